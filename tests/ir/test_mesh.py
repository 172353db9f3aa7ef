import pytest

from autopar import Mesh, MeshError, get_profile


def test_parse_axes_and_sizes():
    m = Mesh.parse("dp=8,tp=8", "h100")
    assert m.shape == (8, 8) and m.axes == ("dp", "tp") and m.size == 64
    assert m.axis_size("tp") == 8
    assert Mesh.parse("4").axes == ("dp",)


def test_inner_axes_in_a_node_get_nvlink_outer_get_network():
    m = Mesh((16, 8), ("dp", "tp"), "h100")
    prof = get_profile("h100")
    assert m.bandwidth == (prof.inter_node_bandwidth, prof.intra_node_bandwidth)
    assert m.latency[0] > m.latency[1]
    m3 = Mesh((8, 16, 8), ("pp", "dp", "tp"), "h200")
    assert m3.bandwidth[1] == m3.bandwidth[0] == prof.inter_node_bandwidth


def test_custom_links_are_kept():
    m = Mesh((2, 4), ("dp", "tp"), "a100", bandwidth=(1e9, 2e9), latency=(1e-5, 2e-6))
    assert m.bandwidth == (1e9, 2e9) and m.latency == (1e-5, 2e-6)


@pytest.mark.parametrize(
    "text", ["dp=8,tp", "dp=x", "=4", "dp:8"],
)
def test_bad_mesh_text_says_how_to_write_it(text):
    with pytest.raises(MeshError, match="axis=size"):
        Mesh.parse(text)


def test_mesh_errors():
    with pytest.raises(MeshError, match="one name per axis"):
        Mesh((2, 4), ("dp",))
    with pytest.raises(MeshError, match="must differ"):
        Mesh((2, 2), ("dp", "dp"))
    with pytest.raises(MeshError, match="unknown device"):
        Mesh((2,), ("dp",), "tpu9")
    with pytest.raises(MeshError, match="no axis"):
        Mesh((2,), ("dp",)).axis_index("tp")


@pytest.mark.parametrize("name", ["h100", "h200", "a100", "cpu"])
def test_builtin_profiles_have_the_roofline_numbers(name):
    p = get_profile(name)
    assert p.peak_flops["float32"] > 0 and p.peak_flops["bfloat16"] > 0
    assert p.mem_bandwidth > 0 and p.mem_capacity > 0
    if name != "cpu":
        assert p.peak_flops["bfloat16"] > p.peak_flops["float32"]


def test_in_node_counts_the_axes_inside_an_axis():
    m = Mesh((4, 8), ("dp", "tp"), "h100")  # 8 GPUs a node
    assert m.in_node("tp") and not m.in_node("dp") and not m.in_node("dp+tp")
    assert Mesh((2, 2), ("dp", "tp"), "h100").in_node("dp+tp")
    assert not Mesh((2, 16), ("dp", "tp"), "h100").in_node("tp")
