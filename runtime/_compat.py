"""The runtime's private-torch adapters: functional collectives and LocalTensorMode hooks.

Same policy as :mod:`autopar.capture._torch_compat` (one small function per private API, exercised by
``tests/runtime/test_lower_local.py`` so a torch release that changes one fails loudly there).
Kept beside the runtime so the planner never imports torch.distributed.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed._functional_collectives as _fc

# torch 2.13 renamed all_gather_tensor / reduce_scatter_tensor to *_single (in the functional
# collectives and in torch.distributed) and deprecated the old names (they warn on every call);
# 2.11 only has the old ones.
_all_gather = getattr(_fc, "all_gather_single", None) or _fc.all_gather_tensor
_reduce_scatter = getattr(_fc, "reduce_scatter_single", None) or _fc.reduce_scatter_tensor
_dist_reduce_scatter = (getattr(torch.distributed, "reduce_scatter_single", None)
                        or torch.distributed.reduce_scatter_tensor)


def wait(t: torch.Tensor) -> torch.Tensor:
    """The plain result of a collective issued with ``sync=False`` (identity on others)."""
    if isinstance(t, _fc.AsyncCollectiveTensor):
        return t.wait()
    return t


# Each collective returns an AsyncCollectiveTensor, which waits lazily on first use. By default
# the runtime waits at once, since it hands results straight to kernels and into saved state
# and keeps plain tensors everywhere; ``sync=False`` leaves the collective running (gradient
# syncs overlapped with the backward) and the result to :func:`wait`, or to the first op on it.


def all_gather(t: torch.Tensor, dim: int, group: Any, sync: bool = True) -> torch.Tensor:
    out = _all_gather(t.contiguous(), dim, group)
    return wait(out) if sync else out


def all_reduce(t: torch.Tensor, op: str, group: Any, sync: bool = True) -> torch.Tensor:
    out = _fc.all_reduce(t.contiguous(), op, group)
    return wait(out) if sync else out


def reduce_scatter(t: torch.Tensor, op: str, dim: int, group: Any,
                   sync: bool = True) -> torch.Tensor:
    out = _reduce_scatter(t.contiguous(), op, dim, group)
    return wait(out) if sync else out


def start_all_reduce(t: torch.Tensor, pg: Any) -> Any:
    """Sum ``t`` in place over process group ``pg`` without waiting; the work to wait on.
    The c10d op, not the functional one: that one copies its input first."""
    import torch.distributed as dist

    return dist.all_reduce(t, group=pg, async_op=True)


def start_reduce_scatter(t: torch.Tensor, pg: Any) -> tuple[torch.Tensor, Any]:
    """Row ``r`` of ``t`` summed over ``pg`` lands on its rank ``r``, without waiting."""
    out = t.new_empty((1, *t.shape[1:]))
    return out[0], _dist_reduce_scatter(out, t, group=pg, async_op=True)


def all_to_all(t: torch.Tensor, group: Any) -> torch.Tensor:
    """Equal split along dim 0: row block ``j`` goes to rank ``j`` of the group."""
    return wait(_fc.all_to_all_single(t.contiguous(), None, None, group))


def local_of(d: Any) -> torch.Tensor:
    """A DTensor's local piece, without ``to_local``'s autograd node and checks (the runtime
    reads every parameter on every call; its own autograd Function carries the gradients)."""
    local = getattr(d, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else d.to_local()


def dtensor_like(ref: Any, local: torch.Tensor) -> Any:
    """A DTensor placed as ``ref`` (same mesh, placements, global shape and stride) holding
    ``local``, without ``from_local``'s autograd node and a new spec for every gradient."""
    spec = getattr(ref, "_spec", None)
    if spec is not None and _DTENSOR_NEW is not None:
        return _DTENSOR_NEW(_DTENSOR, local, spec, requires_grad=False)
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, ref.device_mesh, ref.placements, run_check=False,
                              shape=ref.shape, stride=ref.stride())


def _dtensor_constructor() -> tuple[Any, Any]:
    """(DTensor, its ``__new__``): a DTensor is made by ``__new__(cls, local, spec,
    requires_grad=...)``; its ``__init__`` does nothing. torch 2.13 makes it in C++ and wraps
    the empty ``__init__`` in two Python decorators that cost more than the construction
    (``DTensor(...)`` about 2 us, ``__new__`` alone 0.8 us). ``tests/runtime/
    test_fused_optim.py`` checks the result against ``DTensor(...)``. (None, None) where
    DTensor cannot be imported (``from_local`` is used then)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return None, None
    new = DTensor.__dict__.get("__new__")
    new = getattr(new, "__func__", new)
    if new is None:  # pragma: no cover
        return None, None
    return DTensor, new


_DTENSOR, _DTENSOR_NEW = _dtensor_constructor()


def local_tensor_mode_active() -> bool:
    """True inside ``LocalTensorMode`` (single-process simulation of all ranks)."""
    try:
        from torch.distributed._local_tensor import local_tensor_mode
    except ImportError:  # pragma: no cover - torch without LocalTensorMode
        return False
    return local_tensor_mode() is not None


def outside_local_tensor_mode() -> contextlib.AbstractContextManager:
    """Suspend LocalTensorMode (tracing and planning run on fake tensors, once, for all ranks)."""
    try:
        from torch.distributed._local_tensor import maybe_disable_local_tensor_mode
    except ImportError:  # pragma: no cover
        return contextlib.nullcontext()
    return maybe_disable_local_tensor_mode()


def as_local(t: torch.Tensor) -> torch.Tensor:
    """Under LocalTensorMode, a plain tensor (made outside it) as one LocalTensor holding it on
    every rank: ops that take a per-rank symbolic offset (slicing by coordinate) need that."""
    from torch.distributed._local_tensor import LocalTensor, local_tensor_mode

    mode = local_tensor_mode()
    if mode is None or isinstance(t, LocalTensor):
        return t
    # one copy per rank: an in-place update (the optimizer's) must not hit shared storage
    return mode.rank_map(lambda r: t.clone())


def reconcile(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a LocalTensor whose ranks agree (identity on plain tensors)."""
    from torch.distributed._local_tensor import LocalTensor

    if isinstance(t, LocalTensor):
        return t.reconcile()
    return t
