"""Inter-op slicing: cut the model's layers into pipeline stages by dynamic programming (Alpa).

Layers ``0 .. L-1`` (embedding, blocks, head: whatever pieces the graph's layer ids give) are
cut into ``n = p*v`` contiguous chunks; chunk ``k`` runs on the rank the schedule gives it
(``k % p`` for looped schedules, a V for ZBV and DualPipeV). ``cost(i, j, submesh)`` prices
layers ``[i, j)`` on one submesh choice: the planner plugs the intra-op planner in there, so
it is called once per (range, submesh) and cached here, ``O(L^2 * |submeshes|)`` calls in all.

Objective, for chunk times ``t_k`` per microbatch (forward + backward) and ``m`` microbatches::

    T = sum_k t_k / v + (m*v - 1) * max_k t_k

At ``v = 1`` it is Alpa's ``sum + (m-1) * max``: the first microbatch's trip through every
stage, then one slowest stage per further microbatch. With ``v`` chunks per rank a rank's
share of one microbatch is ``v`` chunks, and the fill is ``(p-1)`` chunks, not stages: for
equal chunks ``T = (m*v + p - 1) * t``, the interleaved schedule's textbook step. It ranks
splits; with unequal chunks a schedule's real step differs, so ``refine=k`` replays the ``k``
best in the schedule model (``passes/pipeline/schedule``) and keeps the fastest.

Method (Alpa's): the objective is monotone in both the sum and the max, so for each candidate
bound ``t`` on the max (the distinct chunk times, ascending, from the smallest feasible one)
a DP over (chunks, layers) finds the least sum with every chunk at most ``t``; the loop stops
once ``least_sum / v + (m*v-1) * t`` cannot beat the best found. Each DP is ``O(n * L^2)``.

Memory: chunk ``k`` needs ``memory_bytes + in_flight(k, n) * activation_bytes`` (weights,
gradients and optimizer state, plus the activations of the microbatches it holds; in 1F1B
stage ``k`` holds up to ``p - k``). The in-flight counts default to the schedule's own, read
off its order (:func:`schedule_in_flight`). The DP asks each chunk to fit ``memory_limit / v``:
with several chunks per rank this is sufficient, not necessary (it keeps the DP per chunk).
What a rank's chunks leave of the limit is then spent (:func:`_spend_rank_memory`): with the
ranges kept, each rank's chunks move to faster submeshes (less recomputation) wherever the
rank's sum still fits, so a rank holding one chunk with many microbatches in flight and three
with few is limited by what it holds at once, not by a quarter of the device each. The split
reports each rank's exact total.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from autopar.ir.errors import PlanError
from autopar.passes.pipeline.schedule import (
    PipelineSchedule,
    StageTime,
    simulate,
    step_and_bubble,
)

GiB = 1024**3
# splits worse than the best by more than this fraction of the objective are not replayed
REPLAY_WITHIN = 0.05


@dataclass(frozen=True, slots=True)
class StageCost:
    """What a range of layers costs on one submesh: ``time_s`` per microbatch (forward +
    backward), ``memory_bytes`` held whatever the microbatches in flight, ``activation_bytes``
    saved per in-flight microbatch."""

    time_s: float
    memory_bytes: float
    activation_bytes: float = 0.0


CostFn = Callable[[int, int, Any], "StageCost | tuple[float, ...]"]
InFlightFn = Callable[[int, int], float]  # (chunk k, chunks n) -> microbatches it holds


@dataclass(frozen=True, slots=True)
class StageSplit:
    ranges: tuple[tuple[int, int], ...]  # per chunk, in pipeline order: layers [i, j)
    submeshes: tuple[Any, ...]  # per chunk: the submesh choice it runs on
    time_s: tuple[float, ...]  # per chunk, per microbatch
    memory_bytes: tuple[float, ...]  # per chunk, with its in-flight activations
    rank_memory_bytes: tuple[float, ...]  # per rank: the sum over its chunks
    objective_s: float
    schedule: PipelineSchedule
    step_s: float | None = None  # the schedule's replayed step, when refined

    def stage_times(self, forward_share: float = 1 / 3,
                    weight_share: float = 0.5) -> tuple[StageTime, ...]:
        """Per-chunk times for the schedule model; by default forward is a third of a chunk's
        time (the usual 1:2 forward:backward of matmul-bound layers)."""
        return tuple(StageTime.of(t * forward_share, t * (1 - forward_share), weight_share)
                     for t in self.time_s)


def objective(times: Sequence[float], m: int, v: int = 1) -> float:
    """The slicing objective of the module docstring."""
    return sum(times) / v + (m * v - 1) * max(times)


def schedule_in_flight(schedule: PipelineSchedule) -> InFlightFn:
    """The microbatches each stage of ``schedule`` holds, counted so that a rank's stages
    add up to what the rank holds at its peak. A stage's allocations (forwards) and frees
    (backwards) all run on its own rank, so the counts follow from the order alone; unit
    times suffice. A rank's stages peak at different times: under Interleaved1F1B (p=4, v=2,
    m=8) its two stages peak at 8 and 4 on rank 0, but the rank holds 11 at once (Megatron's
    ``2(p-r-1) + (v-1)p + 1``), and rank 1 holds 9, not 8 + 4. Each stage's own peak is
    scaled by its rank's ratio (exact where the rank's stages keep equal activations)."""
    peaks = _stage_peaks(schedule)
    return lambda k, n: peaks[k]


@functools.lru_cache(maxsize=256)
def _stage_peaks(schedule: PipelineSchedule) -> tuple[float, ...]:
    """:func:`schedule_in_flight`'s counts, replayed once per schedule (they depend on the
    order alone; a plan weighs each schedule for every layout and microbatch count)."""
    sim = simulate(schedule, StageTime(1.0, 1.0, 1.0))
    peaks = list(map(float, sim.stage_peak_in_flight))
    for r in range(schedule.p):
        mine = schedule.rank_stages(r)
        total = sum(peaks[k] for k in mine)
        if total > sim.peak_in_flight[r] > 0:
            for k in mine:
                peaks[k] *= sim.peak_in_flight[r] / total
    return tuple(peaks)


def layer_cost(times: Sequence[float], memory: Sequence[float] | None = None,
               activations: Sequence[float] | None = None) -> CostFn:
    """A cost function adding per-layer figures (one submesh; for tests and rough plans)."""
    pre_t = list(itertools.accumulate(times, initial=0.0))
    pre_m = list(itertools.accumulate(memory or [0.0] * len(times), initial=0.0))
    pre_a = list(itertools.accumulate(activations or [0.0] * len(times), initial=0.0))
    return lambda i, j, _submesh: StageCost(pre_t[j] - pre_t[i], pre_m[j] - pre_m[i],
                                            pre_a[j] - pre_a[i])


def split_stages(
    num_layers: int,
    cost: CostFn,
    p: int,
    m: int,
    memory_limit: float = math.inf,
    *,
    v: int = 1,
    submeshes: Sequence[Any] = (None,),
    schedule: str | None = None,
    in_flight: InFlightFn | None = None,
    refine: int = 0,
    forward_share: float = 1 / 3,
    tables: Sequence[CostArrays] | None = None,
) -> StageSplit:
    """The best contiguous split of ``num_layers`` layers into ``p * v`` chunks.

    ``schedule`` (a torch schedule name; default 1F1B, or Interleaved1F1B when ``v > 1``)
    places the chunks on ranks and, unless ``in_flight`` is given, says how many microbatches
    each chunk holds. With ``refine > 1`` the ``refine`` best splits by the objective are
    replayed in the schedule (forward taken as ``forward_share`` of each chunk's time) and
    the fastest is returned, its ``step_s`` set. ``tables``: ``cost`` already tabulated, one
    :class:`CostArrays` per submesh (then ``cost`` is not called)."""
    name = schedule or ("1F1B" if v == 1 else "Interleaved1F1B")
    sched = PipelineSchedule(name, p, v, m)
    n, L = sched.num_stages, num_layers
    if n > L:
        raise PlanError(f"cannot cut {L} layers into {n} pipeline stages (p={p} x v={v}): use "
                        f"at most {L} stages, or trace the model into finer layers")
    if not submeshes:
        raise PlanError("split_stages needs at least one submesh choice")
    flight = in_flight or schedule_in_flight(sched)
    held = [float(flight(k, n)) for k in range(n)]
    table = _CostTable(cost, submeshes, L, tables)
    cap = memory_limit / v
    best = [table.best_fitting(held[k], cap, k, n) for k in range(n)]
    least = _least_sum(best, n, L, math.inf)
    if least is None:
        need = v * _min_max_memory([table.leanest(held[k], k, n) for k in range(n)], n, L)
        raise PlanError(
            f"no split of {L} layers into {n} pipeline stages fits {_size(memory_limit)} per "
            f"device: the leanest split needs {_size(need)}. More pipeline stages, "
            "a schedule with fewer microbatches in flight (1F1B rather than GPipe), "
            "recomputation of activations, or sharding the stages wider would help"
        )
    ranked = _sweep(best, n, L, m, v, keep=max(1, refine), lower_sum=least[0])
    splits = []
    for _, ranges in ranked:
        subs = [int(best[k].sub[r]) for k, r in enumerate(ranges)]
        if v > 1 and len(submeshes) > 1 and math.isfinite(memory_limit):
            subs = _spend_rank_memory(sched, table, held, ranges, subs, memory_limit)
        splits.append(_split(sched, table, held, submeshes, ranges, subs))
    if refine > 1:
        # the formula ranks; the schedule's replay decides among the few best
        steps = [step_and_bubble(sched, sp.stage_times(forward_share))[0] for sp in splits]
        order = sorted(range(len(splits)), key=lambda x: (steps[x], x))
        return replace(splits[order[0]], step_s=steps[order[0]])
    return splits[0]


def _sweep(best, n: int, L: int, m: int, v: int, keep: int, lower_sum: float):
    """The ``keep`` best (objective, ranges), one per bound on the chunk time: the DP's least
    sum under each bound, ascending from the smallest feasible bound, until the bound alone
    rules out beating the ``keep``-th best, or the best by more than ``REPLAY_WITHIN``."""
    thresholds = np.unique(np.concatenate([b.time[np.isfinite(b.time)] for b in best])).tolist()
    # feasibility is monotone in the bound: find the smallest feasible one
    lo, hi = 0, len(thresholds) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if _least_sum(best, n, L, thresholds[mid]) is None:
            lo = mid + 1
        else:
            hi = mid
    found: list[tuple[float, list[tuple[int, int]]]] = []
    for t in thresholds[lo:]:
        bound = lower_sum / v + (m * v - 1) * t  # no split under this bound does better
        if len(found) >= keep and bound >= found[keep - 1][0]:
            break
        if found and bound > found[0][0] * (1 + REPLAY_WITHIN):
            break  # the rest are not worth a replay: far slower by the formula already
        got = _least_sum(best, n, L, t)
        if got is None or any(ranges == got[1] for _, ranges in found):
            continue
        value = objective([float(best[k].time[r]) for k, r in enumerate(got[1])], m, v)
        # stable: among equal objectives the smaller bound (found first) stays first
        found.insert(sum(1 for x in found if x[0] <= value), (value, got[1]))
        del found[keep:]
    return found


def _split(sched: PipelineSchedule, table: _CostTable, held: Sequence[float],
           submeshes: Sequence[Any], ranges: list[tuple[int, int]], subs: Sequence[int]
           ) -> StageSplit:
    times = [float(table.time[s, i, j]) for (i, j), s in zip(ranges, subs)]
    mems = [table.chunk_memory(s, i, j, held[k]) for k, ((i, j), s) in
            enumerate(zip(ranges, subs))]
    per_rank = [0.0] * sched.p
    for k, mem in enumerate(mems):
        per_rank[sched.stage_rank(k)] += mem
    return StageSplit(
        ranges=tuple(ranges),
        submeshes=tuple(submeshes[s] for s in subs),
        time_s=tuple(times),
        memory_bytes=tuple(mems),
        rank_memory_bytes=tuple(per_rank),
        objective_s=objective(times, sched.m, sched.v),
        schedule=sched,
    )


def _spend_rank_memory(sched: PipelineSchedule, table: _CostTable, held: Sequence[float],
                       ranges: Sequence[tuple[int, int]], subs: Sequence[int],
                       limit: float) -> list[int]:
    """``subs`` (each chunk's submesh, each chunk within ``limit / v``) with every rank's
    chunks moved to the submeshes of least total time whose memory sums within ``limit``;
    a chunk only ever moves to a submesh at least as fast as its own, so no chunk slows and
    the replayed step cannot grow. Ranks are independent (each has its own memory); per rank
    the choice is a small knapsack, solved exactly over its Pareto front (memory, time)."""
    out = list(subs)
    for r in range(sched.p):
        mine = sched.rank_stages(r)
        front: list[tuple[float, float, tuple[int, ...]]] = [(0.0, 0.0, ())]
        for k in mine:
            (i, j), own = ranges[k], subs[k]
            t_own = table.time[own, i, j]
            opts = [(table.chunk_memory(s, i, j, held[k]), float(table.time[s, i, j]), s)
                    for s in range(table.time.shape[0]) if table.time[s, i, j] <= t_own]
            grown = sorted((mem + om, t + ot, picks + (s,)) for mem, t, picks in front
                           for om, ot, s in opts if mem + om <= limit)
            front = []
            for cand in grown:  # ascending memory: keep each that is faster than all before
                if not front or cand[1] < front[-1][1]:
                    front.append(cand)
        if not front:  # the chunks' own sum over the limit by rounding (each within limit/v)
            continue
        own_time = sum(float(table.time[subs[k], ranges[k][0], ranges[k][1]]) for k in mine)
        fastest = front[-1]  # the front's last is its fastest
        if fastest[1] < own_time * (1 - 1e-12):
            for k, s in zip(mine, fastest[2]):
                out[k] = s
    return out


def _size(nbytes: float) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.3g} bytes"


@dataclass(frozen=True, slots=True)
class _Fit:
    """Per layer range ``[i, j)`` of one chunk (arrays indexed ``[i, j]``): the time,
    submesh index and memory of its fastest fitting submesh; ``inf`` time where none fits
    or the range cannot be that chunk."""

    time: np.ndarray
    sub: np.ndarray
    mem: np.ndarray


@dataclass(frozen=True)
class CostArrays:
    """A cost function tabulated on one submesh: :class:`StageCost`'s three figures of every
    range ``[i, j)`` at ``[i, j]`` (``(L+1, L+1)`` arrays; only ``i < j`` is read)."""

    time: np.ndarray
    memory: np.ndarray
    activation: np.ndarray


class _CostTable:
    """``cost`` asked once per (range, submesh), as arrays ``[submesh, i, j]``."""

    def __init__(self, cost: CostFn, submeshes: Sequence[Any], L: int,
                 tables: Sequence[CostArrays] | None = None) -> None:
        shape = (len(submeshes), L + 1, L + 1)
        self.time = np.full(shape, math.inf)
        self.memory = np.full(shape, math.inf)
        self.act = np.zeros(shape)
        if tables is not None:
            if len(tables) != len(submeshes):
                raise PlanError(f"{len(tables)} cost tables for {len(submeshes)} submeshes")
            upper = np.triu(np.ones((L + 1, L + 1), dtype=bool), 1)
            for s, t in enumerate(tables):
                self.time[s] = np.where(upper, t.time, math.inf)
                self.memory[s] = np.where(upper, t.memory, math.inf)
                self.act[s] = np.where(upper, t.activation, 0.0)
        else:
            for s, sub in enumerate(submeshes):
                for i in range(L):
                    for j in range(i + 1, L + 1):
                        c = cost(i, j, sub)
                        c = c if isinstance(c, StageCost) else StageCost(*c)
                        self.time[s, i, j] = c.time_s
                        self.memory[s, i, j] = c.memory_bytes
                        self.act[s, i, j] = c.activation_bytes
        # chunk k of n may hold layers [i, j) only with room for the chunks around it
        i, j = np.indices((L + 1, L + 1))
        self._i, self._j, self._L = i, j, L
        self._fastest: dict[tuple[float, float], tuple[_Fit, np.ndarray]] = {}

    def _allowed(self, k: int, n: int) -> np.ndarray:
        i, j, L = self._i, self._j, self._L
        return (i >= k) & (i <= L - n + k) & (j > i) & (j <= L - n + k + 1)

    def best_fitting(self, held: float, cap: float, k: int, n: int) -> _Fit:
        fit, first_mem = self._fastest_fitting(held, cap)
        allowed = self._allowed(k, n)
        # where the range cannot be this chunk, as if nothing fit: inf, the first submesh
        return _Fit(np.where(allowed, fit.time, math.inf), np.where(allowed, fit.sub, 0),
                    np.where(allowed, fit.mem, first_mem))

    def _fastest_fitting(self, held: float, cap: float) -> tuple[_Fit, np.ndarray]:
        """Per range, its fastest submesh that fits ``cap`` holding ``held`` microbatches (any
        chunk: :meth:`best_fitting` masks the ranges a chunk may hold), kept per count: the
        chunks of a schedule often hold the same, and this is most of a split's work); and
        the first submesh's memory of every range."""
        hit = self._fastest.get((held, cap))
        if hit is not None:
            return hit
        mem = self.memory + held * self.act
        time = np.where(mem <= cap, self.time, math.inf)
        sub = np.argmin(time, axis=0)  # ties: the first submesh
        pick = np.take_along_axis
        got = self._fastest[(held, cap)] = (
            _Fit(pick(time, sub[None], 0)[0], sub, pick(mem, sub[None], 0)[0]), mem[0])
        return got

    def chunk_memory(self, s: int, i: int, j: int, held: float) -> float:
        """Layers ``[i, j)`` on submesh ``s`` holding ``held`` microbatches: their memory."""
        return float(self.memory[s, i, j] + held * self.act[s, i, j])

    def leanest(self, held: float, k: int, n: int) -> np.ndarray:
        """Least memory of each range on any submesh (inf where not allowed)."""
        mem = (self.memory + held * self.act).min(axis=0)
        return np.where(self._allowed(k, n), mem, math.inf)


def _least_sum(best: list[_Fit], n: int, L: int, bound: float):
    """Least sum of chunk times with each at most ``bound``, and its ranges; None if none."""
    f = np.full(L + 1, math.inf)
    f[0] = 0.0
    back = []
    # among splits of (nearly) the same sum, the most even: each chunk also pays a squared
    # term far below the sum's resolution (equal blocks sum alike however they are cut)
    top = max((float(b.time[np.isfinite(b.time)].max(initial=0.0)) for b in best), default=1.0)
    eps = 1e-12 / max(top, 1e-300)
    for k in range(n):
        t = np.where(best[k].time <= bound, best[k].time, math.inf)
        t = t + eps * t * t
        cand = f[:, None] + t  # [i, j]: chunks so far ending at i, then this one to j
        arg = np.argmin(cand, axis=0)
        f = cand[arg, np.arange(L + 1)]
        back.append(arg)
    if not math.isfinite(f[L]):
        return None
    ranges, j = [], L
    for k in reversed(range(n)):
        i = int(back[k][j])
        ranges.append((i, j))
        j = i
    ranges.reverse()
    return sum(float(best[k].time[r]) for k, r in enumerate(ranges)), ranges


def _min_max_memory(min_mem: list[np.ndarray], n: int, L: int) -> float:
    """The least, over all splits, of the largest chunk's memory (each on its leanest
    submesh): what the memory limit per chunk would have to be for any split to fit."""
    f = np.full(L + 1, math.inf)
    f[0] = 0.0
    for k in range(n):
        f = np.maximum(f[:, None], min_mem[k]).min(axis=0)
    return float(f[L])
