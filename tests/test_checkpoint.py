"""``autopar.checkpoint``: a run saved under one plan resumes under another, equal to the run
that went on; names are the single-device model's; bad checkpoints are refused in one line
with nothing lost; a save is committed atomically.

One launch of 4 gloo processes (start-up dominates on 2 cores) runs, in turn: GPT-2 (4 blocks)
trained on dp=2 x tp=2, saved at step 2 in the background while it trains 3 more steps (the
uninterrupted run); the checkpoint loaded into fresh, differently seeded models on pp=2 x dp=2,
on dp=4 and under FSDP's layout on dp=4, trained 3 steps each: losses equal the uninterrupted
run's within fp32 rounding (and so do the learning-rate schedule's and the data position); the
FSDP run's checkpoint loaded under Megatron's tensor parallel on tp=4, its next step equal to
the FSDP run's; 4 -> 8 processes (dp=4 x tp=2) is a slow test; the pipeline's own checkpoint
loaded into the single-device model equal to its stages' state, bit for bit; a Hugging Face
model's own state dict loaded into its parallelized copy, on dp x tp and as a pipeline. The
rest runs in this process without a process group: the dp x tp checkpoint into the plain
model, offloaded optimizer state, bad input, atomicity.
"""

from __future__ import annotations

import copy
import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from harness.spmd import EPS, LR, four_block_model, reference_plan, rel_err, start_method
from torch import nn
from torch.distributed.tensor import DTensor

import autopar
from autopar import checkpoint
from autopar.ir.errors import CheckpointError

WORLD = 4
BATCH, SEQ = 8, 8
SAVED_AT, MORE = 2, 3
TOL = 1e-5  # norm-wise relative error of losses across meshes (fp32 rounding)


def _gpt2(seed: int = 0) -> tuple[nn.Module, tuple]:
    model, inputs = four_block_model("gpt2-tiny", BATCH, SEQ)
    if seed:  # other weights: what a load must overwrite
        torch.manual_seed(seed)
        for p in model.parameters():
            p.data.normal_(0, 0.02)
    return model, inputs


def _optimizer(model: nn.Module) -> tuple[torch.optim.Optimizer, object]:
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)


def _steps(model: nn.Module, opt, sched, inputs: tuple, n: int) -> list[float]:
    losses = []
    for _ in range(n):
        loss = model(*inputs)
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(float(loss.detach()))
    return losses


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _split_parameters(model: nn.Module) -> int:
    """How many of this rank's parameters are pieces of their whole tensor."""
    return sum(isinstance(p, DTensor) and p.to_local().shape != p.shape
               for p in model.parameters())


def _worker(ckpt: str, pipe_ckpt: str, fsdp_ckpt: str) -> dict:
    from harness import hf

    report: dict = {}
    # 1. dp=2 x tp=2: two steps, saved in the background, three more (the uninterrupted run)
    model, inputs = _gpt2()
    pm = autopar.parallelize(model, autopar.Mesh((2, 2), ("dp", "tp"), "cpu"), inputs,
                             time_limit_s=2.0)
    opt, sched = _optimizer(pm)
    _steps(pm, opt, sched, inputs, SAVED_AT)
    import torch.distributed as dist

    random.seed(11 + dist.get_rank())  # each rank's random state, saved to be restored
    handle = checkpoint.save(ckpt, pm, opt, step=SAVED_AT, lr_scheduler=sched,
                             data_state={"offset": SAVED_AT * BATCH}, blocking=False)
    draws = report["draws"] = [random.random(), float(torch.rand(()))]
    report["uninterrupted"] = _steps(pm, opt, sched, inputs, MORE)
    handle.wait()
    assert handle.done() and checkpoint.latest_step(ckpt) == SAVED_AT

    # 2. resumed on pp=2 x dp=2, on dp=4 and on dp=4 with its parameters split (FSDP), from
    # other weights
    # (the planner replicates a model this small: FSDP's layout is pinned)
    for name, mesh, layout in [("pp2xdp2", autopar.Mesh((2, 2), ("pp", "dp"), "cpu"), None),
                               ("dp4", autopar.Mesh((4,), ("dp",), "cpu"), None),
                               ("fsdp4", autopar.Mesh((4,), ("dp",), "cpu"), "fsdp")]:
        model, _ = _gpt2(seed=7)
        plan = layout and reference_plan(model, "gpt2", layout, mesh, inputs, time_limit_s=2.0)
        resumed_pm = autopar.parallelize(model, mesh, inputs, plan=plan, time_limit_s=2.0)
        opt, sched = _optimizer(resumed_pm)
        resumed = checkpoint.load(ckpt, resumed_pm, opt, lr_scheduler=sched)
        assert [random.random(), float(torch.rand(()))] == draws, name
        report[name] = {"step": resumed.step, "data": resumed.data_state,
                        "lr": opt.param_groups[0]["lr"],
                        "losses": _steps(resumed_pm, opt, sched, inputs, MORE)}
        if name == "pp2xdp2":
            pipe = resumed_pm
            checkpoint.save(pipe_ckpt, pipe, opt, step=SAVED_AT + MORE, lr_scheduler=sched)
        if name == "fsdp4":  # ... and back: FSDP's checkpoint into tensor parallel on tp=4
            report["fsdp_split"] = _split_parameters(resumed_pm)
            checkpoint.save(fsdp_ckpt, resumed_pm, opt, step=SAVED_AT + MORE,
                            lr_scheduler=sched)
            report["fsdp_next"] = _steps(resumed_pm, opt, sched, inputs, 1)
            model, _ = _gpt2(seed=8)
            tp4 = autopar.Mesh((4,), ("tp",), "cpu")
            plan = reference_plan(model, "gpt2", "megatron_tp", tp4, inputs, time_limit_s=2.0)
            tp_pm = autopar.parallelize(model, tp4, inputs, plan=plan)
            opt, sched = _optimizer(tp_pm)
            checkpoint.load(fsdp_ckpt, tp_pm, opt, lr_scheduler=sched)
            report["tp_split"] = _split_parameters(tp_pm)
            report["tp_next"] = _steps(tp_pm, opt, sched, inputs, 1)

    # 3. the pipeline's checkpoint into the single-device model: its stages' state, exactly
    plain, _ = _gpt2(seed=9)
    checkpoint.load(pipe_ckpt, plain)
    own = pipe.state_dict()
    assert own and not any(k.startswith("stages.") for k in own), list(own)[:3]
    whole = plain.state_dict()
    report["pipeline_keys"] = len(own)
    report["pipeline_exact"] = all(torch.equal(whole[k], _whole(v)) for k, v in own.items())

    # 4. a Hugging Face model's own weights into its parallelized copy (tied head included)
    torch.manual_seed(3)
    source = hf.gpt2()
    torch.manual_seed(4)
    target = hf.gpt2()
    kw = hf.inputs()
    hpm = autopar.parallelize(target, autopar.Mesh((2, 2), ("dp", "tp"), "cpu"),
                              example_kwargs=kw, time_limit_s=2.0)
    hpm.load_state_dict(source.state_dict())
    got = hpm.state_dict()
    report["hf_exact"] = all(torch.equal(_whole(got[k]), v) for k, v in
                             source.state_dict().items())
    with torch.no_grad():
        out = hpm(**kw)
        report["hf_loss"] = [float(getattr(out, "loss", out)), float(source(**kw).loss)]
    # ... and into a pipeline of a Hugging Face decoder: each rank its stages' entries
    torch.manual_seed(3)
    source = hf.llama()
    torch.manual_seed(4)
    ppm = autopar.parallelize(hf.llama(), autopar.Mesh((2, 2), ("pp", "dp"), "cpu"),
                              example_kwargs=kw, time_limit_s=2.0, schedule="1f1b",
                              microbatches=2)
    ppm.load_state_dict(source.state_dict())
    want = source.state_dict()
    got = ppm.state_dict()
    report["hf_pipeline_exact"] = bool(got) and all(torch.equal(_whole(v), want[k])
                                                    for k, v in got.items())
    return report


@pytest.fixture(scope="module")
def gloo_run(tmp_path_factory) -> tuple[list[dict], Path]:
    from autopar.runtime.launch import launch

    d = tmp_path_factory.mktemp("ckpt")
    reports = launch(_worker, WORLD, (str(d / "dp2tp2"), str(d / "pipe"), str(d / "fsdp")),
                     timeout_s=300, start_method=start_method())
    return reports, d


def test_resumed_on_other_meshes_equals_the_uninterrupted_run(gloo_run) -> None:
    reports, _ = gloo_run
    for rep in reports:
        want = torch.tensor(rep["uninterrupted"])
        for name in ("pp2xdp2", "dp4", "fsdp4"):
            got = rep[name]
            assert got["step"] == SAVED_AT and got["data"] == {"offset": SAVED_AT * BATCH}
            assert got["lr"] == pytest.approx(LR * 0.7 ** SAVED_AT), name
            assert rel_err(torch.tensor(got["losses"]), want) < TOL, (name, got, want)


def test_fsdp_and_tensor_parallel_checkpoints_load_into_each_other(gloo_run) -> None:
    """dp x tp's checkpoint resumed under FSDP's layout (above, "fsdp4": parameters split over
    dp), and that run's checkpoint loaded under Megatron's tensor parallel on tp=4: its next
    step equals the FSDP run's next step."""
    reports, _ = gloo_run
    for rep in reports:
        assert rep["fsdp_split"] > 0 and rep["tp_split"] > 0, rep
        assert rel_err(torch.tensor(rep["tp_next"]), torch.tensor(rep["fsdp_next"])) < TOL


def test_pipeline_checkpoint_loads_into_the_single_device_model_exactly(gloo_run) -> None:
    reports, _ = gloo_run
    for rep in reports:
        assert rep["pipeline_keys"] > 0 and rep["pipeline_exact"]


def test_hugging_face_state_dict_loads_into_its_parallelized_copy(gloo_run) -> None:
    reports, _ = gloo_run
    for rep in reports:
        assert rep["hf_exact"] and rep["hf_pipeline_exact"]
        assert rep["hf_loss"][0] == pytest.approx(rep["hf_loss"][1], rel=TOL)


def _worker_on_eight(ckpt: str) -> list[float]:
    model, inputs = _gpt2(seed=7)
    pm = autopar.parallelize(model, autopar.Mesh((4, 2), ("dp", "tp"), "cpu"), inputs,
                             time_limit_s=2.0)
    opt, sched = _optimizer(pm)
    checkpoint.load(ckpt, pm, opt, lr_scheduler=sched)
    return _steps(pm, opt, sched, inputs, MORE)


@pytest.mark.slow
def test_four_processes_checkpoint_resumes_on_eight(gloo_run) -> None:
    """4 -> 8 processes: dp=2 x tp=2's checkpoint resumed on dp=4 x tp=2 (8 gloo processes on
    2 cores: slow, so outside the default run)."""
    from autopar.runtime.launch import launch

    reports, d = gloo_run
    want = torch.tensor(reports[0]["uninterrupted"])
    for losses in launch(_worker_on_eight, 8, (str(d / "dp2tp2"),), timeout_s=600,
                         start_method=start_method()):
        assert rel_err(torch.tensor(losses), want) < TOL


def test_dp_tp_checkpoint_into_the_plain_model_without_a_process_group(gloo_run) -> None:
    reports, d = gloo_run
    model, inputs = _gpt2(seed=5)
    opt, sched = _optimizer(model)
    resumed = checkpoint.load(d / "dp2tp2", model, opt, lr_scheduler=sched)
    assert resumed.step == SAVED_AT and resumed.path.name == "step-000000002"
    # another number of processes: rank 0's random state
    assert random.random() == reports[0]["draws"][0] != reports[1]["draws"][0]
    got = torch.tensor(_steps(model, opt, sched, inputs, MORE))
    assert rel_err(got, torch.tensor(reports[0]["uninterrupted"])) < TOL


# --- no processes ------------------------------------------------------------------------------


def _trained(tmp_path: Path, steps: int = 2) -> tuple[nn.Module, torch.optim.Optimizer, Path]:
    model, inputs = _gpt2()
    opt, sched = _optimizer(model)
    _steps(model, opt, sched, inputs, steps)
    d = tmp_path / "run"
    checkpoint.save(d, model, opt, step=steps, lr_scheduler=sched)
    return model, opt, d


def _snapshot(model: nn.Module, opt) -> dict:
    return copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(x, b["model"][k]) for k, x in a["model"].items()) and \
        str(a["opt"]) == str(b["opt"])


def test_resumed_run_is_bit_for_bit_the_uninterrupted_one(tmp_path) -> None:
    model, inputs = _gpt2()
    opt, sched = _optimizer(model)
    _steps(model, opt, sched, inputs, 2)
    np.random.seed(3)
    checkpoint.save(tmp_path, model, opt, step=2, lr_scheduler=sched, data_state={"i": 2})
    draw = np.random.rand()
    want = _steps(model, opt, sched, inputs, 3)
    model, _ = _gpt2(seed=8)
    opt, sched = _optimizer(model)
    resumed = checkpoint.load(tmp_path, model, opt, lr_scheduler=sched)
    assert np.random.rand() == draw and resumed.data_state == {"i": 2}
    assert _steps(model, opt, sched, inputs, 3) == want


def test_no_committed_checkpoint(tmp_path) -> None:
    model, _ = _gpt2()
    with pytest.raises(CheckpointError, match="no committed checkpoint in .*it does not exist"):
        checkpoint.load(tmp_path / "nowhere", model)
    (tmp_path / "step-000000004.tmp").mkdir()
    with pytest.raises(CheckpointError, match="step-000000004.tmp, a save that did not finish"):
        checkpoint.load(tmp_path, model)
    assert checkpoint.latest_step(tmp_path) is None


def test_another_step_than_those_committed(tmp_path) -> None:
    model, opt, d = _trained(tmp_path)
    with pytest.raises(CheckpointError, match=r"no committed checkpoint of step 9 .*steps 2"):
        checkpoint.load(d, model, opt, step=9)


def test_checkpoint_of_another_model_is_refused_and_nothing_changes(tmp_path) -> None:
    _, _, d = _trained(tmp_path)
    from autopar.models import get_preset

    other = get_preset("gpt2-tiny").replace(n_layer=5, d_model=128).build("cpu")
    opt, sched = _optimizer(other)
    _steps(other, opt, sched, four_block_model("gpt2-tiny", 2, 8)[1], 1)
    before = _snapshot(other, opt)
    with pytest.raises(CheckpointError) as e:
        checkpoint.load(d, other, opt)
    msg = str(e.value)
    assert "\n" not in msg and "saved from another model" in msg
    assert "missing (" in msg and "of another shape (" in msg and "load it into the model" in msg
    assert _same(before, _snapshot(other, opt))


def test_damaged_checkpoint_is_refused_and_nothing_changes(tmp_path) -> None:
    model, opt, d = _trained(tmp_path)
    path = d / "step-000000002"
    data = next(path.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 3])  # truncated
    fresh, _ = _gpt2(seed=6)
    fresh_opt, _ = _optimizer(fresh)
    before = _snapshot(fresh, fresh_opt)
    with pytest.raises(CheckpointError, match=r"could not be read .*damaged or incomplete"):
        checkpoint.load(d, fresh, fresh_opt)
    assert _same(before, _snapshot(fresh, fresh_opt))
    (path / ".metadata").write_bytes(b"not an index")
    with pytest.raises(CheckpointError, match="unreadable index .*damaged"):
        checkpoint.load(d, fresh, fresh_opt)


def test_save_that_fails_half_way_leaves_latest_on_the_last_commit(tmp_path, monkeypatch
                                                                   ) -> None:
    model, opt, d = _trained(tmp_path)
    import torch.distributed.checkpoint as dcp

    real = dcp.save

    def dies_half_way(state, **kwargs):
        real({k: v for i, (k, v) in enumerate(state.items()) if i % 2}, **kwargs)
        raise OSError("disk full")

    monkeypatch.setattr(dcp, "save", dies_half_way)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save(d, model, opt, step=3)
    handle = checkpoint.save(d, model, opt, step=4, blocking=False)
    with pytest.raises(OSError, match="disk full"):
        handle.wait()
    monkeypatch.setattr(dcp, "save", real)
    assert (d / "latest").read_text().strip() == "step-000000002"
    assert checkpoint.latest_step(d) == 2 and checkpoint.committed_steps(d) == [2]
    resumed = checkpoint.load(d, model, opt)  # the half-written ones are never loaded
    assert resumed.step == 2
    checkpoint.save(d, model, opt, step=3)  # and the next save replaces the leftover
    assert checkpoint.latest_step(d) == 3 and not (d / "step-000000003.tmp").exists()
    shutil.rmtree(d / "step-000000003")
    os.remove(d / "latest")  # a pointer lost: the newest committed step is found
    assert checkpoint.latest_step(d) == 2


def test_offloaded_optimizer_state_resumes_offloaded_or_not(tmp_path) -> None:
    from autopar.runtime.optim.offload import OffloadedOptimizer

    def offloaded(model: nn.Module) -> tuple[OffloadedOptimizer, object]:
        names = {n for n, _ in model.named_parameters() if n.startswith("blocks.1")}
        opt = OffloadedOptimizer(model.named_parameters(), names, torch.optim.AdamW, lr=LR,
                                 eps=EPS)
        return opt, torch.optim.lr_scheduler.StepLR(opt.device_opt, step_size=1, gamma=1.0)

    model, inputs = _gpt2()
    opt, sched = offloaded(model)
    _steps(model, opt, sched, inputs, 2)
    checkpoint.save(tmp_path, model, opt, step=2)
    want = _steps(model, opt, sched, inputs, 3)
    def on_device(model: nn.Module) -> tuple[torch.optim.Optimizer, object]:
        opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=1.0)

    for make in (offloaded, on_device):  # its state kept on the host again, or not
        model, _ = _gpt2(seed=4)
        opt, sched = make(model)
        checkpoint.load(tmp_path, model, opt)
        assert _steps(model, opt, sched, inputs, 3) == want, make.__name__


def test_an_optimizer_the_checkpoint_does_not_hold(tmp_path) -> None:
    model, inputs = _gpt2()
    checkpoint.save(tmp_path, model, step=0)
    opt, _ = _optimizer(model)
    with pytest.raises(CheckpointError, match="holds no optimizer state .*without optimizer="):
        checkpoint.load(tmp_path, model, opt)


def test_a_commit_that_fails_is_one_line_and_latest_stays(tmp_path, monkeypatch) -> None:
    model, opt, d = _trained(tmp_path)

    def read_only(tmp, final):
        raise PermissionError("read-only file system")

    monkeypatch.setattr(checkpoint, "_commit", read_only)
    with pytest.raises(CheckpointError, match=r"could not be committed as step-000000003 "
                                              r"\(PermissionError: read-only.*save again"):
        checkpoint.save(d, model, opt, step=3)
    assert checkpoint.latest_step(d) == 2 and checkpoint.committed_steps(d) == [2]


def test_a_tied_weight_saved_under_one_of_its_names(tmp_path) -> None:
    class Tied(nn.Module):  # an embedding and a head sharing one weight
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(8, 4)
            self.head = nn.Linear(4, 8, bias=False)
            self.head.weight = self.emb.weight

    source = Tied()
    head_only = nn.Module()
    head_only.head = nn.Linear(4, 8, bias=False)  # the weight under its second name only
    head_only.head.weight = nn.Parameter(source.emb.weight.detach().clone())
    checkpoint.save(tmp_path, head_only, step=0)
    target = Tied()
    checkpoint.load(tmp_path, target)
    assert torch.equal(target.emb.weight, source.emb.weight)
    assert target.emb.weight is target.head.weight
