"""The CP-SAT model is exact: its optimum equals brute force on random small problems."""

from __future__ import annotations

import itertools
import math

import numpy as np
from harness.brute import brute_force
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autopar.solver import Problem, evaluate, make_problem, solve
from autopar.solver.ilp import memory_rows, solve_ilp
from autopar.solver.reduce import reduce_problem

BIG = 1e18  # the contest's "forbidden" cost


@st.composite
def problems(draw, max_nodes: int = 5, floats: bool = False, forbidden: bool = False) -> Problem:
    n = draw(st.integers(1, max_nodes))
    k = [draw(st.integers(1, 3)) for _ in range(n)]
    if floats:
        num = st.floats(0, 50, allow_nan=False).map(lambda x: round(x, 3))
    else:
        num = st.integers(0, 30)
    costs = [[draw(num) for _ in range(ki)] for ki in k]
    usages = [[draw(st.integers(0, 8)) for _ in range(ki)] for ki in k]
    intervals = []
    for _ in range(n):
        a = draw(st.integers(0, 6))
        intervals.append((a, a + draw(st.integers(0, 4))))
    m = draw(st.integers(0, 2 * n))
    edges, ecosts = [], []
    for _ in range(m):
        u, v = draw(st.integers(0, n - 1)), draw(st.integers(0, n - 1))
        vals = [draw(num) for _ in range(k[u] * k[v])]
        if forbidden:
            vals = [BIG if draw(st.integers(0, 4)) == 0 else x for x in vals]
        edges.append((u, v))
        ecosts.append(vals)
    limit = draw(st.one_of(st.none(), st.integers(0, 24)))
    return make_problem(costs, usages, intervals, edges, ecosts, limit)


SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(problems(max_nodes=6))
def test_ilp_optimum_equals_brute_force(p: Problem) -> None:
    want = brute_force(p)
    sol = solve_ilp(p, timeout_s=20)
    if math.isinf(want):
        assert sol.status == "infeasible" and not sol.feasible and sol.assignment == ()
    else:
        assert sol.status == "optimal"
        assert sol.feasible
        assert sol.cost == want
        assert evaluate(p, sol.assignment)[0] == sol.cost


@settings(max_examples=30, deadline=None)
@given(problems(floats=True))
def test_ilp_fractional_costs_within_rounding(p: Problem) -> None:
    want = brute_force(p)
    sol = solve(p, timeout_s=20, method="auto")
    if math.isinf(want):
        assert sol.status == "infeasible"
    else:
        assert sol.feasible and sol.status == "optimal"
        assert abs(sol.cost - want) <= 1e-6 * max(1.0, want)


def test_memory_limit_with_intervals_past_the_load_profile() -> None:
    """Found by hypothesis in CI: under a memory limit, the local search's memory
    neighbourhood looked for the tightest moment in an empty stretch of the load profile."""
    p = Problem(costs=[np.array([1.0, 1.0, 0.0]), np.array([0.0, 1.0])],
                usages=[np.zeros(3), np.zeros(2)], intervals=[(0, 0), (1, 1)],
                edges=[(0, 1)], edge_costs=[np.array([[0.0, 0.0], [0.0, 0.0], [1.0, 0.0]])],
                usage_limit=0.0)
    sol = solve(p, timeout_s=20, method="auto")
    assert sol.status == "optimal" and sol.cost == brute_force(p)


@settings(max_examples=40, deadline=None)
@given(problems(forbidden=True))
def test_forbidden_costs_are_avoided_when_possible(p: Problem) -> None:
    want = brute_force(p)
    sol = solve(p, timeout_s=20)
    if math.isinf(want):
        assert sol.status == "infeasible"
    elif want < 1e17:
        assert sol.status == "optimal" and sol.cost == want
    else:
        # only plans with a forbidden cost exist: we must still return one
        assert sol.feasible and sol.cost >= want


@settings(max_examples=40, deadline=None)
@given(problems(max_nodes=6))
def test_presolve_keeps_the_optimum(p: Problem) -> None:
    red = reduce_problem(p)
    q = red.problem
    assert q.num_nodes == p.num_nodes
    best_red = math.inf
    for a in itertools.product(*[range(len(c)) for c in q.costs]):
        cr, ok, _ = evaluate(q, a)
        co, ok2, _ = evaluate(p, red.expand(np.array(a)))
        assert abs(cr - co) < 1e-9 and ok == ok2  # same plan, same score
        if ok:
            best_red = min(best_red, cr)
    want = brute_force(p)
    assert best_red == want or (red.infeasible and math.isinf(want))


def test_memory_rows_drop_dominated_segments() -> None:
    # three overlapping nodes; only the moment all three are live needs a row
    p = make_problem(
        costs=[[0, 1]] * 3,
        usages=[[5, 1]] * 3,
        intervals=[(0, 10), (2, 8), (4, 6)],
        edges=[],
        edge_costs=[],
        usage_limit=9,
    )
    free = np.arange(3)
    cap = 9 - 3 * np.ones(10)  # everyone at its smallest usage
    rows = memory_rows(p, free, cap)
    assert len(rows) == 1
    nodes, c = rows[0]
    assert sorted(nodes.tolist()) == [0, 1, 2] and c == 6
    sol = solve_ilp(p, 10)
    # extras of 4 each under capacity 6: only one node can take its big strategy
    assert sol.status == "optimal" and sol.cost == 2


def test_hint_and_timeout_are_honoured() -> None:
    rng = np.random.default_rng(1)
    n = 40
    p = make_problem(
        costs=[rng.integers(0, 100, 4) for _ in range(n)],
        usages=[rng.integers(1, 10, 4) for _ in range(n)],
        intervals=[(i, i + 5) for i in range(n)],
        edges=[(i, i + 1) for i in range(n - 1)],
        edge_costs=[rng.integers(0, 100, 16) for _ in range(n - 1)],
        usage_limit=30,
    )
    hint = solve(p, timeout_s=5, method="heuristic").assignment
    sol = solve(p, timeout_s=5, method="ilp", hint=hint)
    assert sol.feasible and sol.time_s < 6
    assert sol.cost <= evaluate(p, hint)[0]


def test_a_hint_sets_every_variable_pair_variables_included() -> None:
    """CP-SAT gets a complete starting solution: the choices and the pair variables of every
    edge (with the choices alone it may not find one before its time runs out)."""
    from autopar.solver import ilp

    rng = np.random.default_rng(2)
    n = 6
    p = make_problem(
        costs=[rng.integers(0, 100, 3) for _ in range(n)],
        usages=[np.ones(3) for _ in range(n)], intervals=[(i, i + 1) for i in range(n)],
        edges=[(i, i + 1) for i in range(n - 1)],
        edge_costs=[rng.integers(0, 100, 9) for _ in range(n - 1)],
    )
    a = rng.integers(0, 3, n)  # any assignment: every strategy pair is allowed here
    free = np.arange(n)
    sm = ilp.build(p, free, a, None)
    assert len(sm.pairs) == (n - 1) * 9
    st, sub, _ = ilp.solve_sub(sm, 5.0, 1, 0, a, whole=True)
    proto = sm.model.Proto()
    hinted = dict(zip(proto.solution_hint.vars, proto.solution_hint.values))
    bools = [i for i, v in enumerate(proto.variables) if list(v.domain) == [0, 1]]
    assert set(bools) <= set(hinted)
    for y, xa, xb in sm.pairs:  # each pair variable: the AND of its two choices
        assert hinted[y.Index()] == (hinted[xa.Index()] & hinted[xb.Index()])
    assert sum(hinted[y.Index()] for y, _, _ in sm.pairs) == n - 1  # one pair per edge
    assert st == ilp.cp_model.OPTIMAL and sub is not None
    assert evaluate(p, sub)[0] == brute_force(p)


def test_build_stops_at_its_deadline() -> None:
    """A whole contest model takes tens of seconds to build on a loaded machine: past its
    deadline ``build`` raises OutOfTime (``solve`` then keeps its heuristic answer)."""
    import time

    import pytest

    from autopar.solver import ilp

    p = make_problem([[1, 2], [3, 1]], [[1, 2], [2, 1]], [(0, 2), (1, 3)], [(0, 1)],
                     [[0, 5, 5, 0]], usage_limit=3)
    free = np.arange(2)
    base = np.zeros(2, dtype=np.int64)
    cap = ilp.capacity_profile(p, free, base)
    with pytest.raises(ilp.OutOfTime):
        ilp.build(p, free, base, cap, deadline=time.monotonic() - 1.0)
    assert ilp.build(p, free, base, cap, deadline=time.monotonic() + 60.0) is not None
