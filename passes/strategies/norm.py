"""Fused normalisations: layer, RMS, batch and group norm, forward and backward.

A norm normalises each row over its trailing ``normalized_shape`` dims, so any *leading* dim
(batch, and sequence: Megatron's sequence parallelism) may be sharded; the saved statistics
(``mean``/``rstd``, shaped ``[*leading, 1, ...]``) follow that shard. The weight and bias are
needed whole.

In the backward, the weight/bias gradients are sums over the leading dims, so under a leading
shard each rank holds a partial sum: ``P``. The backward is linear in ``grad_out`` (input and
statistics fixed), so a ``P`` grad_out gives ``P`` everywhere.
"""

from __future__ import annotations

import torch

from autopar.ir.placements import Placement, R, Shard
from autopar.passes.strategies._common import PSUM, dedupe, ins_for, outs_for, slots
from autopar.passes.strategies.localize import LocalContext, local_size, register_localizer
from autopar.passes.strategies.registry import OpInfo, Rule, register

aten = torch.ops.aten


def _leading(info: OpInfo, x_slot: int, shape_pos: int) -> list[int]:
    x = info.args[x_slot]
    normalized = info.args[shape_pos]
    lead = len(x.shape) - len(normalized)
    return [d for d in range(lead) if x.shape[d] > 1]


def _rule(info: OpInfo, sharded: dict[int, Placement], outs: list[Placement]) -> Rule:
    return Rule(ins_for(info, sharded), outs_for(info, outs))


@register(aten.native_layer_norm.default, aten._fused_rms_norm.default)
def norm_forward_rule(info: OpInfo) -> list[Rule]:
    # (input, normalized_shape, weight?, [bias?,] eps) -> (out, [mean,] rstd)
    rules = []
    for d in _leading(info, 0, 1):
        rules.append(_rule(info, {0: Shard(d)}, [Shard(d)] * len(info.outputs)))
    return dedupe(rules)


@register(aten.native_layer_norm_backward.default)
def layer_norm_backward_rule(info: OpInfo) -> list[Rule]:
    # (grad_out, input, normalized_shape, mean, rstd, weight?, bias?, mask) -> (gi, gw, gb)
    return _backward_rules(info, stats=(3, 4))


@register(aten._fused_rms_norm_backward.default)
def rms_norm_backward_rule(info: OpInfo) -> list[Rule]:
    # (grad_out, input, normalized_shape, rstd, weight?, mask) -> (grad_input, grad_weight)
    return _backward_rules(info, stats=(3,))


def _backward_rules(info: OpInfo, stats: tuple[int, ...]) -> list[Rule]:
    param_grads = [PSUM] * (len(info.outputs) - 1)
    rules = []
    for d in _leading(info, 1, 2):
        sharded: dict[int, Placement] = {0: Shard(d), 1: Shard(d)}
        sharded.update({s: Shard(d) for s in stats})
        rules.append(_rule(info, sharded, [Shard(d), *param_grads]))
    if 0 in slots(info):
        rules.append(_rule(info, {0: PSUM}, [PSUM] * len(info.outputs)))
    return dedupe(rules)


# --- batch norm: statistics over (batch, spatial) per channel ------------------------------------
#
# Training normalises each channel over the batch and spatial dims, so only the channel dim
# (1) may be split: every per-channel tensor (weight, bias, running and saved stats) follows it
# on its dim 0. In eval mode the running stats are used and batch/spatial dims split too. Linear
# in grad_out, as for the other norms.

_BN_TRAINING_POS = {
    aten.native_batch_norm.default: 5, aten._native_batch_norm_legit.default: 5,
    aten._native_batch_norm_legit_functional.default: 5,
    aten._native_batch_norm_legit.no_stats: 3,
}


def _per_channel(info: OpInfo, c: int, placement: Placement) -> dict[int, Placement]:
    """``placement`` for every 1-d per-channel tensor argument of length ``c``."""
    return {s: placement for s in slots(info)
            if isinstance(s, int) and s > 0 and tuple(info.args[s].shape) == (c,)}


def _channel_outs(info: OpInfo, c: int, first: Placement, stat: Placement) -> list[Placement]:
    return [first] + [stat if o is not None and tuple(o.shape) == (c,) else R
                      for o in info.outputs[1:]]


@register(*_BN_TRAINING_POS, aten._native_batch_norm_legit_no_training.default)
def batch_norm_rule(info: OpInfo) -> list[Rule]:
    x = info.args[0]
    if len(x.shape) < 2:
        return []
    c = x.shape[1]
    pos = _BN_TRAINING_POS.get(info.target)
    training = bool(info.arg(pos)) if pos is not None else False
    rules = []
    if c > 1:
        ins = {0: Shard(1), **_per_channel(info, c, Shard(0))}
        rules.append(_rule(info, ins, _channel_outs(info, c, Shard(1), Shard(0))))
    if not training:
        for d in [0, *range(2, len(x.shape))]:
            if x.shape[d] > 1:
                rules.append(_rule(info, {0: Shard(d)}, _channel_outs(info, c, Shard(d), R)))
    return dedupe(rules)


@register(aten.native_batch_norm_backward.default)
def batch_norm_backward_rule(info: OpInfo) -> list[Rule]:
    # (grad_out, input, weight?, running_mean?, running_var?, save_mean?, save_invstd?, train,
    #  eps, output_mask) -> (grad_input, grad_weight, grad_bias)
    x = info.args[1]
    c = x.shape[1]
    rules = []
    if c > 1:
        ins = {0: Shard(1), 1: Shard(1), **_per_channel(info, c, Shard(0))}
        rules.append(_rule(info, ins, [Shard(1), Shard(0), Shard(0)]))
    if not info.arg(7, "train"):
        for d in [0, *range(2, len(x.shape))]:
            if x.shape[d] > 1:
                rules.append(_rule(info, {0: Shard(d), 1: Shard(d)}, [Shard(d), PSUM, PSUM]))
    rules.append(_rule(info, {0: PSUM}, [PSUM] * 3))
    return dedupe(rules)


# --- group norm: statistics per (sample, group); N is an argument ---------------------------------


@register(aten.native_group_norm.default)
def group_norm_rule(info: OpInfo) -> list[Rule]:
    # (input, weight?, bias?, N, C, HxW, group, eps) -> (out, mean [N, G], rstd [N, G])
    x = info.args[0]
    if x.shape[0] <= 1:
        return []
    return [_rule(info, {0: Shard(0)}, [Shard(0)] * 3)]


@register(aten.native_group_norm_backward.default)
def group_norm_backward_rule(info: OpInfo) -> list[Rule]:
    # (grad_out, input, mean, rstd, weight?, N, C, HxW, group, mask) -> (gi, gw, gb)
    rules = [_rule(info, {0: PSUM}, [PSUM] * 3)]
    if info.args[1].shape[0] > 1:
        rules.append(_rule(info, {0: Shard(0), 1: Shard(0), 2: Shard(0), 3: Shard(0)},
                           [Shard(0), PSUM, PSUM]))
    return rules


@register_localizer(aten.native_group_norm.default, aten.native_group_norm_backward.default)
def group_norm_localizer(ctx: LocalContext, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    pos = 3 if ctx.info.target is aten.native_group_norm.default else 5
    n = local_size(ctx, int(args[pos]), 0, 0)
    return (*args[:pos], n, *args[pos + 1 :]), kwargs
