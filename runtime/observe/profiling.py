"""The measured timeline: one step under ``torch.profiler``, ranges named as the predicted trace.

:class:`StepProfiler` (``autopar train --profile DIR``; ``parallelize(..., profile=DIR)``,
which profiles the second call's forward and backward, :func:`arm`; or a step of your own
inside ``with profile_step(model, DIR):``) runs ``torch.profiler`` (CPU activities, and CUDA
on a CUDA mesh) around one training step, and writes this rank's Chrome trace to
``DIR/trace_rank{r}.json``. While it is on:

- each phase of the per-rank program is written out once more with ``record_function``
  ranges around its units, named by :func:`autopar.report.trace_events.unit_names` over the same graph
  nodes the predicted trace walks (``forward layer 3``, ``backward layer 3``, ``recompute
  layer 3``, ``forward``, ...). A run of steps Inductor fused (``compile=True``) is counted in
  the unit where it starts;
- every collective the rank's :class:`~autopar.runtime.redistribute.Comm` issues is a range
  named by :func:`autopar.report.trace_events.collective_name` (``all_reduce[dp] gradient sync``). It
  nests in the unit that issued it; an asynchronous one (gradient buckets, the loss) covers
  its launch only, the wait shows where the step waits for it.

Off, nothing of this runs: the program is the usual one (the lowered graph's cache is keyed by
the module flag :data:`ACTIVE`, read once per phase), and the comm keeps its own class.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.autograd.profiler import record_function

from autopar.passes.cost.cost_model import axes_label
from autopar.report.trace_events import collective_name, unit_names
from autopar.runtime.redistribute import Comm

ACTIVE = False  # read by LoweredGraph._run once per phase


class UnitMarker:
    """Closes the open unit range and opens the next; the generated program calls it where
    the unit changes (``M('forward layer 0')``) and with None at the phase's end."""

    __slots__ = ("_open",)

    def __init__(self) -> None:
        self._open: Any = None

    def __call__(self, name: str | None) -> None:
        if self._open is not None:
            self._open.__exit__(None, None, None)
            self._open = None
        if name is not None:
            self._open = record_function(name)
            self._open.__enter__()


def unit_marks(steps: list[Any]) -> dict[int, str]:
    """Step index -> the unit that starts there (a phase's steps, as :mod:`.step_code` runs
    them)."""
    names = unit_names([s.node for s in steps])
    marks: dict[int, str] = {}
    prev = None
    for k, name in enumerate(names):
        if name is not None and name != prev:
            marks[k] = name
            prev = name
    return marks


class ProfiledComm(Comm):
    """A :class:`Comm` whose every collective is a ``record_function`` range. A rank's comm
    takes this class only while a step is profiled (no state of its own: the swap is safe)."""

    def _name(self, kind: str, ax: int, reason: str) -> str:
        return collective_name(kind, self.axes[ax], reason)

    def all_gather(self, t: torch.Tensor, dim: int, ax: int, reason: str) -> torch.Tensor:
        with record_function(self._name("all_gather", ax, reason)):
            return super().all_gather(t, dim, ax, reason)

    def all_reduce(self, t: torch.Tensor, op: str, ax: int, reason: str) -> torch.Tensor:
        with record_function(self._name("all_reduce", ax, reason)):
            return super().all_reduce(t, op, ax, reason)

    def reduce_scatter(self, t: torch.Tensor, op: str, dim: int, ax: int,
                       reason: str) -> torch.Tensor:
        with record_function(self._name("reduce_scatter", ax, reason)):
            return super().reduce_scatter(t, op, dim, ax, reason)

    def start_all_reduce(self, t: torch.Tensor, ax: int, reason: str) -> Any:
        with record_function(self._name("all_reduce", ax, reason)):
            return super().start_all_reduce(t, ax, reason)

    def sum_over(self, t: torch.Tensor, axes: tuple[int, ...], reason: str) -> torch.Tensor:
        with record_function(collective_name("all_reduce", axes_label(self.axes, axes), reason)):
            return super().sum_over(t, axes, reason)

    def start_sum(self, t: torch.Tensor, axes: tuple[int, ...], reason: str
                  ) -> tuple[torch.Tensor, Any]:
        if len(axes) > 1 and axes in self.merged:  # one collective: one range
            name = collective_name("all_reduce", axes_label(self.axes, axes), reason)
            with record_function(name):
                return super().start_sum(t, axes, reason)
        return super().start_sum(t, axes, reason)  # through the methods above

    def start_reduce_scatter(self, t: torch.Tensor, ax: int, reason: str) -> tuple[Any, Any]:
        with record_function(self._name("reduce_scatter", ax, reason)):
            return super().start_reduce_scatter(t, ax, reason)

    def all_to_all(self, t: torch.Tensor, src_dim: int, dst_dim: int, ax: int,
                   reason: str) -> torch.Tensor:
        with record_function(self._name("all_to_all", ax, reason)):
            return super().all_to_all(t, src_dim, dst_dim, ax, reason)


class StepProfiler:
    """Profile what runs between :meth:`start` and :meth:`stop` (one step) of a parallelized
    ``model`` and write this rank's trace into ``out_dir`` (``trace_rank{r}.json``)."""

    def __init__(self, model: Any, out_dir: str | Path, rank: int | None = None) -> None:
        self.model = model
        self.out_dir = Path(out_dir)
        if rank is None:
            import torch.distributed as dist

            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.rank = rank
        self.path = self.out_dir / f"trace_rank{rank}.json"
        self._prof: Any = None
        self._comm_class: Any = None

    def start(self) -> None:
        global ACTIVE
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        device = getattr(self.model, "_device", None)
        if device is not None and device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._prof = profile(activities=activities)
        self._prof.start()
        comm = getattr(self.model, "_comm", None)
        if comm is not None:
            self._comm_class = comm.__class__
            comm.__class__ = ProfiledComm
        ACTIVE = True

    def stop(self) -> Path:
        global ACTIVE
        ACTIVE = False
        comm = getattr(self.model, "_comm", None)
        if comm is not None and self._comm_class is not None:
            comm.__class__ = self._comm_class
        if torch.cuda.is_available() and getattr(self.model, "_device", None) is not None \
                and self.model._device.type == "cuda":
            torch.cuda.synchronize()
        self._prof.stop()
        self._prof.export_chrome_trace(str(self.path))
        return self.path

    def __enter__(self) -> StepProfiler:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class ProgramWarmUp:
    """A step run with the profiled program but no profiler: with ``compile=True`` the
    profiled program's Inductor runs compile here, not in the step measured."""

    def start(self) -> None:
        global ACTIVE
        ACTIVE = True

    def stop(self) -> None:
        global ACTIVE
        ACTIVE = False


class ArmedProfile:
    """``parallelize(..., profile=DIR)``: the model's training call number ``step`` (from 0:
    forward and backward) is profiled; the module calls :meth:`forward_starts` at each
    forward with gradients on and :meth:`backward_done` at the end of each backward."""

    def __init__(self, out_dir: str | Path, step: int = 1) -> None:
        self.out_dir = out_dir
        self.step = step
        self.calls = 0
        self.profiler: StepProfiler | None = None

    def forward_starts(self, model: Any) -> None:
        if self.calls == self.step and self.profiler is None:
            self.profiler = StepProfiler(model, self.out_dir)
            self.profiler.start()
        self.calls += 1

    def backward_done(self, model: Any) -> None:
        if self.profiler is not None:
            self.profiler.stop()
            model._profile = None  # done: the hot path's checks see None from now on


def arm(model: Any, out_dir: str | Path, mesh: Any, step: int = 1) -> None:
    """Profile ``model``'s training call ``step`` (see :class:`ArmedProfile`); rank 0 writes
    the plan's predicted step to ``out_dir/predicted.json`` now (``mesh``: the
    :class:`autopar.Mesh` it was planned on)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        write_predicted(model, out_dir, mesh)
    model._profile = ArmedProfile(out_dir, step)


def write_predicted(model: Any, out_dir: str | Path, mesh: Any) -> Path:
    """The predicted step of the plan ``model`` runs, as ``out_dir/predicted.json``."""
    from autopar.report.timeline import planned_from_plan, write_timeline

    path = Path(out_dir) / "predicted.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_timeline(planned_from_plan(model.graph, model.plan, mesh), path)
    return path


def profile_step(model: Any, out_dir: str | Path, rank: int | None = None) -> StepProfiler:
    """``with profile_step(model, DIR): loss = model(x, y); loss.backward(); opt.step()``:
    that step's trace in ``DIR/trace_rank{r}.json`` (see the module docstring)."""
    return StepProfiler(model, out_dir, rank)
