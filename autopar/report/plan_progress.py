"""The planner's progress on a terminal: the phase and the best plan so far, for a planning
call (``autopar plan``, ``parallelize``) that runs more than a few seconds.

It lives below :mod:`autopar.api` so that ``parallelize`` shows it too, not only the CLI."""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import TextIO

from tqdm import tqdm

# tqdm's default lock is a multiprocessing semaphore, reported leaked when a launched rank
# exits (autopar.cli.progress says more); one bar at a time per process: a thread lock serves
tqdm.set_lock(threading.RLock())


class PlanProgress:
    """The planner's progress, for a planning call that runs more than ``delay_s`` seconds:
    the phase and the best plan that fits so far (``progress`` of
    :class:`autopar.ir.deadline.Deadline`, which calls it as ``(phase, best_step_s)``).

    On a terminal one line is redrawn in place (tqdm, cleared at :meth:`close`); forced onto
    another stream (``force``: a log, a test) each change is printed as a line of its own.
    Nothing is shown before ``delay_s``: a quick plan prints only its table."""

    def __init__(self, limit_s: float, stream: TextIO | None = None, tty: bool | None = None,
                 delay_s: float = 2.0) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.delay_s = delay_s
        self.limit_s = limit_s
        self.phase, self.best = "starting", None
        self.start = time.monotonic()
        self._bar = tqdm(total=None, file=self.stream, leave=False, delay=delay_s,
                         bar_format="planning: {desc} [{elapsed}, limit " f"{limit_s:g} s]"
                         "{postfix}", mininterval=0.2, disable=not self.tty)

    def __call__(self, phase: str, best_step_s: float | None) -> None:
        from autopar.ir.units import fmt_time

        self.phase = phase or self.phase
        self.best = best_step_s
        best = f"  best step {fmt_time(best_step_s)}" if best_step_s is not None else ""
        if self.tty:
            self._bar.set_description_str(self.phase, refresh=False)
            self._bar.set_postfix_str(best.strip(), refresh=False)
            self._bar.update(0)  # tqdm redraws at most every mininterval, after its delay
            return
        elapsed = time.monotonic() - self.start
        if elapsed >= self.delay_s:
            print(f"planning: {self.phase}{best} [{elapsed:.1f} s, limit {self.limit_s:g} s]",
                  file=self.stream, flush=True)

    def close(self) -> None:
        self._bar.close()


def plan_progress(limit_s: float, force: bool = False, stream: TextIO | None = None,
                  delay_s: float = 2.0) -> PlanProgress | None:
    """A :class:`PlanProgress` where one should be shown: on rank 0 only (``RANK`` unset or
    0), and where the stream (stderr) is a terminal or ``force`` asks for it; else None."""
    if os.environ.get("RANK", "0") != "0":
        return None
    stream = stream or sys.stderr
    tty = stream.isatty()
    if not (tty or force):
        return None
    return PlanProgress(limit_s, stream, tty, 0.0 if force and not tty else delay_s)
