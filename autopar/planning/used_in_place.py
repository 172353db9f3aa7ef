"""A reference layout's parameters used where they are stored, on the axes it names.

Pinning a layout's parameter placements fixes how they are stored, not how the step uses
them: a completion may still gather a tensor-parallel weight over the tp axis and run its
matmul on a batch split there instead (FSDP over tp), which on a large microbatch is cheaper
than tensor parallelism's activation collectives, and is not the layout the team ran.
Tensor parallelism as Megatron-LM and torchtitan run it (``ColwiseParallel`` /
``RowwiseParallel``) multiplies each weight's own shard and makes its gradient there: on
those axes no parameter is gathered and no weight gradient is reduced. :func:`allowed`
states that as strategy restrictions: every use of a pinned parameter (through its casts and
views) takes it as stored on those axes, and the gradient reaching it (through its casts and
views) is made as stored there. FSDP's and ZeRO's axes are not named: they gather at use.
"""

from __future__ import annotations

from autopar.ir.placements import Shard
from autopar.passes.cost.cost_model import VIEW_OPS
from autopar.passes.problem.types import ShardingProblem

Spec = tuple


def _passes_through(sp: ShardingProblem, i: int) -> bool:
    """A node a parameter (or its gradient) reaches the matmul through unchanged: a view, or a
    dtype cast (the mixed-precision copy)."""
    nd = sp.nodes[i]
    if nd.op != "call_function":
        return False
    f = nd.meta["autopar"]
    return str(f.op) in VIEW_OPS or "param_cast" in f.extra or "_to_copy" in str(f.op)


def allowed(sp: ShardingProblem, pinned: dict[int, Spec], axes: tuple[str, ...]
            ) -> dict[int, set[int]]:
    """Node index -> the strategy indices it may take so that the parameters of ``pinned``
    (node index -> its pinned placement) are used and get their gradients as stored on the
    mesh ``axes`` (the others unconstrained). Empty where no such axis has more than one
    device."""
    ks = [k for k, a in enumerate(sp.mesh.axes) if a in axes and sp.mesh.shape[k] > 1]
    if not ks:
        return {}

    def part(spec: Spec) -> tuple:
        return tuple(spec[k] for k in ks)

    # a parameter replicated on those axes (a norm's weight) is no tensor-parallel weight:
    # its use and its gradient's reduction there are the layout's own
    pinned = {i: spec for i, spec in pinned.items()
              if any(isinstance(p, Shard) for p in part(spec))}

    by_src: dict[int, list] = {}
    to_param: dict[int, list] = {}
    for e in sp.edges:
        if e.in_idx >= 0:
            by_src.setdefault(e.src, []).append(e)
        else:
            to_param.setdefault(e.dst, []).append(e)
    out: dict[int, set[int]] = {}

    def restrict(i: int, ok: set[int]) -> set[int]:
        out[i] = out[i] & ok if i in out else set(ok)
        return out[i]

    # forward: from each pinned parameter down its casts and views to the ops that read it
    todo = [(i, {part(spec)}) for i, spec in pinned.items()]
    seen: set[tuple[int, frozenset]] = set()
    while todo:
        i, parts = todo.pop()
        if (i, frozenset(parts)) in seen:
            continue
        seen.add((i, frozenset(parts)))
        for e in by_src.get(i, []):
            strategies = sp.strategies[e.dst]
            ok = restrict(e.dst, {k for k, s in enumerate(strategies)
                                  if e.in_idx < len(s.ins) and part(s.ins[e.in_idx]) in parts})
            if _passes_through(sp, e.dst) and ok:
                todo.append((e.dst, {part(strategies[k].outs[0]) for k in ok}))
    # backward: from each pinned parameter's gradient up its casts and views to the op making it
    todo = [(e.src, e.out_idx, {part(pinned[p])}) for p in pinned for e in to_param.get(p, [])]
    while todo:
        i, out_idx, parts = todo.pop()
        strategies = sp.strategies[i]
        ok = restrict(i, {k for k, s in enumerate(strategies)
                          if out_idx < len(s.outs) and part(s.outs[out_idx]) in parts})
        if not _passes_through(sp, i) or not ok:
            continue
        for e in sp.edges:
            if e.dst == i and e.in_idx == 0:
                todo.append((e.src, e.out_idx, {part(strategies[k].ins[0]) for k in ok
                                                if strategies[k].ins}))
    return out
