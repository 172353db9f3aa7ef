"""Exact region moves (``regions.py``): never worse, never over the limit, and a region of
every unit reaches the brute-force optimum when that optimum fits."""

from __future__ import annotations

import math

import numpy as np
import pytest
from harness.brute import brute_optimum
from harness.limited_problems import random_problem

from autopar.solver import evaluate, kernels, regions
from autopar.solver.problem import _USAGE_RTOL
from autopar.solver.reduce import FORBIDDEN, presolve
from autopar.solver.unitsearch import UnitProblem


def _units(p):
    red, soft = presolve(p)
    if red.infeasible:
        return None, None
    return red, UnitProblem(red.problem, math.inf if soft else FORBIDDEN)


def _lim(p) -> float:
    return p.usage_limit + _USAGE_RTOL * max(1.0, abs(p.usage_limit))


@pytest.mark.parametrize("seed", range(30))
def test_a_region_of_every_unit_reaches_the_optimum(seed: int) -> None:
    p = random_problem(500 + seed, 7)
    best, _, _ = brute_optimum(p)
    red, up = _units(p)
    if up is None or up.num_units == 0 or not math.isfinite(best) or best >= 1e14:
        return
    q = red.problem
    lim = _lim(q)
    rng = np.random.default_rng(seed)
    D = up.D
    for _ in range(3):
        # from the plan with every unit at its smallest usage (fits whenever anything does)
        ch = np.array([int(np.argmin([sum(D.m_use[D.m_uoff[m] + k]
                                          for m in range(D.m_ptr[u], D.m_ptr[u + 1]))
                                      for k in range(D.k_off[u + 1] - D.k_off[u])]))
                       for u in range(up.num_units)], dtype=np.int64)
        if kernels.profile(D, ch, up.base).max() > lim:
            return
        a0 = np.zeros(q.num_nodes, dtype=np.int64)
        before = kernels.total_cost(D, ch, up.ucost)
        ok, saved = regions.region_move(D, rng.permutation(up.num_units).tolist(), ch,
                                        up.ucost, up.base, lim)
        assert ok
        after = kernels.total_cost(D, ch, up.ucost)
        assert after == pytest.approx(before - saved, rel=1e-9, abs=1e-6)
        assert kernels.profile(D, ch, up.base).max() <= lim
        cost, feasible, _ = evaluate(p, red.expand(up.expand(ch, a0)))
        assert feasible
        assert cost >= best - 1e-6 * max(1.0, abs(best))
        # the unconstrained optimum of the units, where it fits, is the optimum
        free = np.zeros(up.num_units, dtype=np.int64)
        regions.region_move(D, list(range(up.num_units)), free, up.ucost, up.base, math.inf)
        if kernels.profile(D, free, up.base).max() <= lim:
            assert cost == pytest.approx(best, rel=1e-9, abs=1e-6)


@pytest.mark.parametrize("seed", range(10))
def test_region_search_never_worsens_nor_overflows(seed: int) -> None:
    p = random_problem(600 + seed, 80)
    red, up = _units(p)
    if up is None or up.num_units == 0:
        return
    lim = _lim(red.problem)
    D = up.D
    ch = np.zeros(up.num_units, dtype=np.int64)
    from autopar.solver.heuristic import LocalSearch
    ls = LocalSearch(red.problem, seed, FORBIDDEN)
    ls.greedy()
    if not ls.fits():
        return
    ch = up.choice(ls.a)
    if kernels.profile(D, ch, up.base).max() > lim:
        return
    rng = np.random.default_rng(seed)
    before = kernels.total_cost(D, ch, up.ucost)
    for size in (2, 5, 20):
        for _ in range(10):
            c0 = kernels.total_cost(D, ch, up.ucost)
            units = regions.grow(D, int(rng.integers(up.num_units)), size, rng)
            assert len(set(units)) == len(units) <= size
            regions.region_move(D, units, ch, up.ucost, up.base, lim)
            assert kernels.total_cost(D, ch, up.ucost) <= c0 + 1e-9 * abs(c0)
            assert kernels.profile(D, ch, up.base).max() <= lim
    assert kernels.total_cost(D, ch, up.ucost) <= before + 1e-9 * abs(before)


@pytest.mark.parametrize("seed", range(6))
def test_region_search_stops_once_every_component_is_settled(seed: int) -> None:
    """On a problem whose components each fit in one region, the search ends long before
    its deadline: the same exact solves would only repeat (it used to spin to the end)."""
    import time

    p = random_problem(800 + seed, 9)
    red, up = _units(p)
    if up is None or len(up.D[9]) == 0:
        return
    from autopar.solver.heuristic import LocalSearch
    ls = LocalSearch(red.problem, seed, FORBIDDEN)
    ls.greedy()
    ch = up.choice(ls.a)
    lim = _lim(red.problem)
    if kernels.profile(up.D, ch, up.base).max() > lim:
        return
    before = kernels.total_cost(up.D, ch, up.ucost)
    t = time.monotonic()
    saved = regions.region_search(up.D, ch, up.ucost, up.base, lim, t + 30.0,
                                  np.random.default_rng(seed))
    assert time.monotonic() - t < 5.0
    assert kernels.total_cost(up.D, ch, up.ucost) == pytest.approx(before - saved, abs=1e-6)
    assert kernels.profile(up.D, ch, up.base).max() <= lim
