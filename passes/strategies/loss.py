"""Loss ops: nll_loss (1-d and 2-d) and the pointwise losses (mse, l1, huber, BCE), fwd and bwd.

``cross_entropy`` reaches the graph as ``_log_softmax`` (class dim whole: see ``reduction.py``)
followed by ``nll_loss_forward``; its backward is ``nll_loss_backward`` then
``_log_softmax_backward_data``.

Batch sharding (and the spatial dims of ``nll_loss2d`` / every dim of a pointwise loss):

- ``reduction='none'``: the per-element losses keep the shard.
- ``reduction='sum'``: each rank's sum is a ``P(sum)`` of the total.
- ``reduction='mean'``: a local mean divides by the local count, so the rule names an impl that
  runs the local op with ``reduction='sum'`` and divides by the *global* count. For the
  pointwise losses that count is the element count from ``OpInfo``. For nll_loss it is
  ``total_weight``, the number of targets not equal to ``ignore_index`` (a causal LM's shifted
  labels always hold some), known only from the data: the op all-reduces each rank's count
  inside it (priced as an in-op collective, ``Rule.raw_outs``) and then divides, so the loss
  is exact and ``total_weight`` comes out whole (``R``), as the backward reads it. With the
  target whole on every rank instead (a model's input is given whole to every rank, so
  keeping the labels replicated costs nothing), each rank counts the whole target itself,
  cuts it to its rows of ``self`` for the sum, and needs no collective at all. With a
  class ``weight`` neither mean rule is offered.

The backwards read ``total_weight`` (global, ``R``) and are exact. Every loss is linear in its
incoming gradient, and nll_loss is linear in its log-probabilities: those pass ``P`` through.
"""

from __future__ import annotations

import math

import torch

from autopar.ir.placements import Placement, R, Shard
from autopar.passes.strategies._common import (
    PSUM,
    bcast,
    dedupe,
    ins_for,
    meta_at,
    outs_for,
    shard_offset,
    slots,
)
from autopar.passes.strategies.localize import LocalContext, register_finish, register_impl
from autopar.passes.strategies.registry import OpInfo, Rule, register

aten = torch.ops.aten

NONE, MEAN, SUM = 0, 1, 2  # torch's Reduction enum


def _nll_dims(info: OpInfo, self_slot: int) -> list[tuple[int, int]]:
    """(self dim, target dim) pairs that may be sharded: batch, and H/W for the 2-d loss."""
    x = info.args[self_slot]
    if len(x.shape) == 1:
        return []  # a single sample: nothing to split but the class dim
    pairs = [(0, 0)] + [(d, d - 1) for d in range(2, len(x.shape))]
    return [(d, t) for d, t in pairs if x.shape[d] > 1]


@register(aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
def nll_forward_rule(info: OpInfo) -> list[Rule]:
    reduction = info.arg(3, "reduction", MEAN)
    weighted = meta_at(info, 2) is not None
    rules = []
    for d, t in _nll_dims(info, 0):
        ins = ins_for(info, {0: Shard(d), 1: Shard(t)})
        if reduction == NONE:
            rules.append(Rule(ins, outs_for(info, [Shard(t), R])))
        elif reduction == SUM:
            rules.append(Rule(ins, outs_for(info, PSUM)))
        elif not weighted:
            # total_weight all-reduced inside the op, then the exact mean (see the docstring)
            rules.append(Rule(ins, outs_for(info, [PSUM, R]), "nll_loss_mean_global",
                              outs_for(info, PSUM)))
            # the target whole: every rank counts all of it, no collective (the docstring)
            rules.append(Rule(ins_for(info, {0: Shard(d)}), outs_for(info, [PSUM, R]),
                              "nll_loss_mean_whole_target"))
    # linear in the log-probabilities; total_weight depends on target and weight only
    rules.append(Rule(ins_for(info, {0: PSUM}), outs_for(info, [PSUM, R])))
    return dedupe(rules)


@register_impl("nll_loss_mean_global")
def nll_loss_mean_global(ctx: LocalContext, args: tuple, kwargs: dict) -> tuple:
    """The rank's sum over its targets and its count of kept targets (both partial sums);
    :func:`nll_loss_mean_finish` divides once the count is all-reduced."""
    a = list(args) + [None] * (5 - len(args))
    x, target, weight = a[0], a[1], a[2]
    ignore_index = a[4] if a[4] is not None else kwargs.get("ignore_index", -100)
    return ctx.info.target(x, target, weight, SUM, ignore_index)


@register_finish("nll_loss_mean_global")
def nll_loss_mean_finish(ctx: LocalContext, out: tuple) -> tuple:
    """The rank's sum divided by the global count of kept targets: a partial of the mean."""
    total_sum, total_weight = out
    return total_sum / total_weight, total_weight


@register_impl("nll_loss_mean_whole_target")
def nll_loss_mean_whole_target(ctx: LocalContext, args: tuple, kwargs: dict) -> tuple:
    """The rank's sum over its rows of ``self`` (the target cut to the same rows) divided by
    the count of kept targets in the whole target, which every rank holds: a partial of the
    mean, and ``total_weight`` whole, without a collective."""
    a = list(args) + [None] * (5 - len(args))
    x, target = a[0], a[1]
    ignore_index = a[4] if a[4] is not None else kwargs.get("ignore_index", -100)
    rows = target
    for d in sorted({p.dim for p in ctx.strategy.ins[0] if isinstance(p, Shard)}):
        t = d if d == 0 else d - 1  # the target has no class dim (dim 1 of self)
        n = ctx.info.inputs[1].shape[t]
        first = shard_offset(ctx.strategy.ins[0], ctx.mesh_shape, ctx.coord, d, n)
        rows = rows.narrow(t, first, x.shape[d])
    total_sum, _ = ctx.info.target(x, rows, None, SUM, ignore_index)
    total_weight = (target != ignore_index).sum().to(total_sum.dtype)
    return total_sum / total_weight, total_weight


@register(aten.nll_loss_backward.default, aten.nll_loss2d_backward.default)
def nll_backward_rule(info: OpInfo) -> list[Rule]:
    # (grad_output, self, target, weight?, reduction, ignore_index, total_weight)
    reduction = info.arg(4, "reduction", MEAN)
    rules = []
    for d, t in _nll_dims(info, 1):
        grad = Shard(t) if reduction == NONE else R
        rules.append(Rule(ins_for(info, {0: grad, 1: Shard(d), 2: Shard(t)}), (Shard(d),)))
    rules.append(Rule(ins_for(info, {0: PSUM}), (PSUM,)))
    return dedupe(rules)


# --- pointwise losses: mse, l1, smooth_l1, huber, binary cross-entropy ---------------------------

# where ``reduction`` sits among the positional args
_LOSS_REDUCTION = {
    aten.mse_loss.default: 2, aten.l1_loss.default: 2, aten.smooth_l1_loss.default: 2,
    aten.huber_loss.default: 2, aten.binary_cross_entropy.default: 3,
    aten.binary_cross_entropy_with_logits.default: 4,
}
_LOSS_BWD_REDUCTION = {
    aten.mse_loss_backward.default: 3, aten.smooth_l1_loss_backward.default: 3,
    aten.huber_loss_backward.default: 3, aten.binary_cross_entropy_backward.default: 4,
}


def _shard_dims(info: OpInfo, slot: int) -> list[int]:
    # self and target have the same shape (broadcast targets are expanded before the loss)
    x, t = info.args[slot], info.args[slot + 1]
    if tuple(x.shape) != tuple(t.shape):
        return []
    return [d for d, n in enumerate(x.shape) if n > 1]


def _weights(info: OpInfo, first: int, d: int, shape) -> dict[int, Placement]:
    """Class/element weights (broadcast against self) follow the shard by broadcasting."""
    return {s: bcast(Shard(d), info.args[s], shape) for s in slots(info)
            if isinstance(s, int) and s >= first}


@register(*_LOSS_REDUCTION)
def pointwise_loss_rule(info: OpInfo) -> list[Rule]:
    reduction = info.arg(_LOSS_REDUCTION[info.target], "reduction", MEAN)
    shape = info.args[0].shape
    rules = []
    for d in _shard_dims(info, 0):
        ins = ins_for(info, {0: Shard(d), 1: Shard(d), **_weights(info, 2, d, shape)})
        if reduction == NONE:
            rules.append(Rule(ins, (Shard(d),)))
        elif reduction == SUM:
            rules.append(Rule(ins, (PSUM,)))
        else:
            rules.append(Rule(ins, (PSUM,), "pointwise_loss_mean_global"))
    return rules


@register_impl("pointwise_loss_mean_global")
def pointwise_loss_mean_global(ctx: LocalContext, args: tuple, kwargs: dict) -> torch.Tensor:
    """The rank's sum of element losses divided by the global element count."""
    args, kwargs = _with_reduction(ctx, _LOSS_REDUCTION[ctx.info.target], args, kwargs)
    return ctx.info.target(*args, **kwargs) / math.prod(ctx.info.args[0].shape)


def _with_reduction(ctx: LocalContext, pos: int, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    kwargs = {k: v for k, v in kwargs.items() if k != "reduction"}
    args = list(args)
    while len(args) < pos:  # fill optional args (weights) left out before reduction
        args.append(None)
    args = args[:pos] + [SUM] + args[pos + 1 :]
    return tuple(args), kwargs


@register(*_LOSS_BWD_REDUCTION)
def pointwise_loss_backward_rule(info: OpInfo) -> list[Rule]:
    # (grad_output, self, target, [weight,] reduction, [beta|delta]) -> grad_self
    reduction = info.arg(_LOSS_BWD_REDUCTION[info.target], "reduction", MEAN)
    shape = info.args[1].shape
    rules = []
    for d in _shard_dims(info, 1):
        grad: Placement = Shard(d) if reduction == NONE else R
        impl = "pointwise_loss_backward_mean_global" if reduction == MEAN else None
        ins = ins_for(info, {0: grad, 1: Shard(d), 2: Shard(d), **_weights(info, 3, d, shape)})
        rules.append(Rule(ins, (Shard(d),), impl))
    rules.append(Rule(ins_for(info, {0: PSUM}), (PSUM,)))
    if info.target is aten.mse_loss_backward.default:
        rules.append(Rule((R, PSUM, PSUM), (PSUM,)))  # 2 * (self - target) * grad: linear
    return dedupe(rules)


@register_impl("pointwise_loss_backward_mean_global")
def pointwise_loss_backward_mean_global(
    ctx: LocalContext, args: tuple, kwargs: dict
) -> torch.Tensor:
    args, kwargs = _with_reduction(ctx, _LOSS_BWD_REDUCTION[ctx.info.target], args, kwargs)
    return ctx.info.target(*args, **kwargs) / math.prod(ctx.info.args[1].shape)
