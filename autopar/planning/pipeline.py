"""The pipeline planner: stages, schedule and microbatches for a mesh with a ``pp`` axis.

Alpa's inter-op pass, with the intra-op planner inside it:

1. **Microbatches.** ``m`` divides the batch so that each microbatch still splits over the
   data-parallel axes; the fewest with ``m >= 2p`` and the fewest with ``m >= p`` are tried
   (``microbatches=`` fixes one).
2. **One stage's intra-op plan.** The model is traced at one microbatch as a stand-in for a
   stage (:func:`autopar.capture.depth_proxy.stage_representative`): its embedding, head and the
   ``ceil(L/p)`` blocks a stage holds, each activation kept for the backward held once per
   microbatch the busiest rank keeps in flight. :func:`autopar.planning.planner.make_plan` plans it on
   the stage submesh (the mesh less ``pp``) under the device's memory limit, choosing the
   sharding, recomputation and ZeRO stage together as it does for any plan. Every stage runs
   that layout's parameter placement: blocks are alike, and the stand-in is the heaviest
   stage's memory.
3. **Its cost per part** (:mod:`autopar.passes.pipeline.stage_profile`): embedding, one block, head,
   each with forward/backward time per microbatch, gradient sync per step, state, kept
   activations and transients; one such profile per recomputation mode the stand-in was
   planned in (the layout priced again in each mode of the same ZeRO stage,
   :func:`mode_profiles`), since a stage holding fewer microbatches than the busiest rank
   may afford to recompute less.
4. **Slicing** (:mod:`autopar.passes.pipeline.stage_split`): for every schedule torch ships
   (``GPipe``, ``1F1B``, ``Interleaved1F1B``, ``InterleavedZeroBubble``, ``LoopedBFS``,
   ``ZBVZeroBubble``, ``DualPipeV``) and stages per rank ``v``, the DP cuts the blocks into
   ``p*v`` contiguous stages minimising Alpa's objective under the memory limit (each stage
   with the in-flight count its schedule gives it, and in the fastest mode's profile that
   fits it there), the first stage also holding the embedding and the last the head, so a
   heavy head gets fewer blocks. The best few splits are replayed in the schedule model
   (:mod:`autopar.passes.pipeline.schedule`), each stage priced by its own profile, with the
   boundary sends priced on the ``pp`` axis's link and the weight-gradient share the
   zero-bubble schedules defer read off the graph; the split in the layout's one mode
   throughout is weighed too, and kept where it replays faster. Each stage's mode is
   recorded (``PipelineStage.recompute``) and the runtime runs it.
5. The fastest (schedule, v, m) that fits wins; the plan records every option weighed and why.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn as nn

from autopar.capture.depth_proxy import longest_block_list, stage_representative, traced_blocks
from autopar.capture.joint import capture
from autopar.ir.errors import PlanError
from autopar.ir.mesh import Mesh
from autopar.ir.options import Options
from autopar.ir.pipeline_mesh import pipeline_axis, stage_mesh
from autopar.ir.plan import PipelinePlan, PipelineStage, PlanCost, ScheduleOption
from autopar.ir.units import fmt_bytes
from autopar.models.reference_plans import megatron_pipeline_layouts
from autopar.passes.pipeline.cost import (
    Option,
    Overheads,
    chunk_cost,
    microbatch_counts,
    overheads,
    planned_stages,
    replay,
    schedule_names,
    schedule_options,
    stage_time,
    stand_in_flight,
    weigh,
)
from autopar.passes.pipeline.schedule import PipelineSchedule, textbook_bubble
from autopar.passes.pipeline.stage_profile import StageProfile, stage_profile
from autopar.passes.pipeline.stage_split import schedule_in_flight
from autopar.passes.problem.types import ShardingProblem
from autopar.planning.memory_fit import memory_limit
from autopar.planning.modes import least_need
from autopar.planning.planner import Planned, carried_choice, make_plan

__all__ = ["batch_size", "microbatch_counts", "pipeline_axis",
           "plan_pipeline", "planned_stages", "predict_split", "stage_mesh", "stand_in_graph"]

MICROBATCH_CHOICES = 2  # microbatch counts planned when the user gives none (at most two)


def plan_pipeline(
    model: nn.Module,
    mesh: Mesh,
    example_inputs: tuple = (),
    example_kwargs: dict | None = None,
    loss_fn: Callable | None = None,
    options: Options | None = None,
    *,
    references: dict[str, Any] | None = None,
    model_name: str = "",
    microbatch_choices: int = MICROBATCH_CHOICES,
    trace_cache: dict | None = None,
    stage_modes: bool = True,
) -> Planned:
    """Plan ``model`` on ``mesh`` as a pipeline over its ``pp`` axis (module docstring).

    Args:
        model: the module, with a list of repeated blocks to cut into stages.
        mesh: a :class:`~autopar.ir.mesh.Mesh` with a ``pp`` axis of size > 1.
        example_inputs, example_kwargs: the whole step's inputs (the batch is cut into
            microbatches).
        loss_fn: as :func:`autopar.planning.planner.make_plan`'s.
        options: :class:`~autopar.ir.options.Options`; ``pipeline.schedule`` (a torch
            schedule name), ``pipeline.microbatches`` and ``pipeline.virtual`` (stages per
            rank) fix those choices, None leaves them to the planner. The other groups are
            :func:`~autopar.planning.planner.make_plan`'s, applied to the stand-in stage.
        references: laid out on the stage submesh and weighed as pipelines too, each with its
            best schedule (one is kept where it is faster).
        model_name: recorded in the plan.
        microbatch_choices: how many microbatch counts are planned where none is fixed
            (:func:`microbatch_counts`).
        trace_cache: a dict that keeps the traced stand-ins for later calls (a mesh-shape
            search plans the same model many times).
        stage_modes: each stage recomputes in the fastest mode planned that fits its own
            microbatches in flight (False: every stage in its layout's one mode, as the
            stand-in was planned for the busiest rank).

    Returns:
        A :class:`~autopar.planning.planner.Planned` whose plan's placements are one stage's
        on the stage submesh; ``plan.decided.pipeline`` holds the stages and schedule.

    Example::

        mesh = Mesh((2, 4), ("pp", "dp"), "h100")
        planned = plan_pipeline(model, mesh, (tokens, targets),
                                options=Options.of(schedule="1F1B", microbatches=8))
        planned.plan.decided.pipeline.stages
    """
    options = (options if options is not None else Options()).with_deadline()  # the call's
    fixed = options.pipeline
    t0 = time.perf_counter()
    axis = pipeline_axis(mesh)
    if axis is None:
        raise PlanError(f"mesh {mesh.describe()} has no pipeline axis of size > 1: name one "
                        "axis 'pp' (e.g. --mesh pp=2,dp=4), or plan it with make_plan")
    p = mesh.shape[axis]
    sub = stage_mesh(mesh, axis)
    found = longest_block_list(model)
    if found is None:
        raise PlanError("the model has no list of repeated blocks (an nn.ModuleList of one "
                        "block type) to cut into pipeline stages: keep its blocks in one "
                        "nn.ModuleList (numbered attributes, self.block0, self.block1, are not "
                        "cut yet), or plan it without a 'pp' axis")
    n_blocks = len(found[1])
    if p > n_blocks:
        raise PlanError(f"{p} pipeline stages but the model has {n_blocks} blocks: use "
                        f"pp <= {n_blocks} (and give the other devices to dp or tp)")
    batch = batch_size(example_inputs, example_kwargs)
    dp = sub.data_parallel_size
    counts = microbatch_counts(batch, dp, p, fixed.microbatches)[:max(1, microbatch_choices)]
    names = schedule_names(fixed.schedule)
    limit, source = memory_limit(options.memory.budget, mesh.device)
    prec = options.resolved_precision(mesh.device)
    # Megatron's layouts (tensor parallel, distributed optimizer; selective and full
    # recomputation) are always weighed, so the plan is never slower than they are; they are
    # listed among the references only where asked for (--compare)
    asked_refs = set(references or ())
    references = {**megatron_pipeline_layouts(model, sub.shape, sub.axes), **(references or {})}

    best: _Best | None = None
    # whether the retry in full recomputation below could weigh a layout this pass did not:
    # only where some microbatch count's stand-in plan is in a mode that recomputes less
    leaner_untried = False
    weighed_all: list[Option] = []  # the solver's layout's, for the table
    ref_costs: dict[str, PlanCost] = {}  # fixed layouts as pipelines, each at its best
    failures: list[str] = []
    timings = {"trace_s": 0.0, "build_s": 0.0, "solve_s": 0.0, "references_s": 0.0,
               "pipeline_s": 0.0}
    for m in counts:
        scheds = schedule_options(names, p, m, n_blocks, fixed.virtual)
        if not scheds:
            failures.append(f"m={m}: no schedule of {', '.join(names)} runs {p} stages "
                            f"of {n_blocks} blocks")
            continue
        flight = stand_in_flight(scheds)
        t1 = time.perf_counter()
        pg = stand_in_graph(model, example_inputs, example_kwargs, loss_fn, prec, batch // m,
                            math.ceil(n_blocks / p), options.search.max_layers, flight,
                            trace_cache, microbatches=m)
        timings["trace_s"] += time.perf_counter() - t1
        # where no mode's leanest plan fits the stand-in, none of its plans can: nothing to
        # solve (a valid bound, modes.least_need; the retry below plans a subset of modes)
        need = least_need(pg, sub, options.memory, limit)
        if need is not None:
            failures.append(f"m={m}: no plan of the stand-in stage fits {fmt_bytes(limit)} per "
                            f"device on the stage submesh {sub.describe()}: any plan holds at "
                            f"least {fmt_bytes(need)} (every tensor at its leanest, in every "
                            "recomputation mode)")
            continue
        try:
            planned = make_plan(model, sub, options=options, graph=pg,
                                model_name=model_name, references=references)
        except PlanError as e:
            # nothing fit the stand-in, though every mode was planned (make_plan goes on
            # through its modes while none fits), the retry's full recomputation among them
            failures.append(f"m={m}: {e}")
            continue
        leaner_untried |= planned.plan.decided.recompute.mode != "full"
        for k in ("build_s", "solve_s", "references_s"):
            timings[k] += planned.plan.provenance.timings.get(k, 0.0)
        t2 = time.perf_counter()
        # the solver's layout, then each reference layout (as completed in its own
        # recomputation mode), weighed alike as pipelines: the fastest that fits is kept,
        # so the plan is never slower than a fixed layout that fits
        layouts = [("", planned.problem, planned.node_choice)] + [
            (name, sp, choice) for name, (sp, choice) in planned.reference_problems.items()]
        for name, sp, choice in layouts:
            prof = stage_profile(sp, choice, proxy_blocks(planned), dp)
            over = overheads(prof.boundary_bytes, mesh, axis, prof.tied_bytes)
            # the layout also in each other recomputation mode planned: a stage holding
            # fewer microbatches than the busiest may recompute less
            profs = mode_profiles(planned, sp, choice, prof, dp) if stage_modes else [prof]
            # a layout that cannot be kept (be faster than the best, nor tie with it at the
            # key's 6 digits, where the leaner would win) is weighed only to be listed, as
            # its policy runs, and only where asked
            hopeless = name and best is not None and busy_bound(
                profs, n_blocks, p, m, over) > best.option.step_s * (1 + 1e-5)
            if hopeless and name not in asked_refs:
                continue
            pairs = [_weigh_modes(sched, profs[:1] if hopeless else profs, n_blocks, limit,
                                  over) for sched in scheds]
            weighed = [kept for _, kept in pairs]
            if not name:
                weighed_all += weighed
            fitting = [o for o in weighed if o.split is not None]
            if name:
                # a fixed layout is listed as its policy runs (one mode for every stage); a
                # layout that fits no split is shown split at its best with no limit,
                # under one 1F1B schedule only (replaying every schedule of a layout that
                # runs nowhere cost 405B on pp=16 half its pipeline time)
                as_is = [one for one, _ in pairs if one.split is not None]
                shown = min(as_is or [weigh(sched, prof, n_blocks, None, over)
                                      for sched in _display_schedules(scheds)],
                            key=lambda o: o.step_s)
                got = _pipeline_cost(planned.plan.provenance.references[name], shown)
                if name not in ref_costs or got.step_s < ref_costs[name].step_s:
                    ref_costs[name] = got
            for opt in fitting:
                # ties (within a part in a million) go to the leaner option (1F1B over
                # GPipe), then to the solver's layout
                key = (float(f"{opt.step_s:.6g}"), opt.mem_bytes, bool(name))
                if best is None or key < best.key:
                    best = _Best(key, planned, name, opt, prof, over)
        timings["pipeline_s"] += time.perf_counter() - t2
    if best is None and options.memory.recompute == "auto" and leaner_untried:
        # the stand-in chose its recomputation for one microbatch in flight; where that
        # mode fits no split with the schedules' microbatches in flight, plan the leanest.
        # Not where every stand-in plan already recomputes fully, or nothing fit it: the
        # retry would plan the modes this pass planned (full recomputation, with and without
        # re-gathering, is among auto's) and weigh the same layouts again (llama3-405b on
        # 8192 H100s: 30 s of the search's 150 s of CPU, seven shapes that fail either way)
        return plan_pipeline(model, mesh, example_inputs, example_kwargs, loss_fn,
                             options.replace(recompute="full"),
                             references={k: v for k, v in references.items() if k in asked_refs},
                             model_name=model_name, microbatch_choices=microbatch_choices,
                             trace_cache=trace_cache, stage_modes=stage_modes)
    if best is None:
        raise PlanError(_no_fit(failures, weighed_all, limit, p, n_blocks))
    planned = best.planned
    if best.reference:
        assert planned.as_reference is not None
        planned = planned.as_reference(best.reference)
        # the solver's layout's options do not describe the layout kept
        weighed_all = [o for o in weighed_all if o.split is None] + [best.option]
    timings["total_s"] = time.perf_counter() - t0
    pipe = _pipeline_record(mesh.axes[axis], best.option, best.profile, n_blocks, weighed_all,
                            best.overheads, kept=best.reference)
    plan = planned.plan
    pv = plan.provenance
    plan = replace(
        plan,
        decided=replace(plan.decided, pipeline=pipe,
                        input_shapes=_full_shapes(plan.decided.input_shapes, batch)),
        predicted=replace(plan.predicted, cost=_pipeline_cost(plan.predicted.cost, best.option)),
        provenance=replace(pv, timings=timings, memory_budget=limit,
                           references={k: c for k, c in ref_costs.items() if k in asked_refs},
                           memory_limit_source=source, model=model_name or pv.model))
    return replace(planned, plan=plan)


@dataclass(frozen=True)
class _Best:
    key: tuple[float, float, bool]
    planned: Planned
    reference: str  # "" for the solver's own layout
    option: Option
    profile: StageProfile
    overheads: Overheads


def _weigh_modes(sched: PipelineSchedule, profs: list[StageProfile], n_blocks: int,
                 limit: float | None, over: Overheads) -> tuple[Option, Option]:
    """The schedule's best split in the layout's own mode throughout, and the option kept:
    the best split with each stage in the fastest mode that fits it where that replays
    faster (the DP ranks splits by Alpa's objective, the replay decides: more choices per
    stage need not replay faster), else the first."""
    if len(profs) == 1:
        one = weigh(sched, profs[0], n_blocks, limit, over)
        return one, one
    per_stage = weigh(sched, profs, n_blocks, limit, over)
    if per_stage.split is None:  # no split fits with any mode per stage: none with one
        return per_stage, per_stage
    one = weigh(sched, profs[0], n_blocks, limit, over)
    if one.split is not None and one.step_s <= per_stage.step_s:
        return one, one
    return one, per_stage


def _display_schedules(scheds: list[PipelineSchedule]) -> list[PipelineSchedule]:
    """The schedule a layout that fits nowhere is shown under: 1F1B (the leanest that runs
    every forward early), else interleaved 1F1B, else the first weighed."""
    for name in ("1F1B", "Interleaved1F1B"):
        for s in scheds:
            if s.name == name:
                return [s]
    return list(scheds[:1])


def busy_bound(prof: StageProfile | Sequence[StageProfile], n_blocks: int, p: int, m: int,
               over: Overheads) -> float:
    """A lower bound on the step of any split and schedule of ``prof`` (or of any stage's
    choice among several profiles) over ``p`` ranks and ``m`` microbatches: the ranks' work,
    each part at its fastest, spread evenly, at the fastest a rank computes. (A rank runs its
    actions one at a time, and the replay only adds to them: sends, overheads, waits, the
    gradient sync.)"""
    profs = [prof] if isinstance(prof, StageProfile) else list(prof)
    work = sum(min(q.part(part).time_s for q in profs) * k
               for part, k in (("pre", 1), ("block", n_blocks), ("post", 1)))
    return m * work / p / max(over.speed or (1.0,))


def mode_profiles(planned: Planned, sp: ShardingProblem, choice: list[int],
                  prof: StageProfile, dp: int) -> list[StageProfile]:
    """``prof``, the profile of the layout ``choice`` on ``sp`` (one of the modes
    ``planned`` planned), then that layout priced in each other recomputation mode planned
    with the same ZeRO stage and offload (a stage's parameters are placed and stored alike,
    only what its backward recomputes differs), each marked with its mode. A stage program
    re-solves its activations in its own mode around the pinned parameters, so the layout
    carried as it is prices them no better than they run. A layout of a mode not planned
    (an exact reference, priced apart) keeps its one profile."""
    main = next((mode for mode, q in planned.mode_problems.items() if q is sp), None)
    if main is None:
        return [prof]
    out = [replace(prof, recompute=main.recompute)]
    for mode, other in planned.mode_problems.items():
        if mode == main or mode.plain != main.plain:
            continue
        carried = carried_choice(other, sp, choice)
        out.append(replace(stage_profile(other, carried, proxy_blocks(planned), dp),
                           recompute=mode.recompute))
    return out


def proxy_blocks(planned: Planned) -> int:
    assert planned.graph.proxy is not None
    return planned.graph.proxy.represented


def _pipeline_cost(stand_in: PlanCost, opt: Option) -> PlanCost:
    """A pipeline's cost: the replayed step (gradient sync included), its busy time split as
    the stage's own compute and communication, and the largest rank's memory."""
    share = stand_in.comm_s / stand_in.step_s if stand_in.step_s > 0 else 0.0
    busy = opt.step_s - opt.sync_s
    return PlanCost(opt.step_s, busy * (1 - share), busy * share + opt.sync_s, opt.mem_bytes)


def stand_in_graph(model: nn.Module, inputs: tuple, kwargs: dict | None, loss_fn: Any,
                   prec: Any, mb_size: int, blocks: int, max_layers: int | None,
                   in_flight: float, cache: dict | None = None, microbatches: int = 1) -> Any:
    """The stand-in of a stage of ``blocks`` blocks, traced at microbatches of ``mb_size``
    (:func:`autopar.capture.depth_proxy.stage_representative`), ``microbatches`` per step
    (what runs once per step weighs 1/microbatches in its plan). The trace depends on the
    microbatch and the blocks traced only, so ``cache`` keeps it for other stage sizes and
    in-flight counts: a copy of the graph carries each call's own proxy."""
    batch = batch_size(inputs, kwargs)
    key = ("stage", mb_size, traced_blocks(blocks, max_layers), prec)
    hit = cache.get(key) if cache is not None else None
    with stage_representative(model, blocks, max_layers, in_flight) as proxy:
        if hit is None:
            hit = capture(model, _microbatch(inputs, batch, mb_size),
                          _microbatch(kwargs or {}, batch, mb_size), loss_fn, precision=prec)
            if cache is not None:
                cache[key] = hit
    pg = copy.copy(hit)
    pg.proxy = replace(proxy, microbatches=microbatches)
    pg.all_param_names = [n for n, q in model.named_parameters() if q.requires_grad]
    return pg


def predict_split(planned: Planned, mesh: Mesh, ranges: Sequence[tuple[int, int]]
                  ) -> tuple[float, float]:
    """(step, bubble) a pipeline plan predicts for other block ranges than its own, with its
    schedule and stage layout, every stage in the layout's own recomputation mode (not each
    stage's choice): to weigh a hand-made split (equal block counts) against it."""
    pipe = planned.plan.decided.pipeline
    if pipe is None:
        raise PlanError("predict_split needs a pipeline plan (made by plan_pipeline)")
    axis = pipeline_axis(mesh)
    if axis is None:
        raise PlanError(f"mesh {mesh.describe()} has no pipeline axis")
    n_blocks = pipe.stages[-1].end_block
    sched = PipelineSchedule(pipe.schedule, pipe.size, pipe.virtual, pipe.microbatches)
    if len(ranges) != sched.num_stages:
        raise PlanError(f"{len(ranges)} block ranges for {sched.num_stages} stages")
    prof = stage_profile(planned.problem, planned.node_choice, proxy_blocks(planned),
                         stage_mesh(mesh, axis).data_parallel_size)
    step, bubble, _ = replay(sched, prof, ranges, n_blocks,
                             overheads(prof.boundary_bytes, mesh, axis, prof.tied_bytes))
    return step, bubble


def _pipeline_record(axis: str, chosen: Option, prof: StageProfile, n_blocks: int,
                     options: list[Option], over: Overheads, kept: str = "") -> PipelinePlan:
    sched, split = chosen.schedule, chosen.split
    assert split is not None
    held = schedule_in_flight(sched)
    stages = []
    last = len(split.ranges) - 1
    tied = sched.stage_rank(0) != sched.stage_rank(last)  # end copies summed across ranks
    for k, ((i, j), sub) in enumerate(zip(split.ranges, split.submeshes)):
        own = sub if isinstance(sub, StageProfile) else prof  # the profile the DP chose
        fwd, _, sync, _, _ = chunk_cost(own, i, j, n_blocks)
        sync += over.tied_s if tied and k in (0, last) else 0.0
        stages.append(PipelineStage(
            k, sched.stage_rank(k), i, j, i == 0, j == n_blocks, split.time_s[k],
            split.memory_bytes[k], round(held(k, sched.num_stages)), fwd,
            own.block.recompute_s * (j - i), sync,
            stage_time(sched, own, i, j, n_blocks, over).split_s, own.recompute))
    fitting = sorted((o for o in options if o.split is not None), key=lambda o: o.step_s)
    runner_up = next((o for o in fitting if o is not chosen), None)
    reason = f"the fastest of {len(fitting)} options that fit"
    if kept:
        reason = (f"reference layout {kept}, as a pipeline faster than the solver's own "
                  "layout's fastest option that fits")
    if runner_up is not None:
        gain = runner_up.step_s / chosen.step_s - 1
        reason += (f"; next {_label(runner_up.schedule)} is {gain:.1%} slower")
    left_out = [o for o in options if o.split is None]
    if left_out:
        reason += f"; {len(left_out)} left out (do not fit or cannot be cut)"
    return PipelinePlan(
        axis=axis, size=sched.p, schedule=sched.name, virtual=sched.v, microbatches=sched.m,
        stages=tuple(stages), rank_memory_bytes=split.rank_memory_bytes, step_s=chosen.step_s,
        bubble=chosen.bubble, textbook_bubble=textbook_bubble(sched.p, sched.m, sched.v),
        send_s=over.send_s, sync_s=chosen.sync_s, reason=reason,
        weight_share=prof.weight_share if prof.splits_backward else 0.0,
        options=tuple(ScheduleOption(o.schedule.name, o.schedule.v, o.schedule.m, o.step_s,
                                     o.bubble, o.mem_bytes, o.note)
                      for o in sorted(options, key=lambda o: (o.step_s, _label(o.schedule)))),
        action_s=over.action_s, post_s=over.post_s, speed=over.speed or (),
    )


def _label(s: PipelineSchedule) -> str:
    return f"{s.name} v={s.v} m={s.m}"


def _no_fit(failures: list[str], options: list[Option], limit: float | None, p: int,
            n_blocks: int) -> str:

    lim = "no limit" if limit is None else fmt_bytes(limit)
    lines = [f"no pipeline plan of {n_blocks} blocks on {p} stages fits {lim} per device"]
    lines += failures[:3]
    notes = sorted({o.note for o in options if o.note})
    lines += notes[:2]
    fix = ("more pipeline stages (a larger pp) or more devices per stage, fewer microbatches "
           "in flight (1F1B rather than GPipe), a smaller batch, or --recompute full")
    return "; ".join(lines) + f". Try {fix}"


def batch_size(inputs: tuple, kwargs: dict | None) -> int:
    for t in [*inputs, *(kwargs or {}).values()]:
        if isinstance(t, torch.Tensor) and t.dim() >= 1:
            return int(t.shape[0])
    raise PlanError("a pipeline needs a batch to cut into microbatches: give example inputs "
                    "whose first dimension is the batch")


def _microbatch(x: Any, batch: int, size: int) -> Any:
    """``x`` with every tensor of leading dimension ``batch`` cut to its first ``size``."""
    if isinstance(x, torch.Tensor):
        return x[:size] if x.dim() >= 1 and x.shape[0] == batch else x
    if isinstance(x, (list, tuple)):
        return type(x)(_microbatch(v, batch, size) for v in x)
    if isinstance(x, dict):
        return {k: _microbatch(v, batch, size) for k, v in x.items()}
    return x


def _full_shapes(shapes: dict[str, list[int]], batch: int) -> dict[str, list[int]]:
    """The inputs' shapes as the user passes them: the whole batch, not a microbatch."""
    return {k: ([batch, *v[1:]] if v else v) for k, v in shapes.items()}
