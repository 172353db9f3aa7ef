"""A pipeline behind the ordinary training loop: ``loss = model(x, y); loss.backward()``.

torch's schedules run the forward and the backward of every micro-batch in one call, so the
whole step happens in ``forward``; the gradients it makes are held aside, and ``backward``
hands them to autograd scaled by the gradient it receives. So ``loss.backward()`` stores the
step's gradients in ``.grad`` as a one-device backward would, ``(loss / k).backward()`` over
k calls accumulates them as gradient accumulation does, and hooks run as usual. Any
``torch.optim`` optimizer steps :meth:`PipelineModule.parameters` (this rank's stages).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from autopar.runtime.pipeline import PipelineRunner


class _WholeStep(torch.autograd.Function):
    """The schedule's step in ``forward``; its gradients, scaled, in ``backward``."""

    @staticmethod
    def forward(ctx: Any, runner: PipelineRunner, tokens: torch.Tensor, targets: torch.Tensor,
                *params: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        # what .grad holds from earlier calls (accumulation) is not this step's: set it aside
        # so the schedule writes this step's alone, then put it back for autograd to add to
        earlier = [p.grad for p in params]
        for p in params:
            p.grad = None
        with torch.enable_grad():  # the schedule runs its own forward and backward
            loss = runner.step(tokens, targets)
        ctx.grads = [p.grad for p in params]
        for p, g in zip(params, earlier):
            p.grad = g
        return loss.detach()

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple:  # type: ignore[override]
        grads, ctx.grads = ctx.grads, None
        scaled = [None if g is None else g * grad_loss.to(g.dtype) for g in grads]
        return (None, None, None, *scaled)


class PipelineModule(nn.Module):
    """This rank's pipeline stages as one module. Calling it runs a whole schedule step and
    returns the single-device mean loss on every rank; its ``backward`` delivers the step's
    gradients. ``stages.<s>`` holds stage ``s`` under the whole model's names
    (``stages.1.layers.3.attention.wq.weight``); a tied weight has one copy per stage.
    Clip gradients with :meth:`clip_grad_norm_` (torch's own would see this rank's stages
    only)."""

    def __init__(self, runner: PipelineRunner) -> None:
        super().__init__()
        self.runner = runner
        self.stages = nn.ModuleDict({str(s): m for s, m in sorted(runner.stage_modules.items())})

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        params = list(self.runner.parameters())
        if not torch.is_grad_enabled():
            raise RuntimeError("a pipeline step runs forward and backward together; call it "
                               "with gradients enabled (not under torch.no_grad())")
        return _WholeStep.apply(self.runner, tokens, targets, *params)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """The whole model's gradient norm (as one device computes it) on every rank, the
        gradients scaled as torch's ``clip_grad_norm_`` scales them."""
        return self.runner.clip_grad_norm_(max_norm, norm_type)
