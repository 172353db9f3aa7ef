"""Rules for token embeddings and their weight gradient.

Three layouts matter for LMs: ids split with the batch (data parallel, the table replicated),
the table split on its embedding dim (column parallel: the output is split on its last dim) and
the table split on its vocabulary (Megatron's vocab parallel: each rank looks up only the ids in
its row range and contributes zeros elsewhere, so the output is a Partial sum). The last one
needs the rank's row range, hence the special impls below.
"""

from __future__ import annotations

import torch

from autopar.ir.placements import R, Shard
from autopar.passes.strategies._layout import P, shard_range
from autopar.passes.strategies.localize import LocalContext, register_impl
from autopar.passes.strategies.registry import OpInfo, Rule, register

aten = torch.ops.aten


@register(aten.embedding.default)
def embedding_rules(info: OpInfo) -> list[Rule]:
    nd = len(info.inputs[1].shape)  # the ids
    rules = [Rule((R, Shard(j)), (Shard(j),)) for j in range(nd)]
    rules.append(Rule((Shard(1), R), (Shard(nd),)))
    rules.append(Rule((Shard(0), R), (P,), "vocab_parallel_embedding"))
    rules.append(Rule((P, R), (P,)))  # a lookup is linear in the table
    return rules


@register_impl("vocab_parallel_embedding")
def _vocab_parallel_embedding(ctx: LocalContext, args: tuple, kwargs: dict) -> torch.Tensor:
    weight, ids = args[0], args[1]
    start, stop = shard_range(ctx, ctx.strategy.ins[0], 0, ctx.info.inputs[0].shape[0])
    inside = (ids >= start) & (ids < stop)
    # ids of other ranks read row 0 and are zeroed after: a static-shape mask, no gather by mask
    local_ids = torch.where(inside, ids - start, torch.zeros_like(ids))
    out = aten.embedding.default(weight, local_ids)
    return out * inside.unsqueeze(-1).to(out.dtype)


@register(aten.embedding_dense_backward.default)
def embedding_backward_rules(info: OpInfo) -> list[Rule]:
    grad, ids = info.inputs[0], info.inputs[1]
    nd = len(ids.shape)
    scale_by_freq = bool(info.arg(4, "scale_grad_by_freq", False))
    rules = []
    if not scale_by_freq:  # frequencies would be counted per rank instead of globally
        # each rank scatters the gradients of its own tokens: the table gradient is their sum
        rules += [Rule((Shard(j), Shard(j)), (P,)) for j in range(nd)]
    rules.append(Rule((Shard(len(grad.shape) - 1), R), (Shard(1),)))
    rules.append(Rule((R, R), (Shard(0),), "vocab_parallel_embedding_backward"))
    rules.append(Rule((P, R), (P,)))  # linear in the incoming gradient
    return rules


@register_impl("vocab_parallel_embedding_backward")
def _vocab_parallel_embedding_backward(
    ctx: LocalContext, args: tuple, kwargs: dict
) -> torch.Tensor:
    grad, ids, num_weights = args[0], args[1], args[2]
    padding_idx = args[3] if len(args) > 3 else kwargs.get("padding_idx", -1)
    scale_by_freq = args[4] if len(args) > 4 else kwargs.get("scale_grad_by_freq", False)
    start, stop = shard_range(ctx, ctx.strategy.outs[0], 0, num_weights)
    n_local = stop - start
    inside = (ids >= start) & (ids < stop)
    # other ranks' ids land in one extra row that is dropped: the scatter stays static-shaped
    local_ids = torch.where(inside, ids - start, torch.full_like(ids, n_local))
    pad = padding_idx - start if 0 <= padding_idx and start <= padding_idx < stop else -1
    g = aten.embedding_dense_backward.default(grad, local_ids, n_local + 1, pad, scale_by_freq)
    return g[:n_local]
