"""Elastic restart: ``autopar train`` under ``torchrun --max-restarts=1`` on 4 processes (the
default mesh, pp=2 x dp=2), one rank SIGKILLed mid-run by the test hook
(``AUTOPAR_TEST_KILL_AT_STEP``): torchrun brings the group back, every rank resumes from the
last committed checkpoint, the run finishes, and its losses equal the uninterrupted run's, bit
for bit (the same plan on the same processes).

Two torchrun runs of fresh processes (about 60 s and 30 s on the loaded 2-core machine): each is
bounded by a timeout that kills its whole process group, so a hang fails the test instead of
stalling the suite.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from autopar.checkpoint import committed_steps
from autopar.cli.resume import KILL_VAR

ARGS = ["--batch", "8", "--seq", "16", "--steps", "6", "--time-limit", "5", "--no-baseline",
        "--checkpoint-every", "2"]
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "GROUP_RANK", "TORCHELASTIC_RESTART_COUNT", KILL_VAR)
TIMEOUT_S = 240


def _torchrun(tmp: Path, name: str, **env: str) -> tuple[subprocess.CompletedProcess, dict]:
    """``torchrun --standalone --nproc-per-node 4 --max-restarts=1 -m autopar.cli train``;
    its result and the losses it wrote."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "4", "--max-restarts=1", "--monitor-interval", "0.2", "-m", "autopar.cli", "train",
           *ARGS, "--checkpoint-dir", str(tmp / name), "--losses-json", str(tmp / f"{name}.json")]
    clean = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    # --standalone picks its own rendezvous port; the workers' MASTER_PORT is torchrun's
    p = subprocess.Popen(cmd, env=clean | env | {"PYTHONUNBUFFERED": "1"},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)  # torchrun and every worker it started
        out, err = p.communicate()
        raise AssertionError(f"torchrun did not finish in {TIMEOUT_S} s\n{out[-2000:]}\n"
                             f"{err[-3000:]}") from None
    r = subprocess.CompletedProcess(cmd, p.returncode, out, err)
    assert r.returncode == 0, f"exit {r.returncode}\n{out[-2000:]}\n{err[-4000:]}"
    return r, json.loads((tmp / f"{name}.json").read_text())


def test_a_killed_rank_restarts_from_the_last_checkpoint(tmp_path: Path) -> None:
    _, want = _torchrun(tmp_path, "uninterrupted")
    assert want["resumed_from"] is None and len(want["losses"]) == 6

    killed, got = _torchrun(tmp_path, "killed", **{KILL_VAR: "1:5"})
    # rank 1 died at the start of step 5 (-9: SIGKILL); torchrun restarted the group, which
    # went on from the last checkpoint committed before (step 4, or step 2 where the
    # asynchronous save of step 4 had not finished when the rank died)
    assert "exitcode: -9" in killed.stderr or "exitcode  : -9" in killed.stderr, killed.stderr
    assert "(torchrun restart 1)" in killed.stdout
    assert got["resumed_from"] in (2, 4)
    assert f"resumed from step {got['resumed_from']} (torchrun restart 1)" in killed.stdout
    assert got["losses"] == want["losses"]  # nothing lost, every step's loss to the bit
    assert committed_steps(tmp_path / "killed")[-1] == 6
