"""Pipeline execution: stage modules and programs under torch.distributed.pipelining."""
