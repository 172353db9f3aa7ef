"""The per-rank program as generated code (``runtime/step_code.py``): plain steps written out,
the others through the interpreter's general path, the same numbers either way."""

from __future__ import annotations

import copy

import pytest
import torch
from harness.spmd import fake_world, mesh_for, reference_plan, train_parallel

import autopar
from autopar.models import get_preset
from autopar.models.mlp import MLP, MLPConfig
from autopar.runtime import step_code


def _train_both(model, inputs, mesh_shape, plan, monkeypatch) -> tuple[dict, dict, object]:
    """Train with the generated program and, from the same start, with every step
    interpreted; return both results and the generated module."""
    runs = {}
    for how in ("interpreted", "generated"):
        with monkeypatch.context() as m:
            if how == "interpreted":
                m.setattr(step_code, "_plain_call", lambda *a: None)
            with fake_world(mesh_for(mesh_shape).size):
                pm = autopar.parallelize(copy.deepcopy(model), mesh_for(mesh_shape), inputs,
                                         plan=plan)
                runs[how] = (train_parallel(pm, inputs, 2), pm)
    return runs["generated"][0], runs["interpreted"][0], runs["generated"][1]


def _assert_identical(a: dict, b: dict) -> None:
    assert all(torch.equal(x, y) for x, y in zip(a["losses"], b["losses"]))
    for key in ("grads", "params"):
        for name in b[key]:
            assert torch.equal(a[key][name], b[key][name]), f"{key} {name}"


def test_a_data_parallel_mlp_runs_as_straight_line_code(monkeypatch) -> None:
    """Data parallelism on an MLP: every forward step but the loss (a mean over a split batch)
    is a plain call, the views' shapes localized once; the result is bit for bit the
    interpreter's."""
    torch.manual_seed(0)
    model = MLP(MLPConfig(in_dim=16, hidden=(32, 16, 32), out_dim=16))
    inputs = (torch.randn(8, 16), torch.randn(8, 16))
    plan = reference_plan(model, "mlp", "data_parallel", mesh_for((2,)), inputs)
    got, want, pm = _train_both(model, inputs, (2,), plan, monkeypatch)
    _assert_identical(got, want)
    lowered = pm._active[1]
    fwd = lowered._compiled[(id(lowered.fwd), False)].source
    assert fwd.count("X(S[") == 1 and "C(F" in fwd  # views through the localized call
    bwd = lowered._compiled[(id(lowered.bwd), False)].source
    assert "step_done(" in bwd  # gradient syncs start from the generated backward


@pytest.mark.parametrize("source", ["megatron_tp", "fsdp"])
def test_steps_that_move_data_keep_the_general_path(source: str, monkeypatch) -> None:
    """Tensor parallelism and FSDP on a transformer: steps that reshard, gather parameters or
    reduce inside the op go through the general path; the numbers are the interpreter's."""
    preset = get_preset("gpt2-tiny").replace(n_positions=16)
    torch.manual_seed(0)
    model = preset.build(device="cpu")
    inputs = preset.example_inputs(2, 8, device="cpu")
    plan = reference_plan(model, "gpt2", source, mesh_for((2,)), inputs)
    assert plan is not None
    got, want, pm = _train_both(model, inputs, (2,), plan, monkeypatch)
    _assert_identical(got, want)
    lowered = pm._active[1]
    code = "".join(lowered._compiled[(id(steps), False)].source
                   for steps in (lowered.fwd, lowered.bwd))
    assert "X(S[" in code and "env[" in code
