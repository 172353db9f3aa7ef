"""How a reshard runs, step by step: pure placement logic, no torch (the cost model can use it).

**Nested shards** (two mesh axes splitting one tensor dim, nested in mesh-axis order as DTensor
does) make the order matter: gathering an outer axis while an inner one still splits the dim
leaves the blocks interleaved. The axes are taken in ascending order (the cost model's) and the
blocks put back in order locally afterwards whenever every rank then holds the right blocks
(``(S(0), S(0)) -> (R, R)``: two gathers and one local permutation, exactly as priced). When
it does not (``(S(0), S(0)) -> (R, S(0))``), the first order that is valid step by step is
taken, which moves other byte counts over the axes than the plan predicted; when no order is
valid (``(R, S(0)) -> (S(0), S(0))``) the innermost shard is gathered first, an extra
all-gather the plan did not price, recorded with reason ``"nested-shard fallback"``.

:func:`route` gives the steps and the local block permutations;
``cost_model.route_collectives`` the collectives they issue, with the same kinds and byte
definition as ``cost_model.reshard_collectives`` (identical to it wherever the ascending order
runs).
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from autopar.ir.placements import Placement, Replicate, Shard, Spec

Steps = list[tuple[int, Placement]]
Perms = dict[int, list[int]]


def route(src: Spec, dst: Spec, local: tuple[int, ...], mesh_shape: tuple[int, ...]
          ) -> tuple[Steps, Perms]:
    """The ``(axis, new placement)`` steps from ``src`` to ``dst`` for a local piece of shape
    ``local``, and the block permutation to apply per dim afterwards."""
    return _cached(tuple(src), tuple(dst), route_key(src, dst, local, mesh_shape),
                   tuple(mesh_shape))


def route_key(src: Spec, dst: Spec, local: tuple[int, ...], mesh_shape: tuple[int, ...]
              ) -> tuple[int, ...]:
    """All of ``local`` the route from ``src`` to ``dst`` depends on: only divisibility by the
    mesh's shard counts matters, so every dim is folded to its gcd with the mesh size and
    tensors of many shapes share one route."""
    size = math.prod(mesh_shape)
    factor = [1] * len(local)
    for p, n in zip(src, mesh_shape):
        if isinstance(p, Shard):
            factor[p.dim] *= n
    moved = {p.dim for p in (*src, *dst) if isinstance(p, Shard)}
    return tuple(math.gcd(n * f, size) // f if d in moved else 1
                 for d, (n, f) in enumerate(zip(local, factor)))


@lru_cache(maxsize=1 << 18)
def _cached(src: Spec, dst: Spec, local: tuple[int, ...], mesh_shape: tuple[int, ...]
            ) -> tuple[Steps, Perms]:
    return _route_uncached(src, dst, local, mesh_shape)


def _route_uncached(src: Spec, dst: Spec, local: tuple[int, ...], mesh_shape: tuple[int, ...]
           ) -> tuple[list[tuple[int, Placement]], dict[int, list[int]]]:
    """The steps to run and the local block permutations to apply after them.

    First choice: the cost model's ascending axis order; nested shards may then come out with
    their blocks interleaved, which a local permutation fixes when this rank ends up holding
    the right blocks (e.g. ``(S(0), S(0)) -> (R, R)``). Otherwise: :func:`reshard_steps`."""
    ascending = [(ax, dst[ax]) for ax in range(len(src)) if src[ax] != dst[ax]]
    perms = _block_permutations(src, dst, ascending, local, mesh_shape)
    if perms is not None:
        return ascending, perms
    return reshard_steps(src, dst, _full_shape(local, src, mesh_shape), mesh_shape), {}


def _block_permutations(src: Spec, dst: Spec, steps: list[tuple[int, Placement]],
                        local: tuple[int, ...], mesh_shape: tuple[int, ...]
                        ) -> dict[int, list[int]] | None:
    """Per tensor dim, how to reorder the local blocks after ``steps`` so every rank holds its
    ``dst`` piece in order; ``None`` if some rank would hold the wrong blocks.

    Simulated on block ids: each dim is cut into as many blocks as the axes sharding it (in
    ``src`` or ``dst``) make; a gather concatenates the peers' lists, a slice, reduce-scatter or
    all-to-all keeps this rank's part of its list."""
    full = _full_shape(local, src, mesh_shape)
    perms: dict[int, list[int]] = {}
    for d in range(len(full)):
        sd = Shard(d)
        if not any(src[ax] != dst[ax] and sd in (src[ax], dst[ax]) for ax in range(len(src))):
            continue  # no step moves this dim's blocks
        axes = [ax for ax in range(len(src)) if sd in (src[ax], dst[ax])]
        n_blocks = math.prod(mesh_shape[ax] for ax in axes)
        if full[d] % n_blocks:
            return None
        # only the axes that split this dim move its blocks: the ranks that differ on the
        # others hold the same blocks. Every rank's block list at once, as one array indexed
        # by its coordinates on ``axes`` then the list, of size 1 on an axis the lists do not
        # depend on (broadcast: meshes of thousands of devices made per-rank Python lists of
        # thousands of blocks, 2 s a route on 8,192 devices)
        state = _pieces(src, d, n_blocks, mesh_shape, axes)
        cur = list(src)
        for ax, b in steps:
            a, n = cur[ax], mesh_shape[ax]
            if (a == sd) == (b == sd):
                cur[ax] = b
                continue
            i = axes.index(ax)
            full_i = state.shape[:i] + (n,) + state.shape[i + 1:]
            state = np.broadcast_to(state, full_i)
            if a == sd:  # gather: each rank gets its peers' lists, in order (then alike on i)
                got = np.moveaxis(state, i, -2)
                state = np.expand_dims(got.reshape(*got.shape[:-2], n * state.shape[-1]), i)
            else:  # slice: each rank keeps its own part of its list
                k = state.shape[-1] // n
                parts = np.moveaxis(state.reshape(*state.shape[:-1], n, k), i, 0)
                idx = np.arange(n)
                state = np.moveaxis(parts[idx, ..., idx, :], 0, i)
            cur[ax] = b
        want = _pieces(dst, d, n_blocks, mesh_shape, axes)
        if state.shape[-1] != want.shape[-1]:
            return None
        # a piece is a contiguous ascending range: where each of its blocks sits in the first
        # rank's list is the permutation; every rank must hold its piece under that same one
        order = np.argsort(state[(0,) * len(axes)], kind="stable")
        if not (state[..., order] == want).all():
            return None  # some rank holds other blocks, or needs another permutation
        perm = [int(x) for x in order]
        if perm != sorted(perm):
            perms[d] = perm
    return perms


def _pieces(spec: Spec, d: int, n_blocks: int, mesh_shape: tuple[int, ...],
            axes: list[int]) -> np.ndarray:
    """Every rank's ``spec`` piece of dim ``d`` cut in ``n_blocks`` blocks, as block ids, in an
    array indexed by the rank's coordinates on ``axes`` and then the piece (all ranks at
    once: the axes sharding ``d`` nest, each cutting the previous part)."""
    start = np.zeros((1,) * len(axes), dtype=np.int32)  # size 1 on axes not cutting it
    size = n_blocks
    for ax, p in enumerate(spec):
        if p == Shard(d):
            size //= mesh_shape[ax]
            shape = [1] * len(axes)
            shape[axes.index(ax)] = mesh_shape[ax]
            start = start + np.arange(mesh_shape[ax], dtype=np.int32).reshape(shape) * size
    return start[..., None] + np.arange(size, dtype=np.int32)


def _part(blocks: list[int], n: int, i: int) -> list[int]:
    k = len(blocks) // n
    return blocks[i * k:(i + 1) * k]


def _full_shape(local: tuple[int, ...], spec: Spec, mesh_shape: tuple[int, ...]) -> list[int]:
    full = list(local)
    for p, n in zip(spec, mesh_shape):
        if isinstance(p, Shard):
            full[p.dim] *= n
    return full


def _invalid(cur: list[Placement], ax: int, target: Placement) -> bool:
    """True when changing axis ``ax`` now would interleave a nested shard's blocks."""
    inner = cur[ax + 1:]
    a = cur[ax]
    if isinstance(a, Shard) and a in inner:
        return True
    return isinstance(target, Shard) and target != a and target in inner


def reshard_steps(src: Spec, dst: Spec, full: list[int] | None = None,
                  mesh_shape: tuple[int, ...] | None = None) -> list[tuple[int, Placement]]:
    """The ordered ``(axis, new placement)`` steps from ``src`` to ``dst`` (see module doc).

    Takes the lowest axis whose step is valid now: it interleaves no nested shard's blocks
    and, given the tensor's ``full`` shape and the ``mesh_shape``, leaves every dim split into
    pieces it divides into (``(P, S(2), S(0)) -> (R, S(0), S(2))`` on a 2x2x2 tensor and mesh
    can take neither shard step first: each would split a dim of 2 four ways). When none is,
    the axes blocking the lowest pending one are gathered to ``R`` first (the inner ones,
    innermost first; the outer ones where no inner one blocks); that axis is then valid, so
    this terminates. Such a gathered axis may be re-sharded by a later step.
    """
    cur = list(src)
    steps: list[tuple[int, Placement]] = []

    def valid(ax: int) -> bool:
        if _invalid(cur, ax, dst[ax]):
            return False
        return full is None or _divides(cur[:ax] + [dst[ax]] + cur[ax + 1:], full, mesh_shape)

    for _ in range(4 * len(cur) + 4):
        pending = [ax for ax in range(len(cur)) if cur[ax] != dst[ax]]
        if not pending:
            return steps
        ax = next((a for a in pending if valid(a)), None)
        if ax is None:
            first = pending[0]
            dims = {p for p in (cur[first], dst[first]) if isinstance(p, Shard)}
            blockers = [j for j in reversed(range(first + 1, len(cur))) if cur[j] in dims]
            if not blockers:
                blockers = [j for j in reversed(range(first)) if cur[j] in dims]
            for j in blockers:
                steps.append((j, Replicate()))
                cur[j] = Replicate()
            continue
        steps.append((ax, dst[ax]))
        cur[ax] = dst[ax]
    raise AssertionError(f"internal: no reshard route from {src} to {dst}")


def _divides(spec: list[Placement], full: list[int], mesh_shape: tuple[int, ...] | None
             ) -> bool:
    """Every dim of a ``full``-shaped tensor splits evenly into the pieces ``spec`` makes."""
    assert mesh_shape is not None
    count = [1] * len(full)
    for p, n in zip(spec, mesh_shape):
        if isinstance(p, Shard):
            count[p.dim] *= n
    return all(f % c == 0 for f, c in zip(full, count))
