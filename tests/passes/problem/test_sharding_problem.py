import numpy as np
import pytest

from autopar.capture.joint import capture
from autopar.ir.mesh import Mesh
from autopar.ir.options import Options
from autopar.models import get_preset
from autopar.passes.problem import sharding_problem
from autopar.passes.problem.scoring import score_assignment
from autopar.solver import evaluate


def _problem(preset_name, mesh, batch=4, seq=32, **changes):
    preset = get_preset(preset_name)
    if changes:
        preset = preset.replace(**changes)
    pg = capture(preset.build("meta"), preset.example_inputs(batch, seq))
    return pg, sharding_problem.build(pg, mesh)


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama3-tiny"])
def test_reduced_objective_equals_the_full_graph_score(name):
    _, sp = _problem(name, Mesh((2, 2), ("dp", "tp")))
    rng = np.random.default_rng(0)
    p = sp.problem
    for _ in range(5):
        a = [int(rng.integers(len(c))) for c in p.costs]
        reduced = evaluate(p, a)[0]
        cost = score_assignment(sp, sp.expand(a)).cost
        # the solver sums communication and compute; the step credits their overlap
        assert reduced == pytest.approx(cost.compute_s + cost.comm_s, rel=1e-9)
        assert cost.step_s <= cost.compute_s + cost.comm_s


def test_on_a_mesh_too_large_to_route_moves_are_priced_by_bytes_alone():
    """Above 64 devices a reshard's price depends on the tensor's bytes only, so the edge
    matrices share it between tensors of one size (``cost_model.reshard_price_key``); the
    reduced objective must still be the full graph's score, each move priced on its own."""
    _, sp = _problem("gpt2-tiny", Mesh((16, 8), ("dp", "tp")), batch=16)
    assert {len(k[0]) for k in sp.reshard_cache} == {1}  # keyed by bytes
    # a spec pair's collectives are worked out once for tensors of every size
    assert {k[0] for k in sp.moves_cache} == {()}
    assert len(sp.moves_cache) < len(sp.reshard_cache)
    rng = np.random.default_rng(1)
    p = sp.problem
    for _ in range(5):
        a = [int(rng.integers(len(c))) for c in p.costs]
        cost = score_assignment(sp, sp.expand(a)).cost
        assert evaluate(p, a)[0] == pytest.approx(cost.compute_s + cost.comm_s, rel=1e-9)


def test_solver_variables_do_not_grow_with_depth():
    mesh = Mesh((2, 4), ("dp", "tp"))
    _, shallow = _problem("llama3-tiny", mesh, n_layers=3)
    _, deep = _problem("llama3-tiny", mesh, n_layers=12)
    assert len(deep.nodes) > 3 * len(shallow.nodes)
    assert deep.problem.num_nodes == shallow.problem.num_nodes
    assert deep.shared_layers == 11


def test_followers_are_merged_into_their_producers():
    _, sp = _problem("gpt2-tiny", Mesh((4,), ("tp",)))
    roots = int(np.sum(sp.group_of == np.arange(len(sp.nodes))))
    assert roots < len(sp.nodes) / 2


def test_every_node_has_the_replicated_strategy_first():
    _, sp = _problem("gpt2-tiny", Mesh((2, 2), ("dp", "tp")))
    for strategies in sp.strategies:
        s = strategies[0]
        assert all(repr(p) == "R" for spec in s.ins + s.outs for p in spec)


def test_a_split_contraction_may_all_reduce_inside_the_op():
    """Row-parallel matmul: the partial sum can be all-reduced in the op (priced there, once)
    so every consumer reads the whole value, instead of each edge reducing it again."""
    import torch

    from autopar.ir.placements import Partial, Replicate
    from autopar.passes.cost import cost_model as cm

    pg, sp = _problem("gpt2-tiny", Mesh((4,), ("tp",)))
    mesh = sp.mesh
    i = next(k for k, n in enumerate(sp.nodes) if n.target is torch.ops.aten.mm.default)
    strategies = sp.strategies[i]
    reduced = [k for k, s in enumerate(strategies) if s.raw_outs]
    assert reduced, "an mm split over its contraction offers the in-op all-reduce"
    for k in reduced:
        s = strategies[k]
        assert isinstance(s.raw_outs[0][0], Partial) and isinstance(s.outs[0][0], Replicate)
        raw = next(j for j, t in enumerate(strategies)
                   if not t.raw_outs and t.ins == s.ins and t.outs == s.raw_outs)
        meta = sp.nodes[i].meta["autopar"].out
        ar = cm.reshard_time(meta, s.raw_outs[0], s.outs[0], mesh)
        assert ar > 0
        assert sp.node_cost[i][k] - sp.node_cost[i][raw] == pytest.approx(ar * sp.weight[i])


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama3-tiny"])
def test_refining_followers_never_costs_more_and_moves_only_followers(name):
    from autopar.passes.problem.reduction import refine_followers

    _, sp = _problem(name, Mesh((2, 2), ("dp", "tp")))
    rng = np.random.default_rng(1)
    p = sp.problem
    improved = 0
    for _ in range(5):
        choice = sp.expand([int(rng.integers(len(c))) for c in p.costs])
        before = score_assignment(sp, choice).cost.step_s
        refined = refine_followers(sp, choice)
        after = score_assignment(sp, refined).cost.step_s
        assert after <= before * (1 + 1e-12)
        improved += after < before * (1 - 1e-9)
        for i, (a, b) in enumerate(zip(choice, refined)):
            if a != b:
                assert sp.group_of[i] != i, f"{sp.nodes[i].name} is a root, it must not move"
    assert improved, "a random plan's followers can always be placed better"


def test_refining_followers_sees_past_the_follower_to_its_consumers():
    """Megatron's row-parallel bias, replicated: merging alone sums its gradient in a sharded
    layout (cheapest for the sum) and then gathers it for the parameter; refined, the sum runs
    where the gradient is needed and the gather is gone."""
    import torch

    from autopar.models import MLP, REFERENCE_PLANS, MLPConfig
    from autopar.planning.planner import make_plan

    with torch.device("meta"):
        model = MLP(MLPConfig(in_dim=256, hidden=(1024, 256, 1024), out_dim=256))
    x = torch.empty(256, 256, device="meta")
    mesh = Mesh((4,), ("tp",), "cpu")
    refs = {"megatron_tp": REFERENCE_PLANS["megatron_tp"](model, mesh.shape, mesh.axes, "mlp",
                                                          batch_size=256)}
    planned = make_plan(model, mesh, (x, torch.empty_like(x)), references=refs,
                        options=Options.of(time_limit_s=2.0))
    from autopar.passes.problem import sharding_problem as spm
    from autopar.passes.problem.reduction import refine_followers

    flat = spm.build(planned.graph, mesh, share_layers=False)
    refined = planned.reference_choices["megatron_tp"]
    unrefined = list(refined)
    # undo the refinement by merging's own rule: each follower as its producer dictates
    for i in range(len(flat.nodes)):
        if flat.group_of[i] != i:
            unrefined[i] = int(flat.follow[i][unrefined[int(flat.group_of[i])]])
    gathers = [c for c in score_assignment(flat, unrefined).collectives
               if c.kind == "all_gather" and c.reason == "gradient sync"]
    assert gathers, "merging alone gathers the row-parallel bias gradients"
    after = score_assignment(flat, refine_followers(flat, unrefined))
    assert not [c for c in after.collectives
                if c.kind == "all_gather" and c.reason == "gradient sync"]
    assert after.cost.step_s < score_assignment(flat, unrefined).cost.step_s


def test_a_sharded_random_op_is_priced_as_the_whole_draw_it_runs():
    """Every rank draws the whole dropout mask and keeps its piece (``random_whole_draw``):
    sharding it saves no compute, so its cost is the replicated draw's."""
    import torch

    from autopar.passes.strategies.random import WHOLE_DRAW

    pg, sp = _problem("gpt2-tiny", Mesh((4,), ("dp",)), dropout=0.1)
    drops = [k for k, n in enumerate(sp.nodes)
             if n.target in (torch.ops.aten.native_dropout.default,
                             torch.ops.aten.bernoulli_.float)]
    assert drops
    for i in drops:
        strategies = sp.strategies[i]
        whole = [k for k, s in enumerate(strategies) if WHOLE_DRAW in s.impls]
        assert whole, sp.nodes[i]
        for k in whole:
            assert sp.node_cost[i][k] == pytest.approx(sp.node_cost[i][0])  # 0: replicated


@pytest.mark.parametrize("shape", [(2, 2), (16, 8)])
def test_edge_matrices_price_each_move_as_the_cost_model_does(shape):
    """Edge matrices, built through the caches (one Move list per spec pair where the shape
    does not matter, per what of its shape a nested route reads), equal every move priced on
    its own by ``cost_model.reshard_time``, bucket shares included."""
    from autopar.passes.cost import cost_model as cm
    from autopar.passes.problem.edge_costs import (
        _batch_price,
        _kind,
        edge_matrix,
        edge_meta,
        edge_specs,
    )

    _, sp = _problem("gpt2-tiny", Mesh(shape, ("dp", "tp")), batch=16)
    rng = np.random.default_rng(2)
    for k in rng.choice(len(sp.edges), size=40, replace=False):
        e = sp.edges[int(k)]
        m = edge_matrix(sp, e)
        meta, (srcs, dsts) = edge_meta(sp, e), edge_specs(sp, e)
        for _ in range(10):
            i, j = int(rng.integers(len(srcs))), int(rng.integers(len(dsts)))
            bucketed, fill = _batch_price(sp, meta, srcs[i], dsts[j], _kind(sp, e))
            want = cm.reshard_time(meta, srcs[i], dsts[j], sp.mesh, bucketed, fill)
            assert m[i, j] == pytest.approx(want, rel=1e-12, abs=1e-15)


def test_inputs_written_in_place_are_never_resharded():
    """BatchNorm's running stats (written by native_batch_norm in training, which its schema
    does not say) and its counter (add_): their edges forbid every move, so the buffer reaches
    the op as it is; in eval mode nothing is written."""
    import torch

    from autopar.passes.problem.edge_costs import edge_matrix, edge_specs
    from autopar.passes.strategies.registry import mutated_inputs, tensor_inputs
    from autopar.solver.reduce import FORBIDDEN

    class ConvBN(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 8, 3, padding=1, bias=False)
            self.bn = torch.nn.BatchNorm2d(8)

        def forward(self, x):
            return self.bn(self.conv(x)).square().mean()

    model, x = ConvBN(), torch.randn(4, 3, 6, 6)
    pg = capture(model, (x,))
    bn = next(n for n in pg.graph.nodes if n.target is torch.ops.aten.native_batch_norm.default)
    names = [a.name for a in tensor_inputs(bn)]
    assert {names[i] for i in mutated_inputs(bn)} == {bn.args[3].name, bn.args[4].name}
    add_ = next(n for n in pg.graph.nodes if n.target is torch.ops.aten.add_.Tensor)
    assert mutated_inputs(add_) == frozenset({0})
    sp = sharding_problem.build(pg, Mesh((2, 2), ("dp", "tp"), "cpu"))
    written = [e for e in sp.edges if e.written]
    assert {sp.nodes[e.dst].name for e in written} == {bn.name, add_.name}
    for e in written:
        m = edge_matrix(sp, e)
        srcs, dsts = edge_specs(sp, e)
        for i, a in enumerate(srcs):
            for j, b in enumerate(dsts):
                assert (m[i, j] >= FORBIDDEN) == (a != b)
    pg_eval = capture(model.eval(), (x,))
    bn_eval = next(n for n in pg_eval.graph.nodes if "batch_norm" in str(n.target)
                   and "backward" not in str(n.target))
    assert mutated_inputs(bn_eval) == frozenset()


def _same_problem(a, b):
    from autopar.passes.problem.edge_costs import edge_matrix

    assert [n.name for n in a.nodes] == [n.name for n in b.nodes]
    assert len(a.edges) == len(b.edges)
    for e, f in zip(a.edges, b.edges):
        assert np.array_equal(edge_matrix(a, e), edge_matrix(b, f))
    for x, y in zip(a.node_cost, b.node_cost):
        assert np.array_equal(x, y)
    pa, pb = a.problem, b.problem
    assert len(pa.costs) == len(pb.costs)
    for x, y in zip(pa.costs, pb.costs):
        assert np.array_equal(x, y)


@pytest.mark.parametrize("mesh", [Mesh((2, 4), ("dp", "tp")), Mesh((16, 8), ("dp", "tp"))])
def test_problems_lent_prices_by_another_mode_are_the_problems_built_alone(mesh):
    """The planner's modes build their problems on one mesh with the first's caches
    (``prices_of``: strategy lists, move prices, whole resharding tables, edge matrices at
    equal prices) and the mesh's (``on_mesh``: lists, node costs and usages); each must be the
    problem built alone, with nothing shared, edge for edge, also once its bucket fills
    change (a repricing, which moves a problem to the matrices of its new prices)."""
    from autopar.passes.problem import bucket_fill
    from autopar.planning.modes import mode_graph

    pg, first = _problem("llama3-tiny", mesh, batch=16)
    for label, zero1 in (("full+zero3", False), ("selective", False), ("none", True)):
        mpg = mode_graph(pg, label)
        lent = sharding_problem.build(mpg, mesh, zero1=zero1, prices_of=first)
        alone = _built_alone(mpg, mesh, zero1=zero1)
        assert lent.table_cache is first.table_cache and alone.table_cache is not lent.table_cache
        assert lent.strategies[0] is first.strategies[0]
        assert alone.strategies[0] is not first.strategies[0]
        _same_problem(lent, alone)
        fills = {k: v / 3 for k, v in _fills(lent).items()}  # buckets found a third full
        assert fills
        for sp in (lent, alone):
            bucket_fill.apply(sp, dict(fills), None)
        _same_problem(lent, alone)
        # back at the build's prices: the matrices shared with the other modes, unchanged
        bucket_fill.apply(lent, {}, None)
        _same_problem(lent, _built_alone(mpg, mesh, zero1=zero1))
    assert first.table_cache  # tables were lent


def _built_alone(pg, mesh, **kw):
    """``pg``'s problem built with no cache shared: no other mode's, nor the mesh's."""
    saved = sharding_problem._ON_MESH[:]
    sharding_problem._ON_MESH[:] = [None, {}]
    try:
        return sharding_problem.build(pg, mesh, **kw)
    finally:
        sharding_problem._ON_MESH[:] = saved


def _fills(sp):
    """Every gradient bucket key the problem's edges price, each at a byte."""
    from autopar.passes.cost.buckets import bucket_kind
    from autopar.passes.problem.edge_costs import edge_meta, edge_specs

    keys = set()
    for e in sp.edges:
        if e.in_idx < 0:
            srcs, dsts = edge_specs(sp, e)
            for a in set(srcs):
                for b in set(dsts):
                    k = bucket_kind(a, b)
                    if k is not None:
                        keys.add((k.kind, k.axes, edge_meta(sp, e).dtype))
    return dict.fromkeys(keys, 3.0)
