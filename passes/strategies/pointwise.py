"""Elementwise ops: shard any output dim (operands follow by broadcasting), plus Partial where linear.

Sharding: every output dim of size > 1 may be split; each operand takes the matching dim
(trailing alignment), or ``R`` where it broadcasts (dim missing or of size 1).

Partial: the full value is the sum of the ranks' local values, so a ``P`` input may only flow
through an op that is linear in it, with every other operand whole:

- addends (add/sub/rsub): *all* tensor operands P, and no nonzero scalar addend (a constant
  added on every rank would be counted n times);
- factors (mul): exactly one tensor operand P, the others R; scalars are fine;
- numerators (div, the ``grad_output`` of activation backwards, masked_fill with 0):
  only that operand P;
- identity-like ops (clone, detach, float casts): P in, P out. (``P(max)`` would pass too, but
  nothing downstream consumes it and every extra layout is an ILP variable, so it is left out);
- ``*_like`` factories ignore their input's values: a P input may give an R output.
Nonlinear ops (exp, pow, comparisons, activations...) get no Partial rule.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from autopar.ir.placements import Partial, R, Shard
from autopar.passes.strategies._common import (
    PSUM,
    Slot,
    bcast,
    dedupe,
    ins_for,
    is_float,
    meta_at,
    outs_for,
    shardable_dims,
    slots,
)
from autopar.passes.strategies.registry import OpInfo, Rule, register

aten = torch.ops.aten


def shard_rules(info: OpInfo, out_shape: Sequence[int] | None = None) -> list[Rule]:
    """One rule per shardable output dim, operands following by broadcasting."""
    shape = tuple(out_shape if out_shape is not None else info.out.shape)
    rules = []
    for d in shardable_dims(shape):
        ins = tuple(bcast(Shard(d), m, shape) for m in info.inputs)
        # a side output of another shape (log_sigmoid's buffer is empty on CUDA) stays whole
        outs = [Shard(d) if o is not None and tuple(o.shape) == shape else R
                for o in info.outputs]
        rules.append(Rule(ins, outs_for(info, outs)))
    return rules


def partial_rule(info: OpInfo, group: Sequence[Slot], p: Partial = PSUM) -> Rule | None:
    """The operands at ``group`` are ``p``, the others ``R``, the output ``p``."""
    if not group or any(meta_at(info, s) is None for s in group):
        return None
    return Rule(ins_for(info, {s: p for s in group}), outs_for(info, p))


def pointwise(info: OpInfo, groups: Sequence[Sequence[Slot]] = ()) -> list[Rule]:
    """Shard rules, plus one Partial rule per group of operands the op is jointly linear in."""
    rules = shard_rules(info)
    for g in groups:
        rules.append(partial_rule(info, g))
    return dedupe(r for r in rules if r is not None)


def _nonzero(v: object) -> bool:
    return isinstance(v, (int, float, bool)) and v != 0


# --- nonlinear: shard only -------------------------------------------------------------------

_NONLINEAR = [
    "exp", "exp2", "expm1", "log", "log1p", "log2", "log10", "rsqrt", "sqrt", "reciprocal",
    "pow", "square", "tanh", "sigmoid", "silu", "gelu", "relu", "relu6", "mish", "hardswish",
    "hardsigmoid", "hardtanh", "leaky_relu", "elu", "softplus", "threshold", "clamp",
    "clamp_min", "clamp_max", "abs", "sign", "sgn", "sin", "cos", "tan", "asin", "acos", "atan",
    "atan2", "sinh", "cosh", "erf", "erfc", "erfinv", "floor", "ceil", "round", "trunc", "frac",
    "eq", "ne", "lt", "gt", "ge", "le", "logical_and", "logical_or", "logical_not",
    "logical_xor", "bitwise_not", "bitwise_and", "bitwise_or", "bitwise_xor", "isnan", "isinf",
    "isfinite", "maximum", "minimum", "fmod", "remainder", "lerp", "addcmul", "addcdiv",
    "nan_to_num", "logit", "xlogy", "heaviside", "floor_divide", "log_sigmoid_forward",
]
# their in-place forms (relu_, logical_and_...) shard the same way
_NONLINEAR_OPS = [getattr(aten, m) for n in _NONLINEAR for m in (n, n + "_") if hasattr(aten, m)]


@register(*_NONLINEAR_OPS, aten.max.other, aten.min.other)
def nonlinear_rule(info: OpInfo) -> list[Rule]:
    return pointwise(info)


# --- linear ops --------------------------------------------------------------------------------


@register(aten.add, aten.sub, aten.add_, aten.sub_, aten.rsub)
def add_rule(info: OpInfo) -> list[Rule]:
    # alpha only scales an operand, so it keeps linearity; a nonzero scalar addend does not
    other = info.arg(1, "other")
    constant = meta_at(info, 1) is None and _nonzero(other)
    return pointwise(info, [] if constant else [slots(info)])


@register(aten.mul, aten.mul_)
def mul_rule(info: OpInfo) -> list[Rule]:
    return pointwise(info, [[s] for s in slots(info)])


@register(aten.div, aten.div_, aten.true_divide)
def div_rule(info: OpInfo) -> list[Rule]:
    if info.kwargs.get("rounding_mode") is not None:
        return pointwise(info)  # floor/trunc division is not linear
    return pointwise(info, [[0]])


_GRAD_LINEAR = [
    "gelu_backward", "silu_backward", "threshold_backward", "sigmoid_backward", "tanh_backward",
    "hardtanh_backward", "leaky_relu_backward", "elu_backward", "softplus_backward",
    "mish_backward", "hardswish_backward", "hardsigmoid_backward", "native_dropout_backward",
    "log_sigmoid_backward", "logit_backward",
]


@register(*[getattr(aten, n) for n in _GRAD_LINEAR if hasattr(aten, n)])
def grad_linear_rule(info: OpInfo) -> list[Rule]:
    # an activation's backward multiplies grad_output by a function of the forward values
    return pointwise(info, [[0]])


@register(aten.neg, aten.neg_, aten.positive, aten.conj_physical)
def neg_rule(info: OpInfo) -> list[Rule]:
    return pointwise(info, [[0]])


@register(aten.clone, aten.detach, aten.alias, aten.lift_fresh_copy, aten.contiguous)
def identity_rule(info: OpInfo) -> list[Rule]:
    return pointwise(info, [[0]])


@register(aten._to_copy, aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.to.other)
def cast_rule(info: OpInfo) -> list[Rule]:
    # a cast to an integer type rounds, which does not commute with the sum of partials
    linear = is_float(info.inputs[0]) and is_float(info.out)
    return pointwise(info, [[0]] if linear else [])


@register(aten.masked_fill, aten.masked_fill_)
def masked_fill_rule(info: OpInfo) -> list[Rule]:
    value = info.arg(2, "value")
    linear = not hasattr(value, "shape") and not _nonzero(value)
    return pointwise(info, [[0]] if linear else [])


@register(aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf)
def where_rule(info: OpInfo) -> list[Rule]:
    # where(c, a, b) = c*a + (1-c)*b: linear in (a, b) together; a scalar branch must be 0
    branch = [s for s in (1, 2) if meta_at(info, s) is not None]
    scalars = [info.args[s] for s in (1, 2) if meta_at(info, s) is None]
    return pointwise(info, [] if any(_nonzero(v) for v in scalars) else [branch])


@register(aten.copy, aten.copy_)
def copy_rule(info: OpInfo) -> list[Rule]:
    # the result is src broadcast to self's shape; self's values are overwritten
    return pointwise(info, [[1]] if meta_at(info, 1) is not None else [])


@register(aten.fill, aten.fill_, aten.zero, aten.zero_)
def fill_rule(info: OpInfo) -> list[Rule]:
    rules = shard_rules(info)
    value = info.arg(1, "value", 0)
    rules.append(Rule(ins_for(info, {0: PSUM}), outs_for(info, R)))  # values are overwritten
    if not _nonzero(value) and not hasattr(value, "shape"):
        rules.append(Rule(ins_for(info, {0: PSUM}), outs_for(info, PSUM)))
    return dedupe(rules)


@register(aten.zeros_like, aten.ones_like, aten.full_like)
def like_rule(info: OpInfo) -> list[Rule]:
    rules = shard_rules(info)
    # only the input's shape is read, so a partial input needs no reduction
    rules.append(Rule((PSUM,), (R,)))
    if info.target.overloadpacket is aten.zeros_like:
        rules.append(Rule((PSUM,), (PSUM,)))
    return rules
