"""FLOPs of one traced node, from torch's own per-op formulas."""

from __future__ import annotations

import torch
import torch.fx as fx

from autopar.capture import _torch_compat as compat


def node_flops(node: fx.Node) -> float:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return 0.0
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
