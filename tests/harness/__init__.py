"""Helpers the tests share: simulated SPMD runs, op-rule checks, brute-force solvers."""
