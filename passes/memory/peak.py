"""Liveness and peak memory per device over the traced step.

Nodes run in graph order. A tensor is live from the op that makes it to its last reader; a view
shares its base's storage, so the base stays live as long as any of its views is read. Each
output of a multi-output op that makes separate storages (a layer norm's result, mean and
rstd) lives on its own, from the op to its own last reader (:func:`own_storage`).
Parameters (with their gradients and optimizer state) and the step's outputs live throughout.
What a solution of the sharding problem adds to this (reshard copies, gathered parameters,
gradient buckets) is :func:`autopar.passes.problem.step_memory.step_usage`.
"""

from __future__ import annotations

import numpy as np
import torch.fx as fx

from autopar.passes.cost.cost_model import VIEW_OPS


def live_intervals(nodes: list[fx.Node], moved: frozenset[int] | set[int] = frozenset()
                   ) -> list[tuple[int, int]]:
    """``[start, end]`` (inclusive) step indices during which each node's output is held.
    ``moved``: indices of views whose input is resharded into a copy first (a layout
    choice, known to :func:`autopar.passes.problem.step_memory.step_usage`): such a view
    aliases the copy, not its input."""
    idx = {n: i for i, n in enumerate(nodes)}
    horizon = len(nodes)
    root = list(range(len(nodes)))
    start = [0 if n.op == "placeholder" else i for i, n in enumerate(nodes)]
    for i, n in enumerate(nodes):
        facts = n.meta["autopar"]
        if facts.op in VIEW_OPS and n.all_input_nodes:
            src = n.all_input_nodes[0]
            if src not in idx or i in moved:
                continue
            if own_storage(n):
                start[i] = start[idx[src]]  # made by its op, held on its own
            else:
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
    return [(start[i], end[i]) for i in range(len(nodes))]


def own_storage(n: fx.Node) -> bool:
    """Whether ``n`` is one output of a multi-output op that makes each output in a storage
    of its own (``native_layer_norm``'s normalized input, mean and rstd; a backward's grads),
    not a view of one base (``split``): such an output is freed after its own last reader,
    whatever its siblings do. (Under bf16 the layer norm's fp32 output dies at its cast while
    its mean and rstd wait for the backward.)"""
    if n.meta["autopar"].op != "getitem" or not n.all_input_nodes:
        return False
    src = n.all_input_nodes[0].meta.get("autopar")
    return src is not None and src.op not in VIEW_OPS


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
