"""The compiled unit search (``unitsearch.py``, ``kernels.py``) against the plain problem:
its arrays score and load a plan exactly as ``evaluate`` does, its moves never make the plan
worse (forest moves under ``no_rise`` never raise the profile), what it returns fits, and
the Lagrangian bound it reports is never above the brute-force optimum."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
from harness.brute import brute_optimum
from harness.limited_problems import random_problem

from autopar.solver import evaluate, kernels
from autopar.solver.heuristic import LocalSearch, _unit_search
from autopar.solver.problem import usage_profile
from autopar.solver.reduce import FORBIDDEN, presolve
from autopar.solver.unitsearch import Elite, Search, UnitProblem


def _reduced(seed: int, n: int):
    red, soft = presolve(random_problem(seed, n))
    return (None, None) if red.infeasible else (red.problem, math.inf if soft else FORBIDDEN)


def _limited_start(problem_seed: int, seed: int) -> tuple[LocalSearch, UnitProblem] | None:
    """A random problem of 80 nodes with a usage limit, its greedy start that fits and its
    units; None where it has no limit or the start does not fit."""
    q, forbid = _reduced(problem_seed, 80)
    if q is None or q.usage_limit is None:
        return None
    ls = LocalSearch(q, seed, forbid)
    ls.greedy()
    if not ls.fits():
        return None
    return ls, UnitProblem(ls.q, ls.forbid)


@pytest.mark.parametrize("seed", range(12))
def test_unit_arrays_score_and_load_like_the_problem(seed: int) -> None:
    q, forbid = _reduced(seed, 40)
    if q is None:
        return
    up = UnitProblem(q, forbid)
    rng = np.random.default_rng(seed)
    a0 = np.zeros(q.num_nodes, dtype=np.int64)
    offsets = set()
    for _ in range(5):
        ch = np.array([rng.integers(up.D.k_off[u + 1] - up.D.k_off[u])
                       for u in range(up.num_units)], dtype=np.int64)
        a = up.expand(ch, a0)
        np.testing.assert_allclose(kernels.profile(up.D, ch, up.base), usage_profile(q, a))
        cost = evaluate(q, a)[0]
        if cost < 1e14:  # no forbidden choice: the unit objective differs by a constant
            offsets.add(round(cost - kernels.total_cost(up.D, ch, up.ucost), 6))
    assert len(offsets) <= 1


@pytest.mark.parametrize("seed", range(12))
def test_forest_moves_never_worse_and_no_rise_keeps_the_profile(seed: int) -> None:
    q, forbid = _reduced(100 + seed, 60)
    if q is None:
        return
    up = UnitProblem(q, forbid)
    rng = np.random.default_rng(seed)
    D = up.D
    ch = np.array([rng.integers(D.k_off[u + 1] - D.k_off[u]) for u in range(up.num_units)],
                  dtype=np.int64)
    pc = up.ucost + rng.random(len(up.ucost))  # priced costs of any kind
    for no_rise in (True, False):
        before_c = kernels.total_cost(D, ch, pc)
        before_load = kernels.profile(D, ch, up.base)
        kernels.forest_dp(D, rng.permutation(up.num_units).astype(np.int64), ch, pc, no_rise)
        assert kernels.total_cost(D, ch, pc) <= before_c + 1e-6 * abs(before_c)
        if no_rise:
            assert (kernels.profile(D, ch, up.base) <= before_load + 1e-9).all()


@pytest.mark.parametrize("seed", range(10))
def test_search_returns_a_plan_that_fits_and_costs_no_more(seed: int) -> None:
    q, forbid = _reduced(200 + seed, 80)
    if q is None:
        return
    ls = LocalSearch(q, seed, forbid)
    ls.greedy()
    if not ls.fits():
        return
    start = ls.cost()
    up = UnitProblem(ls.q, ls.forbid)
    s = Search(up, ls.a, seed)
    s.run(time.monotonic() + 0.2)
    a = s.assignment(ls.a)
    cost, ok, _ = evaluate(ls.q, a)
    assert ok
    assert cost <= start + 1e-6 * abs(start)
    assert s.rounds > 0


@pytest.mark.parametrize("seed", range(40))
def test_reported_bound_is_never_above_the_optimum(seed: int) -> None:
    p = random_problem(300 + seed, 7)
    best, _, _ = brute_optimum(p)
    red, soft = presolve(p)
    if red.infeasible or not math.isfinite(best):
        return
    q = red.problem
    ls = LocalSearch(q, seed, math.inf if soft else FORBIDDEN)
    ls.greedy()
    bound = _unit_search(ls, time.monotonic() + 0.05, seed, 1 + seed % 2, False)
    q_cost = evaluate(q, ls.a)[0]
    if math.isfinite(bound) and q_cost < 1e14:
        # the presolved problem's optimum is the original's less what presolve fixed
        opt_q = best - (evaluate(p, red.expand(ls.a))[0] - q_cost)
        assert bound <= opt_q + 1e-6 * max(1.0, abs(opt_q))


@pytest.mark.parametrize("seed", range(12))
def test_tightening_fits_and_never_costs_more_than_the_greedy_repair(seed: int) -> None:
    q, forbid = _reduced(400 + seed, 80)
    if q is None or q.usage_limit is None:
        return
    up = UnitProblem(q, forbid)
    s = Search(up, np.zeros(q.num_nodes, dtype=np.int64), seed)
    rng = np.random.default_rng(seed)
    D = up.D
    for _ in range(4):
        ch = np.array([rng.integers(D.k_off[u + 1] - D.k_off[u]) for u in range(up.num_units)],
                      dtype=np.int64)
        load = kernels.profile(D, ch, up.base)
        lam = rng.random(len(load)) * rng.choice([0.0, 1.0, 50.0])
        before = ch.copy()
        greedy = s.fit(ch, load)
        got = s.tighten(ch, load, lam, math.inf)
        np.testing.assert_array_equal(ch, before)  # the relaxed plan is left as it was
        if greedy is None:
            continue
        assert got is not None
        cand, cl = got
        np.testing.assert_allclose(cl, kernels.profile(D, cand, up.base))
        assert cl.max() <= s.lim
        g = kernels.total_cost(D, greedy[0], up.ucost)
        assert kernels.total_cost(D, cand, up.ucost) <= g + 1e-9 * abs(g)


def test_unit_min_runs_the_search_past_a_spent_window_but_not_past_its_end() -> None:
    from autopar.solver.heuristic import run_heuristic
    for seed in range(20):
        q, forbid = _reduced(700 + seed, 120)
        if q is None:
            continue
        ls = LocalSearch(q, seed, forbid)
        ls.greedy()
        greedy = ls.cost()
        if not ls.fits() or greedy >= 1e14:
            continue  # a plan with forbidden pairs: left to the tests above
        now = time.monotonic()
        # the window already spent: no unit search, the greedy plan polished by nothing
        a0 = run_heuristic(q, now, seed=seed, forbid=forbid, unit_share=0.75).assignment
        assert evaluate(ls.q, a0)[0] == pytest.approx(greedy)
        now = time.monotonic()
        res = run_heuristic(q, now, seed=seed, forbid=forbid, unit_share=0.75,
                            unit_min=(2.5, now + 2.5))
        took = time.monotonic() - now
        cost, ok, _ = evaluate(ls.q, res.assignment)
        assert ok and cost <= greedy + 1e-6 * abs(greedy)
        assert 2.0 <= took < 2.5 + 5.0  # ran, and stopped near its end
        if cost < greedy - 1e-6 * abs(greedy):
            return  # the search past the window improved the plan
    pytest.fail("the unit search past a spent window never improved a greedy plan")


@pytest.mark.parametrize("seed", range(6))
def test_settling_runs_past_the_deadline_until_the_plan_settles(seed: int) -> None:
    """``run(deadline, settle_until=T)`` with its deadline spent: rounds go on until the
    incumbent has no forbidden pair and has not improved for ``_SETTLE`` rounds (or T);
    without ``settle_until`` a spent deadline runs no round."""
    from autopar.solver.unitsearch import _SETTLE
    got = _limited_start(900 + seed, seed)
    if got is None:
        return
    ls, up = got
    s = Search(up, ls.a, seed)
    s.run(time.monotonic())
    assert s.rounds == 0
    s = Search(up, ls.a, seed)
    now = time.monotonic()
    s.run(now, settle_until=now + 30.0)
    took = time.monotonic() - now
    assert s.rounds >= _SETTLE or took >= 30.0
    if took < 30.0:
        assert s.best_c < 1e15  # settled: no forbidden pair left in the plan
    cost, ok, _ = evaluate(ls.q, s.assignment(ls.a))
    assert ok


def test_elite_keeps_a_copy_of_the_cheapest_plan_offered() -> None:
    e = Elite()
    assert e.cheaper(math.inf) is None
    a = np.array([1, 2, 3])
    e.offer(a, 10.0)
    a[0] = 9  # the searches go on changing their arrays in place
    e.offer(np.array([4, 4, 4]), 12.0)  # dearer: not kept
    got = e.cheaper(11.0)
    assert got is not None and got[1] == 10.0
    np.testing.assert_array_equal(got[0], [1, 2, 3])
    got[0][1] = 7
    np.testing.assert_array_equal(e.cheaper(11.0)[0], [1, 2, 3])
    assert e.cheaper(10.0) is None  # only a strictly cheaper plan is handed out


@pytest.mark.parametrize("seed", range(8))
def test_a_search_takes_the_shared_plan_at_a_kick_and_still_fits(seed: int) -> None:
    """A search whose start is dearer than another's published plan restarts from that plan
    (``share``), and what it returns fits and costs no more than the shared plan."""
    got = _limited_start(1000 + seed, seed)
    if got is None:
        return
    ls, up = got
    elite = Elite()
    first = Search(up, ls.a, seed, elite=elite)
    first.run(time.monotonic() + 0.3)
    assert elite.best_c <= first.best_c  # every better plan was published
    # a second search offered a dearer start than the shared plan
    second = Search(up, ls.a, seed + 1, elite=elite)
    if second.best_c > elite.best_c:
        second.share()
        assert second.adopted == 1 and second.best_c == elite.best_c
    shared = elite.best_c
    second.run(time.monotonic() + 0.3)
    assert second.best_c <= shared + 1e-9 * abs(shared)
    cost, ok, _ = evaluate(ls.q, second.assignment(ls.a))
    assert ok
    assert kernels.profile(up.D, second.best, up.base).max() <= second.lim
