"""Contracting rigid groups (nodes tied by permutation edges) keeps the CP-SAT model exact."""

from __future__ import annotations

import itertools
import math

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autopar.solver import Problem, evaluate, ilp, make_problem, solve
from autopar.solver.contract import contract
from autopar.solver.reduce import FORBIDDEN

BIG = 1e18


@st.composite
def tied_problems(draw, max_nodes: int = 6) -> Problem:
    """Random problems where many edges allow exactly one partner per strategy."""
    n = draw(st.integers(2, max_nodes))
    k = [draw(st.integers(1, 3)) for _ in range(n)]
    costs = [[draw(st.integers(0, 30)) for _ in range(ki)] for ki in k]
    usages = [[draw(st.integers(0, 8)) for _ in range(ki)] for ki in k]
    intervals = []
    for _ in range(n):
        a = draw(st.integers(0, 5))
        intervals.append((a, a + draw(st.integers(0, 4))))
    edges, ecosts = [], []
    for _ in range(draw(st.integers(1, 2 * n))):
        u, v = draw(st.integers(0, n - 1)), draw(st.integers(0, n - 1))
        mat = np.array([[draw(st.integers(0, 30)) for _ in range(k[v])] for _ in range(k[u])])
        mat = mat.astype(float)
        if k[u] == k[v] and draw(st.integers(0, 3)) > 0:  # a tie: one partner per strategy
            perm = draw(st.permutations(list(range(k[u]))))
            keep = np.zeros_like(mat, dtype=bool)
            keep[np.arange(k[u]), perm] = True
            mat[~keep] = BIG
        elif draw(st.integers(0, 3)) == 0:
            mat[mat > 25] = BIG
        edges.append((u, v))
        ecosts.append(mat)
    limit = draw(st.one_of(st.none(), st.integers(0, 20)))
    return make_problem(costs, usages, intervals, edges, ecosts, limit)


def brute_force(p: Problem, fixed: dict[int, int] | None = None) -> float:
    """Cheapest feasible plan that avoids every forbidden cost (inf if none)."""
    best = math.inf
    ranges = [[fixed[i]] if fixed and i in fixed else range(len(c)) for i, c in enumerate(p.costs)]
    for a in itertools.product(*ranges):
        cost, ok, _ = evaluate(p, a)
        if ok and cost < FORBIDDEN:
            best = min(best, cost)
    return best


SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _solve_model(p: Problem, free: np.ndarray, base: np.ndarray) -> tuple[float, np.ndarray]:
    cap = ilp.capacity_profile(p, free, base)
    sm = ilp.build(p, free, base, cap)
    st_, sub, _ = ilp.solve_sub(sm, 20.0, 1, 0, base)
    if sub is None:
        assert st_ == ilp.cp_model.INFEASIBLE
        return math.inf, base
    a = base.copy()
    a[free] = sub
    return evaluate(p, a)[0], a


@SETTINGS
@given(tied_problems())
def test_contracted_model_optimum_equals_brute_force(p: Problem) -> None:
    """Whole problem, no presolve: contraction alone must keep the optimum."""
    want = brute_force(p)
    free = np.arange(p.num_nodes)
    got, a = _solve_model(p, free, np.zeros(p.num_nodes, dtype=np.int64))
    if math.isinf(want):
        assert math.isinf(got) or got >= FORBIDDEN
    else:
        assert got == want
        assert evaluate(p, a)[1]


@SETTINGS
@given(tied_problems(), st.data())
def test_contracted_neighbourhood_is_exact(p: Problem, data) -> None:
    """Some nodes fixed (as in LNS): the model re-optimises the others exactly."""
    n = p.num_nodes
    base = np.array([data.draw(st.integers(0, len(c) - 1)) for c in p.costs], dtype=np.int64)
    free = np.array(sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=1))))
    fixed = {i: int(base[i]) for i in range(n) if i not in set(free.tolist())}
    want = brute_force(p, fixed)
    got, _ = _solve_model(p, free, base)
    if math.isinf(want):
        assert math.isinf(got) or got >= FORBIDDEN
    else:
        assert got == want


@settings(max_examples=60, deadline=None)
@given(tied_problems(max_nodes=5))
def test_solve_with_ties_matches_brute_force(p: Problem) -> None:
    want = brute_force(p)
    sol = solve(p, timeout_s=20)
    if not math.isinf(want):
        assert sol.feasible and sol.cost == want and sol.status == "optimal"


def test_chain_of_ties_is_one_unit_and_bad_cycles_drop_choices() -> None:
    f = BIG
    swap = np.array([[f, 1.0], [2.0, f]])
    same = np.array([[0.0, f], [f, 0.0]])
    node_c = [np.array([1.0, 5.0]), np.array([0.0, 0.0]), np.array([3.0, 0.0])]
    units = contract(node_c, [(0, 1, swap), (1, 2, same)], FORBIDDEN)
    assert len(units.roots) == 1 and not units.edges
    r = units.roots[0]
    # root strategy t gives the whole group's choice; check the cost of both choices
    for t in range(2):
        s = [int(units.maps[k][t]) for k in range(3)]
        want = sum(node_c[k][s[k]] for k in range(3)) + swap[s[0], s[1]] + same[s[1], s[2]]
        assert units.costs[0][t] == want
    assert units.maps[r][0] == 0
    # closing the cycle with a tie that disagrees leaves no valid choice: the unit splits
    split = contract(node_c, [(0, 1, swap), (1, 2, same), (2, 0, same)], FORBIDDEN)
    assert len(split.roots) == 3
