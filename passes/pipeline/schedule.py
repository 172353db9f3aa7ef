"""The cost model of pipeline schedules: step time, bubble and activation memory per rank.

A schedule is the order in which each pipeline rank runs its forwards and backwards over the
microbatches. Its cost is not a formula: the textbook bubble ``(p-1)/m`` holds only for equal
stages, no communication and a full backward; zero-bubble schedules exist precisely because
splitting the backward into its input part (I, on the critical path) and its weight part
(W, deferrable) lets W fill the bubble. So the model replays the schedule.

- The order is torch's own. For the multi-stage schedules (``Interleaved1F1B``,
  ``InterleavedZeroBubble``, ``ZBVZeroBubble``, ``DualPipeV``, ``LoopedBFS``) it is the
  ``pipeline_order`` torch computes when the schedule is built; building one needs no process
  group, only objects with a stage's attributes (:func:`_torch_order`, the one place this module
  touches torch). DualPipeV's ``OVERLAP_F_B`` pairs are replayed as their two actions in
  sequence, which is how torch's runtime runs them when no overlap function is registered.
  ``GPipe`` and ``1F1B`` are single-stage schedules whose order lives in their
  ``_step_microbatches``; it is written out here (:func:`_single_stage_order`) because torch
  2.13's ``Schedule1F1B.pipeline_order`` skips microbatch 0 on the last rank (it is a
  drawing, not what runs).
- Replay is event-driven: an action starts when its rank has finished the previous action in
  its order and its input has arrived (a forward needs the previous stage's forward; a
  backward, or backward-for-input, needs its own forward and the next stage's backward; a
  backward-for-weights needs its own backward-for-input). A boundary tensor between stages on
  different ranks arrives ``send_s`` after both its producer has ended and its receiver has
  posted the receive: torch's single-stage runtimes post it just before the reading action,
  the multi-stage ones where their lowered program puts the RECV (:func:`receive_posts`).
  Sends overlap compute and one another. Stages adjacent on one rank (the V schedules' turn)
  pass tensors locally, for free.
- Beside its stage's time an action costs the runtime's own host time (``StageTime.action_s``,
  ``post_s`` per send or receive it posts to another rank, ``split_s`` on a split backward's
  input action): :mod:`.pipeline_cost` fills them from the device profile.
- Ranks that share cores (processes of one CPU machine) compute faster while fewer of them
  compute: given ``speed`` (:func:`core_speed`), time advances event by event and each
  running action progresses at the speed of the current count.
- Checked against torch's runtime (gloo, 2 ranks, stages that sleep 20 ms forward and 40 ms
  backward): GPipe, 1F1B, Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble and DualPipeV
  measured 3-11% above the replay without the runtime's costs; stages of a tiny Linear, where
  the step is those costs alone: benchmarks/pipeline_calibration.py.
- Memory: a (stage, microbatch) holds its activations from the start of its forward to the
  end of its last backward action (the weight backward when split: W still reads the saved
  inputs, so this errs high, never low). At equal instants frees come before allocations.

Stages are numbered in pipeline order, ``0 .. p*v-1``; ``stage_rank`` says where each runs
(``s % p`` for looped schedules, a V for ``ZBVZeroBubble`` and ``DualPipeV``: rank ``r`` holds
``r`` and ``2p-1-r``). Events carry torch's action names (``"2F0"``, ``"1I3"``), which its
runtime records as ``PP:<action>`` in a profile, so a predicted and a measured timeline share
event names.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from types import SimpleNamespace

from autopar.ir.errors import PlanError
from autopar.ir.schedules import (  # noqa: F401  (the planner's names for the one table's)
    LOOPED,
    SCHEDULES,
    SINGLE_STAGE,
    V_SHAPED,
    canonical_name,
)
from autopar.ir.schedules import schedule as schedule_info
from autopar.ir.schedules import stage_rank as _stage_rank

FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT = "F", "B", "I", "W"
KIND = {FORWARD: "forward", BACKWARD: "backward", BACKWARD_INPUT: "backward_input",
        BACKWARD_WEIGHT: "backward_weight"}


@dataclass(frozen=True, slots=True)
class PipelineSchedule:
    """A schedule choice: ``p`` pipeline ranks, ``v`` stages per rank, ``m`` microbatches.
    Constructing one checks torch's own constraints, so an invalid choice fails at planning
    with a message, not in the runtime with torch's."""

    name: str
    p: int
    v: int = 1
    m: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", canonical_name(self.name))
        for field, value in (("p", self.p), ("v", self.v), ("m", self.m)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlanError(f"pipeline schedule {self.name}: {field} must be a positive "
                                f"integer, got {value!r}")
        _validate(self.name, self.p, self.v, self.m)

    @property
    def num_stages(self) -> int:
        return self.p * self.v

    @property
    def splits_backward(self) -> bool:
        """Whether the schedule runs backward-for-input and -for-weights as separate actions."""
        return schedule_info(self.name).splits_backward

    def stage_rank(self, stage: int) -> int:
        return _stage_rank(self.name, self.p, stage)

    def rank_stages(self, rank: int) -> tuple[int, ...]:
        return tuple(s for s in range(self.num_stages) if self.stage_rank(s) == rank)


def _validate(name: str, p: int, v: int, m: int) -> None:
    if name in SINGLE_STAGE and v != 1:
        raise PlanError(f"{name} runs one stage per rank, got v={v}: use v=1, or "
                        "Interleaved1F1B / InterleavedZeroBubble for several stages per rank")
    if name in V_SHAPED and v != 2:
        raise PlanError(f"{name} needs exactly 2 stages per rank (a V), got v={v}: use v=2, or "
                        "Interleaved1F1B for another count")
    info = schedule_info(name)
    if info.fills_every_stage and m < p * v:
        count = "p" if v == 1 else f"{v}p"
        raise PlanError(f"{name} needs at least as many microbatches as stages: m={m} < "
                        f"{count}={p * v}; use m >= {p * v}, or {info.fewer_microbatches}")
    if info.rounds_of_p:
        rounds = max(1, m // p)
        if m % rounds:
            ok = [k for k in range(1, 4 * m + p) if k % max(1, k // p) == 0]
            lower = max(k for k in ok if k < m)
            upper = min(k for k in ok if k > m)
            raise PlanError(f"{name} runs microbatches in rounds of p={p}: m={m} is not a "
                            f"multiple of its {rounds} rounds (m // p); use m={lower} or "
                            f"m={upper} (any m <= p or a multiple of p works)")


@dataclass(frozen=True, slots=True)
class Action:
    """One compute action of a rank's order: ``kind`` is F, B, I or W (torch's letters)."""

    stage: int
    kind: str
    microbatch: int

    @property
    def name(self) -> str:
        """torch's name for it (``"0F1"``), as its runtime's profile records it."""
        return f"{self.stage}{self.kind}{self.microbatch}"


@dataclass(frozen=True, slots=True)
class StageTime:
    """One virtual stage's costs per microbatch. A full backward costs ``backward_input_s +
    backward_weight_s``. ``send_s`` moves this stage's output to the next stage (and its
    gradient back: same size); ``activation_bytes`` is what one in-flight microbatch holds."""

    forward_s: float
    backward_input_s: float
    backward_weight_s: float = 0.0
    send_s: float = 0.0
    activation_bytes: float = 0.0
    action_s: float = 0.0  # the runtime's own cost of running any one action
    post_s: float = 0.0  # the host's cost of posting one send or receive to another rank
    split_s: float = 0.0  # what splitting the backward costs beyond the whole one (on I)

    @property
    def backward_s(self) -> float:
        return self.backward_input_s + self.backward_weight_s

    @classmethod
    def of(cls, forward_s: float, backward_s: float, weight_share: float = 0.5,
           send_s: float = 0.0, activation_bytes: float = 0.0, action_s: float = 0.0,
           split_s: float = 0.0, post_s: float = 0.0) -> StageTime:
        """From a whole backward: matmul-heavy layers spend about half of it on weights."""
        return cls(forward_s, backward_s * (1 - weight_share), backward_s * weight_share,
                   send_s, activation_bytes, action_s=action_s, post_s=post_s, split_s=split_s)


@dataclass(frozen=True, slots=True)
class Event:
    """One interval of a rank's predicted timeline. ``kind``: forward, backward,
    backward_input, backward_weight, send (beside compute, to rank ``peer``) or idle.
    ``action`` is torch's name for it (``"0F1"``, ``"3SEND_B2"``; empty when idle)."""

    rank: int
    kind: str
    start_s: float
    end_s: float
    stage: int | None = None
    microbatch: int | None = None
    action: str = ""
    peer: int | None = None

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True, slots=True)
class ScheduleCost:
    schedule: PipelineSchedule
    step_s: float
    bubble_fraction: float  # idle / (p * step), over all ranks
    busy_s: tuple[float, ...]  # per rank
    idle_s: tuple[float, ...]  # per rank
    peak_in_flight: tuple[int, ...]  # per rank: (stage, microbatch) activations held at once
    peak_activation_bytes: tuple[float, ...]  # per rank
    stage_peak_in_flight: tuple[int, ...]  # per stage: microbatches it holds at once


def textbook_bubble(p: int, m: int, v: int = 1) -> float:
    """Idle time over ideal time for equal stages, no communication: ``(p-1)/(v*m)``
    (Narayanan et al. 2021). As a fraction of the step it is ``x / (1 + x)``."""
    return (p - 1) / (v * m)


def rank_orders(schedule: PipelineSchedule) -> tuple[tuple[Action, ...], ...]:
    """Each rank's compute actions in the order it runs them."""
    if schedule.name in SINGLE_STAGE:
        return _single_stage_order(schedule.name, schedule.p, schedule.m)
    return _torch_order(schedule.name, schedule.p, schedule.v, schedule.m)


@lru_cache(maxsize=64)
def _single_stage_order(name: str, p: int, m: int) -> tuple[tuple[Action, ...], ...]:
    orders = []
    for r in range(p):
        fwd = [Action(r, FORWARD, i) for i in range(m)]
        bwd = [Action(r, BACKWARD, i) for i in range(m)]
        if name == "GPipe":
            orders.append(tuple(fwd + bwd))
            continue
        warmup = min(m, p - r)  # Schedule1F1B._step_microbatches: then B, F, B, F ...
        order = fwd[:warmup]
        for i in range(m):
            order.append(bwd[i])
            if warmup + i < m:
                order.append(fwd[warmup + i])
        orders.append(tuple(order))
    return tuple(orders)


@lru_cache(maxsize=4)
def _built(name: str, p: int, v: int, m: int):
    """torch's schedule object for ``p`` ranks, built from stand-in stages (the attributes
    the schedules' constructors read; ``submod=None`` skips their torch.compile check). Kept
    for the order and the lowered program both: building Interleaved1F1B for SC'21's 530B
    (35 ranks x 3 stages, 280 microbatches) takes torch 9 s."""
    n = p * v
    info = schedule_info(name)
    cls = info.torch_class()
    local = tuple(s for s in range(n) if _stage_rank(info, p, s) == 0)  # rank 0's stages
    stages = [SimpleNamespace(num_stages=n, group_size=p, group_rank=0, stage_index=s,
                              submod=None, stage_index_to_group_rank=None) for s in local]
    try:
        return cls(stages, m)
    except (ValueError, RuntimeError, AssertionError) as e:
        raise PlanError(f"torch cannot build {name} with p={p}, v={v}, m={m}: {e}") from e


def _leaves(actions):
    for a in actions:
        if a is not None:
            yield from (a.sub_actions or (a,))


@lru_cache(maxsize=64)
def _torch_order(name: str, p: int, v: int, m: int) -> tuple[tuple[Action, ...], ...]:
    """torch's ``pipeline_order``: each rank's compute actions."""
    built = _built(name, p, v, m)
    return tuple(tuple(Action(leaf.stage_index, leaf.computation_type.value,
                              leaf.microbatch_index)
                       for leaf in _leaves(built.pipeline_order[r])
                       if leaf.computation_type.value in KIND)
                 for r in range(p))


@lru_cache(maxsize=64)
def receive_posts(name: str, p: int, v: int, m: int) -> tuple[dict[tuple[int, int, str], int],
                                                               ...]:
    """Where each rank posts the receive of an action's input, as the index of the compute
    action (in :func:`rank_orders`) after which it does, -1 before the first; keyed by
    (stage, microbatch, ``"F"`` for an activation or ``"B"`` for a gradient). The
    multi-stage runtimes run torch's lowered program (``pipeline_order_with_comms``), whose
    RECV actions sit at most a few actions ahead of their readers; the single-stage ones
    post each receive just before the action that reads it, which is the fallback (an
    absent key) where torch has no lowered program."""
    if name in SINGLE_STAGE:
        return ({},) * p
    lowered = getattr(_built(name, p, v, m), "pipeline_order_with_comms", None)
    if not lowered:
        return ({},) * p
    out = []
    for r in range(p):
        posts: dict[tuple[int, int, str], int] = {}
        done = 0
        for leaf in _leaves(lowered[r]):
            kind = leaf.computation_type.value
            if kind in KIND:
                done += 1
            elif kind in ("RECV_F", "RECV_B"):
                posts[(leaf.stage_index, leaf.microbatch_index, kind[-1])] = done - 1
        out.append(posts)
    return tuple(out)


def _as_stage_times(schedule: PipelineSchedule,
                    stage_times: StageTime | Sequence[StageTime]) -> tuple[StageTime, ...]:
    if isinstance(stage_times, StageTime):
        return (stage_times,) * schedule.num_stages
    times = tuple(stage_times)
    if len(times) != schedule.num_stages:
        raise PlanError(f"{schedule.name} with p={schedule.p}, v={schedule.v} has "
                        f"{schedule.num_stages} stages but {len(times)} stage times were given: "
                        "give one StageTime per virtual stage, in pipeline order")
    return times


def _replay(schedule: PipelineSchedule, times: tuple[StageTime, ...],
            speed: Sequence[float] | None = None):
    """Start and end of every action; the event-driven replay the module docstring describes.
    ``speed[k]``: how fast a rank computes while ``k`` ranks compute (processes sharing cores,
    :func:`core_speed`); None: every rank at full speed whatever the others do."""
    orders = rank_orders(schedule)
    n_ranks = len(orders)
    last = schedule.num_stages - 1
    rank_of = [schedule.stage_rank(s) for s in range(schedule.num_stages)]
    fwd_end: dict[tuple[int, int], float] = {}
    grad_end: dict[tuple[int, int], float] = {}  # B or I: the input gradient exists
    runs: list[list[tuple[Action, float, float]]] = [[] for _ in orders]
    free = [0.0] * n_ranks
    pos = [0] * n_ranks
    running: dict[int, tuple[Action, float, float]] = {}  # rank -> (action, start, work left)
    posts = receive_posts(schedule.name, schedule.p, schedule.v, schedule.m)

    def posted(r: int, a: Action, kind: str) -> float:
        # after the rank's j-th action (its previous one where torch posts just before)
        j = posts[r].get((a.stage, a.microbatch, kind), pos[r] - 1)
        return runs[r][j][2] if j >= 0 else 0.0

    def hop(src: int, dst: int) -> float:  # boundary between stages min(src, dst) and +1
        return 0.0 if rank_of[src] == rank_of[dst] else times[min(src, dst)].send_s

    def arrived(end: float | None, src: int, dst: int, posted: float) -> float | None:
        # a transfer starts once its sender has finished and its receiver has posted the
        # receive, which torch's runtimes do when they reach the action that reads it
        if end is None:
            return None
        h = hop(src, dst)
        return end if h == 0.0 else max(end, posted) + h

    def ready(r: int, a: Action) -> float | None:
        key = (a.stage, a.microbatch)
        if a.kind == FORWARD:
            if a.stage == 0:
                return 0.0
            return arrived(fwd_end.get((a.stage - 1, a.microbatch)), a.stage - 1, a.stage,
                           posted(r, a, "F"))
        if a.kind == BACKWARD_WEIGHT:
            return grad_end.get(key)
        own = fwd_end.get(key)
        if own is None or a.stage == last:
            return own
        nxt = arrived(grad_end.get((a.stage + 1, a.microbatch)), a.stage + 1, a.stage,
                      posted(r, a, "B"))
        return None if nxt is None else max(own, nxt)

    def posts_of(a: Action) -> int:  # its sends and receives to and from other ranks
        if a.kind == BACKWARD_WEIGHT:
            return 0
        return sum(1 for other in (a.stage - 1, a.stage + 1)
                   if 0 <= other <= last and rank_of[other] != rank_of[a.stage])

    lengths: dict[tuple[int, str], float] = {}  # an action's length: by stage and kind

    def duration(a: Action) -> float:
        key = (a.stage, a.kind)
        d = lengths.get(key)
        if d is None:
            t = times[a.stage]
            d = lengths[key] = t.action_s + t.post_s * posts_of(a) + {
                FORWARD: t.forward_s, BACKWARD: t.backward_s,
                BACKWARD_INPUT: t.backward_input_s + t.split_s,
                BACKWARD_WEIGHT: t.backward_weight_s}[a.kind]
        return d

    def finish(r: int, a: Action, start: float, end: float) -> None:
        runs[r].append((a, start, end))
        if a.kind == FORWARD:
            fwd_end[(a.stage, a.microbatch)] = end
        elif a.kind in (BACKWARD, BACKWARD_INPUT):
            grad_end[(a.stage, a.microbatch)] = end
        free[r], pos[r] = end, pos[r] + 1

    def deadlock(at: Sequence[int] | None = None) -> PlanError:  # at: each rank's position
        at = pos if at is None else at
        stuck = {r: orders[r][at[r]] for r in range(n_ranks) if at[r] < len(orders[r])}
        return PlanError(f"{schedule} deadlocks (each rank waits: {stuck}); choose another "
                         "schedule or microbatch count")

    remaining = sum(len(o) for o in orders)
    if speed is None:
        return _run_ahead(schedule, times, duration, deadlock)
    # ranks share cores: a running action's pace changes whenever another starts or ends,
    # so time advances event by event
    now = 0.0
    while remaining:
        waits = []
        for r, order in enumerate(orders):
            if r in running or pos[r] >= len(order):
                continue
            at = ready(r, order[pos[r]])
            if at is None:
                continue
            if at <= now + 1e-15:
                running[r] = (order[pos[r]], max(now, free[r]), duration(order[pos[r]]))
            else:
                waits.append(at)
        if not running:
            if not waits:
                raise deadlock()
            now = min(waits)
            continue
        rate = speed[min(len(running), len(speed) - 1)]
        step = min(left for _, _, left in running.values()) / rate
        if waits:
            step = min(step, min(waits) - now)
        now += step
        for r in list(running):
            a, start, left = running[r]
            left -= step * rate
            if left > 1e-12 * max(1.0, now):
                running[r] = (a, start, left)
                continue
            del running[r]
            finish(r, a, start, now)
            remaining -= 1
    return runs


def _run_ahead(schedule: PipelineSchedule, times: tuple[StageTime, ...], duration, deadlock):
    """:func:`_replay` where every action's length is known up front: each rank run ahead as
    far as it can, round after round. The same sums in the same order as ``ready`` and
    ``finish`` there, on what :func:`_program` read off the order once per schedule (the
    pipeline planner replays each schedule for every split it weighs: 83 replays of 16k
    actions were 14 s of 405B's pp=32 plan)."""
    program = _program(schedule)
    m, n = schedule.m, schedule.num_stages
    fwd_end: list[list[float | None]] = [[None] * m for _ in range(n)]
    grad_end: list[list[float | None]] = [[None] * m for _ in range(n)]
    runs: list[list[tuple[Action, float, float]]] = [[] for _ in program]
    ends: list[list[float]] = [[] for _ in program]  # each run's end, by position
    free = [0.0] * len(program)
    remaining = sum(len(acts) for acts in program)
    while remaining:
        progressed = False
        for r, acts in enumerate(program):
            mine, k = ends[r], len(ends[r])
            while k < len(acts):
                a, code, s, mb, cross, j = acts[k]
                if code == _FIRST:  # a forward of the first stage
                    at: float | None = 0.0
                elif code == _FWD:  # the previous stage's forward, sent here
                    at = fwd_end[s - 1][mb]
                    h = times[s - 1].send_s if cross else 0.0
                    if at is not None and h != 0.0:
                        at = max(at, mine[j] if j >= 0 else 0.0) + h
                elif code == _WEIGHT:
                    at = grad_end[s][mb]
                else:  # a backward: its own forward, and the next stage's input gradient
                    at = fwd_end[s][mb]
                    if at is not None and code == _BWD:
                        nxt = grad_end[s + 1][mb]
                        h = times[s].send_s if cross else 0.0
                        if nxt is not None and h != 0.0:
                            nxt = max(nxt, mine[j] if j >= 0 else 0.0) + h
                        at = None if nxt is None else max(at, nxt)
                if at is None:
                    break
                start = max(free[r], at)
                end = start + duration(a)
                runs[r].append((a, start, end))
                mine.append(end)
                if a.kind == FORWARD:
                    fwd_end[s][mb] = end
                elif a.kind != BACKWARD_WEIGHT:
                    grad_end[s][mb] = end
                free[r] = end
                k += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise deadlock([len(e) for e in ends])
    return runs


# what an action waits for (:func:`_program`)
_FIRST, _FWD, _WEIGHT, _LAST_BWD, _BWD = range(5)


@lru_cache(maxsize=64)
def _program(schedule: PipelineSchedule) -> tuple[tuple[tuple, ...], ...]:
    """Each rank's actions as :func:`_run_ahead` reads them: (action, what it waits for,
    stage, microbatch, whether its input crosses to another rank, the position after which
    the rank posts that receive: :func:`_replay`'s ``posted``, -1 before the first)."""
    orders = rank_orders(schedule)
    posts = receive_posts(schedule.name, schedule.p, schedule.v, schedule.m)
    last = schedule.num_stages - 1
    rank_of = [schedule.stage_rank(s) for s in range(schedule.num_stages)]
    out = []
    for r, order in enumerate(orders):
        acts = []
        for k, a in enumerate(order):
            s, cross, j = a.stage, False, -1
            if a.kind == FORWARD:
                code = _FIRST if s == 0 else _FWD
                if s > 0:
                    cross = rank_of[s - 1] != rank_of[s]
                    j = posts[r].get((s, a.microbatch, "F"), k - 1)
            elif a.kind == BACKWARD_WEIGHT:
                code = _WEIGHT
            else:
                code = _LAST_BWD if s == last else _BWD
                if s < last:
                    cross = rank_of[s + 1] != rank_of[s]
                    j = posts[r].get((s, a.microbatch, "B"), k - 1)
            acts.append((a, code, s, a.microbatch, cross, j))
        out.append(tuple(acts))
    return tuple(out)


def core_speed(p: int, processes_per_rank: int, cores: int) -> tuple[float, ...] | None:
    """How fast one of ``p`` pipeline ranks computes while ``k`` of them compute (index
    ``k``), where each rank is ``processes_per_rank`` processes (its dp and tp peers) and all
    ``p * processes_per_rank`` share ``cores`` cores; 1.0 is the speed with every process
    computing, the one the device profile's rates describe. None where no core is shared."""
    n = p * processes_per_rank
    if cores <= 0 or n <= cores:
        return None
    full = cores / n
    return tuple(min(1.0, cores / max(1, k * processes_per_rank)) / full for k in range(p + 1))


def _memory(schedule: PipelineSchedule, times: tuple[StageTime, ...], runs):
    """Peak held activations per rank (count and bytes) and per stage (count)."""
    peak_n, peak_b = [], []
    stage_peak = [0] * schedule.num_stages
    for rank_runs in runs:
        held_from: dict[tuple[int, int], float] = {}
        held_to: dict[tuple[int, int], float] = {}
        for a, start, end in rank_runs:
            key = (a.stage, a.microbatch)
            if a.kind == FORWARD:
                held_from[key] = start
            else:  # the last backward action of the pair frees it
                held_to[key] = max(held_to.get(key, 0.0), end)
        deltas = []  # (time, order: frees first, stage, +1/-1)
        for key, t0 in held_from.items():
            deltas.append((t0, 1, key[0], 1))
            deltas.append((held_to.get(key, math.inf), 0, key[0], -1))
        deltas.sort()
        n = b = best_n = 0
        best_b = 0.0
        per_stage = [0] * schedule.num_stages
        for _, _, s, d in deltas:
            n += d
            b += d * times[s].activation_bytes
            per_stage[s] += d
            stage_peak[s] = max(stage_peak[s], per_stage[s])
            best_n, best_b = max(best_n, n), max(best_b, b)
        peak_n.append(best_n)
        peak_b.append(best_b)
    return tuple(peak_n), tuple(peak_b), tuple(stage_peak)


def simulate(schedule: PipelineSchedule, stage_times: StageTime | Sequence[StageTime],
             speed: Sequence[float] | None = None) -> ScheduleCost:
    """Predicted step of ``schedule`` (one StageTime for all stages, or one per stage);
    ``speed``: ranks sharing cores (:func:`core_speed`)."""
    times = _as_stage_times(schedule, stage_times)
    runs = _replay(schedule, times, speed)
    step, bubble, busy, idle = _timing(schedule, runs)
    peak_n, peak_b, stage_peak = _memory(schedule, times, runs)
    return ScheduleCost(schedule, step, bubble, busy, idle, peak_n, peak_b, stage_peak)


def step_and_bubble(schedule: PipelineSchedule, stage_times: StageTime | Sequence[StageTime],
                    speed: Sequence[float] | None = None) -> tuple[float, float]:
    """:func:`simulate`'s step and bubble alone (the same replay, the peaks not counted):
    what the pipeline planner's splits are weighed by."""
    runs = _replay(schedule, _as_stage_times(schedule, stage_times), speed)
    step, bubble, _, _ = _timing(schedule, runs)
    return step, bubble


def _timing(schedule: PipelineSchedule, runs) -> tuple[float, float, tuple, tuple]:
    """Step, bubble, and each rank's busy and idle time of a replay's runs."""
    step = max((end for rank_runs in runs for _, _, end in rank_runs), default=0.0)
    busy = tuple(sum(end - start for _, start, end in rank_runs) for rank_runs in runs)
    idle = tuple(max(0.0, step - b) for b in busy)
    bubble = sum(idle) / (schedule.p * step) if step > 0 else 0.0
    return step, bubble, busy, idle


def events(schedule: PipelineSchedule, stage_times: StageTime | Sequence[StageTime],
           speed: Sequence[float] | None = None) -> tuple[tuple[Event, ...], ...]:
    """Each rank's timeline, sorted by start: its compute, the idle gaps between (up to the
    step's end) and the sends it issues (which overlap its compute: draw them on a lane of
    their own)."""
    times = _as_stage_times(schedule, stage_times)
    runs = _replay(schedule, times, speed)
    step = max((end for rank_runs in runs for _, _, end in rank_runs), default=0.0)
    last = schedule.num_stages - 1
    out = []
    for r, rank_runs in enumerate(runs):
        evs: list[Event] = []
        t = 0.0
        for a, start, end in rank_runs:
            if start > t:
                evs.append(Event(r, "idle", t, start))
            evs.append(Event(r, KIND[a.kind], start, end, a.stage, a.microbatch, a.name))
            t = end
            to = a.stage + 1 if a.kind == FORWARD else a.stage - 1
            if a.kind != BACKWARD_WEIGHT and 0 <= to <= last:
                peer = schedule.stage_rank(to)
                if peer != r:
                    send_s = times[min(a.stage, to)].send_s
                    name = f"{a.stage}SEND_{'F' if a.kind == FORWARD else 'B'}{a.microbatch}"
                    evs.append(Event(r, "send", end, end + send_s, a.stage, a.microbatch,
                                     name, peer))
        if step > t:
            evs.append(Event(r, "idle", t, step))
        evs.sort(key=lambda e: (e.start_s, e.kind == "send"))
        out.append(tuple(evs))
    return tuple(out)
