"""The planner's modes after the first, planned side by side in forked processes.

Given the first mode's plan (the seed every other mode starts from, and the problem whose
prices they share), the other modes are independent solves: a recomputing or re-gathering
mode reads nothing another of them makes. On a machine with several cores
(``SearchOptions.workers``) they run in forked children (:func:`forked_map`), each mode
planned exactly as :func:`autopar.planning.planner.make_plan` would plan it in this process,
with its share of the time left taken per worker (a worker plans its modes one after
another, as the one process would).

A child sends back its mode's run less what cannot or need not cross a pipe: the graph (the
parent made the same mode graph before forking, :func:`autopar.planning.modes.mode_graph`),
the problem's fx nodes (sent as names, found again in that graph) and the problem's price
caches (memos: the parent shares its own again, the matrix cache starts empty, as it is keyed
by the identity of the strategy lists, which a pipe does not keep).
"""

from __future__ import annotations

import copy
from typing import Any

from autopar.ir.graph import PlanGraph
from autopar.ir.mesh import Mesh
from autopar.passes.problem.types import ShardingProblem

# the problem's caches: the four keyed by spec ids (valid together on one mesh) and the
# edge matrices keyed by the identity of strategy lists
_SHARED_CACHES = ("spec_ids", "reshard_cache", "moves_cache", "table_cache")
# the strategy lists by op that later builds share (sharding_problem.build's ``prices_of``)
_LENT = "strategy_lists"


def portable(run: Any) -> Any:
    """A copy of a mode's run (anything with ``.pg`` and ``.sp``) that crosses a pipe: no
    graph, the problem's nodes as their names, its caches empty."""
    out = copy.copy(run)
    sp = copy.copy(run.sp)
    sp.nodes = [n.name for n in run.sp.nodes]
    for name in (*_SHARED_CACHES, "matrix_cache", "score_cache", "peak_cache"):
        setattr(sp, name, {})
    if hasattr(sp, _LENT):
        setattr(sp, _LENT, {})
    out.sp, out.pg = sp, None
    return out


def restored(run: Any, mpg: PlanGraph, mesh: Mesh, prices_of: ShardingProblem | None) -> Any:
    """:func:`portable`'s run made whole again in this process: ``mpg`` the mode's graph as
    made here, the problem's nodes found in it by name, ``mesh`` this process's mesh, the
    spec-keyed price caches those of ``prices_of`` (the problem every mode was built with)."""
    sp: ShardingProblem = run.sp
    by_name = {n.name: n for n in mpg.graph.nodes}
    sp.nodes = [by_name[name] for name in sp.nodes]
    sp.mesh = mesh
    if prices_of is not None and prices_of.mesh is mesh:
        for name in _SHARED_CACHES:
            setattr(sp, name, getattr(prices_of, name))
    if hasattr(prices_of, _LENT):
        setattr(sp, _LENT, getattr(prices_of, _LENT))
    run.pg = mpg
    return run


def per_worker_share(k: int, count: int, later: int, workers: int) -> int:
    """How many modes the ``k``-th of ``count`` (then ``later`` more to plan) shares the time
    left with: those still to plan on its worker, counting itself (``count - k + later`` where
    one process plans them all)."""
    return max(1, -(-(count - k + later) // max(1, workers)))


__all__ = ["per_worker_share", "portable", "restored"]
