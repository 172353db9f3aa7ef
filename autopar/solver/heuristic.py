"""Fast solver for large instances: memory-safe greedy, then a loop of exact moves on ever
larger neighbourhoods, with CP-SAT large-neighbourhood search (LNS) when they stall.

Works on a presolved problem (``reduce.py``). Given a share of the time (``unit_share``),
the compiled unit search (``unitsearch.py``) runs first from the greedy plan; the moves
below then polish what it found. Moves, cheapest first:

- single-node sweeps (``LocalSearch.sweep``), with incremental numpy cost vectors;
- rigid-group moves (``groups.py``): whole groups of nodes bound by bijective edges;
- tree moves (``treedp.py``): (min, +) dynamic programming over induced trees of up to
  20,000 nodes, e.g. a hub and all its leaf operands;
- CP-SAT on neighbourhoods (``LocalSearch.lns_step``) of three kinds, seeded at the
  currently most expensive edges: breadth-first in the graph (whole groups at a time), a
  window of consecutive node ids (program order), and nodes live at the seed's tightest
  moment that could give memory back. Sizes grow while CP-SAT proves them optimal.

The incumbent is feasible at every step: the greedy starts from every node at its smallest
usage (which fits iff the problem is feasible at all) and only takes a strategy whose extra
usage fits under the limit over the node's whole live interval; every other move checks the
usage profile (or carries it into the CP-SAT memory rows) and is undone if it would overflow.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np

from autopar.solver import ilp, lagrange, unitsearch
from autopar.solver.groups import Groups, group_pass
from autopar.solver.problem import Problem, evaluate, fits, usage_profile
from autopar.solver.treedp import TREE_SIZE, tree_move

# Inside the heuristic, forbidden costs (1e18 in the contest files) are lowered to this so
# sums keep the precision of the ordinary costs; it still outweighs any real plan.
_PENALTY = 1e15
_UNIT_MIN_RUN_S = 2.0  # the unit search is not started with less than this left
_GROUP_CAP = 3_000  # a neighbourhood may exceed its size by this much to take a whole group
_MIN_LNS_SIZE = 20  # neighbourhoods shrink to no fewer free nodes than this
# Seconds to build one variable of an LNS step's CP-SAT model (``ilp.build``, in Python): a
# first guess, then what this process's builds took (``_learn_build_rate``). Measured on the
# 2-core machine: 0.9-2.7e-5 under load (models of 8-70 thousand variables).
_build_s_per_var = 1.5e-5
# CP-SAT seconds per model variable that were not enough for an LNS step to return any
# solution at all, not even its complete hint (status UNKNOWN): the most generous such share
# this process has seen (0: none yet). A step offered no more per variable would end so too:
# moe-tiny's planner polishes spent 0.5-0.9 s on each such step (20-33 nodes, tens of
# thousands of variables) and every one returned nothing, a third of the case's time. Kept
# across planning calls: started afresh in each, moe-tiny at 0.35 of its peak planned after
# it at 0.5 took 11.4-11.8 s where it took 7.3-8.2 s (the rate learnt there carried over)
_futile_s_per_var = 0.0
FUTILE_MARGIN = 2.0  # a step is tried only with this many times that share per variable


def _capped(q: Problem, forbid: float) -> Problem:
    def cap(a: np.ndarray) -> np.ndarray:
        return np.where(a >= forbid, _PENALTY, a) if (a >= forbid).any() else a

    return Problem(
        [cap(c) for c in q.costs], q.usages, q.intervals, q.edges,
        [cap(m) for m in q.edge_costs], q.usage_limit, q.names, q.name,
    )  # fmt: skip


class LocalSearch:
    """Incumbent assignment with its usage profile, and moves that keep it feasible."""

    def __init__(self, q: Problem, seed: int = 0, forbid: float = ilp.FORBIDDEN) -> None:
        if forbid < math.inf:
            q, forbid = _capped(q, forbid), _PENALTY
        self.q = q
        self.forbid = forbid
        self.rng = np.random.default_rng(seed)
        n = q.num_nodes
        self.inc: list[list[tuple[int, int]]] = [[] for _ in range(n)]
        for e, (u, v) in enumerate(q.edges):
            self.inc[u].append((e, 0))
            self.inc[v].append((e, 1))
        self.nbrs = [[q.edges[e][1 - side] for e, side in lst] for lst in self.inc]
        idx = q.index
        self.st, self.en = idx.start, idx.end
        self.live = self.en > self.st
        self.limit = q.usage_limit
        self.tol = 0.0 if self.limit is None else 1e-12 * max(1.0, abs(self.limit))
        self.a = np.array([int(np.lexsort((c, u))[0]) for c, u in zip(q.costs, q.usages)])
        self.min_usage = np.array([u.min() for u in q.usages])
        self.kinds = ["bfs", "bfs", "memory", "window"]
        self.groups: Groups | None = None
        self.load = usage_profile(q, self.a)

    def fits(self) -> bool:
        return self.limit is None or fits(float(self.load.max(initial=0.0)), self.limit)

    def cost(self) -> float:
        return evaluate(self.q, self.a)[0]

    def local(self, i: int, assigned: np.ndarray | None = None) -> np.ndarray:
        """Cost of each strategy of node i given its neighbours' current strategies."""
        q, a = self.q, self.a
        c = q.costs[i].copy()
        for e, side in self.inc[i]:
            m = q.edge_costs[e]
            if side == 0:
                j = q.edges[e][1]
                if assigned is None or assigned[j]:
                    c += m[:, a[j]]
            else:
                j = q.edges[e][0]
                if assigned is None or assigned[j]:
                    c += m[a[j], :]
        return c

    def allowed(self, i: int) -> np.ndarray:
        u = self.q.usages[i]
        if self.limit is None or not self.live[i]:
            return np.ones(len(u), dtype=bool)
        head = self.limit - float(self.load[self.st[i] : self.en[i]].max())
        return u - u[self.a[i]] <= head + self.tol

    def set(self, i: int, s: int) -> None:
        old = self.a[i]
        if old == s:
            return
        if self.live[i]:
            d = self.q.usages[i][s] - self.q.usages[i][old]
            if d:
                self.load[self.st[i] : self.en[i]] += d
        self.a[i] = s

    def greedy(self) -> None:
        """Assign in index order (which follows the program), each node
        taking its cheapest strategy that fits in memory, prefers allowed pairs with assigned
        neighbours, and leaves every unassigned neighbour an allowed strategy (forward
        checking: forbidden pairs make a myopic greedy paint itself into corners)."""
        q, n, f = self.q, self.q.num_nodes, self.forbid
        assigned = np.zeros(n, dtype=bool)
        dom = [np.ones(k, dtype=bool) for k in q.index.n_strat.tolist()]
        for i in range(n):
            c = self.local(i, assigned)
            c[~self.allowed(i)] = np.inf
            look = dom[i].copy()
            for e, side in self.inc[i]:
                j = q.edges[e][1 - side]
                if not assigned[j]:
                    ok = q.edge_costs[e] < f
                    ok = ok if side == 0 else ok.T
                    look &= (ok & dom[j][None, :]).any(1)
            pen = np.where(look, 0.0, f)
            s = int(np.argmin(c + pen))
            self.set(i, s)
            assigned[i] = True
            for e, side in self.inc[i]:
                j = q.edges[e][1 - side]
                if not assigned[j]:
                    row = q.edge_costs[e][s, :] if side == 0 else q.edge_costs[e][:, s]
                    nd = dom[j] & (row < f)
                    if nd.any():
                        dom[j] = nd

    def sweep(self, deadline: float | None = None) -> int:
        """One pass of best single-node moves, in random order, stopping at ``deadline``;
        returns how many changed."""
        moved = 0
        n = self.q.num_nodes
        for k, i in enumerate(self.rng.permutation(n).tolist()):
            if len(self.q.costs[i]) == 1:
                continue
            if deadline is not None and k % 256 == 0 and time.monotonic() > deadline:
                break
            c = self.local(i)
            c[~self.allowed(i)] = np.inf
            s = int(np.argmin(c))
            now = c[self.a[i]]
            # from a forbidden choice (inf) any allowed one is a move (inf - inf is nan)
            if c[s] < (now - 1e-9 * max(1.0, abs(now)) if np.isfinite(now) else now):
                self.set(i, s)
                moved += 1
        return moved

    def neighbourhood(self, size: int) -> np.ndarray:
        """A connected set of about ``size`` free nodes grown breadth-first from a costly
        seed; a node brings its whole rigid group (``groups.py``), which alone can move."""
        q = self.q
        free = self.free_nodes
        if size >= len(free):
            return free
        seed = self.pick_seed()
        seen: set[int] = set()
        frontier: list[int] = []

        def add(j: int) -> None:
            g = self.groups.group_of[j] if self.groups is not None else -1
            new = [j] if g < 0 else self.groups.members[g].tolist()
            if g >= 0 and len(seen) + len(new) > max(size, _GROUP_CAP):
                new = [j]
            for x in new:
                if x not in seen:
                    seen.add(x)
                    frontier.append(x)

        add(seed)
        while frontier and len(seen) < size:
            cur, frontier = frontier, []
            for i in cur:
                nb = self.nbrs[i]
                for j in self.rng.permutation(len(nb)).tolist() if len(nb) > 8 else range(len(nb)):
                    j = nb[j]
                    if j not in seen and len(q.costs[j]) > 1:
                        add(j)
                        if len(seen) >= size:
                            break
                if len(seen) >= size:
                    break
        return np.array(sorted(seen), dtype=np.int64)

    def memory_neighbourhood(self, size: int) -> np.ndarray:
        """A costly seed's graph neighbourhood plus nodes live at its tightest moment that
        could give memory back: a resharding forced by a full timeline is only fixed by
        shrinking nodes that share the time, which are rarely near it in the graph."""
        near = self.neighbourhood(max(1, size // 3))
        if self.limit is None or not len(near):
            return near
        lo, hi = int(self.st[near].min()), int(self.en[near].max())
        span = self.load[lo:hi]  # empty where the intervals hold no time step of the profile
        if not len(span):
            return near
        t = lo + int(np.argmax(span))
        idx = self.q.index
        cur = idx.usage_flat[idx.node_off + self.a]
        slack = cur - self.min_usage
        cand = np.nonzero((self.st <= t) & (self.en > t) & (slack > 0) & (idx.n_strat > 1))[0]
        cand = np.setdiff1d(cand, near)
        want = size - len(near)
        if want <= 0:
            return near
        if len(cand) > want:
            p = slack[cand] / slack[cand].sum()
            cand = self.rng.choice(cand, size=want, replace=False, p=p)
        return np.union1d(near, cand)

    def window(self, size: int) -> np.ndarray:
        """``size`` consecutive free nodes around a costly seed: node ids follow program
        order, so a window holds whole layers, including chains a BFS cuts through."""
        free = self.free_nodes
        k = int(np.searchsorted(free, self.pick_seed()))
        lo = max(0, min(k - size // 2, len(free) - size))
        return free[lo : lo + size]

    def pick_seed(self) -> int:
        """A free node, most often an endpoint of an edge drawn in proportion to its current
        cost: on the contest instances nearly all of the cost is resharding on a few hundred
        edges, and neighbourhoods elsewhere are already optimal."""
        if self.rng.random() < 0.7:
            e = self.pick_edge()
            if e is not None:
                return e[int(self.rng.random() < 0.5)]
        free = self.free_nodes
        return int(free[self.rng.integers(len(free))])

    def pick_edge(self) -> tuple[int, int] | None:
        """An edge drawn in proportion to its current cost (None if all cost nothing)."""
        idx = self.q.index
        if not len(idx.edge_u):
            return None
        ec = idx.edge_flat[idx.edge_off + self.a[idx.edge_u] * idx.edge_nv + self.a[idx.edge_v]]
        ec = np.maximum(ec, 0.0)
        tot = ec.sum()
        if not tot > 0:
            return None
        e = int(self.rng.choice(len(ec), p=ec / tot))
        return int(idx.edge_u[e]), int(idx.edge_v[e])

    @property
    def free_nodes(self) -> np.ndarray:
        if not hasattr(self, "_free"):
            self._free = np.nonzero(self.q.index.n_strat > 1)[0]
        return self._free

    def model_vars(self, free: np.ndarray, lex: bool = False) -> int:
        """Variables of the CP-SAT model of neighbourhood ``free`` (rigid groups not
        contracted, so at most): a choice per strategy, a pair per allowed pair of an edge
        inside it (with ``lex``, as ``ilp.build`` takes it, every pair)."""
        idx = self.q.index
        if not hasattr(self, "_edge_pairs"):
            ok = (idx.edge_flat < self.forbid).astype(np.int64)
            # every edge has a pair at least (a node has a strategy), so no slice is empty
            self._edge_pairs = (np.add.reduceat(ok, idx.edge_off) if len(idx.edge_u)
                                else np.zeros(0, np.int64))
        inside = np.zeros(self.q.num_nodes, dtype=bool)
        inside[free] = True
        inner = inside[idx.edge_u] & inside[idx.edge_v]
        pairs = idx.edge_nv * idx.n_strat[idx.edge_u] if lex else self._edge_pairs
        return int(idx.n_strat[free].sum() + pairs[inner].sum())

    def lns_step(
        self, size: int, time_limit: float, workers: int, seed: int
    ) -> tuple[bool, bool, int]:
        """Re-optimise one neighbourhood; returns (improved, solved to optimality, its size).

        A neighbourhood whose model would take longer to build than ``time_limit`` (CP-SAT's
        time on it) is not built: the step returns its size as a negative number, the
        size that would fit, so that the caller shrinks to it (a step that spends its time
        building leaves CP-SAT none: moe-tiny's 60-node neighbourhoods, 50-70 thousand
        variables, took 1-2.6 s to build and ended with no answer, the solve past its limit).
        """
        q = self.q
        kind = self.kinds[int(self.rng.integers(len(self.kinds)))]
        if kind == "memory" and self.limit is not None:
            free = self.memory_neighbourhood(size)
        elif kind == "window":
            free = self.window(size)
        else:
            free = self.neighbourhood(size)
        if len(free) == 0:
            return False, True, 0
        before = self.cost()
        lex = before >= self.forbid
        n_vars = self.model_vars(free, lex)
        # the model must be built in time, and CP-SAT offered FUTILE_MARGIN times what a step
        # that returned nothing was per variable (building first: its seconds are not CP-SAT's)
        need = n_vars * max(_build_s_per_var, FUTILE_MARGIN * _futile_s_per_var)
        if need > time_limit:
            fit = int(len(free) * time_limit / need)
            return False, False, -max(1, min(fit, len(free) - 1))
        cap = ilp.capacity_profile(q, free, self.a)
        t0 = time.monotonic()
        sm = ilp.build(q, free, self.a, cap, edges_of=self.inc, forbid=self.forbid, lex=lex)
        _learn_build_rate(time.monotonic() - t0, n_vars)
        st, sub, _ = ilp.solve_sub(sm, time_limit, workers, seed, self.a)
        _learn_futile_rate(time_limit, n_vars, sub is None and st == ilp.cp_model.UNKNOWN)
        if sub is None:
            return False, False, len(free)
        old = self.a[free].copy()
        for k, i in enumerate(free.tolist()):
            self.set(i, int(sub[k]))
        after = self.cost()
        if not self.fits() or after > before:
            for k, i in enumerate(free.tolist()):
                self.set(i, int(old[k]))
            return False, st == ilp.cp_model.OPTIMAL, len(free)
        return after < before, st == ilp.cp_model.OPTIMAL, len(free)


def _learn_build_rate(seconds: float, n_vars: int) -> None:
    """Move the build rate a step towards what one build took (models under a thousand
    variables are mostly fixed cost, and say little about the rate)."""
    global _build_s_per_var
    if n_vars >= 1000:
        _build_s_per_var += 0.5 * (seconds / n_vars - _build_s_per_var)


def _learn_futile_rate(seconds: float, n_vars: int, nothing: bool) -> None:
    """``seconds`` of CP-SAT on a model of ``n_vars`` variables returned ``nothing`` (not even
    the hint), or a solution: the futile share rises to the first's, and stays below the
    second's (a loaded moment's failure does not shut out what later got done)."""
    global _futile_s_per_var
    share = seconds / max(1, n_vars)
    _futile_s_per_var = (max(_futile_s_per_var, share) if nothing
                         else min(_futile_s_per_var, share / FUTILE_MARGIN))


def learned_rates() -> tuple[float, float]:
    """What this process has learnt of CP-SAT's steps (the build rate, the futile share), for
    a process that forked this one to take back (:func:`adopt_rates`)."""
    return _build_s_per_var, _futile_s_per_var


def adopt_rates(rates: tuple[float, float]) -> None:
    """Take what a forked worker learnt (:func:`learned_rates`): its build rate, measured
    later, and the more generous futile share of the two (each worker learns it anew
    otherwise, each at the price of one step that returns nothing)."""
    global _build_s_per_var, _futile_s_per_var
    _build_s_per_var = rates[0]
    _futile_s_per_var = max(_futile_s_per_var, rates[1])


def _unit_search(ls: LocalSearch, until: float, seed: int, workers: int, log: bool,
                 settle_until: float = -math.inf) -> float:
    """Run ``unitsearch`` from ``ls``'s plan until ``until`` (and past it until
    ``settle_until`` while a search has not settled: ``Search.run``); ``ls`` takes its plan
    when that fits and costs less. Returns the Lagrangian lower bound on ``ls.q`` (or -inf)."""
    up = unitsearch.UnitProblem(ls.q, ls.forbid)
    elite = unitsearch.Elite()

    def one(k: int) -> unitsearch.Search:
        s = unitsearch.Search(up, ls.a, seed + k, max(until, settle_until), oracle=k == 0,
                              elite=elite)
        s.run(until, log=log and k == 0, settle_until=settle_until)
        return s

    n = max(1, min(workers, 2))
    if n > 1:
        # the kernels release the GIL, so searches from different seeds run on two cores
        with ThreadPoolExecutor(n) as pool:
            searches = list(pool.map(one, range(n)))
    else:
        searches = [one(0)]
    search = min(searches, key=lambda s: s.best_c)
    search.bound = max(s.bound for s in searches)
    a = search.assignment(ls.a)
    cost, ok, _ = evaluate(ls.q, a)
    if ok and (cost < ls.cost() or not ls.fits()):
        ls.a, ls.load = a, usage_profile(ls.q, a)
    if not math.isfinite(search.bound) or not ok:
        return -math.inf
    # the unit objective leaves out what no choice changes (fixed nodes and their edges)
    return search.bound + (cost - search.best_c) if cost < ls.forbid else -math.inf


class HeuristicResult(NamedTuple):
    assignment: np.ndarray
    optimal: bool  # only when one neighbourhood spanned every free node
    lower_bound: float  # -inf where none was proven


def run_heuristic(
    q: Problem,
    deadline: float,
    workers: int = 2,
    seed: int = 0,
    hint: np.ndarray | None = None,
    log: bool = False,
    forbid: float = ilp.FORBIDDEN,
    lagrange_share: float = 0.0,
    unit_share: float = 0.0,
    unit_min: tuple[float, float] = (0.0, 0.0),
) -> HeuristicResult:
    """Best assignment of ``q`` found by ``deadline`` (a ``time.monotonic()`` value).

    ``unit_share`` of the time left after the greedy start goes to the compiled unit search
    (``unitsearch.py``: Lagrangian rounds under a usage limit); under a limit
    ``lagrange_share`` of what is left then goes to the Python Lagrangian rounds
    (``lagrange.py``) before the feasible local search and LNS. ``unit_min`` =
    (seconds, until): the unit search runs that many seconds after the greedy start at least,
    even past ``deadline`` but not past ``until``: a loaded machine can spend a short window
    on the greedy start alone, and the caller knows how much later it can afford; and it goes
    on (to ``until`` at the latest) while its plan still improves or pays a forbidden pair
    (``unitsearch.Search.run``), so what it hands on does not depend on the CPU it got."""
    ls = LocalSearch(q, seed, forbid)
    if hint is not None:
        h = np.asarray(hint, dtype=np.int64)
        load = usage_profile(q, h)
        if fits(float(load.max(initial=0.0)), q.usage_limit):
            ls.a, ls.load = h.copy(), load
        else:
            hint = None
    if hint is None:
        ls.greedy()
    size, it, tree_fails, tree_its, pair_fails = 60, 0, 0, 0, 0
    whole = len(ls.free_nodes) <= size
    bound = -math.inf
    now = time.monotonic()
    until = max(now + unit_share * max(0.0, deadline - now),
                min(now + unit_min[0], unit_min[1]))
    # building the units and the first polish take a second or two of their own: a search
    # with less than that left would only overrun its deadline
    settle_until = unit_min[1] if unit_min[0] > 0 else -math.inf
    if unit_share > 0 and not whole and max(until, settle_until) - now >= _UNIT_MIN_RUN_S:
        # the compiled search over rigid units (Lagrangian rounds under a limit, exact
        # forest moves either way) first; the Python moves and CP-SAT LNS polish after it
        bound = _unit_search(ls, until, seed, workers, log, settle_until)
    for _ in range(3):
        if time.monotonic() > deadline or ls.sweep(deadline) == 0:
            break
    if not whole and time.monotonic() < deadline:
        ls.groups = Groups(ls)
        group_pass(ls, deadline)
    if ls.limit is not None and lagrange_share > 0 and not whole:
        until = time.monotonic() + lagrange_share * max(0.0, deadline - time.monotonic())
        bound = max(bound, lagrange.search(ls, until, log=log))
    while len(ls.free_nodes) and time.monotonic() < deadline - 0.5:
        if not whole and tree_fails < 25:
            # cheap exact moves on big induced trees first; they stall after a while
            gain = tree_move(ls, ls.pick_seed(), TREE_SIZE, safe=tree_its % 2 == 0)
            tree_its += 1
            tree_fails = 0 if gain > 0 else tree_fails + 1
            if tree_its % 25 == 0:
                ls.sweep()
            continue
        if not whole and ls.groups is not None and pair_fails < 60:
            # both ends of an expensive edge, each with its whole group, re-chosen jointly
            e = ls.pick_edge()
            gain = ls.groups.move_units(ls, list(e)) if e is not None else 0.0
            pair_fails = 0 if gain > 0 else pair_fails + 1
            continue
        left = deadline - time.monotonic()
        if left < 1.5:
            break  # building a model takes time too; a late step would overrun the deadline
        tl = min(3.0, left - 1.0)
        improved, optimal, got = ls.lns_step(size, tl, workers, seed + it)
        if got < 0:  # its model would not be built in time: a smaller one, or none
            if size <= _MIN_LNS_SIZE:
                break
            size = max(_MIN_LNS_SIZE, min(size - 1, -got))
            continue
        it += 1
        if improved:
            tree_fails = max(0, tree_fails - 5)  # a changed region may admit tree moves again
            pair_fails = max(0, pair_fails - 10)
            if it % 10 == 0:
                group_pass(ls, deadline)
        if optimal and got == len(ls.free_nodes):
            return HeuristicResult(ls.a.copy(), True, -math.inf)  # the whole problem
        # grow neighbourhoods while CP-SAT proves them quickly, shrink when it cannot
        size = min(2000, int(size * 1.1) + 1) if optimal else max(_MIN_LNS_SIZE, int(size * 0.8))
        if log and it % 10 == 0:
            print(f"  lns it={it} size={size} trees={tree_its} cost={ls.cost():.6g}", flush=True)
    return HeuristicResult(ls.a.copy(), len(ls.free_nodes) == 0, bound)
