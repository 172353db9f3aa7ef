"""``autopar train --mesh pp=2,dp=2``: the pipelined run of the shipped corpus against one
process; what a user can get wrong about a pipeline, in one line with exit code 2.

The option errors need no processes. Two runs spawn 4 gloo processes each (about 15 s and
8 s here): a short training with the pipeline options, gradient accumulation and clipping,
and a memory budget no schedule fits, refused from the planner on rank 0, the same line on
every rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from harness.spmd import train_usage_error


@pytest.mark.parametrize("argv, needle", [
    (["--mesh", "pp=4"], "4 pipeline stages (pp=4 x 1 per rank) but gpt2-tiny has 2 blocks: "
                         "every stage needs one; use pp x --virtual <= 2"),
    (["--mesh", "pp=2,dp=2", "--virtual", "2"], "4 pipeline stages (pp=2 x 2 per rank)"),
    (["--mesh", "pp=2,dp=2", "--microbatches", "3"],
     "3 microbatches do not divide the batch of 16: use a divisor of it (1, 2, 4, 8, 16)"),
    (["--mesh", "pp=2,dp=2", "--batch", "8", "--microbatches", "8"],
     "8 microbatches of 1 samples do not split over the 2 data-parallel ranks"),
    (["--mesh", "pp=2,dp=2", "--batch", "16", "--grad-accum", "2", "--microbatches", "16"],
     "16 microbatches do not divide the batch of 8"),  # each call is one pipeline step
    (["--mesh", "pp=2,dp=2", "--schedule", "pipedream"],
     "unknown pipeline schedule 'pipedream': use one of GPipe, 1F1B"),
    (["--mesh", "dp=2,tp=2", "--schedule", "1F1B"],
     "--schedule, --microbatches and --virtual need a pipeline axis"),
    (["--mesh", "pp=2,ep=2"], "pipelines run on mesh axes 'pp', 'dp' and 'tp'; ep=2 is not"),
    (["--mesh", "pp=2,dp=2", "--compile"], "--compile does not apply to pipelines yet"),
    (["--mesh", "pp=2,dp=2", "--precision", "fp16"],
     "--precision fp16: pipeline stages do not do fp16's dynamic loss scaling yet; use "
     "--precision bf16"),
    (["--mesh", "pp=2,dp=2", "--recompute", "selective", "--schedule", "zbv"],
     "--recompute selective: schedule ZBVZeroBubble runs two backward passes over every block"),
    (["--mesh", "pp=2,dp=2", "--offload", "optimizer"],
     "--offload optimizer: pipeline stages do not offload optimizer state"),
])
def test_bad_pipeline_options_are_one_line_and_exit_2(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    line = train_usage_error(argv, capsys)
    assert needle in line, line


def _train(*argv: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "autopar.cli", "train", "--mesh", "pp=2,dp=2", "--seq", "32",
           "--batch", "8", "--time-limit", "5", *argv]
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)


def test_pipelined_run_tracks_one_process(tmp_path) -> None:
    """4 processes, 3 steps of 2 accumulated calls each, clipped, schedule asked: the plan's
    pipeline section printed once, the curve equal to the one-process run to rounding; the
    second call's step measured beside the plan's prediction, with the same action names."""
    r = _train("--steps", "3", "--grad-accum", "2", "--clip", "0.5", "--schedule", "1F1B",
               "--microbatches", "2", "--profile", str(tmp_path))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    out = r.stdout
    assert out.count("pipeline: 2 ranks on axis pp, schedule 1F1B with 1 stage(s) per rank, "
                     "2 microbatches") == 1  # rank 0 prints the plan
    assert "pipeline schedule 1F1B, microbatches 2" in out
    assert out.count("gradients clipped on 3 steps") == 2  # the pipeline and the baseline
    early = float(out.split("max |autopar pp=2,dp=2 - 1 process|: ")[1].split()[0])
    assert early < 1e-4

    def names(path):
        doc = json.loads(path.read_text())
        return {e["name"] for e in doc["traceEvents"] if e.get("ph") == "X"}

    predicted = names(tmp_path / "predicted.json")
    # 1F1B, 2 microbatches, 2 stages: each action once, on the rank that runs it
    actions = {f"{s}{k}{m}" for s in range(2) for k in "FB" for m in range(2)}
    assert actions <= predicted
    measured = set().union(*(names(tmp_path / f"trace_rank{r}.json") for r in range(4)))
    assert actions <= measured and "gradient sync" in measured & predicted
    assert (tmp_path / "side_by_side.json").exists()


def test_a_schedule_whose_activations_cannot_fit() -> None:
    r = _train("--steps", "1", "--memory-budget", "64KiB", "--schedule", "GPipe",
               "--no-baseline")
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("autopar: error: no pipeline plan of 2 blocks on 2 stages "
                               "fits 64.00 KiB per device"), lines[0]
