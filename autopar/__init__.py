"""autopar: a compiler-style auto-parallelizer for PyTorch.

Trace a single-device model into its joint forward+backward graph, choose how every tensor is
split across a device mesh by solving an ILP over per-op costs, and run the result on
torch.distributed.
"""

from autopar.ir.devices import PROFILES, DeviceProfile, get_profile
from autopar.ir.errors import AutoparError, CaptureError, MeshError, PlanError
from autopar.ir.mesh import Mesh
from autopar.ir.placements import Partial, R, Replicate, S, Shard

__version__ = "0.1.0"

__all__ = [
    "PROFILES", "AutoparError", "CaptureError", "DeviceProfile", "Mesh", "MeshError",
    "Partial", "PlanError", "R", "Replicate", "S", "Shard", "get_profile", "parallelize",
]


def __getattr__(name: str) -> object:
    # parallelize brings in the runtime (torch.distributed, DTensor: about a second of
    # imports) that `autopar plan` and `autopar solve` never use; it loads on first use
    if name == "parallelize":
        from autopar.api import parallelize

        return parallelize
    raise AttributeError(f"module 'autopar' has no attribute {name!r}")
