"""Each parameter's ZeRO stage and offload in a solution of the sharding problem (the stages
and offload are defined in :mod:`autopar.passes.memory.zero`): what the plan records as its
``ParamState``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.fx as fx

from autopar.ir.param_state import ParamState
from autopar.ir.placements import Replicate, Shard
from autopar.passes.memory import zero

if TYPE_CHECKING:
    from autopar.ir.graph import PlanGraph
    from autopar.passes.problem.types import ShardingProblem


def param_state(pg: PlanGraph, sp: ShardingProblem, choice: list[int]) -> ParamState:
    """Each parameter's ZeRO stage in the plan ``choice`` on ``sp`` (the graph as planned,
    re-gathering applied or not), and its offload. Untraced layers of a depth proxy take the
    stage of the layer they stand for."""
    mesh = sp.mesh
    stages: dict[str, int] = {}
    axes: dict[str, tuple[str, ...]] = {}
    offloaded: list[str] = []
    offload_s = offload_bytes = 0.0
    w = sp.weight
    # per parameter placeholder: the axes its readers gather it over, in the forward and in
    # the backward (a backward op reading it afresh, or a re-gathering copy)
    gathers: dict[fx.Node, tuple[set[int], set[int]]] = {}
    for e in sp.edges:
        if e.in_idx < 0:
            continue
        root = zero.param_root(sp.nodes[e.src])
        if root is None:
            continue
        have = sp.strategies[e.src][choice[e.src]].outs[e.out_idx]
        want = sp.strategies[e.dst][choice[e.dst]].ins[e.in_idx]
        moved = {ax for ax, (a, b) in enumerate(zip(have, want))
                 if isinstance(a, Shard) and a != b}
        if moved:
            fwd, bwd = gathers.setdefault(root, (set(), set()))
            (bwd if sp.nodes[e.dst].meta["autopar"].phase == "bwd" else fwd).update(moved)
    for i, n in enumerate(sp.nodes):
        f = n.meta["autopar"]
        if f.role != "param":
            continue
        s = sp.strategies[i][choice[i]]
        spec = s.outs[0]
        if zero.OFFLOAD in s.impls:
            offloaded.append(f.param_name)
            k = float(w[i]) if w is not None else 1.0
            offload_s += zero.offload_time(f.out, spec, mesh) * k
            offload_bytes += zero.offload_saving(f.out, spec, mesh) * k
        fwd, bwd = gathers.get(n, (set(), set()))
        repeated = {ax for ax, p in enumerate(spec)
                    if isinstance(p, Replicate) and mesh.shape[ax] > 1}
        if fwd or bwd:
            stage = 3 if bwd else (1 if sp.zero1 else 2)
            on = fwd | bwd
        elif repeated:
            stage, on = 0, repeated
        else:
            continue  # split on every axis and read split: tensor parallel, no ZeRO stage
        stages[f.param_name] = stage
        axes[f.param_name] = tuple(mesh.axes[ax] for ax in sorted(on))
    if pg.proxy is not None:
        stages = {p: stages[pg.proxy.traced_name(p)] for p in pg.all_param_names
                  if pg.proxy.traced_name(p) in stages}
        axes = {p: axes[pg.proxy.traced_name(p)] for p in stages}
        traced = set(offloaded)
        offloaded = [p for p in pg.all_param_names if pg.proxy.traced_name(p) in traced]
    regathered = any("recomputes" in n.meta["autopar"].extra and zero.is_param_view(n)
                     for n in sp.nodes)
    return ParamState(stages, axes, tuple(offloaded), offload_s, offload_bytes, regathered,
                      sp.zero1)
