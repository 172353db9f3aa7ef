"""Convolutions and pools, forward and backward.

A convolution is a matrix product over (input channels x kernel window), so it shards like one:

- batch: input ``S(0)``, weight and bias whole, output ``S(0)`` (the backward's weight/bias
  grads are then partial sums over the batch: ``P``);
- output channels (``groups == 1``): weight split on its out-channel dim, bias with it,
  output ``S(1)``; the backward's grad_input sums over out-channels: ``P``;
- input channels (``groups == 1``): input ``S(1)``, weight split on its in-channel dim, output
  ``P``; a bias must then be ``P`` too, so it is added once;
- ``P`` input or weight with the other whole: the op is linear in each.

Spatial dims are not sharded: a window straddling two ranks needs a halo exchange, which is not
a placement. Grouped convolutions are only batch-sharded: a channel shard must align with the
groups, which a per-axis rule cannot guarantee on every mesh.

Pools work per (sample, channel) plane: every dim before the spatial ones shards freely, and
the backwards and average pools are linear in their input gradient / input.
"""

from __future__ import annotations

import torch

from autopar.ir.placements import Placement, R, Shard
from autopar.passes.strategies._common import PSUM, dedupe, ins_for, meta_at, outs_for
from autopar.passes.strategies.localize import LocalContext, local_size, register_localizer
from autopar.passes.strategies.registry import OpInfo, Rule, register

aten = torch.ops.aten


def _channel_dims(transposed: bool) -> tuple[int, int]:
    """(out-channel dim, in-channel dim) of the weight: ``[out, in/g, k...]`` for a convolution,
    ``[in, out/g, k...]`` for a transposed one."""
    return (1, 0) if transposed else (0, 1)


@register(aten.convolution.default)
def conv_rule(info: OpInfo) -> list[Rule]:
    # (input, weight, bias?, stride, padding, dilation, transposed, output_padding, groups)
    x, w = info.args[0], info.args[1]
    has_bias = meta_at(info, 2) is not None
    groups = info.arg(8, "groups", 1)
    w_out, w_in = _channel_dims(bool(info.arg(6, "transposed", False)))
    batched = len(x.shape) == len(w.shape)  # unbatched inputs are [C, *spatial]
    c = 1 if batched else 0
    rules = []
    if batched and x.shape[0] > 1:
        rules.append(Rule(ins_for(info, {0: Shard(0)}), (Shard(0),)))
    if groups == 1:
        if w.shape[w_out] > 1:
            rules.append(Rule(ins_for(info, {1: Shard(w_out), 2: Shard(0)}), (Shard(c),)))
        if x.shape[c] > 1:
            rules.append(Rule(ins_for(info, {0: Shard(c), 1: Shard(w_in), 2: PSUM}), (PSUM,)))
    bias: dict[int, Placement] = {2: PSUM} if has_bias else {}
    rules.append(Rule(ins_for(info, {0: PSUM, **bias}), (PSUM,)))
    rules.append(Rule(ins_for(info, {1: PSUM, **bias}), (PSUM,)))
    return dedupe(rules)


@register(aten.convolution_backward.default)
def conv_backward_rule(info: OpInfo) -> list[Rule]:
    # (grad_out, input, weight, bias_sizes, stride, padding, dilation, transposed, out_pad,
    #  groups, output_mask) -> (grad_input, grad_weight, grad_bias)
    x, w = info.args[1], info.args[2]
    groups = info.arg(9, "groups", 1)
    w_out, w_in = _channel_dims(bool(info.arg(7, "transposed", False)))
    batched = len(x.shape) == len(w.shape)
    c = 1 if batched else 0
    rules = []
    if batched and x.shape[0] > 1:
        rules.append(Rule((Shard(0), Shard(0), R), outs_for(info, [Shard(0), PSUM, PSUM])))
    if groups == 1:
        if w.shape[w_out] > 1:
            rules.append(Rule((Shard(c), R, Shard(w_out)),
                              outs_for(info, [PSUM, Shard(w_out), Shard(0)])))
        if x.shape[c] > 1:
            rules.append(Rule((R, Shard(c), Shard(w_in)),
                              outs_for(info, [Shard(c), Shard(w_in), R])))
    rules.append(Rule((PSUM, R, R), outs_for(info, PSUM)))  # linear in grad_out
    return dedupe(rules)


@register_localizer(aten.convolution_backward.default)
def conv_backward_localizer(ctx: LocalContext, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    # bias_sizes names the global bias length; under an out-channel shard it is the local one
    if len(args) > 3 and args[3] and ctx.info.outputs[2] is not None:
        args = (*args[:3], [local_size(ctx, int(args[3][0]), 2, 0)], *args[4:])
    return args, kwargs


# --- pools -------------------------------------------------------------------------------------

_SPATIAL = {
    aten.max_pool2d_with_indices.default: 2, aten.max_pool3d_with_indices.default: 3,
    aten.avg_pool2d.default: 2, aten.avg_pool3d.default: 3,
    aten._adaptive_avg_pool2d.default: 2, aten._adaptive_avg_pool3d.default: 3,
    aten.max_pool2d_with_indices_backward.default: 2,
    aten.max_pool3d_with_indices_backward.default: 3,
    aten.avg_pool2d_backward.default: 2, aten.avg_pool3d_backward.default: 3,
    aten._adaptive_avg_pool2d_backward.default: 2, aten._adaptive_avg_pool3d_backward.default: 3,
}
_LINEAR_POOLS = {aten.avg_pool2d.default, aten.avg_pool3d.default,
                 aten._adaptive_avg_pool2d.default, aten._adaptive_avg_pool3d.default}


@register(*_SPATIAL)
def pool_rule(info: OpInfo) -> list[Rule]:
    x = info.inputs[0]
    lead = len(x.shape) - _SPATIAL[info.target]
    rules = [Rule(tuple(Shard(d) for _ in info.inputs), outs_for(info, Shard(d)))
             for d in range(lead) if x.shape[d] > 1]
    if info.target in _LINEAR_POOLS:
        rules.append(Rule((PSUM,), (PSUM,)))
    elif len(info.inputs) > 1:  # a backward: linear in grad_output, the rest is whole
        rules.append(Rule((PSUM,) + (R,) * (len(info.inputs) - 1), outs_for(info, PSUM)))
    return dedupe(rules)
