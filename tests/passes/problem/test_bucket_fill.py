"""Gradient buckets repriced at their real fill (passes/problem/bucket_fill.py)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from autopar.ir.devices import GBps, get_profile
from autopar.ir.mesh import Mesh
from autopar.ir.options import Options
from autopar.models import MLP, REFERENCE_PLANS, MLPConfig
from autopar.passes.problem import bucket_fill
from autopar.passes.problem.scoring import score_assignment
from autopar.planning import planner
from autopar.planning.planner import make_plan
from autopar.solver import evaluate

# These tests are about repricing buckets at their fill, whichever layout wins. They need the
# tensor-parallel layout to win on this MLP, as it did under the `cpu` profile's first
# calibration (1 ms per collective, 0.5 GB/s); the measured one (2.5 ms, 1.2 GB/s) makes each
# of its synchronous all-reduces dearer and picks data parallelism.
TP_WINS = dataclasses.replace(get_profile("cpu"), name="cpu-tp-wins", collective_overhead=1e-3,
                              intra_node_bandwidth=0.5 * GBps, inter_node_bandwidth=0.2 * GBps)


def _mlp_plan(axis: str, reference: str, **kw):
    with torch.device("meta"):
        model = MLP(MLPConfig(in_dim=256, hidden=(1024, 256, 1024), out_dim=256))
    x = torch.empty(256, 256, device="meta")
    mesh = Mesh((4,), (axis,), TP_WINS)
    refs = {reference: REFERENCE_PLANS[reference](model, mesh.shape, mesh.axes, "mlp",
                                                  batch_size=256)}
    return make_plan(model, mesh, (x, x), references=refs, **kw,
                     options=Options.of(time_limit_s=5))


def _kinds(planned) -> list[tuple[str, str, int]]:
    return sorted((c.kind, c.reason, c.count) for c in planned.plan.predicted.collectives)


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
    mesh = Mesh((4,), ("tp",), TP_WINS)

    def ref(name: str):
        return REFERENCE_PLANS[name](model, mesh.shape, mesh.axes, "mlp", batch_size=256)

    alone = make_plan(model, mesh, (x, x), references={"data_parallel": ref("data_parallel")},
                      options=Options.of(time_limit_s=5))
    both = make_plan(model, mesh, (x, x),
                     references={n: ref(n) for n in ("data_parallel", "megatron_tp")},
                     options=Options.of(time_limit_s=5))
    assert both.problem.bucket_fill  # repriced for the TP plan
    assert both.plan.provenance.references["data_parallel"].step_s == pytest.approx(
        alone.plan.provenance.references["data_parallel"].step_s, rel=1e-9)


def test_a_reference_completion_is_repriced_when_another_plan_wins() -> None:
    """On the measured `cpu` profile data parallelism wins on this MLP even on the "tp" axis;
    the megatron reference, completed as the benchmarks run it, must still compute the
    row-parallel biases' gradients without a near-empty bucket: three all-reduces."""
    from autopar.ir.plan import SolverInfo
    from autopar.planning.assemble import assemble_plan

    with torch.device("meta"):
        model = MLP(MLPConfig(in_dim=256, hidden=(1024, 256, 1024), out_dim=256))
    x = torch.empty(256, 256, device="meta")
    mesh = Mesh((4,), ("tp",), "cpu")
    ref = REFERENCE_PLANS["megatron_tp"](model, mesh.shape, mesh.axes, "mlp", batch_size=256)
    planned = make_plan(model, mesh, (x, x), references={"megatron_tp": ref},
                        options=Options.of(time_limit_s=5))
    assert "megatron_tp" not in planned.plan.provenance.solver.method  # the solver's own plan won
    completion = assemble_plan(planned.graph, planned.problem,
                               planned.reference_choices["megatron_tp"], "MLP", mesh,
                               SolverInfo("reference", 0.0, "megatron_tp"), {}, {}, None)
    assert _kinds(SimpleNamespace(plan=completion)) == [("all_reduce", "resharding", 3)]


def test_a_kept_score_and_peak_are_those_worked_out_afresh_at_any_prices() -> None:
    """``bucket_fill.score`` and ``step_memory.step_peak`` keep each choice's answer on its
    problem: neither reads the solver's prices, so after the problem is repriced (its bucket
    fills changed) the kept answer is still the one worked out afresh."""
    from autopar.passes.memory.peak import peak_memory
    from autopar.passes.problem.step_memory import step_peak, step_usage

    planned = _mlp_plan("tp", "megatron_tp")
    sp = planned.problem
    rng = np.random.default_rng(1)
    choices = [planned.node_choice] + [
        sp.expand(tuple(int(rng.integers(len(c))) for c in sp.problem.costs)) for _ in range(4)]
    kept = [(bucket_fill.score(sp, c), step_peak(sp, c)) for c in choices]
    assert bucket_fill.score(sp, choices[0]) is kept[0][0]  # kept, not worked out again
    for fills in ({}, {k: v / 7 for k, v in sp.bucket_fill.items()}, dict(sp.bucket_fill)):
        bucket_fill.apply(sp, fills, None)
        for c, (scored, peak) in zip(choices, kept):
            again = bucket_fill.score(sp, c)
            sp.score_cache.clear()
            sp.peak_cache.clear()
            assert again.cost == bucket_fill.score(sp, c).cost == scored.cost
            assert sp.bucket_fill == fills  # scoring leaves the solver's prices as they were
            assert step_peak(sp, c) == peak == peak_memory(*step_usage(sp, c))
