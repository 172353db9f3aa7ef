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
    real = elimination._program  # every elimination of minimise runs a program of its domains

    def spy(dom, *a):
        doms.append(list(dom))
        return real(dom, *a)

    monkeypatch.setattr(elimination, "_program", spy)

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


def _dominates(dom, edges, costs, usages, ecosts, x):
    """Per pair (a, b) of node x's choices, whether a uses no more than b and costs no more
    for every assignment of x's neighbours (enumerated): the rule's definition."""
    inc = [(k, u, v) for k, (u, v) in enumerate(edges) if x in (u, v)]
    others = sorted({y for _, u, v in inc for y in (u, v) if y != x})

    def total(c, ctx):
        t = costs[x][c]
        for k, u, v in inc:
            cu = c if u == x else ctx[others.index(u)]
            cv = c if v == x else ctx[others.index(v)]
            t += ecosts[k][cu, cv]
        return t

    ctxs = list(itertools.product(*(range(dom[y]) for y in others)))
    return {(a, b): usages[x][a] <= usages[x][b] and all(total(a, c) <= total(b, c)
                                                         for c in ctxs)
            for a in range(dom[x]) for b in range(dom[x]) if a != b}


@pytest.mark.parametrize("seed", range(30))
def test_the_compiled_rule_leaves_out_only_dominated_choices(seed):
    """On small integer problems (ties everywhere): every choice left out is dominated by
    another by the definition (all neighbour assignments enumerated), every node keeps a
    choice, and where a node has one edge (the rule's per-edge test is then exact) exactly
    the choices the definition removes in the same order go."""
    from autopar.solver.elimination_kernel import undominated

    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 6))
    dom = [int(rng.integers(1, 5)) for _ in range(n)]
    edges = [(int(rng.integers(n)), int(rng.integers(n))) for _ in range(int(rng.integers(1, 7)))]
    costs = [rng.integers(0, 4, d).astype(float) for d in dom]
    usages = [rng.integers(0, 3, d).astype(float) for d in dom]
    ecosts = [rng.integers(0, 3, (dom[u], dom[v])).astype(float) for u, v in edges]
    got = undominated(dom, edges, costs, usages, ecosts)
    at = 0
    for x, d in enumerate(dom):
        mine = got[at:at + d]
        at += d
        assert mine.any()
        beats = _dominates(dom, edges, costs, usages, ecosts, x)
        for b in range(d):
            if not mine[b]:
                assert any(beats[a, b] for a in range(d) if a != b), (x, b)
        if sum(x in e and e[0] != e[1] for e in edges) == 1:
            alive = [True] * d
            for b in range(d):
                if any(alive[a] and beats[a, b] for a in range(d) if a != b):
                    alive[b] = False
            assert list(mine) == alive
