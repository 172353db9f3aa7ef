"""``autopar.parallelize``: trace, plan (or load a plan), lower, and wrap a model for a mesh.

Planning runs once per process on fake tensors; with several processes rank 0 solves and
broadcasts the plan JSON, because the ILP solver runs several workers with a time limit and is
not guaranteed to return the same optimum twice (every rank must run the same program).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from autopar.capture.joint import capture
from autopar.capture.skeleton import meta_skeleton
from autopar.ir import errors
from autopar.ir.devices import PROFILES
from autopar.ir.errors import MeshError, PlanError
from autopar.ir.graph import PlanGraph
from autopar.ir.mesh import Mesh
from autopar.ir.options import Options
from autopar.ir.placements import Spec
from autopar.ir.plan import Plan, SolverInfo
from autopar.ir.precision import Precision
from autopar.ir.stage_kind import plan_runs_as_program
from autopar.passes.memory.recompute import apply_recompute
from autopar.planning.stage_plans import StagePlansAsked, pinned_stage_plans
from autopar.report.plan_progress import PlanProgress, plan_progress
from autopar.runtime import _compat
from autopar.runtime.launch import device_type, ensure_process_group, resolve_mesh
from autopar.runtime.parallel_module import ParallelModule

if TYPE_CHECKING:
    from autopar.planning.modes import Mode
    from autopar.runtime.pipeline.module import PipelineModule
    from autopar.runtime.pipeline.runner import PipelineRunner

def parallelize(
    model: nn.Module,
    mesh: Mesh | Any,
    example_inputs: tuple = (),
    example_kwargs: dict | None = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    plan: Plan | str | Path | None = None,
    options: Options | None = None,
    *,
    compile: bool = False,
    profile: str | Path | None = None,
    **option_kwargs: Any,
) -> ParallelModule | PipelineModule:
    """``model`` made to train on ``mesh`` (an :class:`autopar.Mesh` or a torch DeviceMesh,
    or a number of devices: every ``pp x dp x tp`` shape of them is planned and the fastest
    that the runtime runs is taken, :mod:`autopar.planning.shapes`).

    Args:
        model: the module to train; its parameters are replaced in place by DTensors.
        mesh: an :class:`autopar.Mesh`, a torch ``DeviceMesh``, or a number of devices.
        example_inputs, example_kwargs: one step's inputs, as the model is called.
        loss_fn: turns the model's output into the loss, ``loss_fn(output, target)`` with
            the last example input as the target (None: the model returns it). On a ``pp``
            mesh it is what pipelines a model of a family autopar does not know.
        plan: a :class:`Plan` or a plan JSON path to run as given (None: plan here).
        options: an :class:`autopar.Options` (None: every default).
        compile: compile each rank's program with Inductor (below).
        profile: a directory to write one profiled step's traces to (below).
        **option_kwargs: any of :class:`autopar.Options`' flat keywords (``memory_budget``,
            ``time_limit_s``, ``precision``, ``reduce_dtype``, ``recompute``, ``zero``,
            ``offload``, ``schedule``, ``microbatches``, ``virtual``, ``min_gain``,
            ``workers``, ``max_layers``), applied over ``options``; another keyword raises
            TypeError naming the valid ones.

    Returns:
        A :class:`~autopar.runtime.parallel_module.ParallelModule`, or a
        :class:`~autopar.runtime.pipeline.module.PipelineModule` on a mesh with a ``pp`` axis.

    Example::

        mesh = autopar.Mesh((2, 4), ("dp", "tp"), device="h100")
        model = autopar.parallelize(model, mesh, example_inputs=(tokens, targets),
                                    memory_budget=40 * 2**30, recompute="selective")
        # the same, as a value: options=autopar.Options.of(memory_budget=..., recompute=...)

    ``plan=None`` solves a plan; a :class:`Plan` or a plan JSON path is used as given, after
    checking it was made for this model, these input shapes and this mesh. The model's
    parameters are replaced in place by DTensors (keep a copy if you need the original).
    Calling the result with other input shapes retraces and replans, keeping the parameter
    layouts, unless a plan was given (then it raises :class:`PlanError`).

    ``compile=True`` compiles the per-rank program with Inductor between its collectives
    (fused C++ kernels on CPU, Triton on CUDA; see :mod:`autopar.runtime.inductor_segments`):
    faster steps, after a compile of some seconds on the first call. Under ``LocalTensorMode``
    (simulated ranks) the program runs eagerly.

    ``memory_budget``: bytes per device the plan must fit (default: the device profile's
    capacity less a reserve; ``math.inf``: no limit). ``precision``: ``"fp32"``, ``"bf16"`` or
    ``"fp16"`` (default: bf16 on GPU profiles, fp32 on ``cpu``), ``reduce_dtype`` the
    gradients' reduction dtype (``"fp32"`` default, or the compute dtype); fp16 scales the
    loss dynamically and skips a step whose gradients overflow (:mod:`autopar.runtime.optim.loss_scale`;
    the module's ``loss_scale`` holds the scale and the count of skipped steps). ``recompute``: ``"auto"`` (only
    where the plan would not fit otherwise), ``"none"``, ``"selective"`` or ``"full"``.
    ``zero``: the ZeRO stage of the parameters the plan stores split (``"auto"``, 1, 2, 3);
    ``offload``: optimizer state in host memory (``"auto"``: only where nothing fits
    without; ``"none"``; ``"optimizer"``): build the optimizer with
    ``model.make_optimizer(torch.optim.AdamW, ...)`` so that it keeps that state on the host.
    A plan given runs with the precision, recomputation and parameter state it records.
    ``time_limit_s``: seconds the whole planning may take (the best plan so far is kept at the
    limit, :mod:`autopar.ir.deadline`); the other options are :class:`autopar.Options`'.

    ``profile``: a directory: the second training step's forward and backward (the first
    pays one-off costs) run under ``torch.profiler`` and each rank writes its trace to
    ``DIR/trace_rank{r}.json``, with ranges named as the plan's predicted timeline, which
    rank 0 writes to ``DIR/predicted.json`` (:mod:`autopar.runtime.observe.profiling`,
    ``docs/timeline.md``). On a pipeline the second call's schedule step is written per
    action instead (each forward and backward under torch's action name, the gradient sync),
    beside the plan's predicted step with the same names (:mod:`autopar.report.pipeline_timeline`).

    A mesh with a ``pp`` axis of size > 1 (or a plan with a pipeline section) trains the model
    as a pipeline: :func:`autopar.planning.pipeline.plan_pipeline` picks the stages, the
    schedule (``schedule=``: torch's name, ``"1F1B"``, ``"ZBVZeroBubble"``, ...), the
    micro-batches (``microbatches=``) and the stages per rank (``virtual=``), or takes them
    from ``plan=``, and the result is a :class:`~autopar.runtime.pipeline.module.PipelineModule`
    (``docs/pipelines.md``). Stages are replicated over ``dp`` where the plan keeps their
    parameters whole, computing in the plan's precision (fp32 by default there, or bf16) and
    recomputing as it says, as the SPMD runtime does; else each runs its own plan on the
    stage submesh with the parameters placed as planned, in the plan's precision and
    recompute mode too. What the runtime cannot run as planned is refused with the fix. The
    model itself is left as it was: train the returned module's parameters.
    """
    # time_limit_s bounds the whole call from here (autopar.ir.deadline); a planning call of
    # more than a few seconds shows its phase and best plan on rank 0's terminal
    options = Options.of(options, **option_kwargs)
    progress = _planning_progress(options) if plan is None else None
    try:
        return _parallelize(model, mesh, example_inputs, example_kwargs, loss_fn, plan,
                            options.with_deadline(progress), compile, profile)
    finally:
        if progress is not None:
            progress.close()


def _planning_progress(options: Options) -> PlanProgress | None:
    """The terminal display of ``parallelize``'s planning (:mod:`autopar.report.plan_progress`):
    rank 0 only, on a terminal only, and only for the call that owns the deadline."""
    if options.search.deadline is not None:
        return None
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return None
    return plan_progress(options.search.time_limit_s)


def _parallelize(model: nn.Module, mesh: Mesh | Any, example_inputs: tuple,
                 example_kwargs: dict | None, loss_fn: Callable[..., torch.Tensor] | None,
                 plan: Plan | str | Path | None, options: Options, compile: bool,
                 profile: str | Path | None) -> ParallelModule | PipelineModule:
    """:func:`parallelize` once its options carry the call's deadline."""
    if isinstance(mesh, int) and not isinstance(mesh, bool):
        if plan is not None:
            raise PlanError("plan= fixes the mesh it was made for: give that mesh, not a "
                            "device count")
        plan = _plan_for_devices(model, mesh, tuple(example_inputs), example_kwargs, loss_fn,
                                 options)
        shape, axes = plan.full_mesh
        mesh = init_device_mesh(device_type(), shape, mesh_dim_names=axes)
    device_mesh, amesh = resolve_mesh(mesh)
    example_inputs = tuple(example_inputs)
    if plan is not None and not isinstance(plan, Plan):
        plan = Plan.load(plan)
    if _is_pipeline(amesh, plan):
        if compile:
            raise PlanError("compile= does not apply to pipelines yet (their stages run "
                            "eagerly): leave it out, or use a mesh without a 'pp' axis")
        if options.precision.compute is None:  # pipelines compute in fp32 unless asked
            options = options.replace(precision="fp32")
        piped = _pipeline(model, device_mesh, amesh, example_inputs, example_kwargs, plan,
                          options, loss_fn)
        piped.profile = profile  # the second call's step, measured beside the plan's
        return piped
    if options.pipeline.fixed:
        raise PlanError("schedule=, microbatches= and virtual= choose a pipeline: give a mesh "
                        "with a 'pp' axis (e.g. pp=2,dp=2), or leave them out")
    skeleton = meta_skeleton(model)
    with _compat.outside_local_tensor_mode():
        if plan is None:
            prec = options.resolved_precision(amesh.device)
            graph = capture(model, example_inputs, example_kwargs, loss_fn, precision=prec)
            _warn_if_priced_for_another_device(amesh, device_mesh.device_type)
            the_plan = _agree(lambda: _make_plan(model, amesh, graph, options))
            replan = _replanner(skeleton, amesh, loss_fn, options, prec, plan_mode(the_plan))
        else:
            the_plan = plan
            graph = capture(model, example_inputs, example_kwargs, loss_fn,
                            precision=the_plan.decided.precision)
            replan = None
        graph = apply_recompute(graph, the_plan.decided.recompute.nodes)  # as the plan was made
    check_plan_mesh(the_plan, amesh)
    if the_plan.provenance.missing_rules:
        warnings.warn(
            "no sharding rule for " + ", ".join(sorted(the_plan.provenance.missing_rules))
            + ": these ops "
            "run replicated (whole on every rank), which is correct but may be slow",
            stacklevel=2)
    if the_plan.decided.param_state.offloaded:
        warnings.warn(
            f"the plan keeps the optimizer state of {len(the_plan.decided.param_state.offloaded)} "
            "parameters in host memory: build the optimizer with "
            "model.make_optimizer(torch.optim.AdamW, ...), which does (a plain torch "
            "optimizer would keep it on the device, beyond the plan's memory)", stacklevel=2)
    pm = ParallelModule(model, device_mesh, graph, the_plan, replan, compile)
    if profile is not None:
        from autopar.runtime.observe.profiling import arm

        arm(pm, profile, amesh)
    return pm


# --- pipelines --------------------------------------------------------------------------------


def _is_pipeline(mesh: Mesh, plan: Plan | None) -> bool:
    from autopar.planning.pipeline import pipeline_axis

    return pipeline_axis(mesh) is not None or (
        plan is not None and plan.decided.pipeline is not None)


def _pipeline(model: nn.Module, device_mesh: Any, amesh: Mesh, args: tuple, kwargs: dict | None,
              plan: Plan | None, options: Options, loss_fn: Callable | None = None
              ) -> PipelineModule:
    """The pipeline branch of :func:`parallelize`: plan (rank 0, shared) or check the plan
    given, then build this rank's stages as the plan says (``loss_fn``: the user's, from the
    last stage's output and the targets; None: the model's own loss)."""
    from autopar.planning.pipeline import plan_pipeline
    from autopar.runtime.pipeline import module as pm

    pm.PipelineInputs.of(args, kwargs)
    if plan is not None:
        shapes = [t.shape for t in [*args, *(kwargs or {}).values()]]
        pm.check_plan(plan, amesh, model, shapes, _fixed(options))
    pm.check_mesh(amesh)  # before any planning: what the runtime cannot run at all
    if plan is None:
        skeleton = meta_skeleton(model)
        _warn_if_priced_for_another_device(amesh, device_mesh.device_type)

        def make() -> Plan:
            made = plan_pipeline(skeleton, amesh, args, kwargs, loss_fn, options=options,
                                 model_name=type(model).__name__).plan
            runs = pm.runnable_option(made)
            if runs is None or options.pipeline.schedule is not None:
                return made  # runs as chosen, or as asked (then refused, with the fix)
            # stages that recompute selectively cannot split their backward: the fastest
            # option weighed that they run, planned with its choices fixed
            return plan_pipeline(skeleton, amesh, args, kwargs, loss_fn,
                                 options=options.replace(schedule=runs.schedule,
                                                         virtual=runs.virtual,
                                                         microbatches=runs.microbatches),
                                 model_name=type(model).__name__).plan

        with _compat.outside_local_tensor_mode():
            plan = _agree(make)
    inputs, build = pm.build_options(model, plan, args, kwargs, loss_fn)
    asked = None
    if plan_runs_as_program(plan):  # each stage its plan, placed as the pipeline plan says
        asked = pinned_stage_plans(plan, options.search.time_limit_s)
    tokens, targets = inputs.split(args, kwargs or {})
    runner = build_pipeline(model, (tokens, targets), device_mesh, **build, stage_plans=asked,
                            plan_time_limit_s=options.search.time_limit_s)
    return pm.PipelineModule(runner, plan, inputs, model_keys=list(model.state_dict()))


def build_pipeline(model: nn.Module, example_inputs: tuple, mesh: Any,
                   split: Any = None, schedule: str = "1f1b", n_microbatches: int = 4,
                   virtual: int | None = None, frontend: str = "auto",
                   loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
                   stage_plans: StagePlansAsked = None, plan_time_limit_s: float = 30.0,
                   precision: Precision | str | None = None, recompute: str = "none",
                   ) -> PipelineRunner:
    """``model`` as a pipeline on ``mesh``, its stage plans made where its stages run one
    each: the runtime's :func:`~autopar.runtime.pipeline.runner.build_pipeline` (the same
    arguments, which it documents), but ``stage_plans`` as asked: each stage's plan (stage
    index -> Plan), a callable ``(stage, graph, submesh) -> Plan`` run on rank 0 with the
    stage's graph, its boundary pinned, or None: the planner's
    (:func:`autopar.planning.stage_plans.plan_stages`, no memory limit,
    ``plan_time_limit_s``). Where the mesh has a ``tp`` axis of size > 1 or ``stage_plans``
    is given, every stage's plan is made on rank 0, checked, and the same plans handed to
    every rank's runtime."""
    from autopar.runtime.pipeline import runner as pr

    layout = pr.pipeline_layout(model, example_inputs, mesh, split, schedule, n_microbatches,
                                virtual, frontend, loss_fn, stage_plans is not None, precision,
                                recompute)
    planned = None
    if layout.programs:
        planned = _plan_stage_programs(model, example_inputs, layout, stage_plans,
                                       plan_time_limit_s)
    return pr.build_from_layout(model, example_inputs, layout, planned)


def _plan_stage_programs(model: nn.Module, example_inputs: tuple, layout: Any,
                         asked: StagePlansAsked, time_limit_s: float) -> Any:
    """Every stage's plan of ``layout`` (a pipeline whose stages run a plan each), made on
    rank 0 (:func:`autopar.planning.stage_plans.plan_stages`, each checked as the runtime
    will run it) and the same on every rank."""
    from autopar.planning.stage_plans import plan_stages
    from autopar.runtime.pipeline import stage_program as sp

    tokens, targets = example_inputs[0], example_inputs[1]

    def make() -> tuple[list[Plan], list[Any]]:
        job = sp.stage_planning_inputs(model, layout.block_path, layout.ranges, tokens,
                                       targets, layout.microbatch * layout.dp, layout.loss,
                                       layout.dmesh)
        return plan_stages(job.stages, job.block_path, job.first, job.targets, job.loss_fn,
                           job.mesh, job.tied, asked, time_limit_s,
                           check=sp.check_stage_plan, precision=layout.precision,
                           recompute=layout.recompute)

    plans, inputs = sp.agree(make)
    return sp.PlannedStages(tuple(plans), tuple(inputs))


def _fixed(options: Options) -> dict[str, Any]:
    """The pipeline choices asked for, by their keywords (what a plan given is checked
    against)."""
    p = options.pipeline
    return dict(schedule=p.schedule, microbatches=p.microbatches, virtual=p.virtual)


# --- meshes -----------------------------------------------------------------------------------


def _plan_for_devices(model: nn.Module, n: int, args: tuple, kwargs: dict | None,
                      loss_fn: Callable | None, options: Options) -> Plan:
    """The fastest plan over the ``pp x dp x tp`` shapes of ``n`` devices that the runtime
    runs as written (planned on rank 0, shared): a pipeline plan the runtime refuses
    (:func:`~autopar.runtime.pipeline.module.check_runnable`: stage programs in bf16 or
    recomputing, offloaded optimizer state, ...) gives way to the next shape."""
    from autopar.planning.shapes import search_shapes
    from autopar.runtime.pipeline import module as pm

    ensure_process_group(Mesh((n,), ("dp",), "cpu"))
    world = dist.get_world_size()
    if world != n:
        raise MeshError(f"{n} devices asked but the process group has {world} ranks: launch "
                        f"{n} processes (torchrun --nproc-per-node {n}) or ask for {world}")
    device = "cpu" if device_type() == "cpu" else "h100"
    # each shape planned briefly and whole; the pipeline choices are the runtime's to check
    each = options.replace(time_limit_s=min(options.search.time_limit_s, 5.0), max_layers=None,
                           reduce_dtype=None, schedule=None, microbatches=None, virtual=None)

    def make() -> Plan:
        results = search_shapes(meta_skeleton(model), n, args, kwargs, device, each,
                                loss_fn=loss_fn, model_name=type(model).__name__)
        refused = []
        for r in results:
            if r.plan is None:
                continue
            if r.plan.decided.pipeline is not None:
                try:
                    pm.check_runnable(r.plan, model)
                except PlanError as e:
                    refused.append(f"{r.shape}: {e}")
                    continue
                if pm.runnable_option(r.plan) is not None:
                    continue  # its schedule splits a selectively recomputed backward
            return r.plan
        why = refused[0] if refused else (results[0].note if results else "")
        raise PlanError(f"no shape of {n} devices has a plan that fits and runs: {why}")

    with _compat.outside_local_tensor_mode():
        return _agree(make)


def _warn_if_priced_for_another_device(mesh: Mesh, device_type: str) -> None:
    """Planning for GPUs while the processes run on CPUs (or the other way round) prices the
    plan for the wrong speeds and gradient buckets: say so, with the fix."""
    name = mesh.device.name
    if name in PROFILES and (name == "cpu") != (device_type == "cpu"):
        fix = "'cpu'" if device_type == "cpu" else "the GPU's profile ('h100', 'h200', 'a100')"
        warnings.warn(
            f"the mesh plans for device {name!r} but the processes run on {device_type}: the "
            f"plan is priced for the wrong speeds and gradient buckets; pass device={fix} to "
            "autopar.Mesh (or a DeviceProfile of your own)", stacklevel=3)


def check_plan_mesh(plan: Plan, mesh: Mesh) -> None:
    d = plan.decided
    if tuple(d.mesh_shape) != tuple(mesh.shape) or tuple(d.mesh_axes) != tuple(mesh.axes):
        raise PlanError(
            f"the plan was made for mesh {dict(zip(d.mesh_axes, d.mesh_shape))} but runs on "
            f"{dict(zip(mesh.axes, mesh.shape))}: make the plan for this mesh, or run on the "
            "mesh it was made for")


# --- planning ---------------------------------------------------------------------------------


def _make_plan(model: nn.Module, mesh: Mesh, graph: PlanGraph, options: Options) -> Plan:
    from autopar.planning.planner import make_plan

    return make_plan(model, mesh, options=options, graph=graph,
                     model_name=type(model).__name__).plan


def plan_mode(plan: Plan) -> Mode:
    """The planner's mode a plan was made in (:class:`autopar.planning.modes.Mode`): its
    recomputation, whether it re-gathers parameters in the backward, all-reduces whole
    gradients, offloads optimizer state."""
    from autopar.planning.modes import Mode

    ps = plan.decided.param_state
    return Mode(plan.decided.recompute.mode, regather=bool(ps.regathered),
                whole_grads=bool(ps.zero1), offload=bool(ps.offloaded))


def complete_plan(graph: PlanGraph, mesh: Mesh, params: dict[str, Spec],
                  inputs: dict[int, Spec] | None = None, options: Options | None = None, *,
                  model_name: str = "", mode: Mode | str = "none") -> Plan:
    """A plan with the given parameter (and input, by position) specs pinned, the rest solved,
    with ``mode``'s recomputation and re-gathering applied (a
    :class:`~autopar.planning.modes.Mode` or its label; ``graph`` as captured; the plan
    records what it recomputes, and :func:`parallelize` applies it again to the graph it
    runs). Of ``options``, the memory budget and the solver's time limit apply.

    Used to replan for new input shapes with the parameters where they are, and to turn a
    hand-written reference layout into an executable plan."""
    from autopar.passes.problem import sharding_problem
    from autopar.planning.assemble import assemble_plan, recompute_record
    from autopar.planning.memory_fit import memory_limit
    from autopar.planning.modes import Mode, mode_graph
    from autopar.planning.references import score_reference

    options = options if options is not None else Options()
    mode = Mode.of(mode)
    limit, source = memory_limit(options.memory.budget, mesh.device)
    captured = graph
    graph = mode_graph(graph, mode)
    names = graph.recomputed
    offload = "auto" if mode.offload else "none"
    # no shared layer variables: pins may differ between layers that look alike (Megatron
    # pairs the MLP's equal-width layers 1 and 2 as row then column parallel)
    sp = sharding_problem.build(graph, mesh, limit, share_layers=False, offload=offload,
                                zero1=mode.whole_grads)
    ref = SimpleNamespace(params=params, inputs=inputs or {})
    got = score_reference(sp, graph, ref, options.search.time_limit_s)
    if got is None:
        raise PlanError(
            "no plan keeps the given parameter/input layouts on this graph (a pinned spec is not "
            "among the strategies of its node, e.g. it does not divide the shape evenly): "
            "pin fewer layouts or let autopar plan freely (plan=None)")
    choice = got[1]  # (cost, per-node choice, ...)
    base = sp if not names else sharding_problem.build(
        mode_graph(captured, mode.plain), mesh, limit, share_layers=False, offload=offload,
        zero1=mode.whole_grads)
    rec = recompute_record(mode.recompute, mode.recompute, graph, sp, choice, base)
    return assemble_plan(graph, sp, choice, model_name, mesh,
                         SolverInfo("pinned", 0.0, "pinned+solve"), {}, {}, limit, source, rec)


def _replanner(skeleton: nn.Module, mesh: Mesh, loss_fn: Callable | None, options: Options,
               precision: Precision, mode: Mode) -> Callable:
    """Replans for new input shapes keep the parameters' layouts, the precision and the
    recomputation mode."""

    def replan(args: tuple, kwargs: dict, param_specs: dict[str, Spec]) -> tuple[PlanGraph, Plan]:
        with _compat.outside_local_tensor_mode():
            meta_args = tuple(_to_meta(a) for a in args)
            meta_kwargs = {k: _to_meta(v) for k, v in kwargs.items()}
            graph = capture(skeleton, meta_args, meta_kwargs, loss_fn, precision=precision)
            plan = _agree(lambda: complete_plan(graph, mesh, param_specs, options=options,
                                                mode=mode))
        return apply_recompute(graph, plan.decided.recompute.nodes), plan

    return replan


def _agree(make: Callable[[], Plan]) -> Plan:
    """``make()`` on rank 0, the same plan on every rank."""
    if not _real_multi_process():
        return make()
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = json.dumps(make().to_json())
        except Exception as e:  # every rank must leave the broadcast, then all raise
            box[0] = ("error", type(e).__name__, str(e))
    dist.broadcast_object_list(box, src=0)
    got = box[0]
    if isinstance(got, tuple):
        _, kind, message = got
        # a user's error (a bad option, a budget nothing fits) reads the same on every rank
        cls = getattr(errors, kind, None)
        if isinstance(cls, type) and issubclass(cls, errors.AutoparError):
            raise cls(message)
        raise PlanError(f"planning failed on rank 0: {kind}: {message}")
    return Plan.from_json(json.loads(got))


def _real_multi_process() -> bool:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return False
    # a fake world (LocalTensorMode, planning tests) is one process: nothing to agree on
    return str(dist.get_backend()) != "fake"


def _to_meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().to("meta") if not _compat.local_tensor_mode_active() else torch.empty(
            x.shape, dtype=x.dtype, device="meta")
    if isinstance(x, (list, tuple)):
        return type(x)(_to_meta(v) for v in x)
    if isinstance(x, dict):
        return {k: _to_meta(v) for k, v in x.items()}
    return x
