"""SPMD equality, all ranks simulated in one process with ``LocalTensorMode``.

A model is trained 3 AdamW steps on one device and, from the same weights and the same global
batch, as ``autopar.parallelize(model, mesh)`` on a simulated mesh; loss, gradients and
parameters must agree (fp32, norm-wise relative error < 1e-5). Models, meshes and plans are
drawn by hypothesis: MLP widths the mesh does not divide, small GPTs, meshes 1/2/4/2x2/2x2x2,
plans from the solver and from every hand-written reference layout (params and inputs pinned,
the rest solved). Set ``AUTOPAR_EXAMPLES`` to draw more cases than the default run does.
"""

from __future__ import annotations

import pytest
import torch
from harness.spmd import (
    EXAMPLES,
    PLANS,
    SETTINGS,
    assert_same_training,
    check_collectives,
    fake_world,
    mesh_for,
    reference_plan,
    run_case,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import autopar
from autopar.ir.mesh import Mesh
from autopar.ir.options import Options
from autopar.ir.placements import R, Shard
from autopar.models import get_preset
from autopar.models.mlp import MLP, MLPConfig
from autopar.runtime._compat import reconcile


def _plan_for(model, family: str, source: str, mesh_shape, inputs):
    if source == "solver":
        return None
    return reference_plan(model, family, source, mesh_for(mesh_shape), inputs)


def _check(model, family: str, inputs, mesh_shape, source: str) -> None:
    torch.manual_seed(0)
    plan = _plan_for(model, family, source, mesh_shape, inputs)
    got, want, pm = run_case(model, inputs, mesh_shape, plan, time_limit_s=1.0)
    what = f"{family} on {mesh_shape} with {source if plan is not None else 'solver'} plan"
    assert_same_training(got, want, what=what)
    check_collectives(got["collectives"][-1], pm, what)


@st.composite
def mlp_cases(draw: st.DrawFn):
    mesh_shape = draw(st.sampled_from([(1,), (2,), (4,), (2, 2)]))
    width = st.sampled_from([3, 4, 6, 8, 10, 12])  # 3, 6, 10: not divisible by 4
    cfg = MLPConfig(in_dim=draw(width), hidden=tuple(draw(st.lists(width, min_size=1,
                                                                    max_size=3))),
                    out_dim=draw(width), activation=draw(st.sampled_from(["gelu", "relu"])),
                    bias=draw(st.booleans()))
    batch = draw(st.sampled_from([4, 6, 8]))
    source = draw(st.sampled_from(PLANS))
    return mesh_shape, cfg, batch, source


@settings(max_examples=EXAMPLES, **SETTINGS)
@given(mlp_cases())
def test_mlp_equals_single_device(case) -> None:
    mesh_shape, cfg, batch, source = case
    torch.manual_seed(0)
    model = MLP(cfg)
    inputs = (torch.randn(batch, cfg.in_dim), torch.randn(batch, cfg.out_dim))
    _check(model, "mlp", inputs, mesh_shape, source)


@st.composite
def gpt_cases(draw: st.DrawFn):
    mesh_shape = draw(st.sampled_from([(2,), (4,), (2, 2)]))
    n_head = draw(st.sampled_from([2, 3, 4]))  # 3 heads: not divisible by the mesh
    cfg = dict(n_layer=draw(st.integers(1, 2)), n_head=n_head, d_model=8 * n_head,
               vocab_size=draw(st.sampled_from([48, 64])), n_positions=16)
    cfg["dropout"] = draw(st.sampled_from([0.0, 0.1]))  # drawn whole, so equal to one device
    batch = draw(st.sampled_from([2, 4]))
    source = draw(st.sampled_from(PLANS))
    return mesh_shape, cfg, batch, source


@settings(max_examples=max(1, EXAMPLES // 2), **SETTINGS)
@given(gpt_cases())
def test_gpt_equals_single_device(case) -> None:
    mesh_shape, cfg, batch, source = case
    preset = get_preset("gpt2-tiny").replace(**cfg)
    torch.manual_seed(0)
    model = preset.build(device="cpu")
    tokens, targets = preset.example_inputs(batch, 8, device="cpu")
    _check(model, "gpt2", (tokens, targets), mesh_shape, source)


@pytest.mark.parametrize("mesh_shape, source", [((2,), "data_parallel"),
                                                ((2,), "megatron_tp"), ((2, 2), "dp_tp_2d")])
def test_gpt_with_dropout_equals_single_device(mesh_shape, source: str) -> None:
    """Dropout sharded over the batch, the heads or the hidden units: each rank draws the
    whole mask from a generator in the single device's state and keeps its piece, so the
    parallel step equals the single-device one (``passes/strategies/random.py``)."""
    preset = get_preset("gpt2-tiny").replace(n_positions=16, dropout=0.1)
    torch.manual_seed(0)
    model = preset.build(device="cpu")
    inputs = preset.example_inputs(4, 8, device="cpu")
    plan = reference_plan(model, "gpt2", source, mesh_for(mesh_shape), inputs)
    assert plan is not None
    # dropout traces as bernoulli_ on CPU; the plan shards it
    assert any(i == "random_whole_draw" for p in plan.decided.nodes.values() for i in p.impls)
    got, want, _ = run_case(model, inputs, mesh_shape, plan)
    assert_same_training(got, want, what=f"gpt2 with dropout, {source} on {mesh_shape}")


@pytest.mark.parametrize("source", PLANS)
def test_mlp_tiny_every_plan_on_2x2(source: str) -> None:
    preset = get_preset("mlp-tiny")
    torch.manual_seed(0)
    model = preset.build(device="cpu")
    inputs = preset.example_inputs(8, 0, device="cpu")
    _check(model, "mlp", inputs, (2, 2), source)


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2), (2, 2, 2)])
@pytest.mark.parametrize("source", PLANS)
def test_gpt2_tiny_every_plan(source: str, mesh_shape) -> None:
    preset = get_preset("gpt2-tiny").replace(n_positions=16)
    torch.manual_seed(0)
    model = preset.build(device="cpu")
    inputs = preset.example_inputs(4, 8, device="cpu")
    _check(model, "gpt2", inputs, mesh_shape, source)


@pytest.mark.slow
def test_mlp_tiny_on_2x2x2() -> None:
    preset = get_preset("mlp-tiny")
    torch.manual_seed(0)
    model = preset.build(device="cpu")
    _check(model, "mlp", preset.example_inputs(8, 0, device="cpu"), (2, 2, 2), "solver")


class _ConvBN(torch.nn.Module):
    """A convolution and a BatchNorm: training writes the BatchNorm's running stats (and bumps
    its counter) in place, with an op whose schema does not say so."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = torch.nn.BatchNorm2d(8)
        self.head = torch.nn.Linear(8 * 6 * 6, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.conv(x)))
        return torch.nn.functional.cross_entropy(self.head(h.flatten(1)), y)


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)])
@pytest.mark.parametrize("source", ["solver", "data_parallel"])
def test_batch_norm_running_stats_equal_single_device(mesh_shape, source: str) -> None:
    """The running stats come out as one device's, whatever the plan: an input an op writes in
    place is never resharded before it (the write would land on a copy, or on one rank's
    slice of a replicated buffer: on 2x2 each rank's running mean used to differ)."""
    from autopar.api import complete_plan
    from autopar.capture.joint import capture

    torch.manual_seed(0)
    model = _ConvBN()
    inputs = (torch.randn(8, 3, 6, 6), torch.randint(0, 4, (8,)))
    plan = None
    if source == "data_parallel":  # parameters replicated, the batch split on every axis
        spec = (R,) * len(mesh_shape)
        batch = tuple(Shard(0) if i == 0 else R for i in range(len(mesh_shape)))
        plan = complete_plan(capture(model, inputs), mesh_for(mesh_shape),
                             {n: spec for n, _ in model.named_parameters()},
                             {0: batch, 1: batch}, Options.of(time_limit_s=2.0))
    got, want, pm = run_case(model, inputs, mesh_shape, plan, time_limit_s=2.0)
    assert_same_training(got, want, what=f"conv+batchnorm on {mesh_shape} with {source}")
    assert set(got["buffers"]) == {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"}
    check_collectives(got["collectives"][-1], pm)


def test_a_plan_resharding_an_input_written_in_place_is_refused() -> None:
    """A given plan that moves the running stats before BatchNorm writes them: a clear error
    naming the node and the input, not a silent divergence."""
    from autopar.ir.errors import PlanError
    from autopar.ir.plan import NodePlacement, Plan

    torch.manual_seed(0)
    model = _ConvBN()
    inputs = (torch.randn(8, 3, 6, 6), torch.randint(0, 4, (8,)))
    mesh = mesh_for((2,))
    with fake_world(2):
        plan = autopar.parallelize(model, mesh, inputs, time_limit_s=2.0).plan
    bn = next(k for k in plan.decided.nodes if k.startswith("native_batch_norm") and "backward" not in k)
    place = plan.decided.nodes[bn]
    moved = tuple((Shard(0),) if i in (3, 4) and spec != (Shard(0),) else
                  ((R,) if i in (3, 4) else spec) for i, spec in enumerate(place.ins))
    bad = Plan.from_json(plan.to_json())
    bad.decided.nodes[bn] = NodePlacement(moved, place.outs, place.impls, place.raw_outs)
    fresh = _ConvBN()
    with fake_world(2), pytest.raises(PlanError, match="writes its input .* in place"):
        autopar.parallelize(fresh, mesh, inputs, plan=bad)


def _mlp_with_reference(name: str, mesh_shape: tuple[int, ...], width: int = 32,
                        hidden: int = 128, batch: int = 32):
    """A small column/row MLP, a batch, and the reference layout ``name`` completed on it."""
    torch.manual_seed(0)
    model = MLP(MLPConfig(in_dim=width, hidden=(hidden, width, hidden), out_dim=width))
    inputs = (torch.randn(batch, width), torch.randn(batch, width))
    plan = reference_plan(model, "mlp", name, mesh_for(mesh_shape), inputs)
    assert plan is not None
    return model, inputs, plan


def test_megatron_rows_all_reduce_inside_the_op_once() -> None:
    """The row-parallel layers of megatron_tp, as the solver completes them, all-reduce their
    partial sums inside the op (one collective per layer, which forward and backward share);
    training equals one device and the collectives run are the plan's, across a JSON trip."""
    from autopar.ir.plan import Plan

    # weights wide against the batch, so that moving activations beats gathering weights
    model, inputs, plan = _mlp_with_reference("megatron_tp", (4,), 64, 512, 8)
    plan = Plan.from_json(plan.to_json())
    reduced = [name for name, p in plan.decided.nodes.items() if p.raw_outs]
    assert reduced, "megatron_tp's row-parallel outputs are reduced in the op"
    got, want, pm = run_case(model, inputs, (4,), plan)
    assert_same_training(got, want, what="megatron_tp with in-op all-reduces")
    check_collectives(got["collectives"][-1], pm, "megatron_tp with in-op all-reduces")


def test_fsdp_gradients_reduce_scatter_in_buckets() -> None:
    """FSDP's gradients are reduce-scattered in DDP-style buckets (each gradient laid out as
    its row blocks), not one collective per parameter; training equals one device."""
    model, inputs, plan = _mlp_with_reference("fsdp", (4,))
    got, want, pm = run_case(model, inputs, (4,), plan)
    assert_same_training(got, want, what="fsdp with bucketed reduce-scatters")
    check_collectives(got["collectives"][-1], pm, "fsdp with bucketed reduce-scatters")
    scattered = [r for r in got["collectives"][-1]
                 if r.kind == "reduce_scatter" and r.reason == "gradient sync"]
    sharded = [p for p in plan.decided.params.values() if any(isinstance(x, Shard) for x in p)]
    assert 0 < len(scattered) < len(sharded)


def test_fsdp_gathers_a_layers_parameters_at_once() -> None:
    """FSDP on a transformer: the parameters each layer's ops need whole are gathered with
    one all-gather per layer and phase, not one per parameter; training equals one device."""
    preset = get_preset("llama3-tiny").replace(max_seq_len=16)
    torch.manual_seed(0)
    model = preset.build(device="cpu")
    inputs = preset.example_inputs(4, 8, device="cpu")
    plan = reference_plan(model, "llama3", "fsdp", mesh_for((2,)), inputs)
    assert plan is not None
    got, want, pm = run_case(model, inputs, (2,), plan)
    assert_same_training(got, want, what="fsdp with parameter gathers per layer")
    check_collectives(got["collectives"][-1], pm, "fsdp with parameter gathers per layer")
    lowered = pm._active[1]
    grouped = lowered.fwd_gathers + lowered.bwd_gathers
    assert grouped and any(len(g.producers) > 1 for g in grouped)
    gathers = [r for r in got["collectives"][-1] if r.reason == "parameter gather"]
    assert len(gathers) == len(grouped) < sum(len(g.producers) for g in grouped)


def test_data_parallel_loss_is_waited_for_only_when_read() -> None:
    """Data parallelism returns the whole loss with its all-reduce issued at the end of the
    forward and waited for only when read: the same collectives whatever the user reads, so
    reading on some ranks only cannot desynchronise them. The loss reads as the exact value
    (as a number, formatted, scaled for gradient accumulation without waiting)."""
    import copy

    from autopar.runtime.deferred_loss import DeferredLoss

    model, inputs, plan = _mlp_with_reference("data_parallel", (4,))
    got, want, pm = run_case(model, inputs, (4,), plan, steps=2)
    assert_same_training(got, want, what="data parallel, deferred loss")
    check_collectives(got["collectives"][-1], pm, "data parallel, deferred loss")
    with fake_world(4):
        pm.collectives.reset()
        loss = pm(*inputs)
        assert isinstance(loss, DeferredLoss)
        assert [r.reason for r in pm.collectives.records] == ["loss"]  # issued, not waited
        assert loss._held._work is not None  # a sum over one axis: c10d, in place on a copy
        value = reconcile(loss.detach())
        assert f"{loss:.4f}" == f"{value.item():.4f}" and "grad_fn=" in repr(loss)
        assert torch.equal(copy.deepcopy(loss), value)
        half = loss / 2  # gradient accumulation's scaling: still deferred
        assert isinstance(half, DeferredLoss)
        loss.mul_(3)  # in place on the loss leaves what was derived from it alone
        assert torch.equal(reconcile(half.detach()), value / 2)
        assert torch.equal(reconcile(loss.detach()), value * 3)
        half.backward()
        assert [r.reason for r in pm.collectives.records].count("loss") == 1
        with torch.no_grad():  # no backward to overlap: waited for at once, a plain tensor
            plain = pm(*inputs)
        assert not isinstance(plain, DeferredLoss)
        assert torch.equal(reconcile(plain), value)


@pytest.mark.parametrize("device, syncs", [("cpu", 1), ("h100", 2)])
def test_gradient_buckets_are_sized_for_the_device(device: str, syncs: int) -> None:
    """Data parallelism on 2 MiB of gradients: where communication overlaps compute (NCCL)
    the plan keeps DDP's small first bucket, all-reduced early in the backward, so two
    all-reduces; on CPU cores that gloo shares with the compute an early bucket would only add
    a collective, so one. The runtime fills its buckets as the plan says: the collectives it
    runs are the plan's, and training equals one device."""
    from autopar.passes.cost.buckets import FIRST_BUCKET_BYTES

    torch.manual_seed(0)
    model = MLP(MLPConfig(in_dim=64, hidden=(2048, 64, 2048), out_dim=64))
    inputs = (torch.randn(8, 64), torch.randn(8, 64))
    plan = reference_plan(model, "mlp", "data_parallel", Mesh((2,), ("dp",), device), inputs)
    assert plan is not None
    assert (plan.decided.first_bucket_bytes == FIRST_BUCKET_BYTES) == (device != "cpu")
    predicted = [c for c in plan.predicted.collectives if c.reason == "gradient sync"]
    assert [(c.kind, c.count) for c in predicted] == [("all_reduce", syncs)]
    got, want, pm = run_case(model, inputs, (2,), plan, steps=2)
    assert_same_training(got, want, what=f"data parallel, buckets sized for {device}")
    check_collectives(got["collectives"][-1], pm, f"data parallel, buckets for {device}")
    ran = [r for r in got["collectives"][-1] if r.reason == "gradient sync"]
    assert len(ran) == syncs
