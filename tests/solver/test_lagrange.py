"""The Lagrangian phase: its bound is a bound, its repair ends feasible, its plans fit."""

from __future__ import annotations

import time

import numpy as np
import pytest

from autopar.solver import evaluate, make_problem
from autopar.solver.groups import Groups
from autopar.solver.heuristic import LocalSearch
from autopar.solver.lagrange import node_prices, repair, search
from autopar.solver.problem import usage_profile


def test_node_prices_sum_the_multipliers_over_live_ranges() -> None:
    lam = np.array([1.0, 2.0, 4.0, 8.0])
    start = np.array([0, 1, 3, 2, 4])
    end = np.array([4, 3, 4, 2, 9])  # an empty range and one past the horizon
    assert node_prices(lam, start, end).tolist() == [15.0, 6.0, 8.0, 0.0, 0.0]


def chain(seed: int, n: int = 400, frac: float = 0.15):
    """A long program-like chain with overlapping lifetimes and a tight limit."""
    rng = np.random.default_rng(seed)
    ks = rng.integers(2, 5, n)
    edges = [(i, i + 1) for i in range(n - 1)] + [
        (int(a), int(b)) for a, b in rng.integers(0, n, (n // 4, 2)) if a != b]
    usages = [rng.integers(1, 30, k).astype(float) for k in ks]
    intervals = [(i, i + int(rng.integers(1, 12))) for i in range(n)]
    lo = np.zeros(n + 12)
    hi = np.zeros(n + 12)
    for (s, e), u in zip(intervals, usages):
        lo[s:e] += u.min()
        hi[s:e] += u.max()
    limit = float(lo.max() + frac * (hi.max() - lo.max()))
    return make_problem([rng.integers(0, 100, k) for k in ks], usages, intervals, edges,
                        [rng.integers(0, 100, ks[u] * ks[v]) for u, v in edges], limit)


@pytest.mark.parametrize("seed", range(3))
def test_repair_makes_any_plan_fit(seed: int) -> None:
    p = chain(seed)
    ls = LocalSearch(p, seed)
    ls.groups = Groups(ls)
    ls.a = np.array([int(np.argmax(u)) for u in p.usages])  # the largest plan: overflows
    ls.load = usage_profile(p, ls.a)
    assert not ls.fits()
    assert repair(ls)
    assert evaluate(p, ls.a)[1]
    np.testing.assert_allclose(ls.load, usage_profile(p, ls.a))


def test_search_keeps_a_feasible_plan_and_improves_on_the_greedy_start() -> None:
    p = chain(7)
    ls = LocalSearch(p, 0)
    ls.greedy()
    ls.groups = Groups(ls)
    start = ls.cost()
    bound = search(ls, time.monotonic() + 3.0)
    cost, ok, _ = evaluate(p, ls.a)
    assert ok and cost <= start
    assert bound <= cost
