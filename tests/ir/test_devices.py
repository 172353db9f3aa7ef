"""Device profiles: one per GPU kind of the published runs, GEMMs priced by shape, fused
attention at its own rate, and the CPU profile as it was."""

from __future__ import annotations

import pytest

from autopar import Mesh, get_profile
from autopar.ir.devices import PROFILES


@pytest.mark.parametrize("name", ["a100", "a100-40gb", "h100", "h100-96gb", "h200"])
def test_large_gemms_reach_the_measured_matmul_rate(name):
    prof = get_profile(name)
    big = prof.gemm_efficiency(16384, 16384, 8192)
    assert big == pytest.approx(prof.matmul_efficiency, rel=0.05)
    assert 0.75 < prof.matmul_efficiency < 0.9  # MAMF over the datasheet peak


@pytest.mark.parametrize("name", ["a100", "h100"])
def test_small_and_skinny_gemms_fall_below_it(name):
    prof = get_profile(name)
    big = prof.gemm_efficiency(8192, 8192, 8192)
    small = prof.gemm_efficiency(1024, 1024, 1024)
    skinny = prof.gemm_efficiency(64, 4096, 4096)
    assert skinny < small < big
    assert skinny < 0.5 * big
    # the rate never exceeds the large-GEMM rate, whatever the shape
    for m, n in [(1, 1), (128, 128), (255, 257), (100000, 3)]:
        assert 0 < prof.gemm_efficiency(m, n, 512) <= prof.matmul_efficiency


def test_profiles_by_kind():
    assert get_profile("a100-40gb").mem_capacity < get_profile("a100").mem_capacity
    assert get_profile("A100_40GB") is PROFILES["a100-40gb"]
    assert get_profile("H100-96GB") is PROFILES["h100-96gb"]
    capped, sxm = get_profile("h100-96gb"), get_profile("h100")
    assert capped.peak("bfloat16") < sxm.peak("bfloat16")  # 500 W: a lower clock
    assert capped.mem_capacity > sxm.mem_capacity
    # HBM2e at 2.4 TB/s (torchtitan's benchmark hardware notes), not the HBM3 part's 3.35
    assert capped.mem_bandwidth == 2400e9 < sxm.mem_bandwidth
    for prof in (capped, sxm, get_profile("a100")):
        assert 0 < prof.attention_flops_per_s("bfloat16") < prof.flops_per_s("bfloat16")


def test_cpu_profile_prices_every_matmul_alike():
    cpu = get_profile("cpu")
    assert cpu.sms == 0
    assert cpu.gemm_efficiency(8, 8, 8) == cpu.gemm_efficiency(4096, 4096, 4096) == 0.5
    assert cpu.attention_flops_per_s("float32") == cpu.flops_per_s("float32")


def test_an_axis_across_nodes_gets_a_nic_per_member_in_a_node():
    prof = get_profile("a100")
    alone = Mesh((32,), ("dp",), "a100")  # 8 members in each node: 8 rails
    assert alone.bandwidth[0] == min(prof.intra_node_bandwidth, 8 * prof.inter_node_bandwidth)
    outer = Mesh((32, 8), ("dp", "tp"), "a100")  # tp fills the node: one rail per group
    assert outer.bandwidth[0] == prof.inter_node_bandwidth
    half = Mesh((32, 4), ("dp", "tp"), "a100")  # two dp members in a node
    assert half.bandwidth[0] == 2 * prof.inter_node_bandwidth


def test_async_tp_is_a_suffix_of_a_gpu_device_name():
    from autopar.ir.devices import ASYNC_TP_HIDDEN, get_profile
    from autopar.ir.errors import MeshError

    p = get_profile("H100-96GB+async-tp")
    assert p.name == "h100-96gb+async-tp" and p.async_tp == ASYNC_TP_HIDDEN
    assert get_profile("h100-96gb").async_tp == 0.0
    assert p.peak_flops == get_profile("h100-96gb").peak_flops
    with pytest.raises(MeshError, match="async TP"):
        get_profile("cpu+async-tp")  # gloo's collectives take the compute's cores
    with pytest.raises(MeshError, match="unknown device"):
        get_profile("tpu+async-tp")
