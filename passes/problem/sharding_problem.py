"""From a PlanGraph on a mesh to the abstract problem the solver takes, and back.

Every tensor-producing node gets its strategies (``passes.strategies``), a compute cost and a
memory use per strategy; every producer->consumer edge a matrix of resharding costs
(``problem/edge_costs.py``); a gradient is tied to its parameter by an edge that prices
moving it into the parameter's layout. ``problem/reduction.py`` then merges followers and
shares variables between repeated layers; ``ShardingProblem.expand`` maps a solution back to
every node. The exact peak memory of a solved plan is measured over the whole step afterwards
(``problem/scoring.py``, ``problem/step_memory.py``). The problem's data is ``problem/types.py``.
"""

from __future__ import annotations

import operator

import numpy as np
import torch
import torch.fx as fx

from autopar.ir.graph import NodeFacts, PlanGraph, node_layer
from autopar.ir.mesh import Mesh
from autopar.ir.placements import Replicate
from autopar.passes.cost import cost_model as cm
from autopar.passes.memory import zero
from autopar.passes.memory.peak import live_intervals, own_storage, peak_memory
from autopar.passes.problem import stage_boundary
from autopar.passes.problem.edge_costs import matrix_cache
from autopar.passes.problem.reduction import assign_variables, merge_followers, reduced_problem
from autopar.passes.problem.types import Edge, ShardingProblem
from autopar.passes.strategies.random import WHOLE_DRAW
from autopar.passes.strategies.registry import (
    Strategy,
    all_specs,
    mutated_inputs,
    node_strategies,
    tensor_inputs,
)


def build(pg: PlanGraph, mesh: Mesh, memory_budget: float | None = None,
          share_layers: bool = True, offload: str = "none", zero1: bool = False,
          prices_of: ShardingProblem | None = None) -> ShardingProblem:
    """``offload``: ``none``; ``auto``, each parameter may keep its optimizer state on the
    host (a strategy variant per layout, :mod:`autopar.passes.memory.zero`); ``optimizer``, every
    parameter does. ``zero1``: gradients all-reduced whole (ZeRO-1). ``prices_of``: a problem
    on the same mesh whose resharding prices this one reuses (a planner builds one problem
    per recomputation mode, of mostly the same tensors: 8B on 8x8 spent 4 of its 7 s of
    builds pricing the same moves again)."""
    nodes = problem_nodes(pg)
    idx = {n: i for i, n in enumerate(nodes)}
    # repeated layers repeat the same ops on the same shapes: their strategy lists are computed
    # once and shared (the same list object), which also lets edge matrices be cached; a
    # problem on this mesh (prices_of: the planner's other modes) lends its lists (with their
    # node costs, usages and edge matrices), and without one the mesh's are used (on_mesh)
    lent = getattr(prices_of, "strategy_lists", None) if prices_of is not None \
        and prices_of.mesh is mesh else None
    lent = lent if lent is not None else on_mesh(mesh)
    strategies, missing = strategy_lists(nodes, mesh, offload, lent.setdefault("lists", {}))

    edges: list[Edge] = []
    for n in nodes:
        v = idx[n]
        if n.target is operator.getitem:
            edges.append(Edge(idx[n.args[0]], v, int(n.args[1]), 0))
            continue
        written = mutated_inputs(n)
        for i, a in enumerate(tensor_inputs(n)):
            if a in idx:
                edges.append(Edge(idx[a], v, 0, i, i in written))
    by_name = {n.name: i for i, n in enumerate(nodes)}
    param_index = {n.meta["autopar"].param_name: i for i, n in enumerate(nodes)
                   if n.op == "placeholder" and n.meta["autopar"].role == "param"}
    for gname, pname in pg.grad_of.items():
        if gname in by_name:
            edges.append(Edge(by_name[gname], param_index[pname], 0, -1))

    sp = ShardingProblem(mesh, nodes, strategies, [], [], edges, missing)
    sp.zero1 = zero1
    sp.strategy_lists = lent  # type: ignore[attr-defined]
    if prices_of is not None and prices_of.mesh is mesh:
        # keyed by spec ids and tensor price keys, valid in any problem on this mesh (not the
        # matrix cache: it is keyed by the ids of this build's strategy lists)
        sp.spec_ids, sp.reshard_cache = prices_of.spec_ids, prices_of.reshard_cache
        sp.moves_cache, sp.table_cache = prices_of.moves_cache, prices_of.table_cache
    if pg.precision is not None and pg.precision.mixed and pg.precision.reduce != "fp32":
        sp.grad_dtype = pg.precision.reduce_dtype
    sp.loss_scaling = pg.precision is not None and pg.precision.loss_scaling
    # per strategy list, op and FLOPs, as the lists are shared: by every problem built with
    # these lists (the planner's modes), each entry holding its list so that its id stays
    # its own
    cost_cache: dict = lent.setdefault(("node costs",), {})
    for i, n in enumerate(nodes):
        f = n.meta["autopar"]
        key = (id(strategies[i]), f.op, f.flops)
        if key not in cost_cache:
            cost_cache[key] = (strategies[i], _node_costs(n, strategies[i], mesh))
        sp.node_cost.append(cost_cache[key][1])
    sp.loss_index = loss_i = by_name[pg.loss_node]
    loss_meta = nodes[loss_i].meta["autopar"].out
    # the loss is reported whole on every rank: a partial loss pays its (deferred) all-reduce
    sp.unary[loss_i] = np.array(
        [sum(c.time_s for c in cm.loss_collectives(loss_meta, s.outs[0], mesh))
         for s in strategies[loss_i]]
    )
    sp.usage = node_usages(pg, nodes, strategies, mesh, lent.setdefault(("usages",), {}))
    sp.live = live_intervals(nodes)
    if pg.proxy is not None:
        # a traced middle layer stands for several real ones: weigh its costs (its memory is
        # weighed in node_usages)
        sp.weight = np.array([pg.layer_weight(node_layer(n)) for n in nodes])
        sp.in_flight = pg.proxy.in_flight
        sp.microbatches = pg.proxy.microbatches
        for i, w in enumerate(sp.weight):
            if w != 1.0:
                sp.node_cost[i] = sp.node_cost[i] * w
    else:
        sp.weight = np.ones(len(nodes))
    if sp.microbatches > 1:
        mark_once_per_step(sp)
    stage_boundary.apply(sp, pg)  # a pipeline stage's pinned inputs and priced outputs
    sp.matrix_cache = matrix_cache(sp)  # (its prices fixed: the other modes' matrices)
    sp.peak_time = _replicated_peak(sp)
    merge_followers(sp, memory_budget)
    sp.share_layers = share_layers
    assign_variables(sp, share_layers)
    sp.problem = reduced_problem(sp, memory_budget)
    return sp


# the strategy lists (with their costs and usages) of the mesh built on last: a planner
# bounds and builds on one mesh many times in a row (planning.modes.least_need's bound, then
# each mode's problem; a mesh-shape search, shape after shape). Lists are keyed by op, shapes
# and values, so any graph on an equal mesh may share them; one mesh's only, so the memory
# they hold stays one planning call's
_ON_MESH: list = [None, {}]


def on_mesh(mesh: Mesh) -> dict:
    """What builds on ``mesh`` (or an equal one) share: ``"lists"``, the strategy lists by
    :func:`_strategy_key`; the costs and usages computed per list (:func:`build`)."""
    if _ON_MESH[0] != mesh:
        _ON_MESH[:] = [mesh, {}]
    return _ON_MESH[1]


def problem_nodes(pg: PlanGraph) -> list[fx.Node]:
    """The nodes the problem places: placeholders and ops, in graph order."""
    return [n for n in pg.graph.nodes if n.op in ("placeholder", "call_function")]


def strategy_lists(nodes: list[fx.Node], mesh: Mesh, offload: str, cache: dict
                   ) -> tuple[list[list[Strategy]], dict[str, int]]:
    """Every node's strategies on ``mesh`` (one list object per distinct op, shapes and
    values, kept in ``cache``; a placeholder's also per ``offload``), and the ops with no rule
    (planned replicated), counted."""
    strategies: list[list[Strategy]] = []
    missing: dict[str, int] = {}
    for n in nodes:
        facts: NodeFacts = n.meta["autopar"]
        key = _strategy_key(n)
        if key is not None and n.op == "placeholder":
            key = (*key, offload)
        hit = cache.get(key) if key is not None else None
        if hit is None:
            if n.op == "placeholder":
                meta = facts.out
                specs = all_specs(meta, mesh.shape) if meta is not None else [(Replicate(),) * mesh.ndim]
                hit = (_placeholder_strategies(specs, facts.role == "param", offload), False)
            else:
                ns = node_strategies(n, mesh.shape)
                hit = (ns.strategies, ns.missing_rule)
            first = hit[0][0]
            assert all(isinstance(p, Replicate) for s in first.ins + first.outs for p in s), n.name
            if key is not None:
                cache[key] = hit
        if hit[1]:
            missing[facts.op] = missing.get(facts.op, 0) + 1
        strategies.append(hit[0])
    return strategies, missing


def node_usages(pg: PlanGraph, nodes: list[fx.Node], strategies: list[list[Strategy]],
                mesh: Mesh, usage_cache: dict | None = None) -> list[np.ndarray]:
    """Bytes per device each node holds under each of its strategies. Under a depth proxy a
    traced middle layer stands for several real ones: the memory each of them holds at once
    is weighed (its parameters, gradients and the activations kept for the backward, live
    across the forward's end); what a layer frees before the next one runs (its transients,
    forward or backward) is held by one layer at a time. A pipeline stage's stand-in
    (depth_proxy.stage_representative) also holds each kept activation once per microbatch
    in flight. ``usage_cache``: kept across calls with the same strategy lists on ``mesh``
    (:func:`build`'s lent lists)."""
    usage: list[np.ndarray] = []
    # like the costs, per strategy list and outputs: a model's repeated layers repeat them
    usage_cache = usage_cache if usage_cache is not None else {}
    for i, n in enumerate(nodes):
        f = n.meta["autopar"]
        key = (id(strategies[i]), f.role, f.op,
               tuple(None if m is None else (m.nbytes, m.numel) for m in f.outputs),
               own_storage(n), _read_outputs(n))
        if key not in usage_cache:  # (each entry holds its list: its id stays its own)
            usage_cache[key] = (strategies[i], _usage(n, strategies[i], mesh))
        usage.append(usage_cache[key][1])
    if pg.proxy is None:
        return usage
    live = live_intervals(nodes)
    flight = pg.proxy.in_flight
    turn = next((i for i, n in enumerate(nodes) if n.meta["autopar"].phase == "bwd"),
                len(nodes))
    for i, n in enumerate(nodes):
        w = pg.layer_weight(node_layer(n))
        a, b = live[i]
        # a parameter's own cast or view is one copy per step, whatever is in flight
        if n.meta["autopar"].role in ("param", "grad") or zero.param_root(n) is not None:
            scale = w
        else:
            scale = w * flight if a < turn <= b else 1.0
        if scale != 1.0:
            usage[i] = usage[i] * scale
    return usage


def least_peak(pg: PlanGraph, mesh: Mesh, offload: str = "none",
               cache: dict | None = None) -> float:
    """A lower bound on the whole step's peak memory per device of every plan of ``pg`` on
    ``mesh`` (``offload`` as :func:`build` takes it): each node at its smallest layout (a
    pinned input at its pin), each held for the shortest it can be, with every view taken
    to alias a copy of its input (then no view keeps its input alive). A plan's step peak
    (:func:`autopar.passes.problem.step_memory.step_usage`) holds each node's own usage over
    an interval that contains that one, plus buffers of its own; so no plan peaks lower.
    ``cache``: strategy lists by op, as :func:`strategy_lists` keeps them (None: those of
    :func:`on_mesh`, which the problems built on ``mesh`` then share)."""
    nodes = problem_nodes(pg)
    shared = on_mesh(mesh) if cache is None else {}
    strategies, _ = strategy_lists(nodes, mesh, offload,
                                   cache if cache is not None else shared.setdefault("lists", {}))
    usage = node_usages(pg, nodes, strategies, mesh, shared.setdefault(("usages",), {}))
    least = []
    for n, u, strats in zip(nodes, usage, strategies):
        pin = pg.pins.get(n.name)
        keep = [k for k, s in enumerate(strats) if s.outs[0] == pin] if pin is not None else []
        least.append(float(u[keep].min() if keep else u.min()))
    views = {i for i, n in enumerate(nodes) if n.meta["autopar"].op in cm.VIEW_OPS}
    return peak_memory(least, live_intervals(nodes, views))[0]


def mark_once_per_step(sp: ShardingProblem) -> None:
    """Mark the edges a pipeline stage runs once per step rather than once per microbatch:
    every gradient sync (gradients are summed over the microbatches, then synced once, as
    under DDP's ``no_sync``), and the forward's gathers of a parameter that the backward
    does not gather again (ZeRO-1/2, Megatron's distributed optimizer): its gathered copy is
    kept whole across the microbatches, so it is gathered once, after the optimizer step.
    A parameter the backward reads afresh (a re-gathering copy of its view, ZeRO-3, or an op
    that reads it itself, a norm's weight) is gathered per microbatch, both ways."""
    regathered = {sp.nodes[e.src] for e in sp.edges
                  if e.in_idx >= 0 and sp.nodes[e.src].meta["autopar"].role == "param"
                  and sp.nodes[e.dst].meta["autopar"].phase == "bwd"}
    for e in sp.edges:
        if e.in_idx < 0:
            e.once = True
        elif sp.nodes[e.dst].meta["autopar"].phase == "fwd" and \
                sp.nodes[e.src].meta["autopar"].param_like:
            root = zero.param_root(sp.nodes[e.src])
            e.once = root is not None and root not in regathered


def _frozen(x):
    if isinstance(x, (list, tuple)):
        return tuple(_frozen(v) for v in x)
    if isinstance(x, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in x.items()))
    if isinstance(x, fx.Node):
        f = x.meta.get("autopar")
        return ("node", f.outputs if f else None)
    if isinstance(x, (int, float, str, bool, type(None), torch.dtype, torch.device,
                      torch.memory_format, torch.layout)):
        return x
    raise TypeError(type(x))


def _strategy_key(n: fx.Node):
    """Nodes with equal keys have equal strategy lists (same op, argument shapes and values)."""
    f: NodeFacts = n.meta["autopar"]
    try:
        if n.op == "placeholder":
            return ("placeholder", f.role == "param", f.out)
        return (n.target, _frozen(n.args), _frozen(n.kwargs), f.outputs)
    except TypeError:
        return None


def _placeholder_strategies(specs: list, param: bool, offload: str) -> list[Strategy]:
    """One strategy per layout; a parameter's also with its optimizer state on the host, where
    offloading is offered (``auto``: both; ``optimizer``: only that). The whole-replicated
    layout stays first (the solver's reference start)."""
    kept = [Strategy((), (s,)) for s in specs]
    if not param or offload == "none":
        return kept
    moved = [Strategy((), (s,), (zero.OFFLOAD,)) for s in specs]
    return kept + moved if offload == "auto" else moved


# --- per-node costs -------------------------------------------------------------------------


def _node_costs(n: fx.Node, strategies: list[Strategy], mesh: Mesh) -> np.ndarray:
    facts: NodeFacts = n.meta["autopar"]
    if n.op == "placeholder":
        return np.array([zero.offload_time(facts.out, s.outs[0], mesh)
                         if zero.OFFLOAD in s.impls else 0.0 for s in strategies])
    in_metas = tuple(a.meta["autopar"].out for a in tensor_inputs(n)) if n.target is not operator.getitem else ()
    if n.target is operator.getitem:
        return np.zeros(len(strategies))
    out = np.empty(len(strategies))
    whole = (Replicate(),) * len(mesh.shape)
    for k, s in enumerate(strategies):
        ins, outs = s.ins, s.op_outs
        if WHOLE_DRAW in s.impls:  # every rank draws the whole tensor (strategies/random.py)
            ins, outs = (whole,) * len(ins), (whole,) * len(outs)
        out[k] = cm.compute_time(facts.op, facts.flops, in_metas, facts.outputs, ins, outs,
                                 mesh) + in_op_reduction_time(facts, s, mesh)
    return out


def in_op_collectives(facts: NodeFacts, s: Strategy, mesh: Mesh) -> list[cm.Collective]:
    """The all-reduces a strategy runs inside its op (see ``registry._reduced_in_op``)."""
    if not s.raw_outs:
        return []
    return [c for meta, a, b in zip(facts.outputs, s.raw_outs, s.outs) if meta is not None
            for c in cm.reshard_collectives(meta, a, b, mesh)]


def in_op_reduction_time(facts: NodeFacts, s: Strategy, mesh: Mesh) -> float:
    return sum(c.time_s for c in in_op_collectives(facts, s, mesh))


def _usage(n: fx.Node, strategies: list[Strategy], mesh: Mesh) -> np.ndarray:
    facts: NodeFacts = n.meta["autopar"]
    out = np.zeros(len(strategies))
    if facts.role == "param":
        for k, s in enumerate(strategies):
            # why no gradient here: it exists only from the backward op that makes it (counted
            # there, below); zero_grad frees it before the next forward
            out[k] = cm.param_bytes_per_device(facts.out, s.outs[0], mesh, grad=False)
            if zero.OFFLOAD in s.impls:
                out[k] -= zero.offload_saving(facts.out, s.outs[0], mesh)
        return out
    if own_storage(n):  # one output of a multi-output op, held for as long as it is read
        for k, s in enumerate(strategies):
            out[k] = cm.activation_bytes(facts.out, s.outs[0], mesh)
        return out
    if facts.op in cm.VIEW_OPS:
        return out  # views alias their base
    read = _read_outputs(n)  # counted at their getitem, each for its own lifetime
    for k, s in enumerate(strategies):
        out[k] = sum(cm.activation_bytes(m, spec, mesh)
                     for j, (m, spec) in enumerate(zip(facts.outputs, s.outs)) if j not in read)
    return out


def _read_outputs(n: fx.Node) -> frozenset[int]:
    """The outputs of a multi-output op that a ``getitem`` of its own storage reads."""
    return frozenset(int(u.args[1]) for u in n.users if own_storage(u))


def _replicated_peak(sp: ShardingProblem) -> int:
    return peak_memory([u[0] for u in sp.usage], sp.live)[1]
