"""Rigid groups: nodes tied together by edges whose allowed pairs form a bijection.

On the contest instances most edges allow exactly one partner strategy for each strategy
(an elementwise op must be sharded like its operand; everything else costs 1e18), so nodes
fall into groups of up to thousands that can only change strategy *together*: choosing the
root's strategy fixes every member's. No neighbourhood smaller than a group can move it,
which is what stalls single-node, tree and small CP-SAT moves. A group move tries every root
strategy at once, vectorised: it propagates the choice through a BFS tree of the group's
bijective edges, scores every candidate against the fixed rest of the graph, checks the
memory profile, and takes the best one that fits.
"""

from __future__ import annotations

import time

import numpy as np

from autopar.solver._unionfind import UnionFind


class Groups:
    def __init__(self, ls) -> None:
        q = ls.q
        n = q.num_nodes
        sets = UnionFind(n)
        self.bij = np.zeros(q.num_edges, dtype=bool)
        for e, m in enumerate(q.edge_costs):
            ok = m < ls.forbid
            if (ok.sum(1) <= 1).all() and (ok.sum(0) <= 1).all() and ok.any():
                self.bij[e] = True
                sets.union(q.edges[e][0], q.edges[e][1])
        roots = sets.roots()
        order = np.argsort(roots, kind="stable")
        cuts = np.nonzero(np.diff(roots[order]))[0] + 1
        self.members = [g for g in np.split(order, cuts) if len(g) > 1]
        self.group_of = np.full(n, -1, dtype=np.int64)
        for g, mem in enumerate(self.members):
            self.group_of[mem] = g

    def tree(self, ls, g: int) -> tuple[list[int], list[int], list[int]]:
        """BFS over the group's bijective edges: (nodes, parent, edge to parent)."""
        q = ls.q
        root = int(self.members[g][0])
        seen = {root}
        order, par, pedge = [root], [-1], [-1]
        k = 0
        while k < len(order):
            i = order[k]
            k += 1
            for e, side in ls.inc[i]:
                if not self.bij[e]:
                    continue
                j = q.edges[e][1 - side]
                if j not in seen:
                    seen.add(j)
                    order.append(j)
                    par.append(i)
                    pedge.append(e)
        return order, par, pedge

    def maps(self, ls, node: int) -> tuple[dict[int, np.ndarray], np.ndarray]:
        """For the unit of ``node`` (its group, or the node alone): each member's strategy as
        a function of the unit's choice (-1: inconsistent), and which choices are valid."""
        q = ls.q
        g = int(self.group_of[node])
        if g < 0:
            k = len(q.costs[node])
            return {node: np.arange(k)}, np.ones(k, dtype=bool)
        order, par, pedge = self.tree(ls, g)
        k = len(q.costs[order[0]])
        maps = {order[0]: np.arange(k)}
        for i, p, e in zip(order[1:], par[1:], pedge[1:]):
            ok = q.edge_costs[e] < ls.forbid
            ok = ok if q.edges[e][0] == p else ok.T
            perm = np.full(ok.shape[0], -1)
            r, c = np.nonzero(ok)
            perm[r] = c
            mp = maps[p]
            maps[i] = np.where(mp >= 0, perm[np.maximum(mp, 0)], -1)
        valid = np.ones(k, dtype=bool)
        for mp in maps.values():
            valid &= mp >= 0
        return maps, valid

    def move(self, ls, g: int) -> float:
        """Best consistent re-choice of group ``g``; returns the cost decrease (0 if none)."""
        return self.move_units(ls, [int(self.members[g][0])])

    def move_units(self, ls, nodes: list[int]) -> float:
        """Best joint re-choice of the units (groups or single nodes) of one or two ``nodes``,
        e.g. both ends of an expensive edge; returns the cost decrease (0 if none)."""
        scored = self.score_units(ls, nodes)
        if scored is None:
            return 0.0
        where, total, cur = scored
        a = ls.a
        shape = total.shape
        flat = np.argsort(total, axis=None)
        for f in flat[:12].tolist():
            s = np.unravel_index(f, shape)
            if not total[s] < cur - 1e-9 * max(1.0, abs(cur)):
                return 0.0
            prev = {i: int(a[i]) for i in where}
            self.apply(ls, where, s)
            if ls.fits():
                return cur - float(total[s])
            for i, s0 in prev.items():
                ls.set(i, s0)
        return 0.0

    @staticmethod
    def apply(ls, where: dict[int, np.ndarray], s: tuple) -> None:
        """Set every member of the scored units to its strategy under grid choice ``s``."""
        for i, wi in where.items():
            ls.set(i, int(wi[min(s[0], wi.shape[0] - 1), min(s[1], wi.shape[1] - 1)]))

    def score_units(
        self, ls, nodes: list[int]
    ) -> tuple[dict[int, np.ndarray], np.ndarray, float] | None:
        """Every joint choice of the units of one or two ``nodes``, scored against the fixed
        rest: ``(member -> its strategy on the (k1, k2) grid, total cost on the grid with inf
        where inconsistent, current cost)``, or None when the units have one valid choice."""
        q, a = ls.q, ls.a
        units = [self.maps(ls, nodes[0])]
        if len(nodes) > 1:
            m2 = self.maps(ls, nodes[1])
            if not (m2[0].keys() & units[0][0].keys()):
                units.append(m2)
        # unit j's choices run along axis j of a (k1, k2) grid
        shape = tuple(len(v) for _, v in units) + (1,) * (2 - len(units))
        where: dict[int, np.ndarray] = {}
        valid = np.ones(shape, dtype=bool)
        for j, (maps, ok) in enumerate(units):
            sh = [1, 1]
            sh[j] = len(ok)
            valid &= ok.reshape(sh)
            for i, mp in maps.items():
                where[i] = np.maximum(mp, 0).reshape(sh)
        if valid.sum() <= 1:
            return None
        total = np.zeros(shape)
        cur = 0.0
        edges_seen = set()
        for i, wi in where.items():
            total = total + q.costs[i][wi]
            cur += q.costs[i][a[i]]
            for e, _ in ls.inc[i]:
                if e in edges_seen:
                    continue
                edges_seen.add(e)
                u, v = q.edges[e]
                m = q.edge_costs[e]
                cur += m[a[u], a[v]]
                total = total + m[where.get(u, a[u]), where.get(v, a[v])]
        return where, np.where(valid, total, np.inf), cur


def group_pass(ls, deadline: float) -> int:
    """Try every rigid group of ``ls`` once, in random order; returns how many moved."""
    moved = 0
    for g in ls.rng.permutation(len(ls.groups.members)).tolist():
        if time.monotonic() > deadline:
            break
        moved += ls.groups.move(ls, g) > 0
    return moved
