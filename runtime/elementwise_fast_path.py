"""Elementwise ops on DTensors placed alike, run straight on the local pieces.

An optimizer's for-loop implementation (torch's default on CPU) updates DTensor parameters op
by op: AdamW runs 8 elementwise ops per parameter (``mul_``, ``lerp_``, ``addcmul_``,
``sqrt``, ``div``, ``add_``, ``addcdiv_``). Each call on a DTensor takes DTensor's dispatch:
sharding propagation (cached), then a Python tail. For the 8 parameters of the benchmark MLP,
one process, AdamW's for-loop step took 1.6-1.7x the plain-tensor step on DTensors, and
1.3-1.4x with the handler below (``benchmarks/runtime_vs_torch.py``, both in each run).

The ``_foreach_*`` ops of the foreach implementation (the default on CUDA; about 10 calls a
step, each over every parameter) are left to DTensor: its dispatch of a whole list is
already cheap, and a handler walking the lists in Python measured no faster (1.17x the plain
step without it, 1.20x with it).

Where every DTensor argument is placed exactly as the first one (same mesh, placements and
global shape), or is a 0-dim replicated scalar, and nothing is a ``Partial`` sum, DTensor's
dispatch redistributes nothing: it runs the op on the local pieces and places the result as
the first argument. :func:`install` registers a DTensor op handler that checks just that and
does it itself. Anything else (a plain tensor among the arguments, other placements, a
broadcast, a ``Partial``) goes to DTensor's own dispatch, exactly as if the handler were not
there.

The handlers are process-wide and stay installed, like :mod:`.fused_optim`'s: where DTensor's
dispatch gives a result, they give the same. ``tests/runtime/test_elementwise_fast_path.py``
checks every covered op bit for bit against DTensor's own dispatch, and that the fallbacks
are taken.
"""

from __future__ import annotations

from typing import Any

import torch

from autopar.runtime import _compat, dtensor_handlers
from autopar.runtime.dtensor_handlers import dtensor_dispatch, placed_as

aten = torch.ops.aten

# op packets covered, each with its in-place ``name_`` form where torch has one
_ELEMENTWISE = ("add", "sub", "mul", "div", "addcmul", "addcdiv", "lerp", "sqrt", "rsqrt",
                "neg", "abs", "sign", "exp", "reciprocal", "maximum", "minimum", "clamp",
                "clamp_min", "clamp_max", "pow", "copy_", "zero_", "fill_")
_INPLACE: dict[Any, bool] = {}  # op -> whether it writes its self (add_, copy_: returns it)


def elementwise_ops() -> list[Any]:
    """Every overload this torch has of the ops the handler covers."""
    names = []
    for base in _ELEMENTWISE:
        names += [base] if base.endswith("_") else [base, base + "_"]
    ops = []
    for name in names:
        packet = getattr(aten, name, None)
        if packet is None:
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)
            if "out" in overload or not _on_tensors(op):
                continue  # out= variants (the out tensor is placed by the caller), and
            ops.append(op)  # TorchScript's overloads on numbers, strings and lists
    return ops


def _on_tensors(op: Any) -> bool:
    """The op's first argument is a tensor (where a DTensor can be)."""
    args = op._schema.arguments
    return bool(args) and isinstance(args[0].type, torch._C.TensorType)


def install() -> bool:
    """Register the local fast path for every covered op (idempotent; an op that already has
    a handler, DTensor's own or another's, keeps it). False when this torch's DTensor has no
    op handler table."""
    return dtensor_handlers.install(elementwise_ops(), _on_locals)


def uninstall() -> None:
    """Remove the handlers :func:`install` registered."""
    dtensor_handlers.uninstall(elementwise_ops(), _on_locals)


def installed() -> bool:
    return dtensor_handlers.installed(elementwise_ops(), _on_locals)


class _NotLocal(Exception):
    """The call is not one the local pieces can run: DTensor's dispatch takes it."""


def _on_locals(op: Any, args: tuple, kwargs: dict) -> Any:
    """DTensor's op handler: the op on the local pieces where that is what DTensor's dispatch
    would run, DTensor's dispatch otherwise."""
    try:
        return _local_call(op, args, kwargs)
    except _NotLocal:
        return dtensor_dispatch(op, args, kwargs)


def _local_call(op: Any, args: tuple, kwargs: dict) -> Any:
    """The op run on the local pieces, its result placed as DTensor places it. Raises
    :class:`_NotLocal` where that is not what DTensor would do: before the op runs where it
    writes its arguments (an out-of-place result may still be turned down after it ran)."""
    inplace = _INPLACE.get(op)
    if inplace is None:
        inplace = _INPLACE[op] = op._schema.name.endswith("_")
    lead = args[0] if args else None
    spec = _lead_spec(lead)
    # the lead itself, and autopar's gradients, hold the very spec object
    local_args = [a._local_tensor if getattr(a, "_spec", None) is spec
                  else _local_for(a, spec) for a in args]
    out = op(*local_args, **{k: _local_for(v, spec) for k, v in kwargs.items()})
    return lead if inplace else _placed_result(out, lead)


def _lead_spec(t: Any) -> Any:
    """The spec every other argument is checked against: a DTensor's, never a ``Partial``."""
    spec = getattr(t, "_spec", None)
    if spec is None or any(p.is_partial() for p in spec.placements):
        raise _NotLocal
    return spec


def _local_for(a: Any, spec: Any) -> Any:
    """Argument ``a`` of an op whose first argument has ``spec``, as the local op takes it."""
    if isinstance(a, torch.Tensor):
        if getattr(a, "_spec", None) is None:
            raise _NotLocal  # a plain tensor beside DTensors: DTensor's rules decide
        if placed_as(a, spec) or _replicated_scalar(a):
            return a._local_tensor
        raise _NotLocal
    return a


def _replicated_scalar(t: Any) -> bool:
    """A 0-dim DTensor whose local piece is its whole value on every rank."""
    return t.dim() == 0 and all(p.is_replicate() for p in t._spec.placements)


def _placed_result(out: torch.Tensor, lead: Any) -> Any:
    """An out-of-place result placed as ``lead``: DTensor's placement for it, whose global
    stride is ``lead``'s where the local layout is. Otherwise (a layout the op changed, which
    an elementwise op on a dense piece does not) DTensor works it out, from the start."""
    local = lead._local_tensor
    if out.stride() != local.stride() or out.shape != local.shape:
        raise _NotLocal
    if out.dtype == local.dtype:
        return _compat.dtensor_like(lead, out)
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    spec = lead._spec
    meta = TensorMeta(spec.shape, spec.stride, out.dtype)
    return DTensor(out, DTensorSpec(spec.mesh, spec.placements, meta), requires_grad=False)

