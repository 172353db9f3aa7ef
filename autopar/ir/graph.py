"""PlanGraph: the traced joint forward+backward ATen graph plus typed per-node facts.

Every pass reads ``node.meta["autopar"]`` (a :class:`NodeFacts`) instead of poking at fake
tensors again. Facts are filled by :mod:`autopar.capture.joint` once, right after tracing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch
import torch.fx as fx

if TYPE_CHECKING:
    from autopar.ir.depth import DepthProxy
    from autopar.ir.inputs import CallInputs
    from autopar.ir.placements import Spec
    from autopar.ir.precision import Precision

Role = Literal["param", "buffer", "input", "activation", "grad", "loss", "output"]

DTYPE_BYTES_FALLBACK = 4


@dataclass(frozen=True, slots=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        try:
            return self.numel * self.dtype.itemsize
        except AttributeError:  # pragma: no cover - very old dtypes
            return self.numel * DTYPE_BYTES_FALLBACK

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def __repr__(self) -> str:
        return f"{self.dtype_name}{list(self.shape)}"


@dataclass(slots=True)
class NodeFacts:
    """What the planner knows of one graph node."""

    name: str
    op: str  # "aten.mm.default", "placeholder", "output"
    outputs: tuple[TensorMeta | None, ...]  # one per output; None for non-tensor outputs
    role: Role
    phase: Literal["fwd", "bwd", "none"] = "none"
    flops: float = 0.0
    layer: int | None = None  # index of the repeated block this node belongs to
    param_name: str | None = None  # for param placeholders and their gradients
    input_index: int | None = None  # position among the user's inputs (args then kwargs)
    extra: dict = field(default_factory=dict)

    @property
    def out(self) -> TensorMeta | None:
        return self.outputs[0] if self.outputs else None

    @property
    def param_like(self) -> bool:
        """A parameter, or its cast to the compute dtype (mixed precision): what the step
        reads of a parameter, gathered per layer where sharded."""
        return self.role == "param" or "param_cast" in self.extra


def node_layer(n: fx.Node) -> int | None:
    """The repeated block node ``n`` belongs to (``NodeFacts.layer``); a parameter, which
    capture tags with none, belongs to the layer of the ops that use it (if only one)."""
    ly = n.meta["autopar"].layer
    if ly is None and n.op == "placeholder":
        # a parameter belongs to the layer of the ops that use it
        layers = {u.meta["autopar"].layer for u in n.users if "autopar" in u.meta} - {None}
        if len(layers) == 1:
            return layers.pop()
    return ly


@dataclass(frozen=True, slots=True)
class StageIO:
    """What one pipeline stage's step exchanges with its neighbours besides its parameters
    (:mod:`autopar.capture.stage`), as node names of its graph. The graph's ``loss_node`` is
    the stage's output: the activation it sends on, or the loss on the last stage."""

    input: str | None  # placeholder of the activation received (None: the first stage's tokens)
    input_grad: str | None  # the node computing that activation's gradient, sent back
    # placeholder of the gradient of the output, received from the next stage; None on the
    # last stage, whose output is the loss (its backward starts from ``ones_like(loss)``)
    output_grad: str | None


@dataclass
class PlanGraph:
    """The traced step and its facts. ``gm`` computes ``(loss, *grads)`` from
    ``(*params, *buffers, *inputs)``, all flattened, in that order."""

    gm: fx.GraphModule
    param_names: list[str]
    buffer_names: list[str]
    input_names: list[str]  # "arg0", "arg1", "kw:attention_mask", ...
    grad_of: dict[str, str]  # grad output node name -> param name
    loss_node: str
    trace_s: float = 0.0
    num_layers: int = 0
    proxy: DepthProxy | None = None  # set when only some of the layers were traced
    all_param_names: list[str] = field(default_factory=list)  # the whole model's, traced or not
    precision: Precision | None = None  # the policy the step was traced under (None: fp32)
    # forward nodes copied into the backward (passes.recompute): copy name -> original's
    recomputed: dict[str, str] = field(default_factory=dict)
    stage: StageIO | None = None  # a pipeline stage's step (None: a whole training step)
    # placeholder name -> the only spec the planner may give it (a stage's boundary layouts
    # on one mesh, :func:`autopar.capture.stage.pin_boundary`)
    pins: dict[str, Spec] = field(default_factory=dict)
    # the traced call's structure and non-tensor inputs, constants of the program (None: only
    # tensors, or a graph not traced from a call)
    call_inputs: CallInputs | None = None

    @property
    def has_loss(self) -> bool:
        """Whether ``loss_node`` is a loss (reported whole on every rank), not a stage's
        activation sent to the next stage."""
        return self.stage is None or self.stage.output_grad is None

    def layer_weight(self, layer: int | None) -> float:
        """How many real layers a traced layer stands for (1 without a depth proxy)."""
        return self.proxy.layer_weight(layer) if self.proxy else 1.0

    @property
    def graph(self) -> fx.Graph:
        return self.gm.graph

    def facts(self, node: fx.Node) -> NodeFacts:
        return node.meta["autopar"]

    def nodes(self) -> list[fx.Node]:
        return list(self.gm.graph.nodes)

    def param_node(self, name: str) -> fx.Node:
        for n in self.gm.graph.nodes:
            if n.op == "placeholder" and self.facts(n).param_name == name:
                return n
        raise KeyError(name)

    def op_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for n in self.gm.graph.nodes:
            if n.op == "call_function":
                counts[self.facts(n).op] = counts.get(self.facts(n).op, 0) + 1
        return counts

    def summary(self) -> str:
        n_call = sum(1 for n in self.gm.graph.nodes if n.op == "call_function")
        return (
            f"{n_call} ops, {len(self.param_names)} params, {len(self.input_names)} inputs, "
            f"{self.num_layers} repeated layers"
            + (f" (a proxy of {self.proxy.total})" if self.proxy else "")
            + f", traced in {self.trace_s:.2f} s"
        )
