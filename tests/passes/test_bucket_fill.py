"""Gradient buckets repriced at their real fill (passes.bucket_fill)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from autopar import planner
from autopar.mesh import Mesh
from autopar.models import MLP, REFERENCE_PLANS, MLPConfig
from autopar.passes import bucket_fill
from autopar.passes.scoring import score_assignment
from autopar.planner import make_plan
from autopar.solver import evaluate


def _mlp_plan(axis: str, reference: str, **kw):
    with torch.device("meta"):
        model = MLP(MLPConfig(in_dim=256, hidden=(1024, 256, 1024), out_dim=256))
    x = torch.empty(256, 256, device="meta")
    mesh = Mesh((4,), (axis,), "cpu")
    refs = {reference: REFERENCE_PLANS[reference](model, mesh.shape, mesh.axes, "mlp",
                                                  batch_size=256)}
    return make_plan(model, mesh, (x, x), references=refs, time_limit_s=5, **kw)


def _kinds(planned) -> list[tuple[str, str, int]]:
    return sorted((c.kind, c.reason, c.count) for c in planned.plan.collectives)


def test_tensor_parallel_plan_drops_the_nearly_empty_bucket(monkeypatch) -> None:
    """Priced as full-bucket members, the row-parallel biases' gradients are summed over a
    sharded batch and all-reduced in a 2 KiB bucket; priced at that bucket's fill, the plan
    computes them from the whole output gradient: torch's three all-reduces, no more."""
    monkeypatch.setattr(planner, "REPRICE_ROUNDS", 0)
    optimistic = _mlp_plan("tp", "megatron_tp")
    assert ("all_reduce", "gradient sync", 1) in _kinds(optimistic)
    monkeypatch.undo()
    planned = _mlp_plan("tp", "megatron_tp")
    assert _kinds(planned) == [("all_reduce", "resharding", 3)]
    sp = planned.problem
    assert sp.bucket_fill  # the 2 KiB bucket was found and priced at its fill
    # the repriced problem still prices every assignment as the full-graph score does
    rng = np.random.default_rng(0)
    p = sp.problem
    for _ in range(5):
        a = [int(rng.integers(len(c))) for c in p.costs]
        assert evaluate(p, a)[0] == pytest.approx(
            score_assignment(sp, sp.expand(a)).cost.step_s, rel=1e-9)


def test_full_buckets_keep_their_price() -> None:
    """Data parallelism's buckets hold megabytes: nothing to reprice, no second solve."""
    planned = _mlp_plan("dp", "data_parallel")
    assert bucket_fill.measure(planned.problem, planned.node_choice) == {}
    assert not bucket_fill.reprice(planned.problem, planned.node_choice, None)
    assert planned.problem.bucket_fill == {}


def test_one_plans_fill_does_not_overcharge_a_reference_whose_buckets_fill() -> None:
    """The TP plan's nearly-empty bucket reprices its key for the solver; the data-parallel
    reference on the same axis, whose buckets hold megabytes, is still completed and scored
    as it is when planned alone."""
    with torch.device("meta"):
        model = MLP(MLPConfig(in_dim=256, hidden=(1024, 256, 1024), out_dim=256))
    x = torch.empty(256, 256, device="meta")
    mesh = Mesh((4,), ("tp",), "cpu")

    def ref(name: str):
        return REFERENCE_PLANS[name](model, mesh.shape, mesh.axes, "mlp", batch_size=256)

    alone = make_plan(model, mesh, (x, x), time_limit_s=5,
                      references={"data_parallel": ref("data_parallel")})
    both = make_plan(model, mesh, (x, x), time_limit_s=5,
                     references={n: ref(n) for n in ("data_parallel", "megatron_tp")})
    assert both.problem.bucket_fill  # repriced for the TP plan
    assert both.plan.references["data_parallel"].step_s == pytest.approx(
        alone.plan.references["data_parallel"].step_s, rel=1e-9)
