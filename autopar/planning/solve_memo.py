"""The planner's solves remembered by what they solve, for the length of one planning call.

Modes that differ in the graph can build the same problem: re-gathering a parameter whose
views the reduced problem merges into their consumers changes nothing the problem holds
(``moe-tiny`` of benchmarks/solver.py at 0.35 of its peak: ``selective`` and
``selective+zero3``, ``none+offload`` and ``none+zero3+offload``, each pair the same problem
and the same memory fit's limits round after round; each was solved twice, 2-4 s a mode).
A solve asked again of the same problem content (costs, usages, live intervals, edges and
their costs, the usage limit) from the same starts returns what the first found: the same
search would find it again where it ends by its work, and where it ends by the clock the
first answer is as valid an answer (the memory fit checks every plan's whole step on its own
mode's problem, so a mode whose whole step differs still goes its own way from there).

:func:`remembering` opens the memo for a planning call (nested calls share the outer one's)
and drops it at the end; forked workers inherit it as it stands when they start.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import ParamSpec, TypeVar

from autopar.solver import Problem, Solution

P = ParamSpec("P")
R = TypeVar("R")

# a remembered answer serves a request for at most this many times the seconds it was given
# (one solved in a moment cut short by a deadline is not what a longer search would give)
_MORE_TIME = 2.0

_memo: dict[tuple, tuple[float, Solution]] | None = None


@contextmanager
def remembering() -> Iterator[None]:
    """Solves in this block are remembered (:func:`solved`); the outermost block forgets
    them at its end."""
    global _memo
    outer = _memo is not None
    if not outer:
        _memo = {}
    try:
        yield
    finally:
        if not outer:
            _memo = None


def remembered(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` with its whole call inside :func:`remembering`."""
    @functools.wraps(fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        with remembering():
            return fn(*args, **kwargs)
    return call


def content_key(problem: Problem) -> bytes:
    """A digest of everything a solve reads of ``problem`` (not its names)."""
    ix = problem.index
    h = hashlib.blake2b(digest_size=16)
    h.update(repr(problem.usage_limit).encode())
    for a in (ix.n_strat, ix.cost_flat, ix.usage_flat, ix.start, ix.end, ix.edge_u, ix.edge_v,
              ix.edge_flat):
        h.update(a.tobytes())
        h.update(b"|")
    return h.digest()


def solved(problem: Problem, starts: list, how: tuple, time_limit_s: float,
           solve: Callable[[], Solution]) -> Solution:
    """``solve()``, or what it returned before for the same problem content, the same
    ``starts`` (assignments) and ``how`` (the solve's other settings), given at least
    1 / ``_MORE_TIME`` of ``time_limit_s``. Outside :func:`remembering`, ``solve()``."""
    if _memo is None:
        return solve()
    key = (content_key(problem), tuple(tuple(int(x) for x in s) for s in starts), how)
    hit = _memo.get(key)
    if hit is not None and hit[0] * _MORE_TIME >= time_limit_s:
        return hit[1]
    sol = solve()
    if hit is None or hit[0] < time_limit_s:
        _memo[key] = (time_limit_s, sol)
    return sol


__all__ = ["content_key", "remembered", "remembering", "solved"]
