"""Hugging Face mixture-of-experts layers, traced with an implementation that has static shapes.

transformers 5.x picks how an MoE layer runs its experts by ``config._experts_implementation``:

- ``"eager"`` calls ``nonzero()`` and loops in Python over the experts that were hit: the shapes
  depend on the routing, so it cannot be traced on fake tensors;
- ``"grouped_mm"`` (the default) sorts tokens by expert and calls ``torch._grouped_mm``, whose
  fake kernel takes bf16 only;
- ``"batched_mm"`` gathers each token's expert weights (``w[expert_ids]``) and runs ``bmm``:
  static shapes, any dtype, the same sums.

:func:`traceable_experts` switches the layers that could not be traced to ``"batched_mm"`` for
the length of a trace and puts every config back afterwards, so the user's model is left as it
was. autopar then runs the traced graph, never the model's own forward, so training uses the
implementation that was traced.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
import torch.nn as nn

_STATIC = "batched_mm"


def _is_experts(m: nn.Module) -> bool:
    """An experts layer (transformers' ``use_experts_implementation`` marks it). Every config
    has an experts implementation, a dense model's too: only an experts layer runs one."""
    return hasattr(m, "_is_expert_parallel") or hasattr(m, "is_concatenated")


def _untraceable(impl: object, model: nn.Module) -> bool:
    if impl == "eager":
        return True
    if impl == "grouped_mm":  # its fake kernel is bf16-only
        return any(p.dtype != torch.bfloat16 for p in model.parameters() if p.is_floating_point())
    return False


def _static_available() -> bool:
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return False
    return _STATIC in ALL_EXPERTS_FUNCTIONS


@contextlib.contextmanager
def traceable_experts(model: nn.Module) -> Iterator[None]:
    """Within the block, every HF experts config whose implementation cannot be traced on
    fake tensors uses ``"batched_mm"`` instead."""
    configs = {id(c): c for m in model.modules() if _is_experts(m)
               and hasattr(c := getattr(m, "config", None), "_experts_implementation_internal")}
    switched = [(c, c._experts_implementation_internal) for c in configs.values()
                if _untraceable(c._experts_implementation_internal, model)]
    if switched and not _static_available():
        switched = []  # an older transformers: trace as it is and let capture report a failure
    if switched:
        warnings.warn(
            f"autopar traces this model's experts with experts_implementation='{_STATIC}' "
            f"instead of {switched[0][1]!r}, which cannot be traced on fake tensors (same "
            f"result, more memory per token); with bf16 weights 'grouped_mm' traces as it is",
            stacklevel=4)
    try:
        for c, _ in switched:
            c._experts_implementation_internal = _STATIC
        yield
    finally:
        for c, impl in switched:
            c._experts_implementation_internal = impl
