r"""The memory limit relaxed into the cost (Lagrange multipliers per time step), then repaired.

The hard part of a contest instance is its usage limit: the limit sits about 10% above the
smallest possible peak, so a search that only ever takes moves that fit (``heuristic.py``)
is walled in by its first feasible plan. As the strongest contest solvers do, the limit is
moved into the objective instead. With a multiplier :math:`\lambda_t \ge 0` per time step,

.. math::

    L(\lambda) = \min_x \sum_i \big(c_i(x_i) + \pi_i\, u_i(x_i)\big)
                 + \sum_{(u,v)} C_{uv}(x_u, x_v) - U \sum_t \lambda_t,
    \qquad \pi_i = \sum_{t \in [s_i, e_i)} \lambda_t,

is a lower bound on the optimum for every :math:`\lambda \ge 0` (a plan that fits pays no
more than its cost). Each round

1. solves the relaxed problem (no limit; node costs plus prices) approximately with the
   heuristic's unconstrained moves, warm-started from the last round (``relax``);
2. moves the multipliers along the subgradient (load minus limit), with a Polyak step
   towards the best feasible cost (``_step``);
3. repairs the relaxed plan (``repair``): while some time step overflows, at the worst one
   take the move with the least cost increase per unit of memory freed there, among single
   nodes and whole rigid groups whose usage drops nowhere rises (so the repair ends);
4. polishes the repaired plan with feasible single-node and group moves, and keeps the best.

The relaxed problem is itself hard, so :math:`L(\lambda)` is not known exactly; the bound
reported is a weaker one that is exact for any :math:`\lambda`: every edge is charged to
its first node at its cheapest partner, and each node's minimum taken alone
(``lower_bound``).
"""

from __future__ import annotations

import math
import time

import numpy as np

from autopar.solver.groups import group_pass
from autopar.solver.problem import Problem, fits, usage_profile
from autopar.solver.treedp import TREE_SIZE, tree_move


def node_prices(lam: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """:math:`\\pi_i`: the multipliers summed over each node's live range."""
    c = np.concatenate([[0.0], np.cumsum(lam)])
    s = np.minimum(start, len(lam))
    e = np.minimum(np.maximum(end, start), len(lam))
    return c[e] - c[s]


class EdgeMins:
    """Per node, the sum over the edges it is first endpoint of, of each edge's cheapest
    partner cost: ``own[i][s]``. Built once; the bound only needs the node costs added."""

    def __init__(self, q: Problem) -> None:
        self.own = [np.zeros(len(c)) for c in q.costs]
        for (u, _), m in zip(q.edges, q.edge_costs):
            self.own[u] = self.own[u] + m.min(axis=1)


def lower_bound(q: Problem, mins: EdgeMins, prices: np.ndarray, lam_total: float) -> float:
    """A valid lower bound on ``q``'s optimum under its limit for these multipliers."""
    limit = q.usage_limit or 0.0
    lb = 0.0
    for c, u, own, pi in zip(q.costs, q.usages, mins.own, prices.tolist()):
        lb += float((c + pi * u + own).min())
    return lb - limit * lam_total


class Lagrangian:
    """Multipliers and the two searches (relaxed and true) that share one problem."""

    def __init__(self, ls, rls) -> None:
        # ls: LocalSearch on the true (capped) problem, feasible; rls: one on the same
        # problem without a limit, whose costs this class re-prices each round
        self.ls, self.rls = ls, rls
        q = ls.q
        self.base = q
        self.limit = float(q.usage_limit)
        self.lam = np.zeros(q.index.horizon)
        self.theta = 1.0  # Polyak step factor, halved when the relaxed value stalls
        self.mins = EdgeMins(q)
        self.bound = -math.inf
        self.best_relaxed = -math.inf
        self.stall = 0

    def prices(self) -> np.ndarray:
        idx = self.base.index
        return node_prices(self.lam, idx.start, idx.end)

    def reprice(self) -> None:
        q, pi = self.base, self.prices()
        costs = [c + p * u for c, u, p in zip(q.costs, q.usages, pi.tolist())]
        self.rls.q = Problem(costs, q.usages, q.intervals, q.edges, q.edge_costs, None,
                             q.names, q.name)
        self.bound = max(self.bound, lower_bound(q, self.mins, pi, float(self.lam.sum())))

    def relax(self, until: float) -> None:
        """Approximately minimise the priced problem from the current relaxed plan with the
        heuristic's unconstrained moves (single nodes, rigid groups, induced trees, both
        ends of a costly edge) until ``until``."""
        rls = self.rls
        rls.sweep(until)
        if rls.groups is not None and time.monotonic() < until:
            group_pass(rls, until)
        k = 0
        while time.monotonic() < until:
            tree_move(rls, rls.pick_seed(), TREE_SIZE, safe=False)
            k += 1
            if rls.groups is not None and k % 4 == 0:
                e = rls.pick_edge()
                if e is not None:
                    rls.groups.move_units(rls, list(e))

    def step(self, best_cost: float) -> None:
        """Subgradient step on the multipliers, Polyak-sized towards ``best_cost``."""
        load = usage_profile(self.base, self.rls.a)
        g = load - self.limit
        g = np.where((self.lam > 0) | (g > 0), g, 0.0)
        norm = float(g @ g)
        if norm == 0:
            return
        rel = self.rls.cost() - self.limit * float(self.lam.sum())
        if rel > self.best_relaxed + 1e-9 * abs(self.best_relaxed):
            self.best_relaxed, self.stall = rel, 0
        else:
            self.stall += 1
            if self.stall >= 3:
                self.theta, self.stall = max(self.theta / 2, 1e-3), 0
        gap = best_cost - rel if math.isfinite(best_cost) else abs(rel) * 0.05 + 1.0
        t = self.theta * max(gap, 1e-9 * max(1.0, abs(rel))) / norm
        self.lam = np.maximum(0.0, self.lam + t * g)

    def repair(self, deadline: float) -> bool:
        """Make the true search's plan (a copy of the relaxed one) fit; False if stuck."""
        ls = self.ls
        ls.a = self.rls.a.copy()
        ls.load = usage_profile(ls.q, ls.a)
        return repair(ls, deadline=deadline)


def repair(ls, max_steps: int = 100_000, deadline: float | None = None) -> bool:
    """Lower the peak of ``ls``'s plan to its limit by usage-decreasing moves, cheapest cost
    per unit of memory freed at the worst time step first; True when it fits (False when
    stuck or past ``deadline``)."""
    q, limit = ls.q, ls.limit
    if limit is None:
        return True
    idx = q.index
    free = idx.n_strat > 1
    for _ in range(max_steps):
        t = int(np.argmax(ls.load))
        over = float(ls.load[t]) - limit
        if fits(float(ls.load[t]), limit):
            return True
        if deadline is not None and time.monotonic() > deadline:
            return False
        cand = np.nonzero(free & (ls.st <= t) & (ls.en > t))[0]
        cur_u = idx.usage_flat[idx.node_off[cand] + ls.a[cand]]
        cand = cand[cur_u > ls.min_usage[cand]]
        moves = []  # (cost per unit of memory freed, the move)
        seen_groups: set[int] = set()
        for i in cand.tolist():
            g = int(ls.groups.group_of[i]) if ls.groups is not None else -1
            if g >= 0:
                if g in seen_groups:
                    continue
                seen_groups.add(g)
                mv = _group_move(ls, i, t)
            else:
                mv = _node_move(ls, i, t, over)
            if mv is not None:
                moves.append(mv)
        if not moves:
            return False
        moves.sort(key=lambda m: m[0])
        progressed = False
        for _, apply in moves:
            if apply():
                progressed = True
            if fits(float(ls.load[t]), limit):
                break
        if not progressed:
            return False
    return fits(float(ls.load.max(initial=0.0)), limit)


def _node_move(ls, i: int, t: int, over: float):
    """The single-node usage decrease with the least cost per unit freed, as (ratio, apply)."""
    u = ls.q.usages[i]
    cur = int(ls.a[i])
    down = u < u[cur]
    if not down.any():
        return None
    c = ls.local(i)
    freed = u[cur] - u
    # freeing more than the overflow earns nothing more at this step
    ratio = np.full(len(u), np.inf)
    ratio[down] = (c[down] - c[cur]) / np.minimum(freed[down], max(over, 1e-30))
    s = int(np.argmin(ratio))

    def apply() -> bool:
        if ls.a[i] != cur:
            return False
        ls.set(i, s)
        return True

    return float(ratio[s]), apply


def _group_move(ls, i: int, t: int):
    """The rigid group's choice with the least cost per unit freed at ``t``, as (ratio,
    apply), among those where no live member's usage rises (see ``repair``)."""
    scored = ls.groups.score_units(ls, [i])
    if scored is None:
        return None
    where, total, cur = scored
    q, a = ls.q, ls.a
    k = total.shape[0]
    freed_t = np.zeros(k)
    never_up = np.ones(k, dtype=bool)
    for j, wj in where.items():
        uj = q.usages[j]
        choice = wj[:, 0]
        d = uj[a[j]] - uj[choice]
        never_up &= (d >= 0) | ~ls.live[j]
        if ls.st[j] <= t < ls.en[j]:
            freed_t += d
    ok = never_up & (freed_t > 0) & np.isfinite(total[:, 0])
    if not ok.any():
        return None
    ratio = np.where(ok, (total[:, 0] - cur) / np.where(ok, freed_t, 1.0), np.inf)
    s = int(np.argmin(ratio))
    before = {j: int(a[j]) for j in where}

    def apply() -> bool:
        if any(int(a[j]) != s0 for j, s0 in before.items()):
            return False
        ls.groups.apply(ls, where, (s, 0))
        return True

    return float(ratio[s]), apply


def search(ls, deadline: float, log: bool = False) -> float:
    """Lagrangian rounds until ``deadline``, from ``ls``'s plan (feasible); leaves the best
    feasible plan found in ``ls`` and returns the best lower bound proven on the way."""
    q = ls.q
    if q.usage_limit is None or q.index.horizon == 0:
        return -math.inf
    free_q = Problem(q.costs, q.usages, q.intervals, q.edges, q.edge_costs, None, q.names, q.name)
    rls = type(ls)(free_q, int(ls.rng.integers(2**31)), ls.forbid)
    rls.groups = ls.groups
    rls.a = ls.a.copy()
    rls.load = usage_profile(free_q, rls.a)
    lg = Lagrangian(ls, rls)
    best_a, best_c = ls.a.copy(), ls.cost()
    rounds = 0
    # a round's relaxed search gets a slice long enough for its tree moves to matter
    slice_s = max(1.0, 0.08 * (deadline - time.monotonic()))
    while time.monotonic() < deadline:
        lg.reprice()
        lg.relax(min(deadline, time.monotonic() + slice_s))
        if time.monotonic() > deadline:
            break
        if rounds and not lg.lam.any() and fits(float(usage_profile(q, rls.a).max()), lg.limit):
            break  # the limit does not bind the relaxed plan: nothing to price
        lg.step(best_c)
        rounds += 1
        if lg.repair(deadline):
            ls.sweep(deadline)
            if ls.groups is not None and time.monotonic() < deadline:
                group_pass(ls, deadline)
            c = ls.cost()
            if ls.fits() and c < best_c:
                best_a, best_c = ls.a.copy(), c
        if log:
            print(f"  lagrange round {rounds}: relaxed {rls.cost():.6g} best {best_c:.6g} "
                  f"bound {lg.bound:.6g} theta {lg.theta:g}", flush=True)
    ls.a = best_a
    ls.load = usage_profile(q, best_a)
    return lg.bound
