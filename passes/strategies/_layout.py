"""Shape helpers shared by the data-movement rule families (views, embedding, attention, MoE).

Kept apart from the rule modules so each family reads as a list of rules; nothing here
registers anything.
"""

from __future__ import annotations

from typing import Any

from autopar.ir.graph import TensorMeta
from autopar.ir.placements import Partial, Shard, Spec
from autopar.passes.strategies.localize import LocalContext
from autopar.passes.strategies.registry import OpInfo

P = Partial("sum")


def norm_dim(dim: int, ndim: int) -> int:
    return dim % ndim if ndim else 0


def view_dim_map(src: tuple[int, ...], dst: tuple[int, ...]) -> dict[int, int]:
    """Which input dim's shard is which output dim's shard under a reshape ``src -> dst``.

    Dims are grouped where running products agree (the way ``view`` merges and splits). Inside a
    group only the outermost non-1 dim can carry a shard: a rank's contiguous block of rows of
    that dim is a contiguous block of the flattened group, which is again a block of the outer
    dim on the other side. A shard of an inner dim is strided there: not a ``Shard``. Size-1
    dims take no part (a size-1 dim cannot be split) and zero-size tensors map nothing.
    """
    if 0 in src or 0 in dst:
        return {}
    a = [i for i, s in enumerate(src) if s != 1]
    b = [j for j, s in enumerate(dst) if s != 1]
    out: dict[int, int] = {}
    i = j = 0
    while i < len(a) and j < len(b):
        first_in, first_out = a[i], b[j]
        pa, pb = src[a[i]], dst[b[j]]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                if i >= len(a):
                    return out
                pa *= src[a[i]]
                i += 1
            else:
                if j >= len(b):
                    return out
                pb *= dst[b[j]]
                j += 1
        out[first_in] = first_out
    return out


def shard_factor_of(spec: Spec, dim: int, mesh_shape: tuple[int, ...]) -> int:
    f = 1
    for p, n in zip(spec, mesh_shape):
        if isinstance(p, Shard) and p.dim == dim:
            f *= n
    return f


def local_shape(ctx: LocalContext, shape: tuple[int, ...], spec: Spec) -> list[int]:
    """The local extent of every dim of a tensor of global ``shape`` placed as ``spec``."""
    return [s // shard_factor_of(spec, d, ctx.mesh_shape) for d, s in enumerate(shape)]


def local_out_shape(ctx: LocalContext, out_index: int = 0) -> list[int]:
    meta = ctx.info.outputs[out_index]
    assert meta is not None
    return local_shape(ctx, meta.shape, ctx.strategy.outs[out_index])


def shard_range(ctx: LocalContext, spec: Spec, dim: int, size: int) -> tuple[int, int]:
    """``[start, stop)`` of this rank's piece of a dim of global extent ``size``.

    Nested shards split in mesh-axis order, exactly as ``simulate.shard`` and DTensor do.
    """
    start, length = 0, size
    for axis, (p, n) in enumerate(zip(spec, ctx.mesh_shape)):
        if isinstance(p, Shard) and p.dim == dim and n > 1:
            length //= n
            start += ctx.coord[axis] * length
    return start, start + length


def tensor_arg_names(info: OpInfo) -> list[str]:
    """Schema names of the op's tensor inputs, in the registry's flattened order.

    Lets a rule for a many-argument op (the SDPA family) say "query, key, value: S(1)" by name
    instead of by a position that differs between the forward and backward kernels.
    """
    schema = info.target._schema
    names: list[str] = []

    def visit(name: str, a: Any) -> None:
        if isinstance(a, TensorMeta):
            names.append(name)
        elif isinstance(a, (list, tuple)):
            for x in a:
                visit(name, x)

    for i, a in enumerate(info.args):
        visit(schema.arguments[i].name, a)
    for k, a in info.kwargs.items():
        visit(k, a)
    return names


def return_names(info: OpInfo) -> list[str]:
    names = [r.name or f"out{i}" for i, r in enumerate(info.target._schema.returns)]
    return names[: len(info.outputs)] + [f"out{i}" for i in range(len(names), len(info.outputs))]
