"""Compute ops met in the joint graphs of the covered models that no other family registers yet.

``_safe_softmax`` is SDPA's math path (taken on CPU when attention dropout is on, e.g. HF GPT-2
with ``attn_implementation="sdpa"``): a softmax that returns 0 for fully masked rows. Like
softmax it mixes values only along ``dim``. Kept here until the reduction family takes it over
(its rule is the same as ``_softmax``'s; a later registration there simply replaces this one).
"""

from __future__ import annotations

import torch

from autopar.ir.placements import Shard
from autopar.passes.strategies._layout import norm_dim
from autopar.passes.strategies.registry import OpInfo, Rule, register

aten = torch.ops.aten


@register(aten._safe_softmax.default)
def safe_softmax_rules(info: OpInfo) -> list[Rule]:
    ndim = len(info.inputs[0].shape)
    dim = norm_dim(info.arg(1, "dim"), ndim)
    return [Rule((Shard(d),), (Shard(d),)) for d in range(ndim) if d != dim]
