"""Mixed precision: the traced graph holds the policy's casts, the plan prices the real dtypes,
and bf16/fp16 training on simulated ranks stays within a stated tolerance of fp32 on one device;
an fp16 overflow skips the step and lowers the scale."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from harness.spmd import (
    EPS,
    LR,
    RNG_SEED,
    check_collectives,
    fake_world,
    mesh_for,
    train_parallel,
    train_single,
)

import autopar
from autopar.capture.joint import capture
from autopar.ir.options import Options
from autopar.ir.precision import Precision
from autopar.models import get_preset
from autopar.planning.planner import make_plan
from autopar.runtime.optim.loss_scale import LossScaleWarning

# relative distance of a bf16/fp16 run's losses from fp32's on one device, over the steps run:
# bf16 keeps 8 bits of mantissa (relative rounding 2^-8 = 0.4%), fp16 11; losses of these
# small models stay within a few roundings of fp32's
TOLERANCE = {"bf16": 0.02, "fp16": 0.01}
STEPS = 10


def _llama():
    preset = get_preset("llama3-tiny")
    torch.manual_seed(0)
    return preset.build("cpu"), preset.example_inputs(4, 16, "cpu")


def test_bf16_graph_casts_where_the_policy_says():
    model, inputs = _llama()
    pg = capture(model, inputs, precision=Precision("bf16"))
    nodes = [n for n in pg.graph.nodes if n.op == "call_function"]
    facts = [n.meta["autopar"] for n in nodes]
    casts = [f for f in facts if "param_cast" in f.extra]
    assert len(casts) == len(pg.param_names)  # every parameter cast once, at use
    assert all(f.out.dtype == torch.bfloat16 and f.layer is not None for f in casts
               if f.extra["param_cast"].startswith("layers."))
    mms = [f for f in facts if f.op == "aten.mm.default"]
    assert mms and all(f.out.dtype == torch.bfloat16 for f in mms)
    softmax = [f for f in facts if "log_softmax" in f.op and f.phase == "fwd"]
    assert softmax and all(f.out.dtype == torch.float32 for f in softmax)
    loss = next(n for n in nodes if n.name == pg.loss_node)
    assert loss.meta["autopar"].out.dtype == torch.float32
    grads = [f for f in facts if f.role == "grad"]
    assert grads and all(f.out.dtype == torch.float32 for f in grads)  # fp32 masters' grads


def test_bf16_plan_prices_the_real_dtypes():
    preset = get_preset("llama3-tiny").replace(dim=256, ffn_dim=512, max_seq_len=256)
    model = preset.build("meta")
    inputs = preset.example_inputs(8, 256)
    mesh = autopar.Mesh((2,), ("dp",), "h100")
    fp32 = make_plan(model, mesh, inputs,
                     options=Options.of(precision="fp32", recompute="none", time_limit_s=2.0)).plan
    bf16 = make_plan(model, mesh, inputs,
                     options=Options.of(precision="bf16", recompute="none", time_limit_s=2.0)).plan
    assert bf16.decided.precision == Precision("bf16") and fp32.decided.precision == Precision("fp32")
    assert bf16.predicted.cost.compute_s < fp32.predicted.cost.compute_s  # bf16 matmul rates, half the bytes
    # the same layout twice (parameters whole, gradients all-reduced), the reduction's dtype
    # alone differing: left free, the solver may store the two plans' parameters differently
    held = {"precision": "bf16", "recompute": "none", "zero": "1", "time_limit_s": 2.0}
    whole = make_plan(model, mesh, inputs, options=Options.of(**held)).plan
    reduced = make_plan(model, mesh, inputs, options=Options.of(reduce_dtype="bf16", **held)).plan

    def sync_bytes(p):
        return sum(c.bytes for c in p.predicted.collectives if c.reason == "gradient sync")

    assert sync_bytes(whole) > 0
    assert sync_bytes(reduced) == pytest.approx(sync_bytes(whole) / 2)


def _train_precision(model, inputs, mesh_shape, precision, steps=STEPS, **kw):
    mesh = mesh_for(mesh_shape)
    with fake_world(mesh.size):
        pm = autopar.parallelize(copy.deepcopy(model), mesh, inputs, precision=precision,
                                 time_limit_s=2.0, **kw)
        torch.manual_seed(RNG_SEED)
        got = train_parallel(pm, inputs, steps)
        for records in got["collectives"]:
            check_collectives(records, pm, precision)
    return got, pm


@pytest.mark.parametrize("precision,mesh_shape,reduce", [
    ("bf16", (2, 2), None), ("bf16", (4,), "bf16"), ("fp16", (2, 2), None)])
def test_low_precision_training_stays_near_fp32(precision, mesh_shape, reduce):
    model, inputs = _llama()
    want = train_single(copy.deepcopy(model), inputs, STEPS)
    got, pm = _train_precision(model, inputs, mesh_shape, precision, reduce_dtype=reduce)
    assert pm.plan.decided.precision.name == precision
    for i, (g, w) in enumerate(zip(got["losses"], want["losses"])):
        err = abs(g.item() - w.item()) / abs(w.item())
        assert err < TOLERANCE[precision], f"{precision} step {i}: {g.item()} vs {w.item()}"
    assert got["losses"][-1] < got["losses"][0]  # it trains
    for name, p in got["params"].items():
        assert p.dtype == torch.float32, name  # fp32 master weights


def test_fp16_overflow_skips_the_step_and_lowers_the_scale():
    model, inputs = _llama()
    mesh = mesh_for((2, 2))
    with fake_world(mesh.size):
        pm = autopar.parallelize(copy.deepcopy(model), mesh, inputs, precision="fp16",
                                 time_limit_s=2.0)
        assert any(c.reason == "loss scaling" for c in pm.plan.predicted.collectives)
        opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)
        before = {n: p.full_tensor().clone() for n, p in pm.named_parameters()}
        pm.loss_scale.scale = 2.0**40  # beyond fp16's range: the seed itself overflows
        pm.collectives.reset()
        with pytest.warns(LossScaleWarning, match="step skipped"):
            loss = pm(*inputs)
            loss.backward()
        check_collectives(pm.collectives.records, pm, "fp16 overflow")
        assert all(p.grad is None for p in pm.parameters())
        opt.step()
        for n, p in pm.named_parameters():
            assert torch.equal(p.full_tensor(), before[n]), f"{n} moved on a skipped step"
        assert pm.loss_scale.scale == 2.0**39 and pm.loss_scale.skipped == 1
        pm.loss_scale.scale = 2.0**10  # a scale fp16 holds: the next step goes through
        with warnings.catch_warnings():
            warnings.simplefilter("error", LossScaleWarning)  # no overflow now
            pm(*inputs).backward()
        opt.step()
        assert any(not torch.equal(p.full_tensor(), before[n]) for n, p in pm.named_parameters())
        assert pm.loss_scale.good_steps == 1
