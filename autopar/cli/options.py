"""The command line's side of :class:`autopar.Options`: the flags every subcommand that plans
shares (``plan``, ``train``), and parsed flags turned into one ``Options``.

Commands add the flags here to their parser and call :func:`options_from_args` on what it
parsed; the option names, defaults and checks themselves live in :mod:`autopar.ir.options`.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

from autopar.ir.errors import AutoparError
from autopar.ir.mesh import DATA_PARALLEL_AXES, Mesh
from autopar.ir.options import OFFLOAD_MODES, RECOMPUTE_MODES, ZERO_STAGES, Options
from autopar.ir.precision import DTYPES
from autopar.ir.schedules import SCHEDULE_TABLE

_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6,
          "mib": 2**20, "g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12,
          "tib": 2**40}


class UsageError(AutoparError):
    pass


def parse_bytes(text: str) -> float:
    if text.strip().lower() in ("none", "unlimited", "inf"):
        return float("inf")
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise UsageError(f"cannot read memory size {text!r}: write e.g. 80GiB, 40GB or 1.5e10")
    return float(m.group(1)) * _UNITS[m.group(2).lower()]


def check_batch(mesh: Mesh, batch: int) -> None:
    dp = mesh.data_parallel_size
    names = [f"{a}={n}" for a, n in zip(mesh.axes, mesh.shape) if a.lower() in DATA_PARALLEL_AXES]
    if dp > 1 and batch % dp:
        raise UsageError(
            f"batch {batch} cannot be split over the data-parallel axes {'x'.join(names)} "
            f"({dp} ways): use a batch that is a multiple of {dp}, or a smaller dp axis"
        )


def add_memory_options(p: argparse.ArgumentParser) -> None:
    """The precision and recomputation options ``plan`` and ``train`` share."""
    p.add_argument("--precision", choices=tuple(DTYPES),
                   help="compute dtype (default: bf16 on GPU device profiles, fp32 on cpu); "
                   "master weights and optimizer state stay fp32")
    p.add_argument("--reduce-dtype", choices=tuple(DTYPES),
                   help="dtype gradients are summed across ranks in (default fp32)")
    p.add_argument("--recompute", default="auto", choices=RECOMPUTE_MODES,
                   help="activation recomputation (default auto: only where the plan would "
                   "not fit otherwise)")
    p.add_argument("--zero", default="auto", choices=ZERO_STAGES,
                   help="ZeRO stage of the parameters the plan stores split: 3 gathers them "
                   "again in the backward, 2 keeps them gathered from the forward, 1 also "
                   "all-reduces whole gradients (default auto: 2 or 3, the faster that fits)")
    p.add_argument("--offload", default="auto", choices=OFFLOAD_MODES,
                   help="optimizer state in host memory (default auto: only where no plan "
                   "fits without; 'optimizer': every parameter's)")


def add_pipeline_options(p: argparse.ArgumentParser) -> None:
    """The pipeline choices ``plan`` and ``train`` share (a mesh with a ``pp`` axis)."""
    p.add_argument("--schedule", help="pipeline schedule: "
                   + ", ".join(f"{s.name} ({s.key})" for s in SCHEDULE_TABLE)
                   + " (default: the planner's choice)")
    p.add_argument("--microbatches", type=int, metavar="M",
                   help="microbatches per step (default: the planner's choice)")
    p.add_argument("--virtual", type=int, metavar="V",
                   help="pipeline stages per rank (default: the planner's choice)")


# parsed flag (argparse's dest) -> Options' flat keyword
_FLAGS = {"memory_budget": "memory_budget", "precision": "precision",
          "reduce_dtype": "reduce_dtype", "recompute": "recompute", "zero": "zero",
          "offload": "offload", "time_limit": "time_limit_s", "trace_layers": "max_layers",
          "schedule": "schedule", "microbatches": "microbatches", "virtual": "virtual"}


def options_from_args(args: argparse.Namespace, **overrides: Any) -> Options:
    """The :class:`~autopar.ir.options.Options` the parsed flags ask for (those a command
    has; the rest at their defaults), with ``overrides`` (flat keywords) on top:
    ``--memory-budget`` read as a size, ``--trace-layers 0`` as every layer."""
    flat: dict[str, Any] = {}
    for dest, name in _FLAGS.items():
        if not hasattr(args, dest):
            continue
        value = getattr(args, dest)
        if dest == "memory_budget":
            value = parse_bytes(value) if value else None
        elif dest == "trace_layers":
            value = value if value > 0 else None
        flat[name] = value
    flat.update(overrides)
    return Options.of(**flat)
