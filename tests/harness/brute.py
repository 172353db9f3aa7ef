"""The reference the solver tests compare with: every assignment tried."""

import itertools
import math

from autopar.solver import Problem, evaluate


def brute_force(p: Problem) -> float:
    """Cost of the cheapest feasible assignment (inf if none fits)."""
    best = math.inf
    for a in itertools.product(*[range(len(c)) for c in p.costs]):
        cost, ok, _ = evaluate(p, a)
        if ok:
            best = min(best, cost)
    return best


def brute_optimum(p: Problem) -> tuple[float, tuple[int, ...] | None, int]:
    """``(cheapest feasible cost, its assignment, number of feasible assignments)`` by trying
    every assignment at once with numpy (inf, None, 0 if none fits): hundreds of tiny
    problems a second, where :func:`brute_force` scores one assignment at a time."""
    import numpy as np

    from autopar.solver.problem import fits

    idx = p.index
    n = p.num_nodes
    grid = np.indices([len(c) for c in p.costs]).reshape(n, -1).T  # [K, n]
    cost = idx.cost_flat[idx.node_off + grid].sum(1)
    if len(idx.edge_u):
        e = idx.edge_off + grid[:, idx.edge_u] * idx.edge_nv + grid[:, idx.edge_v]
        cost = cost + idx.edge_flat[e].sum(1)
    use = idx.usage_flat[idx.node_off + grid]  # [K, n]
    t = np.arange(idx.horizon)
    live = (idx.start[:, None] <= t) & (t < idx.end[:, None])  # [n, T]
    peak = (use @ live).max(1) if idx.horizon else np.zeros(len(grid))
    ok = np.array([fits(float(x), p.usage_limit) for x in peak], dtype=bool)
    if not ok.any():
        return math.inf, None, 0
    k = int(np.argmin(np.where(ok, cost, np.inf)))
    return float(cost[k]), tuple(int(x) for x in grid[k]), int(ok.sum())
