"""Data parallelism as an assignment of the sharding problem, made without a solve.

The planner weighs it as a candidate plan beside the solver's (``planner._data_parallel``),
so no plan is slower than data parallelism. Where a model's axis steps are too wide to
eliminate (one block applied at every layer ties each layer to the shared weights: ALBERT, a
universal transformer) the sweeps skip them, and the general solver's moves, a few variables
at a time, cannot reach a layout every node must switch to at once: such a model planned 4x
slower than data parallelism on a 2 x 2 mesh. The layout: weights whole, the inputs split on
their first dim over every mesh axis, and every other node completed greedily in program
order (each takes its cheapest strategy given the nodes before it: with whole weights and
split inputs that keeps the batch split through the graph, the layout a user would write by
hand). A few milliseconds.
"""

from __future__ import annotations

from autopar.ir.placements import R, Shard
from autopar.passes.problem.types import ShardingProblem
from autopar.solver.heuristic import LocalSearch
from autopar.solver.problem import restrict
from autopar.solver.reduce import FORBIDDEN


def data_parallel_assignment(sp: ShardingProblem) -> tuple[int, ...] | None:
    """An assignment of ``sp.problem``'s variables that is data parallelism: parameters
    replicated, each input split on dim 0 over as many mesh axes as its strategies offer
    (all of them where the batch divides), the rest completed greedily. None where the
    problem's shared variables admit no such layout (a variable whose nodes' pins disagree)."""
    assert sp.problem is not None and sp.var_of is not None
    allowed: dict[int, set[int]] = {}
    for i, node in enumerate(sp.nodes):
        meta = node.meta["autopar"]
        if node.op == "placeholder" and meta.role == "param":
            ok = {k for k, s in enumerate(sp.strategies[i]) if all(x == R for x in s.outs[0])}
        elif meta.role == "input" and meta.out is not None and len(meta.out.shape) > 0:
            ok = _batch_split(sp.strategies[i])
        else:
            continue
        if not ok:
            continue
        v = int(sp.var_of[i])
        allowed[v] = allowed[v] & ok if v in allowed else ok
        if not allowed[v]:
            return None
    if not allowed:
        return None
    sub, maps = restrict(sp.problem, {v: sorted(a) for v, a in allowed.items()})
    greedy = LocalSearch(sub, 0, FORBIDDEN)
    greedy.greedy()
    return tuple(int(maps[v][s]) for v, s in enumerate(greedy.a.tolist()))


def _batch_split(strategies: list) -> set[int]:
    """The strategies whose output splits dim 0 on the most mesh axes (and is whole on the
    others); empty where none splits it at all."""
    def axes(spec: tuple) -> int:
        if not all(x == R or x == Shard(0) for x in spec):
            return -1
        return sum(x == Shard(0) for x in spec)

    counts = [axes(s.outs[0]) for s in strategies]
    most = max(counts, default=0)
    return {k for k, c in enumerate(counts) if c == most} if most > 0 else set()
