"""The sharding problem: strategies and edges from the graph, its reduction, boundary pins."""
