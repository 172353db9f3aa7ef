"""Per-action timings of a pipeline step, for measuring its bubble.

Each stage's three per-micro-batch methods (forward, backward, weight backward) are wrapped
on the instance, since torch's schedules call them by attribute: every schedule is timed the
same way, and what is timed is the stage's compute alone (the schedules wait for their
point-to-point messages outside these methods).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple


class StageEvent(NamedTuple):
    """One action of one stage: ``kind`` is ``F`` (forward), ``B`` (full backward), ``I``
    (backward to the input only), ``W`` (backward to the weights) or ``sync`` (the gradient
    all-reduces after the schedule, ``stage`` and ``microbatch`` -1). Times in seconds from the
    step's start on this rank's clock."""

    rank: int
    kind: str
    stage: int
    microbatch: int
    start_s: float
    end_s: float


def instrument(stage: Any, record: Callable[[str, int, int, float], None]) -> None:
    """Call ``record(kind, stage, microbatch, start)`` after each of the stage's actions."""
    fwd, bwd, wgt = stage.forward_one_chunk, stage.backward_one_chunk, \
        stage.backward_weight_one_chunk
    s = stage.stage_index

    def forward_one_chunk(mb: int, *args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        out = fwd(mb, *args, **kwargs)
        record("F", s, mb, t)
        return out

    def backward_one_chunk(mb: int, *args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        out = bwd(mb, *args, **kwargs)
        full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
        record("B" if full else "I", s, mb, t)
        return out

    def backward_weight_one_chunk(mb: int, *args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        out = wgt(mb, *args, **kwargs)
        record("W", s, mb, t)
        return out

    stage.forward_one_chunk = forward_one_chunk
    stage.backward_one_chunk = backward_one_chunk
    stage.backward_weight_one_chunk = backward_weight_one_chunk


def bubble_fraction(events: Sequence[StageEvent]) -> dict[int, float]:
    """Per rank, the share of its step, from the step's start to its last action's end (the
    gradient sync left out), that no stage action filled: the wait for the first micro-batch
    counts, as it is the bubble."""
    out: dict[int, float] = {}
    for rank in sorted({e.rank for e in events}):
        mine = [e for e in events if e.rank == rank and e.kind != "sync"]
        if not mine:
            continue
        span = max(e.end_s for e in mine)
        busy = sum(e.end_s - e.start_s for e in mine)
        out[rank] = max(0.0, 1.0 - busy / span) if span > 0 else 0.0
    return out


def chrome_trace(events: Sequence[StageEvent]) -> dict:
    """The events as a Chrome/Perfetto trace (``json.dump`` it): one process per rank, one
    thread per stage, each action named by kind and micro-batch (``F3``, ``B3``, ``I3``,
    ``W3``), so a measured step reads beside a predicted one."""
    out = []
    for e in events:
        out.append({"name": e.kind if e.kind == "sync" else f"{e.kind}{e.microbatch}",
                    "ph": "X", "pid": e.rank, "tid": max(e.stage, 0),
                    "ts": e.start_s * 1e6, "dur": (e.end_s - e.start_s) * 1e6,
                    "args": {"stage": e.stage, "microbatch": e.microbatch}})
    return {"traceEvents": out, "displayTimeUnit": "ms"}
