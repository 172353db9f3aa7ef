"""A plan's precision: the dtype its step computes in and the dtype its gradients are reduced
in. What the policy casts, op by op, is :mod:`autopar.passes.memory.mixed_precision`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from autopar.ir.errors import PlanError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
NAMES = {v: k for k, v in DTYPES.items()}
# initial scale, and what an overflow and a run of good steps do to it (torch's GradScaler's)
FP16_INITIAL_SCALE = 2.0**16


@dataclass(frozen=True, slots=True)
class Precision:
    """``name``: the compute dtype (``fp32``, ``bf16``, ``fp16``); ``reduce``: the dtype
    gradients are summed across ranks in (``fp32`` default, or the compute dtype)."""

    name: str = "fp32"
    reduce: str = "fp32"

    def __post_init__(self) -> None:
        if self.name not in DTYPES:
            raise PlanError(f"unknown precision {self.name!r}: use fp32, bf16 or fp16")
        if self.reduce not in ("fp32", self.name):
            raise PlanError(
                f"gradients of a {self.name} plan are reduced in fp32 or {self.name}, not "
                f"{self.reduce}: pass reduce_dtype='fp32' or '{self.name}'")

    @property
    def compute_dtype(self) -> torch.dtype:
        return DTYPES[self.name]

    @property
    def reduce_dtype(self) -> torch.dtype:
        return DTYPES[self.reduce]

    @property
    def mixed(self) -> bool:
        return self.name != "fp32"

    @property
    def loss_scaling(self) -> bool:
        """fp16's narrow range needs the loss scaled up so small gradients do not flush to 0."""
        return self.name == "fp16"

    def to_json(self) -> dict[str, str]:
        return {"name": self.name, "reduce": self.reduce}

    @classmethod
    def from_json(cls, d: dict[str, str] | None) -> Precision:
        return cls() if not d else cls(d["name"], d.get("reduce", "fp32"))


def resolve(precision: str | Precision | None, device: Any, reduce_dtype: str | None = None
            ) -> Precision:
    """The plan's precision: as given, or the device profile's default (bf16 on GPUs, fp32 on
    the ``cpu`` profile); ``reduce_dtype`` overrides the gradient reduction dtype."""
    if isinstance(precision, Precision):
        p = precision
    else:
        p = Precision(short_name(precision if precision is not None else device.default_precision))
    return p if reduce_dtype is None else Precision(p.name, short_name(reduce_dtype))


def short_name(name: str) -> str:
    """``"bfloat16"`` -> ``"bf16"`` (torch's names taken too), lower case."""
    name = str(name).lower().removeprefix("torch.")
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(name, name)
