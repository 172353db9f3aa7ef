"""Choosing the mesh shape: ``N`` devices as ``pp x dp x tp``, each shape planned, the best kept.

``autopar plan MODEL --devices N`` (and :func:`search_shapes`) enumerates the layouts
:func:`autopar.planning.mesh_shapes.mesh_shapes` allows (``tp`` inside a node, on its fast links;
``pp`` at most the model's blocks), drops those whose batch cannot be split (``dp`` must
divide it; a pipeline needs a microbatch count that keeps microbatches divisible over
``dp``), and plans every one that is left with the same planner a user's mesh gets:
:func:`autopar.planning.planner.make_plan` where ``pp = 1``, :func:`autopar.planning.pipeline.plan_pipeline`
otherwise. The search is exhaustive over shapes, so its choice is the best of the
enumeration under the cost model (a test checks it against planning each shape alone).

What keeps it short (plan times: ``benchmarks/RESULTS.md``, "Planning time"):

- each shape is planned with a short solver limit (``time_limit_s``, 1 s by default) and one
  microbatch count; the answers barely move with more time (measured: 405B's 22 shapes at
  1 s and 3 s differ by under 1% in step time, the same ranking). Each shape's planning call
  has a time limit of its own (:data:`SHAPE_LIMIT_S`); where the options carry a deadline for
  the whole search (``--time-limit``), every shape gets the same share of it instead
  (:func:`shape_limit_s`), never what the shapes before it left: under one limit spent in
  order, the shapes planned last got their first mode only, and the choice depended on their
  order and on the machine's load. A shape's planning may still run past its share (a mode
  with no plan yet goes on), so shapes not started by the whole limit are not planned;
- the traced stand-ins are shared: a trace depends only on the microbatch and the blocks
  traced, not on the submesh, so the shapes of one stand-in are planned in one process, which
  traces it once;
- a shape that no plan can fit is not planned: where every mode's least peak (each node at its
  smallest layout, :func:`autopar.planning.modes.least_need`) is over the memory limit, it
  fails at once, as planning it would (the bound is below every plan's peak);
- the shapes are planned on forked processes, one per core (:mod:`autopar.planning.parallel_map`);
- nothing is worked out twice for one shape: its memory bound, its modes' problems and the
  plan with no limit share the mesh's strategy lists, node costs and usages
  (:func:`autopar.passes.problem.sharding_problem.on_mesh`), and a choice's full score and
  step peak are kept per problem (they read no solver prices);
- inside each shape's planning, a solve whose memory limit no assignment can fit is answered
  at once (:func:`autopar.solver.problem.cannot_fit`). No shape is skipped by a lower bound on
  its step: the valid ones (each op's cheapest compute, spread evenly, a microbatch's chain
  through the stages) lie far below the best plans, whose communication and bubbles decide
  (``benchmarks/RESULTS.md``, "The mesh-shape search and plan time").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch.nn as nn

from autopar.capture.depth_proxy import longest_block_list, traced_blocks
from autopar.capture.joint import capture
from autopar.ir.deadline import Deadline
from autopar.ir.errors import PlanError
from autopar.ir.mesh import Mesh
from autopar.ir.options import SHAPE_LIMIT_S, Options
from autopar.ir.plan import Plan
from autopar.ir.units import fmt_bytes
from autopar.planning.memory_fit import memory_limit
from autopar.planning.mesh_shapes import MeshShape, mesh_shapes
from autopar.planning.modes import least_need
from autopar.planning.parallel_map import forked_map
from autopar.planning.pipeline import batch_size, microbatch_counts, plan_pipeline, stand_in_graph
from autopar.planning.planner import make_plan

QUICK_S = 1.0  # the solver's limit per solve during the search
# what a search plans each shape with where no options are given
SEARCH_OPTIONS = Options.of(time_limit_s=QUICK_S, max_layers=4)


@dataclass(frozen=True)
class ShapeResult:
    shape: MeshShape
    step_s: float  # inf where no plan fits
    mem_bytes: float
    plan: Plan | None
    note: str = ""  # why it has no plan

    @property
    def fits(self) -> bool:
        return self.plan is not None


def shape_mesh(shape: MeshShape, device: Any) -> Mesh:
    """The shape as a mesh, axes of size 1 left out (a 1-D ``dp`` mesh where all are 1)."""
    axes = [(a, n) for a, n in (("pp", shape.pp), ("dp", shape.dp), ("tp", shape.tp)) if n > 1]
    if not axes:
        return Mesh((1,), ("dp",), device)
    full = shape.mesh(device)
    keep = [full.axes.index(a) for a, _ in axes]
    return Mesh(tuple(n for _, n in axes), tuple(a for a, _ in axes), full.device,
                tuple(full.bandwidth[i] for i in keep), tuple(full.latency[i] for i in keep))


def candidate_shapes(model: nn.Module, n_devices: int, batch: int, device: Any,
                     devices_per_node: int | None = None) -> list[MeshShape]:
    """The shapes worth planning (module docstring)."""
    found = longest_block_list(model)
    n_blocks = len(found[1]) if found is not None else 1
    out = []
    for s in mesh_shapes(n_devices, n_blocks, device, devices_per_node):
        if batch % s.dp:
            continue
        if s.pp > 1:
            try:
                microbatch_counts(batch, s.dp, s.pp, None)
            except PlanError:
                continue
        out.append(s)
    if not out:
        raise PlanError(f"no layout of {n_devices} devices as pp x dp x tp splits a batch of "
                        f"{batch}: use a batch that is a multiple of the data-parallel ways, "
                        "or fewer devices")
    return out


def search_shapes(
    model: nn.Module,
    n_devices: int,
    example_inputs: tuple = (),
    example_kwargs: dict | None = None,
    device: Any = "h100",
    options: Options | None = None,
    *,
    devices_per_node: int | None = None,
    loss_fn: Callable | None = None,
    model_name: str = "",
    references_for: Callable[[MeshShape], dict[str, Any]] | None = None,
) -> list[ShapeResult]:
    """Every candidate shape planned, fastest first (those with no plan last, with why).
    ``options`` go to the planners as they are; None: :data:`SEARCH_OPTIONS` (a short solver
    limit, 4 traced layers). ``search.workers`` is the processes the shapes fan out to (each
    shape's own planning then runs on one). ``references_for``: the reference layouts to
    weigh beside each shape's plan (``--compare``; on the stage submesh for a pipeline)."""
    options = options if options is not None else SEARCH_OPTIONS
    whole = options.search.deadline  # the whole search's limit, where the caller set one
    batch = batch_size(example_inputs, example_kwargs)
    shapes = candidate_shapes(model, n_devices, batch, device, devices_per_node)
    cache: dict = {}  # traced stand-ins, in the process that plans the shapes
    prec = options.resolved_precision(Mesh((1,), ("dp",), device).device)
    max_layers = options.search.max_layers
    each = options.replace(workers=1)
    found = longest_block_list(model)
    n_blocks = len(found[1]) if found is not None else 1
    limit_s = shape_limit_s(whole, len(shapes), options.search.workers)

    def trace(s: MeshShape) -> None:
        """The shape's stand-in into ``cache``, unless there already."""
        if s.pp == 1:
            if "whole" not in cache:
                cache["whole"] = capture(model, example_inputs, example_kwargs, loss_fn,
                                         max_layers=max_layers, precision=prec)
            return
        m = microbatch_counts(batch, s.dp, s.pp, None)[0]
        stand_in_graph(model, example_inputs, example_kwargs, loss_fn, prec, batch // m,
                       math.ceil(n_blocks / s.pp), max_layers, 1.0, cache)

    def plan_one(s: MeshShape) -> ShapeResult:
        if whole is not None and whole.left() < QUICK_S:  # shapes before it overran
            return ShapeResult(s, math.inf, math.inf, None,
                               "not planned: the time limit ran out (raise --time-limit)")
        trace(s)
        mesh = shape_mesh(s, device)
        opts = replace(each, search=replace(each.search, deadline=Deadline(limit_s)))
        refs = references_for(s) if references_for is not None else None
        try:
            if s.pp == 1:
                # where no mode's leanest plan fits, make_plan has nothing to find
                limit, _ = memory_limit(opts.memory.budget, mesh.device)
                need = least_need(cache["whole"], mesh, opts.memory, limit)
                if need is not None:
                    return ShapeResult(s, math.inf, math.inf, None,
                                       f"no plan fits {fmt_bytes(limit)} per device: any plan "
                                       f"holds at least {fmt_bytes(need)}")
                planned = make_plan(model, mesh, options=opts, graph=cache["whole"],
                                    model_name=model_name, references=refs)
            else:
                planned = plan_pipeline(model, mesh, example_inputs, example_kwargs, loss_fn,
                                        opts.replace(precision=prec), model_name=model_name,
                                        microbatch_choices=1, trace_cache=cache,
                                        references=refs)
        except PlanError as e:
            return ShapeResult(s, math.inf, math.inf, None, str(e).split(";")[0])
        c = planned.plan.predicted.cost
        return ShapeResult(s, c.step_s, c.mem_bytes, planned.plan)

    # the shapes of one traced stand-in are planned together, in one process: the trace is
    # made once, there, and so are its mode graphs (planning.modes.mode_graph); the largest
    # groups go first, so the last jobs to finish are short ones
    groups = sorted(_by_stand_in(shapes, batch, n_blocks, max_layers).values(),
                    key=lambda g: -len(g))
    done = forked_map(lambda g: [plan_one(s) for s in g], groups, options.search.workers)
    results = [r for rs in done for r in rs]
    if whole is not None and whole.expired():
        whole.cut("mesh shapes planned past their share of the limit")
    order = {s: k for k, s in enumerate(shapes)}
    return sorted(results, key=lambda r: (r.step_s, order[r.shape]))


def _by_stand_in(shapes: list[MeshShape], batch: int, n_blocks: int, max_layers: int | None
                 ) -> dict[Any, list[MeshShape]]:
    """The shapes by the stand-in they are planned on: the whole step traced (``pp = 1``), or
    a stage's, which depends only on the microbatch and the blocks traced
    (:func:`autopar.planning.pipeline.stand_in_graph`'s cache key), in their order."""
    out: dict[Any, list[MeshShape]] = {}
    for s in shapes:
        if s.pp == 1:
            key: Any = "whole"
        else:
            m = microbatch_counts(batch, s.dp, s.pp, None)[0]
            key = (batch // m, traced_blocks(math.ceil(n_blocks / s.pp), max_layers))
        out.setdefault(key, []).append(s)
    return out


def shape_limit_s(whole: Deadline | None, n_shapes: int, workers: int) -> float:
    """Each shape's planning limit: :data:`SHAPE_LIMIT_S`, or where the whole search has a
    deadline, the same share of what is left of it for every shape (``n_shapes`` planned on
    ``workers`` processes at once), so that no shape's planning depends on its order."""
    if whole is None:
        return SHAPE_LIMIT_S
    rounds = math.ceil(n_shapes / max(1, workers))
    return min(SHAPE_LIMIT_S, max(QUICK_S, whole.left() / max(1, rounds)))
