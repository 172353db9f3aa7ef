"""Dynamic loss scaling for fp16 plans, inside the parallel step (no GradScaler to call).

fp16's narrow range flushes small gradients to zero, so the backward starts from the loss's
gradient times a scale (the seed of the joint graph's backward, scaled here), and every
gradient comes out multiplied by it. Before the gradients reach ``.grad``:

- every rank checks its own gradient pieces for inf/NaN, and one all-reduce of that flag over
  the whole mesh (reason ``"loss scaling"``, listed in the plan and priced) makes every rank
  decide alike;
- an overflow skips the step: no gradient is handed on, every parameter's ``.grad`` is
  dropped (so ``optimizer.step()`` leaves the parameters and their state as they are: torch's
  optimizers pass over parameters without a gradient), the scale is halved, and a warning says
  so. With gradient accumulation, the micro-steps accumulated since the last ``zero_grad`` go
  with it;
- otherwise the gradients are divided by the scale (in fp32), and after ``growth_interval``
  steps without an overflow the scale doubles.

The constants are torch's ``GradScaler``'s. The loss the module returns is never scaled.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from autopar.ir.placements import Partial, Replicate
from autopar.ir.precision import FP16_INITIAL_SCALE
from autopar.runtime import _compat


class LossScaleWarning(UserWarning):
    """An fp16 step overflowed and was skipped."""


@dataclass
class DynamicLossScale:
    scale: float = FP16_INITIAL_SCALE
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    good_steps: int = 0  # backward passes since the last overflow or growth
    skipped: int = 0  # backward passes whose gradients overflowed

    def seed(self, grad_loss: torch.Tensor) -> torch.Tensor:
        return grad_loss * self.scale

    def unscale_or_skip(self, grads: list[torch.Tensor | None], comm,
                        params: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """``grads`` (this rank's pieces, scaled) divided by the scale, or all None where any
        rank's overflowed (the step skipped, see the module doc)."""
        from autopar.runtime.redistribute import redistribute

        present = [g for g in grads if g is not None]
        bad = torch.stack([(~torch.isfinite(g)).any() for g in present]).any().float() \
            if present else torch.zeros(())
        ndim = len(comm.shape)
        bad = redistribute(bad, (Partial(),) * ndim, (Replicate(),) * ndim, comm,
                           "loss scaling")
        if float(_compat.reconcile(bad)) > 0:
            old = self.scale
            self.scale *= self.backoff_factor
            self.skipped += 1
            self.good_steps = 0
            for p in params:
                p.grad = None
            warnings.warn(f"fp16: gradients overflowed (inf/NaN): step skipped, loss scale "
                          f"{old:g} -> {self.scale:g}", LossScaleWarning, stacklevel=2)
            return [None] * len(grads)
        inv = 1.0 / self.scale
        out = [None if g is None else g.mul_(inv) for g in grads]
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0
        return out
