"""The planner: capture -> strategies + cost model -> solve -> Plan.

``make_plan(model, mesh, example_inputs)`` runs the passes in order and returns a
:class:`Planned` (the plan plus what made it, for explanations and comparisons). Reference
layouts (``autopar.models.reference_plans``) are scored by the same cost model: their parameter
and input placements are pinned and the solver completes the rest at its best, so a reference's
score is the best that layout can do.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch.nn as nn

from autopar.capture.joint import capture
from autopar.ir.deadline import MIN_SOLVE_S, Deadline
from autopar.ir.errors import PlanError
from autopar.ir.graph import PlanGraph
from autopar.ir.mesh import Mesh
from autopar.ir.options import Options, SearchOptions, fits_budget
from autopar.ir.placements import Spec
from autopar.ir.plan import (
    Decisions,
    NodePlacement,
    Plan,
    PlanCost,
    Predictions,
    Provenance,
    Recompute,
    SolverInfo,
)
from autopar.ir.precision import Precision
from autopar.passes.cost import cost_model as cm
from autopar.passes.cost.buckets import first_bucket_bytes
from autopar.passes.memory import zero as zero_mod
from autopar.passes.problem import bucket_fill, sharding_problem, zero_stages
from autopar.passes.problem.axis_search import (
    solve_axiswise,
    sweep_declined_steps,
    sweep_was_exact,
)
from autopar.passes.problem.data_parallel import data_parallel_assignment
from autopar.passes.problem.edge_costs import edge_collectives
from autopar.passes.problem.reduction import reduced_problem, refine_followers
from autopar.passes.problem.scoring import score_assignment
from autopar.passes.problem.step_memory import step_peak
from autopar.passes.problem.types import ShardingProblem
from autopar.planning import solve_memo, used_in_place
from autopar.planning.explain import explain_node
from autopar.planning.memory_fit import memory_limit, no_fit_message
from autopar.planning.mode_jobs import per_worker_share, portable, restored
from autopar.planning.modes import Mode, candidate_modes, mode_graph, reference_mode
from autopar.planning.parallel_map import Ahead, forked_map, usable_workers
from autopar.solver import Problem, Solution, evaluate, heuristic, solve
from autopar.solver.problem import cannot_fit, restrict

REPRICE_ROUNDS = 3  # at most this many solves again at the real fill of gradient buckets
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
# random starts of a first solve under a memory limit: besides them the leanest layout, the
# best reference and another mode's plan start it. The encoder of benchmarks/solver.py at 0.7
# and 0.5 of its peak found the same plans from 4 as from 16 in half the CPU time
LIMIT_RESTARTS = 4


@dataclass
class Planned:
    plan: Plan
    graph: PlanGraph
    problem: ShardingProblem
    solution: Solution
    node_choice: list[int]
    reference_choices: dict[str, list[int]] = field(default_factory=dict)
    # every reference layout as completed, in the problem of its own recomputation mode
    reference_problems: dict[str, tuple[ShardingProblem, list[int]]] = field(
        default_factory=dict)
    # name -> a Planned whose plan is that reference layout (a caller that weighs plans by
    # another measure than this planner's, as the pipeline planner does, may keep one)
    as_reference: Callable[[str], Planned] | None = None
    # every mode planned: its problem, in which a layout planned in another mode can be priced
    # again (:func:`carried_choice`; the pipeline planner's per-stage recomputation)
    mode_problems: dict[Mode, ShardingProblem] = field(default_factory=dict)

    def explain(self, node: str, top: int = 5) -> str:
        return explain_node(self.problem, self.graph.proxy, self.solution.assignment,
                            self.node_choice, node, top)


def make_plan(
    model: nn.Module,
    mesh: Mesh,
    example_inputs: tuple = (),
    example_kwargs: dict | None = None,
    loss_fn: Callable | None = None,
    options: Options | None = None,
    *,
    references: dict[str, Any] | None = None,
    model_name: str = "",
    graph: PlanGraph | None = None,
) -> Planned:
    """Plan ``model`` on ``mesh``: trace the training step, solve its sharding together with
    recomputation, the ZeRO stage and offload, and score reference layouts beside it.

    Args:
        model: the module to plan (its parameters may be on the meta device).
        mesh: the :class:`~autopar.ir.mesh.Mesh` to plan for (no pipeline axis; see
            :func:`autopar.planning.pipeline.plan_pipeline`).
        example_inputs, example_kwargs: the step's inputs (shapes and dtypes are what count).
        loss_fn: turns the model's output into the loss (None: the output is the loss).
        options: what is asked (:class:`~autopar.ir.options.Options`; None: every default).
            ``memory.budget``: bytes per device; None holds the plan to the device's capacity
            less a reserve (``DeviceProfile.memory_limit``), ``math.inf`` to nothing.
            ``precision``: the step is traced under that policy
            (:mod:`autopar.passes.memory.mixed_precision`); a ``graph`` given keeps the
            policy it was traced under. ``memory.recompute``: ``auto`` (the default: nothing
            is recomputed where the plan fits without it; otherwise the mode, solved with the
            sharding, whose plan is predicted fastest within the limit). ``memory.zero``: the
            ZeRO stage of parameters the plan stores split (``auto``: stage 2 or 3, the
            faster that fits, planned both ways where the plan does not fit at ease).
            ``memory.offload``: ``auto`` offers the host for optimizer state only where no
            plan fits without. ``search.max_layers``: trace a deeper model as a proxy of that
            many layers (planning time then does not grow with depth; the plan's node
            placements cover the traced layers only). ``search.min_gain``: the solver's own
            plan replaces the best reference layout (as the solver completes it) only when
            predicted at least this fraction faster: the cost model errs by more than a
            fraction of a percent, and the hand-written layouts are the proven ones.
            ``search.workers``: the reference layouts are completed on up to this many forked
            processes (:mod:`autopar.planning.parallel_map`). Pipeline options do not apply.
        references: names to ReferencePlans (their parameter and input placements), each
            completed by the solver and scored by the same cost model.
        model_name: recorded in the plan.
        graph: a graph already traced (then ``model``'s inputs and the precision are not
            used).

    Where the plan leaves gradient buckets nearly empty, they are priced at their real fill
    and everything solved again (:mod:`autopar.passes.problem.bucket_fill`).

    Returns:
        A :class:`Planned`: ``.plan`` (the :class:`~autopar.ir.plan.Plan`), the graph and
        problem it was solved on, and the reference layouts as completed.

    Example::

        planned = make_plan(model, Mesh((8,), ("dp",), "h100"), (tokens, targets),
                            options=Options.of(memory_budget=40 * 2**30, recompute="full"))
        print(plan_table(planned.plan))
    """
    with solve_memo.remembering():  # modes that build one problem solve it once
        return _make_plan(model, mesh, example_inputs, example_kwargs, loss_fn, options,
                          references, model_name, graph)


def _make_plan(model: nn.Module, mesh: Mesh, example_inputs: tuple, example_kwargs: dict | None,
               loss_fn: Callable | None, options: Options | None,
               references: dict[str, Any] | None, model_name: str, graph: PlanGraph | None
               ) -> Planned:
    # the whole call's time limit starts now (or is the calling search's: autopar.ir.deadline)
    options = (options if options is not None else Options()).with_deadline()
    mem, search = options.memory, options.search
    dl = search.deadline
    limit, limit_source = memory_limit(mem.budget, mesh.device)
    t0 = time.perf_counter()
    if graph is None:
        dl.phase("tracing")
        graph = capture(model, example_inputs, example_kwargs, loss_fn,
                        max_layers=search.max_layers,
                        precision=options.resolved_precision(mesh.device))
    pg = graph
    t_trace = time.perf_counter() - t0
    refs_by_mode: dict[Mode, dict[str, Any]] = {}
    exact_refs: dict[Mode, dict[str, Any]] = {}  # also priced alone, the same at any load
    for name, ref in (references or {}).items():
        mode = reference_mode(getattr(ref, "recompute", "none"), getattr(ref, "zero", None))
        refs_by_mode.setdefault(mode, {})[name] = ref
        if getattr(ref, "exact", False):
            exact_refs.setdefault(mode, {})[name] = ref
    timings = {"trace_s": t_trace, "build_s": 0.0, "solve_s": 0.0, "references_s": 0.0}
    runs: dict[Mode, _ModeRun] = {}

    seeds: list[_ModeRun] = []  # plans the recomputing modes start from
    # offload offered from the start?
    stored = "none" if mem.offload == "auto" else mem.offload

    graphs: dict[tuple, Mode] = {}  # what a mode's problem is made of -> the mode planned

    def run(mode: Mode, own: bool, of: int = 1) -> _ModeRun | None:
        """Plan ``mode``, the first of ``of`` modes still to plan: each gets its share of
        the time left (the first mode solved could otherwise spend the whole limit, and a
        later one, the only one that fits, get nothing). None: a mode already planned has
        the same problem (no node it would copy, as re-gathering on a model whose layers
        use each parameter once, or recomputation of a model with nothing to recompute)."""
        mpg = mode_graph(pg, mode)
        key = (frozenset(mpg.recomputed.items()), mode.whole_grads, mode.offload)
        if own and key in graphs and graphs[key] in runs and runs[graphs[key]].sol is not None:
            return None
        graphs.setdefault(key, mode)
        dl.phase(f"planning mode {mode.label}")
        # past the deadline with nothing that fits, each mode still gets MIN_MODE_S
        dl.floor = MIN_SOLVE_S if any(r.fits for r in runs.values()) else MIN_MODE_S
        share = replace(search, time_limit_s=min(search.time_limit_s,
                                                 max(MIN_MODE_S, dl.left() / of)))
        runs[mode] = _plan_mode(pg, mesh, mode, limit, refs_by_mode.get(mode, {}), share, own,
                                timings, seed=seeds[0] if seeds else None, offload=stored,
                                prices_of=next(iter(runs.values())).sp if runs else None,
                                mpg=mpg, must_fit=not runs)
        return runs[mode]

    def run_all(modes: list[Mode], later: int) -> None:
        """Plan ``modes`` (each after the first mode, seeded by it), then ``later`` more
        where none fits yet: one after another, or side by side on ``search.workers``
        forked processes (:mod:`autopar.planning.mode_jobs`), each worker's modes sharing
        its time left as one process's would."""
        workers = min(spread, len(modes))
        if workers <= 1:
            for k, mode in enumerate(modes):
                if not _out_of_time(dl, runs, f"mode {mode.label} not tried"):
                    more = 0 if any(r.fits for r in runs.values()) else later
                    run(mode, own=True, of=len(modes) - k + more)
            return
        jobs: list[tuple[Mode, PlanGraph]] = []
        keys: set[tuple] = set()
        for mode in modes:  # those whose problem no mode planned or to plan has (as run's)
            mpg = mode_graph(pg, mode)
            key = (frozenset(mpg.recomputed.items()), mode.whole_grads, mode.offload)
            if key in keys or (key in graphs and graphs[key] in runs
                               and runs[graphs[key]].sol is not None):
                continue
            graphs.setdefault(key, mode)
            keys.add(key)
            jobs.append((mode, mpg))
        more = 0 if any(r.fits for r in runs.values()) else later
        floor = MIN_SOLVE_S if any(r.fits for r in runs.values()) else MIN_MODE_S
        prices_of = next(iter(runs.values())).sp
        dl.phase(f"planning modes {', '.join(m.label for m, _ in jobs)}")
        # each mode's problem built here, before forking: modes whose problems are the same
        # are planned on one worker one after another, the later ones answered by the first's
        # remembered solves (solve_memo), and every worker starts with the prices these
        # builds made (a worker's own new prices die with it)
        t1 = time.perf_counter()
        built = [sharding_problem.build(mpg, mesh, limit, offload=stored,
                                        zero1=mode.whole_grads, prices_of=prices_of)
                 for mode, mpg in jobs]
        timings["build_s"] += time.perf_counter() - t1
        same: dict[bytes, list[int]] = {}
        for k, sp in enumerate(built):
            assert sp.problem is not None
            same.setdefault(solve_memo.content_key(sp.problem), []).append(k)
        batches = list(same.values())
        workers = min(workers, len(batches))

        # while no plan fits, the leanest modes (the last: they recompute and re-gather the
        # most) start first, with the largest shares: they are the likeliest to fit, and
        # where only they fit, the search for a plan that does is theirs (the
        # encoder-decoder at 0.35 of its peak: full+zero3+offload alone fits, 6 s of CPU)
        order = list(range(len(batches)))
        if not any(r.fits for r in runs.values()):
            order.reverse()

        def job(p: int) -> tuple[list[_ModeRun | None], list[str], dict[str, float],
                                 tuple[float, float]]:
            mine, spent = _own_view(dl, floor), dict.fromkeys(timings, 0.0)
            got: list[_ModeRun | None] = []
            for k in batches[order[p]]:
                mode, mpg = jobs[k]
                if _out_of_time(mine, runs, f"mode {mode.label} not tried"):
                    got.append(None)
                    continue
                # a batch shares its worker's time as one mode: those after its first are
                # answered from memory unless their whole step's memory differs
                of = per_worker_share(p, len(batches), more, workers)
                share = replace(search, workers=1, deadline=mine, time_limit_s=min(
                    search.time_limit_s, max(MIN_MODE_S, mine.left() / of)))
                got.append(portable(_plan_mode(
                    pg, mesh, mode, limit, refs_by_mode.get(mode, {}), share, True, spent,
                    seed=seeds[0] if seeds else None, offload=stored, prices_of=prices_of,
                    mpg=mpg, shown=False, sp=built[k])))
            return got, mine.cuts, spent, heuristic.learned_rates()

        done: dict[int, _ModeRun | None] = {}
        for p, (got, *rest) in enumerate(forked_map(job, range(len(batches)), workers)):
            _merge(dl, timings, *rest)
            done.update(zip(batches[order[p]], got))
        for k, (mode, mpg) in enumerate(jobs):  # in the modes' order, as one process's
            run_k = done[k]
            if run_k is not None:
                runs[mode] = restored(run_k, mpg, mesh, prices_of)
                if runs[mode].fits:
                    dl.found(runs[mode].step_s)

    held = pg.proxy is not None and pg.proxy.microbatches > 1  # a pipeline stage's stand-in
    candidates = candidate_modes(mem.recompute, mem.zero, held)

    def free_plan() -> tuple[_ModeRun, list[str], dict[str, float], tuple[float, float]]:
        """The first mode's plan with no limit, where its plan under the limit does not
        fit: the other modes start from the layout that is fastest with no limit (the
        solver alone, from the leanest start, can stall far from it under a tight limit:
        llama3-70b dp=8,tp=8 b64 found a plan 4x slower). Planned after the first mode
        (where it is not forked beside it), its problem is built with the first's strategy
        lists and price caches, as the other modes' are: caches only, the same problem."""
        mine, spent = _own_view(dl, MIN_MODE_S), dict.fromkeys(timings, 0.0)
        got = _plan_mode(pg, mesh, candidates[0], None, {},
                         replace(search, time_limit_s=search.time_limit_s / 2, workers=1,
                                 deadline=mine), True, spent, shown=False,
                         prices_of=next(iter(runs.values())).sp if runs else None,
                         seed_only=True)
        return portable(got), mine.cuts, spent, heuristic.learned_rates()

    # the workers the modes are planned on: only cores idle now (one busy elsewhere would
    # only be split, and the clock-bound solves do less)
    spread = usable_workers(search.workers) if limit is not None and len(candidates) > 1 \
        else 1
    # on a second core it is planned beside the first mode, and dropped where that one fits
    ahead = Ahead(free_plan, spread) if limit is not None and len(candidates) > 1 else None
    try:
        first = run(candidates[0], own=True)  # also the start of the other modes' searches
    except BaseException:
        if ahead is not None:
            ahead.cancel()
        raise
    assert first is not None
    if first.choice is not None:
        seeds.append(first)
        if ahead is not None:
            ahead.cancel()
    elif ahead is not None:
        # (its limit is half the call's; past the whole call's and a minute it is lost)
        free, *rest = ahead.get(search.time_limit_s + 60)
        _merge(dl, timings, *rest)
        free = restored(free, first.pg, mesh, None)
        if free.choice is not None:
            seeds.append(free)
    # recomputation and re-gathering pay only where memory binds: a plan well inside the
    # limit is the fastest any mode can give (each adds work and frees no better layout),
    # unless the limit bound it all the same (the memory fit tightens the problem's limit
    # below the budget, so a plan bound by it can end well inside: the 3-layer MLP at half
    # its peak ended at 0.88 of it, and the modes that found a plan 26% faster went untried)
    inside = first.fits and (limit is None or first.peak <= AUTO_SLACK * limit)
    if limit is not None and inside:
        # a sweep from the plan alone, with no limit: a bound plan has a cheaper move
        inside = _limit_not_binding(first, dl.cap(search.time_limit_s / 4), restarts=0,
                                    limit=limit)
    if not inside:
        # where the plan is also the best without the limit (near it, not bound by it), a
        # mode that only adds work (recomputes, re-gathers) cannot beat it
        unbound = first.fits and _limit_not_binding(first, dl.cap(search.time_limit_s / 4),
                                                    limit=limit)
        # while nothing fits, the modes that offload (tried only then) share the time left
        # too: the modes before them took it all where none of them fit (MoE at 0.35 of its
        # peak, under load: no plan, where an offloading mode fits)
        offloading = len(candidates) if mem.offload == "auto" and limit is not None else 0
        run_all([m for m in candidates[1:]
                 if not (unbound and (m.recompute != "none" or m.regather))], offloading)
    if mem.offload == "auto" and limit is not None and not any(r.fits for r in runs.values()):
        # nothing fits with the state on the device: offer the solver the host for it
        stored = "auto"
        run_all([mode.offloaded() for mode in candidates], 0)
    for mode in refs_by_mode:  # fixed policies in other modes, completed for the comparison
        # (an exact reference's never skipped for time: the plan is never slower than it)
        if mode not in runs and (mode in exact_refs or not _out_of_time(
                dl, runs, f"references of mode {mode.label} not completed")):
            run(mode, own=False)
    asked = [r for m, r in runs.items() if m.base in candidates]
    fitting = [r for r in asked if r.choice is not None and r.fits]
    if not fitting:
        raise PlanError(no_fit_message(pg, mesh, limit, limit_source, runs,
                                       search.time_limit_s))
    best = min(fitting, key=lambda r: r.step_s)
    dl.close()
    # exact references, reported as priced alone: each mode built afresh (the solver's
    # repricing of its own problem depends on its clock-bound plan) and completed by work,
    # never skipped for time. In the solver's runs they seed and bound its plan as any
    # reference does, completed by work there too, so the plan is never slower than them.
    priced = [_plan_mode(pg, mesh, mode, limit, refs, search, False, timings, offload=stored,
                         prices_of=next(iter(runs.values())).sp, shown=False)
              for mode, refs in exact_refs.items()]
    every = [*runs.values(), *priced]
    references_cost = {name: c for r in every for name, c in r.refs.cost.items()}
    timings["total_s"] = time.perf_counter() - t0
    sp, sol = best.sp, best.sol
    assert sp.problem is not None and best.choice is not None
    plan = assemble_plan(
        best.pg, sp, best.choice, model_name, mesh,
        # the objective at the problem's final prices (a repricing may have changed them)
        SolverInfo(sol.status, round(sol.time_s, 4), best.method, sp.problem.num_nodes,
                   len(sp.nodes), sp.shared_layers,
                   float(evaluate(sp.problem, sol.assignment)[0]),
                   time_limit_s=dl.limit_s, limit_cut=dl.summary(),
                   lower_bound=sol.lower_bound),
        timings, references_cost, limit, limit_source=limit_source,
        recompute=recompute_record(mem.recompute, best.mode.recompute, best.pg, sp,
                                   best.choice, _unrecomputed(pg, mesh, best.mode, runs, stored)),
    )
    ref_runs = {name: r for r in every for name in r.refs.choices}

    def as_reference(name: str) -> Planned:
        r = ref_runs[name]
        choice = r.refs.choices[name]
        c = r.refs.cost[name]
        ref_sol = Solution(tuple(r.refs.assign[name] or ()), c.step_s, True, "feasible", 0.0,
                           f"kept {name}")
        ref_plan = assemble_plan(
            r.pg, r.sp, choice, model_name, mesh,
            SolverInfo("feasible", 0.0, f"kept {name}", r.sp.problem.num_nodes,
                       len(r.sp.nodes), r.sp.shared_layers, c.step_s),
            timings, references_cost, limit, limit_source=limit_source,
            recompute=recompute_record(mem.recompute, r.mode.recompute, r.pg, r.sp, choice,
                                       _unrecomputed(pg, mesh, r.mode, runs, stored)))
        return Planned(ref_plan, r.pg, r.sp, ref_sol, choice, r.refs.choices,
                       mode_problems=mode_problems)

    mode_problems = {m: r.sp for m, r in runs.items()}
    return Planned(plan, best.pg, sp, sol, best.choice, best.refs.choices,
                   {name: (r.sp, r.refs.choices[name]) for name, r in ref_runs.items()},
                   as_reference, mode_problems)


def _own_view(dl: Deadline, floor: float) -> Deadline:
    """The call's deadline as a job planned apart sees it (a forked mode): the same end, its
    own cuts (sent back, :func:`_merge`), nothing drawn on the terminal from there."""
    mine = copy.copy(dl)
    mine.progress, mine.cuts, mine.floor = None, [], floor
    return mine


def _merge(dl: Deadline, timings: dict[str, float], cuts: list[str],
           spent: dict[str, float], rates: tuple[float, float] | None = None) -> None:
    """A job planned apart: its cuts noted on the call's deadline, its time in the call's,
    what its solver learnt of CP-SAT's steps taken here (the next forks start with it)."""
    for what in cuts:
        dl.cut(what)
    for name, s in spent.items():
        timings[name] += s
    if rates is not None:
        heuristic.adopt_rates(rates)


def _out_of_time(dl: Deadline, runs: dict[Mode, _ModeRun], what: str) -> bool:
    """Whether the deadline has passed and a plan that fits is at hand (then ``what`` is
    skipped and the cut noted); with no such plan yet the search goes on."""
    if not dl.expired() or not any(r.fits for r in runs.values()):
        return False
    dl.cut(what)
    return True


def _limit_not_binding(run: _ModeRun, time_limit_s: float, restarts: int = 16,
                       limit: float | None = None) -> bool:
    """Whether ``run``'s plan is as cheap as the axis sweeps find without the memory limit
    (from it and from their usual starts): then the limit does not bind it; nor where the
    plan is data parallelism (taken by its full score, no sweep's end) and what they find
    cheaper fits ``limit`` over the whole step too. Recomputing and
    re-gathering add work to every layout, so no such mode beats a plan the limit did not
    bind: trying each cost a whole solve, at a budget just above the plan's peak (the
    benchmark's 1.0) all of them."""
    sp, sol = run.sp, run.sol
    if sol is None or not sol.feasible or sp.problem is None:
        return False
    p = _with_limit(sp.problem, None)
    own = float(evaluate(p, sol.assignment)[0])
    t0 = time.monotonic()
    # the sweeps from the all-replicated start and the plan first: their starts are the
    # first of the full run's, so a cheaper point among them settles it as the full run
    # would (under a binding limit, most often; the 16 random starts cost 2 s on enc-dec)
    for tries in sorted({0, restarts}):
        left = time_limit_s - (time.monotonic() - t0)
        free = solve_axiswise(sp, p, max(left, 0.0), [sol.assignment], restarts=tries)
        if free is None:
            return False
        if free.cost < own * (1 - 1e-9):
            if sol.method != DATA_PARALLEL or limit is None:
                return False
            # data parallelism, cheaper by the full score than what the search found: that
            # the sweeps move from it says nothing of the limit unless the point they reach
            # overflows it (a plan the memory fit bound is a sweep's end, as above)
            peak = step_peak(sp, sp.expand(free.assignment))[0]
            return fits_budget(peak, limit)
    return True


# a mode's share of the time left is never below this (a solve returns its start at worst)
MIN_MODE_S = 1.0
# a plan in mode "none" whose peak is under this fraction of the limit is kept without trying
# recomputation (the memory constraint did not bind it)
AUTO_SLACK = 0.9


@dataclass
class _ModeRun:
    """One recomputation mode planned: its graph, problem, the solver's plan (None when the
    mode was completed only for its reference layouts) and the references completed in it."""

    mode: Mode
    pg: PlanGraph
    sp: ShardingProblem
    refs: _References
    sol: Solution | None = None
    choice: list[int] | None = None
    method: str = ""
    step_s: float = float("inf")
    peak: float = float("inf")
    fits: bool = False


def _unrecomputed(pg: PlanGraph, mesh: Mesh, mode: Mode, runs: dict[Mode, _ModeRun],
                  offload: str) -> ShardingProblem:
    """The problem of the same graph without recomputation (re-gathering and offload as in
    ``mode``): what a recomputing plan's price is measured against."""
    if mode.plain in runs:
        return runs[mode.plain].sp
    return sharding_problem.build(mode_graph(pg, mode.plain), mesh, offload=offload,
                                  zero1=mode.whole_grads)


def _plan_mode(pg: PlanGraph, mesh: Mesh, mode: Mode, limit: float | None,
               references: dict[str, Any], search: SearchOptions, own: bool,
               timings: dict[str, float], seed: _ModeRun | None = None,
               offload: str = "none", prices_of: ShardingProblem | None = None,
               shown: bool = True, mpg: PlanGraph | None = None,
               must_fit: bool = False, sp: ShardingProblem | None = None,
               seed_only: bool = False) -> _ModeRun:
    """Plan the graph with ``mode``'s recomputation applied: the solver's plan (``own``) or
    only the given reference layouts, completed and scored in that mode, within ``search``'s
    time limit, margin and workers. ``seed``: another mode's plan, a start for the solver
    (its placements, each copy as its original). ``offload``: whether parameters may keep
    their optimizer state on the host (:func:`autopar.passes.problem.sharding_problem.build`).
    ``shown``: a plan that fits is shown as the best so far (not the no-limit plan that only
    seeds the other modes). ``mpg``: the mode's graph, where already made; ``sp``: its problem,
    where already built (as here, from ``prices_of``). ``must_fit``: the first
    mode planned, with no plan at hand yet: its memory fit goes on past the deadline (the
    other modes' stop there, falling back to the leanest layout where that fits).
    ``seed_only``: the plan only starts the other modes' searches (the plan with no limit):
    its solves are polished by local moves, as a memory fit's are, not by CP-SAT's whole
    polish (:func:`_solve_within_budget`'s ``local_polish``)."""
    time_limit_s, min_gain, workers = search.time_limit_s, search.min_gain, search.workers
    dl = search.deadline if search.deadline is not None else Deadline(time_limit_s)
    mpg = mpg if mpg is not None else mode_graph(pg, mode)
    t1 = time.perf_counter()
    if sp is None:
        sp = sharding_problem.build(mpg, mesh, limit, offload=offload, zero1=mode.whole_grads,
                                    prices_of=prices_of)
    timings["build_s"] += time.perf_counter() - t1
    assert sp.problem is not None
    t_refs = time.perf_counter()
    refs = _References.score(sp, mpg, references, dl.cap(time_limit_s), limit, workers)
    timings["references_s"] += time.perf_counter() - t_refs
    out = _ModeRun(mode, mpg, sp, refs)
    if not own:
        if refs.fastest is not None:
            c = refs.cost[refs.fastest]
            out.sol = Solution(tuple(refs.assign[refs.fastest] or ()), c.step_s, True,
                               "feasible", 0.0, f"kept {refs.fastest}")
            out.choice, out.method = refs.choices[refs.fastest], f"kept {refs.fastest}"
            out.step_s, out.peak, out.fits = c.step_s, c.mem_bytes, True
        return out
    # the best reference layout that fits seeds the search: the solver starts from it and can
    # only improve on it (a portfolio start, as MIP solvers take from heuristics)
    hint = refs.assign[refs.best] if refs.best is not None else None
    t2 = time.perf_counter()
    # the other mode's placements, node for node: a start for the solver (each variable at its
    # root's strategy) and a candidate itself (the reduced problem's followers and shared
    # variables do not always let the solver find them again in the recomputing graph)
    carried = carried_choice(sp, seed.sp, seed.choice) if seed is not None else None
    seeds = [tuple(carried[r] for r in sp.var_root)] if carried is not None else []
    # a mode seeded with another's plan has that plan to fall back on: half the time
    polish = True if seed_only else None
    sol = _solve_within_budget(sp, limit, dl.cap(time_limit_s / 2 if seeds else time_limit_s),
                               hint, seeds, dl, must_fit=must_fit, local_polish=polish)
    timings["solve_s"] += time.perf_counter() - t2
    if not sol.feasible:
        out.sol = sol
        return out
    choice, sol, method = _select(sp, [sol], refs, min_gain, limit, carried)
    # gradient buckets the plan leaves nearly empty priced at their real fill, the problem
    # solved again from this solution and the references completed again at those prices
    # (see passes.bucket_fill); a few rounds, as each plan may leave another bucket empty.
    # A reference's completion is looked at too when the chosen plan's buckets fill: it is
    # what the benchmarks run as that layout, and a near-empty bucket priced as a full one's
    # member would leave it an extra collective.
    for _ in range(REPRICE_ROUNDS):
        if dl.expired():
            dl.cut("gradient buckets not repriced")
            break
        if not (bucket_fill.reprice(sp, choice, limit)
                or any(bucket_fill.reprice(sp, c, limit) for c in refs.choices.values())):
            break
        t3 = time.perf_counter()
        again = _solve_within_budget(sp, limit, dl.cap(max(1.0, time_limit_s / 4)),
                                     tuple(sol.assignment), deadline=dl,
                                     restarts=RETRY_RESTARTS, local_polish=polish)
        timings["solve_s"] += time.perf_counter() - t3
        t4 = time.perf_counter()
        # each reference's better completion: at the new prices (they may avoid the bucket)
        # or as before (one plan's fills, priced on all, may misguide a reference's)
        again_refs = _References.score(sp, mpg, references, dl.cap(time_limit_s), limit,
                                       workers)
        refs = refs.rescored(sp, limit).better(again_refs, limit)
        timings["references_s"] += time.perf_counter() - t4
        choice, sol, method = _select(sp, [sol, again], refs, min_gain, limit, carried)
    scored = bucket_fill.score(sp, choice).cost
    # never slower than data parallelism (weighed as the solver's own plan is, against the
    # references' margin); where it is faster, the search missed its basin, and the local
    # moves polish it (the shared-block model of test_data_parallel.py: 12.3 -> 8.6 ms)
    dp = _data_parallel(sp)
    if dp is not None:
        candidates = [sol, dp]
        if _scored_faster(sp, dp, scored, limit) and not dl.expired():
            candidates.append(solve(sp.problem, timeout_s=dl.cap(LOCAL_POLISH_S),
                                    hint=dp.assignment, method="heuristic"))
        choice, sol, method = _select(sp, candidates, refs, min_gain, limit, carried)
        scored = bucket_fill.score(sp, choice).cost
    out.refs, out.sol, out.choice, out.method = refs, sol, choice, method
    out.step_s, out.peak = scored.step_s, scored.mem_bytes
    out.fits = fits_budget(scored.mem_bytes, limit)
    if out.fits and shown:
        dl.found(out.step_s)
    return out


def _data_parallel(sp: ShardingProblem) -> Solution | None:
    """Data parallelism (:mod:`autopar.passes.problem.data_parallel`) as a candidate plan,
    where the model admits it, weighed by its full score against the mode's plan once that
    is final: so no plan is slower than data parallelism. (As a start of the sweeps, or a
    candidate before the repricing rounds, it led the search to points the problem prices
    within a hair of the others' and the full score 2-30% dearer: llama3-70b on 16 x 8,
    llama3-1b on 8 x 8.)"""
    start = data_parallel_assignment(sp)
    if start is None:
        return None
    assert sp.problem is not None
    cost, ok, peak = evaluate(sp.problem, start)
    return Solution(start, cost, ok, "feasible" if ok else "timeout-no-solution", 0.0,
                    DATA_PARALLEL, None, peak)


DATA_PARALLEL = "data parallelism"  # the method of _data_parallel's plan


def _scored_faster(sp: ShardingProblem, sol: Solution, than: PlanCost, limit: float | None
                   ) -> bool:
    """Whether ``sol`` fits ``limit`` and its full score is faster than ``than``."""
    if not sol.feasible:
        return False
    cost = bucket_fill.score(sp, sp.expand(sol.assignment)).cost
    return fits_budget(cost.mem_bytes, limit) and cost.step_s < than.step_s


def carried_choice(sp: ShardingProblem, other: ShardingProblem, choice: list[int]) -> list[int]:
    """The plan ``choice`` on ``other`` (another mode's problem of the same graph) as a
    strategy for every node of ``sp``, a copy as its original (the strategy lists of one op
    on one shape are built alike in both problems)."""
    by_name = {n.name: s for n, s in zip(other.nodes, choice)}
    return [by_name[n.meta["autopar"].extra.get("recomputes", n.name)] for n in sp.nodes]


def recompute_record(asked: str, mode: str, mpg: PlanGraph, sp: ShardingProblem,
                     choice: list[int], base: ShardingProblem) -> Recompute:
    """What a plan on ``mpg`` (recomputation applied) recomputes, per traced layer, and its
    price (:func:`recompute_price`, against ``base``, the problem without it). ``nodes``
    lists every copied node, re-gathered parameter views too (the runtime copies them all);
    the layers, counts and price are the activations' only (re-gathering is the parameter
    state's, :class:`autopar.ir.param_state.ParamState`)."""
    names = tuple(mpg.recomputed.values())
    if not names:
        return Recompute(asked, "none")
    per_layer: dict[int, int] = {}
    for n in mpg.graph.nodes:
        if n.name in mpg.recomputed and not zero_mod.is_param_view(n):
            ly = n.meta["autopar"].layer
            per_layer[ly] = per_layer.get(ly, 0) + 1
    if not per_layer:
        return Recompute(asked, "none", names)
    extra_s, saved = recompute_price(sp, choice, base)
    return Recompute(asked, mode, names, tuple(sorted(per_layer)), extra_s, saved, per_layer)


def recompute_price(sp: ShardingProblem, choice: list[int], base: ShardingProblem
                    ) -> tuple[float, float]:
    """(extra step time, peak memory saved) of a recomputing plan: its copies' compute and the
    collectives of their inputs, and its peak against the same placements on ``base``, the
    problem of the graph without recomputation (a re-gathered parameter view is no
    recomputation: its gather is the parameter state's price)."""
    copies = {i for i, n in enumerate(sp.nodes) if "recomputes" in n.meta["autopar"].extra
              and not zero_mod.is_param_view(n)}
    if not copies:
        return 0.0, 0.0
    w = sp.weight if sp.weight is not None else np.ones(len(sp.nodes))
    extra = sum(float(sp.node_cost[i][choice[i]]) for i in copies)
    for e in sp.edges:
        if e.dst in copies and e.in_idx >= 0:
            src = sp.strategies[e.src][choice[e.src]].outs[e.out_idx]
            dst = sp.strategies[e.dst][choice[e.dst]].ins[e.in_idx]
            if src != dst:
                extra += sum(c.time_s for c in edge_collectives(sp, e, src, dst)) * w[e.dst]
    by_name = {n.name: s for n, s in zip(sp.nodes, choice)}
    kept = score_assignment(base, [by_name[n.name] for n in base.nodes]).cost.mem_bytes
    return extra, max(0.0, kept - score_assignment(sp, choice).cost.mem_bytes)


@dataclass
class _References:
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
              time_limit_s: float, budget: float | None, workers: int = 1) -> _References:
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
        return _References.of(cost, choices, assign, budget)

    @staticmethod
    def of(cost: dict[str, PlanCost], choices: dict[str, list[int]],
           assign: dict[str, tuple[int, ...] | None], budget: float | None) -> _References:
        fitting = [n for n, c in cost.items() if fits_budget(c.mem_bytes, budget)]
        seeds = [n for n in fitting if assign[n] is not None]
        best = min(seeds, key=lambda n: cost[n].step_s) if seeds else None
        fastest = min(fitting, key=lambda n: cost[n].step_s) if fitting else None
        return _References(cost, choices, assign, best, fastest)

    def rescored(self, sp: ShardingProblem, budget: float | None) -> _References:
        """The same completions, scored again (after the problem was repriced)."""
        cost = {n: bucket_fill.score(sp, c).cost for n, c in self.choices.items()}
        return _References.of(cost, self.choices, self.assign, budget)

    def better(self, other: _References, budget: float | None) -> _References:
        """Per reference, the cheaper of its two completions."""
        cost, choices, assign = dict(self.cost), dict(self.choices), dict(self.assign)
        for n, c in other.cost.items():
            if n not in cost or c.step_s < cost[n].step_s:
                cost[n], choices[n], assign[n] = c, other.choices[n], other.assign[n]
        return _References.of(cost, choices, assign, budget)


def _select(sp: ShardingProblem, sols: list[Solution], refs: _References, min_gain: float,
            budget: float | None, carried: list[int] | None = None
            ) -> tuple[list[int], Solution, str]:
    """The plan: the cheapest solution, its followers refined (re-chosen with their whole
    neighbourhood), unless the best reference, as the solver completes it, is within
    ``min_gain`` of it. ``carried``: another recomputation mode's plan, node for node, a
    candidate too. Returns the choice, the solution it came from, and how it was made."""
    candidates: list[tuple[list[int], Solution]] = []
    for sol in sols:
        if sol.feasible:
            solved = sp.expand(sol.assignment)
            candidates += [(refine_followers(sp, solved), sol), (solved, sol)]
    if carried is not None and candidates:
        candidates.append((carried, replace(candidates[0][1], method="carried from mode none")))
    scored = [bucket_fill.score(sp, c).cost for c, _ in candidates]
    fit = [k for k, c in enumerate(scored) if fits_budget(c.mem_bytes, budget)]
    k = min(fit, key=lambda k: scored[k].step_s) if fit else 0  # the first if none fits
    (choice, sol), own = candidates[k], scored[k].step_s
    method = sol.method
    best = refs.fastest
    if best is not None:
        ref = refs.cost[best].step_s
        if own * (1 + min_gain) > ref:
            gain = ref / own - 1 if own > 0 else 0.0
            choice = refs.choices[best]
            method = (f"kept {best}: the solver's own plan was {gain:.1%} faster, under the "
                      f"{min_gain:.0%} margin" if gain >= 0 else
                      f"kept {best}: the solver's own plan was {-gain:.1%} slower")
    return choice, sol, method


def planner_solve(
    sp: ShardingProblem, problem: Problem, time_limit_s: float, hints: list | None = None,
    domains: list[np.ndarray] | None = None, local_polish: bool | str = False,
    restarts: int = 16,
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
    ``restarts``: the sweeps' random starts besides the hints. A problem whose limit no
    assignment fits (:func:`autopar.solver.problem.cannot_fit`: a memory fit's tightened
    limit, a reference that cannot fit) is answered at once: the sweeps would spend their
    whole time finding nothing (llama3-405b pp=16 x dp=64 x tp=8: 3 of the stand-in's 6
    solves, each its full half of the limit)."""
    t0 = time.perf_counter()
    if cannot_fit(problem):
        return _cannot_fit(t0)
    best = solve_axiswise(sp, problem, time_limit_s / 2, hints, domains=domains,
                          restarts=restarts)
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


def _cannot_fit(t0: float) -> Solution:
    """The answer to a problem no assignment fits (:func:`cannot_fit`)."""
    return Solution((), math.inf, False, "infeasible", time.perf_counter() - t0,
                    "memory bound: no assignment fits the limit")


def _solve_within_budget(
    sp: ShardingProblem, budget: float | None, time_limit_s: float,
    hint: tuple[int, ...] | None = None, more_hints: list[tuple[int, ...]] | None = None,
    deadline: Deadline | None = None, restarts: int = 16, must_fit: bool = False,
    local_polish: bool | None = None,
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
    (:func:`planner_solve`'s ``"always"``); None: where there is a budget.
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
                           local_polish=budget is not None if local_polish is None
                           else local_polish,
                           restarts=restarts if budget is None else min(restarts, LIMIT_RESTARTS))
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
            tight[instant] = _with_limit(p_t, lim)
        sp.peak_time, sp.problem, problem = instant, at_budget[instant], tight[instant]
        # a retry starts from a solution that nearly fits: a quarter of the time is plenty
        # (a whole budget let the general solver search 16 s for llama3-405b's full mode)
        retry_s = max(1.0, time_limit_s / 4)
        retry = _solve_or_search(sp, problem, deadline.cap(retry_s) if deadline else retry_s,
                                 [sol.assignment, tuple(int(np.argmin(u)) for u in problem.usages)],
                                 time.perf_counter(), local_polish=True,
                                 restarts=RETRY_RESTARTS)
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
                     restarts: int = 16) -> Solution:
    """:func:`_search_once`, or its answer to the same problem from the same starts earlier
    in this planning call (:mod:`autopar.planning.solve_memo`)."""
    return solve_memo.solved(
        problem, hints, (local_polish, restarts), time_limit_s,
        lambda: _search_once(sp, problem, time_limit_s, hints, t0, local_polish, restarts))


def _search_once(sp: ShardingProblem, problem: Problem, time_limit_s: float,
                  hints: list, t0: float, local_polish: bool = False,
                  restarts: int = 16) -> Solution:
    """:func:`planner_solve`, then, where it found nothing that fits a memory limit, the
    general solver for the time left. ``local_polish``: a memory fit's retry, which starts
    from a solution that nearly fits, is polished by local moves, not CP-SAT (under a memory
    limit CP-SAT rarely proves anything on the planner's problems and spends its whole polish
    budget, round after round: 2 s a round on a 20-variable MLP)."""
    sol = planner_solve(sp, problem, time_limit_s, hints or None,
                        local_polish="always" if local_polish else False, restarts=restarts)
    left = time_limit_s - (time.perf_counter() - t0)
    if sol.feasible or problem.usage_limit is None or left < 1.0 or sol.status == "infeasible":
        return sol
    lean = hints[-1] if hints else None
    other = solve(problem, timeout_s=left, hint=lean)
    return other if other.feasible else sol


def _with_limit(p: Problem, limit: float | None) -> Problem:
    return Problem(p.costs, p.usages, p.intervals, p.edges, p.edge_costs, limit, p.names, p.name)


# --- reference plans ------------------------------------------------------------------------


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
            return _cannot_fit(time.perf_counter())
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


# --- assembling the plan --------------------------------------------------------------------


def assemble_plan(
    pg: PlanGraph, sp: ShardingProblem, choice: list[int], model_name: str, mesh: Mesh,
    solver: SolverInfo, timings: dict[str, float], references: dict[str, PlanCost],
    memory_budget: float | None, limit_source: str = "given",
    recompute: Recompute | None = None,
) -> Plan:
    """The plan of ``choice`` on ``pg`` (the graph as planned: recomputation applied)."""
    scored = bucket_fill.score(sp, choice)
    params: dict[str, Spec] = {}
    inputs: dict[str, Spec] = {}
    input_shapes: dict[str, list[int]] = {}
    nodes: dict[str, NodePlacement] = {}
    for i, n in enumerate(sp.nodes):
        s = sp.strategies[i][choice[i]]
        f = n.meta["autopar"]
        nodes[n.name] = NodePlacement(s.ins, s.outs, s.impls, s.raw_outs)
        if f.role == "param":
            params[f.param_name] = s.outs[0]
        elif f.role == "input" and f.input_index is not None and f.out is not None:
            key = pg.input_names[f.input_index]
            inputs.setdefault(key, s.outs[0])
            input_shapes.setdefault(key, list(f.out.shape))
    if pg.proxy is not None:  # untraced layers take the placements of the layer they stand for
        params = {name: params[pg.proxy.traced_name(name)] for name in pg.all_param_names}
    return Plan(
        Decisions(
            mesh_shape=mesh.shape, mesh_axes=mesh.axes, device=mesh.device.name,
            params=params, inputs=inputs, nodes=nodes, input_shapes=input_shapes,
            precision=pg.precision or Precision(), recompute=recompute or Recompute(),
            param_state=zero_stages.param_state(pg, sp, choice),
            first_bucket_bytes=first_bucket_bytes(mesh.device),
            merged_sums=tuple(tuple(mesh.axes[k] for k in axes)
                              for axes in cm.merged_sums(mesh))),
        Predictions(cost=scored.cost, collectives=tuple(scored.collectives)),
        Provenance(solver=solver, model=model_name, references=references,
                   timings={k: round(v, 4) for k, v in timings.items()},
                   missing_rules=dict(sp.missing_rules), memory_budget=memory_budget,
                   memory_limit_source=limit_source),
    )


def with_recompute(graph: PlanGraph, plan: Plan, mode: Mode | str, mesh: Mesh) -> Plan:
    """``plan`` (made without recomputation, on ``graph`` as captured) with ``mode``'s
    recomputation: every original node placed as in ``plan``, every copy as its original, the
    collectives and costs scored again. The same layout, recomputing: what the property tests
    compare bit for bit, and a way to ask what a mode costs a given plan. ``mode``: a
    :class:`~autopar.planning.modes.Mode` or its label (a recompute mode, with ``+zero3`` to
    re-gather parameters in the backward too, ``+zero1`` to all-reduce the gradients of split
    parameters whole)."""
    if plan.decided.recompute.nodes:
        raise PlanError("with_recompute takes a plan that recomputes nothing")
    mode = Mode.of(mode)
    mpg = mode_graph(graph, mode)
    offload = "auto" if plan.decided.param_state.offloaded else "none"
    sp = sharding_problem.build(mpg, mesh, plan.provenance.memory_budget, share_layers=False,
                                offload=offload, zero1=mode.whole_grads)
    choice = []
    for i, n in enumerate(sp.nodes):
        place = plan.decided.nodes[n.meta["autopar"].extra.get("recomputes", n.name)]
        choice.append(sp.strategy_index(i, place))
    base = sharding_problem.build(graph, mesh, plan.provenance.memory_budget,
                                  share_layers=False,
                                  offload=offload, zero1=mode.whole_grads)
    rec = recompute_record(mode.label, mode.recompute, mpg, sp, choice, base)
    pv = plan.provenance
    return assemble_plan(mpg, sp, choice, pv.model, mesh, pv.solver, dict(pv.timings),
                         dict(pv.references), pv.memory_budget, pv.memory_limit_source, rec)
