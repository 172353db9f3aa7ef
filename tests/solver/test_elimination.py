import math

import numpy as np
from brute import brute_force
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.solver import Problem, evaluate
from autopar.solver.elimination import solve_by_elimination


@st.composite
def problems(draw, with_limit=False):
    n = draw(st.integers(1, 6))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    dom = [int(rng.integers(1, 4)) for _ in range(n)]
    pairs = [(u, v) for u in range(n) for v in range(u + 1, n)]
    edges = [p for p in pairs if rng.random() < 0.5]
    usages = [rng.integers(0, 10, d).astype(float) for d in dom]
    limit = float(rng.integers(0, 30)) if with_limit else None
    return Problem(
        costs=[rng.random(d) for d in dom],
        usages=usages,
        intervals=[(0, 1)] * n,
        edges=edges,
        edge_costs=[rng.random((dom[u], dom[v])) for u, v in edges],
        usage_limit=limit,
    )


@settings(max_examples=80, deadline=None, derandomize=True)
@given(problems())
def test_elimination_is_exact_without_a_limit(p):
    sol = solve_by_elimination(p)
    assert sol is not None and sol.status == "optimal"
    assert sol.cost == brute_force(p) or abs(sol.cost - brute_force(p)) < 1e-9
    assert evaluate(p, sol.assignment)[0] == sol.cost


@settings(max_examples=80, deadline=None, derandomize=True)
@given(problems(with_limit=True))
def test_under_a_limit_it_fits_or_says_infeasible(p):
    sol = solve_by_elimination(p)
    best = brute_force(p)
    if best == math.inf:
        assert sol is None or not sol.feasible
        return
    if sol is not None and sol.feasible:
        cost, ok, _ = evaluate(p, sol.assignment)
        assert ok and cost >= best - 1e-9


def test_declines_problems_too_wide_to_eliminate():
    n, d = 8, 30
    edges = [(u, v) for u in range(n) for v in range(u + 1, n)]  # a clique: width n - 1
    p = Problem([np.zeros(d)] * n, [np.zeros(d)] * n, [(0, 1)] * n, edges,
                [np.zeros((d, d))] * len(edges))
    assert solve_by_elimination(p, max_entries=1e6) is None
