"""Gradient synchronisation, started in the backward as soon as each gradient exists.

The plan prices every gradient's move into its parameter's layout, pure all-reduces grouped
into DDP-style buckets (:func:`autopar.passes.cost.buckets.gradient_buckets`) when it priced them
so. :class:`GradSyncSchedule` works out, once per program, after which backward step each of
those moves can start: a bucket when its last gradient is computed, any other move when its
gradient is. During the backward, :class:`GradSyncRun` starts each one there without waiting
for it (gloo and NCCL progress it in the background while the backward goes on, as DDP
overlaps its buckets); :meth:`GradSyncRun.finish` waits for all of them at the end.

A bucket's gradients are flattened into one buffer, all-reduced over the bucket's mesh axes
(or reduce-scattered over its axis, each gradient laid out as its row blocks so that every
rank gets all its shards) and handed back as views of the result. The collectives are exactly
the ones the plan lists. A bucket's flat buffer is ours, so it is reduced in place (c10d's
collective, not the functional one, which copies its input first).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from autopar.passes.cost.buckets import BucketKind, GradSync, bucket_kind, sync_groups
from autopar.runtime import _compat
from autopar.runtime.redistribute import Comm, redistribute


@dataclass(frozen=True, slots=True)
class _Launch:
    grads: tuple[int, ...]  # indices (parameter order) of the gradients it moves
    bucket: BucketKind | None  # how a bucket reduces; None: a lone move
    release: bool  # no later backward step reads its gradients: drop them once flattened


class GradSyncSchedule:
    """Where in the backward each gradient move starts; built once per lowered program."""

    def __init__(self, bwd_steps: list[str], reads: dict[str, int], grad_names: list[str | None],
                 moves: list[GradSync], mesh_shape: tuple[int, ...], bucketed: bool,
                 first_bucket_bytes: float, reduce_dtype: torch.dtype | None = None) -> None:
        """``reads``: value name -> the last backward step that reads it; ``moves``: the
        gradients that must move (``index`` into ``grad_names``); buckets filled as the plan
        priced them (``Plan.decided.first_bucket_bytes``); ``reduce_dtype``: the dtype gradients are
        summed in, where it is not their own (None: their own)."""
        self.grad_names = grad_names
        self.reduce_dtype = reduce_dtype
        self.move_of = {g.index: g for g in moves}
        self.mesh_shape = mesh_shape
        step_of = {name: i for i, name in enumerate(bwd_steps)}
        self.by_step: dict[int, list[_Launch]] = {}
        for group, kind in sync_groups(moves, mesh_shape, bucketed, first_bucket_bytes):
            ids = [g.index for g in group]
            names = [grad_names[i] for i in ids]
            after = max(step_of.get(n, -1) for n in names)  # type: ignore[arg-type]
            release = all(reads.get(n, -1) <= after for n in names)  # type: ignore[arg-type]
            # keyed by the backward step after which all its gradients exist (-1: before any)
            self.by_step.setdefault(after, []).append(_Launch(tuple(ids), kind, release))

    def dim_of(self, i: int) -> int:
        """The dim gradient ``i`` is reduce-scattered along (a bucket mixes dims)."""
        g = self.move_of[i]
        kind = bucket_kind(g.src, g.dst)
        assert kind is not None and kind.dim is not None
        return kind.dim

    def start(self, comm: Comm, env: dict[str, Any],
              carry: dict[int, torch.Tensor] | None = None, sync: bool = True) -> GradSyncRun:
        return GradSyncRun(self, comm, env, carry, sync)


class GradSyncRun:
    """One backward's gradient moves: started step by step, waited for at the end.

    Gradient accumulation over micro-batches (a pipeline stage's, :mod:`.stage_program`):
    ``sync=False`` moves nothing; each gradient that would move is added, as this rank's
    local (un-summed) contribution, into ``carry`` (parameter index -> a tensor it owns) and
    leaves the backward as ``None``. The next backward with ``sync=True`` adds ``carry``'s sums
    to its own gradients before moving them, so the plan's gradient collectives run once for
    all the micro-batches (they are linear: moving the sum is summing the moves)."""

    def __init__(self, schedule: GradSyncSchedule, comm: Comm, env: dict[str, Any],
                 carry: dict[int, torch.Tensor] | None = None, sync: bool = True) -> None:
        if not sync and carry is None:
            raise ValueError("a backward that defers its gradient sync needs a carry to keep "
                             "its gradients in")
        self.s, self.comm, self.env = schedule, comm, env
        self.carry, self.sync = carry, sync
        self.in_flight: list[tuple[_Launch, torch.Tensor, Any, list[tuple[int, torch.Size]]]] = []
        self.own_dtype: dict[int, torch.dtype] = {}  # each moved gradient's dtype
        self.step_done(-1)

    def step_done(self, i: int) -> None:
        """Start the moves whose gradients all exist once backward step ``i`` has run."""
        for launch in self.s.by_step.get(i, ()):
            self._start(launch)

    def _start(self, launch: _Launch) -> None:
        s, env = self.s, self.env
        names = [s.grad_names[i] for i in launch.grads]
        if not self.sync:
            self._keep(launch, names)
            return
        grads = [env[n] for n in names]
        if self.carry:  # the earlier micro-batches' sums: ours, so added into in place
            for k, i in enumerate(launch.grads):
                held = self.carry.pop(i, None)
                if held is not None:
                    grads[k] = held.add_(grads[k])
        if s.reduce_dtype is not None:
            for i, g in zip(launch.grads, grads):
                self.own_dtype[i] = g.dtype
            grads = [g.to(s.reduce_dtype) for g in grads]
        kind = launch.bucket
        work = None  # the c10d work of an in-place collective, else the result waits itself
        with self.comm.deferred():  # issue the collectives, do not wait for them here
            if kind is None:
                (i,) = launch.grads
                g = s.move_of[i]
                out = redistribute(grads[0], g.src, g.dst, self.comm, "gradient sync")
            elif kind.kind == "all_reduce":
                flat = torch.cat([g.reshape(-1) for g in grads])
                out, work = self.comm.start_sum(flat, kind.axes, "gradient sync")
            else:  # reduce-scatter: rank r's block of every gradient lands in row r
                (ax,) = kind.axes
                n = s.mesh_shape[ax]
                rows = torch.cat([torch.stack([c.reshape(-1) for c in g.chunk(n, s.dim_of(i))])
                                  for i, g in zip(launch.grads, grads)], dim=1)
                out, work = self.comm.start_reduce_scatter(rows, ax, "gradient sync")
        if launch.release:
            for n in names:
                env.pop(n, None)
        shapes = [(i, g.shape if kind is None or kind.kind == "all_reduce"
                   else _split(g.shape, s.dim_of(i), s.mesh_shape[kind.axes[0]]))
                  for i, g in zip(launch.grads, grads)]
        self.in_flight.append((launch, out, work, shapes))

    def _keep(self, launch: _Launch, names: list[str | None]) -> None:
        """Add the launch's gradients into ``carry`` instead of moving them."""
        assert self.carry is not None
        for i, n in zip(launch.grads, names):
            g = self.env[n]
            held = self.carry.get(i)
            if held is None:  # a copy we own: later micro-batches add into it
                self.carry[i] = g.detach().clone()
            else:
                held.add_(g)
        if launch.release:
            for n in names:
                self.env.pop(n, None)

    def finish(self) -> list[torch.Tensor | None]:
        """Every gradient in its parameter's layout (``None`` where there is none, or where
        it went into ``carry``: ``sync=False``)."""
        s, env = self.s, self.env
        out: list[torch.Tensor | None] = [None if n is None else env.get(n)
                                          for n in s.grad_names]
        if not self.sync:
            for i in s.move_of:
                out[i] = None
        for launch, t, work, shapes in self.in_flight:
            if work is not None:
                work.wait()
            t = _compat.wait(t)
            if launch.bucket is None:
                out[launch.grads[0]] = t
                continue
            t = t.reshape(-1)
            offset = 0
            for i, shape in shapes:
                numel = shape.numel()
                out[i] = t[offset: offset + numel].view(shape)
                offset += numel
        self.in_flight.clear()
        if s.reduce_dtype is not None:  # back to the gradients' own dtype (fp32)
            for i, dtype in self.own_dtype.items():
                t = out[i]
                if t is not None and t.dtype != dtype:
                    out[i] = t.to(dtype)
        return out


def _split(shape: torch.Size, dim: int, n: int) -> torch.Size:
    """A gradient's shape on each rank once reduce-scattered ``n`` ways along ``dim``."""
    out = list(shape)
    out[dim] //= n
    return torch.Size(out)
