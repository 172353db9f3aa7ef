"""The parameter state a plan chooses runs as priced and trains as one device: optimizer state
offloaded to host memory (runtime/optim/offload.py, stepped through ``model.make_optimizer``) on
simulated ranks and on gloo, and ZeRO-1's whole-gradient all-reduces (passes/memory/zero.py).
ZeRO-2 and ZeRO-3 (re-gathering) are in test_recompute.py's property test."""

from __future__ import annotations

import copy
import json
import socket
from pathlib import Path

import torch
from harness.spmd import (
    RNG_SEED,
    assert_same_training,
    check_collectives,
    fake_world,
    mesh_for,
    reference_plan,
    spawn_reports,
    train_parallel,
    train_single,
)

import autopar
from autopar.capture.joint import capture
from autopar.ir.options import Options
from autopar.ir.plan import Plan
from autopar.models import get_preset
from autopar.planning.assemble import with_recompute
from autopar.planning.planner import make_plan
from autopar.report.table import plan_table
from autopar.runtime.optim.offload import OffloadedOptimizer

STEPS = 3
WORLD = 2
TIMEOUT_S = 240


def _case():
    preset = get_preset("gpt2-tiny").replace(n_layer=1, n_head=2, d_model=16, vocab_size=48,
                                              n_positions=16)
    torch.manual_seed(0)
    model = preset.build("cpu")
    inputs = preset.example_inputs(4, 8, "cpu")
    return model, inputs


def _plan(model, inputs, offload: str):
    return make_plan(model, mesh_for((WORLD,)), inputs,
                     options=Options.of(memory_budget=float("inf"), time_limit_s=5.0,
                                        offload=offload)).plan


def test_offloaded_state_lives_off_the_parameters_and_trains_as_one_device():
    model, inputs = _case()
    plan = _plan(model, inputs, "optimizer")
    assert set(plan.decided.param_state.offloaded) == set(plan.decided.params)
    torch.manual_seed(RNG_SEED)
    want = train_single(copy.deepcopy(model), inputs, STEPS)
    with fake_world(WORLD):
        pm = autopar.parallelize(copy.deepcopy(model), mesh_for((WORLD,)), inputs, plan=plan)
        opt = pm.make_optimizer(torch.optim.AdamW, lr=1e-3)
        assert isinstance(opt, OffloadedOptimizer) and opt.device_opt is None
        torch.manual_seed(RNG_SEED)
        got = train_parallel(pm, inputs, STEPS)
    assert_same_training(got, want, what="offloaded optimizer state, simulated ranks")


def test_a_plan_that_offloads_nothing_gets_the_plain_optimizer():
    model, inputs = _case()
    plan = _plan(model, inputs, "none")
    assert not plan.decided.param_state.offloaded
    with fake_world(WORLD):
        pm = autopar.parallelize(copy.deepcopy(model), mesh_for((WORLD,)), inputs, plan=plan)
        assert type(pm.make_optimizer(torch.optim.SGD, lr=0.1)) is torch.optim.SGD


def _gloo_worker(rank: int, port: int, plan_json: dict, out_dir: str) -> None:
    import datetime

    import torch.distributed as dist

    from autopar.ir.plan import Plan

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        model, inputs = _case()
        torch.manual_seed(RNG_SEED)
        want = train_single(copy.deepcopy(model), inputs, STEPS, adamw={"fused": True})
        pm = autopar.parallelize(model, mesh_for((WORLD,)), inputs,
                                 plan=Plan.from_json(plan_json))
        torch.manual_seed(RNG_SEED)
        got = train_parallel(pm, inputs, STEPS, adamw={"fused": True})
        assert_same_training(got, want, what="gloo, offloaded optimizer state")
        opt = pm.make_optimizer(torch.optim.AdamW, lr=1e-3)
        host = [t for st in opt.host_opt.state.values() for t in st.values()
                if isinstance(t, torch.Tensor) and t.dim() > 0]
        report = {"ok": True, "host_state_plain": all(type(t) is torch.Tensor for t in host)}
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()


def test_offloaded_state_on_gloo(tmp_path):
    model, inputs = _case()
    plan = _plan(model, inputs, "optimizer")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    reports = spawn_reports(_gloo_worker, (port, plan.to_json(), str(tmp_path)), WORLD,
                            tmp_path, TIMEOUT_S)
    assert all(r["ok"] and r["host_state_plain"] for r in reports)


def test_zero1_all_reduces_whole_gradients_and_trains_as_one_device():
    """ZeRO-1 on FSDP's layout: the gradient syncs become all-reduces (a ring all-reduce
    takes twice a reduce-scatter's steps), the plan says stage 1, and training on simulated
    ranks still equals one device with exactly the plan's collectives."""
    preset = get_preset("llama3-tiny")
    torch.manual_seed(0)
    model = preset.build("cpu")
    inputs = preset.example_inputs(4, 16, "cpu")
    mesh = mesh_for((2,))
    graph = capture(model, inputs)
    base = reference_plan(model, "llama3", "fsdp", mesh, inputs, time_limit_s=2.0)
    z1 = with_recompute(graph, base, "none+zero1", mesh)

    def syncs(plan: Plan) -> dict[str, float]:  # kind -> predicted time
        out: dict[str, float] = {}
        for c in plan.predicted.collectives:
            if c.reason == "gradient sync":
                out[c.kind] = out.get(c.kind, 0.0) + c.time_s
        return out

    assert "reduce_scatter" in syncs(base) and "reduce_scatter" not in syncs(z1)
    assert syncs(z1)["all_reduce"] > syncs(base)["reduce_scatter"]
    assert z1.decided.param_state.zero1 and 1 in set(z1.decided.param_state.stages.values())
    assert "ZeRO-1" in plan_table(z1)
    torch.manual_seed(RNG_SEED)
    want = train_single(copy.deepcopy(model), inputs, 2)
    with fake_world(mesh.size):
        pm = autopar.parallelize(copy.deepcopy(model), mesh, inputs, plan=z1)
        torch.manual_seed(RNG_SEED)
        got = train_parallel(pm, inputs, 2)
        for records in got["collectives"]:
            check_collectives(records, pm, "zero1")
    assert_same_training(got, want, what="ZeRO-1 on fsdp's layout")
