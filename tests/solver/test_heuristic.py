"""The heuristic returns feasible plans, never better than the optimum, scored honestly."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from harness.brute import brute_force
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.solver import Problem, evaluate, make_problem, read_problem, solve
from autopar.solver.heuristic import LocalSearch, run_heuristic
from autopar.solver.problem import usage_profile

G = Path(__file__).resolve().parents[3] / "shared" / "bench" / "iopddl" / "G.json.gz"


def random_problem(seed: int, n: int, k: int = 4, limit_frac: float | None = 0.5) -> Problem:
    """A chain-with-shortcuts graph with overlapping lifetimes, like a real program."""
    rng = np.random.default_rng(seed)
    ks = rng.integers(1, k + 1, n)
    edges = [(i, i + 1) for i in range(n - 1)]
    edges += [(int(a), int(b)) for a, b in rng.integers(0, n, (n // 3, 2))]
    usages = [rng.integers(1, 20, ki) for ki in ks]
    intervals = [(i, i + int(rng.integers(1, 8))) for i in range(n)]
    limit = None
    if limit_frac is not None:
        mins = np.zeros(n + 10)
        maxs = np.zeros(n + 10)
        for (s, e), u in zip(intervals, usages):
            mins[s:e] += u.min()
            maxs[s:e] += u.max()
        lo = mins.max()
        limit = float(lo + limit_frac * (maxs.max() - lo))
    return make_problem(
        costs=[rng.integers(0, 100, ki) for ki in ks],
        usages=usages,
        intervals=intervals,
        edges=edges,
        edge_costs=[rng.integers(0, 100, ks[u] * ks[v]) for u, v in edges],
        usage_limit=limit,
    )


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.integers(2, 7), st.sampled_from([None, 0.0, 0.3, 0.8]))
def test_heuristic_is_feasible_and_not_below_optimum(seed: int, n: int, frac) -> None:
    p = random_problem(seed, n, k=3, limit_frac=frac)
    want = brute_force(p)
    sol = solve(p, timeout_s=5, method="heuristic", seed=seed)
    assert sol.feasible and sol.status in ("optimal", "feasible")
    cost, ok, peak = evaluate(p, sol.assignment)
    assert ok and cost == sol.cost and peak == sol.peak_usage
    assert cost >= want
    if sol.status == "optimal":
        assert cost == want


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_keeps_memory_feasible(seed: int) -> None:
    p = random_problem(seed, 300, k=5, limit_frac=0.1)
    ls = LocalSearch(p, seed)
    ls.greedy()
    assert evaluate(p, ls.a)[1]
    assert np.allclose(ls.load, usage_profile(p, ls.a))  # incremental profile is exact
    before = ls.cost()
    ls.sweep()
    assert ls.cost() <= before and evaluate(p, ls.a)[1]


def test_lns_improves_and_respects_the_deadline() -> None:
    p = random_problem(11, 400, k=5, limit_frac=0.3)
    ls = LocalSearch(p, 0)
    ls.greedy()
    greedy_cost = ls.cost()
    t = time.monotonic()
    a = run_heuristic(p, t + 4.0, workers=1).assignment
    assert time.monotonic() - t < 6.0
    cost, ok, _ = evaluate(p, a)
    assert ok and cost < greedy_cost


def test_infeasible_limit_is_reported_not_raised() -> None:
    p = make_problem([[1, 2]] * 2, [[5, 6]] * 2, [(0, 2), (1, 3)], [], [], usage_limit=9)
    sol = solve(p, timeout_s=2)
    assert sol.status == "infeasible" and not sol.feasible and sol.assignment == ()


@pytest.mark.skipif(not G.exists(), reason="contest instance G not present")
def test_contest_instance_g_feasible_in_a_short_timeout() -> None:
    p = read_problem(G)
    sol = solve(p, timeout_s=12)
    cost, ok, _ = evaluate(p, sol.assignment)
    assert sol.feasible and ok and cost == sol.cost
    assert sol.cost < 1e17  # no forbidden (1e18) pair or strategy used
    assert sol.time_s < 16


def test_a_sweep_moves_a_node_off_an_overflowing_choice():
    """Over the limit, a node's own choice is not allowed (scored inf) and a choice that
    frees memory is: the sweep takes it (``inf - inf`` once compared as nan, so the sweep
    never moved a node off an overflowing choice)."""
    p = make_problem(costs=[np.array([5.0, 0.0]), np.array([0.0])],
                     usages=[np.array([1, 2]), np.array([1])], intervals=[(0, 1), (0, 1)],
                     edges=[(0, 1)], edge_costs=[np.zeros((2, 1))], usage_limit=2)
    ls = LocalSearch(p, 0)
    ls.set(0, 1)  # 3 > 2: over the limit
    assert not ls.fits()
    assert ls.sweep() == 1 and ls.a[0] == 0 and ls.fits()


def test_model_vars_counts_choices_and_allowed_pairs_inside() -> None:
    p = random_problem(3, 40, k=4)
    forbid = 90.0  # pairs priced at or above it are left out of the model
    ls = LocalSearch(p, seed=0, forbid=forbid)
    rng = np.random.default_rng(1)
    for _ in range(5):
        free = np.sort(rng.choice(p.num_nodes, 15, replace=False))
        inside = set(free.tolist())
        want = sum(len(p.costs[i]) for i in free)
        want += sum(int((m < forbid).sum()) for (u, v), m in zip(p.edges, p.edge_costs)
                    if u in inside and v in inside)
        assert ls.model_vars(free) == want
        every = sum(len(p.costs[i]) for i in free) + sum(
            m.size for (u, v), m in zip(p.edges, p.edge_costs) if u in inside and v in inside)
        assert ls.model_vars(free, lex=True) == every  # forbidden pairs kept at a weight


def test_lns_step_declines_a_model_it_could_not_build_in_time(monkeypatch) -> None:
    import autopar.solver.heuristic as heuristic

    p = random_problem(5, 60, k=4)
    ls = LocalSearch(p, seed=0)
    ls.greedy()
    before = ls.a.copy()
    # at this rate a 30-node model takes far longer to build than the step's second
    monkeypatch.setattr(heuristic, "_build_s_per_var", 1.0)
    improved, optimal, got = ls.lns_step(30, 1.0, 1, 0)
    assert got < 0 and not improved and not optimal
    assert 1 <= -got < 30  # the size whose model would be built in time (at least one node)
    assert np.array_equal(ls.a, before)  # nothing built, nothing moved
    # a whole search under that rate still returns a feasible plan, without CP-SAT steps
    t = time.monotonic()
    res = run_heuristic(p, t + 3.0, workers=1)
    assert evaluate(p, res.assignment)[1]
    assert time.monotonic() - t < 3.0


def test_lns_step_declines_a_model_cpsat_could_not_start_in_as_much_time(monkeypatch) -> None:
    import autopar.solver.heuristic as heuristic

    p = random_problem(5, 60, k=4)
    ls = LocalSearch(p, seed=0)
    ls.greedy()
    before = ls.a.copy()
    monkeypatch.setattr(heuristic, "_build_s_per_var", 1e-9)  # building is not what limits
    # a step that returned nothing at 0.01 s per variable: a 30-node model offered less than
    # twice that per variable is not built, and the size that would be is returned
    monkeypatch.setattr(heuristic, "_futile_s_per_var", 0.01)
    least = 30 * min(len(c) for c in p.costs)  # variables of any 30-node model, at least
    improved, optimal, got = ls.lns_step(30, 0.019 * least, 1, 0)
    assert got < 0 and not improved and not optimal and 1 <= -got < 30
    assert np.array_equal(ls.a, before)
    # what is learnt: the most generous share that returned nothing, and below what worked
    monkeypatch.setattr(heuristic, "_futile_s_per_var", 0.0)
    heuristic._learn_futile_rate(1.0, 1000, nothing=True)
    heuristic._learn_futile_rate(0.5, 1000, nothing=True)
    assert heuristic._futile_s_per_var == 1e-3
    heuristic._learn_futile_rate(1.0, 2000, nothing=False)  # 5e-4 per variable sufficed
    assert heuristic._futile_s_per_var == 5e-4 / heuristic.FUTILE_MARGIN


def test_a_forked_workers_rates_are_taken_back(monkeypatch) -> None:
    import autopar.solver.heuristic as heuristic

    monkeypatch.setattr(heuristic, "_build_s_per_var", 1e-5)
    monkeypatch.setattr(heuristic, "_futile_s_per_var", 2e-5)
    heuristic.adopt_rates((3e-5, 1e-5))  # the worker's later build rate, the larger futile
    assert heuristic.learned_rates() == (3e-5, 2e-5)
    heuristic.adopt_rates((3e-5, 4e-5))
    assert heuristic.learned_rates() == (3e-5, 4e-5)
