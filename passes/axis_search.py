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

from autopar.passes.sharding_problem import ShardingProblem
from autopar.solver.elimination import solve_by_elimination
from autopar.solver.problem import Problem, Solution, evaluate


def _axis_components(sp: ShardingProblem) -> list[np.ndarray]:
    """For each solver variable, an int array [strategies, axes]: which 1-D rule (as an id
    local to that axis) each strategy uses on each mesh axis."""
    out = []
    for r in sp.var_root:
        strategies = sp.strategies[r]
        ndim = sp.mesh.ndim
        comp = np.zeros((len(strategies), ndim), dtype=np.int64)
        for k in range(ndim):
            ids: dict = {}
            for s, st in enumerate(strategies):
                key = (tuple(x[k] for x in st.ins), tuple(x[k] for x in st.outs))
                comp[s, k] = ids.setdefault(key, len(ids))
        out.append(comp)
    return out


def _restricted(p: Problem, allowed: list[np.ndarray]) -> Problem:
    return Problem(
        [c[a] for c, a in zip(p.costs, allowed)],
        [u[a] for u, a in zip(p.usages, allowed)],
        p.intervals, p.edges,
        [m[np.ix_(allowed[u], allowed[v])] for (u, v), m in zip(p.edges, p.edge_costs)],
        p.usage_limit, p.names, p.name,
    )


def _sweep(
    p: Problem, comps: list[np.ndarray], start: np.ndarray, deadline: float
) -> tuple[np.ndarray, bool]:
    """A local optimum over single-axis moves, and whether every step was solved exactly."""
    exact = True
    cur = start.copy()
    cur_cost, cur_ok, _ = evaluate(p, cur)
    ndim = comps[0].shape[1] if comps else 0
    improved = True
    while improved and time.monotonic() < deadline:
        improved = False
        for k in range(ndim):
            allowed = []
            for v, comp in enumerate(comps):
                others = np.delete(comp, k, axis=1)
                mask = (others == others[cur[v]]).all(axis=1)
                allowed.append(np.nonzero(mask)[0])
            sub = _restricted(p, allowed)
            sol = solve_by_elimination(sub, timeout_s=max(0.1, deadline - time.monotonic()))
            exact = exact and sol is not None and sol.status == "optimal"
            if sol is None or not sol.feasible:
                continue
            cand = np.array([allowed[v][s] for v, s in enumerate(sol.assignment)])
            cost, ok, _ = evaluate(p, cand)
            if (ok and not cur_ok) or (ok == cur_ok and cost < cur_cost * (1 - 1e-12)):
                cur, cur_cost, cur_ok, improved = cand, cost, ok, True
    return cur, exact


def solve_axiswise(
    sp: ShardingProblem, p: Problem, timeout_s: float, hints: list | None = None,
    restarts: int = 16, seed: int = 0, domains: list[np.ndarray] | None = None,
) -> Solution | None:
    """Best of the axis sweeps from each start, or None when a step is too wide to eliminate.

    ``p`` is ``sp.problem`` or a restriction of it; ``domains[v]`` then lists which of the
    variable's original strategies ``p`` keeps, in order."""
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    comps = _axis_components(sp)
    if domains is not None:
        comps = [c[d] for c, d in zip(comps, domains)]
    starts = [np.zeros(p.num_nodes, dtype=np.int64)]
    if p.usage_limit is not None:
        starts.append(np.array([int(np.argmin(u)) for u in p.usages]))
    starts += [np.asarray(h, dtype=np.int64) for h in hints or []]
    # random starts: single-axis moves cannot leave some basins, other starts find others
    rng = np.random.default_rng(seed)
    starts += [np.array([int(rng.integers(len(c))) for c in p.costs]) for _ in range(restarts)]
    best, best_key, best_exact = None, None, False
    for start in starts:
        if time.monotonic() > deadline:
            break
        a, exact = _sweep(p, comps, start, deadline)
        cost, ok, _ = evaluate(p, a)
        key = (not ok, cost)
        if best_key is None or key < best_key:
            best, best_key, best_exact = a, key, exact
    if best is None:
        return None
    cost, ok, peak = evaluate(p, best)
    # on a 1-D mesh one step spans every strategy: an exact step is the global optimum
    status = "optimal" if sp.mesh.ndim == 1 and best_exact else "feasible"
    return Solution(tuple(int(x) for x in best), cost, ok, status if ok else "timeout-no-solution",
                    time.monotonic() - t0, "axis-sweep", None, peak)
