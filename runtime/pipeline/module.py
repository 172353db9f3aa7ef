"""A pipeline behind the ordinary training loop: ``loss = model(x, y); loss.backward()``.

torch's schedules run the forward and the backward of every micro-batch in one call, so the
whole step happens in ``forward``; the gradients it makes are held aside, and ``backward``
hands them to autograd scaled by the gradient it receives. So ``loss.backward()`` stores the
step's gradients in ``.grad`` as a one-device backward would, ``(loss / k).backward()`` over
k calls accumulates them as gradient accumulation does, and hooks run as usual. Any
``torch.optim`` optimizer steps :meth:`PipelineModule.parameters` (this rank's stages).

:func:`build_options` is ``autopar.parallelize``'s way in for a mesh with a ``pp`` axis: it
reads a pipeline plan (:func:`autopar.planning.pipeline.plan_pipeline`) into what the runtime
builds, as it is written: its stages' block ranges, schedule, stages per rank and
micro-batches. Where the plan's stage layout keeps every parameter whole on a ``dp``-only
stage mesh, the stages are plain modules replicated over ``dp`` (any schedule, autopar's
models and Hugging Face ones), computing in the plan's precision and recomputing as it says,
as the SPMD runtime does (:mod:`.planned_stage`); where it splits them (a ``tp`` axis,
ZeRO/FSDP over ``dp``), each stage runs its own intra-op plan with the parameters placed as
the pipeline plan says (:mod:`.stage_program`; ``autopar.api`` makes those plans), each
traced under the plan's precision and recomputing in its mode. What neither runs as written
(offload, fp16's loss scaling; selective recomputation in plain stages under a split
backward) is refused with the cause and the fix (:func:`check_runnable`), never run as
something else.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autopar.ir.errors import MeshError, PlanError
from autopar.ir.mesh import Mesh
from autopar.ir.pipeline_mesh import pipeline_axis, stage_mesh
from autopar.ir.plan import Plan, ScheduleOption
from autopar.ir.schedules import canonical_name, splits_backward, stage_placement
from autopar.ir.schedules import schedule as schedule_info
from autopar.ir.stage_kind import plan_runs_as_program
from autopar.runtime.pipeline import stages as ps
from autopar.runtime.pipeline.runner import AXES, PipelineRunner


class _WholeStep(torch.autograd.Function):
    """The schedule's step in ``forward``; its gradients, scaled, in ``backward``."""

    @staticmethod
    def forward(ctx: Any, runner: PipelineRunner, tokens: torch.Tensor, targets: torch.Tensor,
                *params: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        # what .grad holds from earlier calls (accumulation) is not this step's: set it aside
        # so the schedule writes this step's alone, then put it back for autograd to add to
        earlier = [p.grad for p in params]
        for p in params:
            p.grad = None
        with torch.enable_grad():  # the schedule runs its own forward and backward
            loss = runner.step(tokens, targets)
        ctx.grads = [p.grad for p in params]
        for p, g in zip(params, earlier):
            p.grad = g
        return loss.detach()

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple:  # type: ignore[override]
        grads, ctx.grads = ctx.grads, None
        # a number, not a tensor: a stage program's gradients are DTensors, which take no
        # plain tensor operand
        scale = float(grad_loss)
        scaled = [g if g is None or scale == 1.0 else g * scale for g in grads]
        return (None, None, None, *scaled)


@dataclass(frozen=True, slots=True)
class PipelineInputs:
    """How a call hands the pipeline its token ids and targets: two positional tensors
    (``keys`` None) or two keywords (a Hugging Face model's ``input_ids`` and ``labels``)."""

    keys: tuple[str, str] | None = None

    @classmethod
    def of(cls, args: Sequence[Any], kwargs: dict | None) -> PipelineInputs:
        kwargs = kwargs or {}
        if not kwargs and len(args) == 2 and all(isinstance(a, torch.Tensor) for a in args):
            return cls(None)
        if not args and set(kwargs) == {"input_ids", "labels"}:
            return cls(("input_ids", "labels"))
        raise PlanError(
            f"a pipeline takes the token ids and the targets (two positional tensors, or "
            f"input_ids= and labels= for a Hugging Face model), got {len(args)} positional and "
            f"keywords {sorted(kwargs)}: call the model with those two only")

    def split(self, args: Sequence[Any], kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is None and not kwargs and len(args) == 2:
            return args[0], args[1]
        if self.keys is not None and not args and set(kwargs) == set(self.keys):
            return kwargs[self.keys[0]], kwargs[self.keys[1]]
        want = "two positional tensors" if self.keys is None else \
            f"keywords {self.keys[0]}= and {self.keys[1]}="
        raise PlanError(f"the pipeline was built for calls with {want}, called with "
                        f"{len(args)} positional and keywords {sorted(kwargs)}: call it as it "
                        "was parallelized")


class PipelineModule(nn.Module):
    """This rank's pipeline stages as one module. Calling it runs a whole schedule step and
    returns the single-device mean loss on every rank; its ``backward`` delivers the step's
    gradients. ``stages.<s>`` holds stage ``s`` under the whole model's names
    (``stages.1.layers.3.attention.wq.weight``); a tied weight has one copy per stage.
    ``state_dict()`` and ``load_state_dict()`` speak the single-device model's names
    (``layers.3.attention.wq.weight``): this rank's stages' entries, which a whole model's state
    dict (the plain model's, a Hugging Face model's own weights) loads into. Clip gradients
    with :meth:`clip_grad_norm_` (torch's own would see this rank's stages only). ``plan``: the
    pipeline plan it runs, where ``parallelize`` made it. ``model_keys``: every state-dict key
    of the whole model (``load_state_dict(strict=True)`` refuses others; None: not checked)."""

    def __init__(self, runner: PipelineRunner, plan: Plan | None = None,
                 inputs: PipelineInputs | None = None,
                 model_keys: Sequence[str] | None = None) -> None:
        super().__init__()
        self.runner = runner
        self.plan = plan
        self.inputs = inputs or PipelineInputs()
        self.model_keys = None if model_keys is None else frozenset(model_keys)
        self.profile: Any = None  # a directory: one step's traces (:meth:`profile_step`)
        self._calls = 0
        self.stages = nn.ModuleDict({str(s): m for s, m in sorted(runner.stage_modules.items())})

    def forward(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        tokens, targets = self.inputs.split(args, kwargs)
        shapes = (tuple(tokens.shape), tuple(targets.shape))
        if self.plan is not None and shapes != self.runner.input_shapes:
            # the stages' buffers (and traced graphs) have the example's shapes
            raise PlanError(
                f"the pipeline was parallelized for inputs of shapes {self.runner.input_shapes}, "
                f"called with {shapes}: call it with those shapes, or parallelize again for "
                "these (a pipeline does not replan on its own)")
        if not torch.is_grad_enabled():
            raise RuntimeError("a pipeline step runs forward and backward together; call it "
                               "with gradients enabled (not under torch.no_grad())")
        params = list(self.runner.parameters())
        loss = _WholeStep.apply(self.runner, tokens, targets, *params)
        self._calls += 1
        if self.profile is not None and self._calls == 2:  # the first pays one-off costs
            self.write_profile(self.profile)
        return loss

    def write_profile(self, out_dir: Any) -> None:
        """The last step as traces beside the plan's prediction: this rank's measured actions
        (``trace_rank{r}.json``: each forward and backward under torch's action name, the
        gradient sync; the per-action timings :class:`PipelineRunner` records around
        torch's own actions) and, on rank 0, the plan's predicted step (``predicted.json``,
        :mod:`autopar.report.pipeline_timeline`), with the same event names."""
        import torch.distributed as dist

        from autopar.report.trace_events import pipeline_trace_events, write_trace

        d = Path(out_dir)
        d.mkdir(parents=True, exist_ok=True)
        rank = dist.get_rank()  # the events carry it: one process per rank in the trace
        write_trace(pipeline_trace_events(self.runner.last_step_events),
                    d / f"trace_rank{rank}.json", {"autopar": "measured", "rank": rank})
        if rank == 0 and self.plan is not None and self.plan.decided.pipeline is not None:
            from autopar.report.pipeline_timeline import write_pipeline_timeline

            write_pipeline_timeline(self.plan, d / "predicted.json")

    # --- state under the single-device model's names -------------------------------------

    def named_model_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's parameters under the single-device model's names; a weight tied across
        two local stages appears once per copy, under one name."""
        return [(name, p) for stage in self.stages.values()
                for name, p in stage.named_parameters(remove_duplicate=False)]

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "",
                   keep_vars: bool = False) -> Any:
        """This rank's stages' state under the single-device model's names (a tied weight's
        copies in two local stages: the first)."""
        if args:  # torch's deprecated positional form: (destination, prefix, keep_vars)
            destination, prefix, keep_vars = (*args, *(destination, prefix, keep_vars)[len(args):])
        out = OrderedDict() if destination is None else destination
        for stage in self.stages.values():
            for key, value in stage.state_dict(prefix=prefix, keep_vars=keep_vars).items():
                out.setdefault(key, value)
        return out

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False
                        ) -> Any:
        """Load the entries of a state dict under the single-device model's names (a whole
        model's, or another pipeline rank's) into this rank's stages. ``strict``: every entry of
        this rank's stages must be given, and every key given must be one of the whole model's
        (``model_keys``); the entries of other ranks' stages are expected, not refused."""
        from torch.nn.modules.module import _IncompatibleKeys

        missing: list[str] = []
        for stage in self.stages.values():
            own = stage.state_dict(keep_vars=True)
            missing += [k for k in own if k not in state_dict]
            stage.load_state_dict({k: v for k, v in state_dict.items() if k in own},
                                  strict=False, assign=assign)
        held = self.model_keys if self.model_keys is not None else set(state_dict)
        unexpected = [k for k in state_dict if k not in held]
        if strict and (missing or unexpected):
            parts = [f"Missing key(s) in state_dict: {', '.join(map(repr, missing))}."] * \
                bool(missing) + \
                [f"Unexpected key(s) in state_dict: {', '.join(map(repr, unexpected))}."] * \
                bool(unexpected)
            raise RuntimeError(f"Error(s) in loading state_dict for {type(self).__name__}:\n\t"
                               + "\n\t".join(parts))
        return _IncompatibleKeys(missing, unexpected)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """The whole model's gradient norm (as one device computes it) on every rank, the
        gradients scaled as torch's ``clip_grad_norm_`` scales them."""
        return self.runner.clip_grad_norm_(max_norm, norm_type)

    def make_optimizer(self, cls: type[torch.optim.Optimizer], **kwargs: Any) -> Any:
        """``cls(self.parameters(), **kwargs)``, as ``ParallelModule.make_optimizer``."""
        return cls(self.parameters(), **kwargs)


# --- parallelize's way in -----------------------------------------------------------------------


def check_mesh(mesh: Mesh) -> None:
    """A pipeline mesh the runtime runs: a ``pp`` axis, the others ``dp`` or ``tp``."""
    if "pp" not in mesh.axes:
        raise MeshError(f"mesh {mesh.describe()} has no axis named 'pp': name the pipeline "
                        "axis 'pp' (e.g. pp=2,dp=2)")
    other = [f"{a}={n}" for a, n in zip(mesh.axes, mesh.shape) if a not in AXES and n > 1]
    if other:
        raise MeshError(f"pipelines run on mesh axes 'pp', 'dp' and 'tp'; {', '.join(other)} is "
                        "not one of them: name the mesh's axes from ('pp', 'dp', 'tp')")


def check_runnable(plan: Plan, model: nn.Module | None = None) -> None:
    """Refuse, naming what differs and the fix, a pipeline plan whose stages the runtime would
    run otherwise than written. Plain stages (replicated over ``dp``) run fp32 or bf16 and
    any recompute mode as the SPMD runtime does (:mod:`.planned_stage`; selective
    recomputation under schedules with a whole backward), in autopar's stage modules; nothing
    runs offloaded optimizer state or fp16's loss scaling; stage programs run autopar's GPT-2
    and Llama-3 stages in fp32 or bf16 and any recompute mode (inside their lowered
    backward), under any schedule."""
    pipe = plan.decided.pipeline
    assert pipe is not None
    fix_fit = ("give a larger memory_budget (--memory-budget), more pipeline stages or "
               "smaller micro-batches")
    if plan.decided.param_state.offloaded:
        raise PlanError(f"the plan keeps the optimizer state of "
                        f"{len(plan.decided.param_state.offloaded)} parameters on the host, which "
                        f"pipeline stages do not do: plan with offload='none', or {fix_fit}")
    prec = plan.decided.precision
    modes = list(dict.fromkeys(pipe.stage_recompute(plan.decided.recompute.mode)))
    mode = "/".join(modes)  # each stage's, where they differ
    if prec.loss_scaling:
        raise PlanError(f"the plan computes in {prec.name}, whose dynamic loss scaling pipeline "
                        "stages do not do yet: plan it with precision='bf16' (--precision "
                        "bf16) or 'fp32'")
    if not plan_runs_as_program(plan):
        if "selective" in modes and splits_backward(pipe.schedule):
            raise PlanError(f"the plan recomputes selectively under {pipe.schedule}, whose "
                            "backward runs twice over every block (input, then weight "
                            "gradients) where selective checkpointing keeps each result for "
                            "one pass: plan with recompute='full', or with schedule 1F1B, "
                            "GPipe, Interleaved1F1B or LoopedBFS")
        if (prec.mixed or modes != ["none"]) and model is not None and \
                ps.module_family(model) is None:
            raise PlanError(f"the plan computes in {prec.name} with recompute {mode!r}, which "
                            f"pipelines run in autopar's stage modules (autopar's GPT-2, "
                            f"Llama-3 and MoE, Hugging Face Llama-style decoders), not in "
                            f"torch's traced stages of {type(model).__name__}: plan it with "
                            "precision='fp32' and recompute='none', or use a mesh without a "
                            "'pp' axis")
        return
    why = ("its stage mesh has a 'tp' axis" if "tp" in plan.decided.mesh_axes else
           "its stage layout splits parameters over dp (ZeRO/FSDP)")
    if model is not None and ps.module_family(model) not in ("gpt2", "llama3"):
        raise PlanError(f"the plan runs each stage's own intra-op plan ({why}), which pipelines "
                        f"do for autopar's GPT-2 and Llama-3 models only, not "
                        f"{type(model).__name__}: use a mesh of axes ('pp', 'dp'), or "
                        f"{fix_fit} so that stages stay replicated")


def runnable_option(plan: Plan) -> ScheduleOption | None:
    """Where the planner chose a schedule the plan's stages cannot run (a split backward
    under selective recomputation in plain stages), the fastest option it weighed that they
    can; None where its choice runs."""
    pipe = plan.decided.pipeline
    assert pipe is not None
    if "selective" not in pipe.stage_recompute(plan.decided.recompute.mode) \
            or not splits_backward(pipe.schedule) or plan_runs_as_program(plan):
        return None
    fit = [o for o in pipe.options if math.isfinite(o.step_s)
           and not splits_backward(o.schedule)]
    return min(fit, key=lambda o: o.step_s, default=None)


def check_plan(plan: Plan, mesh: Mesh, model: nn.Module, shapes: Sequence[Sequence[int]],
               fixed: dict[str, Any]) -> None:
    """A given plan was made for this model, these inputs, this mesh and the ``fixed``
    pipeline choices (schedule, microbatches, virtual: the caller's, None where not given)."""
    pipe = plan.decided.pipeline
    if pipe is None:
        raise PlanError("the plan has no pipeline section (it was made for a mesh without a "
                        "'pp' axis): make it for this mesh (autopar plan ... --mesh "
                        f"{_mesh_text(mesh)}), or run on the mesh it was made for")
    axis = pipeline_axis(mesh)
    sub = stage_mesh(mesh, axis) if axis is not None else None
    if sub is None or mesh.axes[axis] != pipe.axis or mesh.shape[axis] != pipe.size or \
            tuple(sub.shape) != tuple(plan.decided.mesh_shape) or \
            tuple(sub.axes) != tuple(plan.decided.mesh_axes):
        made = ",".join(f"{a}={n}" for a, n in zip(*reversed(plan.full_mesh)))
        raise PlanError(f"the plan was made for mesh {made} but runs on {_mesh_text(mesh)}: "
                        "make the plan for this mesh, or run on the mesh it was made for")
    n_blocks = len(ps.find_blocks(model)[1])
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    if pipe.stages[-1].end_block != n_blocks or set(plan.decided.params) != names:
        named = plan.provenance.model or "unnamed"
        raise PlanError(f"the plan was made for another model ({named}, "
                        f"{pipe.stages[-1].end_block} blocks; this one has {n_blocks}): make the "
                        "plan for this model")
    planned = [list(s) for s in plan.decided.input_shapes.values()]
    if planned != [list(s) for s in shapes]:
        raise PlanError(f"the plan was made for inputs of shapes {planned}, the example inputs "
                        f"have {[list(s) for s in shapes]}: make the plan for these shapes")
    have = {"schedule": pipe.schedule, "microbatches": pipe.microbatches,
            "virtual": pipe.virtual}
    for key, want in fixed.items():
        if want is not None and _same(key, want) != have[key]:
            raise PlanError(f"{key}={want!r} was asked but the given plan has {key}="
                            f"{have[key]!r}: leave {key} out to run the plan as made, or make "
                            "the plan with it")


def build_options(model: nn.Module, plan: Plan, args: tuple, kwargs: dict | None,
                  loss_fn: Any = None) -> tuple[PipelineInputs, dict[str, Any]]:
    """How ``model`` runs as the pipeline ``plan`` describes: how calls hand it their inputs,
    and :func:`~autopar.runtime.pipeline.runner.build_pipeline`'s keywords (its stages' block
    ranges, schedule, stages per rank and micro-batches; each stage a plain module replicated
    over ``dp`` in the plan's precision and recomputation, or, where
    :func:`~autopar.ir.stage_kind.plan_runs_as_program`, a stage program, whose plans the
    caller makes: ``autopar.api``). Refuses what the runtime would run otherwise than the
    plan says (:func:`check_runnable`, the stage placement, the model). ``loss_fn``: the
    user's ``loss_fn(output, targets)``, which any model may be pipelined with."""
    check_runnable(plan, model)
    inputs = PipelineInputs.of(args, kwargs)
    pipe = plan.decided.pipeline
    assert pipe is not None
    info = schedule_info(pipe.schedule)
    placement = stage_placement(pipe.size, len(pipe.stages), info.placement)
    for st in pipe.stages:  # torch's schedules fix where each stage runs: the plan must agree
        if placement[st.index] != st.rank:
            raise PlanError(f"the plan puts stage {st.index} on pipeline rank {st.rank}, where "
                            f"torch's {pipe.schedule} runs it on rank {placement[st.index]}: "
                            "make the plan again with this autopar")
    family = ps.module_family(model)
    if family is None and not ps.is_hf_model(model) and loss_fn is None:
        # the runtime's loss is the family's own next-token cross-entropy: any other model's
        # loss would be computed as something else
        raise PlanError(
            f"pipelines compute autopar's GPT-2, Llama-3 and MoE models' and Hugging Face causal "
            f"LMs' own next-token loss, and know no other of {type(model).__name__}: make its "
            "forward return the output when called with the inputs alone, and pass "
            "loss_fn=(output, targets) -> loss, or run it on a mesh without a 'pp' axis")
    options: dict[str, Any] = {"frontend": "auto"}
    # each stage's recomputation, as the planner chose it for its microbatches in flight
    per_stage = pipe.stage_recompute(plan.decided.recompute.mode)
    recompute = per_stage[0] if len(set(per_stage)) == 1 else per_stage
    if plan_runs_as_program(plan):  # each stage traced under them, planned in its mode
        options = {"frontend": "module", "precision": plan.decided.precision,
                   "recompute": recompute}
    else:
        # as the SPMD runtime runs them (planned_stage)
        options["precision"] = plan.decided.precision
        options["recompute"] = recompute
        if family == "hf" or plan.decided.precision.mixed or set(per_stage) != {"none"}:
            # autopar's stages: Hugging Face decoders' (torch's splitter drops their rotary
            # inputs with some transformers releases and fails to export 3 stages with
            # others), and the only ones a plan's precision and recomputation reach
            options["frontend"] = "module"
    if loss_fn is not None:
        options["loss_fn"] = loss_fn
    options.update(split=[(st.first_block, st.end_block) for st in pipe.stages],
                   schedule=info.key, n_microbatches=pipe.microbatches, virtual=pipe.virtual)
    return inputs, options


def _same(key: str, value: Any) -> Any:
    if key == "schedule":
        return canonical_name(value)
    return value


def _mesh_text(mesh: Mesh) -> str:
    return ",".join(f"{a}={n}" for a, n in zip(mesh.axes, mesh.shape))
