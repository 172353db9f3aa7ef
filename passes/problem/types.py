"""The sharding problem's data: the graph's nodes with their strategies, costs and memory use,
the edges between them, the caches of their prices, and what the reductions and the solver
make of it (built by :func:`autopar.passes.problem.sharding_problem.build`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.fx as fx

from autopar.ir.errors import PlanError
from autopar.ir.mesh import Mesh
from autopar.ir.plan import NodePlacement
from autopar.passes.strategies.registry import Strategy
from autopar.solver.problem import Problem


@dataclass(slots=True)
class Edge:
    src: int  # producer node index
    dst: int  # consumer node index
    out_idx: int  # which output of the producer
    in_idx: int  # which tensor input of the consumer (-1: gradient tied to its parameter)
    # the consumer writes that input in place (a buffer's running stats): the value must reach
    # it as it is, or the write would land on a copy (edge_costs forbids every reshard)
    written: bool = False
    # runs once per step, not once per microbatch (a pipeline stage's gradient sync, and the
    # gather of a parameter held whole across the microbatches): weighed 1/microbatches
    once: bool = False


@dataclass
class ShardingProblem:
    mesh: Mesh
    nodes: list[fx.Node]
    strategies: list[list[Strategy]]
    node_cost: list[np.ndarray]
    usage: list[np.ndarray]  # bytes per device per strategy (param: + grad + Adam state)
    edges: list[Edge]
    missing_rules: dict[str, int]  # op name -> count of nodes planned replicated
    unary: dict[int, np.ndarray] = field(default_factory=dict)  # communication tied to one node
    group_cost: list[np.ndarray] = field(default_factory=list)  # root: its group's total cost
    reshard_cache: dict = field(default_factory=dict, repr=False)
    # (route key, src id, dst id) -> the pair's cost_model.Move list (edge_costs)
    moves_cache: dict = field(default_factory=dict, repr=False)
    # a tensor's whole resharding table between two spec lists (edge_costs._reshard_table)
    table_cache: dict = field(default_factory=dict, repr=False)
    # spec -> int, the ids the caches are keyed by: reset or share the four together
    spec_ids: dict = field(default_factory=dict, repr=False)
    matrix_cache: dict = field(default_factory=dict, repr=False)
    # a choice (tuple) -> its full score (problem/bucket_fill.score): that score depends on
    # the choice and on what the build fixed, not on the solver's prices, and a mode's plan,
    # its refinement and its references are scored again round after round
    score_cache: dict = field(default_factory=dict, repr=False)
    # a choice (tuple) -> the step's peak and its instant (problem/step_memory.step_peak)
    peak_cache: dict = field(default_factory=dict, repr=False)
    # (bucket kind, axes, dtype) -> bytes its gradient buckets hold, where a solution found
    # them under-full (problem/bucket_fill.py); absent: full buckets
    bucket_fill: dict = field(default_factory=dict)
    share_layers: bool = True  # identical layers share one solver variable per node
    # the dtype gradients are summed across ranks in, where it is not their own (a mixed
    # precision plan reducing in bf16): gradient syncs are priced in it
    grad_dtype: torch.dtype | None = None
    loss_scaling: bool = False  # fp16: the step all-reduces an overflow flag (problem/scoring.py)
    # ZeRO-1: gradients of split parameters are all-reduced whole, then sliced
    # (memory/zero.py grad_target); priced and run so
    zero1: bool = False
    loss_index: int = -1  # the loss node (reported whole on every rank)
    # a pipeline stage's output and input gradient: (node, the layout each leaves in)
    boundary: list[tuple[int, tuple]] = field(default_factory=list)
    weight: np.ndarray | None = None  # real layers each node stands for (depth proxy)
    in_flight: float = 1.0  # microbatches whose kept activations a rank holds (pipelines)
    microbatches: int = 1  # per step (pipelines): an edge marked ``once`` weighs 1/this
    peak_time: int = 0
    live: list[tuple[int, int]] = field(default_factory=list)
    # reduction results
    group_of: np.ndarray | None = None  # node -> group root node
    follow: list[np.ndarray] = field(default_factory=list)  # node: root strategy -> own strategy
    var_of: np.ndarray | None = None  # node -> solver variable
    var_root: list[int] = field(default_factory=list)  # variable -> its template root node
    problem: Problem | None = None
    shared_layers: int = 0

    def strategy_index(self, i: int, place: NodePlacement) -> int:
        """Which of node ``i``'s strategies places it as a plan's ``place`` does."""
        want = (place.ins, place.outs, place.impls, place.raw_outs)
        for k, s in enumerate(self.strategies[i]):
            if (s.ins, s.outs, s.impls, s.raw_outs) == want:
                return k
        raise PlanError(f"node {self.nodes[i].name}: the plan's placement is none of its "
                        "strategies; was the plan made for this graph?")

    def expand(self, assignment: tuple[int, ...] | list[int]) -> list[int]:
        """Strategy index of every node from one strategy per solver variable."""
        assert self.var_of is not None and self.group_of is not None
        out = []
        for i in range(len(self.nodes)):
            v = self.var_of[i]
            root = self.group_of[i]
            # a shared variable is solved on its template root; a group in another layer uses
            # the same strategy index at its own root (the strategy lists are identical)
            s_root = assignment[v]
            out.append(int(self.follow[i][s_root]) if root != i else int(s_root))
        return out
