"""Which collectives the runtime batches: gradient buckets (DDP, FSDP) and parameter gathers
per layer (FSDP).

**Gradient buckets.** A gradient whose move into its parameter's layout is only all-reduces
(``P -> R`` on some mesh axes, every other axis unchanged) shares one flat buffer with others
of the same dtype that reduce over the same axes (DDP). So does one whose move is a single
reduce-scatter (``P -> S(d)`` on one axis, no other axis splitting ``d``) with others
reduce-scattered over that axis (FSDP): each is laid out in the buffer as its ``n`` row
blocks, so one reduce-scatter of the buffer hands every rank all of its shards. As in DDP,
buckets fill in reverse parameter order (about the order the backward makes the gradients),
each closed once it holds ``BUCKET_BYTES`` of local data. Where communication overlaps compute
(:func:`first_bucket_bytes`), the first closes at ``FIRST_BUCKET_BYTES``, so that its
collective starts early in the backward, as DDP does; where it does not (gloo on CPU cores the
model computes on), that early bucket would only add a collective, so the first is as large
as the others. The plan records the first bucket's size (``Plan.decided.first_bucket_bytes``).

**Parameter gathers.** The plain all-gathers of parameters that one layer's ops need in one
phase go out as one all-gather (:func:`gather_groups`).

The scorer lists one collective per bucket or group and the runtime issues exactly those
(:mod:`autopar.runtime.grad_sync`, :mod:`autopar.runtime.param_gather`), so the collectives
executed still match the plan's.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.ir.devices import DeviceProfile
from autopar.ir.graph import TensorMeta
from autopar.ir.placements import Partial, Replicate, Shard, Spec, num_shards
from autopar.passes.cost.cost_model import BUCKET_BYTES, sum_axes

FIRST_BUCKET_BYTES = 2**20  # DDP's first bucket: small, so communication starts early


def first_bucket_bytes(profile: DeviceProfile) -> int:
    """The first gradient bucket's size on ``profile``: DDP's small one where a gradient sync
    runs beside the rest of the backward, else the size of every other bucket."""
    return FIRST_BUCKET_BYTES if profile.comm_overlaps_compute else int(BUCKET_BYTES)


@dataclass(frozen=True, slots=True)
class GradSync:
    index: int  # position among the gradients being synced
    meta: TensorMeta
    src: Spec
    dst: Spec
    weight: float = 1.0  # real gradients it stands for (depth proxy)


@dataclass(frozen=True, slots=True)
class BucketKind:
    kind: str  # "all_reduce" | "reduce_scatter"
    axes: tuple[int, ...]  # the mesh axes it reduces over (one for a reduce-scatter)
    dim: int | None = None  # the tensor dim a reduce-scatter shards


def bucket_kind(src: Spec, dst: Spec) -> BucketKind | None:
    """How a gradient move joins a bucket, or None if it must run on its own."""
    axes = sum_axes(src, dst)
    if axes is not None:
        return BucketKind("all_reduce", axes)
    changed = [k for k, (a, b) in enumerate(zip(src, dst)) if a != b]
    if len(changed) != 1:
        return None
    k = changed[0]
    a, b = src[k], dst[k]
    if not (isinstance(a, Partial) and a.reduce == "sum" and isinstance(b, Shard)):
        return None
    if any(isinstance(p, Shard) and p.dim == b.dim for j, p in enumerate(src) if j != k):
        return None  # a nested shard: its blocks are not this simple layout
    return BucketKind("reduce_scatter", (k,), b.dim)


def bucket_collectives(bucket: list[GradSync], mesh_shape: tuple[int, ...],
                       merged: tuple[tuple[int, ...], ...] = ()
                       ) -> list[tuple[str, tuple[int, ...], float]]:
    """``(kind, mesh axes, bytes each rank hands in)`` of the collectives one bucket runs:
    one per axis, or one over all its axes where they are ``merged``
    (:func:`autopar.passes.cost.cost_model.merged_sums`)."""
    kind = bucket_kind(bucket[0].src, bucket[0].dst)
    assert kind is not None
    nbytes = sum(g.weight * g.meta.nbytes / num_shards(g.src, mesh_shape) for g in bucket)
    if kind.kind == "all_reduce" and kind.axes in merged:
        return [(kind.kind, kind.axes, nbytes)]
    return [(kind.kind, (ax,), nbytes) for ax in kind.axes]


def sync_groups(syncs: list[GradSync], mesh_shape: tuple[int, ...], bucketed: bool = True,
                first_bytes: float = FIRST_BUCKET_BYTES,
                ) -> list[tuple[list[GradSync], BucketKind | None]]:
    """Every gradient move once, as the runtime issues them: the buckets (the first closed at
    ``first_bytes``), with how each reduces, then each move no bucket takes, alone (kind
    ``None``)."""
    buckets = (gradient_buckets(syncs, mesh_shape, first_bucket_bytes=first_bytes)
               if bucketed else [])
    taken = {g.index for b in buckets for g in b}
    return ([(b, bucket_kind(b[0].src, b[0].dst)) for b in buckets]
            + [([g], None) for g in syncs if g.index not in taken])


def gradient_buckets(
    syncs: list[GradSync], mesh_shape: tuple[int, ...], bucket_bytes: float = BUCKET_BYTES,
    first_bucket_bytes: float = FIRST_BUCKET_BYTES,
) -> list[list[GradSync]]:
    """Groups of gradients reduced in one flat buffer, filled from the last of ``syncs`` (in
    parameter order) to the first; a gradient that cannot join any is left out (it is moved
    on its own)."""
    open_: dict[tuple, list[GradSync]] = {}
    sizes: dict[tuple, float] = {}
    closed: dict[tuple, int] = {}  # buckets closed so far per key: the first one is smaller
    done: list[list[GradSync]] = []
    for g in reversed(syncs):
        kind = bucket_kind(g.src, g.dst)
        if kind is None:
            continue
        key = (kind.kind, kind.axes, g.meta.dtype)
        local = g.weight * g.meta.nbytes / num_shards(g.src, mesh_shape)
        if key not in open_:
            open_[key], sizes[key] = [], 0.0
        open_[key].append(g)
        sizes[key] += local
        # as DDP: a bucket closes once it holds at least its size
        cap = bucket_bytes if closed.get(key, 0) else min(first_bucket_bytes, bucket_bytes)
        if sizes[key] >= cap:
            done.append(open_.pop(key))
            closed[key] = closed.get(key, 0) + 1
    return done + list(open_.values())


# --- parameter gathers, grouped per layer as FSDP gathers a module's parameters ---------------


@dataclass(frozen=True, slots=True)
class ParamGather:
    index: int  # position among the caller's gathers
    unit: tuple  # (phase, layer) of the op that reads the parameter
    meta: TensorMeta
    src: Spec
    dst: Spec
    weight: float = 1.0  # real gathers it stands for (depth proxy)


def gather_move(src: Spec, dst: Spec) -> tuple[int, int] | None:
    """``(mesh axis, tensor dim)`` when a move is one plain all-gather (``S(d) -> R`` on one
    axis, no other axis splitting ``d``), else None."""
    changed = [k for k, (a, b) in enumerate(zip(src, dst)) if a != b]
    if len(changed) != 1:
        return None
    k = changed[0]
    a, b = src[k], dst[k]
    if not (isinstance(a, Shard) and isinstance(b, Replicate)):
        return None
    if any(isinstance(p, Shard) and p.dim == a.dim for j, p in enumerate(src) if j != k):
        return None
    return k, a.dim


def gather_groups(gathers: list[ParamGather]) -> list[list[ParamGather]]:
    """Parameter gathers issued as one all-gather: those of one layer's ops in one phase
    (forward or backward) over the same mesh axis and of one dtype, as FSDP gathers a wrapped
    module's parameters at once. A move that is not one plain all-gather runs on its own."""
    groups: dict[tuple, list[ParamGather]] = {}
    for g in gathers:
        move = gather_move(g.src, g.dst)
        if move is not None:
            groups.setdefault((g.unit, move[0], g.meta.dtype), []).append(g)
    return list(groups.values())


def gather_group_bytes(group: list[ParamGather], mesh_shape: tuple[int, ...]) -> float:
    """What each rank hands to the group's all-gather: its shards of every parameter."""
    return sum(g.meta.nbytes / num_shards(g.src, mesh_shape) for g in group)
