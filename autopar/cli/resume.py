"""``autopar train``'s checkpoints: where a run starts, what it saves besides the model and the
optimizer, when it saves, and the elastic restart under torchrun.

The checkpoint itself is :mod:`autopar.checkpoint`'s (model, optimizer, RNG states and the step,
committed atomically into ``DIR/step-<step>/``); the loop's own state travels in its
``data_state``:

* ``sampler``: the corpus sampler's position (batches are drawn from ``(seed, step)``, so the
  step and what decides the draws are the whole position in the data);
* ``run``: the options that decide the trajectory (model, lr, accumulation, clipping), which a
  resumed run must share to continue the same run;
* ``losses``: every step's loss so far, so a resumed run reports the whole curve;
* ``loss_scale``: an fp16 plan's dynamic loss scale (its scale and counters), None otherwise.

A step number is the count of optimizer steps done: the checkpoint of step 4 is the state after
steps 0-3, and a run resumed from it runs step 4 next.

Elastic restart: under ``torchrun --max-restarts N`` a rank that dies takes the group down and
torchrun starts every rank again with ``TORCHELASTIC_RESTART_COUNT`` > 0; the restarted run
resumes from the last committed checkpoint of ``--checkpoint-dir`` as if ``--resume`` had been
given (from step 0 where none was committed yet).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from autopar.cli.corpus import BatchSampler
from autopar.cli.options import UsageError

# Test hook, for tests only: "RANK:STEP" makes that rank SIGKILL itself at the start of that
# step, on torchrun's first attempt only (a restarted group runs on), so a test can kill a rank
# mid-run and watch the group come back.
KILL_VAR = "AUTOPAR_TEST_KILL_AT_STEP"

# the options that decide a run's trajectory besides the sampler's: TrainConfig field -> flag
RUN_FLAGS = {"model": "--model", "lr": "--lr", "grad_accum": "--grad-accum", "clip": "--clip"}
SAMPLER_FLAGS = {"seed": "--seed", "batch_size": "--batch", "seq_len": "--seq",
                 "corpus_tokens": "(the corpus)"}


def start_step(directory: str | None, resume: bool, steps: int) -> int | None:
    """The committed checkpoint step this run resumes from, None for a run from step 0; or a
    :class:`UsageError` naming the cause and the fix. The same on every rank: no rank writes
    while ranks start (a restarted group's old ranks are gone)."""
    if directory is None:
        return None
    from autopar.checkpoint import latest_step
    from autopar.runtime.launch import restart_count

    latest = latest_step(directory)
    restarted = restart_count() > 0
    if not resume and not restarted:
        if latest is not None:
            raise UsageError(
                f"--checkpoint-dir {directory} already holds a run (its last checkpoint is at "
                f"step {latest}): add --resume to continue it, or give an empty or new "
                "--checkpoint-dir")
        return None
    if latest is None:
        if restarted and not resume:
            return None  # the group died before its first checkpoint: from step 0 again
        raise UsageError(
            f"--resume: {directory} holds no committed checkpoint (missing, empty, or every "
            "save in it was cut short): leave --resume out to start from step 0, or give the "
            "--checkpoint-dir of the run to continue")
    if latest > steps:
        raise UsageError(
            f"--resume: the checkpoint in {directory} is at step {latest}, past --steps "
            f"{steps}: give --steps {latest} or more (the total, the steps done included)")
    return latest


def loop_state(sampler: BatchSampler, next_step: int, run: dict[str, Any],
               losses: list[float], loss_scale: Any) -> dict[str, Any]:
    """The loop's state before ``next_step``, as the checkpoint's ``data_state``: plain values,
    copied (an asynchronous save may write it after the loop has moved on)."""
    return {"sampler": sampler.state_dict(next_step), "run": dict(run),
            "losses": list(losses),
            "loss_scale": None if loss_scale is None else dataclasses.asdict(loss_scale)}


def restore_loop(state: dict[str, Any] | None, directory: str, sampler: BatchSampler,
                 run: dict[str, Any], loss_scale: Any) -> list[float]:
    """The losses of the steps before the checkpoint, after checking that this run continues the
    saved one (else a :class:`UsageError` naming the options that differ) and restoring the
    loss scale."""
    if not state or "sampler" not in state:
        raise UsageError(f"the checkpoint in {directory} was not written by autopar train (it "
                         "has no loop state): resume it from the script that wrote it, or give "
                         "another --checkpoint-dir")
    differ = [(SAMPLER_FLAGS[k], saved, ours)
              for k, (saved, ours) in sampler.differences(state["sampler"]).items()]
    saved_run = state.get("run", {})
    differ += [(flag, saved_run.get(k), run[k]) for k, flag in RUN_FLAGS.items()
               if saved_run.get(k) != run[k]]
    if differ:
        text = ", ".join(f"{flag} {saved} (this run: {ours})" for flag, saved, ours in differ)
        raise UsageError(f"--resume: {directory} holds a run with {text}: resume with the "
                         "run's own values, or start a new run in an empty --checkpoint-dir")
    if loss_scale is not None and state.get("loss_scale"):
        for k, v in state["loss_scale"].items():
            setattr(loss_scale, k, v)
    return [float(v) for v in state.get("losses", [])]


@dataclass
class Checkpointer:
    """Saves every ``every`` steps (``None``: only at the end) and at the end. Asynchronous by
    default: the loop waits only for the copy of the state, and for the previous save before
    it starts the next, so at most one save is in flight."""

    directory: str
    every: int | None
    model: nn.Module
    optimizer: torch.optim.Optimizer
    sampler: BatchSampler
    run: dict[str, Any]  # TrainConfig.run_identity
    loss_scale: Any = None  # an fp16 plan's DynamicLossScale
    blocking: bool = False
    _pending: Any = None

    def after_step(self, done: int, losses: list[float], last: bool) -> None:
        """After ``done`` steps (``losses``: theirs): save if one is due, or this is the last."""
        if last or (self.every is not None and done % self.every == 0):
            self.save(done, losses, blocking=self.blocking or last)

    def save(self, done: int, losses: list[float], blocking: bool) -> None:
        from autopar import checkpoint

        self.wait()
        state = loop_state(self.sampler, done, self.run, losses, self.loss_scale)
        self._pending = checkpoint.save(self.directory, self.model, self.optimizer, step=done,
                                        data_state=state, blocking=blocking)

    def wait(self) -> None:
        if self._pending is not None:
            self._pending.wait()
            self._pending = None


def planned_kill(rank: int) -> int | None:
    """The step at whose start this rank kills itself (:data:`KILL_VAR`), on a first attempt."""
    from autopar.runtime.launch import restart_count

    spec = os.environ.get(KILL_VAR)
    if not spec or restart_count() > 0:
        return None
    try:
        who, step = (int(v) for v in spec.split(":"))
    except ValueError:
        raise UsageError(f"{KILL_VAR}={spec!r}: write RANK:STEP, e.g. 1:5 (a hook for tests "
                         "only: that rank kills itself at the start of that step)") from None
    return step if who == rank else None


def kill_self() -> None:
    """SIGKILL this process, as a lost machine would end it: no cleanup, no exit handlers."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)
