"""Random limited problems for the solver's tests: chains with extra edges, rigid
(permutation) edges, forbidden pairs and a memory limit that binds."""

from __future__ import annotations

import numpy as np

from autopar.solver import make_problem

BIG = 1e18  # a forbidden pair's cost


def random_problem(seed: int, n: int):
    """Chains with extra edges, rigid (permutation) edges, forbidden pairs and a limit
    between the smallest and the largest possible peak."""
    rng = np.random.default_rng(seed)
    ks = rng.integers(1, 5, n)
    intervals = [(s := int(rng.integers(0, n)), s + int(rng.integers(0, 5))) for _ in range(n)]
    usages = [rng.integers(0, 12, k).astype(float) for k in ks]
    edges = [(i, i + 1) for i in range(n - 1)]
    edges += [tuple(int(x) for x in rng.integers(0, n, 2)) for _ in range(n // 2)]
    ecosts = []
    for u, v in edges:
        m = rng.integers(0, 40, (ks[u], ks[v])).astype(float)
        if rng.random() < 0.3 and ks[u] == ks[v]:
            m = np.full_like(m, BIG)
            m[np.arange(ks[u]), rng.permutation(ks[u])] = rng.integers(0, 5, ks[u])
        elif rng.random() < 0.2:
            m[rng.random(m.shape) < 0.3] = BIG
        ecosts.append(m)
    costs = [rng.integers(0, 60, k).astype(float) for k in ks]
    lo, hi = np.zeros(2 * n + 6), np.zeros(2 * n + 6)
    for (s, e), u in zip(intervals, usages):
        lo[s:e] += u.min()
        hi[s:e] += u.max()
    limit = float(np.floor(lo.max() + rng.uniform(0.1, 0.6) * (hi.max() - lo.max())))
    return make_problem(costs, usages, intervals, edges, ecosts, limit)
