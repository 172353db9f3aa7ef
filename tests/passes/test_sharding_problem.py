import numpy as np
import pytest

from autopar.capture import capture
from autopar.mesh import Mesh
from autopar.models import get_preset
from autopar.passes import sharding_problem
from autopar.passes.scoring import score_assignment
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
        full = score_assignment(sp, sp.expand(a)).cost.step_s
        assert reduced == pytest.approx(full, rel=1e-9)


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

    from autopar.passes import cost_model as cm
    from autopar.placements import Partial, Replicate

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
