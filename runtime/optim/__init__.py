"""Optimizer-side runtime: fused steps, offloaded state, gradient norms, loss scaling."""
