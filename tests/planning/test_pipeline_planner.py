"""The pipeline planner: stages, schedule and microbatches from one stage's intra-op plan, the
mesh-shape search, and their errors. Planning only: no processes."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from autopar.cli.main import main
from autopar.ir.errors import PlanError
from autopar.ir.mesh import Mesh
from autopar.ir.options import Options
from autopar.ir.plan import Plan
from autopar.models import get_preset
from autopar.passes.pipeline.cost import overheads, weigh
from autopar.passes.pipeline.stage_profile import stage_profile
from autopar.planning.mesh_shapes import MeshShape
from autopar.planning.pipeline import (
    busy_bound,
    microbatch_counts,
    plan_pipeline,
    predict_split,
    proxy_blocks,
)
from autopar.planning.planner import make_plan
from autopar.planning.shapes import SEARCH_OPTIONS, candidate_shapes, search_shapes, shape_mesh
from autopar.report.table import plan_table

GiB = 2**30


def gpt(n_layer: int = 8, vocab: int = 256, batch: int = 8, seq: int = 32):
    preset = get_preset("gpt2-tiny").replace(n_layer=n_layer, vocab_size=vocab)
    return preset.build("meta"), preset.example_inputs(batch, seq, "meta")


def test_a_pipeline_plan_covers_every_block_once_and_fits():
    model, inputs = gpt(n_layer=8)
    mesh = Mesh((2, 2), ("pp", "dp"), "cpu")
    plan = plan_pipeline(model, mesh, inputs, model_name="gpt").plan
    pipe = plan.decided.pipeline
    assert pipe is not None and pipe.size == 2
    assert len(pipe.stages) == 2 * pipe.virtual
    assert pipe.stages[0].first_block == 0 and pipe.stages[-1].end_block == 8
    assert all(a.end_block == b.first_block for a, b in zip(pipe.stages, pipe.stages[1:]))
    assert pipe.stages[0].first and pipe.stages[-1].last
    assert 8 % pipe.microbatches == 0
    # the placements are one stage's, on the mesh less its pipeline axis
    assert plan.decided.mesh_axes == ("dp",) and plan.full_mesh == ((2, 2), ("pp", "dp"))
    assert plan.predicted.cost.step_s == pytest.approx(pipe.step_s)
    assert plan.predicted.cost.mem_bytes == max(pipe.rank_memory_bytes) <= plan.provenance.memory_budget
    per_rank = [0.0] * pipe.size
    for st in pipe.stages:
        per_rank[st.rank] += st.memory_bytes
    assert per_rank == pytest.approx(list(pipe.rank_memory_bytes))
    assert 0.0 <= pipe.bubble < 1.0
    assert pipe.options and all(o.step_s >= pipe.step_s for o in pipe.options)


def test_the_plan_round_trips_through_json_and_prints_its_stages(tmp_path):
    model, inputs = gpt(n_layer=4)
    planned = plan_pipeline(model, Mesh((2, 2), ("pp", "dp"), "cpu"), inputs)
    path = tmp_path / "p.json"
    planned.plan.save(path)
    doc = json.loads(path.read_text())
    assert doc["decided"]["schedule"]["schedule"] == planned.plan.decided.pipeline.schedule
    assert len(doc["decided"]["stages"]) == len(planned.plan.decided.pipeline.stages)
    back = Plan.load(path)
    assert back.decided.pipeline == planned.plan.decided.pipeline
    table = plan_table(back)
    assert "pipeline: 2 ranks on axis pp" in table and "embedding + block" in table
    assert "on pp=2 x dp=2" in table


def test_the_runtime_costs_are_the_profiles_and_the_timeline_replays_them():
    from autopar.passes.pipeline.cost import overheads
    from autopar.report.pipeline_timeline import pipeline_timeline

    # the cpu profile: processes share its cores; a GPU's host queues ahead (no costs)
    cpu = overheads(1e3, Mesh((2, 2), ("pp", "dp"), "cpu"), 0)
    assert cpu.speed == (2.0, 2.0, 1.0) and cpu.post_s > 0 and cpu.node_s > 0
    gpu = overheads(1e3, Mesh((2, 2), ("pp", "dp"), "h100"), 0)
    assert gpu.speed is None and gpu.action_s == gpu.post_s == gpu.node_s == 0.0
    model, inputs = gpt(n_layer=4)
    mesh = Mesh((2,), ("pp",), "cpu")
    zbv = plan_pipeline(model, mesh, inputs, options=Options.of(schedule="ZBVZeroBubble")).plan
    pipe = zbv.decided.pipeline
    assert (pipe.action_s, pipe.post_s) == (cpu.action_s, cpu.post_s)
    # one process per rank on 2 cores: a core each, no speed-up
    assert pipe.speed == () and all(st.split_s > 0 for st in pipe.stages)
    one = plan_pipeline(model, mesh, inputs, options=Options.of(schedule="1F1B")).plan.decided.pipeline
    assert all(st.split_s == 0 for st in one.stages)  # a whole backward: nothing to split
    # the timeline, redrawn from the plan alone, ends where the plan's replay did
    _, span = pipeline_timeline(zbv)
    assert span == pytest.approx(pipe.step_s)


@pytest.mark.parametrize("axes,shape", [(("pp", "dp"), (2, 2)), (("pp", "tp"), (2, 2))])
def test_stage_programs_split_the_backward_unless_it_gathers_parameters(axes, shape):
    from autopar.ir.stage_kind import plan_runs_as_program
    from autopar.passes.pipeline.stage_profile import gathers_in_backward
    from autopar.planning.pipeline import proxy_blocks, stage_mesh

    model, inputs = gpt(n_layer=4)
    mesh = Mesh(shape, axes, "cpu")
    planned = plan_pipeline(model, mesh, inputs, options=Options.of(schedule="ZBVZeroBubble"))
    pipe = planned.plan.decided.pipeline
    prof = stage_profile(planned.problem, planned.node_choice, proxy_blocks(planned),
                         stage_mesh(mesh, 0).data_parallel_size)
    # the stage kind the planner priced is the one the runtime reads off the plan made; a
    # stage program splits its lowered backward unless that gathers parameters
    program = plan_runs_as_program(planned.plan)
    assert program == ("tp" in axes)
    gathers = gathers_in_backward(planned.problem, planned.node_choice)
    assert prof.splits_backward == (not program or not gathers)
    if prof.splits_backward:
        assert pipe.weight_share > 0 and all(st.split_s > 0 for st in pipe.stages)
    else:
        # a backward run whole in the input action: no weight part to defer, and no second
        # graph walk to pay for
        assert pipe.weight_share == 0 and all(st.split_s == 0 for st in pipe.stages)


def test_a_split_backward_recomputes_in_both_passes():
    from autopar.passes.pipeline.cost import Overheads, stage_time
    from autopar.passes.pipeline.schedule import PipelineSchedule
    from autopar.passes.pipeline.stage_profile import PartCost, StageProfile

    part = PartCost(forward_s=1.0, backward_s=3.0, recompute_s=1.0, nodes=10)
    prof = StageProfile(part, part, part, boundary_bytes=0.0, weight_share=0.5)
    over = Overheads(0.0, node_s=0.01)
    zbv = stage_time(PipelineSchedule("ZBVZeroBubble", 2, 2, 4), prof, 0, 2, 4, over)
    # blocks 0-2 with the embedding: 3 parts, each recomputing 1.0 and walking 10 nodes again
    assert zbv.split_s == pytest.approx(3 * 1.0 + 30 * 0.01)
    one = stage_time(PipelineSchedule("1F1B", 2, 1, 4), prof, 0, 2, 4, over)
    assert one.split_s == 0 and one.backward_s == zbv.backward_s == pytest.approx(9.0)


def test_a_tied_head_is_held_and_summed_by_both_end_stages():
    from autopar.planning.pipeline import proxy_blocks

    # GPT-2's head is its embedding's weight: the first and last stages each hold a copy
    model, inputs = gpt(n_layer=4, vocab=8192)
    mesh = Mesh((2,), ("pp",), "cpu")
    one = plan_pipeline(model, mesh, inputs, options=Options.of(schedule="1F1B"))
    prof = stage_profile(one.problem, one.node_choice, proxy_blocks(one), 1)
    table = 8192 * 64 * 4
    assert prof.tied_bytes == table
    # its state on both ends, its embedding lookup on the first
    assert prof.pre.state_bytes >= table and prof.post.state_bytes >= table
    assert prof.pre.forward_s > 0
    # the copies' gradients are summed across the two ranks once per step: both pay it
    ends = one.plan.decided.pipeline.stages
    assert ends[0].sync_s == ends[-1].sync_s > 0
    # a V keeps both ends on rank 0: nothing to sum across ranks
    v = plan_pipeline(model, mesh, inputs, options=Options.of(schedule="ZBVZeroBubble")).plan.decided.pipeline
    assert v.stages[0].rank == v.stages[-1].rank and v.stages[0].sync_s == 0


def test_a_heavy_head_gets_fewer_blocks_than_equal_counts():
    # a vocabulary of 16k on a 64-wide model: the head outweighs several blocks. One
    # process per core (pp=2 on the cpu profile's 2 cores): where processes share cores the
    # replay lets an idle rank's core speed the other, and balance matters far less
    model, inputs = gpt(n_layer=8, vocab=16384)
    mesh = Mesh((2,), ("pp",), "cpu")
    planned = plan_pipeline(model, mesh, inputs, options=Options.of(schedule="1F1B"))
    stages = planned.plan.decided.pipeline.stages
    assert stages[-1].blocks < stages[0].blocks
    equal_step, _ = predict_split(planned, mesh, [(0, 4), (4, 8)])
    assert planned.plan.decided.pipeline.step_s < equal_step


def test_the_stage_profile_adds_up_to_its_plan():
    preset = get_preset("llama3-tiny").replace(n_layers=4)
    model, inputs = preset.build("meta"), preset.example_inputs(8, 32, "meta")
    planned = make_plan(model, Mesh((2, 2), ("dp", "tp"), "h100"), inputs,
                        options=Options.of(memory_budget=math.inf, recompute="none",
                                           time_limit_s=2.0))
    prof = stage_profile(planned.problem, planned.node_choice, 4, 2)
    parts = [(prof.pre, 1), (prof.block, 4), (prof.post, 1)]
    total = sum((c.time_s + c.sync_s) * k for c, k in parts)
    assert total == pytest.approx(planned.plan.predicted.cost.step_s, rel=1e-6)
    assert 0.0 < prof.weight_share < 1.0
    assert prof.block.state_bytes > 0 and prof.block.saved_bytes > 0


def test_fixed_choices_are_kept():
    model, inputs = gpt(n_layer=8)
    mesh = Mesh((2,), ("pp",), "cpu")
    pipe = plan_pipeline(model, mesh, inputs,
                         options=Options.of(schedule="interleaved1f1b", microbatches=4,
                                            virtual=2)).plan.decided.pipeline
    assert (pipe.schedule, pipe.virtual, pipe.microbatches) == ("Interleaved1F1B", 2, 4)
    assert [st.rank for st in pipe.stages] == [0, 1, 0, 1]


def test_bad_input_names_the_cause_and_the_fix():
    model, inputs = gpt(n_layer=2)
    with pytest.raises(PlanError, match=r"4 pipeline stages but the model has 2 blocks: use "
                                        r"pp <= 2"):
        plan_pipeline(model, Mesh((4,), ("pp",), "cpu"), inputs)
    with pytest.raises(PlanError, match=r"3 microbatches do not divide the batch of 8: use a "
                                        r"divisor of it \(1, 2, 4, 8\)"):
        microbatch_counts(8, 1, 2, 3)
    with pytest.raises(PlanError, match=r"4 microbatches of 2 samples do not split over the 4 "
                                        r"data-parallel ranks"):
        microbatch_counts(8, 4, 2, 4)
    with pytest.raises(PlanError, match=r"no pipeline plan of 2 blocks on 2 stages fits .*Try "
                                        r"more pipeline stages"):
        plan_pipeline(model, Mesh((2,), ("pp",), "cpu"), inputs,
                      options=Options.of(memory_budget=64 * 2**10))


def test_microbatch_counts_prefer_twice_the_stages():
    assert microbatch_counts(32, 2, 4, None) == [8, 4]
    assert microbatch_counts(128, 16, 8, None) == [8]  # only m <= 8 keep 16 per microbatch
    assert microbatch_counts(6, 1, 4, None) == [6]


def test_the_shape_search_is_the_best_of_planning_each_shape_alone():
    model, inputs = gpt(n_layer=4, batch=8)
    results = search_shapes(model, 4, inputs, device="cpu",
                            options=SEARCH_OPTIONS.replace(time_limit_s=2.0))
    shapes = candidate_shapes(model, 4, 8, "cpu")
    assert {r.shape for r in results} == set(shapes)
    assert MeshShape(2, 1, 2) in shapes and MeshShape(1, 4, 1) in shapes
    steps = []
    for s in shapes:
        mesh = shape_mesh(s, "cpu")
        try:
            if s.pp == 1:
                plan = make_plan(model, mesh, inputs,
                                 options=Options.of(max_layers=4, time_limit_s=2.0)).plan
            else:
                plan = plan_pipeline(model, mesh, inputs, microbatch_choices=1,
                                     options=Options.of(max_layers=4, time_limit_s=2.0)).plan
            steps.append((plan.predicted.cost.step_s, s))
        except PlanError:
            steps.append((math.inf, s))
    best_step, best_shape = min(steps, key=lambda x: x[0])
    assert results[0].step_s == pytest.approx(best_step, rel=1e-9)
    assert results[0].shape == best_shape or math.isclose(
        dict((s, t) for t, s in steps)[results[0].shape], best_step, rel_tol=1e-9)


def test_cli_plans_a_pp_mesh_and_a_device_count(capsys, tmp_path):
    path = tmp_path / "p.json"
    code = main(["plan", "gpt2-tiny", "--mesh", "pp=2,dp=2", "--batch", "8", "--seq", "32",
                 "--device", "cpu", "--json", str(path), "--timeline", str(tmp_path / "t.json")])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "pipeline: 2 ranks" in out and "schedules weighed" in out
    trace = json.loads((tmp_path / "t.json").read_text())
    names = {e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"}
    assert "0F0" in names and "gradient sync" in names
    code = main(["plan", "gpt2-tiny", "--devices", "4", "--batch", "8", "--seq", "32",
                 "--device", "cpu", "--compare"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "mesh shapes of 4 devices" in out and "pp x dp x tp" in out
    # --compare: the winner's shape with the fixed layouts beside it
    assert "reference plans, scored by the same cost model" in out
    code = main(["plan", "gpt2-tiny", "--mesh", "dp=2", "--schedule", "1F1B"])
    out, err = capsys.readouterr()
    assert code == 2 and "need a pipeline axis" in err


def test_llama3_405b_on_1024_gpus_gets_real_stages_that_fit():
    # the command: pp=8, dp=16, tp=8, batch 128 of 8192 tokens, h100 defaults
    preset = get_preset("llama3-405b").replace(max_seq_len=8192)
    model, inputs = preset.build("meta"), preset.example_inputs(128, 8192, "meta")
    plan = plan_pipeline(model, Mesh((8, 16, 8), ("pp", "dp", "tp"), "h100"), inputs,
                         options=Options.of(max_layers=4, time_limit_s=5.0)).plan
    pipe = plan.decided.pipeline
    assert plan.decided.precision.name == "bf16"
    assert len(pipe.stages) == 8 * pipe.virtual
    assert pipe.stages[-1].end_block == 126 and pipe.microbatches >= 8
    assert max(pipe.rank_memory_bytes) <= 74 * GiB
    assert 0.0 < pipe.bubble < 0.5


def test_the_busy_bound_is_below_every_schedule_weighed():
    # plan_pipeline skips a layout weighed only to be kept where faster when this bound
    # already reaches the best step: the bound must lie below every option's replayed step
    model, inputs = gpt(n_layer=8)
    mesh = Mesh((4, 2), ("pp", "dp"), "cpu")
    planned = plan_pipeline(model, mesh, inputs, microbatch_choices=1,
                            options=Options.of(time_limit_s=2.0))
    pipe = planned.plan.decided.pipeline
    prof = stage_profile(planned.problem, planned.node_choice, proxy_blocks(planned), 2)
    over = overheads(prof.boundary_bytes, mesh, 0, prof.tied_bytes)
    bound = busy_bound(prof, 8, 4, pipe.microbatches, over)
    assert bound > 0
    weighed = [o for o in pipe.options if math.isfinite(o.step_s)]
    assert len(weighed) >= 3
    assert all(o.step_s >= bound * (1 - 1e-9) for o in weighed)


def test_stages_that_hold_fewer_microbatches_recompute_less(tmp_path):
    """pp=2 under 1F1B: the first stage holds 2 microbatches in flight, the last 1. At a limit
    below the first stage's need without recomputation but above the last's, the first
    recomputes and the last does not, and the plan is no slower than one mode throughout."""
    from autopar.runtime.pipeline.module import build_options

    preset = get_preset("llama3-tiny").replace(n_layers=8, max_seq_len=256)
    model, inputs = preset.build("meta"), preset.example_inputs(64, 256, "meta")
    mesh = Mesh((2, 2), ("pp", "dp"), "h100")
    fixed = dict(time_limit_s=10.0, schedule="1F1B", microbatches=4)
    budget = 40 * 2**20
    free = plan_pipeline(model, mesh, inputs, options=Options.of(
        **fixed, recompute="none", memory_budget=math.inf)).plan.decided.pipeline
    assert free.stages[0].memory_bytes > budget >= free.stages[-1].memory_bytes
    opts = Options.of(**fixed, memory_budget=budget)
    plan = plan_pipeline(model, mesh, inputs, options=opts).plan
    one = plan_pipeline(model, mesh, inputs, options=opts, stage_modes=False).plan
    pipe = plan.decided.pipeline
    modes = pipe.stage_recompute(plan.decided.recompute.mode)
    assert modes[0] in ("selective", "full") and modes[-1] == "none", modes
    assert all(st.memory_bytes <= budget for st in pipe.stages)
    assert len(set(one.decided.pipeline.stage_recompute(one.decided.recompute.mode))) == 1
    assert plan.predicted.cost.step_s <= one.predicted.cost.step_s * (1 + 1e-9)
    assert plan.predicted.cost.step_s == pytest.approx(pipe.step_s)
    # recorded per stage, kept through JSON, shown, and what the runtime is told to run
    path = tmp_path / "p.json"
    plan.save(path)
    back = Plan.load(path)
    assert back.decided.pipeline == pipe
    assert [s["recompute"] for s in json.loads(path.read_text())["decided"]["stages"]] == \
        list(modes)
    table = plan_table(back)
    assert "recompute" in table and "recomputation per stage" in table
    _, build = build_options(model, back, inputs, None)
    assert tuple(build["recompute"]) == modes
    # a plan written before stages chose their own runs the plan's one mode on every stage
    doc = json.loads(path.read_text())
    for st in doc["decided"]["stages"]:
        del st["recompute"]
    path.write_text(json.dumps(doc))
    old = Plan.load(path).decided.pipeline
    assert old.stage_recompute("full") == ("full",) * len(old.stages)


def _make_plan_calls(monkeypatch) -> list[tuple[str, str]]:
    """Every make_plan call plan_pipeline makes: (the recompute mode asked, the plan's mode or
    "raised")."""
    import autopar.planning.pipeline as pipeline_mod

    calls: list[tuple[str, str]] = []
    real = pipeline_mod.make_plan

    def counted(*args, **kwargs):
        asked = kwargs["options"].memory.recompute
        try:
            planned = real(*args, **kwargs)
        except PlanError:
            calls.append((asked, "raised"))
            raise
        calls.append((asked, planned.plan.decided.recompute.mode))
        return planned

    monkeypatch.setattr(pipeline_mod, "make_plan", counted)
    return calls


def test_the_full_recomputation_retry_is_skipped_where_it_would_plan_the_same_modes(
        monkeypatch):
    # at 18 MiB no plan of the stand-in fits in any mode (the memory bound does not rule it
    # out: make_plan plans every mode, full recomputation among them); the retry in full
    # recomputation would plan those modes again, so it is not run, and it would not have
    # found a plan either
    preset = get_preset("llama3-tiny").replace(n_layers=8, max_seq_len=256)
    model, inputs = preset.build("meta"), preset.example_inputs(64, 256, "meta")
    mesh = Mesh((2, 2), ("pp", "dp"), "h100")
    fixed = dict(time_limit_s=2.0, schedule="1F1B", microbatches=4, memory_budget=18 * 2**20)
    calls = _make_plan_calls(monkeypatch)
    with pytest.raises(PlanError, match="no pipeline plan"):
        plan_pipeline(model, mesh, inputs, options=Options.of(**fixed))
    assert calls == [("auto", "raised")]
    with pytest.raises(PlanError, match="no pipeline plan"):
        plan_pipeline(model, mesh, inputs, options=Options.of(**fixed, recompute="full"))
    # the stand-in's plan already recomputes fully and no split of it fits: no retry
    calls.clear()
    monkeypatch.setattr("autopar.planning.pipeline._weigh_modes", _no_split)
    with pytest.raises(PlanError, match="no pipeline plan"):
        plan_pipeline(model, mesh, inputs,
                      options=Options.of(**{**fixed, "memory_budget": 22 * 2**20}))
    assert calls == [("auto", "full")]


def _no_split(sched, profs, n_blocks, limit, over):
    """No split fits (a stand-in for a memory limit that only the whole pipeline misses)."""
    none = replace(weigh(sched, profs[0], n_blocks, None, over), split=None)
    return none, none


def test_the_full_recomputation_retry_runs_where_the_stand_in_recomputes_less(monkeypatch):
    # with room to spare the stand-in recomputes nothing; where no split of it fits (forced
    # here), the retry plans the stand-in in full recomputation
    model, inputs = gpt(n_layer=8)
    mesh = Mesh((2, 2), ("pp", "dp"), "cpu")
    calls = _make_plan_calls(monkeypatch)
    monkeypatch.setattr("autopar.planning.pipeline._weigh_modes", _no_split)
    with pytest.raises(PlanError, match="no pipeline plan"):
        plan_pipeline(model, mesh, inputs, microbatch_choices=1,
                      options=Options.of(time_limit_s=2.0, memory_budget=2**40))
    assert [asked for asked, _ in calls] == ["auto", "full"]
    assert calls[0][1] != "full"
