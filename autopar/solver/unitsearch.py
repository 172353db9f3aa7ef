r"""Compiled Lagrangian search over rigid units: the memory limit priced per time step,
relaxed plans repaired, repaired plans polished (the approach of the strongest IOPDDL
solvers; ``lagrange.py`` writes out the relaxation, this is its fast form).

The presolved problem's free nodes are contracted into units (``contract.py``: nodes tied
by bijective edges change together, so a unit is one variable indexed by its root's
strategy); fixed nodes are folded into their neighbours' costs and a base usage profile.
The loops (``kernels.py``, numba) then run on flat arrays: a sweep of best single-unit moves
over S's 6.5k units takes milliseconds where the Python sweep over its 28k nodes took
seconds, so a round (reprice, relaxed sweeps to a local optimum, subgradient step,
tightening towards the limit and repair, feasible polish with single-unit and
both-ends-of-an-edge moves) takes well under a second. When the rounds stall, exact moves on
regions of units (``regions.py``) polish the incumbent.

Those moves settle in the basin they start in: on contest instance M the relaxed plans of
every round stayed within 0.1% of the incumbent (5.226e10, the multipliers positive at 2-3
steps), from any price, while the contest's best is 4.99e10. So where the relaxed plans
stay at the incumbent's cost, one search (``oracle``) spends the next part of its run
asking a complete weighted-CSP solver (``wcsp.py``, toulbar2,
hinted by the local relaxed plan) for the relaxed plan: its plan is tightened and considered
whatever its priced cost, and replaces the local one for the subgradient step where it is
cheaper under the prices. On M its first, unpriced plan (4.615e10, 5.5 times over the limit)
steps the multipliers to priced plans 1.6 times over that tighten to 4.99e10.
"""

from __future__ import annotations

import math
import threading
import time
from typing import NamedTuple

import numpy as np

from autopar.solver import kernels, regions, wcsp
from autopar.solver.contract import contract
from autopar.solver.problem import _USAGE_RTOL, Problem

# forbidden costs inside the search: high enough to outweigh any real plan, low enough
# that sums keep the ordinary costs' precision (as ``heuristic._PENALTY``)
_PENALTY = 1e15
# Polyak step factor: starts at _THETA0, halves after _STALL rounds without a better relaxed
# value, never below _THETA_MIN (3 against 8, side by side at half the contest limits under
# load 5-7: M 0.9991, S 0.9974, perturbed M 0.9995, perturbed S 1.0000; most rounds end in
# a kick, which resets the step, before 8 rounds pass)
_THETA0, _STALL, _THETA_MIN = 0.5, 3, 0.02
# after _KICK_AFTER rounds without a better plan the relaxed search restarts from the best
# plan with every multiplier scaled by its own log-normal factor (sigma _KICK_SIGMA) and the
# step reset: the rounds otherwise settle into one cycle of relaxed plans (0 disables)
_KICK_AFTER, _KICK_SIGMA = 6, 0.3
# a relaxed plan over the limit is moved towards it by up to _TIGHTEN_ROUNDS re-solves, the
# multipliers at the steps still over raised by _TIGHTEN_FACTOR (plus a bump) each time,
# each re-solve _TIGHTEN_PASSES passes of relaxed moves (see ``Search.tighten``)
_TIGHTEN_ROUNDS, _TIGHTEN_FACTOR, _TIGHTEN_PASSES = 16, 2.0, 3
# when the rounds stall, exact region moves (``regions.py``) on the incumbent for up to
# this many seconds before the kick; without a limit they take the time the rounds would
_REGION_S = 3.0
# relaxed plans from the complete WCSP solver (``wcsp.py``, toulbar2) in the first
# _ORACLE_SHARE of a run under a limit: each solve gets _ORACLE_PART of the run's time in
# CPU seconds, within [_ORACLE_MIN_S, _ORACLE_MAX_S] (shorter ones return poor plans on M),
# and at most _ORACLE_WALL times that in wall time (a loaded machine gives it a fraction of
# a core); the first solve _ORACLE_FIRST times as much (see ``run``)
_ORACLE_SHARE, _ORACLE_PART, _ORACLE_MIN_S, _ORACLE_MAX_S = 0.6, 0.1, 5.0, 20.0
_ORACLE_WALL, _ORACLE_FIRST = 4.0, 2.0
# ... once the local rounds are stuck: after _ORACLE_AFTER rounds, the best relaxed value
# within _STUCK of the incumbent's cost
_ORACLE_AFTER, _STUCK = 8, 0.01
# ``run(..., settle_until=T)``: past its deadline the search goes on (until T at the latest)
# while its best plan still pays a forbidden pair or improved in the last _SETTLE rounds; a
# fixed wall window gave contest instance A +0.02% or +65% by how much CPU the window got
_SETTLE = 6


class UnitArrays(NamedTuple):
    """Flat arrays of the unit problem, in the order ``kernels.py`` unpacks them."""

    k_off: np.ndarray  # [U+1] unit u's choices are k_off[u]..k_off[u+1]
    m_ptr: np.ndarray  # [U+1] unit u's live members are m_ptr[u]..m_ptr[u+1]
    m_st: np.ndarray  # [M] member live interval [m_st, m_en)
    m_en: np.ndarray
    m_uoff: np.ndarray  # [M] offset of the member's usage per unit choice in m_use
    m_use: np.ndarray
    adj_ptr: np.ndarray  # [U+1] CSR of unit edges: adj_e edge id, adj_side 0 if u is e_a
    adj_e: np.ndarray
    adj_side: np.ndarray
    e_a: np.ndarray  # [E] unit edge endpoints; matrix e_flat[e_off + ka * e_nb + kb]
    e_b: np.ndarray
    e_off: np.ndarray
    e_nb: np.ndarray
    e_flat: np.ndarray


class UnitProblem:
    """``q``'s free nodes as units, with the maps between unit choices and assignments."""

    def __init__(self, q: Problem, forbid: float) -> None:
        idx = q.index
        self.q = q
        free = np.nonzero(idx.n_strat > 1)[0]
        fixed = idx.n_strat <= 1
        pos = np.full(q.num_nodes, -1, dtype=np.int64)
        pos[free] = np.arange(len(free))
        node_c = [q.costs[i].astype(np.float64) for i in free]
        inner = []
        for (u, v), m in zip(q.edges, q.edge_costs):
            pu, pv = pos[u], pos[v]
            if pu >= 0 and pv >= 0:
                inner.append((int(pu), int(pv), m))
            elif pu >= 0:
                node_c[pu] = node_c[pu] + m[:, 0]
            elif pv >= 0:
                node_c[pv] = node_c[pv] + m[0, :]
        units = contract(node_c, inner, forbid, enabled=forbid < math.inf)

        def cap(a: np.ndarray) -> np.ndarray:
            return np.where(~np.isfinite(a) | (a >= forbid), _PENALTY, a)

        self.free, self.maps, self.unit_of = free, units.maps, units.unit_of
        self.roots = np.array(units.roots, dtype=np.int64)
        n_units = len(units.roots)
        sizes = np.array([len(c) for c in units.costs], dtype=np.int64)
        k_off = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.ucost = cap(np.concatenate(units.costs)) if n_units else np.zeros(0)
        self.k_max = int(sizes.max(initial=1))
        live = idx.end > idx.start
        order = np.argsort(units.unit_of, kind="stable")
        mem = [int(k) for k in order if live[free[k]]]
        m_unit = units.unit_of[mem] if mem else np.zeros(0, np.int64)
        m_ptr = np.searchsorted(m_unit, np.arange(n_units + 1)).astype(np.int64)
        uses = [q.usages[free[k]].astype(np.float64)[units.maps[k]] for k in mem]
        m_len = np.array([len(x) for x in uses], dtype=np.int64)
        m_uoff = np.concatenate([[0], np.cumsum(m_len)[:-1]]).astype(np.int64)
        m_use = np.concatenate(uses) if uses else np.zeros(0)
        free_nodes = free[mem] if mem else np.zeros(0, np.int64)
        m_st, m_en = idx.start[free_nodes].astype(np.int64), idx.end[free_nodes].astype(np.int64)
        # the fixed nodes' usage, the floor of every profile
        fl = fixed & live
        use0 = idx.usage_flat[idx.node_off]
        h = idx.horizon
        delta = np.bincount(idx.start[fl], weights=use0[fl], minlength=h + 1)
        delta -= np.bincount(idx.end[fl], weights=use0[fl], minlength=h + 1)
        self.base = np.cumsum(delta[:h]).astype(np.float64)
        e_a = np.array([a for a, _, _ in units.edges], dtype=np.int64)
        e_b = np.array([b for _, b, _ in units.edges], dtype=np.int64)
        e_nb = sizes[e_b] if len(e_b) else np.zeros(0, np.int64)
        e_sz = sizes[e_a] * e_nb if len(e_a) else np.zeros(0, np.int64)
        e_off = np.concatenate([[0], np.cumsum(e_sz)[:-1]]).astype(np.int64)
        e_flat = (cap(np.concatenate([m.ravel() for _, _, m in units.edges]).astype(np.float64))
                  if units.edges else np.zeros(0))
        ends = np.concatenate([e_a, e_b])
        sides = np.concatenate([np.zeros(len(e_a), np.int64), np.ones(len(e_b), np.int64)])
        eids = np.concatenate([np.arange(len(e_a)), np.arange(len(e_b))]).astype(np.int64)
        o = np.argsort(ends, kind="stable")
        adj_ptr = np.searchsorted(ends[o], np.arange(n_units + 1)).astype(np.int64)
        self.D = UnitArrays(k_off, m_ptr, m_st, m_en, m_uoff, m_use, adj_ptr, eids[o],
                            sides[o], e_a, e_b, e_off, e_nb, e_flat)

    @property
    def num_units(self) -> int:
        return len(self.roots)

    def choice(self, a: np.ndarray) -> np.ndarray:
        """Each unit's choice in assignment ``a`` (its root's strategy)."""
        return a[self.free[self.roots]].astype(np.int64)

    def expand(self, ch: np.ndarray, a: np.ndarray) -> np.ndarray:
        """``a`` with every free node set from its unit's choice."""
        out = a.copy()
        pick = ch[self.unit_of]
        out[self.free] = [int(m[k]) for m, k in zip(self.maps, pick.tolist())]
        return out


class Elite:
    """The best plan of the searches that run side by side on one problem (one per
    thread). A search's result depends much on its start: on contest instance S, four seeds
    of one 90 s search ended 1.597e9 to 1.655e9, one of them at its polished greedy start
    for its first 9 rounds, and most of what a search gains later comes from the kicks that
    restart its relaxed plan from its incumbent. So every search publishes each better plan
    here, and at each kick restarts from the best of all (``Search.share``), its own
    multipliers and random stream kept: the searches then differ in their prices, not in
    the basin they refine."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.best: np.ndarray | None = None
        self.best_c = math.inf

    def offer(self, ch: np.ndarray, c: float) -> None:
        """Keep a copy of plan ``ch`` of cost ``c`` when it is the cheapest offered."""
        with self.lock:
            if c < self.best_c:
                self.best, self.best_c = ch.copy(), c

    def cheaper(self, c: float) -> tuple[np.ndarray, float] | None:
        """A copy of the shared plan and its cost when it costs less than ``c``, else None."""
        with self.lock:
            if self.best is not None and self.best_c < c:
                return self.best.copy(), self.best_c
            return None


class Search:
    """The incumbent (best feasible unit choice) and the Lagrangian rounds around it."""

    def __init__(self, up: UnitProblem, a0: np.ndarray, seed: int = 0,
                 deadline: float = math.inf, oracle: bool = False,
                 oracle_min_s: float = _ORACLE_MIN_S, elite: Elite | None = None) -> None:
        self.up, self.D = up, up.D
        self.elite = elite
        self.adopted = 0  # kicks that restarted from another search's better plan
        self.oracle = oracle and wcsp.available()
        self.oracle_min_s = oracle_min_s  # the shortest oracle solve worth its start
        self.oracle_wins = 0  # rounds whose relaxed plan came from the oracle
        self.oracle_calls = 0
        limit = up.q.usage_limit
        self.lim = math.inf if limit is None else limit + _USAGE_RTOL * max(1.0, abs(limit))
        self.rng = np.random.default_rng(seed)
        self.buf = np.zeros(up.k_max)
        self.buf2 = np.zeros(up.k_max)
        ch = up.choice(a0)
        load = kernels.profile(self.D, ch, up.base)
        self.best, self.best_c = ch, math.inf
        if load.max(initial=0.0) <= self.lim or kernels.repair(
                self.D, ch, up.ucost, load, self.lim, self.buf, self.buf2, 100_000):
            self.consider(ch, load, deadline)
        self.bound = -math.inf
        self.rounds = 0

    def order(self) -> np.ndarray:
        return self.rng.permutation(self.up.num_units).astype(np.int64)

    def polish(self, ch: np.ndarray, pc: np.ndarray, load: np.ndarray, lim: float,
               deadline: float, passes: int = 50) -> np.ndarray:
        """Exact moves on random induced forests (under a limit: only choices whose usage
        nowhere rises), single-unit sweeps and moves of both ends of the costliest edges,
        until a pass improves by less than a millionth (or ``deadline``); returns the
        profile (recomputed when forest moves may have lowered it)."""
        D, base = self.D, self.up.base
        capped = math.isfinite(lim)
        before = kernels.total_cost(D, ch, pc)
        for _ in range(passes):
            for _ in range(3):
                kernels.forest_dp(D, self.order(), ch, pc, capped)
            if capped:
                load = kernels.profile(D, ch, base)
            kernels.sweep(D, self.order(), ch, pc, load, lim, self.buf)
            ec = kernels.edge_costs_now(D, ch)
            top = np.argsort(-ec)[: max(64, len(ec) // 20)].astype(np.int64)
            kernels.pair_moves(D, top, ch, pc, load, lim, self.buf, self.buf2, 1_000_000)
            now = kernels.total_cost(D, ch, pc)
            if before - now <= 1e-6 * abs(before) or time.monotonic() > deadline:
                break
            before = now
        return load

    def consider(self, ch: np.ndarray, load: np.ndarray, deadline: float = math.inf) -> bool:
        """Polish the feasible ``ch`` and keep it if it beats the incumbent."""
        load = self.polish(ch, self.up.ucost, load, self.lim, deadline)
        c = kernels.total_cost(self.D, ch, self.up.ucost)
        if c < self.best_c:
            self.best, self.best_c = ch.copy(), c
            if self.elite is not None:
                self.elite.offer(ch, c)
            return True
        return False

    def improve_regions(self, until: float) -> None:
        """Exact region moves on the incumbent until ``until`` (it never gets worse and
        stays under the limit)."""
        if regions.region_search(self.D, self.best, self.up.ucost, self.up.base, self.lim,
                                 until, self.rng) > 0:
            self.best_c = kernels.total_cost(self.D, self.best, self.up.ucost)
            if self.elite is not None:
                self.elite.offer(self.best, self.best_c)

    def fit(self, ch: np.ndarray, load: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """A copy of ``ch`` (and its profile) greedily repaired to fit; None if it cannot."""
        cand, cl = ch.copy(), load.copy()
        if cl.max() <= self.lim or kernels.repair(self.D, cand, self.up.ucost, cl, self.lim,
                                                  self.buf, self.buf2, 100_000):
            return cand, cl
        return None

    def tighten(self, rch: np.ndarray, rload: np.ndarray, lam: np.ndarray,
                deadline: float) -> tuple[np.ndarray, np.ndarray] | None:
        """The cheapest plan that fits found on the way from the relaxed plan ``rch`` towards
        the limit by pricing: the greedy repair (``kernels.repair``: one unit at a time, its
        neighbours held) pays dearly for a large overflow (on S, 1.50e9 relaxed repaired to
        1.69e9), so the multipliers are raised only at the steps still over the limit and
        the relaxed moves re-run (forest DP, sweeps: whole regions move together), a few
        times; each plan on the way is repaired greedily and the cheapest kept."""
        D, up = self.D, self.up
        ch, load = rch.copy(), rload
        best, best_c = None, math.inf
        lam2 = lam.copy()
        pos = lam2[lam2 > 0]
        # the bump's scale: the multipliers' own, else cost per unit of usage per step
        if len(pos):
            unit = float(pos.mean())
        else:
            use = float(np.abs(D.m_use).mean()) if len(D.m_use) else 1.0
            cost = float(np.abs(up.ucost).mean()) if len(up.ucost) else 1.0
            unit = cost / max(1.0, use * len(load))
        for r in range(_TIGHTEN_ROUNDS + 1):
            got = self.fit(ch, load)
            if got is not None:
                c = kernels.total_cost(D, got[0], up.ucost)
                if c < best_c:
                    best, best_c = got, c
            over = load - self.lim
            hot = over > 0
            if not hot.any() or r == _TIGHTEN_ROUNDS or time.monotonic() > deadline:
                break
            lam2[hot] = lam2[hot] * _TIGHTEN_FACTOR + unit * over[hot] / max(self.lim, 1.0)
            pc = kernels.priced(D, up.ucost, lam2)
            self.polish(ch, pc, up.base, math.inf, deadline, passes=_TIGHTEN_PASSES)
            load = kernels.profile(D, ch, up.base)
        return best

    def oracle_round(self, rch: np.ndarray, pc: np.ndarray, lam: np.ndarray, wall_s: float,
                     cpu_s: float, deadline: float) -> np.ndarray:
        """The relaxed plan of the WCSP solver for prices ``pc`` (polished), tightened
        and considered as a candidate whatever its priced cost (it starts the repair in
        another basin); returns it instead of the local relaxed plan ``rch`` when its
        priced cost is lower, else ``rch``."""
        D, up = self.D, self.up
        self.oracle_calls += 1
        got = wcsp.solve_priced(D, pc, _PENALTY, wall_s, hint=rch, cpu_s=cpu_s)
        if got is None or len(got) != len(rch):
            return rch
        sizes = np.diff(D.k_off)
        if (got < 0).any() or (got >= sizes).any():
            return rch
        self.polish(got, pc, up.base, math.inf, deadline)
        fit = self.tighten(got, kernels.profile(D, got, up.base), lam, deadline)
        if fit is not None:
            self.consider(*fit, deadline)
        if kernels.total_cost(D, got, pc) < kernels.total_cost(D, rch, pc):
            self.oracle_wins += 1
            return got
        return rch

    def share(self) -> None:
        """Take the ``Elite``'s plan when it is cheaper than the incumbent."""
        got = self.elite.cheaper(self.best_c) if self.elite is not None else None
        if got is not None:
            self.best, self.best_c = got
            self.adopted += 1

    def settled(self, since_gain: int) -> bool:
        """Whether the incumbent is worth handing on: no forbidden pair in it, and no better
        plan in the last ``_SETTLE`` rounds."""
        return self.best_c < _PENALTY and since_gain >= _SETTLE

    def run(self, deadline: float, log: bool = False, settle_until: float = -math.inf) -> None:
        """Lagrangian rounds until ``deadline`` (a ``time.monotonic()`` value), or past it
        until ``settle_until`` while the search has not ``settled``: the caller's window is
        wall time, and on a loaded machine it may hold only a few rounds."""
        up, D = self.up, self.D
        if not math.isfinite(self.lim) or not len(up.base):
            until = max(deadline, settle_until)
            self.polish(self.best, up.ucost, np.zeros(len(up.base)), math.inf, until)
            self.best_c = kernels.total_cost(D, self.best, up.ucost)
            self.improve_regions(deadline)
            return
        since_gain = 0  # rounds since the incumbent last improved (``settled``)
        lam = np.zeros(len(up.base))
        theta, best_rel, stall = _THETA0, -math.inf, 0
        rch = self.best.copy()
        inf = math.inf
        since_best = 0
        span = deadline - time.monotonic()
        oracle_s = min(_ORACLE_MAX_S, max(self.oracle_min_s, _ORACLE_PART * span))
        oracle_until = -math.inf  # the oracle's phase, once the local rounds are stuck
        while True:
            now = time.monotonic()
            if now >= deadline and (now >= settle_until or self.settled(since_gain)):
                break
            # past the deadline, in the settling window: the moves run to its end
            until = deadline if now < deadline else settle_until
            if (self.oracle and self.oracle_calls == 0 and self.rounds >= _ORACLE_AFTER
                    and best_rel >= (1.0 - _STUCK) * self.best_c
                    and deadline - time.monotonic() >= 2 * self.oracle_min_s):
                # the relaxed plans stay at the incumbent (M: within 0.02%; S, where the
                # rounds still move, 12% below): their moves cannot leave its basin. The
                # oracle's rounds start afresh from unpriced costs: the unconstrained
                # optimum's overflow (M: 5.5 times the limit) steps the multipliers towards
                # plans that tighten well (a poorer first plan's, 2 times over, did not)
                oracle_until = time.monotonic() + _ORACLE_SHARE * (deadline - time.monotonic())
                lam = np.zeros(len(up.base))
                rch = self.best.copy()
                theta, best_rel, stall = _THETA0, -math.inf, 0
            if _KICK_AFTER and since_best >= _KICK_AFTER:
                self.improve_regions(min(until, time.monotonic() + _REGION_S))
                self.share()
                rch = self.best.copy()
                lam = lam * self.rng.lognormal(0.0, _KICK_SIGMA, len(lam))
                theta, best_rel, stall, since_best = _THETA0, -math.inf, 0, 0
            pc = kernels.priced(D, up.ucost, lam)
            self.polish(rch, pc, up.base, inf, until)  # the limit relaxed: load unused
            left = min(oracle_until, deadline) - time.monotonic()
            if self.oracle and left >= min(oracle_s, self.oracle_min_s):
                # the first solve (no prices) sets the multipliers' first step: it gets longer
                cpu = oracle_s * (_ORACLE_FIRST if self.oracle_calls == 0 else 1.0)
                rch = self.oracle_round(rch, pc, lam, min(_ORACLE_WALL * cpu, left), cpu,
                                        deadline)
            rload = kernels.profile(D, rch, up.base)
            # the fixed nodes' usage is priced too: sum_t lam_t (base_t - limit)
            off = float(lam @ up.base) - self.lim * float(lam.sum())
            rel = kernels.total_cost(D, rch, pc) + off
            self.bound = max(self.bound, kernels.lower_bound(D, pc) + off)
            # the first round's value is the first best (-inf + anything is nan: no test)
            if not math.isfinite(best_rel) or rel > best_rel + 1e-9 * abs(best_rel):
                best_rel, stall = rel, 0
            else:
                stall += 1
                if stall >= _STALL:
                    theta, stall = max(theta / 2, _THETA_MIN), 0
            g = rload - self.lim
            g = np.where((lam > 0) | (g > 0), g, 0.0)
            norm = float(g @ g)
            gap = self.best_c - rel if math.isfinite(self.best_c) else 0.05 * abs(rel) + 1.0
            if norm > 0:
                lam = np.maximum(0.0, lam + theta * max(gap, 1e-9 * abs(rel)) / norm * g)
            fit = self.tighten(rch, rload, lam, until)
            if fit is not None and self.consider(*fit, until):
                since_best = since_gain = 0
            else:
                since_best += 1
                since_gain += 1
            self.rounds += 1
            if log and self.rounds % 10 == 0:
                print(f"  unit-lagrange round {self.rounds}: relaxed {rel:.6g} "
                      f"best {self.best_c:.6g} theta {theta:g}", flush=True)

    def assignment(self, a0: np.ndarray) -> np.ndarray:
        return self.up.expand(self.best, a0)
