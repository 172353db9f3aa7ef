"""Execution: lowering a plan to per-rank local graphs and running them on torch.distributed."""
