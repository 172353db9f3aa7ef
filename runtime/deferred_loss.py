"""The loss handed back before it is reduced.

``parallelize``'s module returns the loss whole on every rank, so a data-parallel step must
all-reduce it. Doing so at the end of the forward, and waiting, would add a collective and a
synchronisation point that DDP does not have (DDP returns each rank's own loss): every rank
would stop until the slowest one finished its forward. Yet nothing in the step needs the
value: the backward starts from ``ones_like(loss)``, which needs only its shape.

So the loss is reduced when it is first needed:

- in the backward, at the end of the first gradient bucket that reduces over its axes
  (:func:`autopar.passes.buckets.loss_bucket`; the plan prices it there), at no collective of
  its own;
- where no bucket takes it, by its own collective, issued at the end of the forward and waited
  for only when the value is read;
- when read before the backward (``print(loss.item())`` first), by its own collective then.

:class:`DeferredLoss` is the loss as a tensor subclass holding a :class:`LossValue`.
``ones_like`` / ``zeros_like`` / ``empty_like`` / ``full_like`` (what ``loss.backward()``
calls) answer from the metadata alone, and so does scaling it by a number (``loss / 4`` for
gradient accumulation gives another deferred loss); any other op on it (``loss.item()``,
``float(loss)``, ``print``, ``loss + aux``, ``loss.detach()``) reduces it first and runs on the
plain value, so to the user it behaves as the plain loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_map

from autopar.runtime import _compat

_SHAPE_ONLY = (torch.ops.aten.ones_like.default, torch.ops.aten.zeros_like.default,
               torch.ops.aten.empty_like.default, torch.ops.aten.full_like.default)


class LossValue:
    """One step's loss: this rank's local value and how it becomes whole on every rank."""

    def __init__(self, local: torch.Tensor, reduce: Callable[[torch.Tensor], torch.Tensor],
                 in_bucket: bool) -> None:
        """``reduce``: issues the loss's own collective, returns its (pending) result;
        ``in_bucket``: a gradient bucket will carry it, so nothing is issued now."""
        self.local = local
        self._reduce = reduce
        self._value: torch.Tensor | None = None if in_bucket else reduce(local)

    @property
    def like(self) -> torch.Tensor:
        """A tensor with the whole loss's metadata."""
        return self.local if self._value is None else self._value

    def take(self) -> torch.Tensor | None:
        """The local value for a gradient bucket to reduce, or None if it is reduced already."""
        return self.local if self._value is None else None

    def fulfil(self, whole: torch.Tensor) -> None:
        """The bucket's result (waited for)."""
        self._value = whole

    def resolve(self) -> torch.Tensor:
        """The whole loss, reducing it now if nothing has yet."""
        if self._value is None:
            self._value = self._reduce(self.local)
        self._value = _compat.wait(self._value)
        return self._value


class DerivedValue:
    """``op(loss, number)`` for a loss not yet reduced (``loss / accumulation_steps``), worked
    out when read; the loss itself still rides in its bucket."""

    def __init__(self, parent: LossValue | DerivedValue, op: Any, rest: tuple,
                 kwargs: dict) -> None:
        self.parent, self.op, self.rest, self.kwargs = parent, op, rest, kwargs
        self._value: torch.Tensor | None = None

    @property
    def like(self) -> torch.Tensor:
        return self.parent.like

    def resolve(self) -> torch.Tensor:
        if self._value is None:
            self._value = self.op(self.parent.resolve(), *self.rest, **self.kwargs)
        return self._value


# scaling the loss by a number keeps it deferred: its gradient does not need its value
_SCALINGS = (torch.ops.aten.mul.Tensor, torch.ops.aten.mul.Scalar, torch.ops.aten.div.Tensor,
             torch.ops.aten.div.Scalar)


class DeferredLoss(torch.Tensor):
    """The loss, reduced on first use; see the module docstring."""

    _held: LossValue | DerivedValue

    @staticmethod
    def __new__(cls, held: LossValue | DerivedValue) -> DeferredLoss:
        like = held.like
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, like.shape, strides=like.stride(), dtype=like.dtype, device=like.device)

    def __init__(self, held: LossValue | DerivedValue) -> None:
        self._held = held

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        text = repr(self._held.resolve())
        if self.grad_fn is not None:
            return f"{text[:-1]}, grad_fn=<{type(self.grad_fn).__name__}>)"
        return text

    def __reduce_ex__(self, protocol: Any) -> Any:  # torch.save / pickle get the plain value
        return self._held.resolve().detach().__reduce_ex__(protocol)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _SHAPE_ONLY:  # loss.backward()'s seed: the shape is enough, do not reduce
            d = args[0]
            blank = torch.empty(d.shape, dtype=d.dtype, device=d.device)
            return func(blank, *args[1:], **kwargs)
        if (func in _SCALINGS and len(args) == 2 and isinstance(args[0], DeferredLoss)
                and isinstance(args[1], (int, float)) and not kwargs):
            return DeferredLoss(DerivedValue(args[0]._held, func, args[1:], kwargs))

        def plain(a: Any) -> Any:
            return a._held.resolve() if isinstance(a, DeferredLoss) else a

        out = func(*tree_map(plain, args), **tree_map(plain, kwargs))
        if func._schema.is_mutable and args and isinstance(args[0], DeferredLoss):
            return args[0]  # an in-place op (loss /= n) changed the held value; keep the wrapper
        return out
