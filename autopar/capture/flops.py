"""FLOPs of one traced node, from torch's own per-op formulas."""

from __future__ import annotations

import torch
import torch.fx as fx

from autopar.capture import _torch_compat as compat


def node_flops(node: fx.Node) -> float:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return 0.0
    if "scaled_dot_product" in target.__name__:
        return attention_flops(node)
    reg = compat.flop_registry()
    fn = reg.get(target) or reg.get(target.overloadpacket)
    if fn is None:
        return 0.0
    args = fx.node.map_arg(node.args, lambda a: a.meta.get("val"))
    kwargs = fx.node.map_arg(node.kwargs, lambda a: a.meta.get("val"))
    try:
        return float(fn(*args, **kwargs, out_val=node.meta.get("val")))
    except Exception:  # a formula that cannot read these args: count no FLOPs, never fail
        return 0.0


# A flash attention kernel's backward recomputes the scores (Q K^T) and runs four more
# GEMMs (dV, dP, dQ, dK): five to the forward's two (Dao, FlashAttention-2, arXiv 2307.08691,
# counts its backward as 2.5 x the forward's FLOPs)
ATTENTION_BACKWARD_FACTOR = 2.5


def attention_flops(node: fx.Node) -> float:
    """FLOPs of a scaled-dot-product attention op as a fused kernel does them: ``4 b h s_q s_k
    d`` forward (Q K^T and P V), half of it where the mask is causal (the kernel skips the
    blocks above the diagonal), 2.5 x that backward. torch's own formulas count no causal
    saving, and none at all for the CPU kernel a trace on the CPU records."""
    schema = node.target._schema
    values = {}
    for k, arg in enumerate(schema.arguments):
        if k < len(node.args):
            values[arg.name] = node.args[k]
        elif arg.name in node.kwargs:
            values[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            values[arg.name] = arg.default_value

    def shape(name: str):
        v = values.get(name)
        val = v.meta.get("val") if isinstance(v, fx.Node) else None
        return tuple(val.shape) if val is not None and hasattr(val, "shape") else None

    q, k = shape("query"), shape("key")
    if q is None or k is None or len(q) < 2:
        return 0.0
    *lead, s_q, d = q
    s_k = k[-2]
    v = shape("value")
    d_v = v[-1] if v is not None else d
    b_h = 1
    for x in lead:
        b_h *= int(x)
    fwd = 2.0 * b_h * s_q * s_k * (d + d_v)
    if values.get("is_causal") and s_q == s_k:
        fwd /= 2
    backward = "backward" in node.target.__name__
    return fwd * ATTENTION_BACKWARD_FACTOR if backward else fwd
