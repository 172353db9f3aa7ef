import itertools
import math

import pytest

from autopar.errors import MeshError
from autopar.mesh_search import MeshShape, best_shapes, mesh_shapes


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


def synthetic_step(shape: MeshShape) -> float:
    # compute shrinks with devices; tp pays per layer, pp a bubble, dp a gradient sync;
    # one shape does not fit (too little sharding of the weights)
    if shape.tp * shape.pp < 2:
        return math.inf
    compute = 96.0 / shape.size
    return (compute * (1 + (shape.pp - 1) / 8) + 0.3 * (shape.tp - 1) + 0.5 * math.log2(shape.dp)
            + 0.1 * shape.pp)


@pytest.mark.parametrize("n", [8, 12, 16])
def test_best_is_the_best_of_an_exhaustive_search(n):
    shapes = mesh_shapes(n, num_layers=24, device="h100")
    candidates = exhaustive(n, 8, 24)
    expected = min(synthetic_step(s) for s in candidates)
    best = best_shapes(shapes, synthetic_step, k=3)
    assert math.isclose(best[0][1], expected)
    assert [v for _, v in best] == sorted(v for _, v in best)
    assert len(best) == 3


def test_ties_break_by_candidate_order_and_unfit_shapes_are_dropped():
    shapes = mesh_shapes(8, devices_per_node=8)
    tied = best_shapes(shapes, lambda s: 1.0, k=len(shapes))
    assert [s for s, _ in tied] == list(shapes)
    assert best_shapes(reversed(shapes), lambda s: 1.0)[0][0] == shapes[-1]
    assert best_shapes(shapes, lambda s: math.inf) == []
    assert best_shapes(shapes, lambda s: math.nan if s.tp == 1 else s.pp, k=1)[0][0].tp > 1


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


def test_invalid_layers_node_and_k_are_errors():
    with pytest.raises(MeshError, match="number of layers"):
        mesh_shapes(8, num_layers=0)
    with pytest.raises(MeshError, match="devices_per_node"):
        mesh_shapes(8, devices_per_node=0)
    with pytest.raises(MeshError, match="k must be"):
        best_shapes(mesh_shapes(8), lambda s: 1.0, k=0)
