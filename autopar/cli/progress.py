"""Text output for training runs: a one-line progress bar (``tqdm``), sparklines and a loss
comparison (its table laid out by :func:`autopar.report.table.text_table`, ``rich``).
"""

from __future__ import annotations

import math
import os
import sys
import threading
from collections.abc import Sequence
from typing import Any, TextIO

from tqdm import tqdm

from autopar.report.table import text_table

_BLOCKS = "▁▂▃▄▅▆▇█"
_ASCII_LEVELS = "_.-~=*#@"


class _Bar(tqdm):
    """tqdm with two more fields for ``bar_format``: the last step's ``loss`` (``-`` before the
    first) and ``tok_s``, tqdm's smoothed rate in tokens per second."""

    monitor_interval = 0  # no monitor thread in a training process

    def __init__(self, *args: Any, tokens_per_step: int, **kwargs: Any) -> None:
        self.loss: float | None = None
        self.tokens_per_step = tokens_per_step
        super().__init__(*args, **kwargs)

    @property
    def format_dict(self) -> dict[str, Any]:
        d = super().format_dict
        done = d["n"] - (d.get("initial") or 0)  # a resumed run's steps before it: not timed
        rate = d["rate"] or (done / d["elapsed"] if d["elapsed"] else 0.0)
        loss = "-" if self.loss is None else f"{self.loss:.4f}"
        return {**d, "loss": loss, "tok_s": format_rate(rate * self.tokens_per_step)}


# tqdm's default lock is a multiprocessing semaphore, made on a process's first bar; torch.fx's
# interpreter draws one (it uses tqdm where installed) in every rank that traces a pipeline
# stage, and the launched ranks' semaphores were reported leaked at exit. A process draws one
# bar at a time, so a thread lock serves (set on tqdm itself: torch's bars are plain tqdm's)
tqdm.set_lock(threading.RLock())


class Progress:
    """``update(step, loss)`` after each step; ``close()`` at the end. A resumed run's bar
    starts at the steps already done (``start``).

    On a terminal tqdm redraws the bar in place (at most ~10 times a second, so drawing never
    costs a step's time); elsewhere (a log file, CI, a pipe) the same line is printed every
    ``every`` steps, with no carriage returns, so logs stay readable.
    """

    def __init__(self, total: int, tokens_per_step: int, label: str = "train",
                 stream: TextIO | None = None, tty: bool | None = None,
                 every: int | None = None, width: int = 24, start: int = 0) -> None:
        self.total = total
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self.every = every or max(1, total // 10)
        fmt = (f"{{desc}} [{{bar:{width}}}] {{n_fmt:>{len(str(total))}}}/{{total_fmt}} "
               "loss {loss}  {tok_s} tok/s  {elapsed_s:5.1f}s")
        # off a terminal tqdm never draws (delay=inf): it keeps the count and the clock, and
        # update() prints its line (the rate then is the mean since the start, tqdm's
        # smoothed one being updated only as it draws)
        # a terminal that tells its width: tqdm trims the line to it (tqdm draws nothing at
        # 0 columns, what a pseudo-terminal of no size reports)
        sized = self.tty and _columns(self.stream) > 0
        self._bar = _Bar(total=total, desc=label, file=self.stream, bar_format=fmt, ascii=".#",
                         mininterval=0.1, leave=True, dynamic_ncols=sized,
                         ncols=None if sized else 1000, delay=0 if self.tty else math.inf,
                         tokens_per_step=tokens_per_step, initial=start)

    def update(self, step: int, loss: float) -> None:
        """``step`` counts from 1; ``loss`` is that step's loss."""
        self._bar.loss = loss
        self._bar.update(step - self._bar.n)
        if not self.tty and (step % self.every == 0 or step == self.total or step == 1):
            print(str(self._bar), file=self.stream, flush=True)

    def close(self) -> None:
        self._bar.close()


def _columns(stream: TextIO) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):  # no file descriptor, or not a terminal
        return 0


def format_rate(x: float) -> str:
    """``x`` with an SI prefix, three significant digits (``41.2k``)."""
    return tqdm.format_sizeof(x)


def sparkline(values: Sequence[float], width: int = 60, lo: float | None = None,
              hi: float | None = None, ascii_only: bool = False) -> str:
    """``values`` resampled to ``width`` columns (mean per bucket), one level glyph each.

    ``lo``/``hi`` fix the scale so two curves drawn with the same bounds compare by eye.
    """
    vals = [v for v in values if math.isfinite(v)]
    if not vals:
        return ""
    n = min(width, len(values))
    cols = [_mean(values[i * len(values) // n:(i + 1) * len(values) // n]) for i in range(n)]
    lo = min(vals) if lo is None else lo
    hi = max(vals) if hi is None else hi
    glyphs = _ASCII_LEVELS if ascii_only else _BLOCKS
    span = hi - lo
    out = []
    for v in cols:
        if not math.isfinite(v):
            out.append("?")
            continue
        k = 0 if span <= 0 else round((v - lo) / span * (len(glyphs) - 1))
        out.append(glyphs[min(max(k, 0), len(glyphs) - 1)])
    return "".join(out)


def can_encode(text: str, stream: TextIO | None = None) -> bool:
    enc = getattr(stream or sys.stdout, "encoding", None) or "ascii"
    try:
        text.encode(enc)
    except (UnicodeEncodeError, LookupError):
        return False
    return True


def loss_report(curves: dict[str, Sequence[float]], points: int = 6, width: int = 60,
                stream: TextIO | None = None, early: int = 5) -> str:
    """A table of the loss at ``points`` steps for each curve, the largest difference between
    the first curve and each other one (over the first ``early`` steps and over all), and a
    sparkline per curve on a shared scale."""
    names = list(curves)
    n = min(len(c) for c in curves.values())
    if n == 0:
        return "(no steps)"
    steps = sorted({round(i * (n - 1) / max(points - 1, 1)) for i in range(points)})
    head = ["step", *names]
    if len(names) > 1:
        head.append("|diff|")
    rows = []
    for s in steps:
        row = [str(s + 1), *(f"{curves[k][s]:.6f}" for k in names)]
        if len(names) > 1:
            row.append(f"{max(abs(curves[k][s] - curves[names[0]][s]) for k in names[1:]):.2e}")
        rows.append(row)
    lines = text_table(head, rows, justify="right", indent="")
    if len(names) > 1:
        for k in names[1:]:
            diffs = [abs(a - b) for a, b in zip(curves[names[0]][:n], curves[k][:n])]
            first = min(early, n)
            lines.append(f"max |{names[0]} - {k}|: {max(diffs[:first]):.3e} over steps "
                         f"1-{first}, {max(diffs):.3e} over all {n} steps")
    finite = [v for c in curves.values() for v in c[:n] if math.isfinite(v)]
    lo, hi = (min(finite), max(finite)) if finite else (0.0, 1.0)
    ascii_only = not can_encode(_BLOCKS, stream)
    label_w = max(len(k) for k in names)
    glyphs = _ASCII_LEVELS if ascii_only else _BLOCKS
    lines.append(f"loss, step 1 -> {n} ({glyphs[0]} = {lo:.3f}, {glyphs[-1]} = {hi:.3f}):")
    for k in names:
        lines.append(f"  {k.ljust(label_w)}  "
                     f"{sparkline(curves[k][:n], width, lo, hi, ascii_only)}")
    return "\n".join(lines)


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")
