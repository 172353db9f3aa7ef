"""``autopar train --checkpoint-dir DIR --checkpoint-every N --resume``: what a user can get
wrong (one line, exit 2, before any process starts), the loop state a checkpoint carries, and
resumed runs against uninterrupted ones on 2 gloo processes: bit for bit on the same plan,
to fp32 rounding on another mesh.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from harness.spmd import start_method, train_usage_error

from autopar.cli import resume
from autopar.cli.corpus import BatchSampler
from autopar.cli.options import UsageError
from autopar.runtime.launch import restart_count

# --- option errors ----------------------------------------------------------------------------


@pytest.mark.parametrize("argv, needle", [
    (["--resume"], "--resume needs --checkpoint-dir DIR"),
    (["--checkpoint-every", "2"], "--checkpoint-every needs --checkpoint-dir DIR"),
    (["--checkpoint-sync"], "--checkpoint-sync needs --checkpoint-dir DIR"),
])
def test_checkpoint_flags_need_a_directory(argv: list[str], needle: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert needle in train_usage_error(argv, capsys)


def test_checkpoint_every_must_be_positive(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    line = train_usage_error(["--checkpoint-dir", str(tmp_path), "--checkpoint-every", "0"],
                             capsys)
    assert "--checkpoint-every must be at least 1, got 0" in line


def test_resume_from_a_directory_without_a_checkpoint(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    for d in (tmp_path / "missing", tmp_path):
        line = train_usage_error(["--checkpoint-dir", str(d), "--resume"], capsys)
        assert f"--resume: {d} holds no committed checkpoint" in line
        assert "leave --resume out to start from step 0" in line
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_a_directory_that_holds_a_run(tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A new run never writes over a run's checkpoints; --resume past --steps is refused."""
    import torch

    from autopar import checkpoint

    checkpoint.save(tmp_path, torch.nn.Linear(2, 2), step=8)
    before = sorted(p.name for p in tmp_path.iterdir())
    line = train_usage_error(["--checkpoint-dir", str(tmp_path)], capsys)
    assert (f"--checkpoint-dir {tmp_path} already holds a run (its last checkpoint is at step "
            "8): add --resume to continue it, or give an empty or new --checkpoint-dir") in line
    line = train_usage_error(["--checkpoint-dir", str(tmp_path), "--resume", "--steps", "6"],
                             capsys)
    assert "is at step 8, past --steps 6: give --steps 8 or more" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize("argv, world, needle", [
    ([], "2", "torchrun started 2 processes but mesh pp=2,dp=2 has 4 devices: use torchrun "
              "--nproc-per-node 4, or a mesh of 2 devices"),
    (["--mesh", "dp=2", "--nproc", "4"], "2", "--nproc 4 under torchrun, which started 2"),
    (["--mesh", "dp=2", "--timeout", "60"], "2", "--timeout stops the processes"),
])
def test_under_torchrun_the_processes_are_torchruns(
    argv: list[str], world: str, needle: str, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", world)
    assert needle in train_usage_error(argv, capsys)


# --- the loop state a checkpoint carries ------------------------------------------------------

RUN = {"model": "gpt2-tiny", "lr": 3e-3, "grad_accum": 1, "clip": None}


def test_loop_state_round_trip_and_refusals() -> None:
    from autopar.runtime.optim.loss_scale import DynamicLossScale

    sampler = BatchSampler.from_corpus(4, 16, seed=3)
    scale = DynamicLossScale(scale=1024.0, good_steps=7, skipped=2)
    losses = [5.0, 4.5]
    state = resume.loop_state(sampler, 2, RUN, losses, scale)
    losses.append(4.0)  # the saved state is a copy: an asynchronous save writes it later
    assert state["sampler"]["step"] == 2 and state["losses"] == [5.0, 4.5]
    assert json.loads(json.dumps(state)) == state  # plain values

    fresh = DynamicLossScale()
    assert resume.restore_loop(state, "D", sampler, RUN, fresh) == [5.0, 4.5]
    assert (fresh.scale, fresh.good_steps, fresh.skipped) == (1024.0, 7, 2)

    other = BatchSampler.from_corpus(8, 16, seed=3)
    with pytest.raises(UsageError, match=r"--resume: D holds a run with --batch 4 \(this run: "
                                         r"8\): resume with the run's own values"):
        resume.restore_loop(state, "D", other, RUN, None)
    with pytest.raises(UsageError, match=r"--lr 0.003 \(this run: 0.01\), --clip None "
                                         r"\(this run: 1.0\)"):
        resume.restore_loop(state, "D", sampler, RUN | {"lr": 1e-2, "clip": 1.0}, None)
    with pytest.raises(UsageError, match="was not written by autopar train"):
        resume.restore_loop({}, "D", sampler, RUN, None)


def test_the_kill_hook_fires_on_the_first_attempt_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.delenv(resume.KILL_VAR, raising=False)
    assert resume.planned_kill(1) is None
    monkeypatch.setenv(resume.KILL_VAR, "1:5")
    assert resume.planned_kill(1) == 5 and resume.planned_kill(0) is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert restart_count() == 1 and resume.planned_kill(1) is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv(resume.KILL_VAR, "one:5")
    with pytest.raises(UsageError, match="write RANK:STEP, e.g. 1:5"):
        resume.planned_kill(1)


# --- resumed runs against the uninterrupted one, 2 gloo processes -----------------------------

RESUME_ARGS = ["--batch", "4", "--seq", "16", "--steps", "6", "--time-limit", "5",
               "--no-baseline"]
# A run resumed on another mesh may add its sums in another order: its losses may differ by
# fp32 rounding, which 4 Adam steps amplify a little. Measured: the pp=2 run resumed from the
# dp=2 checkpoint equals the dp=2 run to the last bit (2 stages of 1 block on the whole batch
# in 2 microbatches add up the same; so did a tp=2 run, whose plan replicates this small model),
# so the bound has a margin of all of it.
MESH_CHANGE_RTOL = 1e-5


def _config(*argv: str):
    from autopar.cli import train as tc

    parser = argparse.ArgumentParser()
    tc.register(parser.add_subparsers())
    cfg = tc.validate(parser.parse_args(["train", *RESUME_ARGS, *argv]))
    return dataclasses.replace(cfg, tty=False)


def _resume_worker(tmp: str) -> dict:
    """On each of 2 ranks, as ``autopar train`` runs them: dp=2 for 6 steps saving every 2;
    its step-2 checkpoint copied into two directories, as a run stopped after step 2 would
    leave them; one resumed on dp=2 saving every 2 steps, the other on pp=2 (another plan: a
    pipeline) saving at the end."""
    import torch.distributed as dist

    from autopar.cli import train as tc

    d = Path(tmp)
    full = tc._parallel_worker(_config("--mesh", "dp=2", "--checkpoint-dir", str(d / "full"),
                                       "--checkpoint-every", "2"))
    dist.barrier()
    if dist.get_rank() == 0:
        for name in ("same", "other"):
            shutil.copytree(d / "full" / "step-000000002", d / name / "step-000000002")
    dist.barrier()
    same = tc._parallel_worker(_config("--mesh", "dp=2", "--checkpoint-dir", str(d / "same"),
                                       "--resume", "--checkpoint-every", "2"))
    other = tc._parallel_worker(_config("--mesh", "pp=2", "--checkpoint-dir",
                                        str(d / "other"), "--resume"))
    return {"full": full.losses, "same": same.losses, "other": other.losses,
            "resumed": (same.resumed_from, other.resumed_from),
            "run_now": (len(same.step_times), len(other.step_times))}


def test_resumed_runs_equal_the_uninterrupted_run(tmp_path: Path) -> None:
    from autopar.checkpoint import committed_steps
    from autopar.runtime.launch import launch

    reports = launch(_resume_worker, 2, (str(tmp_path),), timeout_s=300,
                     start_method=start_method())
    r = reports[0]
    assert all(rep["full"] == r["full"] for rep in reports)  # every rank's loss is the whole
    assert committed_steps(tmp_path / "full") == [2, 4, 6]  # every 2 steps, the last at the end
    assert r["resumed"] == (2, 2) and r["run_now"] == (4, 4)
    assert r["same"] == r["full"]  # the same plan: bit for bit, the steps before from the record
    assert r["other"][:2] == r["full"][:2]
    for got, want in zip(r["other"][2:], r["full"][2:]):
        assert abs(got - want) <= MESH_CHANGE_RTOL * abs(want), (r["other"], r["full"])
    assert committed_steps(tmp_path / "same") == [2, 4, 6]
    assert committed_steps(tmp_path / "other") == [2, 6]  # no --checkpoint-every: at the end
