r"""Exact min-sum by variable elimination, for problems of small treewidth.

The planner's problems are pairwise: a cost per node strategy and a cost matrix per edge, over
a graph that (once repeated layers share variables) is a transformer block or two. Such graphs
have small treewidth, and on them *bucket elimination* is exact and fast: eliminating node
``x`` replaces every factor that mentions it by one factor over its neighbours,

.. math::

    g(N_x) = \min_{x} \Big( c_x(x) + \sum_{f \ni x} f(x, N_f) \Big),

and remembers the minimising ``x`` for every assignment of ``N_x``; after the last node, the
choices are read back in reverse order. Work and memory are the product of the domain sizes in
the largest factor, so a greedy order (smallest new factor first) is chosen up front and the
solver declines (returns ``None``) when that factor would exceed ``max_entries``.

A memory limit on one instant (the planner's form: every interval equal) is handled by
Lagrangian relaxation: ``lambda * usage`` is added to the node costs and ``lambda`` is
bisected to the smallest value whose optimum fits. The result then fits but is only proven
optimal for ``lambda = 0``.
"""

from __future__ import annotations

import math
import time

import numpy as np

from autopar.solver.problem import Problem, Solution, evaluate


class _Factor:
    __slots__ = ("scope", "table")

    def __init__(self, scope: tuple[int, ...], table: np.ndarray) -> None:
        self.scope = scope
        self.table = table


def _order(p: Problem, max_entries: float) -> list[int] | None:
    """Greedy elimination order (smallest resulting factor first), or None if too wide."""
    n = p.num_nodes
    dom = [len(c) for c in p.costs]
    nbrs: list[set[int]] = [set() for _ in range(n)]
    for u, v in p.edges:
        if u != v:
            nbrs[u].add(v)
            nbrs[v].add(u)
    alive = set(range(n))
    order = []
    while alive:
        best, best_size = -1, math.inf
        for x in alive:
            size = 1.0
            for y in nbrs[x]:
                size *= dom[y]
                if size > best_size:
                    break
            if size < best_size:
                best, best_size = x, size
        if best_size * dom[best] > max_entries:
            return None
        order.append(best)
        alive.remove(best)
        for y in nbrs[best]:
            nbrs[y].discard(best)
            nbrs[y] |= nbrs[best] - {y}
        nbrs[best] = set()
    return order


def _broadcast(f: _Factor, scope: tuple[int, ...]) -> np.ndarray:
    """``f``'s table laid out along ``scope``'s axes (size 1 where f does not depend)."""
    perm = sorted(range(len(f.scope)), key=lambda k: scope.index(f.scope[k]))
    t = f.table.transpose(perm)
    shape = [1] * len(scope)
    for k in perm:
        shape[scope.index(f.scope[k])] = f.table.shape[k]
    return t.reshape(shape)


def _eliminate(p: Problem, order: list[int], unary: list[np.ndarray]) -> np.ndarray:
    n = p.num_nodes
    buckets: dict[int, list[_Factor]] = {i: [] for i in range(n)}
    pos = {x: k for k, x in enumerate(order)}

    def place(f: _Factor) -> None:
        if not f.scope:
            return
        buckets[min(f.scope, key=pos.__getitem__)].append(f)

    for i in range(n):
        place(_Factor((i,), unary[i]))
    for (u, v), m in zip(p.edges, p.edge_costs):
        if u == v:
            buckets[u].append(_Factor((u,), np.diagonal(m).copy()))
        else:
            place(_Factor((u, v), np.asarray(m, dtype=float)))
    argmins: dict[int, tuple[tuple[int, ...], np.ndarray]] = {}
    for x in order:
        fs = buckets.pop(x)
        rest = tuple(sorted({y for f in fs for y in f.scope} - {x}, key=pos.__getitem__))
        scope = (x, *rest)
        total = np.zeros([len(p.costs[y]) for y in scope])
        for f in fs:
            total = total + _broadcast(f, scope)
        argmins[x] = (rest, np.argmin(total, axis=0))
        place(_Factor(rest, np.min(total, axis=0)))
    assign = np.zeros(n, dtype=np.int64)
    for x in reversed(order):
        rest, table = argmins[x]
        assign[x] = table[tuple(assign[y] for y in rest)] if rest else int(table)
    return assign


def solve_by_elimination(
    p: Problem, timeout_s: float = 30.0, max_entries: float = 4e6
) -> Solution | None:
    """The optimum (or, under a memory limit, a Lagrangian solution that fits), or None when
    the problem is too wide for elimination or has per-node intervals that differ."""
    t0 = time.monotonic()
    limit = p.usage_limit
    if limit is not None and len(set(map(tuple, p.intervals))) > 1:
        return None  # a timeline of different live ranges: not the one-instant form
    order = _order(p, max_entries)
    if order is None:
        return None
    base = [np.asarray(c, dtype=float) for c in p.costs]
    a = _eliminate(p, order, base)
    cost, feasible, _ = evaluate(p, a)
    if feasible:
        return Solution(tuple(int(x) for x in a), cost, True, "optimal", time.monotonic() - t0,
                        "elimination", cost)
    usage = [np.asarray(u, dtype=float) for u in p.usages]
    if sum(float(u.min()) for u in usage) > limit:
        return Solution((), math.inf, False, "infeasible", time.monotonic() - t0, "elimination")
    scale = max(max(float(c.max()) for c in base), 1e-30) / max(
        max(float(u.max()) for u in usage), 1e-30)
    lo, hi = 0.0, scale
    best = None
    while best is None and time.monotonic() - t0 < timeout_s:  # find a lambda that fits
        a = _eliminate(p, order, [c + hi * u for c, u in zip(base, usage)])
        if evaluate(p, a)[1]:
            best = a
        else:
            lo, hi = hi, hi * 10
    if best is None:
        return None
    for _ in range(30):  # bisect down to the smallest lambda that still fits
        if time.monotonic() - t0 > timeout_s or hi - lo <= 1e-6 * hi:
            break
        mid = (lo + hi) / 2
        a = _eliminate(p, order, [c + mid * u for c, u in zip(base, usage)])
        if evaluate(p, a)[1]:
            best, hi = a, mid
        else:
            lo = mid
    cost, _, _ = evaluate(p, best)
    return Solution(tuple(int(x) for x in best), cost, True, "feasible", time.monotonic() - t0,
                    "elimination+lagrange")
