import pytest
from hypothesis import given
from hypothesis import strategies as st

from autopar.ir.placements import (
    Partial,
    R,
    S,
    Shard,
    evenly_divides,
    format_spec,
    from_torch,
    local_shape,
    parse_placement,
    parse_spec,
    to_torch,
)

placements = st.one_of(
    st.just(R), st.integers(0, 5).map(Shard), st.sampled_from(["sum", "max", "min"]).map(Partial)
)


@given(placements)
def test_repr_reads_back(p):
    assert parse_placement(repr(p)) == p


@given(st.lists(placements, min_size=1, max_size=4))
def test_spec_round_trip(spec):
    assert parse_spec(format_spec(tuple(spec))) == tuple(spec)


def test_reprs_are_the_documented_ones():
    assert [repr(R), repr(S(0)), repr(Partial())] == ["R", "S(0)", "P(sum)"]


@pytest.mark.parametrize("bad", ["", "S", "S(x)", "Q(0)", "P()", "R R"])
def test_bad_placement_names_the_fix(bad):
    with pytest.raises(ValueError, match="write 'R'"):
        parse_placement(bad)


def test_nested_shards_divide_in_mesh_order():
    assert evenly_divides((8, 6), (S(0), S(0)), (2, 4))
    assert not evenly_divides((4, 6), (S(0), S(0)), (2, 4))
    assert evenly_divides((8, 6), (S(0), S(1)), (2, 3))
    assert not evenly_divides((8, 5), (R, S(1)), (2, 2))
    assert local_shape((8, 6), (S(0), S(1)), (2, 3)) == (4, 2)


def test_torch_placements_round_trip():
    for p in (R, S(1), Partial("sum")):
        assert from_torch(to_torch(p)) == p
