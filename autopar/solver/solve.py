"""``solve``: presolve, then exact CP-SAT on small problems or LNS on large ones."""

from __future__ import annotations

import math
import time
from dataclasses import replace

import numpy as np

from autopar.solver import ilp
from autopar.solver.contract import contract
from autopar.solver.heuristic import run_heuristic
from autopar.solver.problem import Problem, Solution, check_assignment, evaluate
from autopar.solver.reduce import FORBIDDEN, Reduction, presolve

# Above this many model variables (strategies + allowed edge pairs, rigid groups contracted)
# CP-SAT on the whole problem rarely proves anything within a contest timeout, so "auto"
# runs LNS only. Contest instance A contracts to 48k (from 2M), S to 2.8M.
_EXACT_MAX_VARS = 150_000
METHODS = ("auto", "ilp", "heuristic")
# This share of a large problem's search goes to the compiled unit search (``unitsearch.py``:
# Lagrangian rounds under a usage limit, exact forest moves) before the Python moves and the
# CP-SAT LNS polish its plan; a small problem's warm-start hint comes from it too.
UNIT_SHARE = 0.75
# ... but only with at least this long to run: the first call on a machine compiles the
# kernels (about 8-10 s on the loaded 2-core machine, 0.5 s once cached), which the
# planner's calls of a second or two cannot pay for.
UNIT_MIN_S = 20.0
# A small problem's unit search keeps this share of the limit after the greedy start, as
# long as CP-SAT keeps the last UNIT_CPSAT_KEEP of it: see ``solve``. Where the start ends
# that late the machine is loaded, and CP-SAT on it gets little done (A at load 9-12: the
# greedy start ended past half the limit, and CP-SAT did not move its plan)
UNIT_MIN_SHARE, UNIT_CPSAT_KEEP = 0.1, 0.25
# The Python Lagrangian rounds (``lagrange.py``) after it: superseded by the unit search
# (on S, 30 s of it reach 1.73e9 where 240 s of the old path reached 2.05e9), so none.
LAGRANGE_SHARE = 0.0


def _model_size(q: Problem, forbid: float) -> int:
    """Variables of the CP-SAT model of the whole problem, rigid groups contracted."""
    free = np.nonzero(q.index.n_strat > 1)[0]
    pos = {int(i): k for k, i in enumerate(free)}
    inner = [
        (pos[u], pos[v], m) for (u, v), m in zip(q.edges, q.edge_costs) if u in pos and v in pos
    ]
    units = contract([q.costs[i] for i in free], inner, forbid, enabled=forbid < math.inf)
    n = sum(len(c) for c in units.costs)
    return n + sum(int((m < forbid).sum()) for _, _, m in units.edges)


def solve(
    problem: Problem,
    timeout_s: float = 60.0,
    method: str = "auto",
    hint: object | None = None,
    workers: int = 2,
    seed: int = 0,
    log: bool = False,
) -> Solution:
    """Best solution found within ``timeout_s`` seconds (wall clock, presolve included).

    ``method``: "ilp" (CP-SAT on the whole problem), "heuristic" (greedy + LNS) or "auto"
    (heuristic, then CP-SAT warm-started from it when the model is small enough to prove).
    Never raises for an infeasible problem: the status says "infeasible" when that is proven
    and "timeout-no-solution" when time ran out first.
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {', '.join(METHODS)}")
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    h = check_assignment(problem, hint) if hint is not None else None
    if method == "ilp":
        return ilp.solve_ilp(problem, timeout_s, h, workers, seed)
    red, soft = presolve(problem)
    if red.infeasible:
        return Solution((), math.inf, False, "infeasible", time.monotonic() - t0, method)
    q = red.problem
    rh = red.restrict(h) if h is not None else None
    forbid = math.inf if soft else FORBIDDEN
    small = method == "auto" and _model_size(q, forbid) <= _EXACT_MAX_VARS
    # CP-SAT's own portfolio beats our LNS whenever the whole model fits, so a small problem
    # gets only a short heuristic run, for a warm-start hint, before the exact solve; a big
    # one keeps a margin for expanding and scoring the answer.
    unit_min = (0.0, 0.0)
    if small:
        # the unit search's hint is most of what a loaded machine gets: A at load 6, 2.5 s
        # of it gave +2.5%, where CP-SAT then moved it by 0.01%
        lns_deadline = time.monotonic() + min(15.0, 0.15 * timeout_s)
        # ... so it keeps UNIT_MIN_SHARE of the limit after the greedy start, even when that
        # start used the window up (A at load 9-12: the greedy took it all, +61.7% left)
        unit_min = (UNIT_MIN_SHARE * timeout_s, deadline - UNIT_CPSAT_KEEP * timeout_s)
    else:
        lns_deadline = deadline - min(1.0, 0.02 * timeout_s)
    a, optimal, bound = run_heuristic(q, lns_deadline, workers, seed, rh, log=log, forbid=forbid,
                                      lagrange_share=0.0 if small else LAGRANGE_SHARE,
                                      unit_share=UNIT_SHARE if timeout_s >= UNIT_MIN_S else 0.0,
                                      unit_min=unit_min if timeout_s >= UNIT_MIN_S
                                      else (0.0, 0.0))
    best = _finish(problem, red, a, "optimal" if optimal else "feasible", t0, f"{method}/lns")
    if best.feasible and best.status != "optimal" and math.isfinite(bound) and not soft:
        best = replace(best, lower_bound=min(bound, best.cost))
    if small and not optimal and time.monotonic() < deadline - 0.5:
        best = _exact(problem, red, a, best, forbid, deadline, workers, seed, t0)
    if soft and best.status == "optimal":
        best = replace(best, status="feasible")  # forbidden costs were not pruned: nothing proven
    return replace(best, time_s=time.monotonic() - t0)  # the whole call, not when it was found


def _exact(
    problem: Problem,
    red: Reduction,
    a: np.ndarray,
    best: Solution,
    forbid: float,
    deadline: float,
    workers: int,
    seed: int,
    t0: float,
) -> Solution:
    """CP-SAT on the whole presolved problem (rigid groups contracted), warm-started."""
    q = red.problem
    free = np.nonzero(q.index.n_strat > 1)[0]
    try:  # building must leave CP-SAT a second at least, or it is not worth it
        sm = ilp.build(q, free, a, ilp.capacity_profile(q, free, a), forbid=forbid,
                       deadline=deadline - 1.5)
    except ilp.OutOfTime:
        return best
    # a hint that uses a forbidden pair misleads CP-SAT more than no hint at all
    hint = a if best.feasible and best.cost < FORBIDDEN else None
    left = deadline - time.monotonic()
    # CP-SAT stops up to a second past its limit on a loaded machine (0.85 s at 10 s seen)
    left -= 0.3 + min(2.5, 0.08 * left)
    if left <= 0.05:
        return best
    st, sub, bound = ilp.solve_sub(sm, left, workers, seed, hint, whole=True)
    if sub is None:
        return best
    b = a.copy()
    b[free] = sub
    optimal = st == ilp.cp_model.OPTIMAL and bool(np.isfinite(forbid))
    sol = _finish(problem, red, b, "optimal" if optimal else "feasible", t0, "auto/ilp")
    if sol.status == "optimal" and sol.cost >= FORBIDDEN:
        sol = replace(sol, status="feasible")  # proven only among plans without forbidden costs
    if sol.feasible and (sol.cost <= best.cost or not best.feasible):
        if sol.status != "optimal" and bound is not None:
            sol = replace(sol, lower_bound=bound)
        return sol
    return best


def _finish(
    problem: Problem, red: Reduction, a: np.ndarray, status: str, t0: float, method: str
) -> Solution:
    orig = red.expand(a)
    cost, feas, peak = evaluate(problem, orig)
    if not feas:
        status = "timeout-no-solution"
    return Solution(
        tuple(orig.tolist()), cost, feas, status, time.monotonic() - t0, method,
        cost if status == "optimal" else None, peak,
    )  # fmt: skip
