"""The search: builds the sharding problem from a traced graph, solves it per mode, weighs
references, pipelines and mesh shapes, and returns plans."""
