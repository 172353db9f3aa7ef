"""ZeRO stages and optimizer-state offload as plan options (passes/memory/zero.py): what each stage
costs and saves, that the plan records it, and that offload is chosen only where needed."""

from __future__ import annotations

import pytest

from autopar.capture.joint import capture
from autopar.ir.errors import PlanError
from autopar.ir.mesh import Mesh
from autopar.ir.options import Options
from autopar.ir.placements import Replicate
from autopar.ir.plan import Plan
from autopar.ir.precision import resolve
from autopar.models import get_preset
from autopar.models.reference_plans import fsdp
from autopar.passes.memory import zero
from autopar.planning.assemble import with_recompute
from autopar.planning.planner import make_plan, mode_graph
from autopar.report.table import plan_table

MESH = Mesh((4,), ("dp",), "h100")


@pytest.fixture(scope="module")
def tiny():
    preset = get_preset("llama3-tiny")
    model = preset.build("meta")
    inputs = preset.example_inputs(8, 64)
    return model, inputs, capture(model, inputs, precision=resolve("bf16", MESH.device))


def _fsdp(model, inputs, graph, **kw):
    ref = fsdp(model, MESH.shape, MESH.axes, "llama3", batch_size=8)
    from autopar.api import complete_plan

    return complete_plan(graph, MESH, ref.params, ref.inputs,
                         Options.of(memory_budget=float("inf"), time_limit_s=2.0), **kw)


def test_regather_copies_only_parameter_views_the_backward_reads(tiny):
    _, _, graph = tiny
    names = zero.regather_nodes(graph)
    by_name = {n.name: n for n in graph.graph.nodes}
    assert names
    for name in names:
        n = by_name[name]
        assert zero.is_param_view(n) and n.meta["autopar"].phase == "fwd"
        users = [u for u in n.users if "autopar" in u.meta]
        assert any(u.meta["autopar"].phase == "bwd" or u.name in names for u in users)
    # the weights' t() views and their casts, never an activation
    ops = {by_name[n].meta["autopar"].op for n in names}
    assert "aten.t.default" in ops and "aten.mm.default" not in ops


def test_zero3_gathers_again_in_the_backward_and_holds_less(tiny):
    """FSDP's layout with the gathered weights kept from the forward to the backward
    (ZeRO-2) against gathered again there (ZeRO-3): more bytes gathered (one all-gather per layer and phase), less
    memory, and the plan says which."""
    model, inputs, graph = tiny
    held = _fsdp(model, inputs, graph, mode="none")
    again = with_recompute(graph, held, "none+zero3", MESH)
    stages_held = set(held.decided.param_state.stages.values())
    assert 2 in stages_held and not held.decided.param_state.regathered
    assert again.decided.param_state.regathered
    weights = [p for p in held.decided.params if p.endswith("wq.weight")]
    assert all(held.decided.param_state.stages[p] == 2 and again.decided.param_state.stages[p] == 3
               for p in weights)
    assert all(again.decided.param_state.axes[p] == ("dp",) for p in weights)

    def gathers(plan: Plan) -> float:  # bytes (a layer's backward gathers go out as one)
        return sum(c.bytes for c in plan.predicted.collectives if c.reason == "parameter gather")

    assert gathers(again) > gathers(held)
    assert again.predicted.cost.mem_bytes < held.predicted.cost.mem_bytes
    assert "ZeRO-3" in plan_table(again) and "ZeRO-2" in plan_table(held)


def test_data_parallel_parameters_are_stage_0(tiny):
    model, inputs, graph = tiny
    from autopar.api import complete_plan

    ddp = complete_plan(graph, MESH, {n: (Replicate(),) for n, _ in model.named_parameters()},
                        options=Options.of(memory_budget=float("inf"), time_limit_s=2.0))
    assert set(ddp.decided.param_state.stages.values()) == {0}
    assert "replicated (DDP) over dp" in plan_table(ddp)


def test_auto_picks_the_faster_stage_that_fits(tiny):
    model, inputs, graph = tiny
    free = make_plan(model, MESH, graph=graph,
                     options=Options.of(memory_budget=float("inf"), time_limit_s=2.0))
    forced3 = make_plan(model, MESH, graph=graph,
                        options=Options.of(memory_budget=float("inf"), time_limit_s=2.0, zero=3,
                                           recompute="none"))
    assert free.plan.predicted.cost.step_s <= forced3.plan.predicted.cost.step_s * (1 + 1e-9)
    # under a limit the ZeRO-2 plan misses, the planner weighs re-gathering too
    limit = forced3.plan.predicted.cost.mem_bytes * 1.01
    tight = make_plan(model, MESH, graph=graph,
                      options=Options.of(memory_budget=limit, time_limit_s=2.0, recompute="none"))
    assert tight.plan.predicted.cost.mem_bytes <= limit


def test_offload_moves_the_optimizer_state_and_pays_the_host_link(tiny):
    model, inputs, graph = tiny
    kept = make_plan(model, MESH, graph=graph,
                     options=Options.of(memory_budget=float("inf"), time_limit_s=2.0,
                                        recompute="none", offload="none")).plan
    moved = make_plan(model, MESH, graph=graph,
                      options=Options.of(memory_budget=float("inf"), time_limit_s=2.0,
                                         recompute="none", offload="optimizer")).plan
    ps = moved.decided.param_state
    assert set(ps.offloaded) == set(moved.decided.params) and not kept.decided.param_state.offloaded
    assert ps.offload_s > 0 and ps.offload_bytes > 0
    assert moved.predicted.cost.step_s >= ps.offload_s
    assert moved.predicted.cost.mem_bytes < kept.predicted.cost.mem_bytes
    assert "offloaded to host memory" in plan_table(moved)
    assert Plan.from_json(moved.to_json()) == moved
    # priced with the profile's host link: a slower link costs more
    meta = next(n.meta["autopar"].out for n in graph.graph.nodes
                if n.op == "placeholder" and n.meta["autopar"].role == "param")
    slow = Mesh((4,), ("dp",), "a100")
    spec = (Replicate(),)
    assert zero.offload_time(meta, spec, slow) > zero.offload_time(meta, spec, MESH)


def test_offload_is_chosen_only_where_nothing_fits_without(tiny):
    from autopar.passes.problem import sharding_problem
    from autopar.planning.memory_fit import leanest

    model, inputs, _ = tiny
    graph = capture(model, inputs, precision=resolve("bf16", MESH.device))  # a fresh trace
    lean = mode_graph(graph, "full+zero3")
    on_device = leanest(sharding_problem.build(lean, MESH))[0]
    on_host = leanest(sharding_problem.build(lean, MESH, offload="optimizer"))[0]
    assert on_host < on_device
    roomy = make_plan(model, MESH, graph=graph, options=Options.of(time_limit_s=5.0)).plan
    assert not roomy.decided.param_state.offloaded  # 74 GiB: nothing to offload
    limit = on_device * 0.99  # below any plan with all the state on the device
    assert limit > on_host
    with pytest.raises(PlanError):
        make_plan(model, MESH, graph=graph,
                  options=Options.of(memory_budget=limit, time_limit_s=5.0, offload="none"))
    planned = make_plan(model, MESH, graph=graph,
                        options=Options.of(memory_budget=limit, time_limit_s=5.0)).plan
    assert planned.decided.param_state.offloaded and planned.predicted.cost.mem_bytes <= limit
    # it costs time, so only some of the state goes: as much as the limit needs
    assert len(planned.decided.param_state.offloaded) < len(planned.decided.params)


def test_bad_stage_and_offload_names_say_what_to_use(tiny):
    model, inputs, graph = tiny
    with pytest.raises(PlanError, match="auto, 1, 2 or 3"):
        make_plan(model, MESH, graph=graph, options=Options.of(zero="4"))
    with pytest.raises(PlanError, match="auto, none, optimizer"):
        make_plan(model, MESH, graph=graph, options=Options.of(offload="cpu"))

