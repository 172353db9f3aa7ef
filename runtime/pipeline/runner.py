"""Pipeline parallelism at run time: stage modules run under torch's pipeline schedules.

:func:`build_pipeline` cuts a model into ``pp x virtual`` stages over contiguous ranges of its
blocks (:mod:`.pipeline_stages`), places them on the mesh's ``pp`` axis as torch's schedules
expect (stage ``s`` on pp rank ``s % pp``; for the V-shaped ZBV and DualPipeV schedules rank
``r`` holds stages ``r`` and ``2 pp - 1 - r``) and returns a :class:`PipelineRunner` whose
``step(tokens, targets)`` runs one schedule step (forward and backward of every micro-batch)
and returns the single-device mean loss on every rank.

Why the gradients are the single device's: each micro-batch's loss is its mean, torch's
schedules divide the summed gradients by the number of micro-batches (``scale_grads``), and
the data-parallel replicas then average theirs; with equal micro-batches (enforced) that is
the gradient of the whole batch's mean. Weights two stages share (a tied embedding and head)
are one copy per stage whose gradients are summed, so the copies stay equal under any
optimizer. The optimizer is the user's, over :meth:`PipelineRunner.parameters`.

On a mesh with a ``tp`` axis each stage runs autopar's intra-op plan on its submesh instead
(:mod:`.stage_program`): DTensor parameters, the plan's collectives (data parallelism's
gradient sums among them, run once per step on the gradients summed over the micro-batches),
the loss computed inside the last stage.

Each rank records what its stages did in the last step (:attr:`PipelineRunner.last_step_events`:
forward, backward, input-backward and weight-backward per stage and micro-batch, and the
gradient sync, with wall-clock times) so a benchmark can measure the bubble.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, build_stage
from torch.distributed.tensor import DTensor

from autopar.ir.errors import MeshError, PlanError
from autopar.ir.plan import stage_recompute
from autopar.ir.precision import Precision
from autopar.ir.precision import resolve as resolve_precision
from autopar.ir.schedules import ScheduleInfo, stage_placement
from autopar.ir.schedules import schedule as schedule_info
from autopar.runtime import _compat
from autopar.runtime.pipeline import stages as ps
from autopar.runtime.pipeline.events import StageEvent, bubble_fraction, chrome_trace, instrument
from autopar.runtime.pipeline.planned_stage import (
    PlannedStage,
    check_modes,
    distinct_modes,
    modes_frontend,
    one_weight_pass,
    under_policy,
)

if TYPE_CHECKING:
    from autopar.runtime.pipeline.stage_program import PlannedStages

__all__ = ["PipelineRunner", "StageEvent", "bubble_fraction", "build_pipeline", "chrome_trace"]


def _mesh_groups(mesh: Any) -> tuple[Any, dict[str, Any]]:
    """The torch DeviceMesh and the process group of each of its axes."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        from autopar.runtime.launch import resolve_mesh

        mesh = resolve_mesh(mesh)[0]
    names = mesh.mesh_dim_names or ()
    if "pp" not in names:
        raise MeshError(f"the mesh's axes are {names}: name one axis 'pp' for the pipeline "
                        "stages (and 'dp', 'tp' for data and tensor parallelism in each)")
    unknown = [n for n in names if n not in AXES]
    if unknown and any(mesh.size(names.index(n)) > 1 for n in unknown):
        raise MeshError(f"pipelines run on axes 'pp', 'dp' and 'tp'; axis {unknown} of size > 1 "
                        "is not one of them: name the mesh's axes from ('pp', 'dp', 'tp')")
    return mesh, {n: mesh.get_group(n) for n in names}


AXES = ("pp", "dp", "tp")  # a pipeline's mesh axes: stages, data and tensor parallelism


def _tp_size(mesh: Any) -> int:
    """The size of ``mesh``'s ``tp`` axis (a torch DeviceMesh or an :class:`autopar.Mesh`),
    1 where it has none: read before any process group is made."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or getattr(mesh, "axes", None) or ())
    shape = tuple(getattr(mesh, "shape", None) or ())
    return shape[names.index("tp")] if "tp" in names and len(shape) == len(names) else 1


def build_pipeline(model: nn.Module, example_inputs: tuple, mesh: Any,
                   split: Sequence[int] | Sequence[tuple[int, int]] | None = None,
                   schedule: str = "1f1b", n_microbatches: int = 4, virtual: int | None = None,
                   frontend: str = "auto",
                   loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
                   stage_plans: PlannedStages | None = None,
                   precision: Precision | str | None = None,
                   recompute: str | Sequence[str] = "none",
                   ) -> PipelineRunner:
    """``model`` as a pipeline on ``mesh`` (a torch DeviceMesh or an :class:`autopar.Mesh`
    with a ``pp`` axis and optionally ``dp`` and ``tp`` axes).

    ``example_inputs``: ``(tokens, targets)`` of the global batch, as every rank will pass them
    to :meth:`PipelineRunner.step`. ``split``: blocks per stage or block ranges, one per stage
    (``pp x virtual`` stages; ``None``: as even as can be). ``virtual``: stages per rank
    (default: 2 for ``zbv``/``dualpipev``, else 1). ``frontend``: ``"trace"`` (torch's
    splitter), ``"module"`` (autopar's model families) or ``"auto"`` (trace, except MoE, whose
    balance loss the traced logits would drop). ``loss_fn(last_stage_output, targets)``: the
    per-micro-batch mean loss (default: the model's own, :func:`pipeline_stages.loss_fn_for`).

    Every rank must hold the same initial weights (seed them alike), as for ``parallelize``,
    and the mesh must span every process (tied weights get process groups of their own).

    Where the mesh has a ``tp`` axis of size > 1, or ``stage_plans`` is given, each stage runs
    its own intra-op plan on its submesh (the axes other than ``pp``) as a
    :class:`~autopar.runtime.pipeline.stage_program.StageProgram` (autopar's GPT-2 and Llama-3
    stages): ``stage_plans`` are every stage's plans, made
    (:class:`~autopar.runtime.pipeline.stage_program.PlannedStages`); the runtime makes none
    (:func:`autopar.api.build_pipeline` plans them, then calls this). Otherwise the stages are
    plain modules, replicated over ``dp`` with their gradients averaged at the end of the
    step.

    ``precision`` (``"fp32"`` default, ``"bf16"`` or a :class:`Precision`) and ``recompute``
    (``"none"``, ``"selective"``, ``"full"``): plain stages compute and recompute as the SPMD
    runtime does under a plan's (:mod:`.planned_stage`: parameters cast once per forward,
    fp32 masters and gradients, gradients averaged over ``dp`` in the precision's reduce
    dtype; each block checkpointed); they need autopar's stage modules (``frontend``
    ``"module"``, which ``"auto"`` then picks). Stages that run a plan each compute and
    recompute as their plans say (traced under the precision, the plan's recomputation
    applied to the traced stage), which must be ``precision`` and ``recompute``.
    ``recompute`` may give one mode per stage (a pipeline plan's stages each recompute as
    their microbatches in flight allow).
    """
    layout = pipeline_layout(model, example_inputs, mesh, split, schedule, n_microbatches,
                             virtual, frontend, loss_fn, stage_plans is not None, precision,
                             recompute)
    return build_from_layout(model, example_inputs, layout, stage_plans)


@dataclass(frozen=True)
class PipelineLayout:
    """What :func:`pipeline_layout` resolved and checked: the schedule, the modes, the mesh
    and its process groups, the stages' block ranges and this rank's stages, the loss."""

    schedule: ScheduleInfo
    asked_schedule: str  # as the caller named it (in messages)
    n_microbatches: int
    virtual: int
    frontend: str
    family: str | None
    precision: Precision
    recompute: tuple[str, ...]  # per stage
    modes: bool  # plain stages that run under planned_stage (mixed precision, recomputation)
    programs: bool  # stages that run a plan each (stage_program)
    dmesh: Any
    groups: dict[str, Any]
    dp: int
    block_path: str
    ranges: ps.Ranges
    microbatch: int  # rows per micro-batch, per dp share
    placement: dict[int, int]
    local: list[int]
    device: torch.device
    loss: Callable[[Any, torch.Tensor], torch.Tensor]


def pipeline_layout(model: nn.Module, example_inputs: tuple, mesh: Any,
                    split: Sequence[int] | Sequence[tuple[int, int]] | None = None,
                    schedule: str = "1f1b", n_microbatches: int = 4, virtual: int | None = None,
                    frontend: str = "auto",
                    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
                    plans_given: bool = False, precision: Precision | str | None = None,
                    recompute: str | Sequence[str] = "none") -> PipelineLayout:
    """:func:`build_pipeline`'s arguments resolved and checked, before any stage is built
    (``plans_given``: stage plans will be given, so the stages run a plan each)."""
    info = schedule_info(schedule)
    info.torch_class()  # this torch has it
    style, per_rank = info.placement, info.stages_per_rank
    prec = resolve_precision(precision or "fp32", None)
    # a stage program recomputes inside its one lowered backward, whatever the schedule does
    # with it; a plain stage's selective checkpointing holds for one backward pass only
    plain_split = info.splits_backward and not (plans_given or _tp_size(mesh) > 1)
    asked = distinct_modes(recompute)
    for mode in asked:
        check_modes(prec, mode, schedule if plain_split else None)
    modes = prec.mixed or asked != ["none"]  # the stages run under planned_stage
    virtual = virtual if virtual is not None else (per_rank or 1)
    if per_rank is not None and virtual != per_rank:
        raise PlanError(f"schedule {schedule!r} runs {per_rank} stage(s) per rank, got "
                        f"virtual={virtual}: use virtual={per_rank} or another schedule")
    if frontend not in ("auto", "trace", "module"):
        raise PlanError(f"frontend must be 'auto', 'trace' or 'module', got {frontend!r}")
    family = ps.module_family(model)
    if family == "moe":
        if frontend == "trace":
            raise PlanError("torch's splitter traces the MoE model's logits, which leave out "
                            "its load-balancing loss: use frontend='module' (or 'auto')")
        frontend = "module"
    dmesh, groups = _mesh_groups(mesh)
    names = dmesh.mesh_dim_names
    pp = dmesh.size(names.index("pp"))
    dp = dmesh.size(names.index("dp")) if "dp" in names else 1
    tp = dmesh.size(names.index("tp")) if "tp" in names else 1
    programs = tp > 1 or plans_given
    if programs:
        frontend = _program_frontend(family, frontend, schedule, names)
    elif modes:
        frontend = modes_frontend(model, family, frontend, prec, "/".join(asked))
    n_stages = pp * virtual
    block_path, blocks = ps.find_blocks(model)
    ranges = ps.stage_ranges(split, len(blocks), n_stages)
    per_stage = stage_recompute(recompute, n_stages)
    tokens = example_inputs[0]
    mb = ps.check_batch(tokens.shape[0], dp, n_microbatches)
    placement = stage_placement(pp, n_stages, style)
    pp_rank = dist.get_rank(groups["pp"])
    local = [s for s in range(n_stages) if placement[s] == pp_rank]
    device = torch.device(dmesh.device_type)
    if device.type == "cuda":  # this process's GPU (init_from_env set it from LOCAL_RANK)
        device = torch.device("cuda", torch.cuda.current_device())
    loss = loss_fn or ps.loss_fn_for(model)
    if prec.mixed and not programs:  # a program traces its loss under the policy itself
        loss = under_policy(loss, prec)
    if programs:
        from autopar.runtime.pipeline.stage_program import stage_submesh

        stage_submesh(dmesh)  # the mesh has axes besides pp for the programs to run on
    return PipelineLayout(info, schedule, n_microbatches, virtual, frontend, family, prec,
                          per_stage, modes, programs, dmesh, groups, dp, block_path, ranges, mb,
                          placement, local, device, loss)


def build_from_layout(model: nn.Module, example_inputs: tuple, layout: PipelineLayout,
                      stage_plans: PlannedStages | None = None) -> PipelineRunner:
    """This rank's stages of ``layout`` and the schedule over them (:func:`build_pipeline`):
    stage programs running ``stage_plans`` where the layout's stages run a plan each."""
    lay = layout
    info, schedule, groups = lay.schedule, lay.asked_schedule, lay.groups
    cls, style, per_rank = info.torch_class(), info.placement, info.stages_per_rank
    tokens, loss, frontend = example_inputs[0], lay.loss, lay.frontend
    if lay.programs:
        from autopar.runtime.pipeline.stage_program import build_programs

        if stage_plans is None:
            raise PlanError(
                "stages that run a plan each (a 'tp' axis, or stage_plans) need every stage's "
                "plan, which the runtime does not make: build the pipeline with "
                "autopar.api.build_pipeline (it plans them) or autopar.parallelize")
        mods, stages, plans = build_programs(model, lay.block_path, lay.ranges, lay.local,
                                             lay.dmesh, groups["pp"], loss, lay.device,
                                             stage_plans, lay.precision, lay.recompute,
                                             info.splits_backward)
        loss = _loss_of_last_stage  # the last stage's program computes the loss itself
    else:
        mods, stages, frontend = _module_stages(
            model, lay.family, frontend, style, lay.block_path, lay.ranges, lay.local,
            tokens[:lay.microbatch], lay.device, groups["pp"],
            (lay.precision, lay.recompute) if lay.modes else None)
    n_microbatches = lay.n_microbatches
    try:
        sched = cls(stages if per_rank != 1 else stages[0], n_microbatches=n_microbatches,
                    loss_fn=loss, scale_grads=True)
    except ValueError as e:  # torch's own conditions (micro-batches per round, ...)
        raise PlanError(f"schedule {schedule!r} refuses this pipeline ({e}): change "
                        "n_microbatches or the number of stages") from None
    aliases = ps.alias_names(model)
    holders = ps.tied_names(_all_stage_names(mods, groups["pp"]), aliases)
    tied = _tied_groups(holders, lay.placement, lay.dmesh)
    runner = PipelineRunner(sched, stages, mods, lay.ranges, groups, lay.dp, n_microbatches,
                            (tied, aliases, holders), frontend, info.key, lay.programs)
    # gradients summed across replicas in another dtype than their own, as the SPMD runtime
    # sums a plan's (runtime.lower): cast before the all-reduce, back after
    runner.reduce_dtype = (lay.precision.reduce_dtype if lay.precision.mixed
                           and lay.precision.reduce != "fp32" else None)
    # one mode where every stage runs it, else each stage's
    runner.precision = lay.precision
    runner.recompute = lay.recompute[0] if len(set(lay.recompute)) == 1 else lay.recompute
    runner.input_shapes = (tuple(tokens.shape), tuple(example_inputs[1].shape))
    if lay.programs:
        runner.plans = plans
    return runner


def _module_stages(model: nn.Module, family: str | None, frontend: str, style: str,
                   block_path: str, ranges: ps.Ranges, local: list[int],
                   mb_tokens: torch.Tensor, device: torch.device, pp_group: Any,
                   modes: tuple[Precision, tuple[str, ...]] | None = None
                   ) -> tuple[dict[int, nn.Module], list, str]:
    """This rank's stages as plain modules (torch's traced ones or autopar's), torch's
    pipeline stage over each, and the frontend that made them. ``modes``: the precision and
    each stage's recompute mode autopar's stages run under (:class:`PlannedStage`)."""
    n_stages = len(ranges)
    if frontend in ("auto", "trace"):
        try:
            mods, info = ps.traced_stages(model, (mb_tokens.to(device),), block_path, ranges,
                                          local)
            frontend = "trace"
        except ps.TracedSplitError:
            if frontend == "trace" or family is None:
                raise
            frontend = "module"  # autopar's own model: stages written for it
    if frontend == "module":
        mods = ps.module_stages(model, block_path, ranges, local)
    if modes is not None:
        # the stage's outputs in the compute dtype: the manual stage infers their shapes and
        # dtypes by running it, where torch's traced stage would expect the traced fp32 ones
        prec, per_stage = modes
        stages = [PipelineStage(PlannedStage(mods[s], prec, per_stage[s]).to(device), s,
                                n_stages, device, group=pp_group) for s in local]
        for s, st in zip(local, stages):
            if per_stage[s] != "none":  # a split backward's W action: checkpointed blocks once
                one_weight_pass(st)
    elif frontend == "trace" and style == "loop":
        stages = [build_stage(mods[s], s, info, device, pp_group) for s in local]
    else:
        # torch 2.13's traced stage (build_stage) cannot hand values between two stages on one
        # rank, as the V-shaped schedules do; the manual stage can, and infers the shapes itself
        stages = [PipelineStage(mods[s].to(device), s, n_stages, device, group=pp_group)
                  for s in local]
    return mods, stages, frontend


def _piece(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece: a DTensor's local tensor, else ``t``."""
    return _compat.local_of(t) if isinstance(t, DTensor) else t


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor: a DTensor's whole value, else ``t``."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


def _loss_of_last_stage(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The schedule's loss where the last stage's program returns the loss already."""
    return out


def _program_frontend(family: str | None, frontend: str, schedule: str,
                      names: Sequence[str]) -> str:
    """The frontend of stages that run a plan each: autopar's own block stages, which
    :mod:`.stage_program` traces one by one; refused where they cannot run."""
    if family not in ("gpt2", "llama3"):
        what = "its MoE model" if family == "moe" else "this model"
        raise PlanError(
            f"pipeline stages that run a plan each (a 'tp' axis, or stage_plans) are built for "
            f"autopar's GPT-2 and Llama-3 models, not {what}: use a mesh of axes ('pp', 'dp')")
    if frontend == "trace":
        raise PlanError(
            "torch's traced stages run as plain modules and cannot run a stage's plan over a "
            f"'tp' axis (mesh axes {tuple(names)}): use frontend='module' (or 'auto'), or a "
            "mesh without tp")
    return "module"


def _all_stage_names(local_mods: dict[int, nn.Module], pp_group: Any) -> dict[int, list[str]]:
    """Every stage's parameter names, gathered over the pp group (a rank builds only its own
    stages), so every rank finds the same tied weights and makes the same groups."""
    mine = {s: [n for n, _ in m.named_parameters(remove_duplicate=False)]
            for s, m in local_mods.items()}
    everyone: list[Any] = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(everyone, mine, group=pp_group)
    return {int(s): names for part in everyone for s, names in part.items()}


def _tied_groups(tied: dict[str, list[int]], placement: dict[int, int], dmesh: Any
                 ) -> dict[str, Any]:
    """For each tied weight held on more than one pp rank, the process group of those ranks
    (in this rank's data-parallel column). ``None`` where one rank holds every copy. Every
    rank makes every group, in the same order, as ``new_group`` requires."""
    names = dmesh.mesh_dim_names
    grid = dmesh.mesh.movedim(names.index("pp"), 0).reshape(dmesh.size(names.index("pp")), -1)
    me = dist.get_rank()
    out: dict[str, Any] = {}
    for name in sorted(tied):
        pp_ranks = sorted({placement[s] for s in tied[name]})
        out[name] = None
        if len(pp_ranks) < 2:
            continue
        for col in range(grid.shape[1]):
            ranks = [int(grid[r, col]) for r in pp_ranks]
            group = dist.new_group(ranks)
            if me in ranks:
                out[name] = group
    return out


class PipelineRunner:
    """This rank's stages of a pipeline and the schedule that runs them.

    ``step(tokens, targets)`` takes the global batch (every rank passes the same), runs the
    data-parallel share of this rank's replica as ``n_microbatches`` micro-batches, adds the
    single-device gradients to the local stage parameters' ``.grad`` (as ``backward`` does:
    zero them between optimizer steps) and returns the single-device mean loss on every rank.
    Step the optimizer over :meth:`parameters`.
    """

    def __init__(self, schedule: Any, stages: list, stage_modules: dict[int, nn.Module],
                 ranges: ps.Ranges, groups: dict[str, Any], dp: int, n_microbatches: int,
                 tied: tuple[dict[str, Any], dict[str, str], dict[str, list[int]]],
                 frontend: str,
                 schedule_name: str, programs: bool = False) -> None:
        self.schedule = schedule
        self.stages = stages
        self.stage_modules = stage_modules
        self.ranges = ranges
        self.groups = groups
        self.dp = dp
        self.n_microbatches = n_microbatches
        self.frontend = frontend
        self.schedule_name = schedule_name
        # the stages run a plan each (stage_program): DTensor parameters whose gradients the
        # plan sums over dp, the loss computed by the last stage from its targets
        self.programs = programs
        # tied weight's first name -> group of the pp ranks holding a copy (None: all here);
        # each name of a weight the model holds under several -> its first name; tied weight's
        # first name -> the stages holding a copy
        self._tied, self._alias, self._holders = tied
        self.rank = dist.get_rank()
        self.dp_rank = dist.get_rank(groups["dp"]) if "dp" in groups else 0
        self.has_last = any(st.is_last for st in stages)
        self.last_step_events: list[StageEvent] = []
        self.input_shapes: tuple[tuple, tuple] | None = None  # (tokens, targets) it runs on
        self.plans: list[Any] | None = None  # every stage's plan, where stages run one each
        self.precision = Precision()  # what plain stages compute in (planned_stage)
        self.recompute = "none"
        self.reduce_dtype: torch.dtype | None = None  # the dp all-reduce's, where not fp32
        # the last stage's outputs are not kept for the caller where torch lets us say so
        self._step_options = {"return_outputs": False} if "return_outputs" in \
            inspect.signature(schedule.step).parameters else {}
        self._t0 = 0.0
        for st in stages:
            instrument(st, self._record)

    # --- parameters -----------------------------------------------------------------------

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's stage parameters under the whole model's names (a tied weight once per
        local stage holding a copy)."""
        for _, mod in sorted(self.stage_modules.items()):
            yield from mod.named_parameters()

    def stage_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """As :meth:`named_parameters`, also the names under which a stage holds a parameter
        twice (traced stages keep a tied weight's every name)."""
        for _, mod in sorted(self.stage_modules.items()):
            yield from mod.named_parameters(remove_duplicate=False)

    def parameters(self) -> Iterator[nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    # --- one step -------------------------------------------------------------------------

    def step(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        shapes = (tuple(tokens.shape), tuple(targets.shape))
        if self.input_shapes is not None and shapes != self.input_shapes:
            # the stages' buffers and (traced) graphs have the example's shapes
            raise PlanError(
                f"the pipeline was built for inputs of shapes {self.input_shapes[0]} and "
                f"{self.input_shapes[1]}, called with {shapes[0]} and {shapes[1]}: build "
                "another pipeline (build_pipeline) for these shapes")
        self.last_step_events = []
        self._t0 = time.perf_counter()
        device = self.stages[0].device
        share = tokens.shape[0] // self.dp
        sl = slice(self.dp_rank * share, (self.dp_rank + 1) * share)
        x, y = tokens[sl].to(device), targets[sl].to(device)
        losses: list[torch.Tensor] = []
        first = any(st.is_first for st in self.stages)
        args = (x,) if first else ()
        # torch's schedules divide all of .grad by the micro-batch count and the tied sum
        # would add earlier gradients twice: set them aside, add them back after
        params = list(self.parameters())
        earlier = [p.grad for p in params]
        for p in params:
            p.grad = None
        # a stage program's last stage reads its targets as a keyword input, which torch's
        # schedules split into micro-batches and hand every stage (the others ignore it)
        extra = {"targets": y} if self.programs else {}
        # a stage program sums its gradients over the micro-batches locally and runs its
        # plan's gradient sync once, in its last backward of the step (stage_program)
        progs = self._programs()
        for prog in progs:
            prog.defer_grad_sync(self.n_microbatches)
        self.schedule.step(*args, target=y if self.has_last else None, losses=losses,
                           **self._step_options, **extra)
        for prog in progs:
            prog.grad_sync_done()
        t = time.perf_counter()
        self._sync_grads()
        self._record("sync", -1, -1, t)
        for p, g in zip(params, earlier):
            if g is not None:
                p.grad = g if p.grad is None else g.add_(p.grad)
        return self._mean_loss(losses, device)

    def _programs(self) -> list[Any]:
        """This rank's stages that run a plan each (:class:`StageProgram`), else none."""
        if not self.programs:
            return []
        from autopar.runtime.pipeline.stage_program import StageProgram

        return [m for m in self.stage_modules.values() if isinstance(m, StageProgram)]

    def _sync_grads(self) -> None:
        """Tied copies summed, then the data-parallel replicas averaged (one flat buffer)."""
        by_name: dict[str, list[nn.Parameter]] = {}
        for name, p in self.stage_parameters():
            by_name.setdefault(self._alias.get(name, name), []).append(p)
        for name, group in self._tied.items():
            copies = by_name.get(name, [])
            if not copies:
                continue
            # a copy no micro-batch reached has no gradient: it adds zeros, and still joins
            # the all-reduce its peers wait in. A stage program's copies are DTensors placed
            # alike on every stage (stage_program.plan_stages): their pieces are summed
            local = [_piece(p) for p in copies]
            total = torch.stack([torch.zeros_like(t) if p.grad is None else
                                 _piece(p.grad) for t, p in zip(local, copies)]).sum(0)
            if group is not None:
                dist.all_reduce(total, group=group)
            for p in copies:
                p.grad = (_compat.dtensor_like(p, total.clone()) if self.programs
                          else total.clone())
        if self.dp == 1 or self.programs:  # a stage program's plan summed them over dp
            return
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        if self.reduce_dtype is not None:
            low = flat.to(self.reduce_dtype)
            dist.all_reduce(low, group=self.groups["dp"])
            flat = low.to(flat.dtype)
        else:
            dist.all_reduce(flat, group=self.groups["dp"])
        flat.div_(self.dp)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the whole model's gradients: the norm the
        single device would compute (each tied weight counted once, at its first stage),
        returned on every rank, and every local gradient scaled as it would scale them. Call
        after :meth:`step`, before the optimizer."""
        mine = {s for s in self.stage_modules}
        counted: set[str] = set()
        pieces = []
        for s, mod in sorted(self.stage_modules.items()):
            for name, p in mod.named_parameters(remove_duplicate=False):
                key = self._alias.get(name, name)
                first = self._holders.get(key, [s])[0]
                if p.grad is None or key in counted or first not in mine:
                    continue
                counted.add(key)
                pieces.append(p.grad.detach())
        device = self.stages[0].device
        inf = norm_type == float("inf")
        local = torch.zeros((), device=device)
        if pieces:
            # a stage program's gradients are DTensors: each norm is the whole tensor's, made
            # by DTensor's own collectives over the stage's submesh
            norms = torch.stack([_whole(g.abs().max() if inf else g.float().norm(norm_type))
                                 for g in pieces])
            local = norms.max() if inf else norms.pow(norm_type).sum()
        op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
        dist.all_reduce(local, op=op, group=self.groups["pp"])  # replicas hold the same
        total = local if inf else local.pow(1.0 / norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in self.parameters():
            if p.grad is not None:
                _piece(p.grad).mul_(coef.to(p.grad.dtype))  # a DTensor's piece
        return total

    def _mean_loss(self, losses: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        """The whole batch's mean loss on every rank: the last stage's micro-batch mean, summed
        over the pp group (one member holds it), averaged over the replicas."""
        if self.has_last:
            value = torch.stack([v.detach().float() for v in losses]).mean().reshape(1)
        else:
            value = torch.zeros(1, device=device)
        dist.all_reduce(value, group=self.groups["pp"])
        if self.dp > 1 and not self.programs:  # a program's loss is the whole micro-batch's
            dist.all_reduce(value, group=self.groups["dp"])
            value /= self.dp
        return value[0]

    def _record(self, kind: str, stage: int, mb: int, start: float) -> None:
        self.last_step_events.append(StageEvent(self.rank, kind, stage, mb, start - self._t0,
                                                time.perf_counter() - self._t0))
