"""A pinned reference's parameters used where they are stored on the axes it names
(``autopar/planning/used_in_place.py``): tensor parallelism as Megatron-LM and torchtitan run
it multiplies each weight's own shard and makes its gradient there, so the completion may
neither gather a tensor-parallel weight over tp nor reduce its gradient there."""

from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.ir.mesh import Mesh
from autopar.ir.options import Options
from autopar.ir.placements import Replicate, Shard
from autopar.models.reference_plans import REFERENCE_PLANS
from autopar.passes.cost.cost_model import VIEW_OPS
from autopar.passes.problem.scoring import score_assignment
from autopar.planning import used_in_place
from autopar.planning.planner import make_plan


@dataclass(frozen=True)
class Pinned:
    name: str
    params: dict
    inputs: dict
    recompute: str = "none"
    zero: str | None = "3"
    exact: bool = True
    used_in_place: tuple[str, ...] = ()


def _llama_tp():
    from autopar.models import ModelPreset
    from autopar.models.llama3 import LlamaConfig

    # many tokens on a narrow model: gathering a weight over tp costs less than tensor
    # parallelism's activation collectives, so a free completion prefers the gather
    cfg = LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                      ffn_dim=128, max_seq_len=256)
    preset = ModelPreset("tiny", "llama3", cfg)
    model = preset.build("meta")
    inputs = preset.example_inputs(32, 256, "meta")
    mesh = Mesh.parse("dp=2,tp=2", "h100-96gb")
    ref = REFERENCE_PLANS["fsdp_tp_2d"](model, mesh.shape, mesh.axes, preset.family,
                                       batch_size=32)
    return model, inputs, mesh, ref


def _tp_moves_of_weights(in_place: tuple[str, ...]) -> list[str]:
    """The moves on tp alone of the completed layout that gather a tensor-parallel weight (a
    tp-sharded parameter, its cast or a view of them, on its way to the op reading it) or
    reduce its gradient."""
    model, inputs, mesh, ref = _llama_tp()
    pinned = Pinned("published", ref.params, ref.inputs, used_in_place=in_place)
    got = make_plan(model, mesh, inputs, options=Options.of(
        memory_budget=math.inf, precision="bf16", time_limit_s=5.0),
        references={"published": pinned})
    sp, choice = got.reference_problems["published"]
    tp = mesh.axes.index("tp")
    # the weights tensor parallelism splits, and every cast or view of them
    chain = {i for i, n in enumerate(sp.nodes) if n.op == "placeholder"
             and n.meta["autopar"].role == "param"
             and isinstance(sp.strategies[i][choice[i]].outs[0][tp], Shard)}
    index = {n: i for i, n in enumerate(sp.nodes)}
    grew = True
    while grew:
        grew = False
        for i in list(chain):
            for u in sp.nodes[i].users:
                j = index.get(u)
                f = u.meta["autopar"] if j is not None else None
                if j is not None and j not in chain and u.op == "call_function" and (
                        str(f.op) in VIEW_OPS or "param_cast" in f.extra):
                    chain.add(j)
                    grew = True
    scored = score_assignment(sp, choice)
    out = []
    for k, colls in scored.edge_collectives.items():
        e = sp.edges[k]
        weight_read = e.in_idx >= 0 and e.src in chain
        weight_grad = e.in_idx < 0 and e.dst in chain
        # FSDP's gather of a weight split on dim 0 by dp and tp both passes through tp in
        # autopar's route for nested shards (gather tp, gather dp, split tp again), which
        # torch's strided shard does not need: a move on dp is FSDP's, not tensor parallelism's
        if (weight_read or weight_grad) and {c.axis for c in colls} == {"tp"}:
            out += [f"{c.kind} {sp.nodes[e.src].name}->{sp.nodes[e.dst].name}" for c in colls]
    return out


def test_tensor_parallel_weights_are_multiplied_where_stored():
    # free, the completion gathers the narrow model's weights over tp (FSDP over tp)
    assert _tp_moves_of_weights(())
    # used in place on tp, no weight is gathered there and no weight gradient reduced
    assert _tp_moves_of_weights(("tp",)) == []


def test_an_axis_of_one_device_or_none_named_constrains_nothing():
    model, inputs, mesh, ref = _llama_tp()
    got = make_plan(model, mesh, inputs, options=Options.of(
        memory_budget=math.inf, precision="bf16", time_limit_s=2.0),
        references={"published": Pinned("published", ref.params, ref.inputs)})
    sp, _ = got.reference_problems["published"]
    params = {i: (Shard(0), Shard(0)) for i, n in enumerate(sp.nodes)
              if n.op == "placeholder" and n.meta["autopar"].role == "param"}
    assert used_in_place.allowed(sp, params, ("pp",)) == {}
    assert used_in_place.allowed(sp, params, ()) == {}
    # a parameter replicated on tp (a norm's weight) is no tensor-parallel weight
    replicated = {i: (Shard(0), Replicate()) for i in params}
    assert used_in_place.allowed(sp, replicated, ("tp",)) == {}
