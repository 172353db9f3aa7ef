"""A pipeline's cost from one stage's profile: the options, the split, the replay.

What :mod:`autopar.planning.pipeline` weighs once a stage's intra-op plan is priced per part
(:mod:`.stage_profile`): the microbatch counts worth planning, the (schedule, stages per
rank) that can run ``p`` ranks over ``m`` microbatches, and for each of them the best
contiguous split of the blocks (:mod:`.stage_split`: Alpa's DP under the memory limit, each
stage with its schedule's in-flight count, the first stage also holding the embedding and the
last the head) replayed in the schedule model (:mod:`.pipeline_schedule`), with the boundary
sends priced on the ``pp`` link and each rank's gradient sync after its last action.

Beside the stages' own work the replay charges what running them costs
(:class:`Overheads`, from the device profile): torch's runtime per action and per send or
receive it posts, the extra graph walk of a split backward per autograd node, and, where the
ranks are processes sharing a CPU's cores, their speed with fewer of them computing.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from autopar.ir.errors import PlanError
from autopar.ir.mesh import Mesh
from autopar.ir.schedules import schedule as schedule_info
from autopar.passes.cost.cost_model import collective_time
from autopar.passes.pipeline.schedule import (
    SCHEDULES,
    SINGLE_STAGE,
    V_SHAPED,
    PipelineSchedule,
    StageTime,
    canonical_name,
    core_speed,
    step_and_bubble,
)
from autopar.passes.pipeline.stage_profile import PartCost, StageProfile
from autopar.passes.pipeline.stage_split import (
    CostArrays,
    StageCost,
    StageSplit,
    schedule_in_flight,
    split_stages,
)

if TYPE_CHECKING:
    from autopar.ir.plan import Plan

REFINE = 3  # splits per option replayed in the schedule model


@dataclass(frozen=True, slots=True)
class Option:
    """One (schedule, v, m) weighed: its best split (None where none fits or can be cut),
    replayed step, bubble, largest rank memory and slowest rank's sync, or why not."""

    schedule: PipelineSchedule
    split: StageSplit | None
    step_s: float
    bubble: float
    mem_bytes: float
    sync_s: float
    note: str = ""


def microbatch_counts(batch: int, dp: int, p: int, asked: int | None) -> list[int]:
    """The microbatch counts to plan: ``asked``, checked, or up to two that keep a
    microbatch divisible over ``dp`` (below)."""
    if asked is not None:
        if not isinstance(asked, int) or asked < 1:
            raise PlanError(f"microbatches must be a positive integer, got {asked!r}")
        if batch % asked:
            raise PlanError(f"{asked} microbatches do not divide the batch of {batch}: use a "
                            f"divisor of it ({_divisor_list(batch)})")
        if (batch // asked) % dp:
            raise PlanError(f"{asked} microbatches of {batch // asked} samples do not split "
                            f"over the {dp} data-parallel ranks: use microbatches of a "
                            f"multiple of {dp} samples (m in {_divisor_list(batch, dp)})")
        return [asked]
    valid = [m for m in range(1, batch + 1) if batch % m == 0 and (batch // m) % dp == 0]
    if not valid:
        raise PlanError(f"the batch of {batch} does not split over {dp} data-parallel ranks: "
                        f"use a multiple of {dp}")
    # first the fewest microbatches that keep 1F1B's bubble near a third ((p-1)/m, m >= 2p),
    # then the fewest that fill the pipeline at all (m >= p): more microbatches shrink the
    # bubble but pay each microbatch's fixed costs again (gathers, sends, small kernels)
    out: list[int] = []
    for floor in (2 * p, p):
        m = min((m for m in valid if m >= floor), default=max(valid))
        if m not in out:
            out.append(m)
    return out


def _divisor_list(batch: int, dp: int = 1) -> str:
    return ", ".join(str(m) for m in range(1, batch + 1)
                     if batch % m == 0 and (batch // m) % dp == 0)


def schedule_names(schedule: str | None) -> list[str]:
    if schedule is None or schedule == "auto":
        return list(SCHEDULES)
    return [canonical_name(schedule)]


LOOPED_SEARCH_V = (2, 4)  # stages per rank the planner tries on its own for a looped schedule


def schedule_options(names: Sequence[str], p: int, m: int, n_blocks: int,
               virtual: int | None) -> list[PipelineSchedule]:
    """Every valid (schedule, v) for ``p`` ranks, ``m`` microbatches and ``n_blocks``.
    Unasked, a looped schedule is tried at :data:`LOOPED_SEARCH_V` stages per rank only
    (each ``v`` is one more split and replay per layout); ``virtual`` given is taken as it
    is, any ``v`` that leaves every one of the ``p * v`` stages a block (Megatron's
    interleaved layouts run 3 per rank: SC'21's 76B and 530B)."""
    out = []
    for name in names:
        if name in SINGLE_STAGE:
            vs = [1]
        elif name in V_SHAPED:
            vs = [2]
        elif virtual is not None:
            vs = [virtual] if virtual > 1 else []  # one per rank: GPipe / 1F1B's
        else:
            vs = list(LOOPED_SEARCH_V)
        for v in vs:
            if (virtual is not None and v != virtual) or p * v > n_blocks:
                continue
            try:
                out.append(PipelineSchedule(name, p, v, m))
            except PlanError:
                continue  # torch's own conditions (1F1B needs m >= p, rounds of p, ...)
    return out


def stand_in_flight(scheds: Sequence[PipelineSchedule]) -> float:
    """Microbatches of one stage's activations the busiest rank holds, over the schedules
    to weigh. Schedules that run every forward first (GPipe, LoopedBFS) hold every
    microbatch: they count only where nothing else runs, or every other schedule's stand-in
    would be planned needlessly lean."""
    pool = [s for s in scheds if not schedule_info(s.name).forwards_first] or list(scheds)
    worst = 1.0
    for s in pool:
        held = schedule_in_flight(s)
        for r in range(s.p):
            worst = max(worst, sum(held(k, s.num_stages) for k in s.rank_stages(r)) / s.v)
    return worst


def send_time(nbytes: float, mesh: Mesh, axis: int) -> float:
    if nbytes <= 0:
        return 0.0
    return mesh.latency[axis] + nbytes / mesh.bandwidth[axis]


@dataclass(frozen=True, slots=True)
class Overheads:
    """What a pipeline's run costs beside its stages' work: a boundary tensor's send, the
    runtime's host time per action and per send or receive posted to another rank, a split
    backward's per-autograd-node walk, and ``speed[k]`` of a rank while ``k`` of the ``p``
    compute (None: each at full speed whatever the others do)."""

    send_s: float
    action_s: float = 0.0
    post_s: float = 0.0
    node_s: float = 0.0
    speed: tuple[float, ...] | None = None
    tied_s: float = 0.0  # summing a tied weight's gradient between the end stages' ranks


def overheads(boundary_bytes: float, mesh: Mesh, axis: int,
              tied_bytes: float = 0.0) -> Overheads:
    """The overheads of a pipeline along ``axis`` of ``mesh``, priced by its device profile;
    every rank of the pipeline is the stage submesh's processes (its dp and tp peers).
    ``tied_bytes``: a weight the first and last stages share, all-reduced between the two
    once per step where they are on different ranks."""
    prof = mesh.device
    p = mesh.shape[axis]
    speed = core_speed(p, mesh.size // p, prof.shared_cores) if prof.shared_cores else None
    tied = collective_time("all_reduce", tied_bytes, 2, mesh.bandwidth[axis],
                           mesh.latency[axis], prof.collective_overhead) if tied_bytes else 0.0
    return Overheads(send_time(boundary_bytes, mesh, axis), prof.pipeline_action_s,
                     prof.p2p_post_s, prof.split_backward_node_s, speed, tied)


def stage_time(sched: PipelineSchedule, prof: StageProfile, i: int, j: int, n_blocks: int,
               over: Overheads) -> StageTime:
    """The replay's times of a stage holding blocks [i, j), its overheads included. A stage
    whose backward cannot split (a stage program whose backward gathers parameters) runs it
    whole in the input action; one
    that splits it pays a second graph walk per autograd node and, where it recomputes, the
    recomputation again (the input and the weight pass each rerun the forward they need)."""
    fwd, bwd, _, _, kept = chunk_cost(prof, i, j, n_blocks)
    if not (sched.splits_backward and prof.splits_backward):
        share = prof.weight_share if prof.splits_backward else 0.0
        return StageTime.of(fwd, bwd, share, over.send_s, kept, over.action_s, 0.0, over.post_s)
    parts = chunk_parts(prof, i, j, n_blocks)
    nodes = sum(c.nodes * k for c, k in parts)
    again = sum(c.recompute_s * k for c, k in parts)
    return StageTime.of(fwd, bwd, prof.weight_share, over.send_s, kept, over.action_s,
                        nodes * over.node_s + again, over.post_s)


def chunk_parts(prof: StageProfile, i: int, j: int, n_blocks: int
                ) -> list[tuple[PartCost, int]]:
    """The parts a stage of blocks [i, j) holds, each with its count: the blocks, and the
    embedding on the first stage, the head on the last."""
    return [(prof.block, j - i)] + ([(prof.pre, 1)] if i == 0 else []) \
        + ([(prof.post, 1)] if j == n_blocks else [])


def chunk_cost(prof: StageProfile, i: int, j: int, n_blocks: int) -> tuple[float, ...]:
    """(forward, backward, sync, state + transient, kept per microbatch) of blocks [i, j)."""
    parts = chunk_parts(prof, i, j, n_blocks)
    fwd = sum(c.forward_s * k for c, k in parts)
    bwd = sum(c.backward_s * k for c, k in parts)
    sync = sum(c.sync_s * k for c, k in parts)
    held = sum(c.state_bytes * k for c, k in parts) + max(c.transient_bytes for c, _ in parts)
    kept = sum(c.saved_bytes * k for c, k in parts)
    return fwd, bwd, sync, held, kept


def weigh(sched: PipelineSchedule, prof: StageProfile | Sequence[StageProfile], n_blocks: int,
          limit: float | None, over: Overheads) -> Option:
    """The best split for one schedule, replayed: its step and peak, or why it fails.
    ``prof``: the stage's profile, or several (one per recomputation mode of one layout,
    the first preferred on ties): the DP gives each stage the fastest that fits it with its
    own in-flight count (:func:`autopar.passes.pipeline.stage_split.split_stages`'s choices
    per chunk), so a stage holding few microbatches recomputes less and may take more blocks;
    the split's ``submeshes`` are the profiles its stages run."""
    profs = (prof,) if isinstance(prof, StageProfile) else tuple(prof)
    try:
        split = split_stages(n_blocks, _no_cost, sched.p, sched.m,
                             math.inf if limit is None else limit, v=sched.v,
                             schedule=sched.name, refine=REFINE, submeshes=profs,
                             tables=[range_arrays(pk, n_blocks) for pk in profs])
    except PlanError as e:
        return Option(sched, None, math.inf, 0.0, math.inf, 0.0, str(e).split(":")[0])
    step, bubble, sync = replay(sched, split.submeshes, split.ranges, n_blocks, over)
    return Option(sched, split, step, bubble, max(split.rank_memory_bytes), sync)


@functools.lru_cache(maxsize=32)
def range_arrays(prof: StageProfile, n_blocks: int) -> CostArrays:
    """Every block range's :func:`chunk_cost` as the DP reads it (time, held memory, kept
    per microbatch), tabulated at once, once per profile for all the schedules weighed."""
    i, j = np.indices((n_blocks + 1, n_blocks + 1))
    k = (j - i).astype(float)
    first, last = (i == 0).astype(float), (j == n_blocks).astype(float)
    b, pre, post = prof.block, prof.pre, prof.post

    def add(f: Callable[[PartCost], float]) -> np.ndarray:
        # as chunk_cost adds them: the blocks, then the embedding, then the head
        return 0.0 + f(b) * k + f(pre) * first + f(post) * last

    fwd = add(lambda c: c.forward_s)
    bwd = add(lambda c: c.backward_s)
    trans = np.maximum(b.transient_bytes, np.maximum(np.where(first > 0, pre.transient_bytes, 0),
                                                     np.where(last > 0, post.transient_bytes, 0)))
    return CostArrays(fwd + bwd, add(lambda c: c.state_bytes) + trans,
                      add(lambda c: c.saved_bytes))


def _no_cost(i: int, j: int, sub: object) -> StageCost:
    raise AssertionError("the ranges' costs are tabulated (range_arrays)")


def stage_profiles(prof: StageProfile | Sequence[StageProfile], n: int
                   ) -> tuple[StageProfile, ...]:
    """Each of ``n`` stages' profile: ``prof`` for all, or one per stage."""
    if isinstance(prof, StageProfile):
        return (prof,) * n
    if len(prof) != n:
        raise PlanError(f"{len(prof)} stage profiles for {n} stages: give one, or one per stage")
    return tuple(prof)


def replay(sched: PipelineSchedule, prof: StageProfile | Sequence[StageProfile],
           ranges: Sequence[tuple[int, int]], n_blocks: int, over: Overheads
           ) -> tuple[float, float, float]:
    """(step, bubble, slowest rank's gradient sync) of ``sched`` over stages holding the
    block ranges ``ranges``, each priced by its own profile (``prof``: one for every stage,
    or one per stage): the schedule replayed, plus each rank's sync after it."""
    times = []
    rank_sync = [0.0] * sched.p
    for k, ((i, j), pk) in enumerate(zip(ranges, stage_profiles(prof, len(ranges)))):
        times.append(stage_time(sched, pk, i, j, n_blocks, over))
        rank_sync[sched.stage_rank(k)] += chunk_cost(pk, i, j, n_blocks)[2]
    ends = {sched.stage_rank(0), sched.stage_rank(len(ranges) - 1)}
    if len(ends) == 2:  # the tied copies' gradients are summed across the two ranks
        for r in ends:
            rank_sync[r] += over.tied_s
    step, bubble = step_and_bubble(sched, times, over.speed)
    return step + max(rank_sync), bubble, max(rank_sync)


def planned_stages(plan: Plan) -> tuple[PipelineSchedule, list[StageTime], list[float],
                                        tuple[float, ...] | None]:
    """A pipeline plan's schedule, each stage's times (as the plan replayed them), each
    rank's gradient sync and the ranks' speeds: what its predicted timeline draws, from the
    plan alone."""
    pipe = plan.decided.pipeline
    if pipe is None:
        raise PlanError("not a pipeline plan (made by plan_pipeline)")
    sched = PipelineSchedule(pipe.schedule, pipe.size, pipe.virtual, pipe.microbatches)
    times, rank_sync = [], [0.0] * sched.p
    for st in pipe.stages:
        times.append(StageTime.of(st.forward_s, st.time_s - st.forward_s, pipe.weight_share,
                                  pipe.send_s, 0.0, pipe.action_s, st.split_s, pipe.post_s))
        rank_sync[st.rank] += st.sync_s
    return sched, times, rank_sync, pipe.speed or None
