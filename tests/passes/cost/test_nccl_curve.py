"""NCCL's protocol model (cost_model.nccl_time) held against published nccl-tests figures."""

import pytest

from autopar.ir.devices import PROFILES
from autopar.ir.mesh import Mesh
from autopar.passes.cost import cost_model as cm

H100 = PROFILES["h100"]
MiB = 2**20


def busbw(kind: str, nbytes: float, n: int, per_node: int, bw: float) -> float:
    t = cm.collective_time(kind, nbytes, n, bw, 0.0, 0.0, per_node, H100.nccl)
    factor = 2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n
    return nbytes * factor / t


# nccl-tests all_reduce_perf, 8 GPUs of one NVLink-4 node (NCCL 2.30, out-of-place), as posted
# in kvcache-ai/Mooncake PR #3484: size -> time (us)
NVLINK4_ALL_REDUCE_US = {1 * MiB: 27.76, 4 * MiB: 53.24, 16 * MiB: 121.33, 128 * MiB: 700.25,
                         1024 * MiB: 5252.64}


@pytest.mark.parametrize("nbytes,measured_us", sorted(NVLINK4_ALL_REDUCE_US.items()))
def test_all_reduce_in_a_node_follows_nccl_tests_by_message_size(nbytes, measured_us):
    t = cm.collective_time("all_reduce", nbytes, 8, H100.intra_node_bandwidth, 0.0, 0.0, 8,
                           H100.nccl)
    assert t * 1e6 == pytest.approx(measured_us, rel=0.2)


def test_small_messages_reach_a_fraction_of_the_bus_bandwidth():
    bw = H100.intra_node_bandwidth
    curve = [busbw("all_reduce", s * MiB, 8, 8, bw) for s in (0.0625, 1, 16, 256, 4096)]
    assert curve == sorted(curve)  # rises with the message size
    assert curve[0] < 0.05 * bw and curve[1] < 0.25 * bw and curve[-1] > 0.95 * bw


def test_across_nodes_large_messages_run_at_the_nics_and_small_ones_take_the_tree():
    # nccl-tests issue #309 (NVIDIA/nccl-tests): 4 HGX H100 nodes, 8 x 400 Gb/s NICs each,
    # all_reduce_perf busbw up to 366 GB/s
    mesh = Mesh((32,), ("dp",), "h100")
    assert cm.members_per_node(mesh, (0,)) == 8
    big = busbw("all_reduce", 8 * 1024 * MiB, 32, 8, mesh.bandwidth[0])
    assert big == pytest.approx(366e9, rel=0.1)
    # one GPU per node over 64 nodes: a tiny all-reduce climbs a tree (log2 of the nodes),
    # not 126 ring steps over the network
    tiny = cm.collective_time("all_reduce", 1024, 64, 45e9, 0.0, 0.0, 1, H100.nccl)
    assert tiny < 100e-6
    ring_steps = 2 * 63 * H100.nccl.protocols[0].net_step_one_per_node_s
    assert tiny < ring_steps / 3


def test_reduce_scatter_and_all_gather_take_half_an_all_reduces_steps():
    bw = H100.intra_node_bandwidth
    for nbytes in (64 * 1024, 8 * MiB, 512 * MiB):
        ar = cm.collective_time("all_reduce", nbytes, 8, bw, 0.0, 0.0, 8, H100.nccl)
        rs = cm.collective_time("reduce_scatter", nbytes, 8, bw, 0.0, 0.0, 8, H100.nccl)
        ag = cm.collective_time("all_gather", nbytes, 8, bw, 0.0, 0.0, 8, H100.nccl)
        assert rs == ag and rs < ar <= 2 * rs


def test_members_per_node_follow_the_rank_layout():
    mesh = Mesh((4, 16, 8), ("pp", "dp", "tp"), "h100")
    assert cm.members_per_node(mesh, (2,)) == 8  # tp fills the node
    assert cm.members_per_node(mesh, (1,)) == 1  # one dp rank per node
    assert cm.members_per_node(Mesh((16, 4), ("dp", "tp"), "h100"), (0,)) == 2


def test_the_cpu_profile_keeps_the_ring_formula():
    cpu = PROFILES["cpu"]
    assert cpu.nccl is None
    t = cm.collective_time("all_reduce", 1e6, 4, 1e9, 1e-4, 1e-3, 4, cpu.nccl)
    assert t == pytest.approx(1e-3 + 6 * 1e-4 + 1.5e6 / 1e9)
