"""Every pipeline stage's own plan, for stages that run one each (PP x DP x TP).

A stage whose layout splits something (:mod:`autopar.ir.stage_kind`) runs its intra-op plan
as one program on the stage submesh (``runtime/pipeline/stage_program.py``). Its plan is made
here, on the stage's joint graph (:func:`autopar.capture.stage.trace_stage`) with its
boundary pinned (:func:`autopar.capture.stage.pin_boundary`), stage after stage in order, so a
weight two stages share (GPT-2's embedding and head) is pinned on the later stage to the
layout the earlier chose (its gradient copies are then summed piece by piece over the pp
ranks holding them). ``autopar.api`` runs :func:`plan_stages` on rank 0 and hands the plans,
the same on every rank, to the runtime, which runs them and makes none.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from torch import nn

from autopar.capture.stage import StageInputs, output_meta, pin_boundary, trace_stage
from autopar.ir.errors import PlanError
from autopar.ir.graph import PlanGraph
from autopar.ir.mesh import Mesh
from autopar.ir.placements import spec_str
from autopar.ir.plan import Plan, stage_recompute
from autopar.ir.precision import Precision

# the stage plans asked for: given (dict by stage index), or made by a callable from the
# stage's graph (its boundary pinned) and submesh; None: the planner's own (make_plan)
StagePlansAsked = Mapping[int, Plan] | Callable[[int, PlanGraph, Mesh], Plan] | None
# (stage, its pinned graph, its plan, the submesh, the previous stage's plan and pinned
# graph) -> None, raising where the plan cannot run there (the runtime's check)
StagePlanCheck = Callable[[int, PlanGraph, Plan, Mesh, Plan | None, PlanGraph | None], None]


def solve_stage(model: nn.Module | None, graph: PlanGraph, mesh: Mesh, time_limit_s: float,
                model_name: str, zero: int | str = "auto", recompute: str = "none") -> Plan:
    """A stage's plan on its pinned ``graph`` (traced under the pipeline's precision),
    recomputing as ``recompute`` (a fixed mode: the pipeline's), without a memory limit: the
    pipeline plan was made under it, and a stage's graph holds one micro-batch, not the
    in-flight ones the pipeline planner counted."""
    from autopar.ir.options import Options
    from autopar.planning.planner import make_plan

    return make_plan(model, mesh, graph=graph, model_name=model_name,
                     options=Options.of(memory_budget=math.inf, workers=1,
                                        time_limit_s=time_limit_s, zero=zero,
                                        recompute=recompute)).plan


def plan_stages(stages: Mapping[int, nn.Module], block_path: str, first: StageInputs,
                targets: StageInputs, loss_fn: Callable, mesh: Mesh,
                tied: Mapping[str, Sequence[int]], stage_plans: StagePlansAsked = None,
                time_limit_s: float = 30.0, check: StagePlanCheck | None = None,
                precision: Precision | None = None, recompute: str | Sequence[str] = "none"
                ) -> tuple[list[Plan], list[StageInputs]]:
    """Every stage's plan on ``mesh`` (the submesh), in order, and the inputs each was traced
    with. ``stages``: all of them (meta weights are enough); ``first``: the first stage's
    token ids, ``targets`` the last stage's targets; ``tied``: weight name -> the stages
    holding a copy; ``check``: run on each plan before it is kept (the runtime's
    ``check_stage_plan``). Each stage's inputs are pinned to the boundary layout, and a tied
    weight on a later stage to the layout the first holder's plan gave it. Every stage is
    traced under ``precision`` (None: fp32) and the planner's plans recompute as
    ``recompute``, one mode or one per stage (plans given or made by a callable recompute as
    they say)."""
    n = len(stages)
    modes = stage_recompute(recompute, n)
    plans: list[Plan] = []
    inputs: list[StageInputs] = []
    placed: dict[str, tuple] = {}  # a tied weight's layout, from its first holder's plan
    x = first
    prev: PlanGraph | None = None
    for s in range(n):
        last = s == n - 1
        ins = StageInputs(x.shapes + targets.shapes, x.dtypes + targets.dtypes) if last else x
        graph = trace_stage(stages[s], ins, last, loss_fn, block_path, precision)
        pins = {name: spec for name, spec in placed.items() if s in tied.get(name, ())}
        pinned = pin_boundary(graph, mesh, pins)
        if stage_plans is None:
            plan = solve_stage(stages[s], pinned, mesh, time_limit_s,
                               f"{type(stages[s]).__name__} {s}", recompute=modes[s])
        elif callable(stage_plans):
            plan = stage_plans(s, pinned, mesh)
        else:
            if s not in stage_plans:
                raise PlanError(f"stage_plans has no plan for stage {s}: give one per stage "
                                f"(0 to {n - 1}), or a callable (stage, graph, mesh) -> Plan")
            plan = stage_plans[s]
        if check is not None:
            check(s, pinned, plan, mesh, plans[-1] if plans else None, prev)
        for name, spec in pinned.pins.items():  # a plan given may place them otherwise
            if tuple(plan.decided.nodes[name].outs[0]) != tuple(spec):
                what = next(n for n in pinned.graph.nodes if n.name == name).meta["autopar"]
                label = what.param_name or pinned.input_names[what.input_index]
                raise PlanError(
                    f"stage {s}'s plan places {label} as "
                    f"{spec_str(plan.decided.nodes[name].outs[0])} but the pipeline gives it as "
                    f"{spec_str(spec)}: make the stage's plan from "
                    "the graph it is handed, whose boundary (and shared weights) are pinned")
        for name in tied:
            if s in tied[name] and name in plan.decided.params:
                want = placed.setdefault(name, tuple(plan.decided.params[name]))
                if tuple(plan.decided.params[name]) != want:
                    raise PlanError(
                        f"stage {s}'s plan places the shared weight {name} as "
                        f"{spec_str(plan.decided.params[name])}, stage {tied[name][0]}'s as "
                        f"{spec_str(want)}: the copies' gradients are summed piece by piece, "
                        "so every stage holding it must place it alike; pin it so "
                        "(autopar.capture.stage.pin_boundary(graph, mesh, params=...))")
        plans.append(plan)
        inputs.append(ins)
        prev = pinned
        meta = output_meta(graph)
        x = StageInputs((meta.shape,), (str(meta.dtype).removeprefix("torch."),))
    return plans, inputs


def pinned_stage_plans(plan: Plan, time_limit_s: float
                       ) -> Callable[[int, PlanGraph, Mesh], Plan]:
    """The stage plans of a pipeline plan whose stages run one each: each stage's plan with
    its parameters placed as the pipeline plan's stage layout places them, recomputing in the
    mode the pipeline plan chose for that stage, and the rest (activations, collectives)
    solved on the stage's own graph (:func:`solve_stage`; the graph is traced under the
    plan's precision)."""
    ps_ = plan.decided.param_state
    zero = 3 if ps_.regathered else 1 if ps_.zero1 else 2  # of the parameters it splits
    pipe = plan.decided.pipeline
    modes = (pipe.stage_recompute(plan.decided.recompute.mode) if pipe is not None
             else None)

    def stage_plan(stage: int, graph: PlanGraph, mesh: Mesh) -> Plan:
        params = plan.decided.params
        pins = {n: params[n] for n in graph.param_names if n in params}
        return solve_stage(None, pin_boundary(graph, mesh, pins), mesh, time_limit_s,
                           f"{plan.provenance.model} stage {stage}", zero=zero,
                           recompute=modes[stage] if modes else plan.decided.recompute.mode)

    return stage_plan
