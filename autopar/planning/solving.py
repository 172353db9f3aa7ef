"""How the planner solves one mode's problem: the axis sweeps from several starts and a
short polish (:func:`planner_solve`), and under a memory limit the memory fit's rounds
(:func:`solve_within_budget`: the reduced problem constrains one instant; the whole step's
peak is checked and the instant or the limit moved until the plan fits)."""

from __future__ import annotations

import math
import time
from dataclasses import replace

import numpy as np

from autopar.ir.deadline import Deadline
from autopar.ir.options import fits_budget
from autopar.passes.problem.axis_search import (
    solve_axiswise,
    sweep_declined_steps,
    sweep_was_exact,
)
from autopar.passes.problem.reduction import reduced_problem
from autopar.passes.problem.step_memory import step_peak
from autopar.passes.problem.types import ShardingProblem
from autopar.planning import solve_memo
from autopar.solver import Problem, Solution, evaluate, solve
from autopar.solver.problem import cannot_fit

# seconds the general solver gets to improve on the axis sweeps (it rarely does, so it is short)
POLISH_S = 2.0

# the local moves' budget in a reference completion's polish (they stop sooner when done)
LOCAL_POLISH_S = 0.5

# random starts of the sweeps that solve again from a plan (a memory fit's retry, a repricing):
# the plan is their start, and under a memory limit each random start's sweep costs a few
# eliminations per step (the Lagrangian walk): 16 of them were most of such a solve's time.
# None at all lost plans (helper budg3, benchmarks/RESULTS.md): the 3-layer MLP at half its
# peak without a repricing's (15.6 -> 19.1 ms), the wide-and-deep model at half its peak
# without a fit retry's (23.8 -> 32.7 ms), llama3-tiny at 0.35 of its peak every plan
RETRY_RESTARTS = 2

# whether a memory fit's retries (and a repricing's solves, from the plan) also sweep from the
# all-replicated point. They start from the plan, which nearly fits, the leanest layout and
# RETRY_RESTARTS random points; the all-replicated point, the layout furthest from fitting,
# ended no retry best alone in 132 solves under a limit (benchmarks/solver.py's encoder,
# decoder LM and encoder-decoder at 0.7 and 0.5 of their peaks, helper encdec4) and took 9%
# of the sweeps' time, more where the clock cut the later starts
RETRY_STARTS_REPLICATED = False

# random starts of a first solve under a memory limit: besides them the leanest layout, the
# best reference and another mode's plan start it. The encoder of benchmarks/solver.py at 0.7
# and 0.5 of its peak found the same plans from 4 as from 16 in half the CPU time
LIMIT_RESTARTS = 4


def planner_solve(
    sp: ShardingProblem, problem: Problem, time_limit_s: float, hints: list | None = None,
    domains: list[np.ndarray] | None = None, local_polish: bool | str = False,
    restarts: int = 16, replicated: bool = True,
) -> Solution:
    """Axis-by-axis exact sweeps from several starts, then the general solver from the best
    point for what is left of a short polishing budget; the better answer wins.

    ``local_polish`` (reference completions): where every step of the best sweep was solved
    exactly, the polish is the solver's local moves alone (every node, every rigid group
    re-chosen on its own), not the exact CP-SAT solve of the whole problem. Over
    plan_quality's 316 polishes, 61 were improved by those local moves and 9 more by CP-SAT:
    7 where the sweep's steps were too wide to eliminate (Mixtral on a 1-D mesh; the exact
    polish still runs there) and 2 on one gpt2-xl 8x8 completion of fsdp, not the best
    reference. CP-SAT's polish takes its whole budget (2 s), the local moves about 0.1 s.
    ``local_polish="always"``: the local moves alone polish, exact sweep or not, unless a
    step was too wide to solve (then the sweep may not have moved: CP-SAT searches).
    ``restarts``: the sweeps' random starts besides the hints; ``replicated``: the
    all-replicated point is a start too (:func:`solve_axiswise`). A problem whose limit no
    assignment fits (:func:`autopar.solver.problem.cannot_fit`: a memory fit's tightened
    limit, a reference that cannot fit) is answered at once: the sweeps would spend their
    whole time finding nothing (llama3-405b pp=16 x dp=64 x tp=8: 3 of the stand-in's 6
    solves, each its full half of the limit)."""
    t0 = time.perf_counter()
    if cannot_fit(problem):
        return cannot_fit_answer(t0)
    best = solve_axiswise(sp, problem, time_limit_s / 2, hints, domains=domains,
                          restarts=restarts, replicated=replicated)
    if best is not None and best.status == "optimal":
        return best
    if (local_polish and best is not None and best.feasible
            and (sweep_was_exact(best)
                 or (local_polish == "always" and not sweep_declined_steps(best)))):
        other = solve(problem, timeout_s=LOCAL_POLISH_S, hint=best.assignment,
                      method="heuristic")
        return other if other.feasible and other.cost < best.cost else best
    left = time_limit_s - (time.perf_counter() - t0)
    polish = min(POLISH_S, left)
    if polish > 0.2 or best is None:
        hint = best.assignment if best is not None and best.feasible else None
        other = solve(problem, timeout_s=max(polish, 0.5), hint=hint)
        if best is None or (other.feasible and (not best.feasible or other.cost < best.cost)):
            return other
        if other.status == "optimal" and best.feasible and best.cost <= other.cost:
            # the exact solve proved that no plan beats the sweep's
            return replace(best, status="optimal", lower_bound=best.cost,
                           method=f"{best.method}, proven optimal by {other.method}")
    return best


def cannot_fit_answer(t0: float) -> Solution:
    """The answer to a problem no assignment fits (:func:`cannot_fit`)."""
    return Solution((), math.inf, False, "infeasible", time.perf_counter() - t0,
                    "memory bound: no assignment fits the limit")


def solve_within_budget(
    sp: ShardingProblem, budget: float | None, time_limit_s: float,
    hint: tuple[int, ...] | None = None, more_hints: list[tuple[int, ...]] | None = None,
    deadline: Deadline | None = None, restarts: int = 16, must_fit: bool = False,
    local_polish: bool = False, replicated_start: bool = True,
) -> Solution:
    """Solve; if the exact peak over the whole step still exceeds the budget (the reduced
    problem constrains one instant), constrain the instant where it peaks instead (a sharded
    or recomputing layout peaks elsewhere than the replicated one the problem was built
    at), or, where it peaks at the constrained instant already, tighten the limit by the
    overshoot, and solve again.

    Under a budget the leanest assignment (every variable at its smallest usage) starts the
    search too: it fits wherever anything does, and the sweeps, which move one axis at a
    time, can miss every fitting point of a tight limit from the other starts. Where they
    still find none, the general solver gets the time left. ``must_fit``: no plan that fits
    is at hand yet, so the fit's rounds go on past the deadline (each retry then gets the
    deadline's floor). ``local_polish``: the sweeps polished by local moves, not CP-SAT
    (:func:`planner_solve`'s ``"always"``), with no budget too (under one they always are).
    ``replicated_start``: the first solve's sweeps start from the all-replicated point too;
    the retries' do not (:data:`RETRY_STARTS_REPLICATED`).
    """
    assert sp.problem is not None
    t0 = time.perf_counter()
    problem = sp.problem
    hints = ([hint] if hint is not None else []) + (more_hints or [])
    if budget is not None:
        hints.append(tuple(int(np.argmin(u)) for u in problem.usages))
    # under a memory limit every solve is polished by local moves, not CP-SAT: the reduced
    # problem counts one instant of the step, so CP-SAT's proof is of a problem the memory
    # fit may then tighten, and it spent its whole polish (2 s) without one (on the 3-layer
    # MLP at 0.7 of its peak, 6 modes x 1.7 s of 20 s, to improve one plan by 0.04%)
    sol = _solve_or_search(sp, problem, time_limit_s, hints, t0,
                           local_polish=local_polish or budget is not None,
                           restarts=restarts if budget is None else min(restarts, LIMIT_RESTARTS),
                           replicated=replicated_start)
    if budget is None or not sol.feasible:
        return sol
    # each instant constrained so far: its problem at the budget (what sp.problem becomes
    # when it binds) and as tightened. Switching to the instant that binds now forgot what
    # the earlier ones had learnt, and the solution swung back to one constrained before,
    # round after round (a 2-layer attention LM at half its peak swung between two instants
    # until the rounds ran out); a tightened limit now stays with its instant
    at_budget = {sp.peak_time: sp.problem}
    tight = {sp.peak_time: problem}
    for _ in range(4):
        choice = sp.expand(sol.assignment)
        # the whole step's peak, as the plan reports it (reshard copies, gathers included)
        peak, instant = step_peak(sp, choice)
        if fits_budget(peak, budget):
            return sol
        if deadline is not None and deadline.expired() and not must_fit:
            deadline.cut("the memory fit's rounds")
            return _leanest_if_fits(sp, sol, budget)
        if instant not in tight:  # the problem constrains the instant that binds now
            # at the budget: what the problem misses there depends on the layout, and a
            # limit set at once by this plan's miss shut out layouts that miss less (the
            # 3-layer MLP at 0.35 of its peak ended 8% slower so)
            sp.peak_time = instant
            at_budget[instant] = tight[instant] = reduced_problem(sp, budget)
        else:
            # below what this solution uses there, by the overshoot: the retry cannot return
            # it again (tightening the limit alone left a solution that used less than the
            # limit in place, round after round)
            p_t = tight[instant]
            used = evaluate(p_t, sol.assignment)[2]
            lim = min(p_t.usage_limit or budget, used) - (peak - budget) * 1.05
            tight[instant] = with_limit(p_t, lim)
        sp.peak_time, sp.problem, problem = instant, at_budget[instant], tight[instant]
        # a retry starts from a solution that nearly fits: a quarter of the time is plenty
        # (a whole budget let the general solver search 16 s for llama3-405b's full mode)
        retry_s = max(1.0, time_limit_s / 4)
        retry = _solve_or_search(sp, problem, deadline.cap(retry_s) if deadline else retry_s,
                                 [sol.assignment, tuple(int(np.argmin(u)) for u in problem.usages)],
                                 time.perf_counter(), local_polish=True,
                                 restarts=RETRY_RESTARTS, replicated=RETRY_STARTS_REPLICATED)
        if not retry.feasible:
            return _leanest_if_fits(sp, retry, budget)
        sol = retry
    return _leanest_if_fits(sp, sol, budget)


def _leanest_if_fits(sp: ShardingProblem, sol: Solution, budget: float) -> Solution:
    """``sol`` where its whole step fits ``budget``; otherwise the leanest assignment (every
    variable at its smallest usage at the constrained instant) where that fits: the memory
    fit's rounds can run out, or be cut by the time limit, on a plan that still overshoots,
    and "no plan found" must not be the answer where the leanest layouts fit."""
    assert sp.problem is not None
    if sol.feasible and fits_budget(step_peak(sp, sp.expand(sol.assignment))[0],
                              budget):
        return sol
    lean = tuple(int(np.argmin(u)) for u in sp.problem.usages)
    if not fits_budget(step_peak(sp, sp.expand(lean))[0], budget):
        return sol
    cost, _, used = evaluate(sp.problem, lean)
    return Solution(lean, float(cost), True, "feasible", sol.time_s, "leanest layout", None,
                    used)


def _solve_or_search(sp: ShardingProblem, problem: Problem, time_limit_s: float,
                     hints: list, t0: float, local_polish: bool = False,
                     restarts: int = 16, replicated: bool = True) -> Solution:
    """:func:`_search_once`, or its answer to the same problem from the same starts earlier
    in this planning call (:mod:`autopar.planning.solve_memo`)."""
    return solve_memo.solved(
        problem, hints, (local_polish, restarts, replicated), time_limit_s,
        lambda: _search_once(sp, problem, time_limit_s, hints, t0, local_polish, restarts,
                             replicated))


def _search_once(sp: ShardingProblem, problem: Problem, time_limit_s: float,
                  hints: list, t0: float, local_polish: bool = False,
                  restarts: int = 16, replicated: bool = True) -> Solution:
    """:func:`planner_solve`, then, where it found nothing that fits a memory limit, the
    general solver for the time left. ``local_polish``: a memory fit's retry, which starts
    from a solution that nearly fits, is polished by local moves, not CP-SAT (under a memory
    limit CP-SAT rarely proves anything on the planner's problems and spends its whole polish
    budget, round after round: 2 s a round on a 20-variable MLP)."""
    sol = planner_solve(sp, problem, time_limit_s, hints or None,
                        local_polish="always" if local_polish else False, restarts=restarts,
                        replicated=replicated)
    left = time_limit_s - (time.perf_counter() - t0)
    if sol.feasible or problem.usage_limit is None or left < 1.0 or sol.status == "infeasible":
        return sol
    lean = hints[-1] if hints else None
    other = solve(problem, timeout_s=left, hint=lean)
    return other if other.feasible else sol


def with_limit(p: Problem, limit: float | None) -> Problem:
    """``p`` with another usage limit (None: no limit), sharing its arrays."""
    return Problem(p.costs, p.usages, p.intervals, p.edges, p.edge_costs, limit, p.names, p.name)
