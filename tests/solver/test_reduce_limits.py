"""The solver's own exact reductions under memory limits, assignment by assignment.

``test_limits.py`` checks their optima against brute force; here every assignment of the
reduced form is checked against the original: presolve (``reduce.py``) keeps each kept
strategy's cost, usage and live interval, so a reduced plan costs, uses at every instant and
fits exactly as its expansion does; a rigid unit (``contract.py``) costs, for each choice of
its root, what its members and the edges among them cost at the strategies it implies.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from harness.brute import brute_optimum
from harness.limited_problems import random_problem
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autopar.solver import Problem, evaluate, make_problem, reduce
from autopar.solver.contract import contract
from autopar.solver.problem import usage_profile
from autopar.solver.reduce import FORBIDDEN, presolve

BIG = 1e18
SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def limited_problems(draw, max_nodes: int = 5) -> Problem:
    """Overlapping live ranges (some empty), rigid and forbidden edge pairs, and a limit
    between the smallest and the largest peak (now and then below the smallest)."""
    n = draw(st.integers(2, max_nodes))
    k = [draw(st.integers(1, 3)) for _ in range(n)]
    costs = [[draw(st.integers(0, 30)) for _ in range(ki)] for ki in k]
    usages = [[draw(st.integers(0, 9)) for _ in range(ki)] for ki in k]
    intervals = []
    for _ in range(n):
        a = draw(st.integers(0, 4))
        intervals.append((a, a + draw(st.integers(0, 3))))
    edges, mats = [], []
    for _ in range(draw(st.integers(1, 2 * n))):
        u, v = draw(st.integers(0, n - 1)), draw(st.integers(0, n - 1))
        m = np.array([[draw(st.integers(0, 20)) for _ in range(k[v])] for _ in range(k[u])],
                     dtype=float)
        kind = draw(st.integers(0, 3))
        if kind == 0 and k[u] == k[v]:  # rigid: one partner per strategy
            perm = draw(st.permutations(list(range(k[u]))))
            keep = np.zeros(m.shape, dtype=bool)
            keep[np.arange(k[u]), perm] = True
            m[~keep] = BIG
        elif kind == 1:
            m[m > 15] = BIG
        elif kind == 2:  # separable: folded into the node costs
            m = np.add.outer(m[:, 0], m[0, :])
        edges.append((u, v))
        mats.append(m)
    lo, hi = np.zeros(10), np.zeros(10)
    for (a, b), us in zip(intervals, usages):
        lo[a:b] += min(us)
        hi[a:b] += max(us)
    frac = draw(st.sampled_from([None, -0.1, 0.0, 0.3, 0.6, 1.0]))
    limit = None if frac is None else float(np.floor(lo.max() + frac * (hi.max() - lo.max())))
    return make_problem(costs, usages, intervals, edges, mats, limit)


@SETTINGS
@given(limited_problems())
def test_every_presolved_plan_costs_uses_and_fits_as_its_expansion(p: Problem) -> None:
    red, _ = presolve(p)
    q = red.problem
    assert [tuple(iv) for iv in q.intervals] == [tuple(iv) for iv in p.intervals]
    for a in itertools.product(*[range(len(c)) for c in q.costs]):
        full = red.expand(np.array(a))
        cost, ok, peak = evaluate(q, a)
        fcost, fok, fpeak = evaluate(p, full)
        assert cost == fcost or math.isclose(cost, fcost, rel_tol=1e-12)
        assert (usage_profile(q, np.array(a)) == usage_profile(p, full)).all()
        assert (ok, peak) == (fok, fpeak)
    if red.infeasible:  # proven: nothing fits at all
        assert math.isinf(brute_optimum(p)[0])


@SETTINGS
@given(limited_problems())
def test_a_unit_costs_what_its_members_do(p: Problem) -> None:
    """Every choice of every unit's root: the unit's cost plus the edges between units is
    the original cost of the node assignment the choices imply (inf where a choice breaks a
    tie inside the unit); memory is then that assignment's, which the model checks per node."""
    inner = [(u, v, m) for (u, v), m in zip(p.edges, p.edge_costs)]
    units = contract(p.costs, inner, FORBIDDEN)
    ks = [len(c) for c in units.costs]
    for t in itertools.product(*[range(k) for k in ks]):
        a = np.array([units.maps[i][t[units.unit_of[i]]] for i in range(p.num_nodes)])
        got = sum(units.costs[u][t[u]] for u in range(len(ks)))
        got += sum(m[t[x], t[y]] for x, y, m in units.edges)
        want = evaluate(p, a)[0]
        if math.isinf(got):  # a forbidden member choice or pair inside the unit
            assert want >= FORBIDDEN
        else:
            assert math.isclose(got, want, rel_tol=1e-12, abs_tol=1e-9)


@pytest.mark.parametrize("seed", range(30))
def test_dominance_on_changed_nodes_only_reduces_as_a_full_pass(seed: int, monkeypatch) -> None:
    """Dominance re-tests only the nodes whose data changed since their last test
    (``_Work.dirty``); the reduction is the one of testing every node every pass."""
    p = random_problem(seed, 60)
    red, soft = presolve(p)
    full_pass = reduce._Work.dominance

    def every_node(self) -> None:
        self.dirty[:] = True
        full_pass(self)

    monkeypatch.setattr(reduce._Work, "dominance", every_node)
    ref, ref_soft = presolve(p)
    assert (soft, red.infeasible) == (ref_soft, ref.infeasible)
    assert [k.tolist() for k in red.keep] == [k.tolist() for k in ref.keep]
    assert sorted(red.problem.edges) == sorted(ref.problem.edges)


def test_a_neighbour_losing_a_strategy_brings_a_node_back_to_its_dominance_test() -> None:
    """u's rows [0, 5, 2] and [1, 1, 4] dominate neither way until v loses its strategy 1
    (dominated at v by strategy 0), after u's test in the first pass; then u's second
    strategy is dominated, which only a second test of u finds (and then v's first)."""
    m = [[0.0, 5.0, 2.0], [1.0, 1.0, 4.0]]  # not r[su] + c[sv] once v has lost 1: no fold
    p = make_problem([[0.0, 0.0], [10.0, 100.0, 0.0]], [[1.0, 1.0], [1.0, 1.0, 1.0]],
                     [(0, 1), (0, 1)], [(0, 1)], [m], None)
    red, _ = presolve(p)
    assert [k.tolist() for k in red.keep] == [[0], [2]]  # then v: 0 + 10 against 2 + 0


@SETTINGS
@given(limited_problems())
def test_cannot_fit_only_where_no_assignment_fits_and_as_presolve_proves_it(p):
    """The memory bound the planner's solves check first (``problem.cannot_fit``): never
    where some assignment fits (brute force over all of them), always where the smallest
    usages already overflow at some instant, and the same answer as presolve's proof."""
    from autopar.solver.problem import cannot_fit, least_peak_usage

    peaks = [evaluate(p, a)[2] for a in itertools.product(*(range(len(c)) for c in p.costs))]
    assert least_peak_usage(p) <= min(peaks) + 1e-9
    if cannot_fit(p):
        assert not any(evaluate(p, a)[1]
                       for a in itertools.product(*(range(len(c)) for c in p.costs)))
    red, _ = presolve(p)
    assert cannot_fit(p) == (red.infeasible and p.usage_limit is not None)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 40), st.integers(1, 200),
       st.sampled_from([4, 64]))
def test_no_worse_is_every_column_compared(seed: int, k: int, cols: int, block: int) -> None:
    """The dominance pass's comparison (the columns past the first block compared only for
    the pairs still standing) is the comparison of whole rows."""
    from autopar.solver.reduce import _no_worse

    rng = np.random.default_rng(seed)
    f = rng.integers(0, 3, (k, cols)).astype(float)
    f[rng.random((k, cols)) < 0.05] = np.inf
    f[k // 2:] = f[: k - k // 2]  # equal rows too
    want = np.array([[bool((f[b] <= f[a]).all()) for b in range(k)] for a in range(k)])
    assert np.array_equal(_no_worse(f, block), want)
