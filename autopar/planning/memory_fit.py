"""The memory limit a plan is held to, and what to tell a user when no plan fits it.

With no budget given, a plan must fit the device profile's capacity less its reserve
(:attr:`autopar.ir.devices.DeviceProfile.memory_limit`: the framework's own buffers and the
allocator's fragmentation); ``math.inf`` lifts the limit. When nothing fits, the error gives
the smallest limit that would fit with recomputation and sharding at their leanest and the
option that would help most, sized.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from autopar.ir.devices import DeviceProfile
from autopar.ir.options import check_budget
from autopar.ir.units import fmt_bytes
from autopar.solver.problem import least_peak_usage

if TYPE_CHECKING:
    from autopar.ir.graph import PlanGraph
    from autopar.ir.mesh import Mesh
    from autopar.passes.problem.types import ShardingProblem


def memory_limit(budget: float | None, device: DeviceProfile) -> tuple[float | None, str]:
    """The per-device limit and where it came from (for the plan's record and table)."""
    if budget is None:
        return device.memory_limit, (f"{device.name}'s {fmt_bytes(device.mem_capacity)} less "
                                     f"a {fmt_bytes(device.memory_reserve)} reserve")
    budget = check_budget(budget)
    if math.isinf(budget):
        return None, "unlimited"
    return budget, "given"


# said where the leanest layouts of single tensors fit the limit and the search found no plan
# that does (cut short by the time limit or not), as against no layout fitting at all
NOT_COMBINED = "the leanest layouts of single tensors do not always combine into one plan"


def leanest(sp: ShardingProblem) -> tuple[float, float]:
    """(peak, of which parameter state) per device with every node at its smallest layout: no
    plan's peak on this problem is lower."""
    from autopar.passes.memory.peak import peak_memory

    usage = [float(u.min()) for u in sp.usage]
    peak, _ = peak_memory(usage, sp.live)
    state = sum(u for u, n in zip(usage, sp.nodes) if n.meta["autopar"].role == "param")
    return peak, state


def _proven_need(sp: ShardingProblem) -> tuple[float, float]:
    """:func:`leanest`'s (peak, state), the peak raised to what the problem's constrained
    instant needs at least (the reduced problem's leanest usage there, which no plan's usage
    at that instant is below): the per-node minima of a mode can all fit where no layout of
    its variables (groups of nodes chosen together) does at once, and a mode whose
    constrained instant is over the limit was proven infeasible, not cut short."""
    need, state = leanest(sp)
    if sp.problem is not None:
        need = max(need, least_peak_usage(sp.problem))
    return need, state


def no_fit_message(pg: PlanGraph, mesh: Mesh, limit: float | None, source: str,
                   runs: dict[Any, Any], time_limit_s: float, cut: bool = True) -> str:
    """Why nothing fits: the leanest need (recomputing everything a layer makes, parameters
    gathered again in the backward, every tensor at its most sharded layout, the optimizer
    state offloaded where that was tried), and the option that helps most, sized. ``cut``:
    the time limit stopped some of the search short (then more time is the first advice)."""
    from autopar.passes.problem import sharding_problem
    from autopar.planning.modes import Mode, mode_graph

    # the leanest of the modes tried (with the optimizer state offloaded where that was
    # tried too), full recomputation among them (a mode whose problem another mode's
    # already was is not planned again, so "full" may stand under another name)
    tried = [r.sp for r in runs.values()]
    if not any(m.recompute == "full" for m in runs):
        tried.append(sharding_problem.build(mode_graph(pg, Mode("full", regather=True)), mesh,
                                            limit))
    need, state = min(_proven_need(p) for p in tried)
    acts = max(need - state, 0.0)
    lim = limit or float("inf")
    where = "" if source == "given" else f" ({source})"
    kind = "budget" if source == "given" else "limit"
    msg = (f"no plan fits the memory {kind} of {fmt_bytes(lim)} per device{where} on mesh "
           f"{mesh.describe()}: with recomputation and sharding at their leanest it needs "
           f"about {fmt_bytes(need)} ({fmt_bytes(state)} of parameters, gradients and "
           f"optimizer state, {fmt_bytes(acts)} of activations). ")
    if need <= lim:  # the per-node minima fit: the solver found no consistent plan that does
        if cut:
            return msg + (f"No plan found fits within --time-limit {time_limit_s:g} s "
                          f"({NOT_COMBINED}): "
                          "raise --time-limit, or make room with a smaller batch or more "
                          "devices")
        # the search ended by its own rounds, not the clock: more time would not find one
        return msg + ("The search found no plan that fits, before its time limit "
                      f"({NOT_COMBINED}): "
                      "make room with a smaller batch or more devices, or raise "
                      "--memory-budget")
    batch = _batch(pg)
    devices = mesh.size * math.ceil(need / lim) if lim > 0 else mesh.size
    more = (f"{devices} devices or more (the state shards over all of them, the activations "
            "over the batch)")
    if state >= lim:
        return msg + (f"The state alone exceeds the limit: use {more}; or raise "
                      f"--memory-budget to {fmt_bytes(need)}")
    fit_batch = int(batch * (lim - state) / acts) if batch and acts > 0 else 0
    options = []
    if batch and fit_batch >= 1:
        options.append(f"a batch of {fit_batch} or less (activations grow with it)")
    options.append(more)
    options.append("a pp axis once pipelines exist (each stage holds its layers only)")
    first = "Most helpful: " + options[0] if state < acts else "Most helpful: " + more
    rest = [o for o in options if o not in first]
    return msg + first + "; or " + "; or ".join(rest) + \
        f"; or raise --memory-budget to {fmt_bytes(need)}"


def _batch(pg: PlanGraph) -> int:
    for n in pg.graph.nodes:
        f = n.meta.get("autopar")
        if f is not None and f.role == "input" and f.out is not None and f.out.shape:
            return int(f.out.shape[0])
    return 0

