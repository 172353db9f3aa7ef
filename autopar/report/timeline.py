"""A picture of the step: the predicted timeline of one training step as a Chrome/Perfetto trace.

The trace is data written from the plan (DESIGN, "Pictures are data"): one process per rank
(``pid`` = rank, named ``rank N``), one thread per lane: ``compute`` (the kernels, and
``idle`` where they wait), ``comm`` (the collectives), and with ``ops=True`` an ``ops`` lane
with one event per graph node. Events are complete events (``ph: "X"``, ``ts``/``dur`` in
microseconds). Open the file in https://ui.perfetto.dev or ``chrome://tracing``.

**Units.** Compute is drawn one event per layer and phase (a maximal run of consecutive graph
nodes of one unit): ``forward layer 3``, ``backward layer 3``, ``recompute layer 3`` (the
copies :mod:`autopar.passes.memory.recompute` puts in the backward), and ``forward`` / ``backward``
for the nodes of no layer (embedding, head, loss). Views and ``getitem`` join the unit
before them. Collectives are named ``kind[axis] reason`` (``all_reduce[dp] gradient sync``,
``all_gather[dp] parameter gather``, ``all_reduce[dp+tp] loss``) with their bytes in
``args``. :mod:`autopar.report.trace_events` makes these names (``unit_names``,
``collective_name``), and the runtime's profiling (:mod:`autopar.runtime.observe.profiling`) records
its ``torch.profiler`` ranges with the same functions, so a measured trace carries the same
event names. The writer (``TraceEvent``, ``write_trace``) lives there too.

**Times** come from the cost model the plan was scored by (:func:`bucket_fill.score`, as
:func:`autopar.planning.assemble.assemble_plan` scores it): each node's compute time on its chosen
strategy (``sp.node_cost``, less the all-reduces an op runs inside itself, drawn as
collectives), each edge's collectives at the consumer that needs them, parameter gathers one
per layer, phase and axis at the first reader, gradient syncs one per bucket and axis as soon
as the bucket's last gradient exists, the loss's all-reduce at the end of the forward, and
offloaded optimizer state at the end. Blocking collectives stop the compute lane (an ``idle``
event). Where the device's communication overlaps compute
(``DeviceProfile.comm_overlaps_compute``), gradient syncs and the loss's all-reduce run on
the comm lane beside the backward; otherwise they serialise, as gloo does on the CPU cores.

**The total and the plan's cost.** ``plan.predicted.cost.step_s`` is the serial sum of compute and
communication: the cost model credits no overlap (``bucket_fill`` explains why full buckets
keep their full price). So where communication serialises, the timeline's span equals
``plan.predicted.cost.step_s`` (to float rounding); where it overlaps, the span is shorter by the
gradient-sync time hidden behind the backward (``Timeline.hidden_s``), and span plus hidden
equals ``step_s``. The loss's all-reduce is drawn at its price, as the plan counts it: 0 where
the backward hides it (its unhidden length is in its ``args``), at most the profile's
per-collective overhead where it serialises (:func:`autopar.passes.cost.cost_model.loss_collectives`).

**Depth proxies.** A plan traced as a proxy (``pg.proxy``: a middle traced layer stands for
several real ones) is expanded: each middle layer's events repeat once per real layer it
stands for, each copy taking an equal share of the weighted time, and named after real
layers in order (the copies are identical, so which real index a copy takes is immaterial).
Gradient buckets, formed over the whole model's bytes, are not repeated.

**Ranks.** A non-pipelined SPMD plan runs the same program on every rank, so every rank's
timeline is the same: it is written for the first ``max_ranks`` ranks (8 by default) only,
and the trace's ``otherData`` says so. A pipeline schedule's per-rank events
(:func:`autopar.passes.pipeline.schedule.events`) go through the same writer:
``pipeline_trace_events`` turns them into ``TraceEvent`` s for ``write_trace``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from autopar.ir.graph import node_layer
from autopar.ir.placements import Replicate
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
from autopar.passes.problem import bucket_fill
from autopar.passes.problem.edge_costs import edge_meta, gather_unit, is_param_gather, sync_target
from autopar.passes.problem.scoring import edge_reason
from autopar.passes.problem.sharding_problem import in_op_collectives
from autopar.report.trace_events import (  # noqa: F401 - the writer and names, re-exported
    LANES,
    PHASE_NAMES,
    TraceEvent,
    collective_name,
    merge_traces,
    pipeline_trace_events,
    trace_json,
    unit_names,
    unit_of,
    write_trace,
)

if TYPE_CHECKING:
    from autopar.ir.graph import PlanGraph
    from autopar.ir.mesh import Mesh
    from autopar.ir.plan import Plan
    from autopar.planning.planner import Planned

MAX_RANKS = 8
IDLE = "idle"


# --- the predicted step -----------------------------------------------------------------------


@dataclass
class Timeline:
    """The predicted step: every rank's events (``ranks`` of ``world`` written), the span
    (``step_s``), the plan's own price of it, and the communication hidden behind compute."""

    events: list[TraceEvent]
    step_s: float
    plan_step_s: float
    hidden_s: float
    ranks: int
    world: int
    overlap: bool
    pipeline: bool = False  # one pipeline rank per process of the trace (its stages differ)

    def rank_events(self, rank: int = 0) -> list[TraceEvent]:
        return [e for e in self.events if e.rank == rank]

    def other_data(self) -> dict[str, Any]:
        return {
            "autopar": "predicted", "step_s": self.step_s, "plan_step_s": self.plan_step_s,
            "hidden_comm_s": self.hidden_s, "comm_overlaps_compute": self.overlap,
            "ranks_written": self.ranks, "world_size": self.world,
            "note": (f"one process per pipeline rank ({self.ranks}); the devices of one "
                     f"stage's submesh ({self.world // max(1, self.ranks)}) run alike"
                     if self.pipeline else
                     "a non-pipelined SPMD plan runs one program on every rank: every rank's "
                     f"timeline is the same; the first {self.ranks} of {self.world} are written"),
        }

    def write(self, path: str | Path) -> dict[str, Any]:
        return write_trace(self.events, path, self.other_data())


@dataclass(slots=True)
class _Item:
    kind: str  # "compute" | "sync" (blocking collective) | "async" (beside compute if overlapped)
    dur: float  # seconds, weighted (all the real layers a traced one stands for)
    base: str  # a unit without its layer ("forward"), or a collective's name
    layer: int | None
    cat: str
    args: dict[str, Any] = field(default_factory=dict)
    once: bool = False  # a gradient bucket: not repeated with its layer's copies
    op: str = ""  # compute: the node's name (the ops lane)
    bwd: bool = False  # in the backward: a proxy's copies run in descending layer order


def predicted_timeline(planned: Planned, ops: bool = False, max_ranks: int = MAX_RANKS,
                       overlap: bool | None = None) -> Timeline:
    """The predicted timeline of one training step of ``planned`` (see the module docstring).
    ``ops``: also one event per graph node on an ``ops`` lane. ``overlap``: whether gradient
    syncs run beside the backward (default: the device profile's ``comm_overlaps_compute``)."""
    sp, choice, pg = planned.problem, planned.node_choice, planned.graph
    mesh = sp.mesh
    if overlap is None:
        overlap = mesh.device.comm_overlaps_compute
    if planned.plan.decided.pipeline is not None:  # ranks differ: the schedule's replay, per rank
        from autopar.report.pipeline_timeline import pipeline_timeline

        events, span = pipeline_timeline(planned.plan)
        p = planned.plan.decided.pipeline.size
        return Timeline(events, span, planned.plan.predicted.cost.step_s, 0.0, p,
                        p * int(np.prod(mesh.shape)), overlap, pipeline=True)
    items = _items(pg, sp, choice, overlap)
    one, hidden = _schedule(_expand(items, pg), overlap, ops)
    span = max((e.end_s for e in one), default=0.0)
    world = int(np.prod(mesh.shape))
    ranks = max(1, min(world, max_ranks))
    events = [TraceEvent(e.name, e.start_s, e.dur_s, r, e.lane, e.cat, e.args)
              for r in range(ranks) for e in one]
    return Timeline(events, span, planned.plan.predicted.cost.step_s, hidden, ranks, world, overlap)


def write_timeline(planned: Planned, path: str | Path, ops: bool = False,
                   max_ranks: int = MAX_RANKS) -> Timeline:
    """Write the predicted timeline of ``planned`` to ``path``; returns it."""
    tl = predicted_timeline(planned, ops, max_ranks)
    tl.write(path)
    return tl


def planned_from_plan(graph: PlanGraph, plan: Plan, mesh: Mesh) -> Planned:
    """A :class:`Planned` for a plan made (or loaded) apart from its problem: ``graph`` is
    the graph the plan was made for (recomputation applied, as ``parallelize`` runs it), each
    node given the strategy the plan places it with. What the runtime's ``--profile`` uses to
    write the predicted timeline beside the measured one."""
    from autopar.ir.errors import PlanError
    from autopar.passes.problem import sharding_problem
    from autopar.planning.planner import Planned
    from autopar.solver import Solution

    offload = "auto" if plan.decided.param_state.offloaded else "none"
    sp = sharding_problem.build(graph, mesh, plan.provenance.memory_budget, share_layers=False,
                                offload=offload, zero1=plan.decided.param_state.zero1)
    choice = []
    for i, n in enumerate(sp.nodes):
        place = plan.decided.nodes.get(n.name)
        if place is None:
            raise PlanError(f"the plan has no placement for node {n.name!r}: it was made for "
                            "another graph")
        choice.append(sp.strategy_index(i, place))
    sol = Solution((), plan.predicted.cost.step_s, True, "given", 0.0, "given")
    return Planned(plan, graph, sp, sol, choice)


def _items(pg: PlanGraph, sp: Any, choice: list[int], overlap: bool) -> list[_Item]:
    """One rank's step in graph order, before depth-proxy expansion."""
    mesh = sp.mesh
    scored = bucket_fill.score(sp, choice)  # the plan's prices: its buckets at their fill
    per_edge = scored.edge_collectives
    weight = sp.weight if sp.weight is not None else np.ones(len(sp.nodes))
    layers = [node_layer(n) for n in sp.nodes]
    units = unit_names(sp.nodes)

    # what each consumer needs moved first, and the gradient syncs, as the scorer groups them
    before: dict[int, list[_Item]] = {}
    after: dict[int, list[_Item]] = {}
    syncs: list[GradSync] = []
    gathers: list[ParamGather] = []
    for k, e in enumerate(sp.edges):
        colls = per_edge.get(k)
        if not colls:
            continue
        src = sp.strategies[e.src][choice[e.src]].outs[e.out_idx]
        dst_s = sp.strategies[e.dst][choice[e.dst]]
        dst = dst_s.outs[0] if e.in_idx < 0 else dst_s.ins[e.in_idx]
        w = float(weight[e.dst])
        if e.in_idx < 0:
            syncs.append(GradSync(k, edge_meta(sp, e), src, sync_target(sp, e, src, dst), w))
        elif is_param_gather(sp, e) and gather_move(src, dst) is not None:
            gathers.append(ParamGather(k, gather_unit(sp.nodes[e.dst]), edge_meta(sp, e), src,
                                       dst, w))
        else:
            reason = edge_reason(sp, e)
            before.setdefault(e.dst, []).extend(
                _coll(c, reason, c.time_s * w, layers[e.dst], sp.nodes[e.dst].name)
                for c in colls)
    for group in gather_groups(gathers):
        first = min(sp.edges[g.index].dst for g in group)
        (c0,) = per_edge[group[0].index]
        t = sum(per_edge[g.index][0].time_s * g.weight for g in group)
        nbytes = sum(per_edge[g.index][0].bytes for g in group)
        item = _Item("sync", t, collective_name("all_gather", c0.axis, "parameter gather"),
                     layers[first], "collective",
                     {"kind": "all_gather", "axis": c0.axis, "bytes": nbytes,
                      "reason": "parameter gather", "params": len(group)})
        before.setdefault(first, []).insert(0, item)
    grad_kind = "async" if overlap else "sync"
    for group, batched in sync_groups(syncs, mesh.shape, first_bytes=first_bucket_bytes(
            mesh.device)):
        last = max(sp.edges[g.index].src for g in group)
        if batched is None:
            (g,) = group
            after.setdefault(last, []).extend(
                _coll(c, "gradient sync", c.time_s * g.weight, layers[last], "", grad_kind)
                for c in per_edge[g.index])
            continue
        for kind, axes, nbytes in bucket_collectives(group, mesh.shape, cm.merged_sums(mesh)):
            name = cm.axes_label(mesh.axes, axes)
            t = sum(c.time_s * g.weight for g in group for c in per_edge[g.index]
                    if c.axis == name)
            after.setdefault(last, []).append(_Item(
                grad_kind, t, collective_name(kind, name, "gradient sync"), layers[last],
                "collective", {"kind": kind, "axis": name, "bytes": nbytes,
                               "reason": "gradient sync", "gradients": len(group)},
                once=True))
    loss_i = sp.loss_index  # -1 in a middle pipeline stage's graph: it has no loss
    if loss_i >= 0:
        loss_meta = sp.nodes[loss_i].meta["autopar"].out
        loss_spec = sp.strategies[loss_i][choice[loss_i]].outs[0]
        whole = (Replicate(),) * mesh.ndim
        real = cm.reshard_collectives(loss_meta, loss_spec, whole, mesh)
        for c, priced in zip(real, cm.loss_collectives(loss_meta, loss_spec, mesh)):
            # at its price (0 where the backward hides it, at most the profile's overhead where
            # it serialises: cm.loss_collectives); its unhidden length in args
            item = _coll(c, "loss", priced.time_s, None, "", "async" if overlap else "sync")
            item.args["unhidden_s"] = c.time_s
            after.setdefault(loss_i, []).append(item)

    items: list[_Item] = []
    offload = 0.0
    for i, n in enumerate(sp.nodes):
        s = sp.strategies[i][choice[i]]
        if n.op == "placeholder":
            offload += float(sp.node_cost[i][choice[i]])
            continue
        f = n.meta["autopar"]
        w = float(weight[i])
        in_op = in_op_collectives(f, s, mesh)
        t = float(sp.node_cost[i][choice[i]]) - sum(c.time_s for c in in_op) * w
        unit = units[i] or PHASE_NAMES.get(f.phase, "forward")
        base, layer = _split_unit(unit)
        mine = [*before.get(i, ()), _Item("compute", max(t, 0.0), base, layer, base, {},
                                          op=n.name)]
        mine += [_coll(c, "resharding", c.time_s * w, layer, n.name) for c in in_op]
        mine += after.get(i, ())
        for it in mine:
            it.bwd = f.phase == "bwd"
        items += mine
    if offload > 0:  # optimizer state to and from the host, around the optimizer step
        items.append(_Item("sync", offload, "optimizer state offload", None, "offload",
                           {"reason": "offload"}))
    return items


def _coll(c: cm.Collective, reason: str, t: float, layer: int | None, at: str,
          kind: str = "sync") -> _Item:
    args = {"kind": c.kind, "axis": c.axis, "bytes": c.bytes, "reason": reason}
    if at:
        args["node"] = at
    return _Item(kind, t, collective_name(c.kind, c.axis, reason), layer, "collective", args)


def _split_unit(unit: str) -> tuple[str, int | None]:
    base, _, layer = unit.partition(" layer ")
    return base, (int(layer) if layer else None)


def _copies(pg: PlanGraph) -> dict[int, list[int]]:
    """Traced layer -> the real layers its events stand for (depth proxy), in order."""
    proxy = pg.proxy
    if proxy is None:
        return {}
    out = {0: [0], proxy.kept - 1: [proxy.total - 1]}
    w = proxy.middle_weight
    for j in range(1, proxy.kept - 1):
        a, b = round(1 + (j - 1) * w), round(1 + j * w)
        out[j] = list(range(a, b))
    return out


def _expand(items: list[_Item], pg: PlanGraph) -> list[_Item]:
    """Items with a depth proxy's middle layers repeated once per real layer they stand for."""
    copies = _copies(pg)
    if not copies:
        return items
    out: list[_Item] = []
    k = 0
    while k < len(items):
        it = items[k]
        real = copies.get(it.layer) if it.layer is not None else None
        if real is None or len(real) == 1:
            if real is not None and real[0] != it.layer:
                it = _Item(it.kind, it.dur, it.base, real[0], it.cat, it.args, it.once, it.op,
                           it.bwd)
            out.append(it)
            k += 1
            continue
        end = k
        while end < len(items) and (items[end].layer, items[end].bwd) == (it.layer, it.bwd):
            end += 1
        run, c = items[k:end], len(real)
        for m, layer in enumerate(reversed(real) if it.bwd else real):
            for x in run:
                if x.once and m < c - 1:
                    continue
                dur = x.dur if x.once else x.dur / c
                out.append(_Item(x.kind, dur, x.base, layer, x.cat, x.args, x.once, x.op,
                                 x.bwd))
        k = end
    return out


def _schedule(items: list[_Item], overlap: bool, ops: bool) -> tuple[list[TraceEvent], float]:
    """Times for one rank's items: compute on one lane, collectives on the other. Returns the
    events and the communication time hidden behind compute."""
    events: list[TraceEvent] = []
    t_c = t_m = 0.0  # where the compute and comm lanes are free
    hidden = 0.0
    open_: list[Any] = []  # [name, start, end, cat, nodes] of the compute event being grown

    def close() -> None:
        if open_:
            name, start, end, cat, nodes = open_.pop()
            if end > start:
                events.append(TraceEvent(name, start, end - start, 0, "compute", cat,
                                         {"nodes": nodes}))

    def idle(start: float, end: float, why: str) -> None:
        if end > start:
            close()
            events.append(TraceEvent(IDLE, start, end - start, 0, "compute", IDLE,
                                     {"waiting_for": why}))

    for it in items:
        if it.kind == "compute":
            name = it.base if it.layer is None else f"{it.base} layer {it.layer}"
            if open_ and open_[0][0] == name and open_[0][2] == t_c:
                open_[0][2] += it.dur
                open_[0][4] += 1
            elif it.dur > 0:
                close()
                open_.append([name, t_c, t_c + it.dur, it.cat, 1])
            if ops and it.dur > 0:
                events.append(TraceEvent(it.op, t_c, it.dur, 0, "ops", it.cat,
                                         {"unit": name}))
            t_c += it.dur
            continue
        name = it.base
        if it.kind == "async" and overlap:
            start = max(t_c, t_m)
            t_m = start + it.dur
        else:
            start = max(t_c, t_m)
            idle(t_c, start + it.dur, name)
            t_c = t_m = start + it.dur
        if it.dur > 0 or it.cat == "collective":
            events.append(TraceEvent(name, start, it.dur, 0, "comm", it.cat, dict(it.args)))
    close()
    end = max(t_c, t_m)
    idle(t_c, end, "gradient sync")
    if overlap:
        busy_comm = sum(e.dur_s for e in events if e.lane == "comm")
        busy_compute = sum(e.dur_s for e in events if e.lane == "compute" and e.cat != IDLE)
        hidden = max(0.0, busy_comm + busy_compute - end)
    return events, hidden
