"""The cost model: every plan, solver-made or hand-written, is scored by these functions.

- Compute: roofline on the device profile. An op's work is split over every mesh axis on
  which any of its operands is sharded (or its output is sharded/partial); on an axis where
  everything is replicated each device repeats the whole op.
- Communication: alpha-beta per mesh axis, ring algorithms. Resharding between two specs is
  decomposed axis by axis into all-gather, all-reduce, reduce-scatter and all-to-all, except
  a sum over a set of axes that :func:`merged_sums` merges: one all-reduce over the flattened
  group. The loss's own collective runs beside the backward (:func:`loss_collectives`).
- Memory per device: parameters with their gradients and optimizer state (Adam: two fp32
  moments), plus activations while they are live.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from functools import lru_cache

from autopar.ir.devices import NcclModel
from autopar.ir.graph import TensorMeta
from autopar.ir.mesh import Mesh
from autopar.ir.placements import Partial, Replicate, Shard, Spec, num_shards
from autopar.passes.cost.reshard_route import route, route_key

# ops that only reinterpret storage: no kernel, no traffic
VIEW_OPS = frozenset(
    f"aten.{n}"
    for n in (
        "view.default", "_unsafe_view.default", "t.default", "transpose.int", "permute.default",
        "expand.default", "unsqueeze.default", "squeeze.dim", "squeeze.dims", "squeeze.default",
        "alias.default", "detach.default", "split.Tensor", "split_with_sizes.default",
        "slice.Tensor", "select.int", "unbind.int", "chunk.default", "reshape.default",
        "as_strided.default", "lift_fresh_copy.default",
    )
) | {"getitem"}

ADAM_STATE_BYTES_PER_PARAM = 8.0  # exp_avg and exp_avg_sq in fp32
BUCKET_BYTES = 25 * 2**20  # DDP's default gradient bucket


@dataclass(frozen=True, slots=True)
class Collective:
    kind: str  # "all_gather" | "all_reduce" | "reduce_scatter" | "all_to_all"
    axis: str
    bytes: float  # size of the local buffer each rank hands to the collective
    time_s: float

    def __repr__(self) -> str:
        return f"{self.kind}[{self.axis}] {self.bytes / 1e6:.3g} MB"


def collective_time(
    kind: str, nbytes: float, n: int, bw: float, lat: float, overhead: float = 0.0,
    per_node: int = 0, nccl: NcclModel | None = None,
) -> float:
    """Time of one collective over ``n`` devices (``nbytes`` = full buffer). Without ``nccl``
    (gloo): the ring algorithm, ``overhead`` once, ``lat`` per ring step, and the bytes each
    device moves over ``bw``. With it: :func:`nccl_time`, ``per_node`` of the ``n`` devices
    in each node (0: all of them)."""
    if n <= 1:
        return 0.0
    if nccl is not None:
        return nccl_time(kind, nbytes, n, bw, per_node or n, nccl)
    if kind == "all_reduce":
        return overhead + 2 * (n - 1) * lat + 2 * (n - 1) / n * nbytes / bw
    # all-gather / reduce-scatter / all-to-all move (n-1)/n of the full buffer per device
    return overhead + (n - 1) * lat + (n - 1) / n * nbytes / bw


def nccl_time(kind: str, nbytes: float, n: int, bw: float, per_node: int,
              model: NcclModel) -> float:
    """NCCL's own estimate of a collective (``ncclTopoTuneModel`` in NVIDIA/nccl
    ``src/graph/tuning.cc``), the fastest of its protocols (and, for an all-reduce across
    nodes, of ring and tree), ``bw`` being the link's bus bandwidth (nccl-tests' ``busbw``
    of large messages). A ring of ``n`` ranks over ``n / per_node`` nodes takes ``2(n-1)``
    steps (all-reduce) or ``n-1`` (the others), of which ``2(nodes-1)`` or ``nodes-1`` cross
    the network. Held against nccl-tests' all-reduce on 8 NVLink-4 GPUs (tests/passes/cost/
    test_nccl_curve.py): 1 MiB 28 us, 16 MiB 121 us, 128 MiB 700 us measured."""
    per_node = max(1, min(per_node, n))
    nodes = max(1, n // per_node)
    ar = kind == "all_reduce"
    steps = 2 * (n - 1) if ar else n - 1
    net_steps = 0 if nodes == 1 else (2 * (nodes - 1) if ar else nodes - 1)
    moved = (2 if ar else 1) * (n - 1) / n * nbytes
    ll_cap = (model.ll_max_busbw_node if nodes == 1 else
              model.ll_max_busbw_two_nodes if nodes == 2 else model.ll_max_busbw_nodes)
    best = math.inf
    for p in model.protocols:
        link = bw * p.bw_fraction
        if p.name == "LL":
            link = min(link, ll_cap)
        if nodes == 1:
            lat = steps * p.nvlink_step_s
        else:
            post = model.net_overhead_s * (3 if p.name == "Simple" else 1)
            net = p.net_step_one_per_node_s if per_node == 1 else p.net_step_s
            lat = (steps - net_steps) * max(p.nvlink_step_s, post) + net_steps * net
        best = min(best, p.base_s + lat + moved / link)
        if ar and nodes > 1:  # the tree: up and down a tree of nodes, a chain within each
            tree_link = bw * p.tree_bw_fraction
            if p.name == "LL":
                tree_link = min(tree_link, ll_cap)
            tree_lat = 2 * ((per_node - 1) * p.tree_nvlink_step_s
                            + math.log2(nodes) * p.tree_net_step_s)
            best = min(best, p.tree_base_s + tree_lat + 2 * nbytes / tree_link)
    return best


def members_per_node(mesh: Mesh, axes: tuple[int, ...]) -> int:
    """How many of the devices of one group over mesh ``axes`` share a node: torchrun lays
    ranks out with the last axis innermost, ``devices_per_node`` to a node (as
    ``autopar.ir.mesh``'s default links do)."""
    node = mesh.device.devices_per_node
    out = 1
    for ax in axes:
        inner = math.prod(mesh.shape[ax + 1:])
        out *= max(1, min(mesh.shape[ax], node // inner)) if inner < node else 1
    return out


def sum_axes(src: Spec, dst: Spec) -> tuple[int, ...] | None:
    """The mesh axes of a move that only sums partial values into whole ones (``P(sum) ->
    R`` on each, every other axis unchanged), or None if the move does anything else."""
    axes = []
    for k, (a, b) in enumerate(zip(src, dst)):
        if a == b:
            continue
        if isinstance(a, Partial) and a.reduce == "sum" and isinstance(b, Replicate):
            axes.append(k)
        else:
            return None
    return tuple(axes) or None


def merged_sums(mesh: Mesh) -> tuple[tuple[int, ...], ...]:
    """The sets of two or more mesh axes over which a sum runs as one all-reduce over the
    flattened group rather than axis by axis: those where one ring is no dearer at any size
    (its fixed cost, ``overhead + 2(N-1)`` ring steps at the slowest axis's latency, and its
    per-byte cost, ``2(N-1)/N`` over the slowest bandwidth, both at most the per-axis
    collectives' sums). On ``cpu`` (gloo: a large fixed cost per collective) a 2x2 mesh
    merges; on GPU profiles the extra ring steps, or a slower link on one axis, keep the
    sums axis by axis. The plan records the result (``Plan.decided.merged_sums``) and the runtime
    follows it."""
    return _merged_sums(mesh.shape, mesh.bandwidth, mesh.latency, mesh.device.collective_overhead)


@lru_cache(maxsize=256)
def _merged_sums(shape: tuple[int, ...], bw: tuple[float, ...], lat: tuple[float, ...],
                 overhead: float) -> tuple[tuple[int, ...], ...]:
    live = [k for k, n in enumerate(shape) if n > 1]
    out = []
    for size in range(2, len(live) + 1):
        for axes in itertools.combinations(live, size):
            n = math.prod(shape[k] for k in axes)
            fixed = overhead + 2 * (n - 1) * max(lat[k] for k in axes)
            per_byte = 2 * (n - 1) / n / min(bw[k] for k in axes)
            fixed_apart = sum(overhead + 2 * (shape[k] - 1) * lat[k] for k in axes)
            per_byte_apart = sum(2 * (shape[k] - 1) / shape[k] / bw[k] for k in axes)
            if fixed <= fixed_apart and per_byte <= per_byte_apart:
                out.append(axes)
    return tuple(out)


def axes_label(names: tuple[str, ...], axes: tuple[int, ...]) -> str:
    """How plans and counters name a collective over ``axes`` (``"dp+tp"`` when merged)."""
    return "+".join(names[k] for k in axes)


def async_tp_share(kind: str, axis: str, mesh: Mesh) -> float:
    """The share of an in-line collective (one an op waits for) that torch's async TP hides
    behind the matmul beside it, on a profile that runs it (``DeviceProfile.async_tp``):
    all-gathers and reduce-scatters inside one node, which its micro-pipelining decomposes
    into copies; all-reduces (TP without sequence parallelism) and collectives crossing
    nodes stay in line."""
    share = mesh.device.async_tp
    if share and kind in ("all_gather", "reduce_scatter") and mesh.in_node(axis):
        return share
    return 0.0


@dataclass(frozen=True, slots=True)
class Move:
    """One collective of a reshard, for a tensor of any size: it works on the tensor's bytes
    over ``divisor`` (the tensor as the other axes shard it), over ``n`` devices."""

    kind: str
    axis: str
    divisor: int
    n: int
    bandwidth: float
    latency: float
    overhead: float
    per_node: int = 0  # of the ``n`` devices, how many share a node (NCCL's model)
    nccl: NcclModel | None = None

    def collective(self, nbytes: float, bucketed: bool = False,
                   bucket_bytes: float = BUCKET_BYTES) -> Collective:
        """The collective for a tensor of ``nbytes`` (``bucketed``: see
        :func:`reshard_collectives`)."""
        buf = nbytes / self.divisor
        if self.nccl is not None:
            # a batched move pays its share of its batch's collective
            whole = bucketed and buf < bucket_bytes
            t = collective_time(self.kind, bucket_bytes if whole else buf, self.n,
                                self.bandwidth, self.latency, self.overhead, self.per_node,
                                self.nccl) * (buf / bucket_bytes if whole else 1.0)
        else:
            share = min(1.0, buf / bucket_bytes) if bucketed else 1.0
            t = collective_time(self.kind, buf, self.n, self.bandwidth, self.latency * share,
                                self.overhead * share)
        # what each rank hands to the collective: its shard for gathers and all-to-alls
        local = buf / self.n if self.kind in ("all_gather", "all_to_all") else buf
        return Collective(self.kind, self.axis, local, t)

    def time(self, nbytes: float, bucketed: bool = False,
             bucket_bytes: float = BUCKET_BYTES) -> float:
        return self.collective(nbytes, bucketed, bucket_bytes).time_s


def reshard_collectives(
    meta: TensorMeta, src: Spec, dst: Spec, mesh: Mesh, bucketed: bool = False,
    bucket_bytes: float = BUCKET_BYTES, merged: tuple[tuple[int, ...], ...] | None = None,
) -> list[Collective]:
    """The collectives that turn a tensor placed as ``src`` into ``dst``, axis by axis; a
    sum over a set of axes in ``merged`` (default: :func:`merged_sums` of ``mesh``) as one
    all-reduce over them.

    ``bucketed``: a move the runtime batches with others (gradient reductions in buckets of
    up to ``BUCKET_BYTES``, parameter gathers per layer, as DDP and FSDP do;
    :mod:`autopar.passes.cost.buckets`), so a small tensor pays only its share of a collective's
    latency: its bytes over ``bucket_bytes``, what the batch it joins holds."""
    return [m.collective(float(meta.nbytes), bucketed, bucket_bytes)
            for m in reshard_moves(meta, src, dst, mesh, merged)]


def route_collectives(meta: TensorMeta, src: Spec, dst: Spec, mesh: Mesh,
                      merged: tuple[tuple[int, ...], ...] | None = None) -> list[Collective]:
    """The collectives :func:`autopar.passes.cost.reshard_route.route` issues:
    :func:`reshard_collectives` prices every reshard by its route, so the two are one
    function; ``merged`` as there."""
    return reshard_collectives(meta, src, dst, mesh, merged=merged)


def reshard_moves(
    meta: TensorMeta, src: Spec, dst: Spec, mesh: Mesh,
    merged: tuple[tuple[int, ...], ...] | None = None,
) -> list[Move]:
    """:func:`reshard_collectives` before the tensor's size is put in: the moves depend on its
    shape only where a nested route does (:func:`reshard_route_key`)."""
    if src == dst:
        return []
    axes = sum_axes(src, dst)
    if axes is not None and len(axes) > 1 and axes in (
            merged_sums(mesh) if merged is None else merged):
        return [Move("all_reduce", axes_label(mesh.axes, axes), num_shards(src, mesh.shape),
                     math.prod(mesh.shape[k] for k in axes),
                     min(mesh.bandwidth[k] for k in axes), max(mesh.latency[k] for k in axes),
                     mesh.device.collective_overhead, members_per_node(mesh, axes),
                     mesh.device.nccl)]
    out: list[Move] = []
    cur = list(src)
    for ax, b in _steps(meta, src, dst, mesh.shape):
        kind = _transition(cur[ax], b)
        if kind is not None:
            # the buffer this axis works on: the tensor as sharded by the other axes
            others = tuple(p if i != ax else Replicate() for i, p in enumerate(cur))
            out.append(Move(kind, mesh.axes[ax], num_shards(others, mesh.shape), mesh.shape[ax],
                            mesh.bandwidth[ax], mesh.latency[ax],
                            mesh.device.collective_overhead, members_per_node(mesh, (ax,)),
                            mesh.device.nccl))
        cur[ax] = b
    return out


def _steps(meta: TensorMeta, src: Spec, dst: Spec, mesh_shape: tuple[int, ...]) -> list:
    """``(axis, new placement)`` in the order the runtime runs them: ascending axes where that
    order is valid, another where nested shards (two axes splitting one dim, before, during or
    after the move) need it (``passes.reshard_route``)."""
    ascending = [(ax, dst[ax]) for ax in range(len(src)) if src[ax] != dst[ax]]
    if not _walk_nests(src, dst, len(meta.shape), mesh_shape):
        return ascending
    return route(*_route_args(meta, src, dst, mesh_shape))[0]


def _walk_nests(src: Spec, dst: Spec, ndim: int, mesh_shape: tuple[int, ...]) -> bool:
    """Whether the ascending walk from ``src`` to ``dst`` has two axes splitting one dim at
    some point, so that its order comes from the route (:func:`_steps`). Never on a mesh
    above ``_ROUTE_SIM_DEVICES``: the route simulates every device, and on a mesh that large
    (planned, not run here) the ascending order prices nested moves approximately, which is
    kept for planning time."""
    if math.prod(mesh_shape) > _ROUTE_SIM_DEVICES:
        return False
    states = [tuple(dst[:k]) + tuple(src[k:]) for k in range(len(src) + 1)]
    return any(_nested(s, ndim) for s in states)


def _route_args(meta: TensorMeta, src: Spec, dst: Spec, mesh_shape: tuple[int, ...]
                ) -> tuple[Spec, Spec, tuple[int, ...], tuple[int, ...]]:
    """:func:`route`'s arguments for ``meta``: the specs with their dims counted from the
    front, and the tensor's local piece under ``src``."""
    nd = len(meta.shape)
    src = tuple(Shard(p.dim % nd) if isinstance(p, Shard) else p for p in src)
    dst = tuple(Shard(p.dim % nd) if isinstance(p, Shard) else p for p in dst)
    local = tuple(
        meta.shape[d] // math.prod(n for p, n in zip(src, mesh_shape) if p == Shard(d))
        for d in range(nd)
    )
    return src, dst, local, tuple(mesh_shape)


_ROUTE_SIM_DEVICES = 64


def reshard_price_key(meta: TensorMeta, mesh: Mesh) -> tuple:
    """What of a tensor its reshards' prices (:func:`reshard_collectives`) depend on: its
    bytes alone on a mesh above ``_ROUTE_SIM_DEVICES`` (the moves run in ascending axis order
    there, see :func:`_steps`), else its shape too (a nested route depends on it). Tensors of
    one key price every move alike, so a cache keyed by it prices each move once."""
    if math.prod(mesh.shape) > _ROUTE_SIM_DEVICES:
        return (meta.nbytes,)
    return (meta.shape, meta.dtype)


def reshard_route_key(meta: TensorMeta, mesh: Mesh) -> tuple:
    """What of a tensor the moves of its reshards (:func:`reshard_moves`) depend on, those of
    the pairs :func:`route_reads_shape` names aside: nothing on a mesh above
    ``_ROUTE_SIM_DEVICES`` (ascending axis order), else its number of dims (a spec may name a
    dim from the end)."""
    return () if math.prod(mesh.shape) > _ROUTE_SIM_DEVICES else (len(meta.shape),)


def route_reads_shape(src: Spec, dst: Spec, ndim: int, mesh: Mesh) -> bool:
    """Whether the moves from ``src`` to ``dst`` of a tensor of ``ndim`` dims depend on its
    shape: nested shards take their order from the route, which reads it
    (:func:`nested_route_key`); every other pair's moves are the ascending walk's, the same
    for every tensor of one :func:`reshard_route_key` (moe-tiny on 2 x 2: 3,370 walks stand
    for 38 thousand (tensor, pair) moves)."""
    return _walk_nests(src, dst, ndim, mesh.shape)


def nested_route_key(meta: TensorMeta, src: Spec, dst: Spec, mesh: Mesh) -> tuple:
    """What of a tensor the moves of a reshard :func:`route_reads_shape` names depend on: its
    number of dims and what of its local shape the route reads (:func:`route_key`)."""
    return (len(meta.shape), route_key(*_route_args(meta, src, dst, mesh.shape)))


def _nested(spec: Spec, ndim: int) -> bool:
    dims = [p.dim % max(ndim, 1) for p in spec if isinstance(p, Shard)]
    return len(dims) != len(set(dims))


def _transition(a, b) -> str | None:
    if isinstance(b, Replicate):
        if isinstance(a, Shard):
            return "all_gather"
        if isinstance(a, Partial):
            return "all_reduce"
    if isinstance(b, Shard):
        if isinstance(a, Partial):
            return "reduce_scatter"
        if isinstance(a, Shard):
            return "all_to_all"
        return None  # R -> S: each rank keeps its slice
    if isinstance(b, Partial):
        if isinstance(a, Shard):
            return "all_gather"  # gather, then keep it on one rank: zeros elsewhere
        if isinstance(a, Partial):
            return "all_reduce"  # another reduce op
        return None  # R -> P: divide or zero on the other ranks, no traffic
    return None


def loss_collectives(meta: TensorMeta, src: Spec, mesh: Mesh) -> list[Collective]:
    """The collectives that make the loss whole on every rank, priced as the runtime runs
    them: issued at the end of the forward, waited for at the end of the backward
    (``runtime/deferred_loss.py``), so they run beside the backward. Where the device's
    communication overlaps compute, the backward hides them (priced 0). Where it does not
    (``cpu``: gloo works on the cores the model computes on), each costs at most the
    profile's per-collective overhead, not its latency: no rank waits for another there.
    (Measured on 4 gloo processes: DDP made to all-reduce its loss this way ran 0.96-1.03x
    plain DDP, where a synchronous collective mid-step costs 3-7 ms.)"""
    colls = reshard_collectives(meta, src, (Replicate(),) * mesh.ndim, mesh)
    cap = 0.0 if mesh.device.comm_overlaps_compute else mesh.device.collective_overhead
    return [replace(c, time_s=min(c.time_s, cap)) for c in colls]


def reshard_time(
    meta: TensorMeta, src: Spec, dst: Spec, mesh: Mesh, bucketed: bool = False,
    bucket_bytes: float = BUCKET_BYTES,
) -> float:
    if src == dst:
        return 0.0
    return sum(c.time_s for c in reshard_collectives(meta, src, dst, mesh, bucketed,
                                                     bucket_bytes))


def work_split(ins: tuple[Spec, ...], outs: tuple[Spec, ...], mesh: Mesh) -> int:
    """By how much an op's work shrinks per device under a strategy."""
    f = 1
    for ax, n in enumerate(mesh.shape):
        if any(not isinstance(s[ax], Replicate) for s in ins + outs if s):
            f *= n
    return f


def compute_time(
    op: str,
    flops: float,
    in_metas: tuple[TensorMeta, ...],
    out_metas: tuple[TensorMeta | None, ...],
    ins: tuple[Spec, ...],
    outs: tuple[Spec, ...],
    mesh: Mesh,
) -> float:
    """Roofline time of one op on one device under a strategy."""
    if op in VIEW_OPS:
        return 0.0
    traffic = 0.0
    for m, s in zip(in_metas, ins):
        traffic += m.nbytes / num_shards(s, mesh.shape)
    for m, s in zip(out_metas, outs):
        if m is not None:
            traffic += m.nbytes / num_shards(s, mesh.shape)
    dtype = (out_metas[0] or in_metas[0]).dtype_name if (out_metas or in_metas) else "float32"
    dev = mesh.device
    t_flops = 0.0
    if flops:
        t_flops = flops / work_split(ins, outs, mesh) / op_flops_per_s(op, dtype, in_metas,
                                                                     ins, mesh)
    return max(t_flops, traffic / dev.bytes_per_s())


GEMM_OPS = frozenset(f"aten.{n}" for n in ("mm.default", "addmm.default", "bmm.default",
                                           "baddbmm.default"))


def is_attention(op: str) -> bool:
    """A fused attention kernel (torch's SDPA backends, forward or backward)."""
    return "scaled_dot_product" in op or "flash_attention" in op or (
        "efficient_attention" in op)


def op_flops_per_s(op: str, dtype: str, in_metas: tuple[TensorMeta, ...],
                   ins: tuple[Spec, ...], mesh: Mesh) -> float:
    """The FLOP/s one device reaches on an op: a GEMM at its shape's efficiency (the local
    ``m, n, k`` each device multiplies, :meth:`DeviceProfile.gemm_efficiency`), a fused
    attention kernel at the profile's attention rate, anything else at the large-GEMM rate."""
    dev = mesh.device
    if is_attention(op):
        return dev.attention_flops_per_s(dtype)
    if op in GEMM_OPS and dev.sms > 0:
        mnk = _gemm_shape(op, in_metas, ins, mesh.shape)
        if mnk is not None:
            return dev.peak(dtype) * dev.gemm_efficiency(*mnk)
    return dev.flops_per_s(dtype)


def _gemm_shape(op: str, in_metas: tuple[TensorMeta, ...], ins: tuple[Spec, ...],
                mesh_shape: tuple[int, ...]) -> tuple[int, int, int] | None:
    """``(m, n, k)`` of the GEMM one device runs (a batched GEMM's batch folded into ``m``),
    from its operands' local shapes."""
    first = 1 if op in ("aten.addmm.default", "aten.baddbmm.default") else 0
    if len(in_metas) < first + 2 or len(ins) < first + 2:
        return None
    a = local_shape(in_metas[first].shape, ins[first], mesh_shape)
    b = local_shape(in_metas[first + 1].shape, ins[first + 1], mesh_shape)
    if len(a) < 2 or len(b) < 2:
        return None
    batch = math.prod(a[:-2]) if len(a) > 2 else 1
    return batch * a[-2], b[-1], a[-1]


def local_shape(shape: tuple[int, ...], spec: Spec, mesh_shape: tuple[int, ...]
                ) -> tuple[int, ...]:
    """The shape of one device's piece of a tensor placed as ``spec``."""
    out = list(shape)
    for p, n in zip(spec, mesh_shape):
        if isinstance(p, Shard) and out:
            d = p.dim % len(out)
            out[d] = max(1, out[d] // n)
    return tuple(out)


def param_bytes_per_device(meta: TensorMeta, spec: Spec, mesh: Mesh, optimizer: bool = True,
                           grad: bool = True) -> float:
    """Parameter + gradient (+ Adam state) bytes one device holds for a parameter;
    ``grad=False``: without the gradient (the memory model counts it where the backward makes
    it, since a training loop's ``zero_grad`` frees it before the next forward)."""
    per_elem = ((2 if grad else 1) * meta.dtype.itemsize
                + (ADAM_STATE_BYTES_PER_PARAM if optimizer else 0.0))
    return meta.numel * per_elem / num_shards(spec, mesh.shape)


def activation_bytes(meta: TensorMeta | None, spec: Spec, mesh: Mesh) -> float:
    if meta is None:
        return 0.0
    return meta.nbytes / num_shards(spec, mesh.shape)
