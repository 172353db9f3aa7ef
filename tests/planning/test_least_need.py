"""The memory bound that rules out a stand-in before it is planned (``modes.least_need``,
``sharding_problem.least_peak``): no plan's whole-step peak is below it, and a pipeline (or a
shape of the mesh-shape search) it rules out is one that planning in full also finds no plan
for."""

from __future__ import annotations

import math

import numpy as np
import pytest

import autopar.planning.pipeline as pipeline_mod
from autopar.ir.errors import PlanError
from autopar.ir.mesh import Mesh
from autopar.ir.options import Options
from autopar.models import get_preset
from autopar.passes.memory.peak import peak_memory
from autopar.passes.pipeline.cost import schedule_names, schedule_options, stand_in_flight
from autopar.passes.problem import sharding_problem
from autopar.passes.problem.step_memory import step_usage
from autopar.planning.memory_fit import leanest
from autopar.planning.modes import Mode, candidate_modes, least_need, mode_graph
from autopar.planning.pipeline import plan_pipeline, stage_mesh, stand_in_graph

GiB = 2**30


def _model(name: str = "llama3-tiny", n_layers: int = 4):
    preset = get_preset(name)
    field = "n_layers" if hasattr(preset.config, "n_layers") else "n_layer"
    preset = preset.replace(**{field: n_layers})
    return preset.build("meta"), preset.example_inputs(8, 32, "meta")


def _stand_in(model, inputs, mesh: Mesh, m: int = 4):
    p = mesh.shape[mesh.axes.index("pp")]
    flight = stand_in_flight(schedule_options(schedule_names(None), p, m, 4, None))
    return stand_in_graph(model, inputs, None, None, None, 8 // m, math.ceil(4 / p), None,
                          flight, None, microbatches=m)


@pytest.mark.parametrize("mode", ["none", "selective", "full+zero3"])
@pytest.mark.parametrize("offload", ["none", "auto"])
def test_no_plan_peaks_below_the_bound(mode, offload):
    model, inputs = _model()
    mesh = Mesh((2, 2, 2), ("pp", "dp", "tp"), "h100")
    pg = mode_graph(_stand_in(model, inputs, mesh), Mode.parse(mode))
    sub = stage_mesh(mesh, 0)
    sp = sharding_problem.build(pg, sub, offload=offload)
    bound = sharding_problem.least_peak(pg, sub, offload)
    rng = np.random.default_rng(0)
    lean = [int(np.argmin(u)) for u in sp.usage]
    choices = [lean, [0] * len(sp.nodes)] + [
        [int(rng.integers(len(s))) for s in sp.strategies] for _ in range(40)]
    peaks = [peak_memory(*step_usage(sp, c))[0] for c in choices]
    assert min(peaks) >= bound * (1 - 1e-12)
    # at most the per-node leanest with the nodes' own lifetimes; at least the parameters'
    # state, held the whole step
    state = sum(float(u.min()) for u, n in zip(sp.usage, sp.nodes)
                if n.meta["autopar"].role == "param")
    assert 0 < state <= bound <= leanest(sp)[0] * (1 + 1e-12)


def test_the_bound_rules_a_mode_in_only_when_every_mode_is_over():
    model, inputs = _model()
    mesh = Mesh((2, 2, 2), ("pp", "dp", "tp"), "h100")
    pg = _stand_in(model, inputs, mesh)
    sub = stage_mesh(mesh, 0)
    mem = Options().memory
    bounds = [sharding_problem.least_peak(mode_graph(pg, md), sub, "auto")
              for md in candidate_modes("auto", "auto", held=True)]
    assert least_need(pg, sub, mem, max(bounds) * 1.01) is None
    assert least_need(pg, sub, mem, min(bounds) * 1.01) is None
    got = least_need(pg, sub, mem, min(bounds) * 0.99)
    assert got == pytest.approx(min(bounds))


def test_a_pipeline_the_bound_rules_out_is_not_planned_and_fails_as_planned_in_full(
        monkeypatch):
    model, inputs = _model()
    mesh = Mesh((2, 2, 2), ("pp", "dp", "tp"), "h100")
    pg = _stand_in(model, inputs, mesh)
    sub = stage_mesh(mesh, 0)
    lowest = min(sharding_problem.least_peak(mode_graph(pg, md), sub, "auto")
                 for md in candidate_modes("auto", "auto", held=True))
    opts = Options.of(memory_budget=0.9 * lowest, time_limit_s=2.0, max_layers=None)
    with pytest.raises(PlanError) as bounded:
        monkeypatch.setattr(pipeline_mod, "make_plan", _not_called)
        plan_pipeline(model, mesh, inputs, options=opts)
    assert "any plan holds at least" in str(bounded.value)
    monkeypatch.undo()
    # planned in full (the bound switched off), the same budget finds no plan either
    monkeypatch.setattr(pipeline_mod, "least_need", lambda *a, **k: None)
    with pytest.raises(PlanError) as planned:
        plan_pipeline(model, mesh, inputs, options=opts)
    first = str(bounded.value).split(";")[0]
    assert str(planned.value).split(";")[0] == first


def _not_called(*a, **k):
    raise AssertionError("make_plan was called on a stand-in the bound rules out")


def test_a_whole_step_shape_the_bound_rules_out_is_not_planned(monkeypatch):
    import autopar.planning.shapes as shapes_mod
    from autopar.capture.joint import capture
    from autopar.planning.planner import make_plan

    model, inputs = _model()
    mesh = Mesh((4,), ("dp",), "h100")
    pg = capture(model, inputs, precision=Options().resolved_precision(mesh.device))
    lowest = min(sharding_problem.least_peak(mode_graph(pg, md), mesh, "auto")
                 for md in candidate_modes("auto", "auto"))
    opts = Options.of(memory_budget=0.9 * lowest, time_limit_s=1.0, max_layers=None,
                      workers=1)
    monkeypatch.setattr(shapes_mod, "make_plan", _not_called)
    monkeypatch.setattr(shapes_mod, "plan_pipeline", _not_called)
    monkeypatch.setattr(shapes_mod, "candidate_shapes",
                        lambda *a, **k: [shapes_mod.MeshShape(1, 4, 1)])
    (got,) = shapes_mod.search_shapes(model, 4, inputs, device="h100", options=opts)
    assert not got.fits and "any plan holds at least" in got.note
    # planned in full, the same budget has no plan
    with pytest.raises(PlanError):
        make_plan(model, mesh, inputs, options=opts)
