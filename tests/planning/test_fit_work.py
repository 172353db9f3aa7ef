"""How much search the planner spends where it only starts or repairs another search: the
plan with no limit that seeds the other modes (polished by local moves, not CP-SAT), and the
memory fit's retries (from the plan, the leanest layout and RETRY_RESTARTS random starts)."""

import math

from autopar.ir.mesh import Mesh
from autopar.ir.options import Options
from autopar.models import get_preset
from autopar.planning.planner import make_plan


def _mlp_tiny():
    from autopar.capture.joint import capture

    preset = get_preset("mlp-tiny")
    model, inputs = preset.build("meta"), preset.example_inputs(8, 0)
    return model, inputs, capture(model, inputs)


def test_a_solve_with_no_limit_polishes_by_local_moves_where_asked(monkeypatch):
    """``solve_within_budget(local_polish=True)`` with no budget (the seed plan): an exact
    sweep is polished by the local moves (method "heuristic"); by default, with no budget,
    CP-SAT polishes it ("auto"), as before."""
    from autopar.passes.problem.axis_search import SWEEP
    from autopar.planning import solving
    from autopar.solver.problem import Solution

    _, _, graph = _mlp_tiny()
    from autopar.passes.problem import sharding_problem

    sp = sharding_problem.build(graph, Mesh((2, 2), ("dp", "tp"), "cpu"), None)
    sweep = Solution((0,) * sp.problem.num_nodes, 2.0, True, "feasible", 0.1, SWEEP)
    for polish, want in ((True, "heuristic"), (None, "auto")):
        calls: list[str] = []

        def fake_solve(problem, timeout_s, hint=None, method="auto", _c=calls):
            _c.append(method)
            return Solution(hint, 2.0, True, "feasible", 0.1, method)

        monkeypatch.setattr(solving, "solve_axiswise", lambda *a, **k: sweep)
        monkeypatch.setattr(solving, "solve", fake_solve)
        got = solving.solve_within_budget(sp, None, 10.0, local_polish=polish)
        assert calls == [want] and got.assignment == sweep.assignment


def test_the_seed_plan_with_no_limit_is_planned_seed_only(monkeypatch):
    """Where the first mode's plan does not fit, the plan with no limit is made to seed the
    other modes, and only it is planned ``seed_only`` (no mode whose plan may be chosen is)."""
    from autopar.ir.errors import PlanError
    from autopar.planning import planner

    model, inputs, graph = _mlp_tiny()
    mesh = Mesh((2, 2), ("dp", "tp"), "cpu")
    peak = make_plan(model, mesh, inputs, graph=graph, options=Options.of(
        memory_budget=math.inf, recompute="none")).plan.predicted.cost.mem_bytes
    seen: list[tuple[bool, bool]] = []  # (limit is None, seed_only)
    real = planner._plan_mode

    def first_never_fits(pg, mesh_, mode, lim, *a, seed_only=False, **k):
        run = real(pg, mesh_, mode, lim, *a, seed_only=seed_only, **k)
        seen.append((lim is None, seed_only))
        if lim is not None and not seen[:-1]:
            run.fits, run.choice = False, None  # the first mode's plan: as if none fitted
        return run

    monkeypatch.setattr(planner, "_plan_mode", first_never_fits)
    try:
        make_plan(model, mesh, inputs, graph=graph, options=Options.of(
            memory_budget=0.7 * peak, time_limit_s=20.0, workers=1))
    except PlanError:
        pass  # whether a plan fits is not what is tested
    assert (True, True) in seen  # the seed plan was made, seed_only
    assert all(no_limit == seed_only for no_limit, seed_only in seen)


def test_the_memory_fits_retries_start_from_the_plan_and_few_random_starts(monkeypatch):
    """A memory fit whose first solve overshoots the step: the first solve has its random
    starts (LIMIT_RESTARTS), each retry fewer (RETRY_RESTARTS, besides the plan and the
    leanest layout; none at all lost plans, llama3-tiny at 0.35 of its peak every one), and
    the fit ends on a plan whose whole step fits."""
    from autopar.passes.problem import sharding_problem
    from autopar.passes.problem.step_memory import step_peak
    from autopar.planning import solving

    model, inputs, graph = _mlp_tiny()
    mesh = Mesh((2, 2), ("dp", "tp"), "cpu")
    peak = make_plan(model, mesh, inputs, graph=graph, options=Options.of(
        memory_budget=math.inf, recompute="none")).plan.predicted.cost.mem_bytes
    budget = 0.6 * peak  # the first solve overshoots (reshard copies, gathers)
    sp = sharding_problem.build(graph, mesh, budget)
    calls: list[int] = []
    real = solving.solve_axiswise

    def counting(*a, restarts=16, **k):
        calls.append(restarts)
        return real(*a, restarts=restarts, **k)

    monkeypatch.setattr(solving, "solve_axiswise", counting)
    sol = solving.solve_within_budget(sp, budget, 20.0)
    assert len(calls) > 1  # a retry ran: the case is a real one
    assert calls[0] == solving.LIMIT_RESTARTS
    assert calls[1:] == [solving.RETRY_RESTARTS] * (len(calls) - 1)
    assert 0 < solving.RETRY_RESTARTS < solving.LIMIT_RESTARTS
    assert sol.feasible and step_peak(sp, sp.expand(sol.assignment))[0] <= budget * (1 + 1e-9)
