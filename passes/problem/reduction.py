"""The two reductions that shrink the sharding problem before it reaches the solver.

1. **Followers are merged.** A node with one tensor input (a view, a unary elementwise op, a
   getitem, a reduction) takes, for each strategy of its producer, its own cheapest matching
   strategy, and needs no variable of its own (Alpa does the same).
2. **Repeated layers share variables.** Layers whose merged groups line up (same ops on the
   same shapes, in order) get one set of variables and their costs are added up, so solve
   time does not grow with depth.

Both are exact for the costs: the reduced objective of any assignment equals the full graph's
score of its expansion (``ShardingProblem.expand``). Merging narrows the search, though: a
follower's layout is fixed by its producer's before its consumers are seen, so
:func:`refine_followers` re-chooses the followers of a solved plan with their whole
neighbourhood. Memory is constrained at one instant (the peak of the all-replicated plan,
or where the planner moves it), exactly there: a reduced plan uses what its expansion holds
at that instant. Under a budget, merging keeps the plans that fit up to a small slack
(:data:`MERGE_SLACK`; see ``docs/planning.md``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from autopar.ir.graph import NodeFacts, node_layer
from autopar.passes.problem.edge_costs import edge_matrix
from autopar.solver.problem import Problem

if TYPE_CHECKING:
    from autopar.passes.problem.types import Edge, ShardingProblem


# --- reduction 1: followers -----------------------------------------------------------------


# Under a memory budget, what the followers merged at a layout larger than their smallest may
# use above it, all of them together, as a share of the budget (see merge_followers). inf,
# the default, merges every follower at its cheapest layout as without a budget: measured on
# benchmarks/solver.py, keeping followers apart (at 0.01 and 0.1) and breaking ties toward
# the smaller layout gave worse plans in the planner's short solves (cnn-bn at its own peak
# 15.8 -> 23.2 ms, decoder LM at 0.5 38.0 -> 183 ms) and none at all in a case where only
# offloading fits; a finite slack is the exact reduction the property tests hold to brute force
MERGE_SLACK = math.inf


def merge_followers(sp: ShardingProblem, memory_budget: float | None = None) -> None:
    """Merge each one-input node into its producer's group.

    A follower takes its cheapest strategy for each of its producer's. Under a memory budget
    with a finite :data:`MERGE_SLACK` (the default merges as without a budget, see there), it
    takes the smallest of its cheapest strategies instead, and where
    even that is larger than its smallest strategy for some strategy of its producer (a
    partial sum kept partial rather than reduce-scattered), it is merged only while the
    excess of all such followers together stays within ``MERGE_SLACK`` of the budget, the
    smallest excesses first; the others stay variables of their own (the same op in every
    repeated layer alike). Merging by cost alone fixed a follower at its cheapest layout
    even where a smaller one was what let a plan fit, and the reduced problem could call a
    budget infeasible that some plan met. The excesses are measured at the prices of the
    first build; a rebuild keeps its groups."""
    n = len(sp.nodes)
    in_edges: list[list[Edge]] = [[] for _ in range(n)]
    for e in sp.edges:
        if e.in_idx >= 0:
            in_edges[e.dst].append(e)
    candidates = [v for v in range(n)
                  if len(in_edges[v]) == 1 and sp.nodes[v].op != "placeholder"]
    if sp.group_of is not None:
        # a rebuild at new prices (problem/bucket_fill.py) keeps the followers that stood
        # apart, so the variables stay the same and the solutions its rounds hand on fit it
        apart = {v for v in candidates if sp.group_of[v] == v}
    else:
        apart = _kept_apart(sp, in_edges, candidates, memory_budget)
    group = np.arange(n)
    follow = [np.arange(len(s)) for s in sp.strategies]
    sp.group_cost = [c + sp.unary[i] if i in sp.unary else c.copy()
                     for i, c in enumerate(sp.node_cost)]
    for v in candidates:  # nodes are in topological order, so producers are settled first
        if v in apart:
            continue
        e = in_edges[v][0]
        root = group[e.src]
        rows = follow[e.src]  # producer strategy for each root strategy
        mat = _follower_cost(sp, e, rows)
        exact = memory_budget is not None and math.isfinite(MERGE_SLACK)
        choice = _follower_choice(mat, sp.usage[v] if exact else None)
        follow[v] = choice
        group[v] = root
        sp.group_cost[root] = sp.group_cost[root] + mat[np.arange(len(choice)), choice]
    sp.group_of = group
    sp.follow = follow


def _follower_cost(sp: ShardingProblem, e: Edge, rows: np.ndarray | None = None) -> np.ndarray:
    """Follower ``e.dst``'s own cost and its input edge's, per (producer, own) strategy."""
    v = e.dst
    own = sp.node_cost[v] + sp.unary[v] if v in sp.unary else sp.node_cost[v]
    return edge_matrix(sp, e, rows) * sp.weight[v] + own[None, :]


def _follower_choice(mat: np.ndarray, usage: np.ndarray | None) -> np.ndarray:
    """A follower's strategy for each row of ``mat`` (its cost per producer strategy): the
    cheapest; given its ``usage`` (under a budget), the smallest of the cheapest."""
    if usage is None or usage.min() == usage.max():
        return np.argmin(mat, axis=1)
    best = mat.min(axis=1, keepdims=True)
    cheapest = mat <= best + 1e-12 * np.abs(best)
    return np.argmin(np.where(cheapest, usage[None, :], np.inf), axis=1)


def _kept_apart(sp: ShardingProblem, in_edges: list[list[Edge]], candidates: list[int],
                memory_budget: float | None) -> set[int]:
    """The followers left unmerged under ``memory_budget``: those whose merged layout may
    exceed their smallest, past the first that fit in ``MERGE_SLACK`` of the budget
    together. An excess is taken over every strategy of the producer, so it bounds the
    excess under whatever the producer's group makes of it. The same op on the same shapes
    (the same strategy list object) is decided as one wherever it is, so that repeated
    layers still line up to share their variables."""
    if memory_budget is None or not math.isfinite(MERGE_SLACK):
        return set()
    kinds: dict[tuple, list[tuple[float, int]]] = {}
    for v in candidates:
        u = sp.usage[v]
        choice = _follower_choice(_follower_cost(sp, in_edges[v][0]), u)
        kind = _signature(sp, v)  # not its producer's: a first layer reads another op
        kinds.setdefault(kind, []).append((float(u[choice].max() - u.min()), v))
    room = MERGE_SLACK * max(memory_budget, 0.0)
    apart: set[int] = set()
    # a kind's members may differ in excess (a depth proxy weighs its layers apart): one
    # with none is kept apart with the rest of its kind
    excess = [m for m in kinds.values() if max(m)[0] > 0]
    for members in sorted(excess, key=lambda m: (max(m)[0], len(m))):
        total = sum(g for g, _ in members)
        if total <= room:
            room -= total
        else:
            apart.update(v for _, v in members)
    return apart


# --- reduction 2: shared layer variables ----------------------------------------------------


def assign_variables(sp: ShardingProblem, share_layers: bool) -> None:
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
    return node_layer(sp.nodes[r])


def _signature(sp: ShardingProblem, r: int) -> tuple:
    f: NodeFacts = sp.nodes[r].meta["autopar"]
    # the same strategy list object means the same op on the same shapes (see _strategy_key)
    return (f.op, f.role, id(sp.strategies[r]))


# --- the reduced problem --------------------------------------------------------------------


def reduced_problem(sp: ShardingProblem, memory_budget: float | None) -> Problem:
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
        mat = edge_matrix(sp, e, sp.follow[e.src])[:, sp.follow[e.dst]] * sp.weight[e.dst]
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


# --- after solving: followers re-chosen with their whole neighbourhood ----------------------


def refine_followers(sp: ShardingProblem, choice: list[int],
                     allowed: dict[int, set[int]] | None = None) -> list[int]:
    """``choice`` with every follower group re-optimised exactly, its root and every node
    outside the group held fixed; ``allowed``: node -> the strategies it may take (a pinned
    reference's restrictions), the others not considered.

    Merging picks a follower's strategy for each strategy of its producer from the follower's
    own cost and its input edge only: it cannot see what the follower's output costs further
    on (a bias gradient summed in a sharded layout, then gathered for its replicated
    parameter). Here each group, a tree of followers under its root, is solved by dynamic
    programming over that tree with the edges leaving it priced against the current choice.
    The result never scores worse than ``choice`` (groups are re-solved one at a time, each
    exactly, so every step can only lower the cost)."""
    assert sp.group_of is not None
    n = len(sp.nodes)
    group = sp.group_of
    choice = list(choice)
    weight = sp.weight if sp.weight is not None else np.ones(n)
    feed: list[Edge | None] = [None] * n  # a follower's input edge, from inside its group
    kids: list[list[Edge]] = [[] for _ in range(n)]
    for e in sp.edges:
        if e.in_idx >= 0 and group[e.dst] != e.dst and group[e.src] == group[e.dst]:
            feed[e.dst] = e
            kids[e.src].append(e)
    touching: list[list[Edge]] = [[] for _ in range(n)]  # the other edges of each follower
    for e in sp.edges:
        for v in (e.src, e.dst):
            if feed[v] is not None and e is not feed[v] and e not in kids[v]:
                touching[v].append(e)
    members: dict[int, list[int]] = {}
    for v in range(n):
        if feed[v] is not None:
            members.setdefault(int(group[v]), []).append(v)
    for root, vs in members.items():
        best: dict[int, np.ndarray] = {}  # follower -> cost of its subtree per own strategy
        pick: dict[int, list[np.ndarray]] = {}  # follower -> per child: best child strategy
        for v in reversed(vs):  # children have larger indices than their parents
            total = sp.node_cost[v] + (sp.unary[v] if v in sp.unary else 0.0)
            if allowed and v in allowed:
                total = total + np.where(np.isin(np.arange(len(total)), sorted(allowed[v])),
                                         0.0, np.inf)
            for e in touching[v]:
                mat = edge_matrix(sp, e) * weight[e.dst]
                total = total + (mat[:, choice[e.dst]] if e.src == v else mat[choice[e.src], :])
            pick[v] = []
            for e in kids[v]:
                sub = edge_matrix(sp, e) * weight[e.dst] + best[e.dst][None, :]
                total = total + sub.min(axis=1)
                pick[v].append(sub.argmin(axis=1))
            best[v] = np.asarray(total)
        for e in kids[root]:
            sub = edge_matrix(sp, e)[choice[root]] * weight[e.dst] + best[e.dst]
            choice[e.dst] = int(np.argmin(sub))
        for v in vs:  # parents first: each child follows its parent's new strategy
            for e, p in zip(kids[v], pick[v]):
                choice[e.dst] = int(p[choice[v]])
    return choice
