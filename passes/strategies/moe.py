"""Rules for the ops specific to mixture-of-experts layers: ``histc`` (tokens per expert) and
``_grouped_mm`` (the ragged per-expert matmul of Hugging Face's ``grouped_mm`` experts).

The rest of an MoE layer is covered elsewhere: the capacity-based dispatch of
``autopar.models.moe`` is one-hot arithmetic, ``cumsum`` and einsums that lower to
``bmm``/``permute``/``view`` (expert parallelism there is ``Shard(0)`` of the stacked expert
weights and of the dispatched activations: ``bmm``'s batch split); HF's ``batched_mm`` experts
gather the stacked weights per token (``index``/``index_put``, see ``indexing.py``).
"""

from __future__ import annotations

import torch

from autopar.ir.placements import R, Shard
from autopar.passes.strategies._layout import P, shard_range
from autopar.passes.strategies.localize import LocalContext, register_impl
from autopar.passes.strategies.registry import OpInfo, Rule, register

aten = torch.ops.aten


@register(aten.histc.default)
def histc_rules(info: OpInfo) -> list[Rule]:
    lo, hi = info.arg(2, "min", 0), info.arg(3, "max", 0)
    if not lo < hi:  # the range would come from each rank's own data: not additive
        return []
    # counts over disjoint pieces of the input add up
    return [Rule((Shard(d),), (P,)) for d in range(len(info.inputs[0].shape))]


@register(aten._grouped_mm.default)
def grouped_mm_rules(info: OpInfo) -> list[Rule]:
    """``offs`` splits the rows (2-D x 3-D: tokens sorted by expert) or the contraction
    (2-D x 2-D: the weight gradient, one [K, N] block per expert) into groups. The data-dependent
    group boundaries rule out splitting the grouped dim of the tokens; the other dims split as in
    ``mm``. Expert parallelism without an all-to-all: every rank holds all tokens and its own
    experts, computes the rows routed to them and zeros elsewhere, so the output is a Partial
    sum (the ``expert_grouped_mm`` impl; its weight gradient comes out split by expert)."""
    if info.arg(3, "bias") is not None:
        return []
    a, b = info.inputs[0], info.inputs[1]
    extra = (R,) * (len(info.inputs) - 2)  # offs: whole on every rank
    rules = [Rule((P, R) + extra, (P,)), Rule((R, P) + extra, (P,))]
    shapes = (len(a.shape), len(b.shape))
    if shapes == (2, 3):  # [M, K] x [E, K, N] -> [M, N], M grouped
        rules += [Rule((R, Shard(2)) + extra, (Shard(1),)),
                  Rule((Shard(1), Shard(1)) + extra, (P,))]
        if extra:
            rules.append(Rule((R, Shard(0)) + extra, (P,), "expert_grouped_mm"))
    elif shapes == (2, 2):  # [K, M] x [M, N] -> [E, K, N], M grouped
        rules += [Rule((Shard(0), R) + extra, (Shard(1),)),
                  Rule((R, Shard(1)) + extra, (Shard(2),))]
        if extra:
            rules.append(Rule((R, R) + extra, (Shard(0),), "expert_grouped_mm"))
    elif shapes == (3, 3):  # a plain batched matmul over experts
        rules += [Rule((Shard(0), Shard(0)) + extra, (Shard(0),)),
                  Rule((Shard(1), R) + extra, (Shard(1),)),
                  Rule((R, Shard(2)) + extra, (Shard(2),)),
                  Rule((Shard(2), Shard(1)) + extra, (P,))]
    return rules


@register_impl("expert_grouped_mm")
def _expert_grouped_mm(ctx: LocalContext, args: tuple, kwargs: dict) -> torch.Tensor:
    """The rank's experts ``[e0, e1)`` own token rows ``[offs[e0-1], offs[e1-1])``. Rows before
    them would fall into the rank's first group, so they are zeroed on the way in; rows after
    are not computed by the kernel (left uninitialised), so the output is masked with ``where``.
    """
    a, b, offs = args[0], args[1], args[2]
    info = ctx.info
    if len(info.inputs[1].shape) == 3:  # forward / input gradient: the weight is split
        n_exp = info.inputs[1].shape[0]
        e0, e1 = shard_range(ctx, ctx.strategy.ins[1], 0, n_exp)
        rows_dim = 0
    else:  # weight gradient: the output is split by expert
        n_exp = info.out.shape[0]
        e0, e1 = shard_range(ctx, ctx.strategy.outs[0], 0, n_exp)
        rows_dim = 1
    start = offs[e0 - 1] if e0 > 0 else offs.new_zeros(())
    rows = torch.arange(a.shape[rows_dim], device=a.device)
    inside = (rows >= start) & (rows < offs[e1 - 1])
    inside = inside.unsqueeze(1) if rows_dim == 0 else inside.unsqueeze(0)
    a = torch.where(inside, a, torch.zeros((), dtype=a.dtype, device=a.device))
    out = aten._grouped_mm.default(a, b, offs[e0:e1].contiguous(), *args[3:], **kwargs)
    if rows_dim == 0:
        out = torch.where(inside, out, torch.zeros((), dtype=out.dtype, device=out.device))
    return out
