"""Reductions, softmax-style ops along a dim, scans and sorts.

A dim that is not reduced may be sharded freely (the output keeps that shard, at the dim's new
position when ``keepdim`` is false). A reduced dim may be sharded when the reduction combines
partial results with a Partial's reduce op:

- ``sum``  -> ``P(sum)``; ``mean`` -> ``P(sum)`` through the ``mean_global`` impl, which divides
  each rank's local sum by the *global* count (a local mean would be off by the shard factor);
- ``amax``/``max()`` -> ``P(max)``, ``amin``/``min()`` -> ``P(min)``;
- anything else (var, logsumexp, argmax, sort, softmax over the dim...) needs the whole dim.

Linear reductions also pass a ``P(sum)`` input straight through (sum, mean, cumsum), and
max-reductions pass ``P(max)`` through. The softmax backward ops are linear in
``grad_output``: ``(P, R) -> P``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from autopar.ir.placements import Partial, R, Shard
from autopar.passes.strategies._common import (
    PMAX,
    PMIN,
    PSUM,
    dedupe,
    norm_dim,
    norm_dims,
    outs_for,
    reduced_out_dim,
    shardable_dims,
)
from autopar.passes.strategies.localize import LocalContext, register_impl
from autopar.passes.strategies.registry import OpInfo, Rule, register

aten = torch.ops.aten


def reduce_rules(
    info: OpInfo,
    dims: Sequence[int],
    keepdim: bool,
    combine: Partial | None = None,
    impl: str | None = None,
    passthrough: Sequence[Partial] = (),
) -> list[Rule]:
    """Rules for a reduction of ``info.inputs[0]`` over ``dims`` (all other tensor inputs R).

    ``combine``: the Partial that a shard of a reduced dim turns into (``None``: not allowed).
    ``passthrough``: Partials of the input that give the same Partial out (linear/monotone)."""
    x = info.inputs[0]
    others = len(info.inputs) - 1
    rules = []
    for d in shardable_dims(x.shape):
        ins = (Shard(d),) + (R,) * others
        if d in dims:
            if combine is not None:
                rules.append(Rule(ins, outs_for(info, combine), impl))
        else:
            rules.append(Rule(ins, outs_for(info, Shard(reduced_out_dim(d, dims, keepdim)))))
    for p in passthrough:
        rules.append(Rule((p,) + (R,) * others, outs_for(info, p)))
    return dedupe(rules)


def _dims(info: OpInfo, pos: int = 1, name: str = "dim") -> tuple[int, ...]:
    return norm_dims(info.arg(pos, name), len(info.inputs[0].shape))


def _all(info: OpInfo) -> tuple[int, ...]:
    return tuple(range(len(info.inputs[0].shape)))


def _keep(info: OpInfo, pos: int = 2) -> bool:
    return bool(info.arg(pos, "keepdim", False))


@register(aten.sum.dim_IntList, aten.sum.default, aten.nansum.default)
def sum_rule(info: OpInfo) -> list[Rule]:
    if info.target is aten.sum.default:
        return reduce_rules(info, _all(info), False, PSUM, passthrough=[PSUM])
    return reduce_rules(info, _dims(info), _keep(info), PSUM, passthrough=[PSUM])


@register(aten.mean.dim, aten.mean.default)
def mean_rule(info: OpInfo) -> list[Rule]:
    if info.target is aten.mean.default:
        return reduce_rules(info, _all(info), False, PSUM, "mean_global", [PSUM])
    return reduce_rules(info, _dims(info), _keep(info), PSUM, "mean_global", [PSUM])


@register_impl("mean_global")
def mean_global(ctx: LocalContext, args: tuple, kwargs: dict) -> torch.Tensor:
    """Local sum over the reduced dims divided by their *global* element count.

    Correct for every layout: where the reduced dims are whole on this rank it is the local
    mean; where they are sharded the ranks' results add up to the global mean."""
    x = args[0]
    full = ctx.info.inputs[0].shape
    if ctx.info.target is aten.mean.default:
        dims, keepdim = tuple(range(len(full))), False
    else:
        dims = norm_dims(args[1] if len(args) > 1 else kwargs.get("dim"), len(full))
        keepdim = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
    dtype = kwargs.get("dtype")
    count = math.prod(full[d] for d in dims)
    return aten.sum.dim_IntList(x, list(dims), keepdim, dtype=dtype) / count


@register(aten.amax.default, aten.amin.default)
def amax_rule(info: OpInfo) -> list[Rule]:
    p = PMAX if info.target is aten.amax.default else PMIN
    return reduce_rules(info, _dims(info), _keep(info), p, passthrough=[p])


@register(aten.max.default, aten.min.default)
def max_all_rule(info: OpInfo) -> list[Rule]:
    p = PMAX if info.target is aten.max.default else PMIN
    return reduce_rules(info, _all(info), False, p, passthrough=[p])


@register(
    aten.max.dim, aten.min.dim, aten.argmax.default, aten.argmin.default, aten.median.dim,
    aten.mode.default, aten.kthvalue.default, aten.logsumexp.default, aten.prod.dim_int,
    aten.any.dim, aten.all.dim, aten.any.dims, aten.all.dims,
)
def dim_reduce_rule(info: OpInfo) -> list[Rule]:
    """Reductions whose partial results do not combine with a Partial: whole reduced dim."""
    target = info.target
    if target in (aten.kthvalue.default,):
        dims, keep = _dims(info, 2), _keep(info, 3)
    elif target is aten.mode.default:
        dims, keep = norm_dims(info.arg(1, "dim", -1), len(info.inputs[0].shape)), _keep(info)
    else:
        dims, keep = _dims(info), _keep(info)
    return reduce_rules(info, dims, keep)


@register(aten.prod.default, aten.any.default, aten.all.default, aten.median.default)
def full_reduce_rule(info: OpInfo) -> list[Rule]:
    return reduce_rules(info, _all(info), False)


_CORRECTION = (aten.var.correction, aten.std.correction, aten.var_mean.correction,
               aten.std_mean.correction)


@register(
    *_CORRECTION, aten.var.dim, aten.std.dim, aten.var_mean.dim, aten.std_mean.dim,
)
def var_rule(info: OpInfo) -> list[Rule]:
    # keepdim is keyword-only in the .correction overloads, the 4th argument in .dim
    if info.target in _CORRECTION:
        keep = bool(info.kwargs.get("keepdim", False))
    else:
        keep = bool(info.arg(3, "keepdim", False))
    return reduce_rules(info, _dims(info), keep)


@register(aten.var.default, aten.std.default, aten.var_mean.default, aten.std_mean.default)
def var_all_rule(info: OpInfo) -> list[Rule]:
    return reduce_rules(info, _all(info), False)


@register(aten.linalg_vector_norm.default)
def vector_norm_rule(info: OpInfo) -> list[Rule]:
    return reduce_rules(info, _dims(info, 2), bool(info.arg(3, "keepdim", False)))


# --- ops along one dim that keep the shape ----------------------------------------------------


def along_dim_rules(info: OpInfo, dim: int, linear: Sequence[int] = ()) -> list[Rule]:
    """Shard any dim but ``dim`` (every tensor input and output alike); ``linear`` lists the
    tensor inputs that may be ``P`` alone (others R) with a ``P`` output."""
    x = info.inputs[0]
    rules = []
    for d in shardable_dims(x.shape, exclude=[dim]):
        rules.append(Rule(tuple(Shard(d) for _ in info.inputs), outs_for(info, Shard(d))))
    for i in linear:
        ins = tuple(PSUM if j == i else R for j in range(len(info.inputs)))
        rules.append(Rule(ins, outs_for(info, PSUM)))
    return dedupe(rules)


@register(aten._softmax.default, aten._log_softmax.default, aten.logcumsumexp.default,
          aten.cummax.default, aten.cummin.default, aten.cumprod.default)
def softmax_rule(info: OpInfo) -> list[Rule]:
    return along_dim_rules(info, norm_dim(info.arg(1, "dim"), len(info.inputs[0].shape)))


@register(aten._softmax_backward_data.default, aten._log_softmax_backward_data.default)
def softmax_backward_rule(info: OpInfo) -> list[Rule]:
    # grad_in = f(out) * (g - sum(g * h(out))): linear in g
    return along_dim_rules(info, norm_dim(info.arg(2, "dim"), len(info.inputs[0].shape)), [0])


@register(aten.cumsum.default)
def cumsum_rule(info: OpInfo) -> list[Rule]:
    return along_dim_rules(info, norm_dim(info.arg(1, "dim"), len(info.inputs[0].shape)), [0])


@register(aten.sort.default, aten.argsort.default, aten.sort.stable, aten.argsort.stable)
def sort_rule(info: OpInfo) -> list[Rule]:
    # the .stable overloads take everything after self by keyword
    stable = info.target in (aten.sort.stable, aten.argsort.stable)
    dim = info.kwargs.get("dim", -1) if stable else info.arg(1, "dim", -1)
    return along_dim_rules(info, norm_dim(dim, len(info.inputs[0].shape)))


@register(aten.topk.default)
def topk_rule(info: OpInfo) -> list[Rule]:
    return along_dim_rules(info, norm_dim(info.arg(2, "dim", -1), len(info.inputs[0].shape)))


@register(aten.glu.default)
def glu_rule(info: OpInfo) -> list[Rule]:
    # the halves along dim pair up element by element: that dim stays whole
    return along_dim_rules(info, norm_dim(info.arg(1, "dim", -1), len(info.inputs[0].shape)))


@register(aten.glu_backward.default)
def glu_backward_rule(info: OpInfo) -> list[Rule]:
    # (grad_output [dim halved], self, dim): linear in grad_output
    x = info.inputs[1]
    dim = norm_dim(info.arg(2, "dim", -1), len(x.shape))
    rules = [Rule((Shard(d), Shard(d)), (Shard(d),)) for d in shardable_dims(x.shape, [dim])]
    return dedupe([*rules, Rule((PSUM, R), (PSUM,))])
