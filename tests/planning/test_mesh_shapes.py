import itertools

import pytest

from autopar.ir.errors import MeshError
from autopar.planning.mesh_shapes import MeshShape, mesh_shapes


def exhaustive(n, node, layers):
    return {
        MeshShape(pp, dp, tp)
        for pp, dp, tp in itertools.product(range(1, n + 1), repeat=3)
        if pp * dp * tp == n and node % tp == 0 and pp <= layers
    }


@pytest.mark.parametrize("n", [1, 2, 6, 8, 12, 16, 24, 64])
@pytest.mark.parametrize("node,layers", [(8, 32), (4, 3), (8, 1)])
def test_shapes_are_exactly_the_valid_factorisations(n, node, layers):
    shapes = mesh_shapes(n, num_layers=layers, devices_per_node=node)
    assert set(shapes) == exhaustive(n, node, layers)
    assert len(shapes) == len(set(shapes))
    assert list(shapes) == sorted(shapes, key=lambda s: (s.pp, s.tp))
    assert all(s.size == n for s in shapes)


def test_tp_rides_the_node_links():
    h100 = mesh_shapes(16, device="h100")
    assert max(s.tp for s in h100) == 8  # 8 GPUs a node
    shape = MeshShape(2, 2, 4)
    mesh = shape.mesh("h100")
    assert mesh.axes == ("pp", "dp", "tp") and mesh.shape == (2, 2, 4)
    assert mesh.bandwidth[2] == mesh.device.intra_node_bandwidth
    assert mesh.bandwidth[0] == mesh.device.inter_node_bandwidth
    stage = shape.stage_mesh("h100")
    assert stage.shape == (2, 4) and stage.bandwidth == mesh.bandwidth[1:]


@pytest.mark.parametrize("bad", [0, -4, 2.5, True])
def test_invalid_device_counts_are_errors(bad):
    with pytest.raises(MeshError, match="number of devices must be a positive integer"):
        mesh_shapes(bad)


def test_invalid_layers_and_node_are_errors():
    with pytest.raises(MeshError, match="number of layers"):
        mesh_shapes(8, num_layers=0)
    with pytest.raises(MeshError, match="devices_per_node"):
        mesh_shapes(8, devices_per_node=0)


def test_a_whole_search_limit_gives_every_shape_the_same_share():
    from autopar.ir.deadline import Deadline
    from autopar.ir.options import SHAPE_LIMIT_S
    from autopar.planning.shapes import QUICK_S, shape_limit_s

    assert shape_limit_s(None, 25, 2) == SHAPE_LIMIT_S  # no whole limit: each its own
    whole = Deadline(60.0)
    share = shape_limit_s(whole, 25, 2)  # 13 rounds of 2 shapes at once
    assert 60.0 / 13 * 0.95 < share <= 60.0 / 13
    assert shape_limit_s(Deadline(1e6), 4, 2) == SHAPE_LIMIT_S  # never above the per-shape cap
    assert shape_limit_s(Deadline(0.0), 25, 2) == QUICK_S  # a solve's worth at least


def test_shapes_not_started_within_the_whole_limit_are_not_planned():
    from dataclasses import replace

    from autopar.ir.deadline import Deadline
    from autopar.ir.options import Options
    from autopar.models import get_preset
    from autopar.planning.shapes import search_shapes

    preset = get_preset("gpt2-tiny")
    opts = Options.of(time_limit_s=1.0, max_layers=2, workers=1)
    spent = replace(opts, search=replace(opts.search, deadline=Deadline(0.0)))
    results = search_shapes(preset.build("meta"), 2, preset.example_inputs(4, 16), None,
                            "cpu", spent)
    assert results and all(r.plan is None and "time limit ran out" in r.note for r in results)
    assert spent.search.deadline.was_cut


def test_each_stand_in_is_traced_once_and_its_shapes_planned_together(monkeypatch):
    """The search groups shapes by the stand-in they are planned on (``_by_stand_in``): one
    trace per group, whatever the order the shapes come in."""
    from autopar.capture import joint
    from autopar.ir.options import Options
    from autopar.models import get_preset
    from autopar.planning import pipeline, shapes

    preset = get_preset("gpt2-tiny").replace(n_layer=4)
    model, inputs = preset.build("meta"), preset.example_inputs(8, 16, "meta")
    traced = []

    def counting(*args, **kwargs):
        traced.append(args[1][0].shape[0])  # the microbatch traced
        return joint.capture(*args, **kwargs)

    monkeypatch.setattr(shapes, "capture", counting)
    monkeypatch.setattr(pipeline, "capture", counting)
    opts = Options.of(time_limit_s=0.5, workers=1)  # every layer traced
    candidates = shapes.candidate_shapes(model, 8, 8, "cpu")
    groups = shapes._by_stand_in(candidates, 8, 4, None)
    assert sum(len(g) for g in groups.values()) == len(candidates) > len(groups) > 1
    results = shapes.search_shapes(model, 8, inputs, None, "cpu", opts)
    assert {r.shape for r in results} == set(candidates)
    assert len(traced) == len(groups)  # no stand-in traced twice, none missed
