"""The sharding problem: strategies and edges from the graph, its edge costs, reduction and
boundary pins; what a solution implies: its score, bucket fill, step memory, ZeRO stages."""
