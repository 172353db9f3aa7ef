"""``torch.nn.utils.clip_grad_norm_`` on DTensor gradients: the total norm a user reads.

torch's ``clip_grad_norm_`` (and ``get_total_norm``) works on DTensors as it is: one norm per
gradient (``_foreach_norm`` or ``linalg_vector_norm``; a sharded gradient's norm is a partial
value), ``stack``, and the norm of that stack, whose placement DTensor works out. For the
p-norms DTensor reduces the stack at that last norm (one all-reduce of a few bytes) and the
total comes back ``Replicate``: ``float(norm)`` is the single-device norm on every rank. For
``norm_type=inf`` (``-inf``) it keeps the total ``Partial(max)`` (``min``), since a max of maxes
is still one; the clipping itself is right (DTensor reduces it before scaling the gradients),
but ``float(norm)``, ``norm.item()`` and the ``bool`` that ``error_if_nonfinite`` tests read
each rank's own piece: a different norm per rank on a sharded plan, and the error raised on
some ranks only (the others go on to their next collective and hang). :func:`install` adds a
DTensor op handler for ``linalg_vector_norm`` that reduces such a result where it is made: a
0-dim norm of values that are themselves partial (a norm of norms, the total) comes back
``Replicate``, as DTensor returns the p-norms' total. A norm of a sharded tensor (each
gradient's own) stays partial, so the totals still cost one collective.

``f"{norm:.3f}"`` fails on any 0-dim DTensor (torch formats only exact ``Tensor``s as numbers;
a subclass falls to ``object.__format__``), while the same line works on one device. The
install also gives ``DTensor`` a ``__format__`` that formats a replicated 0-dim DTensor as its
value, which every rank holds (no collective); anything else formats as before.
"""

from __future__ import annotations

from typing import Any

import torch

from autopar.runtime import dtensor_handlers
from autopar.runtime.dtensor_handlers import dtensor_dispatch

aten = torch.ops.aten
_NORM_OPS = [aten.linalg_vector_norm.default]


def install() -> bool:
    """Register the norm handler and the DTensor formatting (idempotent; an op that already
    has a handler keeps it). False when this torch's DTensor has no op handler table."""
    from torch.distributed.tensor import DTensor

    if DTensor.__dict__.get("__format__") is None:
        DTensor.__format__ = _format  # type: ignore[method-assign]
    return dtensor_handlers.install(_NORM_OPS, _reduced_total)


def uninstall() -> None:
    from torch.distributed.tensor import DTensor

    if DTensor.__dict__.get("__format__") is _format:
        del DTensor.__format__
    dtensor_handlers.uninstall(_NORM_OPS, _reduced_total)


def installed() -> bool:
    from torch.distributed.tensor import DTensor

    return (DTensor.__dict__.get("__format__") is _format
            and dtensor_handlers.installed(_NORM_OPS, _reduced_total))


def _reduced_total(op: Any, args: tuple, kwargs: dict) -> Any:
    """DTensor's dispatch of the norm; a 0-dim result of a partial input, reduced."""
    out = dtensor_dispatch(op, args, kwargs)
    spec = getattr(args[0], "_spec", None) if args else None
    if (out.dim() == 0 and spec is not None and _partial(spec.placements)
            and _partial(out.placements)):
        from torch.distributed.tensor import Replicate

        out = out.redistribute(out.device_mesh, [Replicate()] * out.device_mesh.ndim)
    return out


def _partial(placements: tuple) -> bool:
    return any(p.is_partial() for p in placements)


def _format(self: Any, spec: str) -> str:
    """A replicated 0-dim DTensor formats as its value, as a plain 0-dim tensor does."""
    if self.dim() == 0 and all(p.is_replicate() for p in self.placements):
        return format(self._local_tensor.detach().item(), spec)
    return torch.Tensor.__format__(self, spec)
