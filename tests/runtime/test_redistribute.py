"""Redistribution between any two specs, all ranks simulated with LocalTensorMode.

Every rank gets its piece of a random tensor under ``src`` (``simulate.shard``: partial values
are random addends, so treating one as whole is caught), the runtime moves it to ``dst``, and
the pieces must put back together (``simulate.unshard``, which also checks that replicas agree)
to the same tensor. Where the cost model's axis order is executable, the collectives executed
must be exactly those ``cost_model.reshard_collectives`` predicts.
"""

from __future__ import annotations

import itertools
import os

import torch
from harness.spmd import fake_world
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from autopar.ir.graph import TensorMeta
from autopar.ir.mesh import Mesh
from autopar.ir.placements import Partial, R, Shard, evenly_divides, local_shape
from autopar.passes.cost import cost_model
from autopar.passes.cost.cost_model import route_collectives
from autopar.passes.cost.reshard_route import route
from autopar.passes.strategies.simulate import coords, shard, unshard
from autopar.runtime.redistribute import CollectiveCounter, Comm, redistribute

MESHES = [(2,), (4,), (2, 2), (2, 2, 2)]


def _placement(ndim: int, partial: bool) -> st.SearchStrategy:
    options = [R] + [Shard(d) for d in range(ndim)] + ([Partial("sum")] if partial else [])
    return st.sampled_from(options)


@st.composite
def cases(draw: st.DrawFn):
    mesh_shape = draw(st.sampled_from(MESHES))
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.sampled_from([2, 4, 8])) for _ in range(ndim))
    specs = []
    for _ in range(2):
        spec = tuple(draw(_placement(ndim, True)) for _ in mesh_shape)
        specs.append(spec)
    return mesh_shape, shape, specs[0], specs[1]


def _check(mesh_shape, shape, src, dst, mode) -> list:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = Mesh(mesh_shape, [f"a{i}" for i in range(len(mesh_shape))], "cpu")
    # one DeviceMesh per world and shape (making one per check is slow); kept on the mode, as
    # a cache keyed by id() could hand a later world the mesh of a destroyed process group
    meshes = mode.__dict__.setdefault("_test_meshes", {})
    if mesh_shape not in meshes:
        meshes[mesh_shape] = init_device_mesh("cpu", mesh_shape, mesh_dim_names=mesh.axes)
    dm = meshes[mesh_shape]
    full = torch.randn(shape, dtype=torch.float64)
    with mode.disable():
        pieces = shard(full, src, mesh_shape, torch.Generator().manual_seed(1))
    order = coords(mesh_shape)  # rank r sits at the r-th coordinate in row-major order
    local = mode.rank_map(lambda r: pieces[order[r]].clone())
    counter = CollectiveCounter()
    # sums over several axes merged into one collective where the planner would merge them
    comm = Comm(dm, mesh.axes, mesh_shape, tuple(dm.get_coordinate()), counter,
                cost_model.merged_sums(mesh))
    out = redistribute(local, src, dst, comm)
    got = {order[r]: t for r, t in out._local_tensors.items()}
    with mode.disable():
        back = unshard(got, dst, mesh_shape, atol=1e-9, rtol=1e-9)
        assert torch.allclose(back, full, atol=1e-9), f"{src} -> {dst} on {mesh_shape}"
    executed = [(c.kind, c.axis, c.bytes) for c in counter.records]
    meta = TensorMeta(shape, full.dtype)
    routed = route_collectives(meta, src, dst, mesh)
    assert [(c.kind, c.axis, c.bytes) for c in routed] == executed
    steps, _ = route(src, dst, local_shape(shape, src, mesh_shape), mesh_shape)
    ascending = [(ax, dst[ax]) for ax in range(len(src)) if src[ax] != dst[ax]]
    if steps == ascending:  # the cost model's order ran: it must be exactly what it priced
        want = cost_model.reshard_collectives(meta, src, dst, mesh)
        assert [(c.kind, c.axis, c.bytes) for c in want] == executed
    return counter.records


@settings(max_examples=int(os.environ.get("AUTOPAR_EXAMPLES", "15")), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
@example(((2, 2, 2), (2, 2, 8), (Shard(2), Shard(2), Shard(1)), (Shard(2), Shard(1), Shard(2))))
# neither shard step can go first (each would split a dim of 2 four ways): one is gathered
@example(((2, 2, 2), (2, 2, 2), (Partial("sum"), Shard(2), Shard(0)), (R, Shard(0), Shard(2))))
def test_redistribute_matches_full_tensor(case) -> None:
    mesh_shape, shape, src, dst = case
    if not (evenly_divides(shape, src, mesh_shape) and evenly_divides(shape, dst, mesh_shape)):
        return
    size = 1
    for n in mesh_shape:
        size *= n
    with fake_world(size) as mode:
        _check(mesh_shape, shape, src, dst, mode)


def test_nested_shards_every_pair_on_2x2() -> None:
    """Every spec pair of a 2-d tensor on a 2x2 mesh with a dim split by both axes on one side:
    nesting is where the order of the axis steps matters."""
    specs = list(itertools.product([R, Shard(0), Shard(1), Partial("sum")], repeat=2))
    nested = [(Shard(0), Shard(0)), (Shard(1), Shard(1))]
    pairs = [(a, b) for a in specs for b in specs if a != b and (a in nested or b in nested)]
    fallbacks = 0
    with fake_world(4) as mode:
        for src, dst in pairs:
            records = _check((2, 2), (8, 4), src, dst, mode)
            fallbacks += any(r.reason == "nested-shard fallback" for r in records)
    assert fallbacks > 0  # e.g. (R, S(0)) -> (S(0), S(0)) has no per-axis route


def test_every_route_on_3_axes_is_valid_and_terminates() -> None:
    """Pure routing, no tensors: every step valid when taken, every route reaching ``dst``."""
    from autopar.passes.cost.reshard_route import _invalid, reshard_steps

    options = [R, Shard(0), Shard(1), Partial("sum")]
    for n_axes in (2, 3):
        for src in itertools.product(options, repeat=n_axes):
            for dst in itertools.product(options, repeat=n_axes):
                cur = list(src)
                for ax, b in reshard_steps(src, dst):
                    assert not _invalid(cur, ax, b), (src, dst)
                    cur[ax] = b
                assert tuple(cur) == dst


def test_a_sum_over_two_axes_is_one_all_reduce_where_the_planner_merges_them() -> None:
    """On the ``cpu`` profile's 2x2 mesh one ring over 4 ranks is cheaper than two over 2 at
    every size (``cost_model.merged_sums``): the runtime runs that one collective, over the
    flattened group, and the values are the sum over all four ranks."""
    P = Partial("sum")
    mesh = Mesh((2, 2), ("a0", "a1"), "cpu")
    assert cost_model.merged_sums(mesh) == ((0, 1),)
    with fake_world(4) as mode:
        records = _check((2, 2), (4, 6), (P, P), (R, R), mode)
        assert [(r.kind, r.axis) for r in records] == [("all_reduce", "a0+a1")]
        records = _check((2, 2), (4, 6), (P, P), (R, Shard(0)), mode)  # not a pure sum
        assert [(r.kind, r.axis) for r in records] == [("all_reduce", "a0"),
                                                        ("reduce_scatter", "a1")]
