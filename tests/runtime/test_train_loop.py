"""The training loop around a parallelized model: gradient accumulation over micro-batches and
``torch.nn.utils.clip_grad_norm_``, against one device, for every plan kind.

Each case trains 3 AdamW steps, each accumulated over 2 micro-batches (``loss / 2``, backward,
twice), with ``clip_grad_norm_`` before the step in a different form each time (foreach, the
per-tensor loop with ``error_if_nonfinite``, the inf norm; max norms that clip and one that does
not), on one device and on a simulated mesh (``LocalTensorMode``): losses, the last step's
clipped gradients, parameters, and the total norm as a user reads it (``float``, ``.item()``,
an f-string) must agree. One real gloo run (2 processes) does the same with torch's
collectives, and checks that ``error_if_nonfinite`` raises on every rank when only one rank's
shard holds the non-finite value.
"""

from __future__ import annotations

import copy
import json
import math
import socket
from pathlib import Path

import pytest
import torch
from harness.spmd import (
    PLANS,
    RNG_SEED,
    assert_same_training,
    fake_world,
    mesh_for,
    reference_plan,
    run_case,
    spawn_reports,
    train_parallel,
    train_single,
)

from autopar.models import get_preset
from autopar.models.mlp import MLP, MLPConfig
from autopar.runtime.optim import grad_norm

STEPS = 3
# per step: clip_grad_norm_'s options (foreach=None takes the per-tensor loop on DTensors, as
# foreach=False does) and its max_norm as a fraction of the step's norm on one device (below 1:
# the step clips; None: inf, it does not)
CLIPS = [dict(foreach=True), dict(foreach=False, error_if_nonfinite=True),
         dict(norm_type=math.inf)]
CLIPS_AT = [0.5, None, 0.3]


def _clip_for(max_norms: list[float]):
    def clip(params, step: int) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(params, max_norms[step], **CLIPS[step])
    return clip


def _max_norms(model, inputs, micro) -> list[float]:
    """Max norms that clip where CLIPS_AT says: a fraction of each step's norm on one device
    (a dry run with clipping at those fractions, step by step)."""
    max_norms: list[float] = []
    for step, frac in enumerate(CLIPS_AT):
        probe = max_norms + [math.inf] * (STEPS - step)
        torch.manual_seed(RNG_SEED)
        norms = train_single(copy.deepcopy(model), inputs, step + 1, micro=micro,
                             clip=_clip_for(probe))["norms"]
        max_norms.append(math.inf if frac is None else frac * float(norms[step]))
    return max_norms


def _gpt():
    preset = get_preset("gpt2-tiny").replace(n_layer=1, n_head=2, d_model=16, vocab_size=48,
                                              n_positions=16)
    torch.manual_seed(0)
    model = preset.build(device="cpu")
    torch.manual_seed(1)
    micro = [preset.example_inputs(4, 8, device="cpu") for _ in range(2)]
    return model, micro


def _mlp():
    torch.manual_seed(0)
    model = MLP(MLPConfig(in_dim=6, hidden=(8,), out_dim=4, activation="gelu", bias=True))
    micro = [(torch.randn(8, 6), torch.randn(8, 4)) for _ in range(2)]
    return model, micro


def _check_norms(got: list, want: list, what: str) -> None:
    for step, (g, w) in enumerate(zip(got, want)):
        w = float(w)
        assert math.isclose(float(g), w, rel_tol=1e-5), f"{what} step {step}: {float(g)} vs {w}"
        assert g.item() == float(g)
        assert math.isclose(float(f"{g:.6e}"), w, rel_tol=1e-5), f"{what}: {g:.6e}"


def _run(model, micro, family: str, mesh_shape, source: str) -> None:
    mesh = mesh_for(mesh_shape)
    plan = None if source == "solver" else reference_plan(model, family, source, mesh, micro[0])
    assert source == "solver" or plan is not None, f"{source} does not apply on {mesh_shape}"
    max_norms = _max_norms(model, micro[0], micro)
    got, want, _ = run_case(model, micro[0], mesh_shape, plan, steps=STEPS, time_limit_s=2.0,
                            micro=micro, clip=_clip_for(max_norms))
    what = f"{family} on {mesh_shape} with {source} plan"
    # the premise: the steps meant to clip did (a clipped gradient's norm is max_norm)
    for step, frac in enumerate(CLIPS_AT):
        assert (float(want["norms"][step]) > max_norms[step]) == (frac is not None), step
    last = max(float(g.abs().max()) for g in want["grads"].values())  # the inf norm
    assert math.isclose(last, max_norms[-1], rel_tol=1e-4)
    assert_same_training(got, want, what=what)
    _check_norms(got["norms"], want["norms"], what)


@pytest.mark.parametrize("source", PLANS)
def test_mlp_accumulate_and_clip_on_2x2(source: str) -> None:
    model, micro = _mlp()
    _run(model, micro, "mlp", (2, 2), source)


@pytest.mark.parametrize("source", [p for p in PLANS if p != "dp_tp_2d"])  # needs 2 axes
def test_mlp_accumulate_and_clip_on_4(source: str) -> None:
    model, micro = _mlp()
    _run(model, micro, "mlp", (4,), source)


def test_gpt_accumulate_and_clip_on_2x2() -> None:
    """A GPT (tied embedding, layer norms, replicated and sharded gradients side by side) in
    the 2-D layout; one plan only, as a GPT costs 10-20 s under LocalTensorMode on 2 cores."""
    model, micro = _gpt()
    _run(model, micro, "gpt2", (2, 2), "dp_tp_2d")


def test_inf_norm_of_sharded_gradients_is_replicated() -> None:
    """Why :mod:`autopar.runtime.optim.grad_norm` exists: DTensor leaves the inf norm's total
    ``Partial(max)`` (each rank would read its own maximum); with the handler it comes back
    replicated. If torch starts replicating it itself, the first assertion says so and the
    handler can go."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from autopar.runtime._compat import as_local

    grads = [torch.arange(12.0).reshape(4, 3) - 5, torch.arange(8.0) * 0.5]
    with fake_world(4):
        mesh = init_device_mesh("cpu", (4,))
        ds = [distribute_tensor(as_local(g), mesh, [Shard(0)]) for g in grads]
        grad_norm.uninstall()
        try:
            raw = torch.nn.utils.get_total_norm(ds, math.inf)
            assert raw.placements[0].is_partial()
        finally:
            grad_norm.install()
        total = torch.nn.utils.get_total_norm(ds, math.inf)
        assert total.placements == (Replicate(),)
        assert float(total) == 6.0 and f"{total:.1f}" == "6.0"
        assert torch.nn.utils.get_total_norm(ds, 2.0).placements == (Replicate(),)


def test_install_is_idempotent_and_reversible() -> None:
    from torch.distributed.tensor import DTensor

    grad_norm.install()
    grad_norm.install()
    assert grad_norm.installed()
    grad_norm.uninstall()
    assert not grad_norm.installed() and "__format__" not in DTensor.__dict__
    grad_norm.install()
    assert grad_norm.installed()


# --- real processes ---------------------------------------------------------------------------

WORLD = 2
TIMEOUT_S = 240
GLOO_PLANS = ("fsdp", "megatron_tp")


def _gloo_worker(rank: int, port: int, plans: dict, max_norms: list, out_dir: str) -> None:
    import datetime

    import torch.distributed as dist

    import autopar
    from autopar.ir.plan import Plan

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    report: dict = {}
    try:
        for source, plan_json in plans.items():
            model, micro = _mlp()
            torch.manual_seed(RNG_SEED)
            want = train_single(copy.deepcopy(model), micro[0], STEPS, micro=micro,
                                clip=_clip_for(max_norms))
            pm = autopar.parallelize(model, mesh_for((WORLD,)), micro[0],
                                     plan=Plan.from_json(plan_json))
            torch.manual_seed(RNG_SEED)
            got = train_parallel(pm, micro[0], STEPS, micro=micro, clip=_clip_for(max_norms))
            assert_same_training(got, want, what=f"gloo {source}")
            _check_norms(got["norms"], want["norms"], f"gloo {source}")
            report[source] = {"norms": [f"{n:.6e}" for n in got["norms"]],
                              "raised": _nonfinite_on_rank0_only(pm)}
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()


def _nonfinite_on_rank0_only(pm) -> list[bool]:
    """Whether error_if_nonfinite raised here, for the 2-norm and the inf norm, where only rank
    0's piece of the sharded gradients holds an inf."""
    import torch.distributed as dist

    pm(*_mlp()[1][0]).backward()
    sharded = [p for p in pm.parameters() if any(pl.is_shard() for pl in p.grad.placements)]
    assert sharded
    if dist.get_rank() == 0:
        sharded[0].grad._local_tensor.view(-1)[0] = math.inf
    raised = []
    for norm_type in (2.0, math.inf):
        try:
            torch.nn.utils.clip_grad_norm_(pm.parameters(), 1.0, norm_type,
                                           error_if_nonfinite=True)
            raised.append(False)
        except RuntimeError as e:
            assert "non-finite" in str(e)
            raised.append(True)
    return raised


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_gloo_accumulate_and_clip(tmp_path: Path) -> None:
    model, micro = _mlp()
    mesh = mesh_for((WORLD,))
    plans = {}
    for source in GLOO_PLANS:
        plan = reference_plan(model, "mlp", source, mesh, micro[0])
        assert plan is not None
        plans[source] = plan.to_json()
    max_norms = _max_norms(model, micro[0], micro)
    reports = spawn_reports(_gloo_worker, (_free_port(), plans, max_norms, str(tmp_path)),
                            WORLD, tmp_path, TIMEOUT_S)
    for source in GLOO_PLANS:
        assert reports[0][source]["norms"] == reports[1][source]["norms"], source
        for r in range(WORLD):
            assert reports[r][source]["raised"] == [True, True], (source, r)
