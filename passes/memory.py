"""Liveness and peak memory per device over the traced step.

Nodes run in graph order. A tensor is live from the op that makes it to its last reader; a view
shares its base's storage, so the base stays live as long as any of its views is read.
Parameters (with their gradients and optimizer state) and the step's outputs live throughout.
"""

from __future__ import annotations

import numpy as np
import torch.fx as fx

from autopar.passes.cost_model import VIEW_OPS


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
