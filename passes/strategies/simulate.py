"""Simulating every rank of a mesh in one process, to validate rules against full tensors.

``shard(full, spec, ...)`` gives each mesh coordinate its piece (a Partial is split into random
addends that sum to the full tensor, so a rule that wrongly treats a partial value as whole is
caught). ``unshard`` puts the pieces back, checking that replicas agree. ``check_strategy`` runs
an op both ways and compares.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from autopar.ir.placements import Partial, Replicate, Shard, Spec
from autopar.passes.strategies.localize import LocalContext, finish_call, has_finish, local_call
from autopar.passes.strategies.registry import OpInfo, Strategy


def coords(mesh_shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    return list(itertools.product(*(range(n) for n in mesh_shape)))


def shard(
    full: torch.Tensor, spec: Spec, mesh_shape: tuple[int, ...], gen: torch.Generator | None = None
) -> dict[tuple[int, ...], torch.Tensor]:
    """The local piece of ``full`` at every coordinate (nested shards in mesh-axis order)."""
    pieces = {c: full for c in coords(mesh_shape)}
    for axis, (p, n) in enumerate(zip(spec, mesh_shape)):
        for c in pieces:
            t = pieces[c]
            if isinstance(p, Shard):
                pieces[c] = t.chunk(n, dim=p.dim)[c[axis]] if n > 1 else t
        if isinstance(p, Partial):
            pieces = _split_partial(pieces, axis, n, p.reduce, gen)
    # own storage per rank: an in-place op on one rank must not write into the full tensor
    return {c: t.clone() for c, t in pieces.items()}


def _split_partial(pieces, axis, n, reduce, gen):
    out = {}
    groups: dict[tuple, list] = {}
    # pieces depend only on the axes already applied (c[:axis]); later axes must see the same
    # split, else a tensor replicated on a later axis would differ between its replicas
    for c in pieces:
        groups.setdefault(c[:axis], []).append(c)
    for members in groups.values():
        base = pieces[members[0]]
        if reduce == "sum" and base.is_floating_point():
            noise = [
                torch.randn(base.shape, generator=gen, dtype=base.dtype).to(base.device)
                for _ in range(n - 1)
            ]
            parts = noise + [base - sum(noise)] if noise else [base]
        elif reduce == "sum":  # integers/bools: one rank holds the value, the others zeros
            parts = [base] + [torch.zeros_like(base)] * (n - 1)
        elif reduce in ("max", "min", "amax", "amin") and base.is_floating_point() and n > 1:
            parts = _split_extreme(base, n, reduce in ("max", "amax"), gen)
        else:
            parts = [base] * n
        for c in members:
            out[c] = parts[c[axis]]
    return out


def _split_extreme(base, n, is_max, gen):
    """Pieces whose elementwise max (min) is ``base``: every element is exact on one random rank
    and further from the extreme elsewhere, so a rule that reads a P(max) piece as whole fails."""
    owner = torch.randint(0, n, base.shape, generator=gen).to(base.device)
    parts = []
    for r in range(n):
        gap = torch.rand(base.shape, generator=gen, dtype=base.dtype).to(base.device) + 0.5
        off = torch.where(owner == r, torch.zeros_like(base), gap)
        parts.append(base - off if is_max else base + off)
    return parts


def unshard(
    pieces: dict[tuple[int, ...], torch.Tensor], spec: Spec, mesh_shape: tuple[int, ...],
    atol: float = 1e-5, rtol: float = 1e-4,
) -> torch.Tensor:
    """The full tensor from its pieces (innermost mesh axis first, undoing :func:`shard`)."""
    cur = dict(pieces)
    for axis in reversed(range(len(mesh_shape))):
        p = spec[axis]
        nxt = {}
        groups: dict[tuple, list] = {}
        for c in cur:
            groups.setdefault(c[:axis] + c[axis + 1 :], []).append(c)
        for key, members in groups.items():
            members.sort(key=lambda c: c[axis])
            ts = [cur[c] for c in members]
            if isinstance(p, Shard):
                val = torch.cat(ts, dim=p.dim)
            elif isinstance(p, Partial):
                val = _reduce(ts, p.reduce)
            else:
                for t in ts[1:]:
                    if not _close(t, ts[0], atol, rtol):
                        raise AssertionError(f"replicas disagree on mesh axis {axis}")
                val = ts[0]
            nxt[key] = val
        cur = nxt
    return cur[()]


def _reduce(ts, reduce):
    if reduce == "sum":
        return sum(ts[1:], ts[0])
    if reduce in ("max", "amax"):
        return torch.stack(ts).amax(0)
    if reduce in ("min", "amin"):
        return torch.stack(ts).amin(0)
    if reduce in ("avg", "mean"):
        return sum(ts[1:], ts[0]) / len(ts)
    raise ValueError(reduce)


def _close(a, b, atol, rtol) -> bool:
    if not isinstance(a, torch.Tensor):
        return a == b
    if a.is_floating_point():
        return torch.allclose(a, b, atol=atol, rtol=rtol, equal_nan=True)
    return torch.equal(a, b)


def run_sharded(
    target: Any, full_args: tuple, full_kwargs: dict, info: OpInfo, strategy: Strategy,
    mesh_shape: tuple[int, ...], seed: int = 0,
) -> list[torch.Tensor | None]:
    """Run ``target`` on every simulated rank under ``strategy``; return the unsharded outputs."""
    gen = torch.Generator().manual_seed(seed)
    tensors = _flatten_tensors((full_args, full_kwargs))
    if len(tensors) != len(strategy.ins):
        raise ValueError(f"{len(tensors)} tensor inputs but the strategy places {len(strategy.ins)}")
    placed = [shard(t, s, mesh_shape, gen) for t, s in zip(tensors, strategy.ins)]
    per_rank: dict[tuple[int, ...], Any] = {}
    for c in coords(mesh_shape):
        it = iter([pl[c] for pl in placed])
        args, kwargs = _replace_tensors((full_args, full_kwargs), it)
        ctx = LocalContext(info, strategy, mesh_shape, c)
        per_rank[c] = local_call(target, args, kwargs, ctx)
    specs = strategy.op_outs  # an in-op all-reduce: unshard its input
    if strategy.raw_outs and has_finish(strategy):  # reduce per rank, finish, then unshard
        per_rank = _reduced_per_rank(per_rank, strategy, mesh_shape)
        per_rank = {c: finish_call(o, LocalContext(info, strategy, mesh_shape, c))
                    for c, o in per_rank.items()}
        specs = strategy.outs
    outs = []
    for j, spec in enumerate(specs):
        vals = {c: _nth(o, j) for c, o in per_rank.items()}
        if not isinstance(next(iter(vals.values())), torch.Tensor):
            outs.append(None)
            continue
        outs.append(unshard(vals, spec, mesh_shape))
    return outs


def _reduced_per_rank(per_rank: dict[tuple[int, ...], Any], strategy: Strategy,
                      mesh_shape: tuple[int, ...]) -> dict[tuple[int, ...], Any]:
    """Every rank's outputs after the strategy's in-op all-reduces (``raw_outs`` -> ``outs``):
    on each axis a partial becomes whole over, the values of the ranks along it, reduced."""
    out: dict[tuple[int, ...], list] = {c: [] for c in per_rank}
    for j, (raw, whole) in enumerate(zip(strategy.raw_outs, strategy.outs)):
        axes = [k for k, (a, b) in enumerate(zip(raw, whole))
                if isinstance(a, Partial) and isinstance(b, Replicate)]
        for c in per_rank:
            if _nth(per_rank[c], j) is None or not axes:
                out[c].append(_nth(per_rank[c], j))
                continue
            group = [o for o in per_rank if all(o[k] == c[k] for k in range(len(c))
                                                 if k not in axes)]
            (reduce,) = {raw[k].reduce for k in axes}  # type: ignore[union-attr]
            out[c].append(_reduce([_nth(per_rank[o], j) for o in group], reduce))
    first = next(iter(per_rank.values()))
    if isinstance(first, (tuple, list)):
        return {c: type(first)(v) for c, v in out.items()}
    return {c: v[0] for c, v in out.items()}


def _nth(out: Any, j: int) -> Any:
    if isinstance(out, (tuple, list)):
        return out[j]
    return out if j == 0 else None


def _flatten_tensors(tree: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []

    def visit(a):
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            for x in a:
                visit(x)
        elif isinstance(a, dict):
            for x in a.values():
                visit(x)

    visit(tree)
    return found


def _replace_tensors(tree: Any, it) -> Any:
    if isinstance(tree, torch.Tensor):
        return next(it)
    if isinstance(tree, (list, tuple)):
        return type(tree)(_replace_tensors(x, it) for x in tree)
    if isinstance(tree, dict):
        return {k: _replace_tensors(v, it) for k, v in tree.items()}
    return tree


def check_strategy(
    target: Any, full_args: tuple, full_kwargs: dict, info: OpInfo, strategy: Strategy,
    mesh_shape: tuple[int, ...], atol: float = 1e-4, rtol: float = 1e-4,
) -> None:
    """Assert that running sharded under ``strategy`` equals running on full tensors."""
    # clones: in-place ops (add_, bernoulli_) would otherwise change the inputs between the runs
    expected = target(*_clone_tree(full_args), **_clone_tree(full_kwargs))
    got = run_sharded(target, full_args, full_kwargs, info, strategy, mesh_shape)
    exp_list = list(expected) if isinstance(expected, (tuple, list)) else [expected]
    for j, (e, g) in enumerate(zip(exp_list, got)):
        if g is None or not isinstance(e, torch.Tensor):
            continue
        if g.shape != e.shape or g.dtype != e.dtype:  # allclose would broadcast a wrong shape
            raise AssertionError(
                f"output {j} under {strategy}: got {g.dtype}{list(g.shape)}, "
                f"expected {e.dtype}{list(e.shape)}"
            )
        if not _close(g, e, atol, rtol):
            err = (g.double() - e.double()).abs().max().item() if e.is_floating_point() else "-"
            raise AssertionError(f"output {j} differs under {strategy}: max abs err {err}")


def _clone_tree(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, (list, tuple)):
        return type(tree)(_clone_tree(x) for x in tree)
    if isinstance(tree, dict):
        return {k: _clone_tree(v) for k, v in tree.items()}
    return tree


def replicated(spec_len: int) -> Spec:
    return tuple(Replicate() for _ in range(spec_len))
