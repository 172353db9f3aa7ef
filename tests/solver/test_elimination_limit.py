"""minimise under a memory limit: the hull walk over the multiplier returns what the finest
bisection would, the cheapest plan that fits among those any multiplier makes optimal."""

import itertools

import numpy as np
import pytest

from autopar.solver.elimination import greedy_order, minimise


def _problem(seed: int):
    rng = np.random.default_rng(seed)
    n, d = int(rng.integers(3, 7)), int(rng.integers(2, 4))
    edges = [(i, i + 1) for i in range(n - 1)] + [(0, n - 1)]
    ecosts = [rng.random((d, d)) * 3 for _ in edges]
    costs = [rng.random(d) for _ in range(n)]
    usages = [rng.random(d) for _ in range(n)]
    lo = sum(u.min() for u in usages)
    limit = lo + rng.random() * (sum(u.max() for u in usages) - lo)
    return n, d, edges, ecosts, costs, usages, limit


@pytest.mark.parametrize("seed", range(40))
def test_limit_answer_is_the_cheapest_fitting_lagrangian_minimiser(seed):
    n, d, edges, ecosts, costs, usages, limit = _problem(seed)

    def cost(a):
        return sum(c[k] for c, k in zip(costs, a)) + sum(
            m[a[u], a[v]] for (u, v), m in zip(edges, ecosts))

    def usage(a):
        return sum(w[k] for w, k in zip(usages, a))

    a, status = minimise([d] * n, edges, ecosts, costs, usages, limit,
                         greedy_order(edges, [d] * n, 1e7), lambda x: usage(x) <= limit, 10.0)
    assert a is not None and usage(a) <= limit
    everything = list(itertools.product(range(d), repeat=n))
    fitting = [x for x in everything if usage(x) <= limit]
    assert cost(a) >= min(cost(x) for x in fitting) - 1e-9  # never below the true optimum
    if status == "optimal":
        assert cost(a) <= min(cost(x) for x in fitting) + 1e-9
        return
    # the Lagrangian minimisers (brute force, a fine grid of multipliers) that fit: the
    # answer is the cheapest of them
    best = cost(a)
    for lam in np.geomspace(1e-4, 1e4, 400):
        x = min(everything, key=lambda y: cost(y) + lam * usage(y))
        if usage(x) <= limit:
            assert best <= cost(x) + 1e-9, (lam, cost(x), best)
