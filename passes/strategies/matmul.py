"""Matrix products: mm, addmm, bmm, baddbmm, dot, mv (``linear``/``matmul`` decompose into these).

On one mesh axis a product ``out[b, m, n] = sum_k A[b, m, k] B[b, k, n]`` can split

- the batch ``b`` of both operands (bmm): each rank multiplies its own matrices;
- the rows ``m`` of A (data parallel / sequence parallel): B whole, rows of the output;
- the columns ``n`` of B (Megatron column parallel): A whole, columns of the output;
- the contraction ``k`` of both (Megatron row parallel): each rank holds a partial sum, ``P``;
- nothing, with one operand already ``P``: the product is linear in each operand separately.

A bias (addmm/baddbmm: ``out = beta*bias + alpha*A@B``) broadcasts over the output, so it takes
the output's shard by broadcasting; under a ``P`` output it must be ``P`` too, otherwise every
rank would add the whole bias and the sum would count it n times.
"""

from __future__ import annotations

import torch

from autopar.ir.placements import Placement, R, Shard
from autopar.passes.strategies._common import PSUM, bcast, dedupe
from autopar.passes.strategies.registry import OpInfo, Rule, register

aten = torch.ops.aten


def _product_rules(batch: int, a_nd: int, b_nd: int, out_nd: int) -> list[tuple]:
    """(A placement, B placement, out placement) triples for a product with ``batch`` leading
    batch dims. ``a_nd``/``b_nd`` are 1 for vector operands (dot, mv)."""
    rules: list[tuple[Placement, Placement, Placement]] = []
    for d in range(batch):
        rules.append((Shard(d), Shard(d), Shard(d)))
    if a_nd - batch == 2:  # A has rows
        rules.append((Shard(batch), R, Shard(batch)))
    if b_nd - batch == 2:  # B has columns
        rules.append((R, Shard(b_nd - 1), Shard(out_nd - 1)))
    rules.append((Shard(a_nd - 1), Shard(batch), PSUM))  # contraction dim
    rules.append((PSUM, R, PSUM))
    rules.append((R, PSUM, PSUM))
    return rules


def _sizes_ok(info: OpInfo, a: int, b: int, rule: tuple) -> bool:
    # a rule that shards a size-1 dim is pruned by expand anyway; skip it early
    for meta, p in ((info.inputs[a], rule[0]), (info.inputs[b], rule[1])):
        if isinstance(p, Shard) and meta.shape[p.dim] <= 1:
            return False
    return True


@register(aten.mm, aten.bmm, aten.dot, aten.mv)
def product_rule(info: OpInfo) -> list[Rule]:
    a, b = info.inputs[0], info.inputs[1]
    batch = 1 if info.target.overloadpacket is aten.bmm else 0
    triples = _product_rules(batch, len(a.shape), len(b.shape), len(info.out.shape))
    return dedupe(Rule((pa, pb), (po,)) for pa, pb, po in triples if _sizes_ok(info, 0, 1, (pa, pb)))


@register(aten.addmm, aten.baddbmm)
def biased_product_rule(info: OpInfo) -> list[Rule]:
    bias, a, b = info.inputs[0], info.inputs[1], info.inputs[2]
    batch = 1 if info.target.overloadpacket is aten.baddbmm else 0
    out_shape = info.out.shape
    beta = info.arg(3, "beta", 1)
    rules = []
    for pa, pb, po in _product_rules(batch, len(a.shape), len(b.shape), len(out_shape)):
        if not _sizes_ok(info, 1, 2, (pa, pb)):
            continue
        # with beta == 0 the bias values are ignored (its shape must still broadcast), so a
        # partial output does not need a partial bias
        pbias = R if beta == 0 and po == PSUM else bcast(po, bias, out_shape)
        rules.append(Rule((pbias, pa, pb), (po,)))
    return dedupe(rules)
