"""Exact presolve: shrink a problem without changing its optimum.

The reduced problem keeps every node (same ids) but fewer strategies and edges; strategy ``j``
of node ``i`` in the reduced problem is strategy ``keep[i][j]`` of the original, and
``cost_reduced(a) == cost_original(expand(a))`` for every assignment. Steps, repeated until
nothing changes:

- parallel edges are summed, self-loops go into the node cost;
- strategies whose node cost is "forbidden" (>= FORBIDDEN, the contest's 1e18 sentinel) are
  dropped, and so are strategies with no allowed partner on some edge (arc consistency);
  with ``hard_forbid=False`` these steps are skipped, which keeps the reduction exact when the
  only solutions use forbidden costs;
- strategies that can never fit in memory (their extra usage over the node's smallest
  exceeds the headroom left by every other node at its smallest) are dropped;
- dominated strategies are dropped: s' dominates s when its node cost, its usage (if the node
  is ever live under a limit) and its rows of every incident edge matrix are all <= those of s
  (tested again only at nodes whose own data or incident matrices changed since their test);
- edges touching a single-strategy node, and edges whose matrix is ``r[s_u] + c[s_v]``, are
  folded into the node costs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autopar.solver.problem import Problem, fits, least_load

FORBIDDEN = 1e17
_DOMINANCE_BUDGET = 4e7  # element comparisons per node; bigger nodes keep their strategies


@dataclass(frozen=True, slots=True, eq=False)
class Reduction:
    problem: Problem
    keep: list[np.ndarray]
    infeasible: bool = False  # proven: even the smallest usages overflow the limit

    def expand(self, a: np.ndarray) -> np.ndarray:
        return np.array([k[j] for k, j in zip(self.keep, np.asarray(a).tolist())], dtype=np.int64)

    def restrict(self, a: np.ndarray) -> np.ndarray:
        """Map an original assignment into the reduced one; removed strategies become the
        kept strategy with the closest index (a hint only needs to be plausible)."""
        out = np.empty(len(self.keep), dtype=np.int64)
        for i, (k, s) in enumerate(zip(self.keep, np.asarray(a).tolist())):
            out[i] = int(np.argmin(np.abs(k - s)))
        return out


class _Work:
    def __init__(self, p: Problem, hard_forbid: bool) -> None:
        self.p = p
        self.hard = hard_forbid
        self.costs = [c.astype(np.float64).copy() for c in p.costs]
        self.usages = [u.astype(np.float64).copy() for u in p.usages]
        self.keep = [np.arange(len(c)) for c in p.costs]
        self.live = p.index.end > p.index.start
        self.mats: dict[tuple[int, int], np.ndarray] = {}
        self.adj: list[set[tuple[int, int]]] = [set() for _ in p.costs]
        for (u, v), m in zip(p.edges, p.edge_costs):
            if u == v:
                self.costs[u] += np.diag(m)
            elif (u, v) in self.mats:
                self.mats[(u, v)] = self.mats[(u, v)] + m
            elif (v, u) in self.mats:
                self.mats[(v, u)] = self.mats[(v, u)] + m.T
            else:
                self.mats[(u, v)] = m.astype(np.float64).copy()
                self.adj[u].add((u, v))
                self.adj[v].add((u, v))
        self.changed = True
        # nodes whose strategies, usages or incident matrices changed since their last
        # dominance test: only they can have a newly dominated strategy (on contest
        # instance A the second pass over every node was a third of the presolve)
        self.dirty = np.ones(len(p.costs), dtype=bool)

    def touch(self, i: int) -> None:
        """Node i changed: its dominance test and its neighbours' (their matrices) are due."""
        self.dirty[i] = True
        for u, v in self.adj[i]:
            self.dirty[u] = self.dirty[v] = True

    def restrict(self, i: int, mask: np.ndarray) -> None:
        if mask.all():
            return
        self.changed = True
        self.touch(i)
        self.costs[i] = self.costs[i][mask]
        self.usages[i] = self.usages[i][mask]
        self.keep[i] = self.keep[i][mask]
        for key in self.adj[i]:
            m = self.mats[key]
            self.mats[key] = m[mask, :] if key[0] == i else m[:, mask]

    def drop_edge(self, key: tuple[int, int]) -> None:
        self.changed = True
        self.dirty[key[0]] = self.dirty[key[1]] = True
        del self.mats[key]
        self.adj[key[0]].discard(key)
        self.adj[key[1]].discard(key)

    def rows(self, i: int) -> list[np.ndarray]:
        """Each incident matrix oriented with node i's strategies as rows."""
        return [self.mats[k] if k[0] == i else self.mats[k].T for k in self.adj[i]]

    # -- steps -----------------------------------------------------------------------------
    def forbid_nodes(self) -> bool:
        for i, c in enumerate(self.costs):
            ok = c < FORBIDDEN
            if not ok.any():
                return False
            self.restrict(i, ok)
        return True

    def memory_prune(self) -> bool:
        limit = self.p.usage_limit
        if limit is None:
            return True
        idx = self.p.index
        umin = np.array([u.min() for u in self.usages])
        load = least_load(self.p, self.usages)
        if len(load) and not fits(float(load.max()), limit):
            return False
        for i in np.nonzero(self.live)[0]:
            if len(self.usages[i]) == 1:
                continue
            head = limit - float(load[idx.start[i] : idx.end[i]].max())
            extra = self.usages[i] - umin[i]
            self.restrict(int(i), extra <= head + 1e-12 * max(1.0, abs(limit)))
        return True

    def arc_consistency(self) -> bool:
        for key in list(self.mats):
            u, v = key
            ok = self.mats[key] < FORBIDDEN
            ru, cv = ok.any(1), ok.any(0)
            if not ru.any() or not cv.any():
                return False
            self.restrict(u, ru)
            self.restrict(v, cv)
        return True

    def fold_edges(self) -> None:
        for key in list(self.mats):
            u, v = key
            m = self.mats[key]
            if m.shape[0] == 1:
                self.costs[v] += m[0]
            elif m.shape[1] == 1:
                self.costs[u] += m[:, 0]
            else:
                if (m >= FORBIDDEN).any():
                    continue
                r = m.min(1)
                res = m - r[:, None]
                if not (res == res[0]).all():
                    continue
                self.costs[u] += r
                self.costs[v] += res[0]
            self.drop_edge(key)

    def dominance(self) -> None:
        limit = self.p.usage_limit
        for i in np.nonzero(self.dirty)[0].tolist():
            self.dirty[i] = False
            k = len(self.costs[i])
            if k == 1:
                continue
            cols = [self.costs[i][:, None]]
            if limit is not None and self.live[i]:
                cols.append(self.usages[i][:, None])
            for r in self.rows(i):
                cols.append(np.where(r >= FORBIDDEN, np.inf, r) if self.hard else r)
            f = np.concatenate(cols, axis=1)
            if k * k * f.shape[1] > _DOMINANCE_BUDGET:
                continue
            # le[a, b]: b is no worse than a everywhere; b removes a if it is strictly better
            # somewhere or, for identical strategies, comes first
            le = _no_worse(f)
            eq = le & le.T
            first = np.arange(k)[None, :] < np.arange(k)[:, None]
            dominated = (le & (~eq | first)).any(1)
            mask = ~dominated
            self.restrict(i, mask)


def _no_worse(f: np.ndarray, block: int = 64) -> np.ndarray:
    """``le[a, b]``: row ``b`` of ``f`` is no greater than row ``a`` in every column. The
    first ``block`` columns are compared for every pair; the rest only for the pairs still
    standing, which are few (moe-tiny's nodes of 100-200 strategies with edge rows of as
    many columns: the whole comparison was most of a presolve's time)."""
    head = f[:, :block]
    le = (head[None, :, :] <= head[:, None, :]).all(2)
    if f.shape[1] <= block:
        return le
    rest = f[:, block:]
    a, b = np.nonzero(le)
    step = max(1, (1 << 20) // rest.shape[1])  # pairs per chunk: about a million compared
    for lo in range(0, len(a), step):
        aa, bb = a[lo : lo + step], b[lo : lo + step]
        worse = ~(rest[bb] <= rest[aa]).all(1)
        le[aa[worse], bb[worse]] = False
    return le


def reduce_problem(p: Problem, hard_forbid: bool = True, max_rounds: int = 6) -> Reduction | None:
    """Presolve ``p``. Returns None when ``hard_forbid`` leaves some node with no allowed
    strategy (the caller retries with ``hard_forbid=False``)."""
    w = _Work(p, hard_forbid)
    infeasible = False
    if hard_forbid and not w.forbid_nodes():
        return None
    for _ in range(max_rounds):
        if not w.changed:
            break
        w.changed = False
        if not w.memory_prune():
            infeasible = True
            break
        if hard_forbid and not w.arc_consistency():
            return None
        w.fold_edges()
        w.dominance()
    keys = list(w.mats)
    red = Problem(
        costs=w.costs,
        usages=w.usages,
        intervals=list(p.intervals),
        edges=keys,
        edge_costs=[w.mats[k] for k in keys],
        usage_limit=p.usage_limit,
        names=p.names,
        name=p.name,
    )
    return Reduction(red, w.keep, infeasible)


def presolve(problem: Problem) -> tuple[Reduction, bool]:
    """The reduction with forbidden choices removed, or, where removing them leaves no
    solution, the soft one that keeps them; and whether it is the soft one."""
    red = reduce_problem(problem, hard_forbid=True)
    if red is not None and not red.infeasible:
        return red, False
    # forbidding 1e18 choices may be what leaves memory no room: only the soft form proves it
    return reduce_problem(problem, hard_forbid=False), True
