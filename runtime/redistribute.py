"""Moving a local tensor from one placement spec to another with functional collectives.

The steps mirror :func:`autopar.passes.cost.cost_model.reshard_collectives`: one mesh axis at a time,
each transition one collective of the kind the cost model predicts, with the same byte count
(the local buffer each rank hands in), so what runs is what the plan priced:

==============  ============================================================================
``S(d) -> R``   all-gather along ``d``
``P -> R``      all-reduce
``P -> S(d)``   reduce-scatter along ``d``
``S(a) -> S(b)``all-to-all (chunk ``b``, exchange, concatenate along ``a``)
``R -> S(d)``   local slice, no traffic
``R -> P``      the value stays on coordinate 0 of the axis, zeros elsewhere (exact for every
                dtype, unlike dividing by the axis size)
``S(d) -> P``   all-gather, then as ``R -> P``
==============  ============================================================================

Nested shards (two mesh axes splitting one dim) are routed by :mod:`autopar.passes.cost.reshard_route`.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from autopar.ir.placements import Partial, Placement, Replicate, Shard, Spec, normalize_spec
from autopar.passes.cost.cost_model import axes_label, sum_axes
from autopar.passes.cost.reshard_route import route
from autopar.runtime import _compat

_REDUCE_OPS = {"sum": "sum", "max": "max", "amax": "max", "min": "min", "amin": "min",
               "avg": "avg", "mean": "avg"}


@dataclass(frozen=True, slots=True)
class ExecutedCollective:
    kind: str  # "all_gather" | "all_reduce" | "reduce_scatter" | "all_to_all"
    axis: str
    bytes: int  # the local buffer handed in, as cost_model.Collective.bytes
    reason: str  # "resharding", "gradient sync", "parameter gather", "loss", ...


@dataclass
class CollectiveCounter:
    """Every collective the runtime issued, in order; tests compare it with the plan."""

    records: list[ExecutedCollective] = field(default_factory=list)

    def reset(self) -> None:
        self.records.clear()

    def add(self, c: ExecutedCollective) -> None:
        self.records.append(c)

    def totals(self, by_reason: bool = False) -> dict[tuple, tuple[int, float]]:
        """``(kind, axis[, reason]) -> (count, bytes)`` summed over the records."""
        count: Counter = Counter()
        nbytes: Counter = Counter()
        for r in self.records:
            key = (r.kind, r.axis, r.reason) if by_reason else (r.kind, r.axis)
            count[key] += 1
            nbytes[key] += r.bytes
        return {k: (count[k], float(nbytes[k])) for k in count}


class Comm:
    """This rank's view of the mesh: axis groups, its coordinate, the collective counter."""

    def __init__(self, device_mesh: Any, axes: tuple[str, ...], shape: tuple[int, ...],
                 coord: tuple[Any, ...], counter: CollectiveCounter,
                 merged: tuple[tuple[int, ...], ...] = ()) -> None:
        """``merged``: the axis sets whose sums run as one all-reduce over the flattened group
        (``Plan.decided.merged_sums``); their groups are made here, on every rank at once."""
        self.device_mesh = device_mesh
        self.axes = axes
        self.shape = shape
        self.coord = coord  # ints on a real rank; SymInts under LocalTensorMode
        self.counter = counter
        self._sync = True  # False inside deferred(): collectives are issued, not waited for
        self._groups: dict[tuple[int, ...], Any] = {}  # flattened meshes made so far
        self._flat: dict[tuple[int, ...], Any] = {}  # those the active plan merges
        self.merge(merged)

    def merge(self, merged: tuple[tuple[int, ...], ...]) -> None:
        """Sum over each of these axis sets (and no others) as one collective from now on, as
        the plan being run was priced. Every rank calls this at the same point: making a group
        is collective."""
        for axes in merged:
            if axes not in self._groups:
                self._groups[axes] = _flattened(self.device_mesh, self.axes, axes)
        self._flat = {axes: self._groups[axes] for axes in merged}

    @property
    def merged(self) -> Any:
        """The axis sets summed as one collective."""
        return self._flat.keys()

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Within the block, gathers, all-reduces and reduce-scatters return without waiting
        (an op on the result, or ``_compat.wait``, waits for it)."""
        before, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = before

    def _group(self, ax: int) -> Any:
        return (self.device_mesh, ax)

    def _record(self, kind: str, ax: int, t: torch.Tensor, reason: str) -> None:
        self.counter.add(ExecutedCollective(kind, self.axes[ax], t.numel() * t.element_size(),
                                            reason))

    def _record_over(self, kind: str, axes: tuple[int, ...], t: torch.Tensor,
                     reason: str) -> None:
        """One collective over a merged axis set, named as the plan names it."""
        self.counter.add(ExecutedCollective(kind, axes_label(self.axes, axes),
                                            t.numel() * t.element_size(), reason))

    def all_gather(self, t: torch.Tensor, dim: int, ax: int, reason: str) -> torch.Tensor:
        self._record("all_gather", ax, t, reason)
        return _compat.all_gather(t, dim, self._group(ax), self._sync)

    def all_reduce(self, t: torch.Tensor, op: str, ax: int, reason: str) -> torch.Tensor:
        self._record("all_reduce", ax, t, reason)
        return _compat.all_reduce(t, _reduce_op(op), self._group(ax), self._sync)

    def reduce_scatter(self, t: torch.Tensor, op: str, dim: int, ax: int,
                       reason: str) -> torch.Tensor:
        self._record("reduce_scatter", ax, t, reason)
        return _compat.reduce_scatter(t, _reduce_op(op), dim, self._group(ax), self._sync)

    def start_all_reduce(self, t: torch.Tensor, ax: int, reason: str) -> Any:
        """Sum ``t`` over axis ``ax`` in place, issued without waiting; returns the work to
        wait on (a bucket's buffer is ours: no copy, as DDP reduces its buckets)."""
        self._record("all_reduce", ax, t, reason)
        return _compat.start_all_reduce(t, self.device_mesh.get_group(ax))

    def sum_over(self, t: torch.Tensor, axes: tuple[int, ...], reason: str) -> torch.Tensor:
        """``t`` summed over the ``merged`` axis set ``axes``: one all-reduce."""
        self._record_over("all_reduce", axes, t, reason)
        return _compat.all_reduce(t, "sum", (self._flat[axes], 0), self._sync)

    def start_sum(self, t: torch.Tensor, axes: tuple[int, ...], reason: str
                  ) -> tuple[torch.Tensor, Any]:
        """``t`` (ours: changed in place where that saves a copy) summed over mesh ``axes``,
        issued without waiting: ``(result, work)``. Over one axis, or a ``merged`` set of
        them, c10d's in-place all-reduce, whose work to wait on is returned; over several
        others, one axis after the other (the second waits for the first), and the result
        waits itself (work None)."""
        if len(axes) == 1:
            return t, self.start_all_reduce(t, axes[0], reason)
        if axes in self._flat:
            self._record_over("all_reduce", axes, t, reason)
            return t, _compat.start_all_reduce(t, self._flat[axes].get_group())
        nd = len(self.shape)
        src = tuple(Partial() if k in axes else Replicate() for k in range(nd))
        with self.deferred():
            return redistribute(t, src, (Replicate(),) * nd, self, reason), None

    def start_reduce_scatter(self, t: torch.Tensor, ax: int, reason: str) -> tuple[Any, Any]:
        """This rank's row of ``t`` (rows: the ranks of axis ``ax``) summed over the axis,
        issued without waiting: ``(result, work)``."""
        self._record("reduce_scatter", ax, t, reason)
        return _compat.start_reduce_scatter(t, self.device_mesh.get_group(ax))

    def all_to_all(self, t: torch.Tensor, src_dim: int, dst_dim: int, ax: int,
                   reason: str) -> torch.Tensor:
        n = self.shape[ax]
        self._record("all_to_all", ax, t, reason)
        # block j of dst_dim goes to rank j; what comes back from rank j is its src_dim piece
        blocks = torch.stack(t.chunk(n, dim=dst_dim))
        got = _compat.all_to_all(blocks, self._group(ax))
        return torch.cat(got.unbind(0), dim=src_dim)

    def local_slice(self, t: torch.Tensor, dim: int, ax: int) -> torch.Tensor:
        n = self.shape[ax]
        length = t.shape[dim] // n
        # narrow takes the (possibly symbolic) coordinate without a Python branch on it
        return t.narrow(dim, self.coord[ax] * length, length).contiguous()

    def keep_on_first(self, t: torch.Tensor, ax: int) -> torch.Tensor:
        c = self.coord[ax]
        if isinstance(c, int):
            return t if c == 0 else torch.zeros_like(t)
        # symbolic coordinate (LocalTensorMode): pick by index instead of branching on it
        n = self.shape[ax]
        return torch.stack([t] + [torch.zeros_like(t)] * (n - 1)).select(0, c)


def _flattened(device_mesh: Any, axes: tuple[str, ...], merged: tuple[int, ...]) -> Any:
    """A 1-D DeviceMesh over the ``merged`` dims of ``device_mesh`` (every rank makes it)."""
    from torch.distributed.device_mesh import DeviceMesh

    if device_mesh.mesh_dim_names is None:  # slicing needs names: the same mesh, named
        device_mesh = DeviceMesh(device_mesh.device_type, device_mesh.mesh,
                                 mesh_dim_names=axes)
    names = tuple(device_mesh.mesh_dim_names[k] for k in merged)
    return device_mesh[names]._flatten(axes_label(device_mesh.mesh_dim_names, merged))


def _reduce_op(op: str) -> str:
    try:
        return _REDUCE_OPS[op]
    except KeyError:
        raise NotImplementedError(f"no collective reduces with {op!r}") from None


def redistribute(t: torch.Tensor, src: Spec, dst: Spec, comm: Comm,
                 reason: str = "resharding") -> torch.Tensor:
    """``t`` (this rank's piece under ``src``) as this rank's piece under ``dst``."""
    if src == dst:
        return t
    nd = t.dim()
    if nd:
        src, dst = normalize_spec(src, nd), normalize_spec(dst, nd)
    if comm.merged:  # a sum over a merged axis set: one all-reduce over the flattened group
        axes = sum_axes(src, dst)
        if axes is not None and axes in comm.merged:
            return comm.sum_over(t, axes, reason)
    steps, perms = route(src, dst, tuple(t.shape), comm.shape)
    cur = list(src)
    for ax, b in steps:
        why = reason if b == dst[ax] else "nested-shard fallback"
        t = _transition(t, cur[ax], b, ax, comm, why)
        cur[ax] = b
    for d, perm in perms.items():
        blocks = t.chunk(len(perm), dim=d)
        t = torch.cat([blocks[i] for i in perm], dim=d)
    return t


def _transition(t: torch.Tensor, a: Placement, b: Placement, ax: int, comm: Comm,
                reason: str) -> torch.Tensor:
    if isinstance(b, Replicate):
        if isinstance(a, Shard):
            return comm.all_gather(t, a.dim, ax, reason)
        if isinstance(a, Partial):
            return comm.all_reduce(t, a.reduce, ax, reason)
        return t
    if isinstance(b, Shard):
        if isinstance(a, Partial):
            return comm.reduce_scatter(t, a.reduce, b.dim, ax, reason)
        if isinstance(a, Shard):
            return comm.all_to_all(t, a.dim, b.dim, ax, reason)
        return comm.local_slice(t, b.dim, ax)
    assert isinstance(b, Partial)
    if isinstance(a, Shard):
        t = comm.all_gather(t, a.dim, ax, reason)
    elif isinstance(a, Partial):  # another reduce op: make it whole first
        t = comm.all_reduce(t, a.reduce, ax, reason)
    if b.reduce == "sum":
        return comm.keep_on_first(t, ax)
    return t  # max / min / avg: a whole value on every rank is already a valid partial
