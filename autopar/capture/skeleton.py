"""A model's skeleton: the same modules with every parameter and buffer on the meta device.

Planning traces on fake tensors and needs no weights; a skeleton keeps a model's structure
(to retrace when the inputs change shape, to build every pipeline stage for planning) without
holding or copying its memory.
"""

from __future__ import annotations

import copy
from typing import Any

import torch.nn as nn


def meta_skeleton(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every parameter and buffer on the meta device (no memory);
    parameters stay parameters, with their ``requires_grad``."""
    memo: dict[int, Any] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        m = t.detach().to("meta")
        memo[id(t)] = nn.Parameter(m, requires_grad=t.requires_grad) if isinstance(
            t, nn.Parameter) else m
    return copy.deepcopy(model, memo)
