"""From a PlanGraph on a mesh to the abstract problem the solver takes, and back.

Every tensor-producing node gets its strategies (``passes.strategies``), a compute cost and a
memory use per strategy; every producer->consumer edge a matrix of resharding costs. Two
reductions then shrink the problem before it reaches the solver:

1. **Followers are merged.** A node with one tensor input (a view, a unary elementwise op, a
   getitem, a reduction) takes, for each strategy of its producer, its own cheapest matching
   strategy. It then needs no variable of its own (Alpa does the same).
2. **Repeated layers share variables.** Capture tags the nodes of every repeated block with
   its index; layers whose merged groups line up (same ops, shapes and strategies, in order)
   are given one set of variables, and their costs are added up. Solve time then does not grow
   with depth.

Memory is constrained at one instant, the peak of the all-replicated plan (in training, the
turn from forward to backward, when every saved activation is live). The exact peak of the
solved plan is measured afterwards over the whole schedule (:mod:`passes.memory`).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.fx as fx

from autopar.graph import NodeFacts, PlanGraph, TensorMeta
from autopar.mesh import Mesh
from autopar.passes import cost_model as cm
from autopar.passes.memory import live_intervals, peak_memory
from autopar.passes.strategies.registry import Strategy, all_specs, node_strategies, tensor_inputs
from autopar.placements import Replicate
from autopar.solver.problem import Problem


@dataclass(slots=True)
class Edge:
    src: int  # producer node index
    dst: int  # consumer node index
    out_idx: int  # which output of the producer
    in_idx: int  # which tensor input of the consumer (-1: gradient tied to its parameter)


@dataclass
class ShardingProblem:
    mesh: Mesh
    nodes: list[fx.Node]
    strategies: list[list[Strategy]]
    node_cost: list[np.ndarray]
    usage: list[np.ndarray]  # bytes per device per strategy (param: + grad + Adam state)
    edges: list[Edge]
    missing_rules: dict[str, int]  # op name -> count of nodes planned replicated
    unary: dict[int, np.ndarray] = field(default_factory=dict)  # communication tied to one node
    group_cost: list[np.ndarray] = field(default_factory=list)  # root: its group's total cost
    reshard_cache: dict = field(default_factory=dict, repr=False)
    matrix_cache: dict = field(default_factory=dict, repr=False)
    weight: np.ndarray | None = None  # real layers each node stands for (depth proxy)
    peak_time: int = 0
    live: list[tuple[int, int]] = field(default_factory=list)
    # reduction results
    group_of: np.ndarray | None = None  # node -> group root node
    follow: list[np.ndarray] = field(default_factory=list)  # node: root strategy -> own strategy
    var_of: np.ndarray | None = None  # node -> solver variable
    var_root: list[int] = field(default_factory=list)  # variable -> its template root node
    problem: Problem | None = None
    shared_layers: int = 0

    def index(self) -> dict[str, int]:
        return {n.name: i for i, n in enumerate(self.nodes)}

    def edge_matrix(self, e: Edge) -> np.ndarray:
        return _edge_matrix(self, e)

    def expand(self, assignment: tuple[int, ...] | list[int]) -> list[int]:
        """Strategy index of every node from one strategy per solver variable."""
        assert self.var_of is not None and self.group_of is not None
        out = []
        for i in range(len(self.nodes)):
            v = self.var_of[i]
            root = self.group_of[i]
            # a shared variable is solved on its template root; a group in another layer uses
            # the same strategy index at its own root (the strategy lists are identical)
            s_root = assignment[v]
            out.append(int(self.follow[i][s_root]) if root != i else int(s_root))
        return out


def build(pg: PlanGraph, mesh: Mesh, memory_budget: float | None = None,
          share_layers: bool = True) -> ShardingProblem:
    nodes = [n for n in pg.graph.nodes if n.op in ("placeholder", "call_function")]
    idx = {n: i for i, n in enumerate(nodes)}
    strategies: list[list[Strategy]] = []
    missing: dict[str, int] = {}
    # repeated layers repeat the same ops on the same shapes: their strategy lists are computed
    # once and shared (the same list object), which also lets edge matrices be cached
    cache: dict = {}
    for n in nodes:
        facts: NodeFacts = n.meta["autopar"]
        key = _strategy_key(n)
        hit = cache.get(key) if key is not None else None
        if hit is None:
            if n.op == "placeholder":
                meta = facts.out
                specs = all_specs(meta, mesh.shape) if meta is not None else [(Replicate(),) * mesh.ndim]
                hit = ([Strategy((), (s,)) for s in specs], False)
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

    edges: list[Edge] = []
    for n in nodes:
        v = idx[n]
        if n.target is operator.getitem:
            edges.append(Edge(idx[n.args[0]], v, int(n.args[1]), 0))
            continue
        for i, a in enumerate(tensor_inputs(n)):
            if a in idx:
                edges.append(Edge(idx[a], v, 0, i))
    by_name = {n.name: i for i, n in enumerate(nodes)}
    param_index = {n.meta["autopar"].param_name: i for i, n in enumerate(nodes)
                   if n.op == "placeholder" and n.meta["autopar"].role == "param"}
    for gname, pname in pg.grad_of.items():
        if gname in by_name:
            edges.append(Edge(by_name[gname], param_index[pname], 0, -1))

    sp = ShardingProblem(mesh, nodes, strategies, [], [], edges, missing)
    cost_cache: dict = {}
    for i, n in enumerate(nodes):
        f = n.meta["autopar"]
        key = (id(strategies[i]), f.op, f.flops)
        if key not in cost_cache:
            cost_cache[key] = _node_costs(n, strategies[i], mesh)
        sp.node_cost.append(cost_cache[key])
    loss_i = by_name[pg.loss_node]
    loss_meta = nodes[loss_i].meta["autopar"].out
    rep = (Replicate(),) * mesh.ndim
    # the loss is reported whole on every rank: a partial loss pays its all-reduce
    sp.unary[loss_i] = np.array(
        [cm.reshard_time(loss_meta, s.outs[0], rep, mesh) for s in strategies[loss_i]]
    )
    sp.usage = [_usage(n, strategies[i], mesh) for i, n in enumerate(nodes)]
    if pg.proxy is not None:
        # a traced middle layer stands for several real ones: weigh its costs and memory
        sp.weight = np.array([pg.layer_weight(_node_layer(n)) for n in nodes])
        for i, w in enumerate(sp.weight):
            if w != 1.0:
                sp.node_cost[i] = sp.node_cost[i] * w
                sp.usage[i] = sp.usage[i] * w
    else:
        sp.weight = np.ones(len(nodes))
    sp.live = live_intervals(nodes)
    sp.peak_time = _replicated_peak(sp)
    _merge_followers(sp)
    _assign_variables(sp, share_layers)
    sp.problem = _reduced_problem(sp, memory_budget)
    return sp


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
            return ("placeholder", f.out)
        return (n.target, _frozen(n.args), _frozen(n.kwargs), f.outputs)
    except TypeError:
        return None


# --- per-node costs -------------------------------------------------------------------------


def _node_costs(n: fx.Node, strategies: list[Strategy], mesh: Mesh) -> np.ndarray:
    facts: NodeFacts = n.meta["autopar"]
    if n.op == "placeholder":
        return np.zeros(len(strategies))
    in_metas = tuple(a.meta["autopar"].out for a in tensor_inputs(n)) if n.target is not operator.getitem else ()
    if n.target is operator.getitem:
        return np.zeros(len(strategies))
    out = np.empty(len(strategies))
    for k, s in enumerate(strategies):
        out[k] = cm.compute_time(facts.op, facts.flops, in_metas, facts.outputs, s.ins, s.outs, mesh)
    return out


def _usage(n: fx.Node, strategies: list[Strategy], mesh: Mesh) -> np.ndarray:
    facts: NodeFacts = n.meta["autopar"]
    out = np.zeros(len(strategies))
    if facts.role == "param":
        for k, s in enumerate(strategies):
            out[k] = cm.param_bytes_per_device(facts.out, s.outs[0], mesh)
        return out
    if facts.role == "grad" or facts.op in cm.VIEW_OPS:
        return out  # gradients are counted with their parameter; views alias their base
    for k, s in enumerate(strategies):
        out[k] = sum(cm.activation_bytes(m, spec, mesh) for m, spec in zip(facts.outputs, s.outs))
    return out


def _replicated_peak(sp: ShardingProblem) -> int:
    return peak_memory([u[0] for u in sp.usage], sp.live)[1]


# --- edges ----------------------------------------------------------------------------------

def _reshard(sp: ShardingProblem, meta: TensorMeta, src, dst, bucketed: bool) -> float:
    key = (meta.shape, meta.dtype, src, dst, bucketed)
    t = sp.reshard_cache.get(key)
    if t is None:
        t = sp.reshard_cache[key] = cm.reshard_time(meta, src, dst, sp.mesh, bucketed)
    return t


def is_bucketed(sp: ShardingProblem, e: Edge) -> bool:
    """Gradient syncs and parameter gathers go in buckets (see ``cost_model.BUCKET_BYTES``)."""
    return e.in_idx < 0 or sp.nodes[e.src].meta["autopar"].role == "param"


def _edge_specs(sp: ShardingProblem, e: Edge):
    src_specs = [s.outs[e.out_idx] for s in sp.strategies[e.src]]
    if e.in_idx < 0:  # gradient -> the layout of its parameter
        dst_specs = [s.outs[0] for s in sp.strategies[e.dst]]
    else:
        dst_specs = [s.ins[e.in_idx] for s in sp.strategies[e.dst]]
    return src_specs, dst_specs


def _edge_meta(sp: ShardingProblem, e: Edge) -> TensorMeta:
    return sp.nodes[e.src].meta["autopar"].outputs[e.out_idx]


def _edge_matrix(sp: ShardingProblem, e: Edge, rows: np.ndarray | None = None) -> np.ndarray:
    """Resharding cost of edge ``e`` for every (producer, consumer) strategy pair; with
    ``rows``, only those producer strategies, in that order."""
    meta = _edge_meta(sp, e)
    src_list, dst_list = sp.strategies[e.src], sp.strategies[e.dst]
    bucketed = is_bucketed(sp, e)
    key = (id(src_list), e.out_idx, id(dst_list), e.in_idx, meta, bucketed)
    mat = sp.matrix_cache.get(key)
    if mat is None:
        src_specs, dst_specs = _edge_specs(sp, e)
        uniq_src = list(dict.fromkeys(src_specs))
        uniq_dst = list(dict.fromkeys(dst_specs))
        table = np.array([[_reshard(sp, meta, a, b, bucketed) for b in uniq_dst]
                          for a in uniq_src])
        pos_src = {s: i for i, s in enumerate(uniq_src)}
        pos_dst = {s: i for i, s in enumerate(uniq_dst)}
        si = np.array([pos_src[s] for s in src_specs])
        di = np.array([pos_dst[s] for s in dst_specs])
        mat = sp.matrix_cache[key] = table[np.ix_(si, di)]
    return mat if rows is None else mat[rows]


# --- reduction 1: followers -----------------------------------------------------------------


def _merge_followers(sp: ShardingProblem) -> None:
    n = len(sp.nodes)
    in_edges: list[list[Edge]] = [[] for _ in range(n)]
    for e in sp.edges:
        if e.in_idx >= 0:
            in_edges[e.dst].append(e)
    group = np.arange(n)
    follow = [np.arange(len(s)) for s in sp.strategies]
    sp.group_cost = [c + sp.unary[i] if i in sp.unary else c.copy()
                     for i, c in enumerate(sp.node_cost)]
    for v in range(n):  # nodes are in topological order, so producers are settled first
        ins = in_edges[v]
        if len(ins) != 1 or sp.nodes[v].op == "placeholder":
            continue
        e = ins[0]
        root = group[e.src]
        rows = follow[e.src]  # producer strategy for each root strategy
        own = sp.node_cost[v] + sp.unary[v] if v in sp.unary else sp.node_cost[v]
        mat = _edge_matrix(sp, e, rows) * sp.weight[v] + own[None, :]
        choice = np.argmin(mat, axis=1)
        follow[v] = choice
        group[v] = root
        sp.group_cost[root] = sp.group_cost[root] + mat[np.arange(len(choice)), choice]
    sp.group_of = group
    sp.follow = follow


# --- reduction 2: shared layer variables ----------------------------------------------------


def _layer_of(sp: ShardingProblem, i: int) -> int | None:
    return sp.nodes[i].meta["autopar"].layer


def _assign_variables(sp: ShardingProblem, share_layers: bool) -> None:
    n = len(sp.nodes)
    assert sp.group_of is not None
    roots = [i for i in range(n) if sp.group_of[i] == i]
    layer_of_root = {r: _root_layer(sp, r) for r in roots}
    by_layer: dict[int, list[int]] = {}
    for r in roots:
        if layer_of_root[r] is not None:
            by_layer.setdefault(layer_of_root[r], []).append(r)
    var_of_root: dict[int, int] = {}
    sp.var_root = []
    shared = 0
    if share_layers and len(by_layer) >= 2:
        sigs = {ly: [_signature(sp, r) for r in rs] for ly, rs in by_layer.items()}
        templates: dict[tuple, int] = {}  # signature sequence -> template layer
        for ly in sorted(by_layer):
            key = tuple(sigs[ly])
            if key in templates:
                tmpl = by_layer[templates[key]]
                for r, t in zip(by_layer[ly], tmpl):
                    var_of_root[r] = var_of_root[t]
                shared += 1
            else:
                templates[key] = ly
                for r in by_layer[ly]:
                    var_of_root[r] = len(sp.var_root)
                    sp.var_root.append(r)
    for r in roots:
        if r not in var_of_root:
            var_of_root[r] = len(sp.var_root)
            sp.var_root.append(r)
    sp.var_of = np.array([var_of_root[sp.group_of[i]] for i in range(n)])
    sp.shared_layers = shared


def _root_layer(sp: ShardingProblem, r: int) -> int | None:
    return _node_layer(sp.nodes[r])


def _node_layer(n: fx.Node) -> int | None:
    ly = n.meta["autopar"].layer
    if ly is None and n.op == "placeholder":
        # a parameter belongs to the layer of the ops that use it
        layers = {u.meta["autopar"].layer for u in n.users if "autopar" in u.meta} - {None}
        if len(layers) == 1:
            return layers.pop()
    return ly


def _signature(sp: ShardingProblem, r: int) -> tuple:
    f: NodeFacts = sp.nodes[r].meta["autopar"]
    # the same strategy list object means the same op on the same shapes (see _strategy_key)
    return (f.op, f.role, id(sp.strategies[r]))


# --- the reduced problem --------------------------------------------------------------------


def _reduced_problem(sp: ShardingProblem, memory_budget: float | None) -> Problem:
    assert sp.var_of is not None and sp.group_of is not None
    nv = len(sp.var_root)
    costs = [np.zeros(len(sp.strategies[r])) for r in sp.var_root]
    usage = [np.zeros(len(sp.strategies[r])) for r in sp.var_root]
    for i in range(len(sp.nodes)):
        v = sp.var_of[i]
        if sp.group_of[i] == i:
            costs[v] += sp.group_cost[i]
        a, b = sp.live[i]
        if a <= sp.peak_time <= b and sp.usage[i].any():
            usage[v] += sp.usage[i][sp.follow[i]] if sp.group_of[i] != i else sp.usage[i]
    pair: dict[tuple[int, int], np.ndarray] = {}
    for e in sp.edges:
        gu, gv = sp.group_of[e.src], sp.group_of[e.dst]
        if e.in_idx >= 0 and gu == gv:
            continue  # folded into the follower's group cost
        u, v = int(sp.var_of[e.src]), int(sp.var_of[e.dst])
        mat = _edge_matrix(sp, e, sp.follow[e.src])[:, sp.follow[e.dst]] * sp.weight[e.dst]
        if u == v:
            costs[u] += np.diagonal(mat)
        elif (u, v) in pair:
            pair[(u, v)] = pair[(u, v)] + mat
        elif (v, u) in pair:
            pair[(v, u)] = pair[(v, u)] + mat.T
        else:
            pair[(u, v)] = mat
    edges = list(pair)
    return Problem(
        costs=costs,
        usages=usage,
        intervals=[(0, 1)] * nv,
        edges=edges,
        edge_costs=[pair[k] for k in edges],
        usage_limit=memory_budget,
        names=[sp.nodes[r].name for r in sp.var_root],
    )
