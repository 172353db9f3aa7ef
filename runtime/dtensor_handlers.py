"""DTensor's table of op handlers, as autopar's local fast paths use it.

DTensor looks an op up in ``DTensor._op_dispatcher._custom_op_handlers`` before its own
sharding propagation; a handler there gets ``(op, args, kwargs)`` and returns the op's result.
:mod:`.fused_optim` and :mod:`.elementwise_fast_path` register handlers that run an op on
the local pieces where that is exactly what DTensor's dispatch would do, and hand every other
call back to it (:func:`dtensor_dispatch`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

Handler = Callable[[Any, tuple, dict], Any]


def handler_table() -> dict | None:
    """DTensor's op handler table; None for a torch whose DTensor has none."""
    from torch.distributed.tensor import DTensor

    return getattr(DTensor._op_dispatcher, "_custom_op_handlers", None)


def install(ops: Iterable[Any], handler: Handler) -> bool:
    """Register ``handler`` for ``ops`` (idempotent; an op that already has a handler, DTensor's
    own or another's, keeps it). False when there is no table (DTensor's dispatch runs)."""
    table = handler_table()
    if table is None:  # pragma: no cover - a torch without custom op handlers
        return False
    for op in ops:
        table.setdefault(op, handler)
    return True


def uninstall(ops: Iterable[Any], handler: Handler) -> None:
    """Remove ``handler`` where :func:`install` registered it for ``ops``."""
    table = handler_table()
    for op in ops:
        if table is not None and table.get(op) is handler:
            del table[op]


def installed(ops: Iterable[Any], handler: Handler) -> bool:
    table = handler_table()
    return bool(table) and all(table.get(op) is handler for op in ops)


def placed_as(t: Any, spec: Any) -> bool:
    """``t`` is split across ranks exactly as the tensor of ``spec`` (plain with plain)."""
    other = getattr(t, "_spec", None)
    if spec is None or other is None:
        return spec is None and other is None and isinstance(t, torch.Tensor)
    if other is spec:  # autopar's gradients share their parameter's spec
        return True
    return (other.placements == spec.placements and other.shape == spec.shape
            and (other.mesh is spec.mesh or other.mesh == spec.mesh))


def dtensor_dispatch(op: Any, args: tuple, kwargs: dict) -> Any:
    """DTensor's own dispatch of the call, with the op's handler out of the way for it (the
    way torch's ``loss_parallel`` swaps its handlers in and out; as there, another thread's
    call of the op meanwhile takes DTensor's dispatch too, which gives the same result)."""
    table = handler_table()
    assert table is not None
    mine = table.pop(op, None)
    try:
        return op(*args, **kwargs)
    finally:
        if mine is not None:
            table[op] = mine
