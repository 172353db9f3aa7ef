"""Text output for training runs: a one-line progress bar, sparklines and a loss comparison.

No third-party progress library: the package declares only torch and the solver's needs, and a
bar that redraws one line with ``\\r`` is a dozen lines.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Sequence
from typing import TextIO

_BLOCKS = "▁▂▃▄▅▆▇█"
_ASCII_LEVELS = "_.-~=*#@"


class Progress:
    """``update(step, loss)`` after each step; ``close()`` at the end.

    On a terminal the bar is redrawn in place (at most ~10 times a second, so drawing never
    costs a step's time); elsewhere (a log file, CI, a pipe) one line is printed every
    ``every`` steps, so logs stay readable.
    """

    def __init__(self, total: int, tokens_per_step: int, label: str = "train",
                 stream: TextIO | None = None, tty: bool | None = None,
                 every: int | None = None, width: int = 24) -> None:
        self.total = total
        self.tokens_per_step = tokens_per_step
        self.label = label
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self.every = every or max(1, total // 10)
        self.width = width
        self._t0 = time.perf_counter()
        self._last_draw = 0.0
        self._win_t = self._t0
        self._win_steps = 0
        self._rate = 0.0
        self._line_len = 0

    def update(self, step: int, loss: float) -> None:
        """``step`` counts from 1; ``loss`` is that step's loss."""
        now = time.perf_counter()
        self._win_steps += 1
        if now - self._win_t >= 0.5 or step == self.total or self._rate == 0.0:
            self._rate = self._win_steps * self.tokens_per_step / max(now - self._win_t, 1e-9)
            self._win_t, self._win_steps = now, 0
        if self.tty:
            if now - self._last_draw >= 0.1 or step == self.total:
                self._last_draw = now
                self._draw(self.line(step, loss, self._rate, now - self._t0))
        elif step % self.every == 0 or step == self.total or step == 1:
            print(self.line(step, loss, self._rate, now - self._t0), file=self.stream,
                  flush=True)

    def line(self, step: int, loss: float, tok_s: float, elapsed: float) -> str:
        done = round(self.width * step / max(self.total, 1))
        bar = "#" * done + "." * (self.width - done)
        return (f"{self.label} [{bar}] {step:>{len(str(self.total))}}/{self.total} "
                f"loss {loss:.4f}  {format_rate(tok_s)} tok/s  {elapsed:5.1f}s")

    def _draw(self, text: str) -> None:
        pad = max(0, self._line_len - len(text))
        self.stream.write("\r" + text + " " * pad)
        self.stream.flush()
        self._line_len = len(text)

    def close(self) -> None:
        if self.tty and self._line_len:
            self.stream.write("\n")
            self.stream.flush()


def format_rate(x: float) -> str:
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


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
    widths = [max(len(head[i]), *(len(r[i]) for r in rows)) for i in range(len(head))]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
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
