"""``solve``: presolve, then exact CP-SAT on small problems or LNS on large ones."""

from __future__ import annotations

import math
import time

import numpy as np

from autopar.solver import ilp
from autopar.solver.heuristic import run_heuristic
from autopar.solver.problem import Problem, Solution, check_assignment, evaluate
from autopar.solver.reduce import FORBIDDEN, Reduction, reduce_problem

# Above this many model variables (strategies + allowed edge pairs) CP-SAT on the whole
# problem rarely proves anything within a contest timeout, so "auto" runs LNS only.
_EXACT_MAX_VARS = 150_000
METHODS = ("auto", "ilp", "heuristic")


def _model_size(q: Problem) -> int:
    n = int(q.index.n_strat.sum())
    return n + sum(int((m < FORBIDDEN).sum()) for m in q.edge_costs)


def _presolve(problem: Problem) -> tuple[Reduction, bool]:
    red = reduce_problem(problem, hard_forbid=True)
    if red is not None:
        return red, False
    return reduce_problem(problem, hard_forbid=False), True


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
    red, soft = _presolve(problem)
    if red.infeasible:
        return Solution((), math.inf, False, "infeasible", time.monotonic() - t0, method)
    q = red.problem
    rh = red.restrict(h) if h is not None else None
    small = method == "auto" and _model_size(q) <= _EXACT_MAX_VARS
    forbid = math.inf if soft else FORBIDDEN
    # CP-SAT's own portfolio beats our LNS whenever the whole model fits, so a small problem
    # gets only a short heuristic run, for a warm-start hint, before the exact solve; a big
    # one keeps a margin for expanding and scoring the answer.
    if small:
        lns_deadline = time.monotonic() + min(10.0, 0.1 * timeout_s)
    else:
        lns_deadline = deadline - min(1.0, 0.02 * timeout_s)
    a, optimal = run_heuristic(q, lns_deadline, workers, seed, rh, log=log, forbid=forbid)
    best = _finish(problem, red, a, "optimal" if optimal else "feasible", t0, f"{method}/lns")
    if small and not optimal and time.monotonic() < deadline - 0.5:
        # a hint that uses a forbidden pair misleads CP-SAT more than no hint at all
        h2 = best.assignment if best.cost < FORBIDDEN else None
        sub = ilp.solve_ilp(problem, deadline - time.monotonic() - 0.3, h2, workers, seed)
        if sub.assignment and sub.feasible and (sub.cost <= best.cost or not best.feasible):
            best = Solution(
                sub.assignment, sub.cost, True, sub.status, time.monotonic() - t0,
                "auto/ilp", sub.lower_bound, sub.peak_usage,
            )  # fmt: skip
    if soft and best.status == "optimal":
        best = _relabel(best, "feasible")  # forbidden costs were not pruned: nothing proven
    return best


def _relabel(s: Solution, status: str) -> Solution:
    return Solution(
        s.assignment, s.cost, s.feasible, status, s.time_s, s.method, s.lower_bound, s.peak_usage
    )


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
