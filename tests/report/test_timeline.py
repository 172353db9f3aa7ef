"""The picture of a step: the predicted trace (autopar.report.timeline), ``autopar plan --timeline``,
and the measured one (``autopar train --profile``) with the same event names."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

import pytest

import autopar
from autopar.cli.main import main
from autopar.ir.options import Options
from autopar.models import get_preset
from autopar.passes.pipeline import schedule as ps
from autopar.planning.planner import make_plan
from autopar.report.timeline import (
    IDLE,
    TraceEvent,
    pipeline_trace_events,
    planned_from_plan,
    predicted_timeline,
    trace_json,
    write_trace,
)

CASES = {  # name -> (preset, mesh shape, axes, device, recompute, traced layers)
    "cpu": ("gpt2-tiny", (2,), ("dp",), "cpu", "none", None),
    "cpu-2d": ("gpt2-tiny", (2, 2), ("dp", "tp"), "cpu", "none", None),
    "h100": ("gpt2-tiny", (2,), ("dp",), "h100", "none", None),
    "full": ("gpt2-tiny", (2,), ("dp",), "cpu", "full", None),
    # a depth proxy: 4 of gpt2-small's 12 layers traced, the middle two standing for 5 each
    "proxy": ("gpt2-small", (2, 2), ("dp", "tp"), "h100", "full", 4),
}


@pytest.fixture(scope="module")
def planned():
    cache = {}

    def get(name):
        if name not in cache:
            preset, shape, axes, device, recompute, layers = CASES[name]
            p = get_preset(preset)
            cache[name] = make_plan(p.build("meta"), autopar.Mesh(shape, axes, device),
                                    p.example_inputs(4, 32, "meta"),
                                    options=Options.of(time_limit_s=1.0, recompute=recompute,
                                                       max_layers=layers))
        return cache[name]

    return get


def _lanes(events):
    by: dict = {}
    for e in events:
        by.setdefault((e["pid"], e["tid"]), []).append(e)
    return by


def _collective_counts(events) -> Counter:
    return Counter((e.args["kind"], e.args["axis"], e.args["reason"])
                   for e in events if e.cat == "collective")


def _plan_counts(plan) -> Counter:
    return Counter({(c.kind, c.axis, c.reason): c.count for c in plan.predicted.collectives})


@pytest.mark.parametrize("case", ["cpu", "h100"])
def test_trace_is_chrome_json_with_ranks_and_lanes(planned, tmp_path, case):
    tl = predicted_timeline(planned(case), ops=True)
    path = tmp_path / "t.json"
    tl.write(path)
    doc = json.loads(path.read_text())
    evs = doc["traceEvents"]
    meta = [e for e in evs if e["ph"] == "M"]
    assert {e["args"]["name"] for e in meta if e["name"] == "process_name"} == \
        {"rank 0", "rank 1"}
    assert {e["args"]["name"] for e in meta if e["name"] == "thread_name"} == \
        {"compute", "comm", "ops"}
    xs = [e for e in evs if e["ph"] == "X"]
    assert xs and all({"name", "cat", "ts", "dur", "pid", "tid", "args"} <= set(e) for e in xs)
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in xs)
    assert doc["otherData"]["plan_step_s"] == planned(case).plan.predicted.cost.step_s
    # SPMD: both ranks draw the same program
    strip = [[(e["name"], e["ts"], e["dur"], e["tid"]) for e in xs if e["pid"] == r]
             for r in (0, 1)]
    assert strip[0] == strip[1]
    # within a lane, events follow one another (microseconds, rounded to 1e-4)
    for lane in _lanes(xs).values():
        lane.sort(key=lambda e: e["ts"])
        for a, b in zip(lane, lane[1:]):
            assert b["ts"] >= a["ts"] + a["dur"] - 1e-3, (a, b)
    # the ops lane adds up to the compute lane's busy time
    ops = sum(e.dur_s for e in tl.rank_events(0) if e.lane == "ops")
    busy = sum(e.dur_s for e in tl.rank_events(0) if e.lane == "compute" and e.cat != IDLE)
    assert ops == pytest.approx(busy, rel=1e-9)


@pytest.mark.parametrize("case", ["cpu", "cpu-2d", "full", "proxy", "h100"])
def test_total_matches_the_plans_cost_and_collectives_its_counts(planned, case):
    p = planned(case)
    tl = predicted_timeline(p)
    step = p.plan.predicted.cost.step_s
    if p.problem.mesh.device.comm_overlaps_compute:
        # the picture hides gradient syncs behind the backward: span + hidden is the plan's
        # compute and communication summed (its step credits overlap by its own rules,
        # passes/cost/overlap.py, gathers prefetched too)
        c = p.plan.predicted.cost
        summed = c.compute_s + c.comm_s
        assert c.step_s <= summed * (1 + 1e-9)
        assert tl.step_s <= summed * (1 + 1e-9)
        assert tl.step_s + tl.hidden_s == pytest.approx(summed, rel=1e-6)
    else:  # gloo on the compute cores: everything serialises, the span is the price
        assert tl.hidden_s == 0.0
        assert tl.step_s == pytest.approx(step, rel=1e-6)
    rank0 = tl.rank_events(0)
    assert _collective_counts(rank0) == _plan_counts(p.plan)
    busy = sum(e.dur_s for e in rank0 if e.cat == "collective")
    assert busy == pytest.approx(p.plan.predicted.cost.comm_s, rel=1e-6, abs=1e-12)


def test_every_layer_has_its_forward_and_backward(planned):
    names = {e.name for e in predicted_timeline(planned("cpu")).rank_events(0)}
    for layer in range(2):
        assert {f"forward layer {layer}", f"backward layer {layer}"} <= names
    assert "all_reduce[dp] gradient sync" in names and "all_reduce[dp] loss" in names
    assert not any(n.startswith("recompute") for n in names)


def test_recomputed_layers_are_drawn_in_the_backward(planned):
    evs = predicted_timeline(planned("full")).rank_events(0)
    order = [e.name for e in evs if e.lane == "compute" and e.cat != IDLE]
    for layer in range(2):
        rc, bw = f"recompute layer {layer}", f"backward layer {layer}"
        assert rc in order and order.index(rc) < order.index(bw)
        assert order.index(f"forward layer {layer}") < order.index(rc)


def test_a_depth_proxy_is_expanded_to_every_real_layer(planned):
    p = planned("proxy")
    assert p.graph.proxy is not None and p.graph.proxy.total == 12
    evs = predicted_timeline(p).rank_events(0)
    order = list(dict.fromkeys(e.name for e in evs if e.lane == "compute" and e.cat != IDLE))
    fwd = [n for n in order if n.startswith("forward layer")]
    bwd = [n for n in order if n.startswith("backward layer")]
    assert fwd == [f"forward layer {k}" for k in range(12)]
    assert bwd == [f"backward layer {k}" for k in reversed(range(12))]
    assert sum(n.startswith("recompute layer") for n in order) == 12


def test_ranks_are_capped(planned):
    tl = predicted_timeline(planned("cpu-2d"), max_ranks=3)
    assert {e.rank for e in tl.events} == {0, 1, 2} and tl.world == 4
    assert tl.other_data()["ranks_written"] == 3


def test_a_plan_alone_gives_the_same_timeline(planned):
    p = planned("full")
    again = planned_from_plan(p.graph, p.plan, p.problem.mesh)
    a, b = predicted_timeline(p), predicted_timeline(again)
    assert [(e.name, e.start_s) for e in a.events] == \
        [(e.name, pytest.approx(e.start_s, rel=1e-9, abs=1e-15)) for e in b.events]


def test_pipeline_schedules_go_through_the_same_writer(tmp_path):
    sched = ps.PipelineSchedule("1F1B", 2, 1, 4)
    evs = pipeline_trace_events(ps.events(sched, ps.StageTime.of(1e-3, 2e-3, send_s=1e-4)))
    doc = write_trace(evs, tmp_path / "pp.json")
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in xs} == {0, 1}
    assert {"0F0", "1B3"} <= {e["name"] for e in xs}
    assert {e["cat"] for e in xs} >= {"forward", "backward", "send"}


def test_a_measured_pipeline_step_takes_the_predicted_names(tmp_path):
    from autopar.runtime.pipeline.events import StageEvent

    measured = [StageEvent(0, "F", 0, 1, 0.0, 1e-3), StageEvent(1, "B", 1, 3, 2e-3, 4e-3),
                StageEvent(0, "sync", -1, -1, 5e-3, 6e-3)]
    evs = pipeline_trace_events(measured)
    assert [(e.name, e.rank, e.lane, e.cat) for e in evs] == [
        ("0F1", 0, "compute", "forward"), ("1B3", 1, "compute", "backward"),
        ("gradient sync", 0, "comm", "sync")]
    predicted = pipeline_trace_events(
        ps.events(ps.PipelineSchedule("1F1B", 2, 1, 4), ps.StageTime.of(1e-3, 2e-3)))
    assert {"0F1", "1B3"} <= {e.name for e in predicted}


def test_trace_json_orders_and_names_lanes():
    doc = trace_json([TraceEvent("b", 2e-6, 1e-6, 1, "extra"), TraceEvent("a", 0.0, 1e-6)])
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert [(e["name"], e["pid"], e["tid"], e["ts"], e["dur"]) for e in xs] == \
        [("a", 0, 0, 0.0, 1.0), ("b", 1, 3, 2.0, 1.0)]


# --- the command line -----------------------------------------------------------------------


def test_plan_timeline_option_writes_the_trace(tmp_path, capsys):
    out = tmp_path / "step.json"
    plan_path = tmp_path / "plan.json"
    code = main(["plan", "gpt2-tiny", "--mesh", "dp=2", "--device", "cpu", "--batch", "4",
                 "--seq", "32", "--time-limit", "2", "--timeline", str(out),
                 "--json", str(plan_path)])
    stdout, err = capsys.readouterr()
    assert code == 0, err
    assert f"written to {out}" in stdout
    doc = json.loads(out.read_text())
    plan = json.loads(plan_path.read_text())["predicted"]
    assert doc["otherData"]["plan_step_s"] == plan["cost"]["step_s"]
    assert doc["otherData"]["step_s"] == pytest.approx(plan["cost"]["step_s"], rel=1e-6)
    names = {e["name"] for e in doc["traceEvents"] if e["ph"] == "X"}
    assert {"forward layer 0", "backward layer 1", "all_reduce[dp] gradient sync"} <= names


# --- the measured trace, on 2 gloo processes ---------------------------------------------------


def test_train_profile_writes_measured_traces_with_the_predicted_names(tmp_path):
    """``autopar train --profile``: 2 processes, 2 steps (the second profiled), each layer
    recomputed; about 15 s on 2 cores, mostly start-up and planning."""
    out = tmp_path / "prof"
    cmd = [sys.executable, "-m", "autopar.cli", "train", "--steps", "2", "--nproc", "2",
           "--mesh", "dp=2", "--seq", "16", "--batch", "2", "--time-limit", "1",
           "--no-baseline", "--recompute", "full", "--profile", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                       env=os.environ | {"PYTHONUNBUFFERED": "1"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    predicted = json.loads((out / "predicted.json").read_text())
    want = {"forward layer 0", "forward layer 1", "backward layer 0", "backward layer 1",
            "recompute layer 0", "recompute layer 1", "all_reduce[dp] gradient sync"}
    assert want <= {e["name"] for e in predicted["traceEvents"] if e["ph"] == "X"}
    for rank in (0, 1):
        doc = json.loads((out / f"trace_rank{rank}.json").read_text())
        ranges = Counter(e["name"] for e in doc["traceEvents"]
                         if e.get("cat") == "user_annotation")
        assert want <= set(ranges), sorted(ranges)
        assert ranges["all_reduce[dp] gradient sync"] == 1  # one bucket, as planned
    both = json.loads((out / "side_by_side.json").read_text())
    procs = {e["args"]["name"] for e in both["traceEvents"] if e.get("name") == "process_name"}
    assert {"predicted rank 0", "measured rank 0", "measured rank 1"} <= procs
    assert "side_by_side.json" in r.stdout


def test_a_pipeline_stage_without_the_loss_has_a_predicted_timeline():
    # a first stage's graph ends at its boundary output: no loss (loss_index -1) to draw
    import math

    import torch

    from autopar.capture.stage import StageInputs, pin_boundary, trace_stage
    from autopar.ir.mesh import Mesh
    from autopar.runtime.pipeline import stages

    preset = get_preset("gpt2-tiny").replace(n_layer=4)
    torch.manual_seed(0)
    model = preset.build("cpu")
    path = stages.find_blocks(model)[0]
    first = stages.module_stages(model, path, ((0, 2), (2, 4)), [0])[0]
    mesh = Mesh((2, 2), ("dp", "tp"), "cpu")
    graph = trace_stage(first, StageInputs(((4, 8),), ("int64",)), False,
                        stages.loss_fn_for(model), path)
    planned = make_plan(None, mesh, graph=pin_boundary(graph, mesh),
                        options=Options.of(memory_budget=math.inf, time_limit_s=1.0))
    assert planned.problem.loss_index == -1
    events = predicted_timeline(planned).rank_events(0)
    assert events and not any(e.args.get("reason") == "loss" for e in events)
