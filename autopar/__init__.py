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

from autopar.ir.devices import PROFILES, DeviceProfile, get_profile
from autopar.ir.errors import AutoparError, CaptureError, CheckpointError, MeshError, PlanError
from autopar.ir.mesh import Mesh
from autopar.ir.options import (
    MemoryOptions,
    Options,
    PipelineOptions,
    PrecisionOptions,
    SearchOptions,
)
from autopar.ir.placements import Partial, R, Replicate, S, Shard
from autopar.ir.plan import Plan
from autopar.report.table import plan_table

__version__ = "0.1.0"

# parallelize and init_from_env bring in the runtime (torch.distributed, DTensor: about a
# second of imports) and the planners the solver; `autopar plan` and `autopar solve` load
# only what they use, so these load on first use
_LAZY = {
    "parallelize": "autopar.api",
    "make_plan": "autopar.planning.planner",
    "plan_pipeline": "autopar.planning.pipeline",
    "Mode": "autopar.planning.modes",
    "init_from_env": "autopar.runtime.launch",
    "LaunchError": "autopar.runtime.launch",
}

__all__ = [
    "PROFILES", "AutoparError", "CaptureError", "CheckpointError", "DeviceProfile", "LaunchError", "MemoryOptions",
    "Mesh", "MeshError", "Options", "Partial", "PipelineOptions", "Plan", "PlanError",
    "PrecisionOptions", "R", "Replicate", "S", "SearchOptions", "Shard", "get_profile",
    "plan_table", *_LAZY,
]


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'autopar' has no attribute {name!r}")
