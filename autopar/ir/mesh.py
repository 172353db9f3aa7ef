"""The abstract device mesh: axis names and sizes, a device profile, per-axis links.

A ``Mesh`` needs no processes, so a plan for 1,024 GPUs is made on a laptop. Each axis has a
bandwidth and a latency for the alpha-beta collective model. By default the innermost axes
that fit in one node (``devices_per_node``) ride the node's fabric (NVLink) and the outer ones
the network (InfiniBand), which is how torchrun ranks are laid out on real clusters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.ir.devices import DeviceProfile, get_profile
from autopar.ir.errors import MeshError

# axis names a batch is split over (data parallelism in its several spellings)
DATA_PARALLEL_AXES = ("dp", "data", "fsdp", "ddp", "batch")


@dataclass(frozen=True, slots=True)
class Mesh:
    shape: tuple[int, ...]
    axes: tuple[str, ...]
    device: DeviceProfile
    bandwidth: tuple[float, ...]  # bytes/s per device, per axis
    latency: tuple[float, ...]  # seconds per collective step, per axis

    def __init__(
        self,
        shape: tuple[int, ...] | list[int] | int,
        axes: tuple[str, ...] | list[str] | str | None = None,
        device: str | DeviceProfile = "h100",
        bandwidth: tuple[float, ...] | None = None,
        latency: tuple[float, ...] | None = None,
    ) -> None:
        shape = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
        if axes is None:
            axes = tuple(f"ax{i}" for i in range(len(shape)))
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        if len(axes) != len(shape):
            raise MeshError(
                f"mesh shape {shape} has {len(shape)} axes but {len(axes)} names {axes}: "
                "give one name per axis, e.g. Mesh((2, 4), ('dp', 'tp'))"
            )
        if len(set(axes)) != len(axes):
            raise MeshError(f"mesh axis names must differ, got {axes}")
        if not shape or any(s < 1 for s in shape):
            raise MeshError(f"mesh sizes must be positive integers, got {shape}")
        profile = get_profile(device)
        default_bw, default_lat = _default_links(shape, profile)
        bandwidth = tuple(bandwidth) if bandwidth is not None else default_bw
        latency = tuple(latency) if latency is not None else default_lat
        if len(bandwidth) != len(shape) or len(latency) != len(shape):
            raise MeshError("give one bandwidth and one latency per mesh axis")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "axes", axes)
        object.__setattr__(self, "device", profile)
        object.__setattr__(self, "bandwidth", tuple(float(b) for b in bandwidth))
        object.__setattr__(self, "latency", tuple(float(x) for x in latency))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def data_parallel_size(self) -> int:
        """The ways the batch is split: the product of the data-parallel axes' sizes."""
        return math.prod(n for a, n in zip(self.axes, self.shape)
                         if a.lower() in DATA_PARALLEL_AXES)

    def axis_index(self, axis: str | int) -> int:
        if isinstance(axis, int):
            return axis
        try:
            return self.axes.index(axis)
        except ValueError:
            raise MeshError(f"mesh has no axis {axis!r}; its axes are {self.axes}") from None

    def axis_size(self, axis: str | int) -> int:
        return self.shape[self.axis_index(axis)]

    def in_node(self, label: str) -> bool:
        """Whether a collective over the axes ``label`` names (``"tp"``, or ``"dp+tp"`` merged)
        stays inside one node: those axes and every axis after them (the inner ones) fill at
        most a node, as :func:`_default_links` lays them out."""
        first = min(self.axis_index(a) for a in label.split("+"))
        return math.prod(self.shape[first:]) <= self.device.devices_per_node

    def describe(self) -> str:
        return "x".join(f"{a}={n}" for a, n in zip(self.axes, self.shape)) + f" ({self.device.name})"

    @classmethod
    def parse(cls, text: str, device: str | DeviceProfile = "h100") -> Mesh:
        """``"dp=8,tp=8"`` -> Mesh((8, 8), ("dp", "tp")); ``"8"`` -> a 1-D mesh named ``dp``."""
        text = text.strip()
        if text.isdigit():
            return cls((int(text),), ("dp",), device)
        shape, axes = [], []
        for part in text.split(","):
            name, sep, size = part.partition("=")
            if not sep or not size.strip().isdigit() or not name.strip():
                raise MeshError(
                    f"cannot read mesh {text!r}: write axis=size pairs such as 'dp=8,tp=8'"
                )
            axes.append(name.strip())
            shape.append(int(size))
        return cls(tuple(shape), tuple(axes), device)

    @classmethod
    def from_device_mesh(cls, device_mesh, device: str | DeviceProfile | None = None) -> Mesh:
        """An abstract mesh with the shape and axis names of a torch ``DeviceMesh``."""
        names = device_mesh.mesh_dim_names or tuple(f"ax{i}" for i in range(device_mesh.ndim))
        if device is None:
            device = "cpu" if device_mesh.device_type == "cpu" else "h100"
        return cls(tuple(device_mesh.shape), tuple(names), device)


def _default_links(
    shape: tuple[int, ...], profile: DeviceProfile
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Each axis's link: the node's fabric where the axis and every axis inside it fit in a
    node, else the network. An axis that crosses nodes with ``k`` of its members in each node
    (the axes inside it fill less than a node) runs ``k`` rings side by side, each over its
    own NIC (NCCL's multi-rail rings: one NIC per GPU), so its bus bandwidth is ``k`` NICs'
    worth, at most the node's fabric."""
    bw, lat = [0.0] * len(shape), [0.0] * len(shape)
    node = profile.devices_per_node
    inner = 1
    for i in reversed(range(len(shape))):
        if inner * shape[i] <= node:
            bw[i], lat[i] = profile.intra_node_bandwidth, profile.intra_node_latency
        else:
            rails = max(1, min(shape[i], node // inner)) if inner < node else 1
            bw[i] = min(profile.intra_node_bandwidth, rails * profile.inter_node_bandwidth)
            lat[i] = profile.inter_node_latency
        inner *= shape[i]
    return tuple(bw), tuple(lat)
