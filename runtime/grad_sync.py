"""Gradient synchronisation in buckets: one flat all-reduce for many gradients.

The plan lists gradient syncs grouped by :func:`autopar.passes.buckets.gradient_buckets`; this
module issues exactly those collectives. Gradients in a bucket are flattened into one buffer,
reduced over the bucket's mesh axes, and cut back into their shapes. A gradient no bucket takes
(its move is not a pure all-reduce) is redistributed on its own.
"""

from __future__ import annotations

import torch

from autopar.graph import TensorMeta
from autopar.passes.buckets import GradSync, gradient_buckets, reduce_axes
from autopar.placements import Partial, Replicate, Spec
from autopar.runtime.redistribute import Comm, redistribute


def sync_gradients(
    grads: list[torch.Tensor | None], metas: list[TensorMeta | None], srcs: list[Spec | None],
    dsts: list[Spec | None], comm: Comm,
) -> list[torch.Tensor | None]:
    """Each local gradient moved from ``srcs[i]`` to ``dsts[i]`` (its parameter's spec)."""
    out: list[torch.Tensor | None] = list(grads)
    syncs = [GradSync(i, metas[i], srcs[i], dsts[i])  # type: ignore[arg-type]
             for i, g in enumerate(grads) if g is not None and srcs[i] != dsts[i]]
    buckets = gradient_buckets(syncs, comm.shape)
    done = set()
    for bucket in buckets:
        axes = reduce_axes(bucket[0].src, bucket[0].dst) or ()
        flat = torch.cat([grads[g.index].reshape(-1) for g in bucket])  # type: ignore[union-attr]
        src = tuple(Partial() if k in axes else Replicate() for k in range(len(comm.shape)))
        flat = redistribute(flat, src, (Replicate(),) * len(comm.shape), comm, "gradient sync")
        offset = 0
        for g in bucket:
            t = grads[g.index]
            assert t is not None
            out[g.index] = flat[offset: offset + t.numel()].view(t.shape)
            offset += t.numel()
            done.add(g.index)
    for g in syncs:
        if g.index not in done:
            out[g.index] = redistribute(grads[g.index], g.src, g.dst, comm, "gradient sync")
    return out
