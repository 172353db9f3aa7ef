"""Which (pp, dp, tp) layouts of N devices are worth planning.

Tensor parallelism talks inside every layer (several collectives per block, forward and
backward), so its group must ride the node's fast fabric: ``tp`` divides the devices per node,
and tp is the innermost mesh axis, which ``Mesh`` gives the intra-node links (consecutive
ranks share a node under torchrun). Data parallelism talks once per step (gradients) and the
pipeline only at stage boundaries, so they can cross nodes. A pipeline cannot have more stages
than the model has layers to cut.

The candidates come in a fixed order (pp, then tp, ascending), so a search that scores them
and breaks ties by that order (:func:`autopar.planning.shapes.search_shapes`) is reproducible
run to run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.ir.devices import DeviceProfile, get_profile
from autopar.ir.errors import MeshError
from autopar.ir.mesh import Mesh

AXES = ("pp", "dp", "tp")


@dataclass(frozen=True, slots=True)
class MeshShape:
    pp: int
    dp: int
    tp: int

    @property
    def size(self) -> int:
        return self.pp * self.dp * self.tp

    def mesh(self, device: str | DeviceProfile = "h100") -> Mesh:
        """The whole mesh, axes ``("pp", "dp", "tp")``: tp innermost, on the node's links."""
        return Mesh((self.pp, self.dp, self.tp), AXES, device)

    def stage_mesh(self, device: str | DeviceProfile = "h100") -> Mesh:
        """One pipeline stage's submesh, ``("dp", "tp")``, with the links it has in the whole
        mesh (the inner axes' links do not depend on the pipeline axis outside them)."""
        return Mesh((self.dp, self.tp), AXES[1:], device)


def _positive(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise MeshError(f"{name} must be a positive integer, got {value!r}")
    return value


def mesh_shapes(
    n_devices: int,
    num_layers: int | None = None,
    device: str | DeviceProfile = "h100",
    devices_per_node: int | None = None,
) -> tuple[MeshShape, ...]:
    """Every ``pp * dp * tp == n_devices`` with ``tp`` dividing the node size (the device
    profile's ``devices_per_node`` unless given) and ``pp <= num_layers`` (when given), in
    order of pp, then tp."""
    n = _positive("the number of devices", n_devices)
    node = _positive("devices_per_node",
                     devices_per_node if devices_per_node is not None
                     else get_profile(device).devices_per_node)
    if num_layers is not None:
        _positive("the number of layers", num_layers)
    out = []
    for pp in _divisors(n):
        if num_layers is not None and pp > num_layers:
            break
        for tp in _divisors(n // pp):
            if node % tp == 0:
                out.append(MeshShape(pp, n // pp // tp, tp))
    return tuple(out)


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))
