"""What a user may ask of the planner, as one frozen value: :class:`Options`.

The options fall in four groups, each a frozen dataclass validated when it is made (an error
names the bad value and the valid ones):

- :class:`MemoryOptions`: the per-device memory budget, activation recomputation, the ZeRO
  stage of parameters stored split, optimizer state offloaded to the host;
- :class:`PrecisionOptions`: the compute dtype and the gradients' reduction dtype;
- :class:`SearchOptions`: the solver's time limit, the margin the solver's own plan must win
  by over a reference layout, the worker processes, the layers traced of a deep model;
- :class:`PipelineOptions`: a pipeline's schedule, microbatches and stages per rank.

``Options.of(memory_budget=..., recompute="full")`` builds one from the flat keywords
:func:`autopar.parallelize`, the CLI and the planners have always taken (:data:`FLAT` lists
them); ``options.replace(recompute="none")`` is a copy with some changed, and
``options.flat()`` the keywords back. This module is the one home of those names, their
defaults and the vocabularies they are checked against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from dataclasses import replace as _replace
from typing import Any

from autopar.ir.errors import PlanError
from autopar.ir.precision import DTYPES, Precision, short_name
from autopar.ir.schedules import canonical_name

RECOMPUTE_MODES = ("auto", "none", "selective", "full")
FIXED_RECOMPUTE_MODES = ("none", "selective", "full")  # what a plan records as applied
ZERO_STAGES = ("auto", "1", "2", "3")
OFFLOAD_MODES = ("auto", "none", "optimizer")
# the solver's own plan must beat the best reference layout by this fraction to replace it
MIN_GAIN = 0.01
TIME_LIMIT_S = 30.0
# a mesh-shape search's limit per shape where no limit is set for the whole search
# (autopar.planning.shapes)
SHAPE_LIMIT_S = 120.0


def check_recompute(mode: str) -> str:
    if mode not in RECOMPUTE_MODES:
        raise PlanError(f"unknown recompute mode {mode!r}: use one of {', '.join(RECOMPUTE_MODES)}")
    return mode


def check_stage(stage: str | int) -> str:
    """The ZeRO stage as text (``"auto"``, ``"1"``, ``"2"``, ``"3"``)."""
    text = str(stage)
    if text not in ZERO_STAGES:
        raise PlanError(f"unknown ZeRO stage {stage!r}: use auto, 1, 2 or 3 (stage 0, data "
                        "parallel, is a placement: the solver picks it where it is best)")
    return text


def check_offload(mode: str) -> str:
    if mode not in OFFLOAD_MODES:
        raise PlanError(f"unknown offload mode {mode!r}: use one of {', '.join(OFFLOAD_MODES)}")
    return mode


def fits_budget(mem_bytes: float, budget: float | None) -> bool:
    """Whether ``mem_bytes`` fits ``budget`` (None: no limit), within a part in a billion
    (sums of the same bytes in another order)."""
    return budget is None or mem_bytes <= budget * (1 + 1e-9)


def check_budget(budget: float | None) -> float | None:
    """Bytes per device: positive, ``math.inf`` for no limit, None for the device's own."""
    if budget is None:
        return None
    try:
        value = float(budget)
    except (TypeError, ValueError):
        raise PlanError(f"memory budget {budget!r}: give a number of bytes per device, e.g. "
                        "80 * 2**30, math.inf for no limit, or None for the device's") from None
    if not value > 0:  # nan and negatives too
        raise PlanError(f"memory budget {value:g} bytes: give a positive size, e.g. 80GiB")
    return value


def _check_dtype(what: str, name: Any) -> Any:
    if name is None or isinstance(name, Precision):
        return name
    short = short_name(name)
    if short not in DTYPES:
        raise PlanError(f"unknown {what} {name!r}: use one of {', '.join(DTYPES)}")
    return short


def _check_count(what: str, n: int | None, least: int = 1) -> int | None:
    if n is None:
        return None
    if isinstance(n, bool) or not isinstance(n, int) or n < least:
        raise PlanError(f"{what} must be a whole number of at least {least} (or None), got {n!r}")
    return n


@dataclass(frozen=True, slots=True)
class MemoryOptions:
    """``budget``: bytes per device the plan must fit (None: the device profile's capacity less
    a reserve; ``math.inf``: no limit). ``recompute``: ``auto`` (only where the plan would not
    fit otherwise), ``none``, ``selective``, ``full``. ``zero``: the ZeRO stage of parameters
    the plan stores split (``auto``, ``1``, ``2``, ``3``; an int is taken). ``offload``:
    optimizer state on the host (``auto``: only where nothing fits without; ``none``;
    ``optimizer``)."""

    budget: float | None = None
    recompute: str = "auto"
    zero: str = "auto"
    offload: str = "auto"

    def __post_init__(self) -> None:
        object.__setattr__(self, "budget", check_budget(self.budget))
        check_recompute(self.recompute)
        object.__setattr__(self, "zero", check_stage(self.zero))
        check_offload(self.offload)


@dataclass(frozen=True, slots=True)
class PrecisionOptions:
    """``compute``: ``fp32``, ``bf16``, ``fp16`` or a :class:`~autopar.ir.precision.Precision`
    (None: the device profile's default, bf16 on GPUs, fp32 on ``cpu``); torch's names
    (``bfloat16``) are taken. ``reduce``: the dtype gradients are summed across ranks in
    (None: fp32)."""

    compute: str | Precision | None = None
    reduce: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "compute", _check_dtype("precision", self.compute))
        if isinstance(self.reduce, Precision):
            raise PlanError(f"reduce dtype {self.reduce!r}: give a dtype name, one of "
                            f"{', '.join(DTYPES)}")
        object.__setattr__(self, "reduce", _check_dtype("reduce dtype", self.reduce))


@dataclass(frozen=True, slots=True)
class SearchOptions:
    """``time_limit_s``: seconds the whole planning call may take (every mode, reference
    layout, memory fit, pipeline and mesh-shape search; tracing included); at the limit the
    best plan found so far is returned and its provenance says the limit cut the search.
    ``min_gain``: the solver's own plan replaces the best reference layout only when
    predicted at least this fraction faster. ``workers``: forked processes reference
    layouts, mesh shapes and the planner's modes after the first are planned on.
    ``max_layers``: trace a deeper model as a proxy of that many layers (None: every one).
    ``deadline``: the running call's
    :class:`~autopar.ir.deadline.Deadline` (set by the planner where the call starts; not an
    option a user gives, and not compared)."""

    time_limit_s: float = TIME_LIMIT_S
    min_gain: float = MIN_GAIN
    workers: int = 1
    max_layers: int | None = None
    deadline: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        t = self.time_limit_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise PlanError(f"time limit {t!r}: give a positive number of seconds")
        object.__setattr__(self, "time_limit_s", float(t))
        g = self.min_gain
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not (
                0 <= g and math.isfinite(g)):
            raise PlanError(f"min_gain {g!r}: give a fraction >= 0, e.g. {MIN_GAIN}")
        object.__setattr__(self, "min_gain", float(g))
        _check_count("workers", self.workers)
        _check_count("max_layers", self.max_layers)


@dataclass(frozen=True, slots=True)
class PipelineOptions:
    """A mesh with a ``pp`` axis: ``schedule`` (torch's name, e.g. ``1F1B``,
    ``ZBVZeroBubble``, or a short name of :mod:`autopar.ir.schedules`; ``auto`` is None),
    ``microbatches`` per step and ``virtual`` stages per rank; None leaves each to the
    planner."""

    schedule: str | None = None
    microbatches: int | None = None
    virtual: int | None = None

    def __post_init__(self) -> None:
        if self.schedule is not None and not isinstance(self.schedule, str):
            raise PlanError(f"pipeline schedule {self.schedule!r}: give a schedule's name")
        if self.schedule not in (None, "auto"):
            canonical_name(self.schedule)  # an unknown name: refused, naming the known ones
        _check_count("microbatches", self.microbatches)
        _check_count("virtual", self.virtual)

    @property
    def fixed(self) -> bool:
        """Whether any pipeline choice is fixed (then a mesh needs a ``pp`` axis)."""
        return (self.schedule, self.microbatches, self.virtual) != (None, None, None)


# flat keyword -> (group, field): the names parallelize, the planners and the CLI take
FLAT: dict[str, tuple[str, str]] = {
    "memory_budget": ("memory", "budget"),
    "recompute": ("memory", "recompute"),
    "zero": ("memory", "zero"),
    "offload": ("memory", "offload"),
    "precision": ("precision", "compute"),
    "reduce_dtype": ("precision", "reduce"),
    "time_limit_s": ("search", "time_limit_s"),
    "min_gain": ("search", "min_gain"),
    "workers": ("search", "workers"),
    "max_layers": ("search", "max_layers"),
    "schedule": ("pipeline", "schedule"),
    "microbatches": ("pipeline", "microbatches"),
    "virtual": ("pipeline", "virtual"),
}


@dataclass(frozen=True, slots=True)
class Options:
    """Everything a user may ask of the planner, in four groups (module docstring):
    ``memory`` (:class:`MemoryOptions`), ``precision`` (:class:`PrecisionOptions`), ``search``
    (:class:`SearchOptions`) and ``pipeline`` (:class:`PipelineOptions`). Frozen and
    validated; ``Options()`` is every default.

    Example::

        opts = Options.of(memory_budget=40 * 2**30, recompute="full", precision="bf16")
        opts.memory.recompute                     # "full"
        quick = opts.replace(time_limit_s=1.0)    # a copy, one option changed
    """

    memory: MemoryOptions = field(default_factory=MemoryOptions)
    precision: PrecisionOptions = field(default_factory=PrecisionOptions)
    search: SearchOptions = field(default_factory=SearchOptions)
    pipeline: PipelineOptions = field(default_factory=PipelineOptions)

    @classmethod
    def of(cls, options: Options | None = None, /, **flat: Any) -> Options:
        """Options from the flat keywords (:data:`FLAT`), over ``options`` where given (else
        the defaults). An unknown keyword raises TypeError naming the valid ones."""
        base = options if options is not None else cls()
        return base.replace(**flat) if flat else base

    def replace(self, **flat: Any) -> Options:
        """A copy with the flat keywords given changed (``dataclasses.replace`` by name)."""
        unknown = sorted(set(flat) - set(FLAT))
        if unknown:
            raise TypeError(f"unknown option{'s' if len(unknown) > 1 else ''} "
                            f"{', '.join(unknown)}: autopar's options are {', '.join(FLAT)}")
        groups: dict[str, dict[str, Any]] = {}
        for name, value in flat.items():
            group, fld = FLAT[name]
            groups.setdefault(group, {})[fld] = value
        return _replace(self, **{g: _replace(getattr(self, g), **kw) for g, kw in groups.items()})

    def flat(self) -> dict[str, Any]:
        """The flat keywords: ``Options.of(**o.flat()) == o``."""
        return {name: getattr(getattr(self, g), f) for name, (g, f) in FLAT.items()}

    def with_deadline(self, progress: Any = None) -> Options:
        """These options with a :class:`~autopar.ir.deadline.Deadline` of ``time_limit_s``
        starting now, where they carry none yet (a planning call's entry point calls this;
        a call inside another keeps the outer one's). ``progress``: the deadline's display
        (see :mod:`autopar.ir.deadline`)."""
        if self.search.deadline is not None:
            return self
        from autopar.ir.deadline import Deadline

        dl = Deadline(self.search.time_limit_s, progress)
        return _replace(self, search=_replace(self.search, deadline=dl))

    def resolved_precision(self, device: Any) -> Precision:
        """The plan's precision on ``device`` (its default where none was asked)."""
        from autopar.ir.precision import resolve

        return resolve(self.precision.compute, device, self.precision.reduce)


def split_options(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``kwargs`` parted into the flat option keywords and the rest."""
    opts = {k: v for k, v in kwargs.items() if k in FLAT}
    return opts, {k: v for k, v in kwargs.items() if k not in FLAT}


__all__ = ["FLAT", "MemoryOptions", "Options", "PipelineOptions", "PrecisionOptions",
           "SearchOptions", "check_budget", "check_offload", "check_recompute", "check_stage",
           "split_options"]
