"""Trace events: the Chrome/Perfetto trace-event format every autopar picture is written in,
and the names a predicted and a measured step share.

:class:`TraceEvent` and :func:`write_trace` are what the predicted step
(:mod:`autopar.report.timeline`) and a pipeline schedule's replay (:func:`pipeline_trace_events`)
write; :func:`unit_names` and :func:`collective_name` name the events, for the predicted trace
and for the runtime's ``torch.profiler`` ranges (:mod:`autopar.runtime.observe.profiling`) alike;
:func:`merge_traces` puts a predicted trace and measured ones side by side in one file.
"""

from __future__ import annotations

import json
import operator
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.fx as fx

from autopar.passes.cost.cost_model import VIEW_OPS

LANES = ("compute", "comm", "ops")  # tid = position; other lanes get the next ids
PHASE_NAMES = {"fwd": "forward", "bwd": "backward"}


# --- the writer ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TraceEvent:
    """One interval on one rank's lane: what the predicted step (this module), a pipeline
    schedule's replay (:func:`pipeline_trace_events`) and any other picture write."""

    name: str
    start_s: float
    dur_s: float
    rank: int = 0
    lane: str = "compute"
    cat: str = "compute"  # forward, backward, recompute, collective, idle, ...
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def end_s(self) -> float:
        return self.start_s + self.dur_s


def trace_json(events: Iterable[TraceEvent], other: dict[str, Any] | None = None,
               rank_names: dict[int, str] | None = None) -> dict[str, Any]:
    """The Chrome trace-event document (``traceEvents``) of ``events``: complete events in
    microseconds, and metadata naming each rank's process and each lane's thread."""
    events = list(events)
    lanes = {name: k for k, name in enumerate(LANES)}
    for e in events:
        lanes.setdefault(e.lane, len(lanes))
    out: list[dict[str, Any]] = []
    used: dict[int, set[str]] = {}
    for e in events:
        used.setdefault(e.rank, set()).add(e.lane)
    for rank in sorted(used):
        name = (rank_names or {}).get(rank, f"rank {rank}")
        out.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                    "args": {"name": name}})
        out.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0,
                    "args": {"sort_index": rank}})
        for lane in sorted(used[rank], key=lanes.__getitem__):
            out.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": lanes[lane],
                        "args": {"name": lane}})
            out.append({"name": "thread_sort_index", "ph": "M", "pid": rank,
                        "tid": lanes[lane], "args": {"sort_index": lanes[lane]}})
    for e in sorted(events, key=lambda e: (e.rank, lanes[e.lane], e.start_s)):
        out.append({"name": e.name, "cat": e.cat, "ph": "X", "pid": e.rank,
                    "tid": lanes[e.lane], "ts": round(e.start_s * 1e6, 4),
                    "dur": round(e.dur_s * 1e6, 4), "args": e.args})
    doc: dict[str, Any] = {"traceEvents": out, "displayTimeUnit": "ms"}
    if other:
        doc["otherData"] = other
    return doc


def write_trace(events: Iterable[TraceEvent], path: str | Path,
                other: dict[str, Any] | None = None,
                rank_names: dict[int, str] | None = None) -> dict[str, Any]:
    """Write ``events`` as a Chrome/Perfetto trace JSON file; returns the document."""
    doc = trace_json(events, other, rank_names)
    Path(path).write_text(json.dumps(doc))
    return doc


def pipeline_trace_events(events: Sequence[Any]) -> list[TraceEvent]:
    """A pipeline step's events as trace events, predicted or measured, with the same names:

    - the schedule's replay (:func:`autopar.passes.pipeline.schedule.events`: per rank,
      events with ``kind`` forward/backward/..., ``start_s``, ``end_s``, ``stage``,
      ``microbatch``, ``action``): actions named by torch's action name (``0F1``), sends on
      the comm lane, idle gaps on the compute lane;
    - a measured step's (:class:`autopar.runtime.pipeline.events.StageEvent`: ``kind`` F, B,
      I, W or sync, flat or per rank): named as torch names the action too (stage, kind,
      microbatch: ``0F1``), the gradient sync on the comm lane.
    """
    flat = [e for item in events
            for e in ([item] if hasattr(item, "start_s") else item)]
    out = []
    for e in flat:
        kind = e.kind
        if kind in _ACTION_KINDS:  # a measured action: torch's name for it
            name = f"{e.stage}{kind}{e.microbatch}"
            kind = _ACTION_KINDS[kind]
        elif kind == "sync":
            name, kind = "gradient sync", "sync"
        else:
            name = getattr(e, "action", "") or kind
        lane = "comm" if kind in ("send", "sync") else "compute"
        args = {k: v for k, v in (("kind", kind), ("stage", e.stage),
                                  ("microbatch", e.microbatch),
                                  ("peer", getattr(e, "peer", None)))
                if v is not None and v != -1}
        out.append(TraceEvent(name, e.start_s, e.end_s - e.start_s, e.rank, lane, kind, args))
    return out


_ACTION_KINDS = {"F": "forward", "B": "backward", "I": "backward_input", "W": "backward_weight"}


def merge_traces(predicted: str | Path, measured: Sequence[str | Path],
                 out: str | Path) -> dict[str, Any]:
    """One file with the predicted trace and measured ones (``trace_rank{r}.json`` of
    ``autopar train --profile``) side by side: processes ``predicted rank r`` and ``measured
    rank r``, each measured trace shifted so that its first autopar range (a unit or a
    collective) starts at 0, as the predicted step does."""
    pred = json.loads(Path(predicted).read_text())
    events = [e for e in pred["traceEvents"] if e.get("name") != "process_name"]
    ranks = sorted({e["pid"] for e in events if e.get("ph") == "X"})
    for r in ranks:
        events.append({"name": "process_name", "ph": "M", "pid": r, "tid": 0,
                       "args": {"name": f"predicted rank {r}"}})
    base = 1 + max(ranks, default=0)
    for k, path in enumerate(measured):
        doc = json.loads(Path(path).read_text())
        xs = [e for e in doc.get("traceEvents", []) if e.get("ph") == "X"]
        marks = [e["ts"] for e in xs if e.get("cat") == "user_annotation"]
        t0 = min(marks or [e["ts"] for e in xs] or [0.0])
        pid = base + k
        m = re.search(r"rank(\d+)", Path(path).stem)
        name = f"measured rank {m.group(1)}" if m else f"measured {Path(path).stem}"
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                       "args": {"name": name}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0,
                       "args": {"sort_index": pid}})
        events += [{**e, "pid": pid} for e in doc["traceEvents"]
                   if e.get("ph") == "M" and e.get("name") == "thread_name"]
        events += [{**e, "pid": pid, "ts": float(e["ts"]) - t0} for e in xs]
    doc = {"traceEvents": events, "displayTimeUnit": "ms",
           "otherData": pred.get("otherData", {})}
    Path(out).write_text(json.dumps(doc))
    return doc


# --- names, shared with the runtime's profiling ----------------------------------------------


def collective_name(kind: str, axis: str, reason: str) -> str:
    """``all_reduce[dp] gradient sync``: how both traces name a collective."""
    return f"{kind}[{axis}] {reason}"


def unit_of(facts: Any) -> str | None:
    """The unit a traced node's compute is drawn in (None: a placeholder, no compute)."""
    base = PHASE_NAMES.get(facts.phase)
    if base is None:
        return None
    if "recomputes" in facts.extra:
        base = "recompute"
    return base if facts.layer is None else f"{base} layer {facts.layer}"


def unit_names(nodes: Sequence[fx.Node]) -> list[str | None]:
    """Each node's unit (see the module docstring); a view or ``getitem`` joins the unit of
    the node before it in the same phase. The predicted trace and the runtime's ranges both
    come from this, over the same graph's nodes (a phase at a time or all at once: the same)."""
    out: list[str | None] = []
    prev: tuple[str, str] | None = None  # (phase, unit) of the last call
    for n in nodes:
        f = n.meta.get("autopar")
        if n.op != "call_function" or f is None:
            out.append(None)
            continue
        unit = unit_of(f)
        joins = n.target is operator.getitem or f.op in VIEW_OPS
        if joins and prev is not None and prev[0] == f.phase:
            unit = prev[1]
        out.append(unit)
        if unit is not None:
            prev = (f.phase, unit)
    return out
