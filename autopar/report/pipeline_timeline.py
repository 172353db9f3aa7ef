"""The predicted timeline of one pipelined step, per rank, as a Chrome/Perfetto trace.

A pipeline plan's ranks run different programs at different times, so its picture is the
schedule's replay (:func:`autopar.passes.pipeline.schedule.events`) with the stage times the
plan was priced with (:func:`autopar.passes.pipeline.cost.planned_stages`, read off the plan
alone, so the runtime can write it from the plan it runs): per rank, each
forward, backward (or input and weight backward) action under torch's name for it (``0F1``),
the boundary sends on the comm lane, the idle gaps, and the gradient sync once the rank's
last action ends. Where the plan recomputes, a backward action starts with its stage's
recomputation, drawn as its own ``recompute`` event. The names are those a measured pipeline
step carries (:func:`autopar.report.trace_events.pipeline_trace_events`), so the two open side by
side. The span equals the plan's ``cost.step_s``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from autopar.ir.plan import Plan
from autopar.passes.pipeline.cost import planned_stages
from autopar.passes.pipeline.schedule import events
from autopar.report.trace_events import TraceEvent, pipeline_trace_events, write_trace

RECOMPUTING = ("backward", "backward_input")


def pipeline_timeline(plan: Plan) -> tuple[list[TraceEvent], float]:
    """Every rank's events and the span (module docstring), from the plan alone."""
    pipe = plan.decided.pipeline
    assert pipe is not None
    sched, times, rank_sync, speed = planned_stages(plan)
    again = {st.index: st.recompute_s for st in pipe.stages}
    out: list[TraceEvent] = []
    span = 0.0
    for rank_events in events(sched, times, speed):
        for ev in pipeline_trace_events(rank_events):
            stage = ev.args.get("stage")
            rc = again.get(stage, 0.0) if ev.cat in RECOMPUTING else 0.0
            if rc > 0 and ev.lane == "compute":
                rc = min(rc, ev.dur_s)
                out.append(TraceEvent(f"recompute stage {stage}", ev.start_s, rc, ev.rank,
                                      "compute", "recompute", dict(ev.args)))
                ev = replace(ev, start_s=ev.start_s + rc, dur_s=ev.dur_s - rc)
            out.append(ev)
        rank = rank_events[0].rank if rank_events else 0
        end = max((e.end_s for e in rank_events if e.kind != "idle"), default=0.0)
        sync = rank_sync[rank]
        if sync > 0:
            out.append(TraceEvent("gradient sync", end, sync, rank, "comm", "sync",
                                  {"kind": "sync"}))
        span = max(span, end + sync)
    return out, span


def write_pipeline_timeline(plan: Plan, path: Any) -> float:
    """Write the predicted pipelined step of ``plan`` to ``path``; returns its span."""
    evs, span = pipeline_timeline(plan)
    write_trace(evs, path, {"autopar": "predicted", "step_s": span,
                            "plan_step_s": plan.predicted.cost.step_s,
                            "note": "one process per pipeline rank"})
    return span
