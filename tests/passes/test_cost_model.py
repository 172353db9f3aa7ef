import pytest
import torch

from autopar.graph import TensorMeta
from autopar.mesh import Mesh
from autopar.passes import cost_model as cm
from autopar.placements import Partial, R, S

MESH = Mesh((2, 4), ("dp", "tp"), "h100", bandwidth=(1e10, 1e11), latency=(1e-5, 1e-6))
T = TensorMeta((64, 128), torch.float32)  # 32 KiB


def kinds(src, dst, meta=T, mesh=MESH):
    return [(c.kind, c.axis) for c in cm.reshard_collectives(meta, src, dst, mesh)]


def test_each_transition_maps_to_its_collective():
    P = Partial()
    assert kinds((R, S(0)), (R, R)) == [("all_gather", "tp")]
    assert kinds((P, R), (R, R)) == [("all_reduce", "dp")]
    assert kinds((R, P), (R, S(1))) == [("reduce_scatter", "tp")]
    assert kinds((S(0), R), (S(1), R)) == [("all_to_all", "dp")]
    assert kinds((R, R), (S(0), S(1))) == []  # slicing is free
    assert kinds((S(0), S(1)), (S(0), S(1))) == []


def test_alpha_beta_ring_formulas():
    n, b, bw, lat = 8, 1e9, 1e11, 1e-5
    assert cm.collective_time("all_reduce", b, n, bw, lat) == pytest.approx(
        2 * 7 * lat + 2 * 7 / 8 * b / bw)
    assert cm.collective_time("all_gather", b, n, bw, lat) == pytest.approx(7 * lat + 7 / 8 * b / bw)
    assert cm.collective_time("all_reduce", b, 1, bw, lat) == 0.0


def test_buffer_size_accounts_for_other_axes():
    # gathering over tp a tensor also split over dp moves half of it
    (c,) = cm.reshard_collectives(T, (S(0), S(1)), (S(0), R), MESH)
    assert c.kind == "all_gather" and c.bytes == T.nbytes / 8
    (c,) = cm.reshard_collectives(T, (Partial(), R), (R, R), MESH)
    assert c.bytes == T.nbytes
    # an all-reduce over the slow axis costs more than over the fast one
    slow = cm.reshard_time(T, (Partial(), R), (R, R), MESH)
    fast = cm.reshard_time(T, (R, Partial()), (R, R), MESH)
    assert slow > fast > 0


def test_compute_splits_over_axes_that_shard_something():
    a, b, out = TensorMeta((8192, 8192), torch.float32), TensorMeta((8192, 8192), torch.float32), \
        TensorMeta((8192, 8192), torch.float32)
    flops = 2 * 8192**3
    full = cm.compute_time("aten.mm.default", flops, (a, b), (out,), ((R, R), (R, R)), ((R, R),), MESH)
    split = cm.compute_time("aten.mm.default", flops, (a, b), (out,), ((R, R), (R, S(1))),
                            ((R, S(1)),), MESH)
    assert split == pytest.approx(full / 4, rel=1e-6)
    assert cm.compute_time("aten.view.default", 0, (a,), (out,), ((R, R),), ((R, R),), MESH) == 0


def test_memory_of_params_counts_grad_and_adam_state():
    w = TensorMeta((1000,), torch.float32)
    assert cm.param_bytes_per_device(w, (R, R), MESH) == 1000 * (4 + 4 + 8)
    assert cm.param_bytes_per_device(w, (S(0), S(0)), MESH) == 1000 * 16 / 8


def test_per_call_overhead_makes_one_all_reduce_cheaper_than_two_halves():
    n, b, bw, lat, ovh = 4, 1e6, 1e9, 1e-4, 1e-3
    ar = cm.collective_time("all_reduce", b, n, bw, lat, ovh)
    rs_ag = cm.collective_time("reduce_scatter", b, n, bw, lat, ovh) + cm.collective_time(
        "all_gather", b, n, bw, lat, ovh)
    assert ar == pytest.approx(rs_ag - ovh)


def test_bucketed_gradient_syncs_pay_only_their_share_of_fixed_costs():
    small = TensorMeta((1024,), torch.float32)
    alone = cm.reshard_time(small, (Partial(), R), (R, R), MESH)
    bucketed = cm.reshard_time(small, (Partial(), R), (R, R), MESH, bucketed=True)
    bandwidth_only = cm.collective_time("all_reduce", small.nbytes, 2, MESH.bandwidth[0], 0.0)
    share = small.nbytes / cm.BUCKET_BYTES
    assert bucketed == pytest.approx(bandwidth_only + share * (alone - bandwidth_only))
    assert bucketed < alone / 50
