"""A pipeline stage's boundary in the sharding problem: pinned inputs, priced moves out.

A stage's graph (:func:`autopar.capture.stage.capture_stage`) exchanges four tensors with its
neighbours, each in the layout both sides agreed on (:func:`autopar.capture.stage.pin_boundary`):

* its inputs (the activation received, the output's gradient received, token ids, targets)
  arrive in their pinned layouts, so a pinned placeholder keeps only the strategy of its pin;
* its output (sent on) and its input's gradient (sent back) leave in the layout of the tensor
  the neighbour pinned: the output in its gradient's, the input's gradient in the input's.
  Their producers stay free; moving the result into that layout is priced on the producer
  (a unary cost, as the loss's collective is) and listed with the plan's collectives under
  the reason ``"stage boundary"``, as the runtime runs it (:mod:`autopar.runtime.lower`).

A stage that does not end in a loss has none to report whole: the loss's price goes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from autopar.ir.errors import PlanError
from autopar.ir.graph import PlanGraph
from autopar.ir.placements import spec_str
from autopar.passes.cost import cost_model as cm

if TYPE_CHECKING:
    from autopar.passes.problem.types import ShardingProblem

REASON = "stage boundary"


def apply(sp: ShardingProblem, pg: PlanGraph) -> None:
    """Pin ``pg.pins`` and price the boundary moves; before followers are merged (a pinned
    placeholder is a root, whose strategy list the followers index)."""
    if not pg.pins and pg.stage is None:
        return
    index = {n.name: i for i, n in enumerate(sp.nodes)}
    for name, spec in pg.pins.items():
        i = index[name]
        keep = [k for k, s in enumerate(sp.strategies[i]) if s.outs[0] == spec]
        if not keep:
            raise PlanError(
                f"input {name} of shape {list(sp.nodes[i].meta['autopar'].out.shape)} cannot be "
                f"pinned to {spec_str(spec)} on mesh {sp.mesh.describe()}: no layout of it "
                "divides evenly so; pin another spec or change the batch")
        # new lists and arrays: the old ones are shared with nodes of the same strategies
        sp.strategies[i] = [sp.strategies[i][k] for k in keep]
        sp.node_cost[i] = sp.node_cost[i][keep]
        sp.usage[i] = sp.usage[i][keep]
    if pg.stage is None:
        return
    sp.boundary = boundary_moves(pg, index)
    if not pg.has_loss:  # the stage's output is sent on, not reported whole
        sp.unary.pop(sp.loss_index, None)
        sp.loss_index = -1
    for i, dst in sp.boundary:
        meta = sp.nodes[i].meta["autopar"].out
        price = np.array([sum(c.time_s for c in cm.reshard_collectives(meta, s.outs[0], dst,
                                                                       sp.mesh))
                          for s in sp.strategies[i]])
        sp.unary[i] = sp.unary[i] + price if i in sp.unary else price


def boundary_moves(pg: PlanGraph, index: dict[str, int]) -> list[tuple[int, tuple]]:
    """(node index, the layout it leaves in) of the stage's output and input gradient."""
    st = pg.stage
    assert st is not None
    missing = [n for n in (st.input, st.output_grad) if n is not None and n not in pg.pins]
    if missing:
        raise PlanError(
            f"the stage's boundary inputs {missing} are not pinned: call "
            "autopar.capture.stage.pin_boundary(graph, mesh) before planning a stage, so that "
            "both neighbours place the tensors between them alike")
    out = []
    if st.output_grad is not None:
        out.append((index[pg.loss_node], pg.pins[st.output_grad]))
    if st.input_grad is not None and st.input is not None:
        out.append((index[st.input_grad], pg.pins[st.input]))
    return out


def collectives(sp: ShardingProblem, choice: list[int]) -> list[cm.Collective]:
    """The boundary moves' collectives under ``choice`` (one per step of each move)."""
    out: list[cm.Collective] = []
    for i, dst in sp.boundary:
        meta = sp.nodes[i].meta["autopar"].out
        out += cm.reshard_collectives(meta, sp.strategies[i][choice[i]].outs[0], dst, sp.mesh)
    return out
