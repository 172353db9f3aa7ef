"""``autopar.parallelize``: trace, plan (or load a plan), lower, and wrap a model for a mesh.

Planning runs once per process on fake tensors; with several processes rank 0 solves and
broadcasts the plan JSON, because the ILP solver runs several workers with a time limit and is
not guaranteed to return the same optimum twice (every rank must run the same program).
"""

from __future__ import annotations

import json
import os
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
from autopar.ir.placements import Spec
from autopar.ir.plan import Plan, SolverInfo
from autopar.ir.precision import Precision
from autopar.ir.precision import resolve as resolve_precision
from autopar.passes.memory.recompute import apply_recompute
from autopar.runtime import _compat
from autopar.runtime.parallel_module import ParallelModule

if TYPE_CHECKING:
    from autopar.runtime.pipeline.module import PipelineModule

_BACKEND_DEVICE = {"gloo": "cpu", "nccl": "cuda", "fake": "cpu", "threaded": "cpu"}


def parallelize(
    model: nn.Module,
    mesh: Mesh | Any,
    example_inputs: tuple = (),
    example_kwargs: dict | None = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    plan: Plan | str | Path | None = None,
    memory_budget: float | None = None,
    time_limit_s: float = 30.0,
    compile: bool = False,
    precision: str | Precision | None = None,
    reduce_dtype: str | None = None,
    recompute: str = "auto",
    zero: str | int = "auto",
    offload: str = "auto",
    profile: str | Path | None = None,
    schedule: str | None = None,
    microbatches: int | None = None,
    virtual: int | None = None,
) -> ParallelModule | PipelineModule:
    """``model`` made to train on ``mesh`` (an :class:`autopar.Mesh` or a torch DeviceMesh,
    or a number of devices: every ``pp x dp x tp`` shape of them is planned and the fastest
    that the runtime runs is taken, :mod:`autopar.planning.shapes`).

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
    stage submesh with the parameters placed as planned, in fp32 without recomputation. What
    the runtime cannot run as planned is refused with the fix. The model itself is left as it
    was: train the returned module's parameters.
    """
    if isinstance(mesh, int) and not isinstance(mesh, bool):
        if plan is not None:
            raise PlanError("plan= fixes the mesh it was made for: give that mesh, not a "
                            "device count")
        plan = _plan_for_devices(model, mesh, tuple(example_inputs), example_kwargs, loss_fn,
                                 time_limit_s, dict(memory_budget=memory_budget,
                                                    precision=precision, recompute=recompute,
                                                    zero=zero, offload=offload))
        shape, axes = plan.full_mesh
        mesh = init_device_mesh(_device_type(), shape, mesh_dim_names=axes)
    device_mesh, amesh = resolve_mesh(mesh)
    example_inputs = tuple(example_inputs)
    if plan is not None and not isinstance(plan, Plan):
        plan = Plan.load(plan)
    if _is_pipeline(amesh, plan):
        if loss_fn is not None or compile:
            what = "loss_fn" if loss_fn is not None else "compile"
            raise PlanError(f"{what}= does not apply to pipelines yet (their loss is the "
                            "model's own, their stages run eagerly): leave it out, or use a "
                            "mesh without a 'pp' axis")
        piped = _pipeline(model, device_mesh, amesh, example_inputs, example_kwargs, plan,
                          dict(memory_budget=memory_budget, time_limit_s=time_limit_s,
                               precision=precision or "fp32", reduce_dtype=reduce_dtype,
                               recompute=recompute, zero=zero, offload=offload),
                          dict(schedule=schedule, microbatches=microbatches, virtual=virtual))
        piped.profile = profile  # the second call's step, measured beside the plan's
        return piped
    if (schedule, microbatches, virtual) != (None, None, None):
        raise PlanError("schedule=, microbatches= and virtual= choose a pipeline: give a mesh "
                        "with a 'pp' axis (e.g. pp=2,dp=2), or leave them out")
    skeleton = meta_skeleton(model)
    with _compat.outside_local_tensor_mode():
        if plan is None:
            prec = resolve_precision(precision, amesh.device, reduce_dtype)
            graph = capture(model, example_inputs, example_kwargs, loss_fn, precision=prec)
            _warn_if_priced_for_another_device(amesh, device_mesh.device_type)
            the_plan = _agree(lambda: _make_plan(model, amesh, graph, memory_budget,
                                                 time_limit_s, recompute, zero, offload))
            replan = _replanner(skeleton, amesh, loss_fn, memory_budget, time_limit_s, prec,
                                plan_mode(the_plan))
        else:
            the_plan = plan
            graph = capture(model, example_inputs, example_kwargs, loss_fn,
                            precision=the_plan.precision)
            replan = None
        graph = apply_recompute(graph, the_plan.recompute.nodes)  # as the plan was made
    check_plan_mesh(the_plan, amesh)
    if the_plan.missing_rules:
        warnings.warn(
            "no sharding rule for " + ", ".join(sorted(the_plan.missing_rules)) + ": these ops "
            "run replicated (whole on every rank), which is correct but may be slow",
            stacklevel=2)
    if the_plan.param_state.offloaded:
        warnings.warn(
            f"the plan keeps the optimizer state of {len(the_plan.param_state.offloaded)} "
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

    return pipeline_axis(mesh) is not None or (plan is not None and plan.pipeline is not None)


def _pipeline(model: nn.Module, device_mesh: Any, amesh: Mesh, args: tuple, kwargs: dict | None,
              plan: Plan | None, options: dict[str, Any], fixed: dict[str, Any]
              ) -> PipelineModule:
    """The pipeline branch of :func:`parallelize`: plan (rank 0, shared) or check the plan
    given, then build this rank's stages as the plan says."""
    from autopar.planning.pipeline import plan_pipeline
    from autopar.runtime.pipeline import module as pm

    pm.PipelineInputs.of(args, kwargs)
    if plan is not None:
        shapes = [t.shape for t in [*args, *(kwargs or {}).values()]]
        pm.check_plan(plan, amesh, model, shapes, fixed)
    pm.check_mesh(amesh)  # before any planning: what the runtime cannot run at all
    if plan is None:
        skeleton = meta_skeleton(model)
        _warn_if_priced_for_another_device(amesh, device_mesh.device_type)

        def make() -> Plan:
            made = plan_pipeline(skeleton, amesh, args, kwargs, model_name=type(model).__name__,
                                 **options, **fixed).plan
            runs = pm.runnable_option(made)
            if runs is None or fixed["schedule"] is not None:
                return made  # runs as chosen, or as asked (then refused, with the fix)
            # stages that recompute selectively cannot split their backward: the fastest
            # option weighed that they run, planned with its choices fixed
            return plan_pipeline(skeleton, amesh, args, kwargs, model_name=type(model).__name__,
                                 **options, schedule=runs.schedule, virtual=runs.virtual,
                                 microbatches=runs.microbatches).plan

        with _compat.outside_local_tensor_mode():
            plan = _agree(make)
    return pm.from_plan(model, device_mesh, plan, args, kwargs, options["time_limit_s"])


# --- meshes -----------------------------------------------------------------------------------


def _device_type() -> str:
    backend = str(dist.get_backend())
    return _BACKEND_DEVICE.get(backend, "cuda" if "nccl" in backend else "cpu")


def _plan_for_devices(model: nn.Module, n: int, args: tuple, kwargs: dict | None,
                      loss_fn: Callable | None, time_limit_s: float, options: dict[str, Any]
                      ) -> Plan:
    """The fastest plan over the ``pp x dp x tp`` shapes of ``n`` devices that the runtime
    runs as written (planned on rank 0, shared): a pipeline plan the runtime refuses
    (:func:`~autopar.runtime.pipeline.module.check_runnable`: stage programs in bf16 or
    recomputing, offloaded optimizer state, ...) gives way to the next shape."""
    from autopar.planning.shapes import search_shapes
    from autopar.runtime.pipeline import module as pm

    _ensure_process_group(Mesh((n,), ("dp",), "cpu"))
    world = dist.get_world_size()
    if world != n:
        raise MeshError(f"{n} devices asked but the process group has {world} ranks: launch "
                        f"{n} processes (torchrun --nproc-per-node {n}) or ask for {world}")
    device = "cpu" if _device_type() == "cpu" else "h100"

    def make() -> Plan:
        results = search_shapes(meta_skeleton(model), n, args, kwargs, device,
                                time_limit_s=min(time_limit_s, 5.0), max_layers=None,
                                loss_fn=loss_fn, model_name=type(model).__name__, **options)
        refused = []
        for r in results:
            if r.plan is None:
                continue
            if r.plan.pipeline is not None:
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


def resolve_mesh(mesh: Mesh | Any) -> tuple[Any, Mesh]:
    """The torch DeviceMesh to run on and the abstract Mesh to plan for."""
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(mesh, DeviceMesh):
        return mesh, Mesh.from_device_mesh(mesh)
    if not isinstance(mesh, Mesh):
        raise MeshError(f"mesh must be an autopar.Mesh or a torch DeviceMesh, got {type(mesh)}")
    _ensure_process_group(mesh)
    world = dist.get_world_size()
    if world != mesh.size:
        raise MeshError(
            f"mesh {mesh.describe()} has {mesh.size} devices but the process group has {world} "
            f"ranks: launch {mesh.size} processes (torchrun --nproc-per-node {mesh.size}) or use "
            f"a mesh of {world} devices")
    return init_device_mesh(_device_type(), mesh.shape, mesh_dim_names=mesh.axes), mesh


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


def _ensure_process_group(mesh: Mesh) -> None:
    if dist.is_initialized():
        return
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        from autopar.runtime.launch import init_from_env

        # NCCL with one GPU per process (LOCAL_RANK's) where CUDA is there, else gloo;
        # collectives time out after torch's default 10 minutes
        init_from_env(collective_timeout_s=600.0)
    elif mesh.size == 1:  # a single-device mesh needs no launcher
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    else:
        raise MeshError(
            f"mesh {mesh.describe()} has {mesh.size} devices but no process group is running: "
            f"launch with torchrun --nproc-per-node {mesh.size} (or call "
            "torch.distributed.init_process_group first)")


def check_plan_mesh(plan: Plan, mesh: Mesh) -> None:
    if tuple(plan.mesh_shape) != tuple(mesh.shape) or tuple(plan.mesh_axes) != tuple(mesh.axes):
        raise PlanError(
            f"the plan was made for mesh {dict(zip(plan.mesh_axes, plan.mesh_shape))} but runs on "
            f"{dict(zip(mesh.axes, mesh.shape))}: make the plan for this mesh, or run on the "
            "mesh it was made for")


# --- planning ---------------------------------------------------------------------------------


def _make_plan(model: nn.Module, mesh: Mesh, graph: PlanGraph, memory_budget: float | None,
               time_limit_s: float, recompute: str, zero: str | int, offload: str) -> Plan:
    from autopar.planning.planner import make_plan

    return make_plan(model, mesh, graph=graph, memory_budget=memory_budget,
                     time_limit_s=time_limit_s, model_name=type(model).__name__,
                     recompute=recompute, zero=zero, offload=offload).plan


def plan_mode(plan: Plan) -> str:
    """The planner's mode a plan was made in (:func:`autopar.planning.planner.mode_graph`): its
    recomputation, with ``+zero3`` where it re-gathers parameters in the backward and
    ``+offload`` where it offloads optimizer state."""
    from autopar.planning.planner import OFFLOADED, REGATHER, WHOLE_GRADS

    ps = plan.param_state
    return (plan.recompute.mode + (REGATHER if ps.regathered else "")
            + (WHOLE_GRADS if ps.zero1 else "") + (OFFLOADED if ps.offloaded else ""))


def complete_plan(graph: PlanGraph, mesh: Mesh, params: dict[str, Spec],
                  inputs: dict[int, Spec] | None = None, memory_budget: float | None = None,
                  time_limit_s: float = 30.0, model_name: str = "",
                  recompute: str = "none") -> Plan:
    """A plan with the given parameter (and input, by position) specs pinned, the rest solved,
    with ``recompute``'s mode applied (``graph`` as captured; the plan records what it
    recomputes, and :func:`parallelize` applies it again to the graph it runs).

    Used to replan for new input shapes with the parameters where they are, and to turn a
    hand-written reference layout into an executable plan."""
    from autopar.passes.problem import sharding_problem
    from autopar.planning.memory_fit import memory_limit
    from autopar.planning.planner import (
        OFFLOADED,
        WHOLE_GRADS,
        assemble_plan,
        mode_graph,
        recompute_record,
        score_reference,
    )

    limit, source = memory_limit(memory_budget, mesh.device)
    captured = graph
    graph = mode_graph(graph, recompute)
    names = graph.recomputed
    offload = "auto" if OFFLOADED in recompute else "none"
    # no shared layer variables: pins may differ between layers that look alike (Megatron
    # pairs the MLP's equal-width layers 1 and 2 as row then column parallel)
    sp = sharding_problem.build(graph, mesh, limit, share_layers=False, offload=offload,
                                zero1=WHOLE_GRADS in recompute)
    ref = SimpleNamespace(params=params, inputs=inputs or {})
    got = score_reference(sp, graph, ref, time_limit_s)
    if got is None:
        raise PlanError(
            "no plan keeps the given parameter/input layouts on this graph (a pinned spec is not "
            "among the strategies of its node, e.g. it does not divide the shape evenly): "
            "pin fewer layouts or let autopar plan freely (plan=None)")
    choice = got[1]  # (cost, per-node choice, ...)
    base = sp if not names else sharding_problem.build(
        mode_graph(captured, "none" + recompute.removeprefix(recompute.split("+")[0])), mesh,
        limit, share_layers=False, offload=offload, zero1=WHOLE_GRADS in recompute)
    mode = recompute.split("+")[0]
    rec = recompute_record(mode, mode, graph, sp, choice, base)
    return assemble_plan(graph, sp, choice, model_name, mesh,
                         SolverInfo("pinned", 0.0, "pinned+solve"), {}, {}, limit, source, rec)


def _replanner(skeleton: nn.Module, mesh: Mesh, loss_fn: Callable | None,
               memory_budget: float | None, time_limit_s: float, precision: Precision,
               recompute: str) -> Callable:
    """Replans for new input shapes keep the parameters' layouts, the precision and the
    recomputation mode."""

    def replan(args: tuple, kwargs: dict, param_specs: dict[str, Spec]) -> tuple[PlanGraph, Plan]:
        with _compat.outside_local_tensor_mode():
            meta_args = tuple(_to_meta(a) for a in args)
            meta_kwargs = {k: _to_meta(v) for k, v in kwargs.items()}
            graph = capture(skeleton, meta_args, meta_kwargs, loss_fn, precision=precision)
            plan = _agree(lambda: complete_plan(graph, mesh, param_specs,
                                                memory_budget=memory_budget,
                                                time_limit_s=time_limit_s, recompute=recompute))
        return apply_recompute(graph, plan.recompute.nodes), plan

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
