"""Rules for gathers and scatters: index_select, gather, index (advanced indexing), index_put,
scatter, scatter_add, index_add.

A gather moves values without mixing them, so dims it does not index keep their shards (the
index must then be split the same way where it spans the dim) and Partials pass through. The
indexed dim itself can be split two ways: the *index* split (each rank looks up its own ids in a
whole table) or the *table* split, where each rank answers only the ids in its row range and the
results add up (a Partial): the expert-parallel gather of stacked expert weights and its
accumulating scatter run that way, through the masked impls below.
Scatters that accumulate (``scatter_add``, ``index_put(accumulate=True)``, ``index_add``) are
linear in the destination and the source together, so both may be Partial, and a source split
along the scattered dim gives a Partial result.
"""

from __future__ import annotations

import torch

from autopar.ir.graph import TensorMeta
from autopar.ir.placements import R, Shard
from autopar.passes.strategies._layout import P, local_out_shape, norm_dim, shard_range
from autopar.passes.strategies.localize import LocalContext, register_impl, register_localizer
from autopar.passes.strategies.registry import OpInfo, Rule, register

aten = torch.ops.aten


# --- index_select / gather -------------------------------------------------------------------


@register(aten.index_select.default)
def index_select_rules(info: OpInfo) -> list[Rule]:
    ndim = len(info.inputs[0].shape)
    dim = norm_dim(info.arg(1, "dim"), ndim)
    rules = [Rule((Shard(d), R), (Shard(d),)) for d in range(ndim) if d != dim]
    rules.append(Rule((R, Shard(0)), (Shard(dim),)))
    rules.append(Rule((Shard(dim), R), (P,), "masked_index"))
    return rules + [Rule((P, R), (P,))]


@register(aten.gather.default)
def gather_rules(info: OpInfo) -> list[Rule]:
    src, index = info.inputs[0], info.inputs[1]
    ndim = len(src.shape)
    dim = norm_dim(info.arg(1, "dim"), ndim)
    # off the gathered dim, output row i reads source row i: split both alike, sizes permitting
    rules = [Rule((Shard(d), Shard(d)), (Shard(d),)) for d in range(ndim)
             if d != dim and src.shape[d] == index.shape[d]]
    rules.append(Rule((R, Shard(dim)), (Shard(dim),)))
    return rules + [Rule((P, R), (P,))]


# --- advanced indexing: self[i0, i1, ...] ----------------------------------------------------


def _index_layout(self_shape: tuple[int, ...], indices: list) -> tuple[list[int], tuple, int,
                                                                      dict[int, int]]:
    """Indexed dims, broadcast index shape, where its dims start in the output, and the output
    dim of every non-indexed dim of ``self`` (torch puts the index dims in place when the
    indexed dims are adjacent, in front otherwise)."""
    dims = [d for d, t in enumerate(indices) if t is not None]
    bshape = tuple(torch.broadcast_shapes(*[indices[d].shape for d in dims]))
    adjacent = dims == list(range(dims[0], dims[-1] + 1))
    start = dims[0] if adjacent else 0
    kept = [d for d in range(len(self_shape)) if d not in dims]
    out: dict[int, int] = {}
    for pos, d in enumerate(kept):
        out[d] = d if adjacent and d < dims[0] else pos + len(bshape)
    return dims, bshape, start, out


def _result_shape(self_shape: tuple[int, ...], dims: list[int], bshape: tuple, start: int,
                  kept: dict[int, int]) -> list[int]:
    res = [0] * (len(self_shape) - len(dims) + len(bshape))
    res[start : start + len(bshape)] = bshape
    for d, o in kept.items():
        res[o] = self_shape[d]
    return res


def _index_splits(idx: list[TensorMeta], bshape: tuple) -> list[tuple[tuple, int]]:
    """Splits of the index tensors along broadcast dim j: (their placements, j). An index that
    broadcasts along j (size 1 or missing) stays whole."""
    out = []
    for j, size in enumerate(bshape):
        pl = []
        for t in idx:
            k = j - (len(bshape) - len(t.shape))
            pl.append(Shard(k) if k >= 0 and t.shape[k] == size and size > 1 else R)
        if any(isinstance(p, Shard) for p in pl):
            out.append((tuple(pl), j))
    return out


def _index_parts(info: OpInfo) -> tuple[TensorMeta, list, list[TensorMeta]]:
    indices = list(info.arg(1, "indices"))
    return info.inputs[0], indices, [t for t in indices if t is not None]


@register(aten.index.Tensor)
def index_rules(info: OpInfo) -> list[Rule]:
    self_meta, indices, idx = _index_parts(info)
    if any(t.dtype == torch.bool for t in idx):
        return []  # boolean masks: data-dependent shapes, never traced here
    dims, bshape, start, kept = _index_layout(self_meta.shape, indices)
    rest = (R,) * len(idx)
    rules = [Rule((Shard(d),) + rest, (Shard(o),)) for d, o in kept.items()]
    rules += [Rule((R,) + pl, (Shard(start + j),)) for pl, j in _index_splits(idx, bshape)]
    if len(dims) == 1:  # rows of a split table: each rank answers the ids it holds
        rules.append(Rule((Shard(dims[0]),) + rest, (P,), "masked_index"))
    return rules + [Rule((P,) + rest, (P,))]


@register_impl("masked_index")
def _masked_index(ctx: LocalContext, args: tuple, kwargs: dict) -> torch.Tensor:
    """index / index_select on a table split along the indexed dim: out-of-range ids read row 0
    of the local piece and are zeroed, so the ranks' results sum to the full lookup."""
    table = args[0]
    if ctx.info.target is aten.index_select.default:
        dim = norm_dim(args[1], table.dim())
        ids = args[2]
    else:
        indices = list(args[1])
        dim = next(d for d, t in enumerate(indices) if t is not None)
        ids = indices[dim]
    start, stop = shard_range(ctx, ctx.strategy.ins[0], dim, ctx.info.inputs[0].shape[dim])
    inside = (ids >= start) & (ids < stop)
    local = torch.where(inside, ids - start, torch.zeros_like(ids))
    if ctx.info.target is aten.index_select.default:
        out = aten.index_select.default(table, dim, local)
        shape = [1] * out.dim()
        shape[dim] = -1
        return out * inside.view(shape).to(out.dtype)
    out = aten.index.Tensor(table, [None] * dim + [local])
    shape = [1] * dim + list(inside.shape) + [1] * (out.dim() - dim - inside.dim())
    return out * inside.view(shape).to(out.dtype)


# --- index_put: self[i0, ...] = values (or +=) -----------------------------------------------


@register(aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default)
def index_put_rules(info: OpInfo) -> list[Rule]:
    self_meta, indices, idx = _index_parts(info)
    values = info.inputs[-1]
    if any(t.dtype == torch.bool for t in idx):
        return []
    dims, bshape, start, kept = _index_layout(self_meta.shape, indices)
    res = _result_shape(self_meta.shape, dims, bshape, start, kept)
    vo = len(res) - len(values.shape)  # values broadcast from the right onto self[indices]

    def vpl(res_dim: int):
        k = res_dim - vo
        if k < 0 or values.shape[k] == 1:
            return R
        return Shard(k)

    rest = (R,) * len(idx)
    rules = [Rule((Shard(d),) + rest + (vpl(o),), (Shard(d),)) for d, o in kept.items()]
    if bool(info.arg(3, "accumulate", False)):
        rules.append(Rule((P,) + rest + (P,), (P,)))
        # each rank adds its share of (index, value) pairs into a partial destination
        for pl, j in _index_splits(idx, bshape):
            p = vpl(start + j)
            if isinstance(p, Shard):
                rules.append(Rule((P,) + pl + (p,), (P,)))
    if len(dims) == 1:  # destination rows split: each rank writes the ids it holds
        rules.append(Rule((Shard(dims[0]),) + rest + (R,), (Shard(dims[0]),), "masked_index_put"))
    return rules


@register_impl("masked_index_put")
def _masked_index_put(ctx: LocalContext, args: tuple, kwargs: dict) -> torch.Tensor:
    """index_put into a destination split along the indexed dim: ids of other ranks are sent to
    one scratch row appended to the local piece and dropped after, keeping shapes static."""
    dest, indices, values = args[0], list(args[1]), args[2]
    accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
    dim = next(d for d, t in enumerate(indices) if t is not None)
    ids = indices[dim]
    start, stop = shard_range(ctx, ctx.strategy.ins[0], dim, ctx.info.inputs[0].shape[dim])
    n_local = stop - start
    inside = (ids >= start) & (ids < stop)
    local = torch.where(inside, ids - start, torch.full_like(ids, n_local))
    pad_shape = list(dest.shape)
    pad_shape[dim] = 1
    padded = torch.cat([dest, dest.new_zeros(pad_shape)], dim)
    indices[dim] = local
    out = aten.index_put.default(padded, indices, values, accumulate)
    result = out.narrow(dim, 0, n_local)
    if ctx.info.target is not aten.index_put.default:  # the in-place variants write into dest
        dest.copy_(result)
        return dest
    return result


# --- scatter / scatter_add / index_add -------------------------------------------------------


def _same_off_dim(metas: list[TensorMeta], dim: int) -> list[int]:
    ndim = len(metas[0].shape)
    return [d for d in range(ndim)
            if d != dim and len({m.shape[d] for m in metas}) == 1]


@register(aten.scatter.src, aten.scatter.value, aten.scatter_.src, aten.scatter_.value)
def scatter_rules(info: OpInfo) -> list[Rule]:
    ndim = len(info.inputs[0].shape)
    dim = norm_dim(info.arg(1, "dim"), ndim)
    k = len(info.inputs)  # self, index[, src]
    rules = [Rule((Shard(d),) * k, (Shard(d),)) for d in _same_off_dim(list(info.inputs), dim)]
    if k == 3:  # overwrite is linear in (self, src) jointly: partial writes sum to the write
        rules.append(Rule((P, R, P), (P,)))
    elif info.arg(3, "value") == 0:
        rules.append(Rule((P, R), (P,)))
    return rules


@register(aten.scatter_add.default, aten.scatter_add_.default)
def scatter_add_rules(info: OpInfo) -> list[Rule]:
    self_m, index, src = info.inputs
    ndim = len(self_m.shape)
    dim = norm_dim(info.arg(1, "dim"), ndim)
    rules = [Rule((Shard(d),) * 3, (Shard(d),)) for d in _same_off_dim([self_m, index, src], dim)]
    rules.append(Rule((P, R, P), (P,)))
    if index.shape[dim] == src.shape[dim]:  # each rank adds its slice of the contributions
        rules.append(Rule((P, Shard(dim), Shard(dim)), (P,)))
    return rules


@register(aten.index_add.default, aten.index_add_.default)
def index_add_rules(info: OpInfo) -> list[Rule]:
    self_m, index, src = info.inputs
    ndim = len(self_m.shape)
    dim = norm_dim(info.arg(1, "dim"), ndim)
    rules = [Rule((Shard(d), R, Shard(d)), (Shard(d),)) for d in range(ndim)
             if d != dim and src.shape[d] == self_m.shape[d]]
    rules.append(Rule((P, R, P), (P,)))
    rules.append(Rule((P, Shard(0), Shard(dim)), (P,)))
    return rules


@register(aten.index_select_backward.default)
def index_select_backward_rules(info: OpInfo) -> list[Rule]:
    # zeros(self_sizes).index_add(dim, index, grad): a scatter-add of the gathered rows
    grad = info.inputs[0]
    ndim = len(grad.shape)
    dim = norm_dim(info.arg(2, "dim"), ndim)
    rules = [Rule((Shard(d), R), (Shard(d),)) for d in range(ndim) if d != dim]
    rules.append(Rule((Shard(dim), Shard(0)), (P,)))
    return rules + [Rule((P, R), (P,))]


@register_localizer(aten.index_select_backward.default)
def _index_select_backward_local(ctx: LocalContext, args: tuple, kwargs: dict) -> tuple:
    args = list(args)
    args[1] = local_out_shape(ctx)
    return tuple(args), kwargs
