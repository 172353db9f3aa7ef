"""time_limit_s bounds the whole planning call (autopar.ir.deadline), and the planner's
progress shows on a terminal or when asked (autopar.report.plan_progress.PlanProgress)."""

import io
import math
import time

from autopar.capture.joint import capture
from autopar.ir.deadline import MIN_SOLVE_S, Deadline
from autopar.ir.mesh import Mesh
from autopar.ir.options import Options
from autopar.models import get_preset
from autopar.planning.planner import make_plan
from autopar.report.plan_progress import PlanProgress, plan_progress

MESH = Mesh((2, 2), ("dp", "tp"), "cpu")


def _mlp():
    preset = get_preset("mlp-tiny")
    model, inputs = preset.build("meta"), preset.example_inputs(8, 0)
    return model, inputs, capture(model, inputs)


def test_deadline_caps_solves_and_records_what_it_cut():
    dl = Deadline(10.0)
    assert dl.cap(2.0) == 2.0 and not dl.was_cut and dl.summary() == ""
    dl.at = time.monotonic() + 0.5  # half a second left
    assert 0.3 < dl.cap(2.0) <= 0.5
    dl.close()
    assert not dl.was_cut  # not past the deadline: nothing was cut
    dl.at = time.monotonic() - 1.0
    assert dl.expired() and dl.cap(2.0) == MIN_SOLVE_S
    dl.close()
    assert dl.cuts == ["a solve stopped at the limit"]
    dl.cut("mode full not tried")
    dl.cut("mode full not tried")  # noted once
    assert dl.cuts.count("mode full not tried") == 1
    assert "10 s time limit cut the search" in dl.summary()


def test_options_carry_one_deadline_through_replace():
    opts = Options.of(time_limit_s=5.0).with_deadline()
    dl = opts.search.deadline
    assert isinstance(dl, Deadline) and dl.limit_s == 5.0
    # a call inside another keeps the outer deadline, whatever per-solve limit it sets
    inner = opts.replace(time_limit_s=1.0).with_deadline()
    assert inner.search.deadline is dl
    assert opts == Options.of(time_limit_s=5.0)  # the deadline is no part of what is asked


def test_tiny_time_limit_returns_a_valid_plan_within_the_limit():
    model, inputs, graph = _mlp()
    free = make_plan(model, MESH, inputs, graph=graph,
                     options=Options.of(memory_budget=math.inf, recompute="none"))
    peak = free.plan.predicted.cost.mem_bytes
    # a binding budget: the memory fit, every recomputing mode, the repricing all want time
    # (about 0.3 s of it on the idle machine, where 0.5 s once cut it: the limit is well
    # under what the whole search takes, so that it cuts at any load)
    limit_s = 0.1
    t0 = time.perf_counter()
    planned = make_plan(model, MESH, inputs, graph=graph,
                        options=Options.of(memory_budget=0.6 * peak, time_limit_s=limit_s))
    wall = time.perf_counter() - t0
    plan = planned.plan
    assert plan.predicted.cost.mem_bytes <= 0.6 * peak * (1 + 1e-9)
    info = plan.provenance.solver
    assert info.time_limit_s == limit_s
    assert "time limit cut the search" in info.limit_cut
    # the limit, plus what one solve started just before it and assembling the plan take
    # (generous: the test machine is shared)
    assert wall < limit_s + 3.0, wall


def test_a_search_run_to_its_end_records_no_cut():
    model, inputs, graph = _mlp()
    plan = make_plan(model, MESH, inputs, graph=graph,
                     options=Options.of(memory_budget=math.inf, time_limit_s=60)).plan
    assert plan.provenance.solver.limit_cut == ""
    assert plan.provenance.solver.time_limit_s == 60


def test_progress_shows_phase_and_best_plan_when_forced():
    model, inputs, graph = _mlp()
    out = io.StringIO()
    progress = plan_progress(30.0, force=True, stream=out)
    assert isinstance(progress, PlanProgress)
    planned = make_plan(model, MESH, inputs, graph=graph,
                        options=Options.of(recompute="none").with_deadline(progress))
    progress.close()
    lines = out.getvalue().splitlines()
    assert any(ln.startswith("planning: planning mode none") for ln in lines), lines
    assert any("best step" in ln for ln in lines), lines
    assert "\r" not in out.getvalue()  # off a terminal: whole lines, no redraws
    assert planned.plan.predicted.cost.step_s > 0


def test_progress_is_off_unless_a_terminal_or_asked_and_only_on_rank_0(monkeypatch):
    out = io.StringIO()  # not a terminal
    assert plan_progress(30.0, stream=out) is None
    monkeypatch.setenv("RANK", "1")
    assert plan_progress(30.0, force=True, stream=out) is None
    monkeypatch.setenv("RANK", "0")
    assert plan_progress(30.0, force=True, stream=out) is not None


def test_progress_waits_for_its_delay():
    out = io.StringIO()
    p = PlanProgress(30.0, stream=out, tty=False, delay_s=60.0)
    p("tracing", None)
    p.close()
    assert out.getvalue() == ""
