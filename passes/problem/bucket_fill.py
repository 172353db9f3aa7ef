"""Gradient buckets (and, where plans are scored, parameter gathers) priced at their real fill.

The sharding problem prices a bucketed gradient move at its share of a full bucket's fixed
cost: its bytes over ``BUCKET_BYTES`` (pairwise, as the IOPDDL form needs). That is right
where many gradients reduce over the same mesh axes (data parallelism fills bucket after
bucket) and wrong where few do: in a tensor-parallel plan, the row-parallel biases' gradients,
partial over ``tp``, make a bucket of a few KiB that still costs a whole collective, priced at
almost nothing. The solver then trades a collective for a few microseconds of compute.

:func:`measure` reads, from a solution, how full each kind of bucket really is (bytes per
bucket, per ``(collective, mesh axes, dtype)``); buckets under ``NEARLY_EMPTY`` count as
under-full. :func:`reprice` prices the problem's gradient edges at those fills
(``ShardingProblem.bucket_fill``, read by ``edge_costs``) and rebuilds the reduced problem,
when that makes the solution's predicted step time dearer by more than ``MIN_CHANGE``; the
planner then solves again from that solution. Fuller buckets keep the full-bucket price, so a
data-parallel plan, with the large models whose planning time counts, never pays for a second
solve. Those fills are one plan's, applied by the solver to every plan; plans and references
are compared and reported by :func:`score`, each at its own buckets' fill.

Parameter gathers are batched too, one all-gather per layer, phase and axis (as FSDP gathers
a wrapped module's parameters), so a layer of a few KiB of parameters pays a whole collective.
:func:`score` prices them at their groups' fill, so plans are reported and compared at it;
the solver's prices leave them at a full batch's share (repricing them too sent Llama-3 8B on
8x8 through more solves and reference completions, 6.5 -> 14.6 s, for the same plan).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autopar.passes.cost.buckets import (
    FIRST_BUCKET_BYTES,
    GradSync,
    ParamGather,
    bucket_collectives,
    bucket_kind,
    first_bucket_bytes,
    gather_group_bytes,
    gather_groups,
    gather_move,
    sync_groups,
)
from autopar.passes.problem.edge_costs import (
    edge_meta,
    gather_unit,
    is_param_gather,
    matrix_cache,
    sync_target,
)
from autopar.passes.problem.reduction import assign_variables, merge_followers, reduced_problem
from autopar.passes.problem.types import ShardingProblem

if TYPE_CHECKING:
    from autopar.passes.problem.scoring import Scored

MIN_CHANGE = 0.005  # reprice (and solve again) only if the step gets at least this much dearer
# Buckets holding less than DDP's first bucket are repriced. Fuller ones keep the full-bucket
# price: it stands in for what the cost model does not credit, the overlap of bucketed
# gradient reductions with the rest of the backward (a data-parallel step hides most of its
# buckets behind it), which a bucket of a few KiB, latency-bound, does not buy back.
NEARLY_EMPTY = FIRST_BUCKET_BYTES


def measure(sp: ShardingProblem, choice: list[int], gathers: bool = False
            ) -> dict[tuple, float]:
    """Bytes per rank per bucket, for each bucket key whose buckets are under-full in
    ``choice`` (one strategy per node); with ``gathers``, the parameter gathers' groups too."""
    syncs = []
    for k, e in enumerate(sp.edges):
        if e.in_idx >= 0:
            continue
        src = sp.strategies[e.src][choice[e.src]].outs[e.out_idx]
        dst = sync_target(sp, e, src, sp.strategies[e.dst][choice[e.dst]].outs[0])
        if src != dst and bucket_kind(src, dst) is not None:
            weight = float(sp.weight[e.dst]) if sp.weight is not None else 1.0
            syncs.append(GradSync(k, edge_meta(sp, e), src, dst, weight))
    totals: dict[tuple, float] = {}
    counts: dict[tuple, int] = {}
    for group, kind in sync_groups(syncs, sp.mesh.shape,
                                   first_bytes=first_bucket_bytes(sp.mesh.device)):
        if kind is None:
            continue
        key = (kind.kind, kind.axes, group[0].meta.dtype)
        nbytes = bucket_collectives(group, sp.mesh.shape)[0][2]  # per rank, every axis alike
        totals[key] = totals.get(key, 0.0) + nbytes
        counts[key] = counts.get(key, 0) + 1
    if gathers:
        _measure_gathers(sp, choice, totals, counts)
    fills = {key: totals[key] / counts[key] for key in totals}
    return {key: f for key, f in fills.items() if f < NEARLY_EMPTY}


def gather_key(axis: int, dtype: object) -> tuple:
    """The fill key of parameter gathers over mesh axis ``axis`` (``edge_costs`` reads it)."""
    return ("param_gather", axis, dtype)


def _measure_gathers(sp: ShardingProblem, choice: list[int], totals: dict, counts: dict) -> None:
    """Parameter gathers go out one all-gather per layer, phase and axis
    (:func:`autopar.passes.cost.buckets.gather_groups`): what each such group gathers, in the
    units a move is priced by (the gathered buffer)."""
    gathers = []
    for k, e in enumerate(sp.edges):
        if not is_param_gather(sp, e):
            continue
        src = sp.strategies[e.src][choice[e.src]].outs[e.out_idx]
        dst = sp.strategies[e.dst][choice[e.dst]].ins[e.in_idx]
        if src != dst and gather_move(src, dst) is not None:
            gathers.append(ParamGather(k, gather_unit(sp.nodes[e.dst]), edge_meta(sp, e), src,
                                       dst))
    for group in gather_groups(gathers):
        axis = gather_move(group[0].src, group[0].dst)[0]
        key = gather_key(axis, group[0].meta.dtype)
        nbytes = gather_group_bytes(group, sp.mesh.shape) * sp.mesh.shape[axis]
        totals[key] = totals.get(key, 0.0) + nbytes
        counts[key] = counts.get(key, 0) + 1


def reprice(sp: ShardingProblem, choice: list[int], memory_budget: float | None) -> bool:
    """Price gradient buckets at their fill in ``choice`` and rebuild the reduced problem, if
    that makes ``choice`` dearer by more than ``MIN_CHANGE``; True if it did."""
    from autopar.passes.problem.scoring import score_assignment

    # keys found under-full before keep their price, so that rounds do not undo each other
    fills = {**sp.bucket_fill, **measure(sp, choice)}
    if fills == sp.bucket_fill:
        return False
    old = sp.bucket_fill
    before = score_assignment(sp, choice).cost.step_s
    _set(sp, fills)
    after = score_assignment(sp, choice).cost.step_s
    if after <= before * (1 + MIN_CHANGE):
        _set(sp, old)
        return False
    _rebuild(sp, memory_budget)
    return True


def score(sp: ShardingProblem, choice: list[int]) -> Scored:
    """``choice`` scored with its own nearly-empty buckets at their fill. Plans are compared and
    reported by this: the solver's prices (``sp.bucket_fill``) are the fills of one plan,
    applied to every plan, and would overcharge one whose buckets fill (a data-parallel
    reference beside a tensor-parallel plan on the same axis)."""
    from autopar.passes.problem.scoring import score_assignment

    key = tuple(choice)
    hit = sp.score_cache.get(key)
    if hit is not None:  # the same (read-only) score: sp.bucket_fill is not read below
        return hit
    old = sp.bucket_fill
    sp.bucket_fill = measure(sp, choice, gathers=True)  # scoring reads no cached edge matrix
    try:
        got = sp.score_cache[key] = score_assignment(sp, choice)
        return got
    finally:
        sp.bucket_fill = old


def apply(sp: ShardingProblem, fills: dict[tuple, float], memory_budget: float | None) -> None:
    """Price ``sp`` at bucket ``fills`` found on another problem of the same graph (a
    reference completed without shared layer variables) and rebuild its reduced problem."""
    if fills != sp.bucket_fill:
        _set(sp, dict(fills))
        _rebuild(sp, memory_budget)


def _rebuild(sp: ShardingProblem, memory_budget: float | None) -> None:
    merge_followers(sp, memory_budget)
    assign_variables(sp, sp.share_layers)
    sp.problem = reduced_problem(sp, memory_budget)


def _set(sp: ShardingProblem, fills: dict[tuple, float]) -> None:
    sp.bucket_fill = fills
    sp.matrix_cache = matrix_cache(sp)  # edge matrices at the new prices
