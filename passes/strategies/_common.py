"""Helpers shared by the rule families: dim normalisation, broadcasting, input slots.

Rule functions see an :class:`OpInfo` whose ``args`` hold a :class:`TensorMeta` wherever the node
had a tensor. Rules must give one placement per *tensor input in flattened order*, which shifts
when an optional tensor (a norm's weight, a loss's class weight) is ``None``. :func:`slots` and
:func:`ins_for` let a rule name inputs by argument position instead, so it never miscounts.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from autopar.ir.graph import TensorMeta
from autopar.ir.placements import Partial, Placement, R, Shard
from autopar.passes.strategies.registry import OpInfo, Rule

PSUM = Partial("sum")
PMAX = Partial("max")
PMIN = Partial("min")

Slot = int | str | tuple  # arg position, kwarg name, or (position, index) inside a list arg


def norm_dim(d: int, ndim: int) -> int:
    """``d`` made non-negative; a 0-d tensor accepts dim 0 / -1 (torch treats it as 1-d)."""
    if ndim == 0:
        return 0
    return d % ndim


def norm_dims(dims: Any, ndim: int) -> tuple[int, ...]:
    """The reduced dims of a reduction: ``None`` or ``[]`` mean all of them (torch's convention)."""
    if dims is None:
        return tuple(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    dims = list(dims)
    if not dims:
        return tuple(range(ndim))
    return tuple(sorted({norm_dim(d, ndim) for d in dims}))


def slots(info: OpInfo) -> list[Slot]:
    """Where each tensor input sits among the args, in the registry's flattened order."""
    found: list[Slot] = []
    for i, a in enumerate(info.args):
        if isinstance(a, TensorMeta):
            found.append(i)
        elif isinstance(a, (list, tuple)):
            found.extend((i, j) for j, x in enumerate(a) if isinstance(x, TensorMeta))
    for k, v in info.kwargs.items():
        if isinstance(v, TensorMeta):
            found.append(k)
        elif isinstance(v, (list, tuple)):
            found.extend((k, j) for j, x in enumerate(v) if isinstance(x, TensorMeta))
    return found


def ins_for(info: OpInfo, by_slot: dict[Slot, Placement], default: Placement = R) -> tuple:
    """Input placements in flattened order from a map keyed by argument position."""
    return tuple(by_slot.get(s, default) for s in slots(info))


def meta_at(info: OpInfo, slot: Slot) -> TensorMeta | None:
    """The tensor at argument position ``slot`` (or kwarg name), ``None`` if absent/not a tensor."""
    if isinstance(slot, tuple):
        container = info.arg(slot[0]) if isinstance(slot[0], int) else info.kwargs.get(slot[0])
        v = container[slot[1]] if container is not None else None
    elif isinstance(slot, int):
        v = info.args[slot] if slot < len(info.args) else None
    else:
        v = info.kwargs.get(slot)
    return v if isinstance(v, TensorMeta) else None


def outs_for(info: OpInfo, placement: Placement | Sequence[Placement]) -> tuple:
    """One placement per output; a ``None`` output (an unrequested grad) is always ``R``."""
    if isinstance(placement, (list, tuple)):
        ps = list(placement)
    else:
        ps = [placement] * len(info.outputs)
    return tuple(R if o is None else p for o, p in zip(info.outputs, ps))


def bcast(p: Placement, meta: TensorMeta, out_shape: Sequence[int]) -> Placement:
    """The placement an operand needs so that broadcasting it gives ``p`` on the output.

    Trailing dims align; an output dim the operand lacks, or has as size 1 while the output is
    larger, is broadcast, so every rank needs the operand whole there (``R``)."""
    if not isinstance(p, Shard):
        return p
    d = p.dim - (len(out_shape) - len(meta.shape))
    if d < 0 or (meta.shape[d] == 1 and out_shape[p.dim] != 1):
        return R
    return Shard(d)


def shardable_dims(shape: Sequence[int], exclude: Iterable[int] = ()) -> list[int]:
    """Dims worth a shard rule: size > 1 (a size-1 dim never splits evenly) and not excluded."""
    ex = set(exclude)
    return [d for d, n in enumerate(shape) if n > 1 and d not in ex]


def reduced_out_dim(d: int, reduced: Sequence[int], keepdim: bool) -> int:
    """Where input dim ``d`` (not reduced) lands in a reduction's output."""
    return d if keepdim else d - sum(1 for r in reduced if r < d)


def dedupe(rules: Iterable[Rule]) -> list[Rule]:
    return list(dict.fromkeys(rules))


def is_float(meta: TensorMeta | None) -> bool:
    """Floating or complex: types in which a sum of partials rounds like the whole value."""
    return meta is not None and (meta.dtype.is_floating_point or meta.dtype.is_complex)


def shard_offset(
    spec: Sequence[Placement], mesh_shape: Sequence[int], coord: Sequence[int], dim: int, size: int
) -> int:
    """Global index of the first element of this rank's piece of ``dim`` (nested shards split
    in mesh-axis order, as :func:`simulate.shard` and DTensor do; sizes divide evenly)."""
    offset, extent = 0, size
    for p, n, c in zip(spec, mesh_shape, coord):
        if isinstance(p, Shard) and p.dim == dim:
            extent //= n
            offset += c * extent
    return offset
