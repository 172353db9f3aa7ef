"""A trace that stands for a deeper model: which blocks were traced and what each stands for.
How a model is traced so is :mod:`autopar.capture.depth_proxy`."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DepthProxy:
    path: str  # the ModuleList's qualified name, e.g. "layers"
    total: int  # blocks in the real model
    kept: int  # blocks traced
    # blocks the trace stands for (a pipeline stage's share; None: all of them) and the
    # microbatches whose saved activations a rank holds at once (pipelines; 1 otherwise)
    stands_for: int | None = None
    in_flight: float = 1.0
    # microbatches per step (pipelines; 1 otherwise): what runs once per step (gradient
    # syncs, gathers of parameters held whole across microbatches) weighs 1/microbatches
    # against one microbatch's work
    microbatches: int = 1

    @property
    def represented(self) -> int:
        return self.total if self.stands_for is None else self.stands_for

    @property
    def middle_weight(self) -> float:
        return (self.represented - 2) / (self.kept - 2)

    def layer_weight(self, layer: int | None) -> float:
        if layer is None:
            return 1.0
        if self.represented < self.kept:  # a stage of one block, traced as two to be tagged
            return self.represented / self.kept
        if layer == 0 or layer == self.kept - 1:
            return 1.0
        return self.middle_weight

    def traced_name(self, name: str) -> str:
        """The traced parameter that stands for ``name`` (itself if it was traced)."""
        m = re.match(rf"^{re.escape(self.path)}\.(\d+)\.(.*)$", name)
        if not m:
            return name
        i = int(m.group(1))
        if i < self.kept - 1:
            return name
        if self.kept < 3:  # no middle block: the last traced one stands for the rest
            return f"{self.path}.{self.kept - 1}.{m.group(2)}"
        j = self.kept - 1 if i == self.total - 1 else 1 + (i - 1) % (self.kept - 2)
        return f"{self.path}.{j}.{m.group(2)}"
