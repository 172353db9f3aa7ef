"""Mixed precision: which dtype every op of the traced step computes in.

A :class:`Precision` is a plan property: ``fp32``; ``bf16`` (parameters kept in fp32 as the
master copy the optimizer steps, cast to bf16 where the step reads them; matmuls, attention
and everything downstream in bf16; softmax, norms and the loss computed in fp32; gradients
leave the graph in fp32, reduced in ``reduce_dtype``); ``fp16`` (the same in fp16, with
dynamic loss scaling at run time, :mod:`autopar.runtime.optim.loss_scale`).

The policy is applied while the step is traced (:func:`policy`), so the casts are ATen ops of
the captured joint graph and everything after reads them: the cost model prices each op in
its dtype (bf16 matmul rates, halved activation bytes) and the casts themselves, the memory
model holds the bf16 copies, the runtime runs them. Tracing under the policy, rather than
rewriting the traced graph afterwards, lets autograd place the backward's casts (the gradient
of a cast is the reverse cast), which a rewrite would have to re-derive op by op.

- Parameters: each floating parameter is cast once, at the start of the step (a node tagged
  ``param_cast``, which capture gives the layer of the ops reading it). A sharded parameter is
  cast before it is gathered, so the gather moves half the bytes, as FSDP's mixed precision
  does.
- Ops that must accumulate in fp32 (:data:`UPCAST`): their low-precision inputs are cast to
  fp32; softmax and norms cast their result back to the input's dtype (the next op reads it
  in the compute dtype, and a saved activation stays half size), the losses keep fp32.
- Matmul-like ops (:data:`DOWNCAST`): fp32 operands (an fp32 user input, an fp32 buffer) are
  cast to the compute dtype, as autocast does, so a matmul never mixes dtypes.
- The loss is returned in fp32.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from autopar.ir.precision import Precision

# --- the policy while tracing ---------------------------------------------------------------

_NORMS = (F.layer_norm, F.group_norm, F.instance_norm, F.batch_norm, F.normalize,
          *((F.rms_norm,) if hasattr(F, "rms_norm") else ()))
_SOFTMAX = (F.softmax, F.log_softmax, torch.softmax, torch.log_softmax,
            torch.Tensor.softmax, torch.Tensor.log_softmax)
_LOSSES = (F.cross_entropy, F.nll_loss, F.mse_loss, F.l1_loss, F.smooth_l1_loss,
           F.huber_loss, F.binary_cross_entropy, F.binary_cross_entropy_with_logits,
           F.kl_div)
# results cast back to the input's dtype / kept in fp32
UPCAST = frozenset(_NORMS + _SOFTMAX) | frozenset(_LOSSES)
_KEEP_FP32 = frozenset(_LOSSES)
DOWNCAST = frozenset((
    F.linear, F.bilinear, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d,
    F.conv_transpose3d, F.scaled_dot_product_attention, torch.matmul, torch.mm, torch.bmm,
    torch.addmm, torch.baddbmm, torch.addbmm, torch.einsum, torch.tensordot,
    torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__, torch.Tensor.mm,
    torch.Tensor.bmm,
))


def _cast(x: Any, frm: frozenset[torch.dtype], to: torch.dtype) -> Any:
    return x.to(to) if isinstance(x, torch.Tensor) and x.dtype in frm else x


class _PolicyMode(TorchFunctionMode):
    """Casts around the ops of :data:`UPCAST` and :data:`DOWNCAST` (see the module doc)."""

    def __init__(self, low: torch.dtype) -> None:
        super().__init__()
        self.low = low

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if func in UPCAST:
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            args, kwargs = tree_map(lambda x: _cast(x, frozenset({self.low}), torch.float32),
                                    (args, kwargs))
            out = func(*args, **kwargs)
            if func not in _KEEP_FP32 and first is not None and first.dtype == self.low:
                out = tree_map(lambda x: _cast(x, frozenset({torch.float32}), self.low), out)
            return out
        if func in DOWNCAST:
            args, kwargs = tree_map(lambda x: _cast(x, frozenset({torch.float32}), self.low),
                                    (args, kwargs))
        return func(*args, **kwargs)


@contextlib.contextmanager
def policy(precision: Precision) -> Iterator[None]:
    """The op-level policy for the forward being traced (a no-op for fp32)."""
    if not precision.mixed:
        yield
        return
    with _PolicyMode(precision.compute_dtype):
        yield


def cast_params(params: dict[str, torch.Tensor], precision: Precision) -> dict[str, torch.Tensor]:
    """Each floating parameter in the compute dtype, for the step to read (the fp32 one stays
    the optimizer's); capture tags these casts ``param_cast``."""
    if not precision.mixed:
        return params
    low = precision.compute_dtype
    return {n: p.to(low) if p.is_floating_point() and p.dtype != low else p
            for n, p in params.items()}
