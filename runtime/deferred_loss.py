"""The loss handed back while its all-reduce is still running.

``parallelize``'s module returns the loss whole on every rank (the single-device value), so a
data-parallel step all-reduces it. Waiting for that collective at the end of the forward
would be a synchronisation point DDP does not have (DDP returns each rank's own loss): every
rank would stop there until the slowest one finished its forward. Yet nothing in the step
needs the value: the backward starts from ``ones_like(loss)``, which needs only its shape.

So every rank issues the loss's all-reduce at the end of the forward, at the same point of
the program whatever the user does with the result, and waits for it only when the value is
read (or at the end of the backward, by which time it is done). Reading the loss on some
ranks only (``if rank == 0: print(loss.item())``) is safe: no rank issues anything the others
do not.

:class:`DeferredLoss` is the loss as a tensor subclass holding that pending value.
``ones_like`` / ``zeros_like`` / ``empty_like`` / ``full_like`` (what ``loss.backward()``
calls) answer from the metadata alone, and so does scaling it by a number (``loss / 4`` for
gradient accumulation gives another deferred loss); any other op on it (``loss.item()``,
``float(loss)``, ``f"{loss:.3f}"``, ``print``, ``loss + aux``, ``loss.detach()``) waits for the
value first and runs on it, so to the user it behaves as the plain loss.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map

from autopar.runtime import _compat

_SHAPE_ONLY = (torch.ops.aten.ones_like.default, torch.ops.aten.zeros_like.default,
               torch.ops.aten.empty_like.default, torch.ops.aten.full_like.default)
# scaling the loss by a number keeps it deferred: its gradient does not need its value
_SCALINGS = (torch.ops.aten.mul.Tensor, torch.ops.aten.mul.Scalar, torch.ops.aten.div.Tensor,
             torch.ops.aten.div.Scalar)


class LossValue:
    """The whole loss: a collective's pending result, waited for on first use (``work``: the
    c10d work of a collective reducing ``pending`` in place; else ``pending`` waits itself)."""

    def __init__(self, pending: torch.Tensor, work: Any = None) -> None:
        self._value = pending
        self._work = work

    @property
    def like(self) -> torch.Tensor:
        """A tensor with the whole loss's metadata."""
        return self._value

    def resolve(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        self._value = _compat.wait(self._value)
        return self._value


class DerivedValue:
    """``op(loss, number)`` for a loss not yet waited for, worked out when read."""

    def __init__(self, parent: LossValue | DerivedValue, op: Any, rest: tuple) -> None:
        self.parent, self.op, self.rest = parent, op, rest
        self._value: torch.Tensor | None = None

    @property
    def like(self) -> torch.Tensor:
        return self.parent.like

    def resolve(self) -> torch.Tensor:
        if self._value is None:
            self._value = self.op(self.parent.resolve(), *self.rest)
        return self._value


class DeferredLoss(torch.Tensor):
    """The loss, waited for on first use; see the module docstring."""

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

    def __format__(self, spec: str) -> str:  # f"{loss:.3f}", as a plain 0-dim tensor allows
        value = self._held.resolve().detach()
        return format(value.item() if value.dim() == 0 else value, spec)

    def __deepcopy__(self, memo: dict) -> torch.Tensor:  # a copy holds the plain value
        return self._held.resolve().detach().clone()

    def __reduce_ex__(self, protocol: Any) -> Any:  # torch.save / pickle get the plain value
        return self._held.resolve().detach().__reduce_ex__(protocol)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _SHAPE_ONLY:  # loss.backward()'s seed: the shape is enough, do not wait
            d = args[0]
            blank = torch.empty(d.shape, dtype=d.dtype, device=d.device)
            return func(blank, *args[1:], **kwargs)
        if (func in _SCALINGS and len(args) == 2 and isinstance(args[0], DeferredLoss)
                and isinstance(args[1], (int, float)) and not kwargs):
            return DeferredLoss(DerivedValue(args[0]._held, func, args[1:]))

        def plain(a: Any) -> Any:
            return a._held.resolve() if isinstance(a, DeferredLoss) else a

        target = args[0] if args else None
        if func._schema.is_mutable and isinstance(target, DeferredLoss):
            # in place on the loss (loss /= n): work on a copy and hold that from now on, so
            # that values derived from the loss before keep theirs
            value = plain(target).clone()
            func(value, *tree_map(plain, args[1:]), **tree_map(plain, kwargs))
            if value.shape != target.shape or value.dtype != target.dtype:
                raise RuntimeError(
                    f"{func} would change the loss's shape or dtype in place; apply it to "
                    "loss.detach() (a plain tensor) instead")
            target._held = LossValue(value)
            return target
        return func(*tree_map(plain, args), **tree_map(plain, kwargs))
