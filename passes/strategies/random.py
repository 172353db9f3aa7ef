"""Factories and random ops: tensors made from a size, from another tensor's shape, or from RNG.

Factories (``ones``, ``zeros``, ``full``, ``empty``, ``new_*``, ``rand``, ``randn``...) can be
built directly in any shard: a localizer rewrites the size argument to the rank's piece
(:func:`localize.local_size`). ``arange`` is shardable too, through an impl that starts each
rank's range at its offset. ``*_like`` ops follow their input's shard and, since they read only
its shape, turn a ``P`` input into an ``R`` output without reducing it.

Random ops (dropout, bernoulli, rand...) may be sharded on any dim, and then draw *the whole
tensor* on every rank and keep their piece (impl ``random_whole_draw``): every rank consumes its
generator exactly as the single-device run does, so with the same seed each rank's values are
the single device's at its positions, replicas agree, and shards are independent of one another
(a local draw would give every shard the same values: a dropout mask repeated across the
ranks). The price is the whole draw on every rank, work and a transient buffer the size of the
whole tensor: the cost model charges the work (``sharding_problem._node_costs`` prices such a
strategy's compute as the replicated op's), not yet the buffer. DTensor gets the same values on CUDA by
moving the Philox offset instead; the CPU generator cannot skip ahead. ``multinomial`` stays a
local draw (rows of zeros would be invalid distributions), and so do the fused attention
kernels' own dropout, where they take one (on CPU a dropout > 0 traces as explicit ops, which
this covers). The validator checks shapes and dtypes for every strategy, and values where they
are deterministic (``p=0`` dropout is the identity, ``bernoulli(p=1)`` is all ones); the
runtime tests check dropout against one device. No Partial passes through a random op: each
rank would draw its own mask for its addend.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from autopar.ir.placements import Placement, R, Shard, Spec
from autopar.passes.strategies._common import (
    PSUM,
    bcast,
    dedupe,
    outs_for,
    shard_offset,
    shardable_dims,
)
from autopar.passes.strategies.localize import (
    LocalContext,
    local_size,
    register_impl,
    register_localizer,
)
from autopar.passes.strategies.pointwise import shard_rules
from autopar.passes.strategies.registry import OpInfo, Rule, register

aten = torch.ops.aten

# where the size list sits among the positional args
_SIZE_POS = {
    aten.ones.default: 0, aten.zeros.default: 0, aten.full.default: 0,
    aten.empty.memory_format: 0, aten.empty_strided.default: 0,
    aten.rand.default: 0, aten.rand.generator: 0, aten.randn.default: 0,
    aten.randn.generator: 0, aten.randint.default: 1, aten.randint.generator: 1,
    aten.randint.low: 2, aten.randint.low_generator: 2, aten.normal.float_float: 2,
    aten.new_zeros.default: 1, aten.new_ones.default: 1, aten.new_empty.default: 1,
    aten.new_full.default: 1, aten.new_empty_strided.default: 1,
}
_NEW = (aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default,
        aten.new_full.default, aten.new_empty_strided.default)


_RANDOM_FACTORIES = {op for op in _SIZE_POS
                     if op.overloadpacket in (aten.rand, aten.randn, aten.randint, aten.normal)}


@register(*_SIZE_POS)
def size_factory_rule(info: OpInfo) -> list[Rule]:
    rules = [Rule((R,) * len(info.inputs), (Shard(d),)) for d in shardable_dims(info.out.shape)]
    if info.target in _RANDOM_FACTORIES:
        return whole_draw(rules)
    if info.target in _NEW:
        # new_*(self, size) reads only self's dtype and device, so self need not be gathered
        # or reduced; a few layouts suffice (each extra one is an ILP variable)
        rules += [Rule((PSUM,), (R,))]
        self_meta = info.inputs[0]
        for d in shardable_dims(info.out.shape):
            if len(self_meta.shape) == len(info.out.shape) and self_meta.shape[d] > 1:
                rules.append(Rule((Shard(d),), (Shard(d),)))
    return dedupe(rules)


@register_localizer(*_SIZE_POS)
def size_factory_localizer(ctx: LocalContext, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    pos = _SIZE_POS[ctx.info.target]
    if len(args) <= pos:  # size given by keyword: make it positional
        kwargs = dict(kwargs)
        args = (*args, kwargs.pop("size"))
    size = [local_size(ctx, int(s), 0, d) for d, s in enumerate(args[pos])]
    args = args[:pos] + (size,) + args[pos + 1 :]
    if ctx.info.target in (aten.empty_strided.default, aten.new_empty_strided.default):
        stride = args[pos + 1] if len(args) > pos + 1 else kwargs.pop("stride")
        args = args[: pos + 1] + (_dense_strides(size, stride),) + args[pos + 2 :]
    return args, kwargs


def _dense_strides(size: list[int], global_stride: list[int]) -> list[int]:
    """Dense strides for the local size, keeping the global layout's dim order."""
    order = sorted(range(len(size)), key=lambda d: global_stride[d])
    strides, step = [0] * len(size), 1
    for d in order:
        strides[d] = step
        step *= max(size[d], 1)
    return strides


@register(aten.scalar_tensor.default)
def scalar_tensor_rule(info: OpInfo) -> list[Rule]:
    return []  # a 0-d tensor: replicated only (expand adds it)


# --- arange ----------------------------------------------------------------------------------


@register(aten.arange.default, aten.arange.start, aten.arange.start_step)
def arange_rule(info: OpInfo) -> list[Rule]:
    if info.out.shape[0] <= 1:
        return []
    return [Rule((), (Shard(0),), "arange_shard")]


@register_impl("arange_shard")
def arange_shard(ctx: LocalContext, args: tuple, kwargs: dict) -> torch.Tensor:
    """This rank's slice of ``arange``: same step, started at its offset."""
    if ctx.info.target is aten.arange.default:
        start, step = 0, 1
    else:
        start = args[0]
        step = args[2] if len(args) > 2 else kwargs.pop("step", 1)
    n = ctx.info.out.shape[0]
    first = shard_offset(ctx.strategy.outs[0], ctx.mesh_shape, ctx.coord, 0, n)
    count = local_size(ctx, n, 0, 0)
    lo = start + step * first
    kwargs = {k: v for k, v in kwargs.items() if k != "step"}
    kwargs.setdefault("dtype", ctx.info.out.dtype)
    if kwargs["dtype"].is_floating_point:
        # end half a step past the last element: the count is exact despite rounding
        return aten.arange.start_step(lo, lo + step * (count - 0.5), step, **kwargs)
    return aten.arange.start_step(lo, lo + step * count, step, **kwargs)  # ints: end truncates


# --- *_like and random ops -------------------------------------------------------------------

_LIKE_RANDOM = [
    aten.empty_like.default, aten.rand_like.default, aten.rand_like.generator,
    aten.randn_like.default, aten.randn_like.generator, aten.randint_like.default,
    aten.randint_like.low_dtype, aten.randint_like.generator,
    aten.randint_like.low_generator_dtype,
]


@register(*_LIKE_RANDOM)
def like_random_rule(info: OpInfo) -> list[Rule]:
    # only the input's shape matters
    rules = dedupe(shard_rules(info) + [Rule((PSUM,) + (R,) * (len(info.inputs) - 1), (R,))])
    return rules if info.target is aten.empty_like.default else whole_draw(rules)


_OVERWRITE = [aten.bernoulli_.float, aten.uniform_.default, aten.normal_.default,
              aten.exponential_.default]


@register(*_OVERWRITE)
def overwrite_random_rule(info: OpInfo) -> list[Rule]:
    # the input's values are overwritten, so a partial input needs no reduction
    return whole_draw(dedupe(shard_rules(info) + [Rule((PSUM,), (R,))]))


@register(aten.bernoulli.default, aten.bernoulli.p, aten.bernoulli.Tensor,
          aten.bernoulli_.Tensor, aten.uniform.default, aten.normal.Tensor_float,
          aten.normal.float_Tensor, aten.normal.Tensor_Tensor, aten.multinomial.default)
def random_pointwise_rule(info: OpInfo) -> list[Rule]:
    if info.target is aten.multinomial.default:  # rows are independent, samples are not
        x = info.inputs[0]
        return [Rule((Shard(0),), (Shard(0),))] if len(x.shape) == 2 and x.shape[0] > 1 else []
    return whole_draw(shard_rules(info))


@register(aten.native_dropout.default)
def dropout_rule(info: OpInfo) -> list[Rule]:
    x = info.inputs[0]
    return whole_draw([Rule((bcast(Shard(d), x, x.shape),), outs_for(info, Shard(d)))
                       for d in shardable_dims(x.shape)])


# --- the whole draw ----------------------------------------------------------------------------

WHOLE_DRAW = "random_whole_draw"


def whole_draw(rules: list[Rule]) -> list[Rule]:
    """``rules`` with every one that shards an output drawing the whole tensor (see the module
    docstring); replicated outputs are whole already."""
    return [replace(r, impl=WHOLE_DRAW) if any(isinstance(p, Shard) for p in r.outs) else r
            for r in rules]


@register_impl(WHOLE_DRAW)
def random_whole_draw(ctx: LocalContext, args: tuple, kwargs: dict) -> Any:
    """The op on whole tensors (each sharded input's piece set in zeros: the random ops read
    their inputs elementwise, or only their shape), then this rank's piece of its outputs. An
    in-place op writes its piece back into its local input."""
    leaves, tree = tree_flatten((args, kwargs))
    places = iter(zip(ctx.info.inputs, ctx.strategy.ins))
    whole = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            meta, spec = next(places)
            leaf = _whole(leaf, spec, tuple(meta.shape), ctx)
        whole.append(leaf)
    wargs, wkwargs = tree_unflatten(whole, tree)
    out = ctx.info.target(*wargs, **wkwargs)
    if ctx.info.target._schema.is_mutable:  # bernoulli_, uniform_, ...: self is the output
        return args[0].copy_(_piece(out, ctx.strategy.outs[0], ctx))
    if isinstance(out, torch.Tensor):
        return _piece(out, ctx.strategy.outs[0], ctx)
    return type(out)(_piece(o, spec, ctx) for o, spec in zip(out, ctx.strategy.outs))


def _extent(spec: Spec, mesh_shape: tuple[int, ...], dim: int, size: int) -> int:
    return size // math.prod(n for p, n in zip(spec, mesh_shape) if p == Shard(dim))


def _sharded_dims(spec: Spec) -> list[int]:
    return sorted({p.dim for p in spec if isinstance(p, Shard)})


def _piece(full: torch.Tensor, spec: Spec, ctx: LocalContext) -> torch.Tensor:
    """This rank's piece of ``full`` placed as ``spec`` (nested shards in mesh-axis order)."""
    for d in _sharded_dims(spec):
        n = full.shape[d]
        first = shard_offset(spec, ctx.mesh_shape, ctx.coord, d, n)
        full = full.narrow(d, first, _extent(spec, ctx.mesh_shape, d, n))
    return full


def _whole(local: torch.Tensor, spec: tuple[Placement, ...], shape: tuple[int, ...],
           ctx: LocalContext) -> torch.Tensor:
    """A tensor of the whole ``shape`` holding ``local`` at this rank's place, zeros elsewhere
    (``local`` itself where nothing is sharded)."""
    if not _sharded_dims(spec):
        return local
    full = local.new_zeros(shape)
    _piece(full, spec, ctx).copy_(local)
    return full
