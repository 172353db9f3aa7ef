"""A pipeline's mesh: its ``pp`` axis and the stage submesh the other axes make."""

from __future__ import annotations

from autopar.ir.mesh import Mesh


def pipeline_axis(mesh: Mesh) -> int | None:
    """Index of the mesh's pipeline axis (named ``pp``), None where it has none of size > 1."""
    i = mesh.axes.index("pp") if "pp" in mesh.axes else None
    return i if i is not None and mesh.shape[i] > 1 else None


def stage_mesh(mesh: Mesh, axis: int) -> Mesh:
    """The mesh less its pipeline axis, each other axis with its own link."""
    keep = [i for i in range(mesh.ndim) if i != axis]
    if not keep:
        return Mesh((1,), ("dp",), mesh.device)
    return Mesh(tuple(mesh.shape[i] for i in keep), tuple(mesh.axes[i] for i in keep),
                mesh.device, tuple(mesh.bandwidth[i] for i in keep),
                tuple(mesh.latency[i] for i in keep))
