"""Pipeline stages that run autopar's intra-op plan on their submesh (PP x DP x TP).

Each stage of a pipeline is planned as a program of its own (:mod:`autopar.capture.stage`):
its joint graph is traced with its boundary, planned on the stage's submesh (the mesh's axes
other than ``pp``: ``dp``, ``tp``) and lowered as :class:`StageProgram`, a
:class:`~autopar.runtime.parallel_module.ParallelModule` whose parameters are DTensors placed
as the stage's plan says. Its ``forward`` takes this rank's piece of what the previous stage
sent (token ids on the first stage) and returns this rank's piece of its output, or on the
last stage the micro-batch's loss, whole; its backward takes the piece of the output's
gradient the next stage sent back and returns the piece of the input's gradient, the
parameters' DTensor gradients made by the planned collectives (so data parallelism's
gradient sums are the plan's, not a separate all-reduce). torch's ``PipelineStage`` sends and
receives those pieces between the pp neighbours at the same (dp, tp) coordinate, which is
right because both neighbours place the tensor between them alike: the batch split over
``dp``, whole on ``tp`` (:func:`autopar.capture.stage.boundary_spec`), pinned in both plans.

The last stage computes the loss inside its program (its targets come as the keyword input
``targets``, which torch's schedules hand every stage; the others ignore it), so the head's
vocabulary-parallel matmul and the cross-entropy run as planned, not on gathered logits.

The plans come made (:class:`PlannedStages`): ``autopar.api`` plans every stage on rank 0
(:func:`autopar.planning.stage_plans.plan_stages`, checked by :func:`check_stage_plan`) and
hands every rank the same plans (:func:`agree`: the solver is not deterministic under a time
limit; every rank must run the same program). The runtime runs them and makes none.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.function import once_differentiable

from autopar.capture.stage import StageInputs, output_meta, trace_stage
from autopar.ir.errors import MeshError, PlanError
from autopar.ir.graph import PlanGraph
from autopar.ir.mesh import Mesh
from autopar.ir.placements import local_shape, spec_str
from autopar.ir.plan import Plan, stage_recompute
from autopar.ir.precision import Precision
from autopar.runtime import _compat
from autopar.runtime.parallel_module import ParallelModule, ProgramCall, store_fresh_grads

TARGETS = "targets"  # the keyword input the last stage reads its targets from


class _StageStep(torch.autograd.Function):
    """The stage's forward nodes in ``forward``, its backward nodes in ``backward``; the
    received activation (or token ids) and the parameters are the inputs."""

    @staticmethod
    def forward(ctx: Any, call: ProgramCall, x: torch.Tensor, *params: torch.Tensor
                ) -> torch.Tensor:  # type: ignore[override]
        out, saved = call.run_forward()
        ctx.call = call
        ctx.saved_env = saved
        if call.lowered.pg.has_loss:  # the last stage: its loss, whole on every rank
            out = call.lowered.whole_loss(out, call.pm._comm)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:  # type: ignore[override]
        call: ProgramCall = ctx.call
        saved, ctx.saved_env = ctx.saved_env, None
        prog = call.pm
        if prog.split_weights and call.lowered.bwd_split is not None:
            # the input's gradient now; the weights' when the schedule's W action runs
            dx = call.lowered.stage_backward_input(saved, grad_out.contiguous(), prog._comm)
            prog._weights_left.append((call, saved))
            return (None, dx, *[None] * len(prog._param_list))
        carry, sync = prog._grad_sync_turn()
        grads, dx = call.run_stage_backward(saved, grad_out.contiguous(), carry, sync)
        return (None, dx, *store_fresh_grads(ctx, call.pm._param_list, grads, skip=1))


class StageProgram(ParallelModule):
    """One pipeline stage as a planned SPMD program on its submesh. Parameter names are the
    stage module's (the whole model's). ``collectives`` counts what it ran.

    Within a pipeline step (:meth:`defer_grad_sync` ... :meth:`grad_sync_done`, as
    ``PipelineRunner.step`` brackets the schedule) the plan's gradient sync runs once: each
    backward but the step's last keeps its parameters' local gradient contributions (the ones
    the sync would sum or move into their parameter's layout) in a carry, and the last adds
    them to its own before running the sync, as DDP's ``no_sync`` does under torch's
    schedules. The last is counted, not told: under the split-backward schedules the
    weights' halves run in the W actions, which torch calls with ``last_backward=False`` for
    every micro-batch. Collectives that make activations' gradients run in every backward.
    Outside such a bracket every backward syncs its own gradients.

    With ``split_weights`` (a schedule that splits the backward, :func:`build_programs` sets
    it), a backward runs the steps the input's gradient needs (the I action) and leaves the
    rest, the weights' gradients and their sync, to the runner :meth:`weight_runner` hands
    torch's stage (the W action), as the zero-bubble schedules expect: the lowered program's
    :attr:`~autopar.runtime.lower.LoweredGraph.bwd_split`. A stage whose backward does not
    split (:meth:`~autopar.runtime.lower.LoweredGraph._split_backward`) runs it whole in
    the I action."""

    def __init__(self, stage: nn.Module, submesh: Any, graph: PlanGraph, plan: Plan,
                 compile: bool = False) -> None:
        if graph.stage is None:
            raise PlanError("a StageProgram runs a pipeline stage's graph "
                            "(autopar.capture.stage.capture_stage), not a whole step's")
        if plan.decided.precision.loss_scaling:
            raise PlanError("fp16 with dynamic loss scaling does not run in pipeline stages "
                            "yet: plan them in bf16 or fp32")
        super().__init__(stage, submesh, graph, plan, None, compile)
        self._defer = 0  # backwards in this step, the sync in the last (<= 1: in every one)
        self._seen = 0  # backwards run so far in this step
        self._carry: dict[int, torch.Tensor] = {}  # parameter index -> local gradient sum
        self.split_weights = False  # the weights' gradients in a W action of their own
        self._weights_left: list[tuple[ProgramCall, dict]] = []  # I actions run, W not yet
        self.weight_actions = 0  # the weights' halves run since it was built

    def defer_grad_sync(self, n_backwards: int) -> None:
        """The next ``n_backwards`` backwards are one step's: run the plan's gradient sync
        once, in the last of them, on the gradients summed over all of them."""
        self._defer, self._seen, self._carry = n_backwards, 0, {}

    def grad_sync_done(self) -> None:
        """End the step :meth:`defer_grad_sync` began; raise if a gradient was left unsynced
        (fewer backwards ran than announced)."""
        seen, want, left = self._seen, self._defer, len(self._carry)
        self._defer, self._seen, self._carry = 0, 0, {}
        if left:
            raise RuntimeError(
                f"internal: the stage program's gradient sync was deferred to its backward "
                f"{want} of the step, but {seen} ran: {left} parameters' gradients were "
                "never summed across ranks")

    def weight_runner(self) -> Callable[[], None]:
        """What the W action of the backward just run (torch's ``dw_builder``, called right
        after it) runs: the weights' half of its split backward, or nothing where it ran
        whole."""
        if not self._weights_left:
            return _nothing
        call, saved = self._weights_left.pop()
        return functools.partial(self._run_weights, call, saved)

    def _run_weights(self, call: ProgramCall, saved: dict) -> None:
        carry, sync = self._grad_sync_turn()
        grads = call.lowered.stage_backward_weight(saved, self._comm, carry, sync)
        self.weight_actions += 1
        saved.clear()
        for p, g in zip(self._param_list, grads):  # accumulated as autograd would
            if g is not None:
                d = _compat.dtensor_like(p, g)
                p.grad = d if p.grad is None else p.grad + d

    def _grad_sync_turn(self) -> tuple[dict[int, torch.Tensor] | None, bool]:
        """(carry, whether this backward runs the gradient sync) for the backward starting."""
        if self._defer <= 1:
            return None, True
        self._seen += 1
        return self._carry, self._seen >= self._defer

    def forward(self, *args: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        lowered = self._active[1]
        leaves = list(args)
        if lowered.pg.has_loss:  # the last stage reads its targets too
            if kwargs.get(TARGETS) is None:
                raise PlanError("the last pipeline stage computes the loss: call it with "
                                f"{TARGETS}=<this rank's piece of the micro-batch's targets>")
            leaves.append(kwargs[TARGETS])
        with torch.no_grad():
            env = self._placeholders(lowered, leaves, pieces=True)
        if not torch.is_grad_enabled():
            out = lowered.forward(env, self._comm)[0]
            return lowered.whole_loss(out, self._comm) if lowered.pg.has_loss else out
        return _StageStep.apply(ProgramCall(self, lowered, env), args[0], *self._param_list)


# --- planning ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PlannedStages:
    """Every stage's plan, in stage order, and the inputs each stage's graph was traced with
    (:func:`autopar.planning.stage_plans.plan_stages`): what stage programs run."""

    plans: tuple[Plan, ...]
    inputs: tuple[StageInputs, ...]


@dataclass(frozen=True, slots=True)
class StagePlanningInputs:
    """What planning every stage takes, as the runtime cuts the model: every stage module
    (meta weights), their blocks' path, the first stage's token ids and the last stage's
    targets (the global micro-batch), the loss, the stage submesh and the tied weights."""

    stages: dict[int, nn.Module]
    block_path: str
    first: StageInputs
    targets: StageInputs
    loss_fn: Callable
    mesh: Mesh
    tied: dict[str, list[int]]


def stage_submesh(dmesh: Any) -> tuple[Any, Mesh]:
    """The torch submesh of ``dmesh``'s axes other than ``pp``, on which each stage program
    runs, and its :class:`Mesh`."""
    names = tuple(dmesh.mesh_dim_names)
    sub_axes = tuple(n for n in names if n != "pp")
    if not sub_axes:
        raise MeshError(f"stages that run a plan each run on the mesh's axes other than pp, and "
                        f"mesh {names} has none: add a 'dp' or 'tp' axis (of size 1 is fine)")
    submesh = dmesh[sub_axes] if len(sub_axes) > 1 else dmesh[sub_axes[0]]
    return submesh, Mesh.from_device_mesh(submesh)


def stage_planning_inputs(model: nn.Module, block_path: str, ranges: Sequence[tuple[int, int]],
                          tokens: torch.Tensor, targets: torch.Tensor, rows: int,
                          loss_fn: Callable, dmesh: Any) -> StagePlanningInputs:
    """:class:`StagePlanningInputs` of ``model`` cut at ``ranges``: the stages built on its
    meta skeleton (no weights); ``rows``: the global micro-batch's (every dp share's)."""
    from autopar.capture.skeleton import meta_skeleton
    from autopar.runtime.pipeline import stages as ps

    def example(t: torch.Tensor) -> StageInputs:
        return StageInputs(((rows, *t.shape[1:]),), (str(t.dtype).removeprefix("torch."),))

    skeleton = meta_skeleton(model)  # every stage, no weights: planning only
    every = ps.module_stages(skeleton, block_path, ranges, range(len(ranges)))
    held = {s: [n for n, _ in m.named_parameters(remove_duplicate=False)]
            for s, m in every.items()}
    tied = ps.tied_names(held, ps.alias_names(model))
    return StagePlanningInputs(every, block_path, example(tokens), example(targets), loss_fn,
                               stage_submesh(dmesh)[1], tied)


def check_stage_plan(s: int, graph: PlanGraph, plan: Plan, mesh: Mesh,
                     prev_plan: Plan | None, prev_graph: PlanGraph | None) -> None:
    """Raise :class:`PlanError` unless ``plan`` runs stage ``s`` on ``mesh`` and receives its
    input in the layout the previous stage's plan sends its output in."""
    from autopar.runtime.lower import validate

    d = plan.decided
    if tuple(d.mesh_shape) != tuple(mesh.shape) or tuple(d.mesh_axes) != tuple(mesh.axes):
        raise PlanError(
            f"stage {s}'s plan was made for mesh {dict(zip(d.mesh_axes, d.mesh_shape))} "
            f"but the stage runs on {dict(zip(mesh.axes, mesh.shape))} (the mesh's axes other "
            "than pp): plan it for that submesh")
    validate(graph, plan)
    st = graph.stage
    assert st is not None
    if prev_plan is None or prev_graph is None or st.input is None:
        return
    prev_st = prev_graph.stage
    assert prev_st is not None and prev_st.output_grad is not None
    sent = tuple(prev_plan.decided.nodes[prev_st.output_grad].outs[0])
    got = tuple(plan.decided.nodes[st.input].outs[0])
    if sent != got:
        raise PlanError(
            f"stage {s}'s plan receives its input as {spec_str(got)} but stage {s - 1}'s plan "
            f"sends its output as {spec_str(sent)}: the pieces sent between them would not "
            "match; plan both with their boundary pinned alike "
            "(autopar.capture.stage.pin_boundary on the same submesh)")


def agree(make: Callable[[], tuple[list[Plan], list[StageInputs]]]
          ) -> tuple[list[Plan], list[StageInputs]]:
    """``make()`` on rank 0; its plans and stage inputs on every rank (JSON broadcast)."""
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            plans, inputs = make()
            box[0] = json.dumps({"plans": [p.to_json() for p in plans],
                                 "inputs": [[list(map(list, i.shapes)), list(i.dtypes)]
                                            for i in inputs]})
        except Exception as e:  # every rank must leave the broadcast, then all raise
            box[0] = "error:" + f"{type(e).__name__}: {e}"
    dist.broadcast_object_list(box, src=0)
    text = box[0]
    if text.startswith("error:"):
        raise PlanError(f"planning the pipeline's stages failed on rank 0: {text[6:]}")
    got = json.loads(text)
    return ([Plan.from_json(p) for p in got["plans"]],
            [StageInputs(tuple(tuple(s) for s in shapes), tuple(dtypes))
             for shapes, dtypes in got["inputs"]])


def local_example(inputs: StageInputs, plan: Plan, graph: PlanGraph, device: torch.device,
                  count: int) -> tuple[torch.Tensor, ...]:
    """This rank's pieces of a stage's first ``count`` inputs, as torch's ``PipelineStage``
    wants its example inputs (a floating-point one requires a gradient)."""
    nodes = [n for n in graph.graph.nodes if n.op == "placeholder"
             and n.meta["autopar"].role == "input"]
    out = []
    for node, shape, dtype in list(zip(nodes, inputs.shapes, inputs.dtypes))[:count]:
        piece = local_shape(tuple(shape), plan.decided.nodes[node.name].outs[0],
                            tuple(plan.decided.mesh_shape))
        t = torch.zeros(piece, dtype=getattr(torch, dtype), device=device)
        out.append(t.requires_grad_(t.is_floating_point()))
    return tuple(out)


def local_output(program: StageProgram, device: torch.device) -> torch.Tensor:
    """This rank's piece of a stage's output (the loss on the last stage): the example
    output torch's ``PipelineStage`` wants."""
    lowered = program._active[1]
    graph = lowered.pg
    meta = output_meta(graph)
    if graph.has_loss:
        return torch.zeros((), dtype=meta.dtype, device=device, requires_grad=True)
    spec = lowered.boundary[0][1]
    piece = local_shape(meta.shape, spec, lowered.mesh_shape)
    return torch.zeros(piece, dtype=meta.dtype, device=device, requires_grad=True)


# --- building a pipeline's stages -------------------------------------------------------------


def build_programs(model: nn.Module, block_path: str, ranges: Sequence[tuple[int, int]],
                   local: Sequence[int], dmesh: Any, pp_group: Any, loss_fn: Callable,
                   device: torch.device, planned: PlannedStages,
                   precision: Precision | None = None,
                   recompute: str | Sequence[str] = "none", split_backward: bool = False
                   ) -> tuple[dict[int, StageProgram], list, list[Plan]]:
    """This rank's stages as :class:`StageProgram` s on the submesh of ``dmesh``'s axes other
    than ``pp``, running the plans ``planned`` gives (each must compute in ``precision``,
    None: fp32, and recompute in mode ``recompute``: one, or one per stage), torch's ``PipelineStage`` over each
    (static shapes: this rank's pieces), and every stage's plan. ``split_backward``: the
    schedule splits the backward (I and W actions), and so do the programs."""
    from torch.distributed.pipelining import PipelineStage

    from autopar.passes.memory.recompute import apply_recompute
    from autopar.runtime.pipeline import stages as ps

    submesh, _ = stage_submesh(dmesh)
    n_stages = len(ranges)
    if len(planned.plans) != n_stages or len(planned.inputs) != n_stages:
        raise PlanError(f"{len(planned.plans)} stage plans for a pipeline of {n_stages} stages: "
                        "give one plan per stage")
    plans, inputs = list(planned.plans), list(planned.inputs)
    modes = stage_recompute(recompute, n_stages)
    for s, plan in enumerate(plans):
        _check_modes(s, plan, precision, modes[s])
    mods = ps.module_stages(model, block_path, ranges, local)
    programs: dict[int, StageProgram] = {}
    stages = []
    for s in local:
        # traced under the plan's precision (its casts are ops of the program, the parameters
        # stay fp32 masters) and recomputing what the plan recomputes, as the plan was made
        graph = trace_stage(mods[s], inputs[s], s == n_stages - 1, loss_fn, block_path,
                            plans[s].decided.precision)
        graph = apply_recompute(graph, plans[s].decided.recompute.nodes)
        programs[s] = prog = StageProgram(mods[s], submesh, graph, plans[s])
        # under a schedule that splits the backward (ZBV, DualPipeV, InterleavedZeroBubble)
        # torch runs the program's backward in the I action and the runner its dw_builder
        # made in the W action: the weights' half (StageProgram.weight_runner)
        prog.split_weights = split_backward
        stages.append(PipelineStage(prog, s, n_stages, device,
                                    input_args=local_example(inputs[s], plans[s], graph,
                                                             device, 1),
                                    output_args=local_output(prog, device), group=pp_group,
                                    dw_builder=prog.weight_runner))
    return programs, stages, plans


def _check_modes(s: int, plan: Plan, precision: Precision | None, recompute: str) -> None:
    """Refuse a stage plan made for another precision or recompute mode than the pipeline
    runs (its graph would be traced otherwise than it was planned)."""
    want = precision or Precision()
    d = plan.decided
    if d.precision.name != want.name or d.recompute.mode != recompute:
        raise PlanError(
            f"stage {s}'s plan computes in {d.precision.name} with recompute "
            f"{d.recompute.mode!r}, but the pipeline runs {want.name} with recompute "
            f"{recompute!r}: build it with precision={d.precision.name!r} and "
            f"recompute={d.recompute.mode!r}, or plan the stages for what it runs")


def _nothing() -> None:
    return None
