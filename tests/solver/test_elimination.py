import math

import numpy as np
import pytest
from harness.brute import brute_force
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


def _plain_greedy(edges, dom, max_entries):
    """The greedy order as first written: scan every node, keep the first of least size."""
    n = len(dom)
    nbrs = [set() for _ in range(n)]
    for u, v in edges:
        if u != v:
            nbrs[u].add(v)
            nbrs[v].add(u)
    alive, order = list(range(n)), []
    while alive:
        best = min(alive, key=lambda x: (math.prod(dom[y] for y in nbrs[x]), x))
        if math.prod(dom[y] for y in nbrs[best]) * dom[best] > max_entries:
            return None
        order.append(best)
        alive.remove(best)
        for y in nbrs[best]:
            nbrs[y].discard(best)
            nbrs[y] |= nbrs[best] - {y}
        nbrs[best] = set()
    return order


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.integers(1, 25), st.integers(0, 2**31))
def test_the_heap_order_is_the_plain_greedy_order(n, seed):
    """Elimination order decides how ties are broken, so the faster order must be the same."""
    from autopar.solver.elimination import greedy_order

    rng = np.random.default_rng(seed)
    edges = [(int(rng.integers(n)), int(rng.integers(n))) for _ in range(int(rng.integers(3 * n)))]
    dom = [int(rng.integers(1, 6)) for _ in range(n)]
    for cap in (1e3, 1e6):
        assert greedy_order(edges, dom, cap) == _plain_greedy(edges, dom, cap)


def test_self_loops_and_single_choice_nodes():
    """An edge from a node to itself counts its diagonal; a one-strategy node still counts."""
    rng = np.random.default_rng(5)
    dom = [1, 3, 2, 1, 3]
    edges = [(0, 1), (1, 1), (1, 2), (2, 3), (3, 4), (0, 4), (4, 4)]
    p = Problem([rng.random(d) for d in dom], [np.zeros(d) for d in dom], [(0, 1)] * 5, edges,
                [rng.random((dom[u], dom[v])) for u, v in edges])
    sol = solve_by_elimination(p)
    assert sol is not None and sol.cost == pytest.approx(brute_force(p), rel=1e-12)


def _random_graph(rng, n, dense):
    dom = [int(rng.integers(1, 6)) for _ in range(n)]
    edges = [(int(rng.integers(n)), int(rng.integers(n))) for _ in range(int(dense * n))]
    return dom, edges


def test_scheduled_elimination_equals_the_plain_one_ties_included():
    """The compiled program changes the bookkeeping and the order in which a bucket's
    factors are added (exact on integers): on integer costs (many ties), the same assignment
    as the numpy elimination that works out every bucket on each call, self-edges, repeated
    pairs and domains of one included."""
    from autopar.solver.elimination import _eliminate_plain, eliminate, greedy_order

    rng = np.random.default_rng(1)
    for _ in range(200):
        dom, edges = _random_graph(rng, int(rng.integers(2, 12)), 1.5)
        ec = [rng.integers(0, 3, (dom[u], dom[v])).astype(float) for u, v in edges]
        unary = [rng.integers(0, 3, d).astype(float) for d in dom]
        order = greedy_order(edges, dom, 1e9)
        for _ in range(2):  # the second call runs from the cached schedule
            assert np.array_equal(eliminate(dom, edges, ec, order, unary),
                                  _eliminate_plain(dom, edges, ec, order, unary))


def test_a_program_run_on_flat_tables_gives_what_it_gives_on_the_lists():
    """``Program.run_flat`` (the Lagrangian walk's call: the edge matrices flattened once)
    reads the same numbers as ``run``, so it returns the same assignment, ties included."""
    from autopar.solver.elimination import _flat, _program, greedy_order

    rng = np.random.default_rng(3)
    for _ in range(100):
        dom, edges = _random_graph(rng, int(rng.integers(1, 12)), 1.5)
        ec = [rng.integers(0, 3, (dom[u], dom[v])).astype(float) for u, v in edges]
        unary = [rng.integers(0, 3, d).astype(float) for d in dom]
        prog = _program(dom, edges, greedy_order(edges, dom, 1e9))
        assert np.array_equal(prog.run_flat(_flat(unary), _flat(ec)), prog.run(unary, ec))


def test_cheap_order_is_never_larger_than_greedy_and_declines_wide_problems():
    from autopar.solver.elimination import cheap_order, greedy_order, order_size

    rng = np.random.default_rng(2)
    smaller = 0
    for _ in range(60):
        dom, edges = _random_graph(rng, 30, 2.5)
        g = order_size(edges, dom, greedy_order(edges, dom, math.inf))
        order = cheap_order(edges, dom, math.inf)
        assert sorted(order) == list(range(30))
        c = order_size(edges, dom, order)
        assert c[0] <= g[0]
        smaller += c[0] < g[0]
        assert cheap_order(edges, dom, c[1] - 1) is None
    assert smaller > 0  # min-fill does win somewhere on such graphs


@given(problems())
@settings(max_examples=60, deadline=None)
def test_elimination_in_the_cheap_order_is_optimal(p):
    from autopar.solver.elimination import cheap_order, eliminate

    order = cheap_order(p.edges, [len(c) for c in p.costs], math.inf)
    a = eliminate([len(c) for c in p.costs], p.edges, p.edge_costs, order, p.costs)
    assert evaluate(p, a)[0] == pytest.approx(brute_force(p))
