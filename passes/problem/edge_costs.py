"""Edge costs of the sharding problem: resharding time for every (producer, consumer) pair.

Matrices are cached by the identity of the two strategy lists (repeated layers share them), so
a model's 32 identical layers cost one matrix per distinct edge, not 32.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from autopar.ir.graph import TensorMeta, node_layer
from autopar.passes.cost import cost_model as cm
from autopar.passes.cost.buckets import bucket_kind, gather_move
from autopar.passes.memory.zero import grad_target
from autopar.solver.reduce import FORBIDDEN

if TYPE_CHECKING:
    import torch.fx as fx

    from autopar.passes.problem.types import Edge, ShardingProblem


def _reshard_table(sp: ShardingProblem, meta: TensorMeta, srcs: list, dsts: list,
                   kind: str | None) -> np.ndarray:
    """Resharding time for every (src, dst) pair of distinct specs, through the problem's
    caches. They are keyed by small ints standing for the specs (``sp.spec_ids``): a spec
    is a tuple of placement dataclasses, whose hash runs in Python, and a model's edges look
    up millions of pairs (Llama-3 405B on 8x16x8: 2 million, 400 thousand of them distinct).
    A pair's collectives (``cm.reshard_moves``) are worked out once for tensors of every size
    where they do not depend on the shape (:func:`_pair_moves`): on that mesh 83
    thousand pairs stand for the 250 thousand (tensor, pair) prices."""
    ids = sp.spec_ids
    src_ids = [ids.setdefault(a, len(ids)) for a in srcs]
    dst_ids = [ids.setdefault(b, len(ids)) for b in dsts]
    cache, tensor = sp.reshard_cache, cm.reshard_price_key(meta, sp.mesh)
    route = cm.reshard_route_key(meta, sp.mesh)
    whole = kind == "grad" and sp.zero1  # ZeRO-1: a gradient is summed whole, then sliced
    # the whole table, for the problems of the other planner modes on this mesh (they share
    # these caches): everything a price below depends on is in the key, the bucket fills
    # too where the tensor moves in batches (a repricing changes them)
    fills = frozenset(sp.bucket_fill.items()) if kind is not None else None
    whole_key = (tensor, route, meta.dtype, kind, whole, fills, tuple(src_ids), tuple(dst_ids))
    table = sp.table_cache.get(whole_key)
    if table is not None:
        return table
    nbytes = float(meta.nbytes)
    table = np.empty((len(srcs), len(dsts)))
    plain = (False, cm.BUCKET_BYTES)  # a move that runs alone (see _batch_price)
    for i, (a, ai) in enumerate(zip(srcs, src_ids)):
        row = table[i]
        for j, (b, bj) in enumerate(zip(dsts, dst_ids)):
            if whole:
                b = grad_target(a, b)
                bj = ids.setdefault(b, len(ids))
            bucketed, fill = plain if kind is None else _batch_price(sp, meta, a, b, kind)
            key = (tensor, ai, bj, bucketed, fill)
            t = cache.get(key)
            if t is None:
                moves = _pair_moves(sp, meta, route, a, ai, b, bj)
                t = cache[key] = sum(m.time(nbytes, bucketed, fill) for m in moves)
            row[j] = t
    table.flags.writeable = False  # shared: its readers index it into new arrays
    sp.table_cache[whole_key] = table
    return table


def _pair_moves(sp: ShardingProblem, meta: TensorMeta, route: tuple, a, ai: int, b, bj: int
                ) -> list[cm.Move]:
    """The moves of ``meta`` from spec ``a`` to ``b`` (ids ``ai``, ``bj``), through
    ``sp.moves_cache``: kept by the pair and ``route`` (``cm.reshard_route_key``) for every
    tensor alike, or, where they depend on its shape (``cm.route_reads_shape``: nested shards;
    the entry is then ``_BY_SHAPE``), by the pair and what of the shape they read. Keyed by the
    whole shape, moe-tiny on 2 x 2 worked out 51 thousand moves per problem built (about two
    seconds on the 2-core machine), where 6,241 stand for them."""
    moves_of = sp.moves_cache
    moves = moves_of.get((route, ai, bj))
    if moves is None:
        moves = moves_of[route, ai, bj] = (
            _BY_SHAPE if cm.route_reads_shape(a, b, len(meta.shape), sp.mesh)
            else cm.reshard_moves(meta, a, b, sp.mesh))
    if isinstance(moves, str):  # _BY_SHAPE
        key = (cm.nested_route_key(meta, a, b, sp.mesh), ai, bj)
        moves = moves_of.get(key)
        if moves is None:
            moves = moves_of[key] = cm.reshard_moves(meta, a, b, sp.mesh)
    return moves


# a moves_cache entry: the pair's moves depend on the tensor's shape (see _pair_moves); a
# string, not a marker object, so that it means the same in a copy of the cache
_BY_SHAPE = "by shape"


def edge_collectives(sp: ShardingProblem, e: Edge, src, dst) -> list[cm.Collective]:
    """The collectives of edge ``e`` under one (producer, consumer) pair, priced as the
    solver prices them (bucket shares included)."""
    meta = edge_meta(sp, e)
    dst = sync_target(sp, e, src, dst)
    bucketed, fill = _batch_price(sp, meta, src, dst, _kind(sp, e))
    return cm.reshard_collectives(meta, src, dst, sp.mesh, bucketed, fill)


def sync_target(sp: ShardingProblem, e: Edge, src, dst):
    """Where edge ``e`` moves its value: the consumer's layout, except a ZeRO-1 plan's
    gradient, summed whole first (:func:`autopar.passes.memory.zero.grad_target`)."""
    return grad_target(src, dst) if e.in_idx < 0 and sp.zero1 else dst


def _batch_price(sp: ShardingProblem, meta: TensorMeta, src, dst,
                 kind: str | None) -> tuple[bool, float]:
    """Whether the move is batched with others, and what its batch holds: a full gradient
    bucket (or parameter gather), unless :func:`autopar.passes.problem.bucket_fill.measure` found its
    batches under-full in a solution."""
    if not _batched(kind, src, dst):
        return False, cm.BUCKET_BYTES
    if not sp.bucket_fill:
        return True, cm.BUCKET_BYTES
    if kind == "param":  # one all-gather per layer and phase: its group's bytes
        move = gather_move(src, dst)
        assert move is not None
        key = ("param_gather", move[0], meta.dtype)  # bucket_fill.gather_key
        return True, sp.bucket_fill.get(key, cm.BUCKET_BYTES)
    b = bucket_kind(src, dst)
    assert b is not None
    return True, sp.bucket_fill.get((b.kind, b.axes, meta.dtype), cm.BUCKET_BYTES)


def is_param_gather(sp: ShardingProblem, e: Edge) -> bool:
    return e.in_idx >= 0 and sp.nodes[e.src].meta["autopar"].param_like


def gather_unit(consumer: fx.Node) -> tuple:
    """The (phase, layer) whose parameter gathers go out together."""
    return (consumer.meta["autopar"].phase, node_layer(consumer))


def _kind(sp: ShardingProblem, e: Edge) -> str | None:
    if e.in_idx < 0:
        return "grad"
    return "param" if is_param_gather(sp, e) else None


def _batched(kind: str | None, src, dst) -> bool:
    """Moves the runtime batches with others (:mod:`autopar.passes.cost.buckets`): gradient
    all-reduces and single reduce-scatters in buckets, single all-gathers of parameters per
    layer. They pay only their share of a bucket's latency; every other move runs alone."""
    if kind == "grad":
        return bucket_kind(src, dst) is not None
    return kind == "param" and gather_move(src, dst) is not None


def edge_specs(sp: ShardingProblem, e: Edge):
    src_specs = [s.outs[e.out_idx] for s in sp.strategies[e.src]]
    if e.in_idx < 0:  # gradient -> the layout of its parameter
        dst_specs = [s.outs[0] for s in sp.strategies[e.dst]]
    else:
        dst_specs = [s.ins[e.in_idx] for s in sp.strategies[e.dst]]
    return src_specs, dst_specs


def edge_meta(sp: ShardingProblem, e: Edge) -> TensorMeta:
    """The tensor edge ``e`` moves: a gradient in the dtype it is reduced in."""
    meta = sp.nodes[e.src].meta["autopar"].outputs[e.out_idx]
    if e.in_idx < 0 and sp.grad_dtype is not None:
        return TensorMeta(meta.shape, sp.grad_dtype)
    return meta


def edge_matrix(sp: ShardingProblem, e: Edge, rows: np.ndarray | None = None) -> np.ndarray:
    """Resharding cost of edge ``e`` for every (producer, consumer) strategy pair; with
    ``rows``, only those producer strategies, in that order."""
    meta = edge_meta(sp, e)
    src_list, dst_list = sp.strategies[e.src], sp.strategies[e.dst]
    kind = _kind(sp, e)
    key = (id(src_list), e.out_idx, id(dst_list), e.in_idx, meta, kind, e.written, e.once)
    hit = sp.matrix_cache.get(key)
    mat = hit[0] if hit is not None else None
    if mat is None:
        src_specs, dst_specs = edge_specs(sp, e)
        uniq_src = list(dict.fromkeys(src_specs))
        uniq_dst = list(dict.fromkeys(dst_specs))
        table = _reshard_table(sp, meta, uniq_src, uniq_dst, kind)
        if e.written:  # written in place: only the producer's own layout (see Edge.written)
            same = np.array([[a == b for b in uniq_dst] for a in uniq_src])
            table = np.where(same, table, FORBIDDEN)
        pos_src = {s: i for i, s in enumerate(uniq_src)}
        pos_dst = {s: i for i, s in enumerate(uniq_dst)}
        si = np.array([pos_src[s] for s in src_specs])
        di = np.array([pos_dst[s] for s in dst_specs])
        mat = table[np.ix_(si, di)]
        if e.once and sp.microbatches > 1:  # weighed against one microbatch's work
            mat = np.where(mat >= FORBIDDEN, mat, mat / sp.microbatches)
        # the entry holds the two lists: their ids are not reused while it lives (the
        # cache may be shared by the problems built with these lists, :func:`matrix_cache`)
        mat.flags.writeable = False  # shared: its readers make new arrays of it
        sp.matrix_cache[key] = (mat, src_list, dst_list)
    return mat if rows is None else mat[rows]


def matrix_cache(sp: ShardingProblem) -> dict:
    """The edge matrices at ``sp``'s prices, shared by every problem built with the same
    strategy lists (``sp.strategy_lists``, sharding_problem.build's lent lists: the planner's
    modes on one mesh) at the same bucket fills, ZeRO-1 choice and microbatches, which are
    what a matrix's price depends on beyond its key; a private one where nothing is lent."""
    lent = getattr(sp, "strategy_lists", None)
    if lent is None:
        return {}
    key = ("edge matrices", frozenset(sp.bucket_fill.items()), sp.zero1, sp.microbatches,
           sp.grad_dtype)
    return lent.setdefault(key, {})
