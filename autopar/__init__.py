"""autopar: a compiler-style auto-parallelizer for PyTorch.

Trace a single-device model into its joint forward+backward graph, choose how every tensor is
split across a device mesh by solving an ILP over per-op costs, and run the result on
torch.distributed. What a user needs is here:

- ``parallelize(model, mesh, example_inputs=...)``: the model, planned and ready to train;
- ``make_plan`` / ``plan_pipeline``: a plan without running anything; ``plan_table(plan)``
  prints it; ``Plan.load`` / ``plan.save`` read and write it;
- ``Options`` (and its groups ``MemoryOptions``, ``PrecisionOptions``, ``SearchOptions``,
  ``PipelineOptions``): what is asked of the planner, one frozen value
  (``Options.of(memory_budget=..., recompute="full")``); ``Mode``: a planner mode;
- ``Mesh`` (abstract: axis names, sizes, a device profile) and ``get_profile``;
- ``init_from_env()``: the process group from torchrun's variables;
- ``autopar.checkpoint``: ``save`` / ``load`` a run (model, optimizer, schedule, step, data
  position, random state) on any mesh, committed atomically;
- the errors, all ``AutoparError``: ``CaptureError``, ``PlanError``, ``MeshError``,
  ``CheckpointError``, ``LaunchError``.
"""

__version__ = "0.1.0"

# Every name loads on first use: `autopar solve` must not pay torch's import (seconds of a
# contest time limit), parallelize brings in the runtime (torch.distributed, DTensor) and the
# planners the solver; `import autopar` itself imports nothing heavy.
_LAZY = {
    **dict.fromkeys(["PROFILES", "DeviceProfile", "get_profile"], "autopar.ir.devices"),
    **dict.fromkeys(["AutoparError", "CaptureError", "CheckpointError", "MeshError",
                     "PlanError"], "autopar.ir.errors"),
    "Mesh": "autopar.ir.mesh",
    **dict.fromkeys(["MemoryOptions", "Options", "PipelineOptions", "PrecisionOptions",
                     "SearchOptions"], "autopar.ir.options"),
    **dict.fromkeys(["Partial", "R", "Replicate", "S", "Shard"], "autopar.ir.placements"),
    "Plan": "autopar.ir.plan",
    "plan_table": "autopar.report.table",
    "parallelize": "autopar.api",
    "make_plan": "autopar.planning.planner",
    "plan_pipeline": "autopar.planning.pipeline",
    "Mode": "autopar.planning.modes",
    "init_from_env": "autopar.runtime.launch",
    "LaunchError": "autopar.runtime.launch",
}

# submodules a user reaches as attributes of the package (``autopar.checkpoint.save``)
_SUBMODULES = ("checkpoint",)

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> object:
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"autopar.{name}")
    raise AttributeError(f"module 'autopar' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY, *_SUBMODULES])
