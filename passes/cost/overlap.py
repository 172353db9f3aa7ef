"""Communication beside compute: how long a step takes when collectives run on their own
stream (NCCL) while the compute stream works.

A step is cut into segments in program order (a layer's forward ops, the head, a layer's
backward ops, ...), each run ``copies`` times in a row (a traced layer standing for several
real ones). Per copy a segment has:

- ``compute_s``: its ops, with the collectives the ops wait for in line (tensor-parallel
  all-reduces, sequence-parallel gathers, resharding): Megatron's vanilla TP does not hide
  them, so neither does this model;
- ``gather_s``: the parameter all-gathers it needs (FSDP / ZeRO-3). As FSDP2 and torchtitan
  run them, the gather of a segment is issued when the segment before it starts (prefetch of
  one), so it hides behind that segment's compute; the step's first gather has nothing
  before it and is exposed;
- ``sync_s``: the gradient reductions it makes (DDP's all-reduce buckets, FSDP's
  reduce-scatters), issued when it ends and run while the rest of the backward computes.
  What is exposed is what exceeds the backward still to run once it is ready; the last
  bucket's (the first layers' and the embedding's gradients) is exposed whole.

One communication stream takes them in the order they are issued (a backlog of gradient
syncs delays the next gather, which then delays compute). The step ends when both streams
are done. Where communication does not overlap compute (gloo: it runs on the cores the model
computes on) the caller adds it up instead (``passes/problem/scoring.py``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Segment:
    compute_s: float  # per copy: its ops and the collectives they wait for in line
    gather_s: float = 0.0  # per copy: parameter gathers, prefetched one segment ahead
    sync_s: float = 0.0  # per copy: gradient syncs issued at its end
    copies: int = 1


def overlapped_step(segments: list[Segment]) -> float:
    """The step's time with communication on its own stream (the module's docstring)."""
    flat = _without_empty([s for s in segments for _ in range(max(1, s.copies))])
    if not flat:
        return 0.0
    t_comp = 0.0
    t_comm = flat[0].gather_s  # the first gather: nothing to hide behind
    ready = t_comm  # when the current segment's gather is done
    for i, seg in enumerate(flat):
        start = max(t_comp, ready)
        ready = 0.0
        if i + 1 < len(flat) and flat[i + 1].gather_s > 0:
            t_comm = max(t_comm, start) + flat[i + 1].gather_s
            ready = t_comm
        t_comp = start + seg.compute_s
        if seg.sync_s > 0:
            t_comm = max(t_comm, t_comp) + seg.sync_s
    return max(t_comp, t_comm)


def _without_empty(flat: list[Segment]) -> list[Segment]:
    """``flat`` without its segments of no compute (ops of no layer between two layers that
    cost nothing, a view): one would end where it starts, so its syncs go out at the end of
    the segment before it and its gathers are waited for at the start of the one after it,
    which then prefetches behind the segment before as a run without it would."""
    out: list[Segment] = []
    carry = 0.0  # gathers of dropped segments, waited for by the next one with compute
    for seg in flat:
        if seg.compute_s > 0:
            out.append(Segment(seg.compute_s, seg.gather_s + carry, seg.sync_s))
            carry = 0.0
        elif out:
            out[-1] = Segment(out[-1].compute_s, out[-1].gather_s, out[-1].sync_s + seg.sync_s)
            carry += seg.gather_s
        else:  # nothing before it: its syncs wait for nothing either
            out.append(Segment(0.0, seg.gather_s + carry, seg.sync_s))
            carry = 0.0
    if carry:
        out.append(Segment(0.0, carry))
    return out


def serial_step(segments: list[Segment]) -> float:
    """The step's time with every collective in line with compute (no overlap)."""
    return sum((s.compute_s + s.gather_s + s.sync_s) * max(1, s.copies) for s in segments)


def exposed_after(comm_s: float, compute_after_s: float) -> float:
    """Of a collective issued with ``compute_after_s`` of independent compute still to run
    behind it, the part the compute does not hide (a pipeline stage's gradient sync issued
    with the cooldown's backward still to run, a p2p send behind the next microbatch)."""
    return max(0.0, comm_s - compute_after_s)


def exposed_gradient_sync(backward_s: float, sync_s: float, pieces: int) -> float:
    """Of ``sync_s`` of gradient syncs made by a backward of ``backward_s`` in ``pieces``
    equal parts (a pipeline rank's last microbatch's backward over its layers, each layer's
    gradients reduced once it is done), the part that runs past the backward's end: the last
    piece's sync at least, the backlog where the syncs outrun the backward."""
    k = max(1, pieces)
    return overlapped_step([Segment(backward_s / k, sync_s=sync_s / k, copies=k)]) - backward_s
