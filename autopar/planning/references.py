"""Reference layouts (``autopar.models.reference_plans``) as the solver completes them: their
parameter and input placements pinned, the rest solved at its best (or, for an ``exact``
reference, by work rather than the clock), each scored by the same cost model."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from autopar.ir.graph import PlanGraph
from autopar.ir.options import fits_budget
from autopar.ir.placements import Spec
from autopar.ir.plan import PlanCost
from autopar.passes.problem import bucket_fill, sharding_problem
from autopar.passes.problem.axis_search import solve_axiswise
from autopar.passes.problem.reduction import refine_followers
from autopar.passes.problem.types import ShardingProblem
from autopar.planning import used_in_place
from autopar.planning.parallel_map import forked_map
from autopar.planning.solving import cannot_fit_answer, planner_solve
from autopar.solver import Problem, Solution, evaluate
from autopar.solver.problem import cannot_fit, restrict


@dataclass
class References:
    """Reference layouts as the solver completes them on one problem: cost, full choice,
    solver assignment (None when completed without shared layer variables); the fastest that
    fits the budget (``fastest``: the plan is never slower) and the fastest of those with an
    assignment (``best``: it seeds the solver)."""

    cost: dict[str, PlanCost]
    choices: dict[str, list[int]]
    assign: dict[str, tuple[int, ...] | None]
    best: str | None
    fastest: str | None

    @staticmethod
    def score(sp: ShardingProblem, pg: PlanGraph, references: dict[str, Any],
              time_limit_s: float, budget: float | None, workers: int = 1) -> References:
        """Each reference completed on ``sp``; on up to ``workers`` forked processes
        (:mod:`autopar.planning.parallel_map`: each completion is independent)."""
        cost: dict[str, PlanCost] = {}
        choices: dict[str, list[int]] = {}
        assign: dict[str, tuple[int, ...] | None] = {}
        names = list(references)
        done = forked_map(lambda n: score_reference(sp, pg, references[n], time_limit_s),
                          names, workers)
        for name, got in zip(names, done):
            if got is not None:
                cost[name], choices[name], assign[name] = got
        return References.of(cost, choices, assign, budget)

    @staticmethod
    def of(cost: dict[str, PlanCost], choices: dict[str, list[int]],
           assign: dict[str, tuple[int, ...] | None], budget: float | None) -> References:
        fitting = [n for n, c in cost.items() if fits_budget(c.mem_bytes, budget)]
        seeds = [n for n in fitting if assign[n] is not None]
        best = min(seeds, key=lambda n: cost[n].step_s) if seeds else None
        fastest = min(fitting, key=lambda n: cost[n].step_s) if fitting else None
        return References(cost, choices, assign, best, fastest)

    def rescored(self, sp: ShardingProblem, budget: float | None) -> References:
        """The same completions, scored again (after the problem was repriced)."""
        cost = {n: bucket_fill.score(sp, c).cost for n, c in self.choices.items()}
        return References.of(cost, self.choices, self.assign, budget)

    def better(self, other: References, budget: float | None) -> References:
        """Per reference, the cheaper of its two completions."""
        cost, choices, assign = dict(self.cost), dict(self.choices), dict(self.assign)
        for n, c in other.cost.items():
            if n not in cost or c.step_s < cost[n].step_s:
                cost[n], choices[n], assign[n] = c, other.choices[n], other.assign[n]
        return References.of(cost, choices, assign, budget)


def score_reference(
    sp: ShardingProblem, pg: PlanGraph, ref: Any, time_limit_s: float
) -> tuple[PlanCost, list[int], tuple[int, ...] | None] | None:
    """Best completion of a reference layout (its params and inputs pinned): its cost, the
    strategy of every node, and the solver assignment (None when it had to be solved without
    shared layer variables). None if a pinned placement is one no strategy offers."""
    got = _pinned_solve(sp, ref, time_limit_s)
    if got is not _CONFLICT:
        return got  # type: ignore[return-value]
    # the layout places repeated layers differently (an MLP alternating column and row
    # layers): plan it without shared layer variables
    assert sp.problem is not None
    flat = sharding_problem.build(pg, sp.mesh, sp.problem.usage_limit, share_layers=False,
                                  zero1=sp.zero1, prices_of=sp)
    bucket_fill.apply(flat, sp.bucket_fill, sp.problem.usage_limit)  # at the same prices
    got = _pinned_solve(flat, ref, time_limit_s)
    if got is None or got is _CONFLICT:
        return None
    _, choice, _ = got  # type: ignore[misc]
    return bucket_fill.score(sp, choice).cost, choice, None


_CONFLICT = object()


def _pinned_solve(sp: ShardingProblem, ref: Any, time_limit_s: float):
    assert sp.problem is not None and sp.var_of is not None
    pins: dict[int, Spec] = {}
    index = {n.name: i for i, n in enumerate(sp.nodes)}
    params = {n.meta["autopar"].param_name: i for i, n in enumerate(sp.nodes)
              if n.op == "placeholder" and n.meta["autopar"].role == "param"}
    for pname, spec in ref.params.items():
        if pname in params:
            pins[params[pname]] = tuple(spec)
    for n in sp.nodes:
        f = n.meta["autopar"]
        if f.role == "input" and f.input_index in ref.inputs:
            spec = tuple(ref.inputs[f.input_index])
            if len(spec) == len(sp.mesh.shape) and f.out is not None and len(f.out.shape) > 0:
                pins[index[n.name]] = spec
    allowed: dict[int, set[int]] = {}
    for node_i, spec in pins.items():
        v = int(sp.var_of[node_i])
        ok = {k for k, s in enumerate(sp.strategies[node_i]) if s.outs[0] == spec}
        if not ok:
            return None
        allowed[v] = allowed[v] & ok if v in allowed else ok
        if not allowed[v]:
            return _CONFLICT
    in_place = getattr(ref, "used_in_place", ())
    node_allowed: dict[int, set[int]] = {}
    if in_place:  # tensor parallelism as run: each weight multiplied on its own shard
        params_pinned = {i: spec for i, spec in pins.items()
                         if sp.nodes[i].meta["autopar"].role == "param"}
        node_allowed = used_in_place.allowed(sp, params_pinned, tuple(in_place))
        for node_i, ok in node_allowed.items():
            v, root = int(sp.var_of[node_i]), int(sp.group_of[node_i])
            if root != node_i:  # a follower: the root strategies that give it one of ``ok``
                ok = {k for k, f in enumerate(sp.follow[node_i]) if int(f) in ok}
            allowed[v] = allowed[v] & ok if v in allowed else set(ok)
            if not allowed[v]:
                return _CONFLICT
    sub, maps = restrict(sp.problem, {v: sorted(a) for v, a in allowed.items()})
    exact = getattr(ref, "exact", False)

    def complete(q: Problem, limit_s: float) -> Solution:
        if cannot_fit(q):  # what either completion would end with, at once
            return cannot_fit_answer(time.perf_counter())
        return exact_completion(sp, q, maps) if exact else \
            planner_solve(sp, q, limit_s, domains=maps, local_polish=True)

    sol = complete(sub, time_limit_s)
    if not sol.feasible and sub.usage_limit is not None and \
            getattr(ref, "zero", None) is not None:
        # a layout that carries its ZeRO stage is one a team ran (Megatron's distributed
        # optimizer, a published run's): where no completion fits, the fastest one is
        # reported as not fitting (a pipeline weighs it again with other schedules)
        sub = replace(sub, usage_limit=None)
        sol = complete(sub, time_limit_s / 4)
    if not sol.feasible:
        return None
    full_assign = [maps[v][s] for v, s in enumerate(sol.assignment)]
    choice = sp.expand(full_assign)
    # placeholders (the pins) are never followers; the followers in use keep to their sets
    choice = refine_followers(sp, choice, node_allowed)
    return bucket_fill.score(sp, choice).cost, choice, tuple(int(x) for x in full_assign)


# an exact completion's local search: rounds of moves until one gains nothing, at most
# EXACT_ROUNDS; in a round, tree moves until EXACT_TREE_FAILS in a row gain nothing, and pair
# moves until EXACT_PAIR_FAILS do (the heuristic's own stall counts, run_heuristic), each
# kind at most EXACT_MOVES times
EXACT_ROUNDS, EXACT_TREE_FAILS, EXACT_PAIR_FAILS, EXACT_MOVES = 20, 25, 60, 2000


def exact_completion(sp: ShardingProblem, problem: Problem,
                     domains: list[np.ndarray]) -> Solution:
    """A reference's completion bounded by work, not by the clock, so that it is the same
    at any load. The planner's own completion races a clock (sweeps cut by the deadline,
    LNS and CP-SAT for what is left of it): the same pinned layout (Llama-3 8B, FSDP on 8
    GPUs) priced 2.42 to 5.15 s per step in four runs under load. Here the axis sweeps from
    their seeded starts run to their end, and from their point and from the greedy start
    the local search's moves (single nodes, rigid groups, induced trees, the two ends of a
    costly edge: :mod:`autopar.solver.heuristic`, seeded) run until a round gains nothing;
    no LNS (its CP-SAT steps are timed). The better end wins. On that 8B layout (118
    variables on a 1-D mesh, the sweeps' steps too wide to eliminate) the sweeps end at
    5.61 s, CP-SAT on one worker stays there after 100 s, and the moves from the greedy
    start reach 2.43 s in 0.1 s, the best the timed heuristic found in 10 s. A reference
    that carries ``exact=True`` is completed so."""
    from autopar.solver.groups import Groups, group_pass
    from autopar.solver.heuristic import LocalSearch
    from autopar.solver.problem import usage_profile
    from autopar.solver.treedp import TREE_SIZE, tree_move

    t0 = time.perf_counter()
    swept = solve_axiswise(sp, problem, float("inf"), domains=domains)
    best: tuple[tuple[bool, float], np.ndarray, str] | None = None
    for start in ([np.asarray(swept.assignment)] if swept is not None else []) + [None]:
        ls = LocalSearch(problem)
        if start is None:
            ls.greedy()
        else:
            ls.a, ls.load = start.astype(np.int64), usage_profile(problem, start)
        ls.groups = Groups(ls)
        for _ in range(EXACT_ROUNDS if len(ls.free_nodes) else 0):  # else nothing to move
            before = ls.cost()
            while ls.sweep():
                pass
            group_pass(ls, float("inf"))
            fails = tries = 0
            while fails < EXACT_TREE_FAILS and tries < EXACT_MOVES:
                gain = tree_move(ls, ls.pick_seed(), TREE_SIZE, safe=tries % 2 == 0)
                tries += 1
                fails = 0 if gain > 0 else fails + 1
            fails = tries = 0
            while fails < EXACT_PAIR_FAILS and tries < EXACT_MOVES:
                edge = ls.pick_edge()
                gain = ls.groups.move_units(ls, list(edge)) if edge is not None else 0.0
                tries += 1
                fails = 0 if gain > 0 else fails + 1
            if ls.cost() >= before * (1 - 1e-12):
                break
        cost, ok, _ = evaluate(problem, ls.a)
        how = (swept.method if start is not None and swept is not None else "greedy")
        if best is None or (not ok, cost) < best[0]:
            best = ((not ok, cost), ls.a.copy(), f"{how} + local moves")
    (infeasible, cost), a, method = best
    _, _, peak = evaluate(problem, a)
    return Solution(tuple(int(x) for x in a), cost, not infeasible,
                    "timeout-no-solution" if infeasible else "feasible",
                    time.perf_counter() - t0, method, None, peak)
