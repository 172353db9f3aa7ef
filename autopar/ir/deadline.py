"""The whole planning call's time limit: one :class:`Deadline`, made where the call starts.

``time_limit_s`` (:class:`autopar.ir.options.SearchOptions`) bounds a whole planning call:
every mode, every reference layout, the memory fit, the pipeline and mesh-shape searches. The
entry point (``make_plan``, ``plan_pipeline``, the shape search, ``parallelize``) makes one
``Deadline`` at its start and hands it down inside the options (``SearchOptions.deadline``);
a call that finds one there already is part of a larger call and keeps it. Each solve asks
:meth:`Deadline.cap` for its own limit (what it would take, at most what is left), and a
search that stops or skips work for lack of time says so (:meth:`Deadline.cut`): the plan's
provenance then records that the limit cut the search.

``progress``: a callable ``(phase, best_step_s)`` told of each phase and of the best plan so
far (``autopar.report.plan_progress.PlanProgress`` draws it on a terminal); None: nothing is shown.
"""

from __future__ import annotations

import time
from collections.abc import Callable

# a solve's limit never drops below this: a solve returns its start point at worst, and a
# deadline met a little late beats no plan at all
MIN_SOLVE_S = 0.05


class Deadline:
    """``limit_s`` seconds from now (``time.monotonic``)."""

    def __init__(self, limit_s: float,
                 progress: Callable[[str, float | None], None] | None = None) -> None:
        self.limit_s = float(limit_s)
        self.start = time.monotonic()
        self.at = self.start + self.limit_s
        self.progress = progress
        self.cuts: list[str] = []  # what the limit stopped short or skipped, in order
        # the least a solve gets past the deadline: MIN_SOLVE_S once a plan is at hand; the
        # planner raises it while none is (a search with nothing to return goes on)
        self.floor = MIN_SOLVE_S
        self.best_step_s: float | None = None

    def left(self) -> float:
        """Seconds left (negative once past)."""
        return self.at - time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def expired(self) -> bool:
        return self.left() <= 0

    def cap(self, seconds: float) -> float:
        """A solve's limit: ``seconds``, at most what is left (at least :attr:`floor`).
        (Whether the solve was cut shows at the end: a call that ends past its deadline was
        cut by it, :meth:`close`.)"""
        return max(min(self.floor, seconds), min(seconds, self.left()))

    def close(self) -> None:
        """At the end of the search: past the deadline, a solve ran up to it (noted)."""
        if self.expired():
            self.cut("a solve stopped at the limit")

    def cut(self, what: str) -> None:
        """Note that the limit stopped ``what`` short (recorded once per kind)."""
        if what not in self.cuts:
            self.cuts.append(what)

    @property
    def was_cut(self) -> bool:
        return bool(self.cuts)

    def phase(self, name: str) -> None:
        """Tell the progress display the search entered ``name``."""
        if self.progress is not None:
            self.progress(name, self.best_step_s)

    def found(self, step_s: float) -> None:
        """A plan predicted at ``step_s`` seconds per step fits: shown if the best so far."""
        if self.best_step_s is None or step_s < self.best_step_s:
            self.best_step_s = step_s
            if self.progress is not None:
                self.progress("", step_s)

    def summary(self) -> str:
        """One line for the plan's provenance: empty where the limit cut nothing."""
        if not self.cuts:
            return ""
        return (f"the {self.limit_s:g} s time limit cut the search ({'; '.join(self.cuts)}): "
                "raise --time-limit (time_limit_s) for a search run to its end")


__all__ = ["MIN_SOLVE_S", "Deadline"]
