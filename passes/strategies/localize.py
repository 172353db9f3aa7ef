"""Running an op on local shards: what each rank calls once its inputs are placed.

Most ops are SPMD as they are: each rank calls the same op on its shards. Two things break that
and are registered here by the rule modules:

- *localizers* rewrite non-tensor arguments that name global sizes (``view(x, [B, S, H])``
  becomes ``view(x, [B/2, S, H])`` when the batch is split in two). One function per op. A
  *static* one reads only the context and the non-tensor arguments and leaves the tensors in
  place, so the runtime may localize once per program rather than once per call.
- *special impls* replace the op with a rank-aware kernel, named by ``Rule.impl`` (e.g. a
  vocab-parallel embedding masks the ids outside the rank's vocabulary range).

The runtime's lowering and the rule validator (``simulate.py``) both go through
:func:`local_call`, so a rule that validates is a rule that runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from autopar.passes.strategies.registry import OpInfo, Strategy


@dataclass(frozen=True, slots=True)
class LocalContext:
    """Where this rank sits and what layout the op runs under."""

    info: OpInfo  # global metadata of the op (full shapes)
    strategy: Strategy
    mesh_shape: tuple[int, ...]
    coord: tuple[int, ...]  # this rank's index on every mesh axis


Localizer = Callable[[LocalContext, tuple, dict], tuple[tuple, dict]]
SpecialImpl = Callable[[LocalContext, tuple, dict], Any]

_LOCALIZERS: dict[Any, Localizer] = {}
_STATIC: set[Localizer] = set()  # localizers that read no tensor (see the module docstring)
_IMPLS: dict[str, SpecialImpl] = {}
Finisher = Callable[[LocalContext, Any], Any]
_FINISHERS: dict[str, Finisher] = {}


def register_localizer(*ops: Any, static: bool = False) -> Callable[[Localizer], Localizer]:
    def deco(fn: Localizer) -> Localizer:
        for op in ops:
            _LOCALIZERS[op] = fn
        if static:
            _STATIC.add(fn)
        return fn

    return deco


def register_impl(name: str) -> Callable[[SpecialImpl], SpecialImpl]:
    def deco(fn: SpecialImpl) -> SpecialImpl:
        _IMPLS[name] = fn
        return fn

    return deco


def register_finish(name: str) -> Callable[[Finisher], Finisher]:
    """The second half of impl ``name``, run on its outputs once the strategy's in-op
    all-reduces made them ``strategy.outs`` (an op that needs a reduced value to finish)."""
    def deco(fn: Finisher) -> Finisher:
        _FINISHERS[name] = fn
        return fn

    return deco


def _finisher(strategy: Strategy) -> Finisher | None:
    """The finisher of the impl that runs (the first named, as in :func:`local_call`)."""
    impl = next((i for i in strategy.impls if i), None)
    return _FINISHERS.get(impl) if impl is not None else None


def has_finish(strategy: Strategy) -> bool:
    return _finisher(strategy) is not None


def finish_call(out: Any, ctx: LocalContext) -> Any:
    """``out`` finished by its impl's finisher, if it has one."""
    fn = _finisher(ctx.strategy)
    return out if fn is None else fn(ctx, out)


def localizer_for(target: Any) -> Localizer | None:
    from autopar.passes.strategies.registry import _load_rule_modules

    _load_rule_modules()  # the rule modules register the localizers
    fn = _LOCALIZERS.get(target)
    if fn is None and hasattr(target, "overloadpacket"):
        fn = _LOCALIZERS.get(target.overloadpacket)
    return fn


def is_static(fn: Localizer) -> bool:
    """Whether ``fn`` reads only the context and the non-tensor arguments."""
    return fn in _STATIC


def local_call(target: Any, args: tuple, kwargs: dict, ctx: LocalContext) -> Any:
    """Run ``target`` on this rank's local inputs (already placed as ``ctx.strategy.ins``)."""
    from autopar.passes.strategies.registry import _load_rule_modules

    _load_rule_modules()
    impl = next((i for i in ctx.strategy.impls if i), None)
    if impl is not None:
        return _IMPLS[impl](ctx, args, kwargs)
    fn = localizer_for(target)
    if fn is not None:
        args, kwargs = fn(ctx, args, kwargs)
    return target(*args, **kwargs)


def local_size(ctx: LocalContext, size: int, out_index: int, dim: int) -> int:
    """The local extent of output ``out_index``'s ``dim`` whose global extent is ``size``."""
    spec = ctx.strategy.outs[out_index]
    f = 1
    for p, n in zip(spec, ctx.mesh_shape):
        if getattr(p, "dim", None) == dim:
            f *= n
    return size // f
