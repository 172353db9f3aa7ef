"""Scoring a complete assignment (one strategy per traced node) with the cost model.

This works on the full graph, not the reduced solver problem, so it is the ground truth a plan
reports: predicted step time split into compute and communication, the collectives with their
axis and bytes, and the exact peak memory per device over the whole step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autopar.ir.graph import TensorMeta, node_layer
from autopar.ir.placements import Partial, Replicate
from autopar.ir.plan import CollectiveUse, PlanCost
from autopar.passes.cost import cost_model as cm
from autopar.passes.cost.buckets import (
    GradSync,
    ParamGather,
    bucket_collectives,
    first_bucket_bytes,
    gather_groups,
    gather_move,
    sync_groups,
)
from autopar.passes.cost.overlap import Segment, overlapped_step
from autopar.passes.problem import stage_boundary
from autopar.passes.problem.edge_costs import (
    edge_collectives,
    edge_meta,
    gather_unit,
    is_param_gather,
    sync_target,
)
from autopar.passes.problem.sharding_problem import in_op_collectives
from autopar.passes.problem.step_memory import step_peak
from autopar.passes.problem.types import Edge, ShardingProblem


@dataclass(frozen=True, slots=True)
class Scored:
    cost: PlanCost
    collectives: list[CollectiveUse]
    edge_collectives: dict[int, list[cm.Collective]]  # edge index -> its collectives
    # of the collectives' time, what runs once per step (``Edge.once``: a pipeline stage's
    # gradient syncs and gathers of parameters held across microbatches), at full price;
    # ``cost`` weighs it 1/microbatches, as the solver does
    once_s: float = 0.0


def edge_reason(sp: ShardingProblem, e: Edge) -> str:
    if e.in_idx < 0:
        return "gradient sync"
    if sp.nodes[e.src].meta["autopar"].param_like:
        return "parameter gather"
    return "resharding"


def _add_gradient_syncs(
    sp: ShardingProblem, syncs: list[GradSync], per_edge: dict[int, list[cm.Collective]],
    agg: dict[tuple[str, str, str], list[float]],
) -> None:
    """Gradient syncs that are pure all-reduces or single reduce-scatters go out in buckets
    (one collective per bucket and axis, as the runtime issues them); the others one by one."""
    for group, batched in sync_groups(syncs, sp.mesh.shape,
                                      first_bytes=first_bucket_bytes(sp.mesh.device)):
        if batched is None:
            (g,) = group
            for c in per_edge[g.index]:
                slot = agg.setdefault((c.kind, c.axis, "gradient sync"), [0, 0.0, 0.0])
                slot[0] += g.weight
                slot[1] += c.bytes * g.weight
                slot[2] += c.time_s * g.weight
            continue
        for kind, axes, _ in bucket_collectives(group, sp.mesh.shape, cm.merged_sums(sp.mesh)):
            name = cm.axes_label(sp.mesh.axes, axes)
            mine = [(c, g.weight) for g in group for c in per_edge[g.index] if c.axis == name]
            slot = agg.setdefault((kind, name, "gradient sync"), [0, 0.0, 0.0])
            slot[0] += 1
            slot[1] += sum(c.bytes * w for c, w in mine)
            slot[2] += sum(c.time_s * w for c, w in mine)


def _add_param_gathers(
    sp: ShardingProblem, gathers: list[ParamGather], per_edge: dict[int, list[cm.Collective]],
    agg: dict[tuple[str, str, str], list[float]],
) -> float:
    """Parameter gathers go out one all-gather per layer, phase and axis, as the runtime
    issues them (:func:`autopar.passes.cost.buckets.gather_groups`). Returns the time of
    those that run once per step (``Edge.once``)."""
    once = 0.0
    for group in gather_groups(gathers):
        (c0,) = per_edge[group[0].index]
        slot = agg.setdefault(("all_gather", c0.axis, "parameter gather"), [0, 0.0, 0.0])
        slot[0] += group[0].weight  # a traced layer's group stands for its untraced copies
        slot[1] += sum(per_edge[g.index][0].bytes * g.weight for g in group)
        slot[2] += sum(per_edge[g.index][0].time_s * g.weight for g in group)
        once += sum(per_edge[g.index][0].time_s * g.weight for g in group
                    if sp.edges[g.index].once)
    return once


def score_assignment(sp: ShardingProblem, choice: list[int]) -> Scored:
    compute = float(sum(sp.node_cost[i][s] for i, s in enumerate(choice)))
    per_edge: dict[int, list[cm.Collective]] = {}
    agg: dict[tuple[str, str, str], list[float]] = {}

    weight = sp.weight if sp.weight is not None else [1.0] * len(sp.nodes)

    def add(colls: list[cm.Collective], reason: str, w: float = 1.0) -> None:
        for c in colls:
            slot = agg.setdefault((c.kind, c.axis, reason), [0, 0.0, 0.0])
            slot[0] += w
            slot[1] += c.bytes * w
            slot[2] += c.time_s * w

    syncs: list[GradSync] = []
    gathers: list[ParamGather] = []
    for k, e in enumerate(sp.edges):
        src = sp.strategies[e.src][choice[e.src]].outs[e.out_idx]
        dst_s = sp.strategies[e.dst][choice[e.dst]]
        dst = dst_s.outs[0] if e.in_idx < 0 else dst_s.ins[e.in_idx]
        if src == dst:
            continue
        meta = edge_meta(sp, e)
        colls = edge_collectives(sp, e, src, dst)
        if not colls:
            continue
        per_edge[k] = colls
        if e.in_idx < 0:
            syncs.append(GradSync(k, meta, src, sync_target(sp, e, src, dst),
                                  float(weight[e.dst])))
        elif is_param_gather(sp, e) and gather_move(src, dst) is not None:
            gathers.append(ParamGather(k, gather_unit(sp.nodes[e.dst]), meta, src, dst,
                                       float(weight[e.dst])))
        else:
            add(colls, edge_reason(sp, e), float(weight[e.dst]))
    _add_gradient_syncs(sp, syncs, per_edge, agg)
    once_s = _add_param_gathers(sp, gathers, per_edge, agg)
    if sp.microbatches > 1:
        once_s += sum(v[2] for (_, _, reason), v in agg.items() if reason == "gradient sync")
    else:
        once_s = 0.0
    for i, s in enumerate(choice):  # all-reduces inside an op: priced in its node cost
        colls = in_op_collectives(sp.nodes[i].meta["autopar"], sp.strategies[i][s], sp.mesh)
        if colls:
            add(colls, "resharding", float(weight[i]))
            compute -= sum(c.time_s for c in colls) * float(weight[i])
    loss_i = sp.loss_index
    if loss_i >= 0:  # a pipeline stage that sends its output on has no loss
        loss_meta = sp.nodes[loss_i].meta["autopar"].out
        add(cm.loss_collectives(loss_meta, sp.strategies[loss_i][choice[loss_i]].outs[0],
                                sp.mesh), "loss")
    before = sum(v[2] for v in agg.values())
    add(stage_boundary.collectives(sp, choice), stage_boundary.REASON)
    if sp.loss_scaling:  # fp16: one flag of overflowed gradients summed over the mesh
        n = sp.mesh.ndim
        add(cm.reshard_collectives(TensorMeta((), torch.float32), (Partial(),) * n,
                                   (Replicate(),) * n, sp.mesh), "loss scaling")
    # what runs once per step weighs 1/microbatches against one microbatch's work
    comm = float(sum(v[2] for v in agg.values())) - once_s * (1 - 1 / sp.microbatches)
    step = compute + comm
    if overlaps(sp):
        # a stage's boundary and the loss scaling flag: in line (the loss's own is hidden)
        in_line = sum(v[2] for v in agg.values()) - before
        step = min(step, overlapped_step(step_segments(sp, choice, per_edge)) + in_line)
    # the whole step's buffers, not only each node's output: a per-node usage misses the
    # copies two layouts make (gathered weights kept by views, reshard copies, gradient
    # buckets) and keeps a producer that a moved view does not alias (benchmarks/memory.py:
    # within 10% of the measured peak on every combination with them, 3 of 21 outside
    # without)
    mem, _ = step_peak(sp, choice)
    collectives = [
        CollectiveUse(kind, axis, int(round(v[0])), float(v[1]), float(v[2]), reason)
        for (kind, axis, reason), v in sorted(agg.items(), key=lambda kv: -kv[1][2])
    ]
    return Scored(PlanCost(step, compute, comm, mem), collectives, per_edge, once_s)


def overlaps(sp: ShardingProblem) -> bool:
    """Whether the step is priced with communication beside compute
    (:mod:`autopar.passes.cost.overlap`): on a device whose collectives run on their own
    stream, for a whole step (a pipeline stage's parts are scheduled by the pipeline's
    replay, which weighs its syncs once per step itself)."""
    return (sp.mesh.device.comm_overlaps_compute and sp.microbatches == 1
            and not sp.boundary)


def hidden_by_async_tp(sp: ShardingProblem, colls: list[cm.Collective]) -> float:
    """Of in-line collectives, the time a profile with async TP hides
    (:func:`autopar.passes.cost.cost_model.async_tp_share`)."""
    return sum(c.time_s * cm.async_tp_share(c.kind, c.axis, sp.mesh) for c in colls)


def step_segments(sp: ShardingProblem, choice: list[int],
                  per_edge: dict[int, list[cm.Collective]]) -> list[Segment]:
    """The step as :class:`~autopar.passes.cost.overlap.Segment` s in program order: runs of
    ops of one layer (an op of no layer between two of one layer counts in it), each with its
    compute and in-line collectives, the parameter gathers its ops wait for and the gradient
    syncs its ops make, a traced layer's run repeated as many times as the layers it stands
    for."""
    weight = sp.weight if sp.weight is not None else [1.0] * len(sp.nodes)
    n = len(sp.nodes)
    compute = [float(sp.node_cost[i][s]) for i, s in enumerate(choice)]
    gather = [0.0] * n
    sync = [0.0] * n
    for k, colls in per_edge.items():
        e = sp.edges[k]
        t = sum(c.time_s for c in colls) * float(weight[e.dst])
        if e.in_idx < 0:
            sync[e.src] += t  # ready when the gradient is made
        elif is_param_gather(sp, e):
            gather[e.dst] += t
        else:  # the consumer waits for it, less what async TP hides
            compute[e.dst] += t - hidden_by_async_tp(sp, colls) * float(weight[e.dst])
    ops = [i for i, nd in enumerate(sp.nodes) if nd.op == "call_function"]
    keys = [node_layer(sp.nodes[i]) for i in ops]
    after: list[int | None] = [None] * len(keys)  # the next op's layer that has one
    for j in range(len(keys) - 2, -1, -1):
        after[j] = keys[j + 1] if keys[j + 1] is not None else after[j + 1]
    last = None  # the last layer seen
    for j, key in enumerate(keys):  # an op of no layer inside a layer's run joins it
        if key is None and last is not None and last == after[j]:
            keys[j] = last
        elif key is not None:
            last = key
    lump = sum(compute[i] for i, nd in enumerate(sp.nodes) if nd.op != "call_function")
    runs: list[list] = []  # [key, nodes]
    for i, key in zip(ops, keys):
        if runs and runs[-1][0] == key:
            runs[-1][1].append(i)
        else:
            runs.append([key, [i]])
    out = []
    for j, (_, nodes) in enumerate(runs):
        copies = max(1, round(max(float(weight[i]) for i in nodes)))
        c = sum(compute[i] for i in nodes) + (lump if j == 0 else 0.0)
        out.append(Segment(c / copies, sum(gather[i] for i in nodes) / copies,
                           sum(sync[i] for i in nodes) / copies, copies))
    return out
