"""The planner: capture -> strategies + cost model -> solve -> Plan.

``make_plan(model, mesh, example_inputs)`` runs the passes in order and returns a
:class:`Planned` (the plan plus what made it, for explanations and comparisons). Reference
layouts (``autopar.models.reference_plans``) are scored by the same cost model: their parameter
and input placements are pinned and the solver completes the rest at its best, so a reference's
score is the best that layout can do.

Here is the search over modes (recomputation, re-gathering, whole gradients, offload) and
what one mode's plan is; one mode's solve and memory fit are :mod:`autopar.planning.solving`,
the reference completions :mod:`autopar.planning.references`, the plan made of a choice
:mod:`autopar.planning.assemble`.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch.nn as nn

from autopar.capture.joint import capture
from autopar.ir.deadline import MIN_SOLVE_S, Deadline
from autopar.ir.errors import PlanError
from autopar.ir.graph import PlanGraph
from autopar.ir.mesh import Mesh
from autopar.ir.options import Options, SearchOptions, fits_budget
from autopar.ir.plan import (
    Plan,
    PlanCost,
    SolverInfo,
)
from autopar.passes.problem import bucket_fill, sharding_problem
from autopar.passes.problem.axis_search import solve_axiswise
from autopar.passes.problem.data_parallel import data_parallel_assignment
from autopar.passes.problem.reduction import refine_followers
from autopar.passes.problem.step_memory import step_peak
from autopar.passes.problem.types import ShardingProblem
from autopar.planning import solve_memo
from autopar.planning.assemble import assemble_plan, recompute_record
from autopar.planning.explain import explain_node
from autopar.planning.memory_fit import memory_limit, no_fit_message
from autopar.planning.mode_jobs import per_worker_share, portable, restored
from autopar.planning.modes import Mode, candidate_modes, mode_graph, reference_mode
from autopar.planning.parallel_map import Ahead, forked_map, usable_workers
from autopar.planning.references import References
from autopar.planning.solving import (
    LOCAL_POLISH_S,
    RETRY_RESTARTS,
    RETRY_STARTS_REPLICATED,
    solve_within_budget,
    with_limit,
)
from autopar.solver import Solution, evaluate, heuristic, solve

REPRICE_ROUNDS = 3  # at most this many solves again at the real fill of gradient buckets


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


@solve_memo.remembered  # one planning call: modes that build one problem solve it once
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
                                       search.time_limit_s, cut=dl.was_cut))
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
    p = with_limit(sp.problem, None)
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
    refs: References
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
    polish (:func:`solve_within_budget`'s ``local_polish``)."""
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
    refs = References.score(sp, mpg, references, dl.cap(time_limit_s), limit, workers)
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
    sol = solve_within_budget(sp, limit, dl.cap(time_limit_s / 2 if seeds else time_limit_s),
                               hint, seeds, dl, must_fit=must_fit, local_polish=seed_only)
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
        again = solve_within_budget(sp, limit, dl.cap(max(1.0, time_limit_s / 4)),
                                     tuple(sol.assignment), deadline=dl,
                                     restarts=RETRY_RESTARTS, local_polish=seed_only,
                                     replicated_start=RETRY_STARTS_REPLICATED)
        timings["solve_s"] += time.perf_counter() - t3
        t4 = time.perf_counter()
        # each reference's better completion: at the new prices (they may avoid the bucket)
        # or as before (one plan's fills, priced on all, may misguide a reference's)
        again_refs = References.score(sp, mpg, references, dl.cap(time_limit_s), limit,
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


def _select(sp: ShardingProblem, sols: list[Solution], refs: References, min_gain: float,
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
