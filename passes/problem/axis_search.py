"""Solving the planner's problem one mesh axis at a time, each step exactly.

A strategy on an N-D mesh is one 1-D rule per mesh axis. Holding the choices on every axis but
one, what is left is a problem with a handful of strategies per node (the op's 1-D rules),
small enough for exact variable elimination (:mod:`autopar.solver.elimination`) however the
graph is wired. Sweeping the axes until no sweep improves reaches a point that no change on a
single axis can better; on a 1-D mesh that single step is the global optimum. Several starts
(all replicated, leanest memory, the best reference layout) are swept and the best kept.
"""

from __future__ import annotations

import time

import numpy as np

from autopar.passes.problem.types import ShardingProblem
from autopar.solver.elimination import cached_order, minimise
from autopar.solver.problem import Problem, Solution, evaluate
from autopar.solver.problem import fits as fits_limit


def _axis_components(sp: ShardingProblem) -> list[np.ndarray]:
    """For each solver variable, an int array [strategies, axes]: which 1-D rule (as an id
    local to that axis) each strategy uses on each mesh axis. A function of the variables'
    strategy lists only, so kept per list (:data:`_COMPONENTS`): a planner solves each
    problem many times (memory fits, repricings, references), and its modes' problems share
    their lists (llama3-405b's shape search spent 21 s of 530 under cProfile making these
    again)."""
    out = []
    for r in sp.var_root:
        strategies = sp.strategies[r]
        hit = _COMPONENTS.get(id(strategies))
        if hit is not None and hit[0] is strategies and hit[1] == sp.mesh.ndim:
            out.append(hit[2])
            continue
        ndim = sp.mesh.ndim
        comp = np.zeros((len(strategies), ndim), dtype=np.int64)
        for k in range(ndim):
            ids: dict = {}
            for s, st in enumerate(strategies):
                key = (tuple(x[k] for x in st.ins), tuple(x[k] for x in st.outs))
                comp[s, k] = ids.setdefault(key, len(ids))
        comp.setflags(write=False)
        if len(_COMPONENTS) >= _MAX_COMPONENTS:
            _COMPONENTS.clear()
        # the list is held with its arrays, so its id is not reused while the entry lives
        _COMPONENTS[id(strategies)] = (strategies, ndim, comp)
        out.append(comp)
    return out


# strategy list id -> (the list, mesh dims, its components); a list is never changed once
# made (sharding_problem.strategy_lists shares one list among the nodes of one op and shape)
_COMPONENTS: dict[int, tuple[list, int, np.ndarray]] = {}
_MAX_COMPONENTS = 1024  # a shape's planning makes a few hundred lists; kept lists hold memory


class _Steps:
    """The single-axis steps of one problem, each solved once.

    A step on axis ``k`` from a point depends on the point only through which strategies
    agree with it on every other axis: ``codes[k][v][s]`` numbers those classes, so a step
    is known by axis and one class per variable. Sweeps revisit steps all the time (the last
    pass of every sweep repeats the steps that found nothing; starts fall into the same
    basins), so each is solved once and remembered. Sub-problems of one axis keep the
    problem's edges, and many share their domain sizes: their elimination orders are kept
    too. Both caches return exactly what solving again would. A step's minimisers at each
    Lagrangian multiplier are kept beyond the sweep (:func:`_hulls_of`): a memory fit solves
    the same problem again at other limits, and its steps ask for the same multipliers."""

    def __init__(self, p: Problem, comps: list[np.ndarray], hulls: dict | None = None) -> None:
        self.p = p
        self.hulls = hulls if hulls is not None else {}
        self.ndim = comps[0].shape[1] if comps else 0
        self.codes: list[list[np.ndarray]] = []
        self.groups: list[list[dict[int, np.ndarray]]] = []
        for k in range(self.ndim):
            codes, groups = [], []
            for comp in comps:
                code, group = _classes(comp, k)
                codes.append(code)
                groups.append(group)
            self.codes.append(codes)
            self.groups.append(groups)
        self.memo: dict[tuple, tuple[np.ndarray | None, bool]] = {}
        self.orders: dict[tuple[int, ...], list[int] | None] = {}
        self.walked: dict[int, float] = {}  # by axis: the multiplier its last walk reached
        self.all_live = all(e > s for s, e in p.intervals)  # at the one instant, if one
        self.declined = 0  # steps too wide to eliminate (or not of the one-instant form)

    def step(self, k: int, cur: np.ndarray, deadline: float) -> tuple[np.ndarray | None, bool]:
        """The best point reachable from ``cur`` by changing axis ``k`` only (None when the
        step finds nothing that fits), and whether it was solved exactly."""
        codes = self.codes[k]
        key = (k, *(int(codes[v][s]) for v, s in enumerate(cur.tolist())))
        got = self.memo.get(key)
        if got is None:
            got = self.memo[key] = self._solve(k, key[1:], deadline, cur)
        return got

    def _solve(self, k: int, key: tuple[int, ...], deadline: float, cur: np.ndarray
               ) -> tuple[np.ndarray | None, bool]:
        p = self.p
        allowed = [g[c] for g, c in zip(self.groups[k], key)]
        dom = [len(a) for a in allowed]
        order = self.orders.get(tuple(dom), ())
        if order == ():
            order = self.orders[tuple(dom)] = _order(p.edges, dom)
        if order is None or (p.usage_limit is not None
                             and len(set(map(tuple, p.intervals))) > 1):
            # too wide, or not the one-instant form elimination handles
            self.declined += 1
            return None, False
        usages = [u[a] for u, a in zip(p.usages, allowed)]
        least = sum(float(u.min()) for u in usages)
        if p.usage_limit is not None and self.all_live and not fits_limit(
                least - 1e-9 * abs(least), p.usage_limit):
            # every node live at the one instant, each at its leanest choice of the step,
            # already overflows the limit: no point of the step fits (what elimination
            # finds after its first table, with the step's program and pruning made first)
            return None, False
        costs = [c[a] for c, a in zip(p.costs, allowed)]
        ecosts = [m.take(allowed[u], 0).take(allowed[v], 1)  # as m[np.ix_(...)], faster
                  for (u, v), m in zip(p.edges, p.edge_costs)]

        def fits(a: np.ndarray) -> bool:
            if p.usage_limit is None:
                return True
            return evaluate(p, [al[s] for al, s in zip(allowed, a.tolist())])[1]

        memo = self.hulls.get((k, key))
        if memo is None:
            if len(self.hulls) > _MAX_HULL_STEPS:
                self.hulls.clear()
            memo = self.hulls[(k, key)] = {}
        # the current point, in the step's own indices: where it fits, the Lagrangian walk
        # starts from it (elimination.minimise)
        walked: list[float] = []
        here = np.array([int(np.searchsorted(al, s)) for al, s in zip(allowed, cur.tolist())])
        a, status = minimise(dom, p.edges, ecosts, costs, usages, p.usage_limit, order, fits,
                             max(0.1, deadline - time.monotonic()), memo,
                             start=here if p.usage_limit is not None else None,
                             guess=self.walked.get(k), walked=walked)
        if walked:
            self.walked[k] = walked[0]
        if a is None:
            return None, False
        return np.array([al[s] for al, s in zip(allowed, a.tolist())]), status == "optimal"


def _classes(comp: np.ndarray, k: int) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """A variable's strategies by the class they fall in on every axis but ``k`` (its
    ``codes``), and each class's strategies. Kept for the components :func:`_axis_components`
    keeps (read-only arrays, one per strategy list): the same for every solve of them."""
    kept = not comp.flags.writeable
    hit = _CLASSES.get((id(comp), k)) if kept else None
    if hit is not None and hit[0] is comp:
        return hit[1], hit[2]
    others = np.delete(comp, k, axis=1)
    _, code = np.unique(others, axis=0, return_inverse=True)
    code = code.reshape(-1)
    group = {int(c): np.nonzero(code == c)[0] for c in np.unique(code)}
    if kept:
        for a in (code, *group.values()):
            a.setflags(write=False)
        if len(_CLASSES) >= 4 * _MAX_COMPONENTS:
            _CLASSES.clear()
        _CLASSES[(id(comp), k)] = (comp, code, group)
    return code, group


# (components' id, axis) -> (the components, codes, classes); the arrays are never written
_CLASSES: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, dict[int, np.ndarray]]] = {}


# sub-problems whose elimination needs a larger table are declined (as solve_by_elimination)
_MAX_ENTRIES = 4e6


def _order(edges: list[tuple[int, int]], dom: list[int]) -> list[int] | None:
    return cached_order(edges, dom, _MAX_ENTRIES)


# the problems whose steps' minimisers are kept, most recent last: (what identifies the problem
# as solved, its steps' minimisers by (axis, classes) and multiplier). The key holds the
# problem's own cost and usage lists (they stay alive, so no other problem takes their ids):
# a problem made again with another limit (planning.solving.with_limit) shares them. Those lists are
# made for one sharding problem (its reduced problem, or a restriction of it), whose
# strategies define the steps: they stand for it, and it is not kept alive
_HULLS: list[tuple[tuple, dict]] = []
# bounds on what is kept: a step keeps an assignment per multiplier tried (a few, each a few
# hundred bytes), and a memory fit solves one problem a few times in a row, so a few problems
# of up to 2000 steps each hold what is asked again (benchmarks/solver.py's decoder LM at 0.7
# and MLP at 0.35 keep at most 71 steps per problem) in tens of MB at most
_MAX_HULL_PROBLEMS = 4
_MAX_HULL_STEPS = 2_000  # a problem's kept steps, cleared past this


def _hulls_of(p: Problem, domains: list[np.ndarray] | None) -> dict:
    """The kept minimisers of ``p``'s steps (the same costs, usages and edges, on its
    strategies restricted to ``domains``), whatever its limit."""
    key = (p.costs, p.usages, p.edges, p.edge_costs, domains)
    for k, hulls in _HULLS:
        if all(a is b for a, b in zip(k, key)):
            return hulls
    hulls: dict = {}
    _HULLS.append((key, hulls))
    if len(_HULLS) > _MAX_HULL_PROBLEMS:
        _HULLS.pop(0)
    return hulls


def _sweep(steps: _Steps, start: np.ndarray, deadline: float) -> tuple[np.ndarray, bool]:
    """A local optimum over single-axis moves, and whether every step was solved exactly."""
    p = steps.p
    exact = True
    cur = start.copy()
    cur_cost, cur_ok, _ = evaluate(p, cur)
    improved = True
    while improved and time.monotonic() < deadline:
        improved = False
        for k in range(steps.ndim):
            cand, step_exact = steps.step(k, cur, deadline)
            exact = exact and step_exact
            if cand is None:
                continue
            cost, ok, _ = evaluate(p, cand)
            if (ok and not cur_ok) or (ok == cur_ok and cost < cur_cost * (1 - 1e-12)):
                cur, cur_cost, cur_ok, improved = cand, cost, ok, True
    return cur, exact


def solve_axiswise(
    sp: ShardingProblem, p: Problem, timeout_s: float, hints: list | None = None,
    restarts: int = 16, seed: int = 0, domains: list[np.ndarray] | None = None,
    replicated: bool = True,
) -> Solution | None:
    """Best of the axis sweeps from each start, or None when a step is too wide to eliminate.

    ``p`` is ``sp.problem`` or a restriction of it; ``domains[v]`` then lists which of the
    variable's original strategies ``p`` keeps, in order. ``replicated``: the all-replicated
    point (every variable at its first strategy) is a start too."""
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    comps = _axis_components(sp)
    if domains is not None:
        comps = [c[d] for c, d in zip(comps, domains)]
    starts = [np.zeros(p.num_nodes, dtype=np.int64)] if replicated else []
    if p.usage_limit is not None:
        starts.append(np.array([int(np.argmin(u)) for u in p.usages]))
    starts += [np.asarray(h, dtype=np.int64) for h in hints or []]
    # random starts: single-axis moves cannot leave some basins, other starts find others
    rng = np.random.default_rng(seed)
    starts += [np.array([int(rng.integers(len(c))) for c in p.costs]) for _ in range(restarts)]
    steps = _Steps(p, comps, _hulls_of(p, domains))
    best, best_key, best_exact = None, None, False
    for start in starts:
        if time.monotonic() > deadline:
            break
        a, exact = _sweep(steps, start, deadline)
        cost, ok, _ = evaluate(p, a)
        key = (not ok, cost)
        if best_key is None or key < best_key:
            best, best_key, best_exact = a, key, exact
    if best is None:
        return None
    cost, ok, peak = evaluate(p, best)
    # on a 1-D mesh one step spans every strategy: an exact step is the global optimum
    status = "optimal" if sp.mesh.ndim == 1 and best_exact else "feasible"
    method = SWEEP if best_exact else SWEEP_DECLINED if steps.declined else SWEEP_INEXACT
    return Solution(tuple(int(x) for x in best), cost, ok, status if ok else "timeout-no-solution",
                    time.monotonic() - t0, method, None, peak)


SWEEP = "axis-sweep"
# some step of the best sweep was not solved exactly: too wide to eliminate (it was skipped),
# or a memory limit made it a Lagrangian step
SWEEP_INEXACT = "axis-sweep (inexact steps)"
# some step was too wide to eliminate and was skipped: the sweep may have moved little or not
# at all (moe-tiny on 2 x 2: every step), and only the general solver searches
SWEEP_DECLINED = "axis-sweep (steps too wide skipped)"


def sweep_was_exact(sol: Solution) -> bool:
    """Whether every step of the sweep that gave ``sol`` was solved exactly."""
    return sol.method == SWEEP


def sweep_declined_steps(sol: Solution) -> bool:
    """Whether some step of the sweeps that gave ``sol`` was too wide to solve."""
    return sol.method == SWEEP_DECLINED
