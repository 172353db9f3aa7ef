"""ZeRO stages and optimizer-state offload: how a plan keeps each parameter's state.

A parameter's placeholder in the traced step is what the optimizer updates (its master copy,
fp32 under mixed precision), placed as the plan stores it; its optimizer state inherits that
placement (DESIGN: the optimizer sees DTensor parameters). Where the plan stores it split over
a mesh axis that its readers need whole, the step gathers it there (one all-gather per layer
and phase, :mod:`autopar.runtime.param_gather`). That gives the ZeRO stages, per parameter:

- **stage 0** (data parallel): stored whole on an axis of size > 1; the state is repeated on
  every rank of it. Gradients are all-reduced.
- **stage 1**: stored split, gathered once per step where the forward first reads it and held
  until the backward's last read (the parameters stay whole through the step); gradients
  all-reduced whole, each rank keeping its own part for its optimizer step. The whole
  gradient is held to the step's end, and an all-reduce moves twice a reduce-scatter's bytes:
  without gradient accumulation (where ZeRO-1 syncs once per accumulated step) it costs more
  time and memory than stage 2, so the planner weighs it and keeps it only when asked for.
- **stage 2**: as stage 1, gradients reduce-scattered as the backward makes them (each rank
  receives only its part).
- **stage 3** (FSDP): as stage 2, but the gathered copy is dropped after the forward and
  gathered again in the backward (:func:`regather_nodes`): the gathered parameters of one
  layer are live at a time, for one more all-gather per step.

Which of 0, 2, 3 a parameter gets is the solver's placement plus the planner's choice of
re-gathering (tried as the recomputation modes are, :mod:`autopar.planning.planner`); a tensor-parallel
axis, on which the parameter is read split, needs no gather and no stage.

**Offload** (:func:`offload_time`): a parameter's optimizer state (Adam's two fp32 moments)
kept in host memory, as ZeRO-Offload does. Each step its gradient goes to the host, the host
runs the optimizer step on its part, and the updated parameter comes back: priced with the
device profile's host link and host memory bandwidth, never overlapped (conservative), and
offered to the solver only where no plan fits without it (a parameter strategy variant that
holds no state on the device, ``impls == ("offload",)``): it saves memory, never time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.fx as fx

from autopar.ir.placements import Partial, Replicate, Shard
from autopar.passes.cost.cost_model import ADAM_STATE_BYTES_PER_PARAM, VIEW_OPS, num_shards
from autopar.passes.memory.recompute import needed_in_backward

if TYPE_CHECKING:
    from autopar.ir.graph import PlanGraph, TensorMeta
    from autopar.ir.mesh import Mesh
    from autopar.ir.placements import Spec

OFFLOAD = "offload"  # the impl tag of a parameter strategy whose optimizer state is on the host
# bytes the host's optimizer step reads and writes per element: Adam reads the fp32 parameter,
# gradient and two moments and writes back the parameter and the moments
HOST_STEP_BYTES_PER_ELEM = 28.0


def regather_nodes(pg: PlanGraph) -> list[str]:
    """The forward nodes that only view or cast a parameter (``t(weight)``, the weight's cast
    to the compute dtype) and that the backward reads: copied into the backward
    (:func:`autopar.passes.memory.recompute.apply_recompute`), they make the backward read the
    parameter afresh, so a sharded one is gathered again there and the forward's gathered
    copy is freed after its last forward reader (ZeRO-3). Without it the backward reads the
    forward's view, which keeps the gathered copy alive from the forward to the backward."""
    chosen: set[str] = set()
    for n in pg.graph.nodes:
        f = n.meta.get("autopar")
        if f is None or n.op != "call_function" or f.phase != "fwd" or f.layer is None:
            continue
        ins = n.all_input_nodes
        if not ins:
            continue
        src = ins[0]
        sf = src.meta.get("autopar")
        from_param = sf is not None and (sf.param_like or src.name in chosen)
        if from_param and ("param_cast" in f.extra or f.op in VIEW_OPS):
            chosen.add(n.name)
    return needed_in_backward(pg, [n.name for n in pg.graph.nodes if n.name in chosen])


def grad_target(src: Spec, dst: Spec) -> Spec:
    """Where a ZeRO-1 plan moves a gradient from ``src`` before its parameter's layout
    ``dst``: summed whole (all-reduced) on every axis it would be reduce-scattered over; each
    rank then keeps its own part of it (a local slice, no collective)."""
    return tuple(Replicate() if isinstance(a, Partial) and isinstance(b, Shard) else b
                 for a, b in zip(src, dst))


def offload_time(meta: TensorMeta, spec: Spec, mesh: Mesh) -> float:
    """Seconds one step pays to keep this parameter's optimizer state on the host: its
    gradient to the host and the updated parameter back over the host link, and the host's
    optimizer step over its part at the host's memory bandwidth."""
    dev = mesh.device
    elems = meta.numel / num_shards(spec, mesh.shape)
    link = 2 * elems * meta.dtype.itemsize / dev.host_link_bandwidth
    host = elems * HOST_STEP_BYTES_PER_ELEM / dev.host_memory_bandwidth
    return link + host


def offload_saving(meta: TensorMeta, spec: Spec, mesh: Mesh) -> float:
    """Device bytes offloading this parameter's optimizer state frees."""
    return meta.numel * ADAM_STATE_BYTES_PER_PARAM / num_shards(spec, mesh.shape)


def param_root(n: fx.Node) -> fx.Node | None:
    """The parameter placeholder whose value ``n`` is (itself, or a cast or view chain of it
    made in the forward or re-made in the backward), else None."""
    while True:
        f = n.meta.get("autopar")
        if f is None:
            return None
        if f.role == "param":
            return n
        if not ("param_cast" in f.extra or f.op in VIEW_OPS) or not n.all_input_nodes:
            return None
        if f.role != "activation":
            return None
        n = n.all_input_nodes[0]



def is_param_view(n: fx.Node) -> bool:
    """Whether ``n`` only casts or views a parameter (a re-gathering copy is one)."""
    return n.meta["autopar"].role != "param" and param_root(n) is not None
