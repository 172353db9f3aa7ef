"""Why did a node get its strategy? Compare it with every alternative, all else fixed.

The explanation works on the solver's variable that owns the node (its follower group, shared
by every repeated layer): for each strategy of that variable it shows what the step would cost
(compute in the group, resharding on the edges around it) if only that choice changed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from autopar.ir.units import fmt_time
from autopar.solver.problem import evaluate

if TYPE_CHECKING:
    from collections.abc import Sequence

    from autopar.ir.depth import DepthProxy
    from autopar.passes.problem.types import ShardingProblem


def explain_node(sp: ShardingProblem, proxy: DepthProxy | None, assignment: Sequence[int],
                 node_choice: list[int], node: str, top: int = 5) -> str:
    """``node`` (or a parameter's name) in the solved problem ``sp``: the solver's
    ``assignment`` (one strategy per variable) and its expansion ``node_choice`` (one per
    node); ``proxy``: the depth proxy the graph was traced with, if any."""
    names = [n.name for n in sp.nodes]
    if node not in names:
        params = {n.meta["autopar"].param_name: n.name for n in sp.nodes
                  if n.meta["autopar"].param_name and n.op == "placeholder"}
        if proxy is not None:  # a layer that was not traced: its stand-in
            node = proxy.traced_name(node)
        if node not in params:
            raise KeyError(f"no node or parameter named {node!r} in the plan's graph")
        node = params[node]
    i = names.index(node)
    assert sp.var_of is not None and sp.group_of is not None and sp.problem is not None
    v = int(sp.var_of[i])
    root = int(sp.group_of[i])
    base = np.asarray(assignment)
    p = sp.problem
    base_cost = evaluate(p, base)[0]
    members = int(np.sum(sp.var_of == v))
    f = sp.nodes[i].meta["autopar"]
    chosen = sp.strategies[i][node_choice[i]]
    lines = [
        f"{node}{f' (parameter {f.param_name})' if f.param_name else ''}: {f.op} -> "
        f"{', '.join(repr(m) for m in f.outputs if m)}",
        f"  chosen: {chosen}",
        f"  decided by variable {v} (root {sp.nodes[root].name}; it covers {members} graph "
        f"nodes{', shared by repeated layers' if sp.shared_layers else ''})",
        "  alternatives, all other choices fixed (step time change):",
    ]
    deltas = []
    for s in range(len(p.costs[v])):
        alt = base.copy()
        alt[v] = s
        cost, feasible, _ = evaluate(p, alt)
        deltas.append((cost - base_cost, s, feasible))
    deltas.sort()
    for d, s, feasible in deltas[: top + 1]:
        own = sp.strategies[i][sp.follow[i][s]] if root != i else sp.strategies[i][s]
        mark = "  <- chosen" if s == base[v] else ""
        fits = "" if feasible else "  (over the memory budget)"
        lines.append(f"    {'+' if d >= 0 else '-'}{fmt_time(abs(d)):>10}  {own}{mark}{fits}")
    return "\n".join(lines)
