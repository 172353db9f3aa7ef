"""Pipeline stages that run autopar's plan on their submesh: PP x DP x TP equals one device.

One launch of 8 gloo processes runs every configuration in turn (process start-up dominates on
2 cores): GPT-2 (embedding tied to the head on the first and last stage) and Llama-3, 1F1B,
GPipe and interleaved 1F1B (2 stages per rank), on pp=2 x dp=2 x tp=2 and on pp=4 x tp=2
(PP x TP). Each stage runs as a ``StageProgram``: its plan comes from the planner (the stage's
graph, boundary pinned), from a callable pinning Megatron's tensor-parallel layout (so the tp
axis really splits weights: column and row parallel linears, a vocabulary-parallel embedding
and head shared by two stages) or, for GPipe, as the plans another pipeline made (a dict).
Every rank trains 3 AdamW steps and checks against the single-device run (done once, here):
the loss of each step, the last step's gradients and the parameters after the third step of
its own stages (each whole, gathered over the stage's submesh), norm-wise relative error below
1e-5, and where CLIP names a config the whole model's gradient norm ``clip_grad_norm_``
returns; and that each stage program ran exactly its plan's collectives (kind, axis, reason,
count, bytes): the gradient sync once per step, on the gradients summed over the micro-batches
(deferred to the stage's last backward), everything else once per micro-batch. Two configs
run the plan's bf16 with recomputation (GPT-2 selective, Llama-3 full: MODES), each stage
traced under the policy with its plan's recomputation applied, checked against autopar's
one-device bf16 run (see BF16_LOSS_TOL).

The tests after it need no processes: the stage graph's shape, the pinned boundary, the
errors for meshes, frontends, schedules and plans that cannot run.
"""

from __future__ import annotations

import dataclasses
import io
import math
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from harness.spmd import (
    EPS,
    LR,
    fake_group,
    four_block_model,
    one_device_run,
    rel_err,
    start_method,
)

from autopar.api import build_pipeline  # plans the stages, then builds (runtime)
from autopar.ir.errors import MeshError, PlanError
from autopar.ir.mesh import Mesh
from autopar.ir.options import Options
from autopar.ir.placements import R, Replicate, S
from autopar.models import get_preset
from autopar.runtime.pipeline import stages as ps

WORLD = 8
TOL = 1e-5
BATCH, SEQ = 8, 8
STEPS = 3
PLAN_S = 1.0  # the solver's time per stage: the tiny stages are solved well within it
# (name, preset, mesh axes -> sizes, schedule, stages per rank, micro-batches, stage plans)
# stage plans: "solver" (make_plan), "megatron" (Megatron's layout pinned, the rest solved),
# or the name of an earlier config whose plans are reused
CONFIGS = [
    ("1f1b-gpt2-megatron", "gpt2-tiny", {"pp": 2, "dp": 2, "tp": 2}, "1f1b", 1, 2, "megatron"),
    ("gpipe-gpt2", "gpt2-tiny", {"pp": 2, "dp": 2, "tp": 2}, "gpipe", 1, 2,
     "1f1b-gpt2-megatron"),
    ("1f1b-llama", "llama3-tiny", {"pp": 2, "dp": 2, "tp": 2}, "1f1b", 1, 2, "solver"),
    ("interleaved-llama-megatron", "llama3-tiny", {"pp": 2, "dp": 2, "tp": 2},
     "interleaved_1f1b", 2, 2, "megatron"),
    ("1f1b-gpt2-pp4-tp2", "gpt2-tiny", {"pp": 4, "tp": 2}, "1f1b", 1, 4, "solver"),
    # a split-backward schedule: each program's input gradient in the I action, its weights'
    # in the W action (the lowered backward split, StageProgram.weight_runner)
    ("zbv-llama", "llama3-tiny", {"pp": 2, "dp": 2, "tp": 2}, "zbv", 2, 2,
     "interleaved-llama-megatron"),
    # the plan's precision and recomputation (MODES), checked against one device's bf16
    ("1f1b-gpt2-bf16-selective", "gpt2-tiny", {"pp": 2, "dp": 2, "tp": 2}, "1f1b", 1, 2,
     "megatron"),
    ("1f1b-llama-bf16-full", "llama3-tiny", {"pp": 2, "dp": 2, "tp": 2}, "1f1b", 1, 2,
     "solver"),
]
# (precision, recompute) of the configs that do not run fp32 without recomputation
MODES = {"1f1b-gpt2-bf16-selective": ("bf16", "selective"),
         "1f1b-llama-bf16-full": ("bf16", "full")}
# bf16 against autopar's one-device bf16 run (harness.spmd.one_device_run, the micro-batches
# accumulated alike). tp sums a row-parallel matmul's bf16 partial results (one rounding
# more than one device's single matmul), after which every later rounding falls otherwise:
# so the runs agree to bf16's rounding noise, not to the bit. Measured on these models:
# losses within 3e-5, gradients within 2e-2 (one device's bf16 is 2e-2 from its fp32); and
# the gradients at least FP32_AWAY from fp32's (measured 1.7e-2), so a run in fp32 fails.
# Parameters after AdamW are not compared: Adam blows a near-zero gradient's noise up to a
# whole update (see harness.spmd.EPS)
BF16_LOSS_TOL, BF16_GRAD_TOL, FP32_AWAY = 1e-3, 5e-2, 5e-3
# gradient clipping (the whole model's norm over DTensor gradients, the tied weight once):
# max norms low enough to clip
CLIP = {"1f1b-gpt2-pp4-tp2": 0.5, "1f1b-llama": 0.5}


def _build(preset_name: str):
    return four_block_model(preset_name, BATCH, SEQ)


def _reference(preset_name: str, clip: float | None) -> dict:
    """One device, the whole batch's mean loss: each step's loss (and gradient norm, where
    ``clip`` clips), the last step's gradients, the parameters after the last step."""
    model, (tokens, targets) = _build(preset_name)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses, grads, norms = [], {}, []
    for _ in range(STEPS):
        loss = model(tokens, targets)
        loss.backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads, "norms": norms,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _megatron(model, family: str, recompute: str = "none"):
    """Stage plans with Megatron's tensor-parallel layout pinned (the stage's boundary and
    shared weights stay pinned as the pipeline gave them), the rest solved, recomputing as
    ``recompute`` says."""
    from autopar.capture.stage import pin_boundary
    from autopar.models.reference_plans import megatron_tp
    from autopar.planning.planner import make_plan

    def plan(stage: int, graph, mesh):
        ref = megatron_tp(model, mesh.shape, mesh.axes, family)
        pinned = pin_boundary(graph, mesh, {n: ref.params[n] for n in graph.param_names})
        return make_plan(None, mesh, graph=pinned,
                         options=Options.of(memory_budget=math.inf, time_limit_s=PLAN_S,
                                            recompute=recompute)).plan
    return plan


def _worker(configs: list, saved_references: bytes) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    references = torch.load(io.BytesIO(saved_references))
    report, made = {}, {}
    for name, preset, axes, schedule, virtual, m, plans in configs:
        model, (tokens, targets) = _build(preset)
        want, clip = references[name], CLIP.get(name)
        precision, recompute = MODES.get(name, ("fp32", "none"))
        exact = name not in MODES  # else compared in the parent, against one device's bf16
        mesh = init_device_mesh("cpu", tuple(axes.values()), mesh_dim_names=tuple(axes))
        stage_plans = (None if plans == "solver" else
                       _megatron(model, get_preset(preset).family, recompute)
                       if plans == "megatron" else dict(enumerate(made[plans])))
        runner = build_pipeline(model, (tokens, targets), mesh, None, schedule, m, virtual,
                                "module", stage_plans=stage_plans, plan_time_limit_s=PLAN_S,
                                precision=precision, recompute=recompute)
        made[name] = runner.plans
        opt = torch.optim.AdamW(runner.parameters(), lr=LR, eps=EPS)
        synced, losses, grads = {}, [], {}
        for step in range(STEPS):
            for prog in runner.stage_modules.values():
                prog.collectives.reset()
            loss = runner.step(tokens, targets).item()
            losses.append(loss)
            got = want["losses"][step]
            assert not exact or abs(loss - got) <= TOL * abs(got), (name, step, loss, got)
            if clip is not None:
                norm, ref = runner.clip_grad_norm_(clip).item(), want["norms"][step]
                assert abs(norm - ref) <= TOL * ref, (name, step, norm, ref)
            if step == STEPS - 1:
                grads = {n: p.grad.full_tensor() for n, p in runner.named_parameters()}
                if exact:
                    _compare(name, "grad", grads, want["grads"])
                for s, prog in runner.stage_modules.items():
                    synced[s] = _check_collectives(name, s, prog, m)
            opt.step()
            opt.zero_grad()
        if exact:
            _compare(name, "param", {n: p.detach().full_tensor()
                                     for n, p in runner.named_parameters()}, want["params"])
        report[name] = {
            "losses": losses, "grads": None if exact else grads,
            # per stage: the precision its plan computes in, its parameters' dtype (the fp32
            # masters), and how many forward ops its backward recomputes
            "modes": {s: (p.plan.decided.precision.name,
                          {str(q.dtype) for q in p.parameters()},
                          len(p._active[1].pg.recomputed))
                      for s, p in runner.stage_modules.items()},
            "stages": sorted(runner.stage_modules),
            "events": [tuple(e) for e in runner.last_step_events],
            # how many parameters each stage's plan splits over tp (Megatron's: many)
            "tp_split": {s: sum(not isinstance(spec[-1], Replicate)
                                for spec in p.plan.decided.params.values())
                         for s, p in runner.stage_modules.items()},
            "synced": synced,  # stage -> gradient-sync collectives run in the last step
            # stage -> W actions that ran the weights' half of its split backward
            "weights": {s: p.weight_actions for s, p in runner.stage_modules.items()},
        }
        del runner, opt
        dist.barrier()
    return report


def _compare(config: str, what: str, got: dict, want: dict) -> None:
    assert got, f"{config}: this rank holds no parameters"
    for n, t in got.items():
        err = rel_err(t.detach(), want[n])
        assert err < TOL, f"{config}: {what} {n} relative error {err:.2e}"


def _check_collectives(config: str, stage: int, prog, n_microbatches: int) -> int:
    """What the stage program ran in one step: its plan's gradient sync once (on the
    gradients summed over the micro-batches), its other collectives once per micro-batch.
    Returns how many gradient-sync collectives ran."""
    ran = prog.collectives.totals(by_reason=True)
    per_step = {}
    for c in prog.plan.predicted.collectives:
        times = 1 if c.reason == "gradient sync" else n_microbatches
        per_step[(c.kind, c.axis, c.reason)] = (c.count * times, c.bytes * times)
    assert ran == per_step, (config, stage, ran, per_step)
    return sum(n for (_, _, reason), (n, _) in ran.items() if reason == "gradient sync")


def test_pipeline_stages_run_their_plans() -> None:
    from autopar.runtime.launch import launch

    made = {}
    for name, preset, *_ in CONFIGS:
        key = (preset, CLIP.get(name))
        if key not in made:
            made[key] = _reference(preset, CLIP.get(name))
    references = {c[0]: made[(c[1], CLIP.get(c[0]))] for c in CONFIGS}
    # the references go as torch.save's bytes: passed as tensors, each would travel as a file
    # descriptor, and a fork server hands a worker at most 256 of them
    saved = io.BytesIO()
    torch.save(references, saved)
    reports = launch(_worker, WORLD, (CONFIGS, saved.getvalue()), timeout_s=300,
                     start_method=start_method())
    for name, preset, axes, schedule, virtual, m, plans in CONFIGS:
        pp = axes["pp"]
        backward = ("I", "W") if schedule == "zbv" else ("B",)
        held = sorted(s for rep in reports for s in rep[name]["stages"])
        assert held == sorted(list(range(pp * virtual)) * (WORLD // pp)), name
        for rank, rep in enumerate(reports):
            r = rep[name]
            kinds = Counter((k, s) for _, k, s, *_ in r["events"])
            for s in r["stages"]:
                assert all(kinds[(k, s)] == m for k in ("F", *backward)), (name, rank, kinds)
            # with dp every stage sums its gradients across ranks, so the once-per-step check
            # above had something to check (without dp a solved stage may have no sum)
            if axes.get("dp", 1) > 1:
                assert all(n > 0 for n in r["synced"].values()), (name, rank, r["synced"])
            if plans == "megatron":  # the tp axis really splits the stages' weights
                assert all(n > 0 for n in r["tp_split"].values()), (name, r["tp_split"])
            # a split backward's W action runs the weights' half (every stage splits: the
            # first's I half is empty, its input being token ids); whole backwards run none
            split = STEPS * m if schedule == "zbv" else 0
            assert all(n == split for n in r["weights"].values()), (name, r["weights"])
            precision, recompute = MODES.get(name, ("fp32", "none"))
            for s, (computes, dtypes, recomputed) in r["modes"].items():
                assert (computes, dtypes) == (precision, {"torch.float32"}), (name, s)
                assert (recomputed > 0) == (recompute != "none"), (name, s, recomputed)
        if name in MODES:
            _check_bf16(name, preset, axes, m, references[name], reports)


def _check_bf16(name: str, preset: str, axes: dict, m: int, fp32: dict, reports: list) -> None:
    """A bf16 pipeline against autopar's one-device bf16 run of the same micro-batches (see
    BF16_LOSS_TOL), and away from fp32's."""
    model, (tokens, targets) = _build(preset)
    same = one_device_run(model, tokens, targets, m * axes.get("dp", 1), "bf16", STEPS)
    losses = reports[0][name]["losses"]
    for step, (a, b) in enumerate(zip(losses, same["losses"])):
        assert abs(a - b) <= BF16_LOSS_TOL * abs(b), (name, step, a, b)
    grads = {n: t for rep in reports for n, t in rep[name]["grads"].items()}
    assert set(grads) == set(same["grads"]), name  # every parameter
    near = max(rel_err(t, same["grads"][n]) for n, t in grads.items())
    away = max(rel_err(t, fp32["grads"][n]) for n, t in grads.items())
    assert near < BF16_GRAD_TOL, f"{name}: gradients {near:.2e} from one device's bf16"
    assert away > FP32_AWAY, f"{name}: gradients only {away:.2e} from fp32's: bf16 not applied?"


# --- without processes ------------------------------------------------------------------------


def _stage_graphs(preset: str, mesh: Mesh):
    """Both stages of a 2-stage split, captured with their boundary pinned on ``mesh``."""
    from autopar.capture.stage import StageInputs, pin_boundary, trace_stage

    model, _ = _build(preset)
    path = ps.find_blocks(model)[0]
    mods = ps.module_stages(model, path, ((0, 2), (2, 4)), [0, 1])
    first = StageInputs(((4, SEQ),), ("int64",))
    g0 = trace_stage(mods[0], first, False, ps.loss_fn_for(model), path)
    y = next(n for n in g0.graph.nodes if n.name == g0.loss_node).meta["autopar"].out
    last = StageInputs((y.shape, (4, SEQ)), ("float32", "int64"))
    g1 = trace_stage(mods[1], last, True, ps.loss_fn_for(model), path)
    return mods, pin_boundary(g0, mesh), pin_boundary(g1, mesh)


def test_stage_graph_has_its_boundary() -> None:
    """A middle stage's step: (x, g) in, (y, grads, dx) out; the first reads tokens and
    returns no input gradient; the last computes the loss. Phases split forward from
    backward as in a whole step, and the stage's blocks are its layers."""
    mesh = Mesh((2, 2), ("dp", "tp"), "cpu")
    _, g0, g1 = _stage_graphs("llama3-tiny", mesh)
    facts = {n.name: n.meta["autopar"] for n in g0.graph.nodes}
    assert g0.stage.input is None and g0.stage.input_grad is None
    assert g0.input_names == ["arg0", "grad_out"] and not g0.has_loss
    y, g = facts[g0.loss_node].out, facts[g0.stage.output_grad].out
    assert (y.shape, y.dtype) == (g.shape, g.dtype) == ((4, SEQ, 64), torch.float32)
    assert facts[g0.loss_node].phase == "fwd" and g0.num_layers == 2
    assert not any(n.target is torch.ops.aten.ones_like.default for n in g0.graph.nodes)
    facts1 = {n.name: n.meta["autopar"] for n in g1.graph.nodes}
    assert g1.has_loss and facts1[g1.loss_node].out.shape == ()
    assert facts1[g1.stage.input_grad].out == facts1[g1.stage.input].out  # dx like x
    assert facts1[g1.stage.input_grad].phase == "bwd"
    assert g1.pins == {g1.stage.input: (S(0), R),
                       next(n for n, f in facts1.items() if f.input_index == 1): (S(0), R)}


def test_stage_plan_keeps_its_pins_and_prices_the_boundary() -> None:
    """The planner keeps a stage's inputs where they are pinned and lists moving its output
    into its gradient's layout as a "stage boundary" collective where the two differ; an
    unpinned stage is refused with the fix."""
    from autopar.planning.planner import make_plan

    mesh = Mesh((2, 2), ("dp", "tp"), "cpu")
    mods, g0, _ = _stage_graphs("gpt2-tiny", mesh)
    plan = make_plan(mods[0], mesh, graph=g0,
                     options=Options.of(memory_budget=math.inf, time_limit_s=PLAN_S)).plan
    for name, spec in g0.pins.items():
        assert plan.decided.nodes[name].outs[0] == spec
    y_spec = plan.decided.nodes[g0.loss_node].outs[0]
    boundary = [c for c in plan.predicted.collectives if c.reason == "stage boundary"]
    assert bool(boundary) == (y_spec != (S(0), R)), (y_spec, boundary)
    assert not any(c.reason == "loss" for c in plan.predicted.collectives)  # no loss on this stage
    with pytest.raises(PlanError, match="not pinned.*pin_boundary"):
        make_plan(mods[0], mesh, graph=dataclasses.replace(g0, pins={}),
                  options=Options.of(memory_budget=math.inf, time_limit_s=PLAN_S))


def test_neighbours_must_agree_on_the_boundary() -> None:
    """A plan for the next stage that receives its input in another layout than the stage
    before sends it is refused, naming both layouts."""
    from autopar.planning.planner import make_plan
    from autopar.runtime.pipeline.stage_program import check_stage_plan

    mesh = Mesh((2, 2), ("dp", "tp"), "cpu")
    mods, g0, g1 = _stage_graphs("llama3-tiny", mesh)
    p0 = make_plan(mods[0], mesh, graph=g0,
                   options=Options.of(memory_budget=math.inf, time_limit_s=PLAN_S)).plan
    whole = dataclasses.replace(g1, pins={k: (R, R) for k in g1.pins})  # another boundary
    p1 = make_plan(mods[1], mesh, graph=whole,
                   options=Options.of(memory_budget=math.inf, time_limit_s=PLAN_S)).plan
    with pytest.raises(PlanError, match=r"stage 1's plan receives its input as \(R, R\) but "
                                        r"stage 0's plan sends its output as \(S\(0\), R\)"):
        check_stage_plan(1, g1, p1, mesh, p0, g0)
    with pytest.raises(PlanError, match="made for mesh .* runs on"):
        check_stage_plan(1, g1, p1, Mesh((4,), ("tp",), "cpu"), p0, g0)


def test_meshes_frontends_and_schedules_that_cannot_run() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    model, inputs = _build("gpt2-tiny")
    moe, moe_inputs = _build("moe-tiny")
    with fake_group(8):
        bad = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "sp"))
        with pytest.raises(MeshError, match=r"axes 'pp', 'dp' and 'tp'; axis \['sp'\]"):
            build_pipeline(model, inputs, bad)
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
        with pytest.raises(PlanError, match="traced stages .* cannot run a stage's plan.*"
                                            "frontend='module'"):
            build_pipeline(model, inputs, mesh, frontend="trace")
        with pytest.raises(PlanError, match="GPT-2 and Llama-3 models, not its MoE"):
            build_pipeline(moe, moe_inputs, mesh)


def test_a_shared_weight_must_be_placed_alike_on_its_stages() -> None:
    """GPT-2's embedding, tied to its head, is pinned on the last stage to the layout the
    first stage's plan gave it; a stage plan placing it otherwise is refused."""
    from autopar.capture.stage import StageInputs, pin_boundary
    from autopar.planning.planner import make_plan
    from autopar.planning.stage_plans import plan_stages

    model, _ = _build("gpt2-tiny")
    path = ps.find_blocks(model)[0]
    mods = ps.module_stages(model, path, ((0, 2), (2, 4)), [0, 1])
    mesh = Mesh((2, 2), ("dp", "tp"), "cpu")

    def plans(stage: int, graph, mesh):
        # the embedding whole on the first stage, the head's copy split over tp on the last
        graph = pin_boundary(graph, mesh, {"wte.weight": (R, S(0)) if stage else (R, R)})
        return make_plan(None, mesh, graph=graph,
                         options=Options.of(memory_budget=math.inf, time_limit_s=PLAN_S)).plan

    with pytest.raises(PlanError, match=r"stage 1's plan places wte.weight as \(R, S\(0\)\) "
                                        r"but the pipeline gives it as \(R, R\)"):
        plan_stages(mods, path, StageInputs(((4, SEQ),), ("int64",)),
                    StageInputs(((4, SEQ),), ("int64",)), ps.loss_fn_for(model), mesh,
                    {"wte.weight": [0, 1]}, plans)
