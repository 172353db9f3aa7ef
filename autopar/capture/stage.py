"""Stage capture: the joint graph of one pipeline stage, and its boundary layouts on a mesh.

A pipeline stage is not a training step: ``y = stage(x)`` ends in an activation sent to the
next stage, not in a loss, and its backward starts from the gradient of ``y`` that the next
stage sends back. :func:`capture_stage` traces

    y = stage(x);  grads, dx = autograd.grad(y, params + [x], grad_outputs=g)

into a :class:`PlanGraph` whose inputs are ``(x, g)`` and whose outputs are ``(y, *grads,
dx)``. The first stage reads token ids (no ``dx``); the last computes the loss from its output
and the targets (``loss_fn``; no ``g``: its backward starts from ``ones_like(loss)`` as a
whole step's does). Everything else is the ordinary capture's: phases, roles, layer tags
(the stage's blocks, given), so the strategies, cost model, memory model and solver plan a
stage unchanged. ``pg.stage`` (:class:`autopar.ir.graph.StageIO`) names the boundary nodes and
``pg.loss_node`` is the stage's output.

Two stages agree on the tensor between them only if both place it alike, so its layout is
pinned, not planned: :func:`pin_boundary` fixes every input of a stage (activation, its
gradient, token ids, targets) to :func:`boundary_spec`, the batch split over the ``dp`` axis
and whole on the others (Megatron sends whole activations between its stages too). The
planner then prices moving the output into that layout and the input's gradient into the
input's (:mod:`autopar.passes.problem.stage_boundary`), and the runtime moves them so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from autopar.capture.joint import StageMode, trace_joint
from autopar.ir.errors import PlanError
from autopar.ir.graph import PlanGraph
from autopar.ir.mesh import Mesh
from autopar.ir.placements import Replicate, Shard, Spec, evenly_divides, spec_str
from autopar.ir.precision import Precision

BATCH_AXIS = "dp"  # the mesh axis a stage's boundary tensors split their batch over


@dataclass(frozen=True, slots=True)
class StageInputs:
    """The global micro-batch a stage receives (every dp share), shapes and dtypes: its
    example inputs for capture."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]

    def examples(self) -> tuple[torch.Tensor, ...]:
        return tuple(torch.empty(s, dtype=getattr(torch, d), device="meta")
                     for s, d in zip(self.shapes, self.dtypes))


def trace_stage(stage: nn.Module, inputs: StageInputs, last: bool, loss_fn: Callable,
                block_path: str, precision: Precision | None = None) -> PlanGraph:
    """The joint graph (:func:`capture_stage`) of a pipeline stage module whose blocks are
    ``block_path`` (in its ``order`` where it has one), the loss computed on the last, traced
    under ``precision``'s policy (None: fp32)."""
    holder = stage.get_submodule(block_path)
    blocks = [holder[k] for k in getattr(stage, "order", list(holder.keys()))]
    return capture_stage(stage, inputs.examples(), loss_fn if last else None, blocks,
                         precision)


def capture_stage(
    stage: nn.Module,
    example_inputs: Sequence[torch.Tensor],
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
    blocks: Sequence[nn.Module] = (),
    precision: Precision | None = None,
) -> PlanGraph:
    """Trace one pipeline stage's forward and backward into a :class:`PlanGraph`.

    ``example_inputs``: what the stage receives, the global micro-batch (every data-parallel
    share): token ids or a floating-point activation; with ``loss_fn``, the targets after it.
    Without ``loss_fn`` the stage's output is sent on and the step takes its gradient as one
    more input; with it, the step computes ``loss_fn(stage(x), targets)``, a scalar. A
    floating-point first input gets its gradient returned as the step's last output.
    ``blocks``: the stage's repeated blocks, tagged as layers (repeated layers share the
    solver's variables)."""
    example_inputs = tuple(example_inputs)
    if not example_inputs:
        raise PlanError("a pipeline stage needs its input: pass example_inputs=(x,) (token ids "
                        "or the previous stage's activation)")
    if loss_fn is not None and len(example_inputs) < 2:
        raise PlanError("the last stage computes loss_fn(output, target): pass "
                        "example_inputs=(x, targets)")
    mode = StageMode(input_grad=example_inputs[0].is_floating_point(),
                     seeded=loss_fn is None, blocks=tuple(blocks))
    pg = trace_joint(stage, example_inputs, None, loss_fn, precision or Precision(), mode)
    pg.all_param_names = list(pg.param_names)
    pg.precision = precision or Precision()
    return pg


def output_meta(pg: PlanGraph) -> Any:
    """The tensor meta (shape, dtype) of a stage graph's output: the activation it sends on,
    or the loss on the last stage."""
    return next(n for n in pg.graph.nodes if n.name == pg.loss_node).meta["autopar"].out


def boundary_spec(shape: Sequence[int], mesh: Mesh) -> Spec:
    """The layout of a tensor crossing between stages: dim 0 (the batch) split over ``dp``
    where the mesh has that axis and the batch divides, whole on every other axis."""
    spec = tuple(Shard(0) if ax == BATCH_AXIS and n > 1 and len(shape) > 0 else Replicate()
                 for ax, n in zip(mesh.axes, mesh.shape))
    if not evenly_divides(tuple(shape), spec, mesh.shape):
        n = mesh.axis_size(BATCH_AXIS)
        raise PlanError(
            f"a stage's micro-batch of {shape[0]} rows does not split over {BATCH_AXIS}={n}: "
            f"use a batch that is a multiple of {n} x the number of micro-batches")
    return spec


def pin_boundary(pg: PlanGraph, mesh: Mesh, params: dict[str, Spec] | None = None
                 ) -> PlanGraph:
    """``pg`` (a stage's graph) with every input pinned to :func:`boundary_spec` on ``mesh``,
    and ``params`` (name -> spec) pinned too: a weight two stages share (a tied embedding and
    head) must be placed alike on both, its gradient copies summed piece by piece. Parameters
    ``pg`` has pinned already stay pinned unless ``params`` names them. The graph itself is
    shared, not copied."""
    if pg.stage is None:
        raise PlanError("pin_boundary takes a pipeline stage's graph (capture_stage), not a "
                        "whole training step's")
    params_of = {n.name for n in pg.graph.nodes if n.op == "placeholder"
                 and n.meta["autopar"].role == "param"}
    pins: dict[str, Spec] = {k: v for k, v in pg.pins.items() if k in params_of}
    for n in pg.graph.nodes:
        f = n.meta["autopar"]
        if n.op != "placeholder":
            continue
        if f.role == "input" and f.out is not None:
            pins[n.name] = boundary_spec(f.out.shape, mesh)
        elif f.role == "param" and params and f.param_name in params:
            spec = tuple(params[f.param_name])
            if len(spec) != mesh.ndim or not evenly_divides(f.out.shape, spec, mesh.shape):
                raise PlanError(
                    f"parameter {f.param_name} cannot be pinned to {spec_str(spec)} on mesh "
                    f"{mesh.describe()}: give a spec of one placement per axis that divides "
                    f"its shape {list(f.out.shape)}")
            pins[n.name] = spec
    return dataclasses.replace(pg, pins=pins)
