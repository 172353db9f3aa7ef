"""A solved choice made into a :class:`~autopar.ir.plan.Plan`, and what its recomputation
costs and saves."""

from __future__ import annotations

import numpy as np

from autopar.ir.errors import PlanError
from autopar.ir.graph import PlanGraph
from autopar.ir.mesh import Mesh
from autopar.ir.placements import Spec
from autopar.ir.plan import (
    Decisions,
    NodePlacement,
    Plan,
    PlanCost,
    Predictions,
    Provenance,
    Recompute,
    SolverInfo,
)
from autopar.ir.precision import Precision
from autopar.passes.cost import cost_model as cm
from autopar.passes.cost.buckets import first_bucket_bytes
from autopar.passes.memory import zero as zero_mod
from autopar.passes.problem import bucket_fill, sharding_problem, zero_stages
from autopar.passes.problem.edge_costs import edge_collectives
from autopar.passes.problem.scoring import score_assignment
from autopar.passes.problem.types import ShardingProblem
from autopar.planning.modes import Mode, mode_graph


def recompute_record(asked: str, mode: str, mpg: PlanGraph, sp: ShardingProblem,
                     choice: list[int], base: ShardingProblem) -> Recompute:
    """What a plan on ``mpg`` (recomputation applied) recomputes, per traced layer, and its
    price (:func:`recompute_price`, against ``base``, the problem without it). ``nodes``
    lists every copied node, re-gathered parameter views too (the runtime copies them all);
    the layers, counts and price are the activations' only (re-gathering is the parameter
    state's, :class:`autopar.ir.param_state.ParamState`)."""
    names = tuple(mpg.recomputed.values())
    if not names:
        return Recompute(asked, "none")
    per_layer: dict[int, int] = {}
    for n in mpg.graph.nodes:
        if n.name in mpg.recomputed and not zero_mod.is_param_view(n):
            ly = n.meta["autopar"].layer
            per_layer[ly] = per_layer.get(ly, 0) + 1
    if not per_layer:
        return Recompute(asked, "none", names)
    extra_s, saved = recompute_price(sp, choice, base)
    return Recompute(asked, mode, names, tuple(sorted(per_layer)), extra_s, saved, per_layer)


def recompute_price(sp: ShardingProblem, choice: list[int], base: ShardingProblem
                    ) -> tuple[float, float]:
    """(extra step time, peak memory saved) of a recomputing plan: its copies' compute and the
    collectives of their inputs, and its peak against the same placements on ``base``, the
    problem of the graph without recomputation (a re-gathered parameter view is no
    recomputation: its gather is the parameter state's price)."""
    copies = {i for i, n in enumerate(sp.nodes) if "recomputes" in n.meta["autopar"].extra
              and not zero_mod.is_param_view(n)}
    if not copies:
        return 0.0, 0.0
    w = sp.weight if sp.weight is not None else np.ones(len(sp.nodes))
    extra = sum(float(sp.node_cost[i][choice[i]]) for i in copies)
    for e in sp.edges:
        if e.dst in copies and e.in_idx >= 0:
            src = sp.strategies[e.src][choice[e.src]].outs[e.out_idx]
            dst = sp.strategies[e.dst][choice[e.dst]].ins[e.in_idx]
            if src != dst:
                extra += sum(c.time_s for c in edge_collectives(sp, e, src, dst)) * w[e.dst]
    by_name = {n.name: s for n, s in zip(sp.nodes, choice)}
    kept = score_assignment(base, [by_name[n.name] for n in base.nodes]).cost.mem_bytes
    return extra, max(0.0, kept - score_assignment(sp, choice).cost.mem_bytes)


def assemble_plan(
    pg: PlanGraph, sp: ShardingProblem, choice: list[int], model_name: str, mesh: Mesh,
    solver: SolverInfo, timings: dict[str, float], references: dict[str, PlanCost],
    memory_budget: float | None, limit_source: str = "given",
    recompute: Recompute | None = None,
) -> Plan:
    """The plan of ``choice`` on ``pg`` (the graph as planned: recomputation applied)."""
    scored = bucket_fill.score(sp, choice)
    params: dict[str, Spec] = {}
    inputs: dict[str, Spec] = {}
    input_shapes: dict[str, list[int]] = {}
    nodes: dict[str, NodePlacement] = {}
    for i, n in enumerate(sp.nodes):
        s = sp.strategies[i][choice[i]]
        f = n.meta["autopar"]
        nodes[n.name] = NodePlacement(s.ins, s.outs, s.impls, s.raw_outs)
        if f.role == "param":
            params[f.param_name] = s.outs[0]
        elif f.role == "input" and f.input_index is not None and f.out is not None:
            key = pg.input_names[f.input_index]
            inputs.setdefault(key, s.outs[0])
            input_shapes.setdefault(key, list(f.out.shape))
    if pg.proxy is not None:  # untraced layers take the placements of the layer they stand for
        params = {name: params[pg.proxy.traced_name(name)] for name in pg.all_param_names}
    return Plan(
        Decisions(
            mesh_shape=mesh.shape, mesh_axes=mesh.axes, device=mesh.device.name,
            params=params, inputs=inputs, nodes=nodes, input_shapes=input_shapes,
            precision=pg.precision or Precision(), recompute=recompute or Recompute(),
            param_state=zero_stages.param_state(pg, sp, choice),
            first_bucket_bytes=first_bucket_bytes(mesh.device),
            merged_sums=tuple(tuple(mesh.axes[k] for k in axes)
                              for axes in cm.merged_sums(mesh))),
        Predictions(cost=scored.cost, collectives=tuple(scored.collectives)),
        Provenance(solver=solver, model=model_name, references=references,
                   timings={k: round(v, 4) for k, v in timings.items()},
                   missing_rules=dict(sp.missing_rules), memory_budget=memory_budget,
                   memory_limit_source=limit_source),
    )


def with_recompute(graph: PlanGraph, plan: Plan, mode: Mode | str, mesh: Mesh) -> Plan:
    """``plan`` (made without recomputation, on ``graph`` as captured) with ``mode``'s
    recomputation: every original node placed as in ``plan``, every copy as its original, the
    collectives and costs scored again. The same layout, recomputing: what the property tests
    compare bit for bit, and a way to ask what a mode costs a given plan. ``mode``: a
    :class:`~autopar.planning.modes.Mode` or its label (a recompute mode, with ``+zero3`` to
    re-gather parameters in the backward too, ``+zero1`` to all-reduce the gradients of split
    parameters whole)."""
    if plan.decided.recompute.nodes:
        raise PlanError("with_recompute takes a plan that recomputes nothing")
    mode = Mode.of(mode)
    mpg = mode_graph(graph, mode)
    offload = "auto" if plan.decided.param_state.offloaded else "none"
    sp = sharding_problem.build(mpg, mesh, plan.provenance.memory_budget, share_layers=False,
                                offload=offload, zero1=mode.whole_grads)
    choice = []
    for i, n in enumerate(sp.nodes):
        place = plan.decided.nodes[n.meta["autopar"].extra.get("recomputes", n.name)]
        choice.append(sp.strategy_index(i, place))
    base = sharding_problem.build(graph, mesh, plan.provenance.memory_budget,
                                  share_layers=False,
                                  offload=offload, zero1=mode.whole_grads)
    rec = recompute_record(mode.label, mode.recompute, mpg, sp, choice, base)
    pv = plan.provenance
    return assemble_plan(mpg, sp, choice, pv.model, mesh, pv.solver, dict(pv.timings),
                         dict(pv.references), pv.memory_budget, pv.memory_limit_source, rec)
