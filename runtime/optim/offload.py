"""Optimizer state in host memory, for the parameters a plan offloads (ZeRO-Offload's way).

A plan that offloads (``Plan.decided.param_state.offloaded``, :mod:`autopar.passes.memory.zero`) was priced
with those parameters' optimizer state off the device: each step their gradients go to the
host, the host's optimizer step updates a host copy of the parameter, and the result comes
back. :class:`OffloadedOptimizer` does exactly that around any torch optimizer class:

- a host (CPU; pinned where the device is a GPU) copy of each offloaded parameter's local
  piece, made once, is what one instance of the optimizer class updates; its state (Adam's
  moments) is therefore made on the host;
- the other parameters are stepped by a second instance on the device, as usual;
- ``step()`` copies each offloaded gradient's local piece into the host copy's ``.grad``,
  steps both, and copies the updated host piece back into the parameter's local piece.

The host instance sees local pieces, not DTensors: an optimizer whose update of an element
reads only that element's parameter, gradient and state (Adam, AdamW, SGD, Adagrad, RMSprop:
torch's elementwise ones) computes exactly what it would on the device; one that reduces over
a whole tensor (LAMB-style trust ratios, Adafactor's factored moments) would see only this
rank's piece. Clip gradients before ``step()`` as usual (``clip_grad_norm_`` reads the
DTensor gradients on the device). A parameter without a gradient is left as it is (torch's
optimizers skip those), so an fp16 step skipped for overflow skips the host step too.

Get one with ``model.make_optimizer(torch.optim.AdamW, lr=...)`` (a plain optimizer where
the plan offloads nothing).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class OffloadedOptimizer:
    """``cls(params, **kwargs)`` with the optimizer state of ``offloaded`` params on the host."""

    def __init__(self, named_params: Iterable[tuple[str, torch.nn.Parameter]],
                 offloaded: set[str], cls: type[torch.optim.Optimizer], **kwargs: Any) -> None:
        named = list(named_params)
        self.on_device = [p for n, p in named if n not in offloaded and p.requires_grad]
        self.moved = [p for n, p in named if n in offloaded and p.requires_grad]
        # a copy, not a view, even where the device is the host (a CPU run): the same code
        # path as on a GPU (and the same arithmetic: the host step is the device step's)
        self.host = [_to_host(local(p.detach())).requires_grad_(True) for p in self.moved]
        host_kwargs = dict(kwargs)
        if host_kwargs.get("fused") and not _fused_on_cpu(cls):
            host_kwargs.pop("fused")
        self.device_opt = cls(self.on_device, **kwargs) if self.on_device else None
        self.host_opt = cls(self.host, **host_kwargs) if self.host else None

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self._opts() for g in o.param_groups]

    @property
    def state(self) -> dict:
        out: dict = {}
        for o in self._opts():
            out.update(o.state)
        return out

    def _opts(self) -> list[torch.optim.Optimizer]:
        return [o for o in (self.device_opt, self.host_opt) if o is not None]

    @torch.no_grad()
    def step(self) -> None:
        stepped = []
        for p, h in zip(self.moved, self.host):
            h.grad = None if p.grad is None else _to_host(local(p.grad))
            if p.grad is not None:
                stepped.append((p, h))
        if self.device_opt is not None:
            self.device_opt.step()
        if self.host_opt is not None:
            self.host_opt.step()
        for p, h in stepped:
            piece = local(p.data)
            piece.copy_(h.to(piece.device, non_blocking=True))

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self._opts():
            o.zero_grad(set_to_none=set_to_none)
        for p in self.moved:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def state_dict(self) -> dict:
        return {"device": self.device_opt.state_dict() if self.device_opt else None,
                "host": self.host_opt.state_dict() if self.host_opt else None}

    def load_state_dict(self, state: dict) -> None:
        if self.device_opt is not None:
            self.device_opt.load_state_dict(state["device"])
        if self.host_opt is not None:
            self.host_opt.load_state_dict(state["host"])


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of ``t`` (pinned from a GPU, so the copy back runs asynchronously)."""
    out = t.detach().to("cpu", copy=True)
    return out.pin_memory() if t.device.type == "cuda" else out


def _fused_on_cpu(cls: type) -> bool:
    """torch's fused Adam/AdamW/SGD/Adagrad kernels exist on CPU; others' ``fused`` may not."""
    return cls in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)


def make_optimizer(named_params: Iterable[tuple[str, torch.nn.Parameter]], offloaded: set[str],
                   cls: type[torch.optim.Optimizer], **kwargs: Any) -> Any:
    """A plain ``cls`` where nothing is offloaded, an :class:`OffloadedOptimizer` otherwise."""
    named = list(named_params)
    if not offloaded:
        return cls([p for _, p in named], **kwargs)
    return OffloadedOptimizer(named, offloaded, cls, **kwargs)
