"""Liveness and peak memory per device over the traced step.

Nodes run in graph order. A tensor is live from the op that makes it to its last reader; a view
shares its base's storage, so the base stays live as long as any of its views is read.
Parameters (with their gradients and optimizer state) and the step's outputs live throughout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch.fx as fx

from autopar.passes.cost_model import VIEW_OPS

if TYPE_CHECKING:
    from autopar.passes.sharding_problem import ShardingProblem


def live_intervals(nodes: list[fx.Node]) -> list[tuple[int, int]]:
    """``[start, end]`` (inclusive) step indices during which each node's output is held."""
    idx = {n: i for i, n in enumerate(nodes)}
    horizon = len(nodes)
    root = list(range(len(nodes)))
    for i, n in enumerate(nodes):
        facts = n.meta["autopar"]
        if facts.op in VIEW_OPS and n.all_input_nodes:
            src = n.all_input_nodes[0]
            if src in idx:
                root[i] = root[idx[src]]
    end = list(range(len(nodes)))
    for i, n in enumerate(nodes):
        facts = n.meta["autopar"]
        last = i
        for u in n.users:
            last = max(last, idx[u] if u in idx else horizon)  # the graph output: held to the end
        if facts.role in ("param", "buffer", "grad", "loss"):
            last = horizon
        r = root[i]
        end[r] = max(end[r], last)
        end[i] = max(end[i], last)
    return [(0 if nodes[i].op == "placeholder" else i, end[i]) for i in range(len(nodes))]


def peak_memory(
    usage_per_node: list[float], live: list[tuple[int, int]]
) -> tuple[float, int]:
    """Peak of the summed usage over time, and the step at which it happens."""
    horizon = max((b for _, b in live), default=0) + 2
    delta = np.zeros(horizon + 1)
    for u, (a, b) in zip(usage_per_node, live):
        if u:
            delta[a] += u
            delta[b + 1] -= u
    curve = np.cumsum(delta)
    t = int(np.argmax(curve))
    return float(curve[t]), t


def step_usage(sp: ShardingProblem, choice: list[int]
               ) -> tuple[list[float], list[tuple[int, int]]]:
    """Everything one step holds under a complete assignment, as ``(bytes, interval)`` lists
    for :func:`peak_memory`: each node's output (``sp.usage``) and the buffers that exist only
    because two layouts differ, which a per-node usage cannot see:

    * a reshard's result (a gathered parameter, a resharded activation) lives while its
      reader runs; where the reader is a view, as long as the view and the views of it (the
      forward's ``t(weight)`` read again by the backward keeps the gathered weight); the
      parameters one layer's ops gather in one phase are gathered once, so counted once;
    * a gradient bucket is a flat copy of its gradients, made when its last one exists.
    """
    from autopar.passes.buckets import GradSync, first_bucket_bytes, gather_move, sync_groups
    from autopar.passes.cost_model import activation_bytes
    from autopar.passes.edge_costs import gather_unit, is_param_gather

    weight = sp.weight if sp.weight is not None else np.ones(len(sp.nodes))
    usage = [float(sp.usage[i][s]) for i, s in enumerate(choice)]
    live = list(sp.live)
    view_end = _view_chain_ends(sp)
    copies: dict[tuple, list] = {}  # one buffer per key: [bytes, start, end]
    syncs: list[GradSync] = []
    for e in sp.edges:
        src = sp.strategies[e.src][choice[e.src]].outs[e.out_idx]
        dst_s = sp.strategies[e.dst][choice[e.dst]]
        dst = dst_s.outs[0] if e.in_idx < 0 else dst_s.ins[e.in_idx]
        if src == dst:
            continue
        meta = sp.nodes[e.src].meta["autopar"].outputs[e.out_idx]
        if e.in_idx < 0:
            syncs.append(GradSync(e.src, meta, src, dst, float(weight[e.dst])))
            continue
        n = sp.nodes[e.dst]
        if n.meta["autopar"].op == "getitem":
            continue  # a multi-output op's piece: moved where it is read, counted there
        shared = is_param_gather(sp, e) and gather_move(src, dst) is not None
        key = (e.src, e.out_idx, dst, gather_unit(n) if shared else e.dst)
        end = view_end[e.dst] if n.meta["autopar"].op in VIEW_OPS else e.dst
        nbytes = activation_bytes(meta, dst, sp.mesh) * float(weight[e.dst])
        slot = copies.setdefault(key, [nbytes, e.dst, end])
        slot[1], slot[2] = min(slot[1], e.dst), max(slot[2], end)
    for nbytes, a, b in copies.values():
        usage.append(nbytes)
        live.append((a, b))
    for group, kind in sync_groups(syncs, sp.mesh.shape,
                                   first_bytes=first_bucket_bytes(sp.mesh.device)):
        if kind is None:
            continue  # moved alone: its result replaces it
        t = max(g.index for g in group)
        usage.append(sum(activation_bytes(g.meta, g.src, sp.mesh) * g.weight for g in group))
        live.append((t, t))
    return usage, live


def _view_chain_ends(sp: ShardingProblem) -> list[int]:
    """For each node, the last step at which it or a view made from it (transitively) is
    read: how long a buffer a view reads stays held."""
    idx = {n: i for i, n in enumerate(sp.nodes)}
    end = [b for _, b in sp.live]
    for i in range(len(sp.nodes) - 1, -1, -1):  # users come after their producers
        for u in sp.nodes[i].users:
            j = idx.get(u)
            if j is not None and sp.nodes[j].meta["autopar"].op in VIEW_OPS:
                end[i] = max(end[i], end[j])
    return end


def plan_choice(sp: ShardingProblem, nodes: dict) -> list[int]:
    """The strategy index of every node of ``sp`` that a plan's placements (``Plan.nodes``:
    name -> ins, outs, raw_outs) pick, for :func:`step_usage` on a plan made elsewhere."""
    out = []
    for i, n in enumerate(sp.nodes):
        p = nodes[n.name]
        want = (tuple(p.ins), tuple(p.outs), tuple(p.raw_outs))
        out.append(next(k for k, s in enumerate(sp.strategies[i])
                        if (tuple(s.ins), tuple(s.outs), tuple(s.raw_outs)) == want))
    return out
