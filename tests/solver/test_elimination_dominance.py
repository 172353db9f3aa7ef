"""Dominated choices left out of the elimination (``elimination._without_dominated``): the
minimum is the same as with every choice, at every multiplier and under a memory limit, and
the tables the elimination builds do shrink."""

import itertools

import numpy as np
import pytest

from autopar.solver import elimination
from autopar.solver.elimination import greedy_order, minimise


def _problem(seed: int):
    """A cycle of nodes whose every choice has a copy that costs and uses more (dominated),
    and one that costs less but uses more (not dominated: it can win without a limit)."""
    rng = np.random.default_rng(seed)
    n, d = int(rng.integers(3, 6)), int(rng.integers(1, 3))
    edges = [(i, i + 1) for i in range(n - 1)] + [(0, n - 1), (1, 1)]
    base_e = [rng.integers(0, 4, (d, d)).astype(float) for _ in edges]
    costs, usages = [], []
    for _ in range(n):
        c, u = rng.integers(0, 4, d).astype(float), rng.integers(0, 4, d).astype(float)
        costs.append(np.concatenate([c, c + 5 + rng.integers(0, 3, d), c - 1]))
        usages.append(np.concatenate([u, u + rng.integers(0, 2, d), u + 2]))
    # each copy repeats its original's edge rows: the dominated copy pays more on its own only
    ecosts = [np.tile(m, (3, 3)) for m in base_e]
    lo = sum(u.min() for u in usages)
    limit = lo + rng.random() * (sum(u.max() for u in usages) - lo)
    return 3 * d, n, edges, ecosts, costs, usages, limit


@pytest.mark.parametrize("seed", range(25))
def test_leaving_dominated_choices_out_keeps_the_minimum(seed, monkeypatch):
    monkeypatch.setattr(elimination, "_PRUNE_FROM", 0)
    monkeypatch.setattr(elimination, "_PRUNE_GAIN", 1.0)
    d, n, edges, ecosts, costs, usages, limit = _problem(seed)
    doms = []
    real = elimination.eliminate

    def spy(dom, *a):
        doms.append(list(dom))
        return real(dom, *a)

    monkeypatch.setattr(elimination, "eliminate", spy)

    every = np.array(list(itertools.product(range(d), repeat=n)))
    all_cost = sum(c[every[:, i]] for i, c in enumerate(costs)) + sum(
        m[every[:, u], every[:, v]] for (u, v), m in zip(edges, ecosts))
    all_use = sum(w[every[:, i]] for i, w in enumerate(usages))

    def cost(a):
        return sum(c[k] for c, k in zip(costs, a)) + sum(
            m[a[u], a[v]] for (u, v), m in zip(edges, ecosts))

    def usage(a):
        return sum(w[k] for w, k in zip(usages, a))

    order = greedy_order(edges, [d] * n, 1e7)
    free, status = minimise([d] * n, edges, ecosts, costs, usages, None, order,
                            lambda x: True, 10.0)
    assert status == "optimal"
    assert cost(free) == pytest.approx(all_cost.min(), abs=1e-9)
    assert doms and all(sum(k) < d * n for k in doms)  # the dominated copies were left out

    a, status = minimise([d] * n, edges, ecosts, costs, usages, limit, order,
                         lambda x: usage(x) <= limit, 10.0)
    assert a is not None and usage(a) <= limit
    fits = all_use <= limit
    assert cost(a) >= all_cost[fits].min() - 1e-9
    # the cheapest fitting Lagrangian minimiser, as with every choice kept
    for lam in np.geomspace(1e-3, 1e3, 200):
        x = int(np.argmin(all_cost + lam * all_use))
        if fits[x]:
            assert cost(a) <= all_cost[x] + 1e-9, (lam, all_cost[x], cost(a))
