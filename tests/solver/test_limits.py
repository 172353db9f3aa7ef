"""Under memory limits the solver keeps its contract, checked against brute force on hundreds
of tiny random problems shaped like the contest's (overlapping live ranges, a binding limit,
forbidden pairs, rigid "same sharding" edges):

- a solution it calls feasible fits and costs what it says; "optimal" is the brute optimum;
- a lower bound it reports is never above the optimum;
- "infeasible" only when nothing fits, and never a solution when nothing fits;
- the exact reductions (presolve, rigid-group contraction) keep the optimum under the limit.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from harness.brute import brute_optimum

from autopar.solver import Problem, evaluate, make_problem, solve
from autopar.solver.lagrange import EdgeMins, lower_bound, node_prices
from autopar.solver.reduce import FORBIDDEN, presolve

BIG = 1e18  # the contest's "forbidden" cost


def limited_problem(seed: int, max_nodes: int = 6) -> Problem:
    """A small problem whose limit sits between the smallest and the largest possible peak
    (now and then below the smallest: nothing fits)."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, max_nodes + 1))
    ks = rng.integers(1, 4, n)
    intervals = []
    for _ in range(n):
        s = int(rng.integers(0, n))
        intervals.append((s, s + int(rng.integers(0, 4))))
    usages = [rng.integers(0, 12, k).astype(float) for k in ks]
    edges = [(i, i + 1) for i in range(n - 1)]
    edges += [tuple(int(x) for x in rng.integers(0, n, 2)) for _ in range(int(rng.integers(0, n)))]
    ecosts = []
    for u, v in edges:
        m = rng.integers(0, 40, (ks[u], ks[v])).astype(float)
        r = rng.random()
        if r < 0.25 and ks[u] == ks[v]:  # rigid: only a permutation of pairs is allowed
            perm = rng.permutation(ks[u])
            m = np.full_like(m, BIG)
            m[np.arange(ks[u]), perm] = rng.integers(0, 5, ks[u])
        elif r < 0.5:
            m[rng.random(m.shape) < 0.3] = BIG
        ecosts.append(m)
    costs = [rng.integers(0, 60, k).astype(float) for k in ks]
    if rng.random() < 0.2:
        costs[0][0] = BIG
    lo = np.zeros(2 * n + 4)
    hi = np.zeros(2 * n + 4)
    for (s, e), u in zip(intervals, usages):
        lo[s:e] += u.min()
        hi[s:e] += u.max()
    frac = rng.choice([-0.1, 0.0, 0.2, 0.5, 0.8])
    limit = None if rng.random() < 0.1 else float(np.floor(lo.max() + frac * (hi.max() - lo.max())))
    return make_problem(costs, usages, intervals, edges, ecosts, limit)


def check_contract(p: Problem, sol, want: float, exact_expected: bool) -> None:
    if sol.feasible:
        cost, ok, peak = evaluate(p, sol.assignment)
        assert ok, "a solution called feasible overflows the limit"
        assert cost == sol.cost and peak == sol.peak_usage
        assert cost >= want - 1e-9 * max(1.0, abs(want))
    else:
        assert sol.status in ("infeasible", "timeout-no-solution")
    if sol.status == "infeasible":
        assert math.isinf(want), "called infeasible but some assignment fits"
    if math.isinf(want):
        assert not sol.feasible and sol.status in ("infeasible", "timeout-no-solution")
    if sol.lower_bound is not None and not math.isinf(want):
        assert sol.lower_bound <= want + 1e-9 * max(1.0, abs(want)), "bound above the optimum"
    if sol.status == "optimal":
        assert sol.cost == pytest.approx(want, rel=1e-12)
    if exact_expected and want < FORBIDDEN:
        # tiny problems are proven, whatever path the solver takes
        assert sol.feasible and sol.cost == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("method", ["auto", "heuristic"])
@pytest.mark.parametrize("block", range(4))
def test_solve_keeps_its_contract_under_limits(method: str, block: int) -> None:
    for seed in range(block * 50, block * 50 + 50):
        p = limited_problem(seed)
        want, _, _ = brute_optimum(p)
        sol = solve(p, timeout_s=10, method=method, seed=seed)
        check_contract(p, sol, want, exact_expected=True)


@pytest.mark.parametrize("block", range(2))
def test_presolve_keeps_the_optimum_under_limits(block: int) -> None:
    for seed in range(1000 + block * 100, 1000 + block * 100 + 100):
        p = limited_problem(seed)
        want, _, _ = brute_optimum(p)
        red, soft = presolve(p)
        if red.infeasible:
            assert math.isinf(want), f"seed {seed}: presolve called a feasible problem infeasible"
            continue
        got, a, _ = brute_optimum(red.problem)
        if math.isinf(got):
            # a hard presolve may only lose solutions that use forbidden costs
            assert math.isinf(want) or want >= FORBIDDEN, f"seed {seed}"
            continue
        assert got == pytest.approx(want, rel=1e-12) or (soft is False and want >= FORBIDDEN)
        cost, ok, _ = evaluate(p, red.expand(np.array(a)))
        assert ok and cost == pytest.approx(got, rel=1e-12)


def test_the_generator_makes_binding_limits_and_infeasible_cases() -> None:
    """The property tests above are only as good as their problems: many have a limit that
    changes the optimum, and some have no feasible assignment at all."""
    binding = infeasible = 0
    for seed in range(200):
        p = limited_problem(seed)
        want, _, _ = brute_optimum(p)
        free, _, _ = brute_optimum(make_problem(
            p.costs, p.usages, p.intervals, p.edges, p.edge_costs, None))
        infeasible += math.isinf(want)
        binding += (not math.isinf(want)) and want > free
    assert binding >= 40 and infeasible >= 5


def test_the_bound_is_below_the_optimum_for_any_multipliers() -> None:
    rng = np.random.default_rng(0)
    checked = 0
    for seed in range(300):
        p = limited_problem(seed)
        want, _, _ = brute_optimum(p)
        if math.isinf(want) or p.usage_limit is None or p.index.horizon == 0:
            continue
        mins = EdgeMins(p)
        for scale in (0.0, 0.1, 1.0, 10.0):
            lam = scale * rng.random(p.index.horizon)
            pi = node_prices(lam, p.index.start, p.index.end)
            assert lower_bound(p, mins, pi, float(lam.sum())) <= want + 1e-9 * abs(want)
        checked += 1
    assert checked > 150
