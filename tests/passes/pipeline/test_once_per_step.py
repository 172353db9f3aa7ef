"""What a pipeline stage runs once per step, not once per microbatch: its gradient sync, and
the gathers of parameters held whole across the microbatches (ZeRO-1/2, Megatron's
distributed optimizer). Priced on a stand-in stage of a small Llama, no processes."""

from __future__ import annotations

import functools

import pytest

from autopar.ir.graph import node_layer
from autopar.ir.mesh import Mesh
from autopar.ir.options import Options
from autopar.models import get_preset
from autopar.models.reference_plans import fsdp_tp_2d
from autopar.passes.pipeline.stage_profile import stage_profile
from autopar.passes.problem import bucket_fill, sharding_problem
from autopar.passes.problem.edge_costs import edge_matrix, is_param_gather
from autopar.passes.problem.step_memory import step_usage
from autopar.planning.modes import Mode, candidate_modes, mode_graph
from autopar.planning.pipeline import stand_in_graph
from autopar.planning.references import score_reference

MESH = Mesh((2, 2), ("dp", "tp"), "h100")
TRACES: dict = {}  # one trace serves every stand-in here


@functools.cache
def stand_in(microbatches: int, in_flight: float = 1.0, mode: str = "none"):
    preset = get_preset("llama3-tiny").replace(n_layers=4)
    model, inputs = preset.build("meta"), preset.example_inputs(8, 32, "meta")
    pg = stand_in_graph(model, inputs, None, None, None, 4, 2, None, in_flight, TRACES,
                        microbatches=microbatches)
    sp = sharding_problem.build(mode_graph(pg, mode), MESH)
    ref = fsdp_tp_2d(model, MESH.shape, MESH.axes, "llama3")
    got = score_reference(sp, pg, ref, 0.5)
    assert got is not None
    return sp, got[1]


def test_the_gradient_sync_is_weighed_once_per_step_whatever_the_microbatches():
    (sp2, c2), (sp8, _) = stand_in(2), stand_in(8)
    c8 = c2  # one layout, priced for 2 and for 8 microbatches (the graphs are one trace's)
    s2, s8 = bucket_fill.score(sp2, c2), bucket_fill.score(sp8, c8)
    sync = sum(c.time_s for c in s2.collectives if c.reason == "gradient sync")
    assert sync > 0 and s2.once_s == pytest.approx(s8.once_s) and s2.once_s >= sync
    # one microbatch's share: what runs once per step weighs 1/m against it
    assert s2.cost.step_s - s8.cost.step_s == pytest.approx(s2.once_s * (1 / 2 - 1 / 8))
    # the solver's edge prices agree: a gradient edge costs 1/m of its collective
    e = next(e for e in sp8.edges if e.in_idx < 0)
    assert e.once
    one = stand_in(1)[0]
    e1 = next(e for e in one.edges if e.in_idx < 0)
    assert not e1.once
    assert edge_matrix(sp8, e) * 8 == pytest.approx(edge_matrix(one, e1))
    # the stage's parts carry the sync per step, the same for any microbatch count
    p2, p8 = stage_profile(sp2, c2, 2, 2), stage_profile(sp8, c8, 2, 2)
    for a, b in ((p2.pre, p8.pre), (p2.block, p8.block), (p2.post, p8.post)):
        assert a.sync_s == pytest.approx(b.sync_s)
        assert a.forward_s == pytest.approx(b.forward_s)
    assert p8.block.sync_s > 0


def test_zero2_in_a_pipeline_gathers_nothing_per_microbatch_zero3_gathers_every_time():
    held, _ = stand_in(4, mode="none")  # the forward's gathered copy kept: ZeRO-2
    again, _ = stand_in(4, mode="none+zero3")  # gathered again in the backward
    read_back = {held.nodes[e.src] for e in held.edges if e.in_idx >= 0
                 and held.nodes[e.dst].meta["autopar"].phase == "bwd"}
    held_gathers = [e for e in held.edges if is_param_gather(held, e)
                    and held.nodes[e.dst].meta["autopar"].phase == "fwd"]
    # the matmuls' weights are kept whole; a norm's weight, which its backward reads
    # itself, is gathered again there: per microbatch, both ways
    assert any(e.once for e in held_gathers)
    assert all(e.once != (held.nodes[e.src] in read_back) for e in held_gathers
               if held.nodes[e.src].meta["autopar"].role == "param")
    # the blocks' parameters are re-gathered (the embedding and head keep theirs whole)
    block_gathers = [e for e in again.edges if is_param_gather(again, e)
                     and node_layer(again.nodes[e.dst]) is not None]
    assert block_gathers and not any(e.once for e in block_gathers)
    # a stand-in that is no pipeline's marks nothing
    assert not any(e.once for e in stand_in(1)[0].edges)


def test_a_parameters_gathered_copy_is_held_once_whatever_is_in_flight():
    (sp1, c1), (sp4, _) = stand_in(4, in_flight=1.0), stand_in(4, in_flight=4.0)
    c4 = c1
    once1: set[int] = set()
    once4: set[int] = set()
    u1, _ = step_usage(sp1, c1, once1)
    u4, _ = step_usage(sp4, c4, once4)
    assert once1 and once1 == once4
    assert [u1[k] for k in sorted(once1)] == pytest.approx([u4[k] for k in sorted(once4)])
    # the kept activations are held once per microbatch in flight, the parameters' copies not
    p1, p4 = stage_profile(sp1, c1, 2, 2), stage_profile(sp4, c4, 2, 2)
    assert p4.block.state_bytes == pytest.approx(p1.block.state_bytes)
    assert p4.block.saved_bytes == pytest.approx(p1.block.saved_bytes)


def test_a_pipeline_stage_tries_full_recomputation_with_parameters_held():
    assert Mode("full") in candidate_modes("auto", "auto", held=True)
    assert Mode("full") not in candidate_modes("auto", "auto")
    # ZeRO-1 holds what ZeRO-2 holds in a stage and moves twice the bytes
    assert Mode("none", whole_grads=True) not in candidate_modes("auto", "auto", held=True)


def test_a_pipeline_plan_is_never_slower_than_megatrons_layouts():
    from autopar.models.reference_plans import comparison_plans
    from autopar.planning.pipeline import plan_pipeline

    preset = get_preset("llama3-tiny").replace(n_layers=4)
    model, inputs = preset.build("meta"), preset.example_inputs(16, 32, "meta")
    mesh = Mesh((2, 2, 2), ("pp", "dp", "tp"), "h100")
    megatron = {"megatron_distopt+selective", "megatron_distopt+full"}
    refs = comparison_plans(model, (2, 2), ("dp", "tp"), "llama3", pipeline=True)
    assert megatron <= set(refs) and refs["megatron_distopt+full"].zero == "2"
    refs = {k: refs[k] for k in megatron}
    # a limit that lets every reference be completed on a loaded machine (the whole call,
    # tracing included, counts against it; a tiny model's solves stop well before it)
    opts = Options.of(time_limit_s=20.0, max_layers=4, microbatches=4, recompute="full")
    plan = plan_pipeline(model, mesh, inputs, options=opts, references=refs).plan
    got = plan.provenance.references
    assert set(got) == megatron
    assert all(plan.predicted.cost.step_s <= c.step_s * (1 + 1e-9) for c in got.values())
    # weighed without being asked, listed only where asked
    plain = plan_pipeline(model, mesh, inputs, options=opts).plan
    assert not plain.provenance.references
    assert plain.predicted.cost.step_s <= got["megatron_distopt+full"].step_s * (1 + 1e-9)
