"""Exact re-optimisation of a tree-shaped neighbourhood by dynamic programming.

The neighbourhood is an *induced* tree: grown breadth-first from a root, a node joins only if
exactly one of its edges leads into the tree, so every other edge of a tree node goes to a
node that stays fixed and folds into that node's cost. Then (min, +) messages from the leaves
up give the best strategies for the whole tree in O(sum of edge matrix sizes); the real
instances are hubs with thousands of leaf operands, where this moves a hub and all its leaves
at once, which single-node moves cannot.

Memory is handled conservatively: a node may only take strategies that use no more than its
current one (``safe=True``, the move is then always feasible), or any strategy that fits in
the headroom on its own, with the whole move checked and undone if the profile overflows.
"""

from __future__ import annotations

import numpy as np

TREE_SIZE = 20_000  # nodes in one induced tree at most


def grow_tree(ls, root: int, size: int) -> tuple[list[int], list[int], list[int]]:
    """(nodes in BFS order, parent of each, edge to the parent) of an induced tree."""
    q = ls.q
    pos = {root: 0}
    order, parent, pedge = [root], [-1], [-1]
    k = 0
    while k < len(order) and len(order) < size:
        i = order[k]
        k += 1
        for e, side in ls.inc[i]:
            j = q.edges[e][1 - side]
            if j in pos or len(q.costs[j]) == 1:
                continue
            # an edge from j to another tree node would close a cycle
            if any(q.edges[e2][1 - s2] in pos for e2, s2 in ls.inc[j] if e2 != e):
                continue
            pos[j] = len(order)
            order.append(j)
            parent.append(i)
            pedge.append(e)
            if len(order) >= size:
                break
    return order, parent, pedge


def tree_move(ls, root: int, size: int, safe: bool = True) -> float:
    """Re-optimise the induced tree at ``root``; returns the cost decrease (0 if none)."""
    q, a = ls.q, ls.a
    order, parent, pedge = grow_tree(ls, root, size)
    if len(order) < 2:
        return 0.0
    in_tree = set(order)
    n = len(order)
    f: list[np.ndarray] = [None] * n  # type: ignore[list-item]
    arg: list[np.ndarray | None] = [None] * n
    old = 0.0
    for k in range(n):
        i = order[k]
        c = q.costs[i].copy()
        for e, side in ls.inc[i]:
            j = q.edges[e][1 - side]
            if j in in_tree:
                continue
            c += q.edge_costs[e][:, a[j]] if side == 0 else q.edge_costs[e][a[j], :]
        old += c[a[i]]
        if k:
            e = pedge[k]
            old += (
                q.edge_costs[e][a[parent[k]], a[i]]
                if q.edges[e][0] == parent[k]
                else (q.edge_costs[e][a[i], a[parent[k]]])
            )
        u = q.usages[i]
        if ls.limit is not None and ls.live[i]:
            if safe:
                ok = u <= u[a[i]]
            else:
                ok = ls.allowed(i)
            c = np.where(ok, c, np.inf)
        f[k] = c
    index = {i: k for k, i in enumerate(order)}
    for k in range(n - 1, 0, -1):
        p, e = index[parent[k]], pedge[k]
        m = q.edge_costs[e]
        m = m if q.edges[e][0] == parent[k] else m.T  # rows: parent's strategies
        tot = m + f[k][None, :]
        best = np.argmin(tot, axis=1)
        arg[k] = best
        f[p] = f[p] + tot[np.arange(len(best)), best]
    s_root = int(np.argmin(f[0]))
    new = float(f[0][s_root])
    if not new < old - 1e-9 * max(1.0, abs(old)):
        return 0.0
    choice = np.empty(n, dtype=np.int64)
    choice[0] = s_root
    for k in range(1, n):
        choice[k] = arg[k][choice[index[parent[k]]]]
    prev = [int(a[i]) for i in order]
    for k, i in enumerate(order):
        ls.set(i, int(choice[k]))
    if not safe and ls.limit is not None and not ls.fits():
        for k, i in enumerate(order):
            ls.set(i, prev[k])
        return 0.0
    return old - new
