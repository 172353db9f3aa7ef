import time

import numpy as np
import pytest

from autopar.capture.joint import capture
from autopar.ir.mesh import Mesh
from autopar.models import get_preset
from autopar.passes.problem import sharding_problem
from autopar.passes.problem.axis_search import solve_axiswise
from autopar.solver import Problem, evaluate
from autopar.solver.elimination import solve_by_elimination


def _sp(mesh, name="gpt2-tiny"):
    preset = get_preset(name)
    return sharding_problem.build(capture(preset.build("meta"), preset.example_inputs(4, 32)), mesh)


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama3-tiny"])
def test_on_a_1d_mesh_the_sweep_is_the_global_optimum(name):
    sp = _sp(Mesh((4,), ("tp",)), name)
    sol = solve_axiswise(sp, sp.problem, timeout_s=30)
    exact = solve_by_elimination(sp.problem, max_entries=5e7)
    assert sol.status == "optimal"
    assert exact is not None and sol.cost == pytest.approx(exact.cost, rel=1e-12)


def test_on_a_2d_mesh_it_improves_on_every_start():
    sp = _sp(Mesh((2, 2), ("dp", "tp")))
    p = sp.problem
    rng = np.random.default_rng(3)
    hint = [int(rng.integers(len(c))) for c in p.costs]
    sol = solve_axiswise(sp, p, timeout_s=30, hints=[hint], restarts=0)
    assert sol.feasible
    assert sol.cost <= evaluate(p, hint)[0]
    assert sol.cost <= evaluate(p, [0] * p.num_nodes)[0]
    assert evaluate(p, sol.assignment)[0] == pytest.approx(sol.cost)


@pytest.mark.parametrize("limit", [None, "tight"])
def test_each_step_is_the_exact_optimum_over_one_axis_and_solved_once(limit):
    """A step from a point equals eliminating the problem restricted to the strategies that
    agree with the point on every other axis (the step's definition); asking again, or from
    another point of the same classes, is answered from memory with the same answer."""
    from autopar.passes.problem.axis_search import _axis_components, _Steps
    from autopar.planning.solving import with_limit

    sp = _sp(Mesh((2, 2), ("dp", "tp")))
    p = sp.problem
    if limit == "tight":  # between the leanest and the all-replicated peak: memory binds
        lean = evaluate(p, [int(np.argmin(u)) for u in p.usages])[2]
        p = with_limit(p, lean + 0.3 * (evaluate(p, [0] * p.num_nodes)[2] - lean))
    comps = _axis_components(sp)
    steps = _Steps(p, comps)
    rng = np.random.default_rng(0)
    solved = 0
    for _ in range(6):
        cur = np.array([int(rng.integers(len(c))) for c in p.costs])
        for k in range(2):
            allowed = [np.nonzero((np.delete(c, k, 1) == np.delete(c, k, 1)[s]).all(1))[0]
                       for c, s in zip(comps, cur)]
            sub = Problem([c[a] for c, a in zip(p.costs, allowed)],
                          [u[a] for u, a in zip(p.usages, allowed)], p.intervals, p.edges,
                          [m[np.ix_(allowed[u], allowed[v])]
                           for (u, v), m in zip(p.edges, p.edge_costs)], p.usage_limit)
            want = solve_by_elimination(sub)
            got, exact = steps.step(k, cur, deadline=time.monotonic() + 30)
            if want is None or not want.feasible:
                assert got is None
                continue
            solved += 1
            assert exact == (want.status == "optimal")
            # the same plan, or where two tie on cost (a limit's multiplier walk may break
            # ties another way) one as cheap, as feasible, and inside the step's strategies
            cost, fits, _ = evaluate(p, got.tolist())
            assert fits and cost == pytest.approx(want.cost, rel=1e-12)
            assert all(g in a for g, a in zip(got.tolist(), allowed))
            before = len(steps.memo)
            again, _ = steps.step(k, cur, deadline=time.monotonic() + 30)
            assert len(steps.memo) == before and again.tolist() == got.tolist()
    assert solved


def test_a_problem_solved_again_at_another_limit_gives_what_a_fresh_solve_does(monkeypatch):
    """The steps' Lagrangian minimisers kept across solves of one problem (a memory fit's
    retries: the same costs, another limit) change no answer, only the time."""
    from autopar.passes.problem import axis_search
    from autopar.planning.solving import with_limit

    sp = _sp(Mesh((2, 2), ("dp", "tp")))
    p = sp.problem
    lean = evaluate(p, [int(np.argmin(u)) for u in p.usages])[2]
    top = evaluate(p, [0] * p.num_nodes)[2]
    limits = [lean + f * (top - lean) for f in (0.5, 0.3, 0.2)]
    from autopar.solver import elimination_kernel

    calls = [0]
    real = elimination_kernel._run  # every elimination's compiled call

    def counting(*a, **k):
        calls[0] += 1
        return real(*a, **k)

    monkeypatch.setattr(elimination_kernel, "_run", counting)
    axis_search._HULLS.clear()
    kept = [solve_axiswise(sp, with_limit(p, lim), 60, restarts=2) for lim in limits]
    kept_calls, calls[0] = calls[0], 0
    for lim, got in zip(limits, kept):
        axis_search._HULLS.clear()
        fresh = solve_axiswise(sp, with_limit(p, lim), 60, restarts=2)
        assert got.assignment == fresh.assignment and got.cost == fresh.cost
        assert got.feasible and evaluate(p, got.assignment)[2] <= lim * (1 + 1e-9)
    assert kept_calls < calls[0]  # the later limits' solves reused the first's eliminations


def test_kept_axis_classes_and_programs_change_no_answer():
    """The components and classes kept per strategy list, and the elimination programs and
    table sizes kept per graph, give the same solves as made afresh; the kept arrays are
    read-only."""
    from autopar.passes.problem import axis_search
    from autopar.solver import elimination

    sp = _sp(Mesh((2, 2), ("dp", "tp")))
    p = sp.problem
    warm = solve_axiswise(sp, p, 60, restarts=3)
    again = solve_axiswise(sp, p, 60, restarts=3)
    comps = axis_search._axis_components(sp)
    assert all(not c.flags.writeable for c in comps)
    for cache in (axis_search._COMPONENTS, axis_search._CLASSES, axis_search._HULLS,
                  elimination._PROGRAMS, elimination._SIZES, elimination._ORDERS):
        cache.clear()
    cold = solve_axiswise(sp, p, 60, restarts=3)
    fresh = axis_search._axis_components(sp)
    assert [c.tolist() for c in comps] == [c.tolist() for c in fresh]
    for got in (warm, again):
        assert got.assignment == cold.assignment and got.cost == cold.cost


def test_a_step_no_point_of_which_fits_is_answered_without_eliminating(monkeypatch):
    """Where every node at its leanest choice of an axis step already overflows the limit
    (every node live at the one instant), the step finds nothing, and says so before any
    order, program or table is made for it; the other steps are solved as before."""
    import itertools

    from autopar.passes.problem import axis_search
    from autopar.passes.problem.axis_search import _Steps

    rng = np.random.default_rng(3)
    n, d = 4, 3  # 3 rules on each of 2 axes: 9 strategies a node
    comp = np.array(list(itertools.product(range(d), range(d))))
    comp.setflags(write=False)
    edges = [(i, i + 1) for i in range(n - 1)]
    costs = [rng.random(d * d) for _ in range(n)]
    usages = [rng.random(d * d) for _ in range(n)]
    ecosts = [rng.random((d * d, d * d)) for _ in edges]
    calls = []
    real = axis_search.minimise
    monkeypatch.setattr(axis_search, "minimise", lambda *a, **k: calls.append(1) or real(*a, **k))
    lean = sum(float(u.min()) for u in usages)
    answered = solved = 0
    for limit in (lean * 1.05, lean * 1.3):
        p = Problem(costs, usages, [(0, 1)] * n, edges, ecosts, limit)
        for k in range(2):
            for cls in itertools.product(range(d), repeat=n):
                calls.clear()
                steps = _Steps(p, [comp] * n)
                cur = np.array([int(np.nonzero(steps.codes[k][v] == c)[0][0])
                                for v, c in enumerate(cls)])
                got, _ = steps.step(k, cur, time.monotonic() + 10)
                allowed = [steps.groups[k][v][c] for v, c in enumerate(cls)]
                fitting = [x for x in itertools.product(*allowed)
                           if evaluate(p, list(x))[1]]
                if not fitting:
                    assert got is None
                    if sum(float(u[a].min()) for u, a in zip(usages, allowed)) > limit * 1.001:
                        assert not calls  # answered before any elimination
                        answered += 1
                else:
                    assert got is not None and evaluate(p, got)[1]
                    solved += 1
    assert answered and solved  # both kinds of step met
