"""A plain multi-layer perceptron regression model: the smallest thing worth parallelising.

Linear layers live in ``layers`` (``layers.{i}.weight`` / ``.bias``), so Megatron's
column-then-row pairing applies to layers (0, 1), (2, 3), ...
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

_ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu, "silu": F.silu, "tanh": torch.tanh}


@dataclass(frozen=True, slots=True)
class MLPConfig:
    in_dim: int = 64
    hidden: tuple[int, ...] = (128, 128)
    out_dim: int = 64
    activation: str = "gelu"
    bias: bool = True

    def __post_init__(self) -> None:
        # Lists are accepted for convenience; stored as a tuple so the config stays hashable.
        if not isinstance(self.hidden, tuple):
            object.__setattr__(self, "hidden", tuple(self.hidden))
        if self.activation not in _ACTIVATIONS:
            raise ValueError(
                f"unknown activation {self.activation!r}; choose one of {sorted(_ACTIVATIONS)}"
            )

    @property
    def widths(self) -> tuple[int, ...]:
        return (self.in_dim, *self.hidden, self.out_dim)


MLP_CONFIGS: dict[str, MLPConfig] = {
    "mlp-tiny": MLPConfig(in_dim=16, hidden=(32, 32, 32), out_dim=8),
    "mlp-large": MLPConfig(in_dim=8192, hidden=(8192, 8192, 8192), out_dim=8192),
}


class MLP(nn.Module):
    """``forward(x, y=None)``: mean-squared error against ``y`` when given, else the output."""

    def __init__(self, config: MLPConfig) -> None:
        super().__init__()
        self.config = config
        w = config.widths
        self.layers = nn.ModuleList(
            nn.Linear(a, b, bias=config.bias) for a, b in zip(w[:-1], w[1:])
        )
        self.act = _ACTIVATIONS[config.activation]

    @torch.no_grad()
    def init_weights(self) -> None:
        """PyTorch's default Linear initialisation, in place; call after ``to_empty()``."""
        for layer in self.layers:
            layer.reset_parameters()

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = self.act(x)
        return x if y is None else F.mse_loss(x, y)


