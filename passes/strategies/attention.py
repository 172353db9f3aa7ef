"""Rules for the fused scaled-dot-product-attention kernels, forward and backward.

Attention is independent per (batch, head), so splitting either dim of q, k, v splits the output,
the logsumexp and every gradient the same way (with grouped-query attention k and v have fewer
heads; a head split still pairs each rank's q heads with its own kv heads whenever the kv head
count divides, which ``expand`` checks). Splitting the *query sequence* also works when k and v
stay whole: each query row attends to the keys independently, and the gradients of k and v are
partial sums over the rank's queries. Under a causal mask the rank's rows start at an offset, so
the CPU kernel is then called with an explicit additive mask shifted by that offset (the
``causal_query_split`` impl) instead of ``is_causal``.

The kernels take many tensors (mask, RNG state, cumulative sequence lengths...): rules are
written by schema argument name, so one table serves the CPU flash, CUDA flash, memory-efficient
and cuDNN variants. Only the CPU variant can be run here; the others are checked by structure.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from autopar.ir.graph import TensorMeta
from autopar.ir.placements import Placement, R, Shard
from autopar.passes.strategies._layout import P, return_names, shard_range, tensor_arg_names
from autopar.passes.strategies.localize import LocalContext, register_impl
from autopar.passes.strategies.registry import OpInfo, Rule, register

aten = torch.ops.aten

# [batch, heads, seq, head_dim] tensors, by schema name (inputs) or return name (outputs)
_BHSD = {"query", "key", "value", "out", "output", "grad_out", "grad_out_", "grad_query",
         "grad_key", "grad_value"}
_LSE = {"logsumexp", "log_sumexp"}
_MASK = {"attn_mask", "attn_bias"}
_KV = {"key", "value"}
_GRAD_KV = {"grad_key", "grad_value"}

# CPU flash: logsumexp is exactly [B, H, L], so it can follow a query-sequence split. The
# memory-efficient kernel pads it to a multiple of 32 and the CUDA kernels differ per backend:
# those get the batch and head splits only.
_SEQ_OK = {
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
}


def _mask_placement(meta: TensorMeta, q_dim: int, q_ndim: int) -> Placement:
    """A broadcastable mask/bias follows the split only where it is not broadcast."""
    d = q_dim - (q_ndim - len(meta.shape))
    if d < 0 or meta.shape[d] == 1:
        return R
    return Shard(d)


def _placement(name: str, meta: TensorMeta | None, mode: str, q_dim: int,
               q_ndim: int) -> Placement:
    if meta is None or len(meta.shape) == 0 or meta.numel == 0:
        return R  # RNG seeds, offsets, SymInts and unused placeholders
    if mode == "seq" and (name in _KV):
        return R
    if mode == "seq" and name in _GRAD_KV:
        return P
    if name in _BHSD or name in _LSE:
        return Shard(q_dim)
    if name in _MASK:
        return _mask_placement(meta, q_dim, q_ndim)
    if name == "grad_bias":  # the bias gradient is summed over the dims the bias broadcasts
        p = _mask_placement(meta, q_dim, q_ndim)
        return P if p == R else p
    if name == "debug_attn_mask" and len(meta.shape) == q_ndim:
        return Shard(q_dim)
    return R


def _names(info: OpInfo) -> tuple[list[str], list[str]]:
    ins = tensor_arg_names(info)
    outs = return_names(info)
    if info.target in _UNNAMED_GRADS:  # backward kernels whose returns are unnamed in schema
        outs = ["grad_query", "grad_key", "grad_value", "grad_bias"][: len(info.outputs)]
    return ins, outs


def _is_causal(info: OpInfo) -> bool:
    schema = info.target._schema
    for i, a in enumerate(schema.arguments):
        if a.name == "is_causal":
            return bool(info.arg(i, "is_causal", a.default_value or False))
    return False


def sdpa_rules(info: OpInfo) -> list[Rule]:
    in_names, out_names = _names(info)
    q = info.inputs[in_names.index("query")]
    q_ndim = len(q.shape)
    modes = [("bh", 0), ("bh", 1)]
    if info.target in _SEQ_OK:
        modes.append(("seq", q_ndim - 2))
    rules = []
    for mode, dim in modes:
        ins = tuple(_placement(n, m, mode, dim, q_ndim) for n, m in zip(in_names, info.inputs))
        outs = tuple(_placement(n, m, mode, dim, q_ndim) for n, m in zip(out_names, info.outputs))
        causal_seq = mode == "seq" and _is_causal(info)
        rules.append(Rule(ins, outs, "causal_query_split" if causal_seq else None))
    return rules


@register_impl("causal_query_split")
def _causal_query_split(ctx: LocalContext, args: tuple, kwargs: dict) -> Any:
    """Causal attention for query rows ``[start, stop)``: row ``i`` sees keys ``j <= start + i``
    (SDPA's causal mask is aligned top-left), given to the kernel as an additive mask."""
    info = ctx.info
    names = tensor_arg_names(info)
    qi = names.index("query")
    q_meta, k_meta = info.inputs[qi], info.inputs[names.index("key")]
    seq_dim = len(q_meta.shape) - 2
    start, stop = shard_range(ctx, ctx.strategy.ins[qi], seq_dim, q_meta.shape[seq_dim])
    q = args[[a.name for a in info.target._schema.arguments].index("query")]
    keep = torch.ones(stop - start, k_meta.shape[-2], dtype=torch.bool, device=q.device)
    keep = keep.tril(diagonal=start)
    mask = torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill(~keep, -math.inf)
    args = list(args)
    pos = [a.name for a in info.target._schema.arguments].index("is_causal")
    if pos < len(args):
        args[pos] = False
    else:
        kwargs = {**kwargs, "is_causal": False}
    return info.target(*args, **{**kwargs, "attn_mask": mask})


_UNNAMED_GRADS = {
    getattr(aten, n).default
    for n in (
        "_scaled_dot_product_efficient_attention_backward",
        "_scaled_dot_product_cudnn_attention_backward",
        "_scaled_dot_product_fused_attention_overrideable_backward",
    )
    if hasattr(aten, n)
}

_SDPA_OPS = [
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_cudnn_attention_backward",
    "_scaled_dot_product_fused_attention_overrideable",
    "_scaled_dot_product_fused_attention_overrideable_backward",
]
# torch versions differ in which kernels exist: register those this torch has
SDPA_OPS = [getattr(aten, n).default for n in _SDPA_OPS if hasattr(aten, n)]
register(*SDPA_OPS)(sdpa_rules)


@register(aten._scaled_dot_product_attention_math.default)
def sdpa_math_rules(info: OpInfo) -> list[Rule]:
    # returns (out [B, H, L, E], attn [B, H, L, S]); only seen when not decomposed
    q_ndim = len(info.inputs[0].shape)
    in_names = tensor_arg_names(info)
    rules = []
    for dim in (0, 1):
        ins = tuple(
            R if n == "dropout_mask" and m.shape[dim] == 1 else
            _mask_placement(m, dim, q_ndim) if n in ("attn_mask", "dropout_mask") else Shard(dim)
            for n, m in zip(in_names, info.inputs)
        )
        rules.append(Rule(ins, (Shard(dim), Shard(dim))))
    return rules
