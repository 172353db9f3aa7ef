"""Independent planning jobs side by side in forked processes (``autopar plan --compare``).

Completing a reference layout is a solve of its own, independent of the others, and
``--compare`` completes up to eight of them: on a machine with several cores they run in
forked children, which inherit the problem they solve (nothing but the job's index and its
small result cross a pipe). Only where forking is safe: the POSIX ``fork`` start method, and
no process group in this process (gloo's and NCCL's background threads may hold locks a forked
child would inherit held). The children touch numpy, the solver and meta tensors only; torch's
compute thread pool, which is not fork-safe once used, is not.

:func:`forked_map` is exact: each job computes what it would in this process.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from typing import Any

_JOB: tuple[Callable[[Any], Any], Sequence[Any]] | None = None  # what the children run


def default_workers() -> int:
    """The cores this process may use (``AUTOPAR_PLAN_WORKERS`` overrides; 1: no forking)."""
    env = os.environ.get("AUTOPAR_PLAN_WORKERS")
    if env:
        return max(1, int(env))
    return _cores()


def idle_cores(sample_s: float = 0.1) -> float | None:
    """Cores idle now: the machine's idle share over ``sample_s`` seconds (``/proc/stat``)
    times the cores this process may use; None where that cannot be read (not Linux). The
    load average lags by a minute, and counts this process's own planning just before."""
    try:
        before = _cpu_times()
        time.sleep(sample_s)
        after = _cpu_times()
    except (OSError, ValueError, IndexError):
        return None
    total = sum(after) - sum(before)
    if total <= 0:
        return None
    idle = (after[3] + after[4]) - (before[3] + before[4])  # idle and iowait
    return idle / total * _cores()


def usable_workers(workers: int) -> int:
    """``workers``, at most the cores idle now (at least one). A job forked onto a busy core
    only splits it with what runs there, and the planner's solves that stop by the clock
    then do part of their work: MoE at 0.35 of its peak (benchmarks/solver.py) on two
    workers, with the two cores busy with other work, found no plan that fits in its 30 s,
    where one process found its plan. ``AUTOPAR_PLAN_WORKERS`` set: ``workers`` as given."""
    if workers <= 1:
        return 1
    if os.environ.get("AUTOPAR_PLAN_WORKERS"):
        return workers  # the user's own count: taken as given, busy cores or not
    idle = idle_cores()
    return workers if idle is None else max(1, min(workers, int(idle + 0.5)))


def _cpu_times() -> list[int]:
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:]]


def _cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def forked_map(fn: Callable[[Any], Any], items: Sequence[Any], workers: int) -> list[Any]:
    """``[fn(x) for x in items]``, on up to ``workers`` forked processes where that is safe
    and there is more than one item; in this process otherwise."""
    global _JOB
    workers = min(workers, len(items))
    if workers <= 1 or not _fork_is_safe():
        return [fn(x) for x in items]
    _JOB = (fn, items)
    try:
        with _frozen(), multiprocessing.get_context("fork").Pool(workers) as pool:
            return pool.map(_run, range(len(items)), chunksize=1)
    finally:
        _JOB = None


# forks under way (_frozen), and whether the first of them froze the heap (not where it found
# objects frozen already: the caller's own gc.freeze, left as it is)
_FROZEN: list = [0, False]


@contextmanager
def _frozen():
    """The objects alive now left out of the garbage collector's passes while forked
    children live (``gc.freeze``, as Python's documentation advises before a fork): a full
    collection touches every object it scans, and a page a parent or child writes while
    both share it is copied. The planner's heap (the traced graph, torch, the problems) is
    hundreds of thousands of objects: on moe-tiny at 0.35 of its peak on two workers, the
    parent's three full collections while its children ran took 3.2 s, its children's
    0.4-0.6 s each."""
    if _FROZEN[0] == 0:
        _FROZEN[1] = gc.get_freeze_count() == 0
        if _FROZEN[1]:
            gc.freeze()
    _FROZEN[0] += 1
    try:
        yield
    finally:
        _FROZEN[0] -= 1
        if _FROZEN[0] == 0 and _FROZEN[1]:
            _FROZEN[1] = False
            gc.unfreeze()


class Ahead:
    """``fn()`` started now in a forked process, where forking is safe and ``workers`` > 1,
    for a result that may not be wanted (the planner's plan without a memory limit, needed
    only where the first mode's plan does not fit): :meth:`get` waits for it (or computes it
    here, where nothing was forked), :meth:`cancel` stops it unread.

    One plain process and a pipe, not a one-worker pool: a pool's ``terminate`` joins its
    task-handling thread, and once (benchmarks/solver.py, MoE at 0.35 of its peak, the
    first mode's plan fitting at once) that thread waited for ever on the task queue's lock
    of the worker just killed, and the planning call with it."""

    def __init__(self, fn: Callable[[], Any], workers: int) -> None:
        self._fn, self._proc, self._conn, self._frozen = fn, None, None, None
        if workers > 1 and _fork_is_safe():
            ctx = multiprocessing.get_context("fork")
            self._frozen = _frozen()
            self._frozen.__enter__()  # until the child is stopped (cancel)
            try:
                self._conn, send = ctx.Pipe(duplex=False)
                self._proc = ctx.Process(target=_send_result, args=(fn, send), daemon=True)
                self._proc.start()
                send.close()  # the child's end: the parent's read then ends where it dies
            except BaseException:
                self.cancel()
                raise

    def get(self, timeout_s: float | None = None) -> Any:
        """The result; computed here where the child has not sent it within ``timeout_s``
        or died without sending it (killed, by the memory limit say)."""
        if self._proc is None:
            return self._fn()
        assert self._conn is not None
        try:
            if self._conn.poll(timeout_s):
                ok, value = self._conn.recv()
                if not ok:
                    raise value
                return value
        except (EOFError, OSError):
            pass  # died without a word
        finally:
            self.cancel()
        return self._fn()

    def cancel(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join()
            self._proc = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._frozen is not None:
            frozen, self._frozen = self._frozen, None
            frozen.__exit__(None, None, None)


def _send_result(fn: Callable[[], Any], send: Any) -> None:
    """An :class:`Ahead` child: ``fn()``'s result, or the error it raised, sent back."""
    try:
        out = (True, fn())
    except BaseException as e:  # sent to the parent, which raises it
        out = (False, e)
    send.send(out)
    send.close()


def _run(k: int) -> Any:
    assert _JOB is not None
    fn, items = _JOB
    return fn(items[k])


def _fork_is_safe() -> bool:
    if "fork" not in multiprocessing.get_all_start_methods():
        return False
    if multiprocessing.current_process().daemon:
        return False  # a pool's worker (a forked mode, a shape) may not fork a pool of its own
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized())
