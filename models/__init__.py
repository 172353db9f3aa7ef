"""Reference models with configs as code, a preset registry, and hand-written reference plans.

>>> from autopar.models import get_preset
>>> preset = get_preset("llama3-8b")
>>> model = preset.build(device="meta")          # nothing allocated
>>> tokens, targets = preset.example_inputs(batch=8, seq=2048)
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autopar.ir.errors import AutoparError

from .gpt2 import GPT2, GPT2_CONFIGS, GPT2Config
from .llama3 import LLAMA_CONFIGS, LlamaConfig, Transformer
from .mlp import MLP, MLP_CONFIGS, MLPConfig
from .moe import MOE_CONFIGS, MoEConfig, MoETransformer
from .reference_plans import REFERENCE_PLANS, ReferencePlan, applicable_plans

Llama = Transformer

_FAMILY_CLASS: dict[str, type[nn.Module]] = {
    "gpt2": GPT2,
    "llama3": Transformer,
    "moe": MoETransformer,
    "mlp": MLP,
}


@dataclass(frozen=True, slots=True)
class ModelPreset:
    name: str
    family: str  # "gpt2" | "llama3" | "moe" | "mlp"
    config: Any

    @property
    def model_class(self) -> type[nn.Module]:
        return _FAMILY_CLASS[self.family]

    def build(
        self, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32
    ) -> nn.Module:
        """The model on ``device`` in ``dtype``; on ``"meta"`` nothing is allocated or initialised.

        Always constructed on meta first and then materialised once with ``init_weights()``, so
        large models are not initialised twice (module defaults, then ours).
        """
        device = torch.device(device) if device is not None else torch.get_default_device()
        with torch.device("meta"):
            model = self.model_class(self.config)
        model.to(dtype=dtype)
        # RoPE tables stay fp32 whatever the weights' dtype: bf16 angles lose position precision.
        for name, buf in list(model.named_buffers(recurse=False)):
            setattr(model, name, buf.float())
        if device.type != "meta":
            model.to_empty(device=device)
            model.init_weights()
        return model

    def example_inputs(
        self, batch: int, seq: int, device: torch.device | str = "meta"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tokens, targets)``: int64 ``[batch, seq]`` for LMs, float ``(x, y)`` for the MLP.

        The MLP ignores ``seq``.
        """
        cfg = self.config
        if self.family == "mlp":
            return (
                torch.randn(batch, cfg.in_dim, device=device),
                torch.randn(batch, cfg.out_dim, device=device),
            )
        field = "n_positions" if self.family == "gpt2" else "max_seq_len"
        if seq > getattr(cfg, field):
            raise ValueError(
                f"{self.name}: seq={seq} exceeds {field}={getattr(cfg, field)}; use "
                f"get_preset({self.name!r}).replace({field}={seq})"
            )
        shape = (batch, seq)
        return (
            torch.randint(0, cfg.vocab_size, shape, device=device),
            torch.randint(0, cfg.vocab_size, shape, device=device),
        )

    def replace(self, **changes: Any) -> ModelPreset:
        """The same preset with config fields changed, e.g. ``replace(max_seq_len=8192)``."""
        return dataclasses.replace(self, config=dataclasses.replace(self.config, **changes))


def _presets() -> dict[str, ModelPreset]:
    out: dict[str, ModelPreset] = {}
    for family, configs in (
        ("gpt2", GPT2_CONFIGS),
        ("llama3", LLAMA_CONFIGS),
        ("moe", MOE_CONFIGS),
        ("mlp", MLP_CONFIGS),
    ):
        out.update({name: ModelPreset(name, family, cfg) for name, cfg in configs.items()})
    return out


PRESETS: dict[str, ModelPreset] = _presets()


class UnknownPresetError(AutoparError, KeyError, ValueError):
    """A preset name not in :data:`PRESETS`; also a ``KeyError`` and a ``ValueError``."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])


def get_preset(name: str) -> ModelPreset:
    try:
        return PRESETS[name]
    except KeyError:
        close = difflib.get_close_matches(name, PRESETS, n=1, cutoff=0.4)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise UnknownPresetError(
            f"unknown model preset {name!r}.{hint} Known presets: {', '.join(PRESETS)}"
        ) from None


__all__ = [
    "GPT2",
    "GPT2Config",
    "Llama",
    "LlamaConfig",
    "MLP",
    "MLPConfig",
    "MoEConfig",
    "MoETransformer",
    "ModelPreset",
    "PRESETS",
    "REFERENCE_PLANS",
    "ReferencePlan",
    "Transformer",
    "UnknownPresetError",
    "applicable_plans",
    "get_preset",
]
