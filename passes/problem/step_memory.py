"""What one step holds under a solution of the sharding problem: every node's output (its
``usage`` in the problem) and the buffers that exist only because two layouts differ, as
``(bytes, interval)`` lists for :func:`autopar.passes.memory.peak.peak_memory`
(:func:`step_usage`); the solution a plan made elsewhere picks (:func:`plan_choice`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from autopar.ir.placements import Replicate, Shard
from autopar.passes.cost.buckets import GradSync, first_bucket_bytes, gather_move, sync_groups
from autopar.passes.cost.cost_model import VIEW_OPS, activation_bytes
from autopar.passes.cost.reshard_route import route
from autopar.passes.memory.peak import live_intervals, own_storage, peak_memory
from autopar.passes.problem.edge_costs import gather_unit, is_param_gather, sync_target

if TYPE_CHECKING:
    from autopar.passes.problem.types import ShardingProblem


def step_peak(sp: ShardingProblem, choice: list[int]) -> tuple[float, int]:
    """``peak_memory(*step_usage(sp, choice))``: the step's peak and its instant, kept per
    problem. It depends on the choice and on what the build fixed, not on the solver's prices,
    and one plan's peak is asked for by its memory fit, its scoring and its repricing."""
    key = tuple(choice)
    hit = sp.peak_cache.get(key)
    if hit is None:
        hit = sp.peak_cache[key] = peak_memory(*step_usage(sp, choice))
    return hit


def step_usage(sp: ShardingProblem, choice: list[int], once: set[int] | None = None
               ) -> tuple[list[float], list[tuple[int, int]]]:
    """Everything one step holds under a complete assignment, as ``(bytes, interval)`` lists
    for :func:`peak_memory`: each node's output (``sp.usage``) and the buffers that exist only
    because two layouts differ, which a per-node usage cannot see:

    * a reshard's result (a gathered parameter, a resharded activation) lives while its
      reader runs; where the reader is a view, as long as the view and the views of it (the
      forward's ``t(weight)`` read again by the backward keeps the gathered weight);
    * the parameters one layer's ops gather in one phase are gathered at once, when the
      first of those ops runs, and held until the last one has (each also as long as views
      keep it); the all-gather's own buffers (flattened shards, gathered rows) exist while
      it runs;
    * a gradient bucket is a flat copy of its gradients, made when its last one exists;
    * an op that all-reduces its partial result inside the op holds both while it runs.

    A view that reads such a copy aliases the copy, not its producer: the producer is freed
    after its own last reader (intervals recomputed with :func:`live_intervals`' ``moved``).
    A move that only slices a replicated piece (``R -> S(d)``) into a block still contiguous
    is a view of its input, as the runtime's ``narrow(...).contiguous()`` leaves it: no copy.

    In a pipeline stage's stand-in, a buffer kept for the backward is held once per
    microbatch in flight, except a parameter's gathered copy: one per step, whatever is in
    flight. ``once``, where given, receives the indices of the entries past the nodes' own
    that are such copies (a node's own is a parameter's cast or view by its role).
    """
    weight = sp.weight if sp.weight is not None else np.ones(len(sp.nodes))
    usage = [float(sp.usage[i][s]) for i, s in enumerate(choice)]
    moves = []  # (edge, src spec, dst spec) of every input resharded into a copy
    syncs: list[GradSync] = []
    for e in sp.edges:
        src = sp.strategies[e.src][choice[e.src]].outs[e.out_idx]
        dst_s = sp.strategies[e.dst][choice[e.dst]]
        dst = dst_s.outs[0] if e.in_idx < 0 else dst_s.ins[e.in_idx]
        if src == dst:
            continue
        meta = sp.nodes[e.src].meta["autopar"].outputs[e.out_idx]
        if e.in_idx < 0:
            syncs.append(GradSync(e.src, meta, src, sync_target(sp, e, src, dst),
                                  float(weight[e.dst])))
            continue
        if sp.nodes[e.dst].meta["autopar"].op == "getitem":
            continue  # a multi-output op's piece: moved where it is read, counted there
        if not _copies(sp, e, src, dst):
            continue
        moves.append((e, src, dst))
    moved = {e.dst for e, _, _ in moves
             if e.in_idx == 0 and sp.nodes[e.dst].meta["autopar"].op in VIEW_OPS}
    fresh = moved | {e.dst for e in sp.edges if e.in_idx == 0 and own_storage(sp.nodes[e.dst])
                     and sp.strategies[e.src][choice[e.src]].outs[e.out_idx]
                     != sp.strategies[e.dst][choice[e.dst]].ins[0]}
    reshaped = _views_that_copy(sp, choice, fresh)
    moved |= reshaped
    live = live_intervals(sp.nodes, moved) if moved else list(sp.live)
    view_end = _view_chain_ends(sp, live)
    # under the depth proxy a traced layer's buffer stands for its untraced copies only where
    # each of them holds one at once: across the forward's end (as sharding_problem weighs
    # usage); a transient is held by one layer at a time
    turn = next((i for i, n in enumerate(sp.nodes) if n.meta["autopar"].phase == "bwd"),
                len(sp.nodes))

    def held(nbytes: float, a: int, b: int, w: float, per_step: bool = False) -> None:
        if per_step and once is not None:
            once.add(len(usage))
        f = 1.0 if per_step else sp.in_flight
        usage.append(nbytes * (w * f if a < turn <= b else 1.0))
        live.append((a, b))

    for i, k in enumerate(choice):
        # an op that all-reduces its partial result (Megatron's row-parallel matmul) holds
        # the partial and the reduced copy at once while the collective runs
        st = sp.strategies[i][k]
        if st.raw_outs:
            f = sp.nodes[i].meta["autopar"]
            held(sum(activation_bytes(m, a, sp.mesh)
                     for m, a, b in zip(f.outputs, st.raw_outs, st.outs) if a != b), i, i, 1.0)
    for i in reshaped:
        f = sp.nodes[i].meta["autopar"]
        held(activation_bytes(f.out, sp.strategies[i][choice[i]].outs[0], sp.mesh),
             i, view_end[i], float(weight[i]))
    # one buffer per key: [bytes, start, end, layer weight, a parameter's copy]
    copies: dict[tuple, list] = {}
    groups: dict[tuple, list] = {}  # a layer's gather: [start, last reader, {member key: dim}]
    for e, src, dst in moves:
        meta = sp.nodes[e.src].meta["autopar"].outputs[e.out_idx]
        n = sp.nodes[e.dst]
        move = gather_move(src, dst) if is_param_gather(sp, e) else None
        key = (e.src, e.out_idx, dst, gather_unit(n) if move is not None else e.dst)
        end = view_end[e.dst] if n.meta["autopar"].op in VIEW_OPS else e.dst
        nbytes = activation_bytes(meta, dst, sp.mesh)
        slot = copies.setdefault(key, [nbytes, e.dst, end, float(weight[e.dst]),
                                       sp.nodes[e.src].meta["autopar"].param_like])
        slot[1], slot[2] = min(slot[1], e.dst), max(slot[2], end)
        if move is not None:
            g = groups.setdefault((gather_unit(n), move[0], meta.dtype), [e.dst, e.dst, {}])
            g[0], g[1] = min(g[0], e.dst), max(g[1], e.dst)
            g[2][key] = (move[1], activation_bytes(meta, src, sp.mesh))
    for a, last, members in groups.values():
        # one all-gather for the group when its first reader runs (runtime/param_gather.py):
        # the shards flattened into one buffer, the gathered rows, then each member cut out
        # as a copy (a view of the rows only for a lone member split along dim 0), all held
        # until the group's last reader
        rows = sum(copies[k][0] for k in members)
        copied = len(members) > 1 or any(d != 0 for d, _ in members.values())
        held(sum(b for _, b in members.values()) + (rows if copied else 0.0), a, a, 1.0)
        for k in members:
            copies[k][1], copies[k][2] = a, max(copies[k][2], last)
    for nbytes, a, b, w, param in copies.values():
        held(nbytes, a, b, w, param)
    for group, kind in sync_groups(syncs, sp.mesh.shape,
                                   first_bytes=first_bucket_bytes(sp.mesh.device)):
        if kind is None:
            continue  # moved alone: its result replaces it
        t = max(g.index for g in group)
        usage.append(sum(activation_bytes(g.meta, g.src, sp.mesh) * g.weight for g in group))
        live.append((t, t))
    return usage, live


def _copies(sp: ShardingProblem, e, src: tuple, dst: tuple) -> bool:
    """Whether moving edge ``e``'s value from ``src`` to ``dst`` makes a new buffer: anything
    but local slices (``R -> S(d)`` on every axis that changes) whose ``narrow`` stays
    contiguous in the producer's memory layout (its traced strides: a ``t()`` view is
    column-major, so its row slices are copied)."""
    steps, perms = route(src, dst, _local_shape(sp, e, src), sp.mesh.shape)
    if perms or not all(isinstance(src[ax], Replicate) and isinstance(b, Shard)
                        for ax, b in steps):
        return True
    val = sp.nodes[e.src].meta.get("val")
    if isinstance(val, (tuple, list)):
        val = val[e.out_idx] if e.out_idx < len(val) else None
    if not isinstance(val, torch.Tensor):
        return True
    local = _local_shape(sp, e, src)
    stride = val.stride()
    if any(st == 0 and n > 1 for st, n in zip(stride, local)):
        return True  # an expanded value: contiguous() copies it
    # the local piece has the value's dimension order with local sizes
    order = sorted(range(len(local)), key=lambda d: -stride[d])
    t = torch.empty([local[d] for d in order], device="meta").permute(
        [order.index(d) for d in range(len(local))])
    for ax, b in steps:
        t = t.narrow(b.dim, 0, t.shape[b.dim] // sp.mesh.shape[ax])
        if not t.is_contiguous():
            return True
    return False


# view ops replayed on a moved value's local layout (their other arguments are dims, or, for
# the reshaping ones, the node's own local output shape)
_REPLAYED = {"aten.transpose.int", "aten.t.default", "aten.permute.default",
             "aten.unsqueeze.default", "aten.squeeze.dim", "aten.detach.default",
             "aten.alias.default", "aten.view.default", "aten._unsafe_view.default"}
_RESHAPING = {"aten.view.default", "aten._unsafe_view.default"}


def _views_that_copy(sp: ShardingProblem, choice: list[int], fresh: set[int]) -> set[int]:
    """The reshaping views that the runtime must run as copies: a value a collective made
    (``fresh``: a moved input, standard row-major) loses the strides the traced value had
    (an attention kernel's output laid out as ``(B, S, H, D)`` behind its ``(B, H, S, D)``
    shape), so a ``transpose`` then ``view`` that was a view when traced cannot be one
    here; the runtime reshapes it into a copy. Replayed on meta tensors of the local
    shapes, along view chains that start at a fresh value."""
    idx = {n: i for i, n in enumerate(sp.nodes)}
    copy: set[int] = set()
    layout: dict[int, torch.Tensor] = {}  # node -> its value's local layout (meta)

    def local(i: int, spec: tuple, out: int = 0) -> list[int]:
        shape = list(sp.nodes[i].meta["autopar"].outputs[out].shape)
        for p, n in zip(spec, sp.mesh.shape):
            if getattr(p, "dim", None) is not None:
                shape[p.dim] //= n
        return shape

    for i, n in enumerate(sp.nodes):
        f = n.meta["autopar"]
        if f.op not in _REPLAYED and not (i in fresh and own_storage(n)):
            continue
        st = sp.strategies[i][choice[i]]
        if i in fresh:
            if own_storage(n):
                layout[i] = torch.empty(local(i, st.outs[0]), device="meta")
                continue
            src = n.all_input_nodes[0]
            base = torch.empty(local(idx[src], st.ins[0]), device="meta")
        else:
            src = n.all_input_nodes[0] if n.all_input_nodes else None
            if src not in idx or idx[src] not in layout:
                continue
            base = layout[idx[src]]
        try:
            if f.op in _RESHAPING:
                out = base.view(local(i, st.outs[0]))
            else:
                out = n.target(base, *n.args[1:], **n.kwargs)
        except RuntimeError:  # not expressible as a view of this layout: reshape copies
            copy.add(i)
            continue
        layout[i] = out
    return copy


def _local_shape(sp: ShardingProblem, e, spec: tuple) -> tuple[int, ...]:
    shape = list(sp.nodes[e.src].meta["autopar"].outputs[e.out_idx].shape)
    for p, n in zip(spec, sp.mesh.shape):
        if isinstance(p, Shard):
            shape[p.dim] //= n
    return tuple(shape)


def _view_chain_ends(sp: ShardingProblem, live: list[tuple[int, int]]) -> list[int]:
    """For each node, the last step at which it or a view made from it (transitively) is
    read: how long a buffer a view reads stays held."""
    idx = {n: i for i, n in enumerate(sp.nodes)}
    end = [b for _, b in live]
    for i in range(len(sp.nodes) - 1, -1, -1):  # users come after their producers
        for u in sp.nodes[i].users:
            j = idx.get(u)
            if j is not None and sp.nodes[j].meta["autopar"].op in VIEW_OPS:
                end[i] = max(end[i], end[j])
    return end


def plan_choice(sp: ShardingProblem, nodes: dict) -> list[int]:
    """The strategy index of every node of ``sp`` that a plan's placements (``Plan.decided.nodes``:
    name -> ins, outs, raw_outs) pick, for :func:`step_usage` on a plan made elsewhere."""
    out = []
    for i, n in enumerate(sp.nodes):
        p = nodes[n.name]
        want = (tuple(p.ins), tuple(p.outs), tuple(p.raw_outs))
        out.append(next(k for k, s in enumerate(sp.strategies[i])
                        if (tuple(s.ins), tuple(s.outs), tuple(s.raw_outs)) == want))
    return out
