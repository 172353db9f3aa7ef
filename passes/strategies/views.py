"""Rules for data-movement ops: views, reshapes, transposes, splits, concatenation, slicing.

None of these ops mixes values, so a shard of an input dim survives as a shard of the output dim
it becomes, and a Partial passes through unchanged (they are all linear). What breaks is
arithmetic on sizes: ``view(x, [B, S, H])`` must become ``view(x, [B/2, S, H])`` on a rank that
holds half the batch; those ops get localizers that rewrite their size arguments to the local
output shape. Gathers and scatters are in ``indexing.py``, lookups in ``embedding.py``.
"""

from __future__ import annotations

import torch

from autopar.ir.placements import R, Shard
from autopar.passes.strategies._layout import (
    P,
    local_out_shape,
    norm_dim,
    view_dim_map,
)
from autopar.passes.strategies.localize import LocalContext, register_impl, register_localizer
from autopar.passes.strategies.registry import OpInfo, Rule, register

aten = torch.ops.aten


def _shard_map_rules(pairs: dict[int, int] | list[tuple[int, int]]) -> list[Rule]:
    """Input dim i's shard becomes output dim o's, for each (i, o); Partial passes through."""
    items = pairs.items() if isinstance(pairs, dict) else pairs
    return [Rule((Shard(i),), (Shard(o),)) for i, o in items] + [Rule((P,), (P,))]


# --- reshapes: shards follow the outermost dim of each merged/split group -----------------------


@register(
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.unsqueeze.default,
    aten.flatten.using_ints, aten.unflatten.int, aten._reshape_alias.default,
)
def view_rules(info: OpInfo) -> list[Rule]:
    return _shard_map_rules(view_dim_map(info.inputs[0].shape, info.out.shape))


def _sizes_to_local(index: int):
    """A localizer that replaces positional arg ``index`` (a global size list) by the local
    output shape; the output meta already resolved any ``-1``."""

    def localize(ctx: LocalContext, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        args = list(args)
        args[index] = local_out_shape(ctx)
        return tuple(args), kwargs

    return localize


register_localizer(aten.view.default, aten._unsafe_view.default, aten.reshape.default,
                   aten.expand.default, static=True)(_sizes_to_local(1))


@register_localizer(aten.unflatten.int, static=True)
def _unflatten_local(ctx: LocalContext, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    dim = norm_dim(args[1], len(ctx.info.inputs[0].shape))
    n = len(args[2])
    args = list(args)
    args[2] = local_out_shape(ctx)[dim : dim + n]
    return tuple(args), kwargs


@register_localizer(aten._reshape_alias.default, static=True)
def _reshape_alias_local(ctx: LocalContext, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    # strides are the contiguous ones of the local shape (the op is only emitted for those)
    shape = local_out_shape(ctx)
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return (args[0], shape, list(reversed(strides))), kwargs


@register(aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims)
def squeeze_rules(info: OpInfo) -> list[Rule]:
    shape = info.inputs[0].shape
    rules = _shard_map_rules(view_dim_map(shape, info.out.shape))
    # A dim of global size > 1 named in squeeze is kept globally, but a rank whose shard of it is
    # 1 long would drop it locally: then sharded strategies run through an impl that squeezes
    # only the dims that are 1 globally.
    dims = info.arg(1, "dim")
    asked = range(len(shape)) if dims is None else dims if isinstance(dims, (list, tuple)) else [dims]
    if all(shape[d] == 1 for d in asked):
        return rules
    return [Rule(r.ins, r.outs, "squeeze_global") if isinstance(r.ins[0], Shard) else r
            for r in rules]


@register_impl("squeeze_global")
def _squeeze_global(ctx: LocalContext, args: tuple, kwargs: dict) -> torch.Tensor:
    shape = ctx.info.inputs[0].shape
    ndim = len(shape)
    if len(args) == 1:
        asked = list(range(ndim))
    elif isinstance(args[1], (list, tuple)):
        asked = [norm_dim(d, ndim) for d in args[1]]
    else:
        asked = [norm_dim(args[1], ndim)]
    dims = [d for d in asked if shape[d] == 1]
    return aten.squeeze.dims(args[0], dims) if dims else aten.alias.default(args[0])


@register(aten.expand.default)
def expand_rules(info: OpInfo) -> list[Rule]:
    src, dst = info.inputs[0].shape, info.out.shape
    off = len(dst) - len(src)
    rules = [Rule((P,), (P,))]
    for j in range(len(dst)):
        i = j - off
        if i >= 0 and src[i] == dst[j]:
            rules.append(Rule((Shard(i),), (Shard(j),)))
        else:
            # a broadcast dim: every rank materialises only its slice of the copies
            rules.append(Rule((R,), (Shard(j),)))
    return rules


# --- pure dim permutations and identities ----------------------------------------------------


def _perm(info: OpInfo) -> list[int]:
    ndim = len(info.inputs[0].shape)
    t = info.target
    if t in (aten.t.default, aten.numpy_T.default) or ndim < 2 and t is aten.transpose.int:
        return list(reversed(range(ndim)))
    if t is aten.transpose.int:
        d0, d1 = norm_dim(info.args[1], ndim), norm_dim(info.args[2], ndim)
        perm = list(range(ndim))
        perm[d0], perm[d1] = perm[d1], perm[d0]
        return perm
    return [norm_dim(d, ndim) for d in info.arg(1, "dims")]


@register(aten.t.default, aten.transpose.int, aten.permute.default, aten.numpy_T.default)
def permute_rules(info: OpInfo) -> list[Rule]:
    # output dim j is input dim perm[j]
    return _shard_map_rules([(p, j) for j, p in enumerate(_perm(info))])


# --- splitting and joining -------------------------------------------------------------------


@register(aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default,
          aten.unsafe_split.Tensor, aten.unsafe_split_with_sizes.default)
def split_rules(info: OpInfo) -> list[Rule]:
    ndim = len(info.inputs[0].shape)
    dim = norm_dim(info.arg(2, "dim", 0), ndim)
    k = len(info.outputs)
    rules = [Rule((Shard(d),), (Shard(d),) * k) for d in range(ndim) if d != dim]
    return rules + [Rule((P,), (P,) * k)]


@register(aten.unbind.int)
def unbind_rules(info: OpInfo) -> list[Rule]:
    ndim = len(info.inputs[0].shape)
    dim = norm_dim(info.arg(1, "dim", 0), ndim)
    k = len(info.outputs)
    rules = [Rule((Shard(d),), (Shard(d if d < dim else d - 1),) * k)
             for d in range(ndim) if d != dim]
    return rules + [Rule((P,), (P,) * k)]


@register(aten.cat.default)
def cat_rules(info: OpInfo) -> list[Rule]:
    ndim = len(info.out.shape)
    dim = norm_dim(info.arg(1, "dim", 0), ndim)
    k = len(info.inputs)
    rules = [Rule((P,) * k, (P,))]  # cat of partial sums is the partial sum of the cats
    if all(len(m.shape) == ndim for m in info.inputs):  # legacy empty 1-D inputs: no shards
        rules += [Rule((Shard(d),) * k, (Shard(d),)) for d in range(ndim) if d != dim]
    return rules


@register(aten.stack.default)
def stack_rules(info: OpInfo) -> list[Rule]:
    ndim = len(info.out.shape)
    dim = norm_dim(info.arg(1, "dim", 0), ndim)
    k = len(info.inputs)
    rules = [Rule((P,) * k, (P,))]
    rules += [Rule((Shard(d),) * k, (Shard(d if d < dim else d + 1),)) for d in range(ndim - 1)]
    return rules


# --- slicing ---------------------------------------------------------------------------------


def _is_noop_slice(size: int, start, end, step) -> bool:
    start = 0 if start is None else (start + size if start < 0 else start)
    end = size if end is None else (end + size if end < 0 else end)
    return step in (None, 1) and start <= 0 and end >= size


@register(aten.slice.Tensor, aten.narrow.default)
def slice_rules(info: OpInfo) -> list[Rule]:
    shape = info.inputs[0].shape
    ndim = len(shape)
    dim = norm_dim(info.arg(1, "dim", 0), ndim)
    if info.target is aten.narrow.default:
        start, end, step = info.arg(2), info.arg(2) + info.arg(3), 1
    else:
        start, end, step = info.arg(2, "start"), info.arg(3, "end"), info.arg(4, "step", 1)
    noop = _is_noop_slice(shape[dim], start, end, step)
    rules = [Rule((Shard(d),), (Shard(d),)) for d in range(ndim) if d != dim or noop]
    return rules + [Rule((P,), (P,))]


@register(aten.slice_backward.default)
def slice_backward_rules(info: OpInfo) -> list[Rule]:
    shape = tuple(info.out.shape)
    ndim = len(shape)
    dim = norm_dim(info.arg(2), ndim)
    noop = _is_noop_slice(shape[dim], info.arg(3), info.arg(4), info.arg(5))
    rules = [Rule((Shard(d),), (Shard(d),)) for d in range(ndim) if d != dim or noop]
    return rules + [Rule((P,), (P,))]  # zero padding is linear


register_localizer(aten.slice_backward.default, aten.select_backward.default,
                   static=True)(_sizes_to_local(1))


@register(aten.select.int)
def select_rules(info: OpInfo) -> list[Rule]:
    ndim = len(info.inputs[0].shape)
    dim = norm_dim(info.arg(1, "dim"), ndim)
    return _shard_map_rules([(d, d if d < dim else d - 1) for d in range(ndim) if d != dim])


@register(aten.select_backward.default)
def select_backward_rules(info: OpInfo) -> list[Rule]:
    ndim = len(info.out.shape)
    dim = norm_dim(info.arg(2), ndim)
    return _shard_map_rules([(d if d < dim else d - 1, d) for d in range(ndim) if d != dim])


@register(aten.constant_pad_nd.default)
def pad_rules(info: OpInfo) -> list[Rule]:
    ndim = len(info.inputs[0].shape)
    pad = list(info.arg(1, "pad"))
    padded = {ndim - 1 - k // 2 for k in range(len(pad)) if pad[k] != 0}
    rules = [Rule((Shard(d),), (Shard(d),)) for d in range(ndim) if d not in padded]
    if info.arg(2, "value", 0) == 0:  # padding with zeros is linear
        rules.append(Rule((P,), (P,)))
    return rules


@register(aten.repeat.default)
def repeat_rules(info: OpInfo) -> list[Rule]:
    src, reps = info.inputs[0].shape, list(info.arg(1, "repeats"))
    off = len(reps) - len(src)
    pairs = [(i, i + off) for i in range(len(src)) if reps[i + off] == 1]
    return _shard_map_rules(pairs)


@register(aten.tril.default, aten.triu.default)
def triangle_rules(info: OpInfo) -> list[Rule]:
    # the mask depends on (row, col) of the last two dims: only leading (batch) dims may split
    ndim = len(info.inputs[0].shape)
    rules = [Rule((Shard(d),), (Shard(d),)) for d in range(ndim - 2)]
    return rules + [Rule((P,), (P,))]



@register(aten.flip.default, aten.roll.default)
def flip_roll_rules(info: OpInfo) -> list[Rule]:
    # reversing or rotating a dim moves rows across ranks; the other dims keep their shards
    ndim = len(info.inputs[0].shape)
    if info.target is aten.flip.default:
        moved = {norm_dim(d, ndim) for d in info.arg(1, "dims")}
    else:
        dims = list(info.arg(2, "dims", []) or [])
        moved = {norm_dim(d, ndim) for d in dims} if dims else set(range(ndim))  # flat roll
    rules = [Rule((Shard(d),), (Shard(d),)) for d in range(ndim) if d not in moved]
    return rules + [Rule((P,), (P,))]


# --- functional writes into a view (functionalised in-place ops) -----------------------------


@register(aten.slice_scatter.default)
def slice_scatter_rules(info: OpInfo) -> list[Rule]:
    shape = info.inputs[0].shape
    ndim = len(shape)
    dim = norm_dim(info.arg(2, "dim", 0), ndim)
    noop = _is_noop_slice(shape[dim], info.arg(3, "start"), info.arg(4, "end"),
                          info.arg(5, "step", 1))
    rules = [Rule((Shard(d), Shard(d)), (Shard(d),)) for d in range(ndim) if d != dim or noop]
    return rules + [Rule((P, P), (P,))]  # overwrite is linear in (self, src) jointly


@register(aten.select_scatter.default)
def select_scatter_rules(info: OpInfo) -> list[Rule]:
    ndim = len(info.inputs[0].shape)
    dim = norm_dim(info.arg(2, "dim"), ndim)
    rules = [Rule((Shard(d), Shard(d if d < dim else d - 1)), (Shard(d),))
             for d in range(ndim) if d != dim]
    return rules + [Rule((P, P), (P,))]
