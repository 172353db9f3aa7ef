"""Does a plan fit this program? Its collectives, re-derived on the traced tensors.

Tensor sizes enter the byte counts, so re-deriving :attr:`Plan.collectives` from the graph's
tensors catches a plan made for other parameter or activation shapes (a plan records node
names and specs, not every shape). It also tells how the plan priced gradient syncs: one
collective per gradient, or DDP-style buckets (:mod:`autopar.passes.cost.buckets`), which the
runtime then issues the same way.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from autopar.ir.errors import PlanError
from autopar.ir.mesh import Mesh

if TYPE_CHECKING:
    from autopar.runtime.lower import LoweredGraph

Totals = dict[tuple[str, str, str], list]


def grad_sync_mode(lowered: LoweredGraph) -> bool:
    """``True`` if the plan lists gradient syncs bucketed, ``False`` if one per gradient;
    :class:`PlanError` if its collectives fit this graph neither way."""
    listed = {(c.kind, c.axis, c.reason): [c.count, c.bytes] for c in lowered.plan.collectives}
    for bucketed in (False, True):
        if _same(predicted(lowered, bucketed), listed):
            return bucketed
    raise PlanError(
        "the plan's collectives do not match this model's tensors (it was made for other "
        "parameter or activation shapes, by an older autopar that batched collectives "
        "differently, or edited by hand); make a new plan for this model and these inputs "
        "(parallelize(..., plan=None))")


def predicted(lowered: LoweredGraph, bucketed: bool) -> Totals:
    """``(kind, axis, reason) -> [count, bytes]`` per step as the cost model prices it."""
    from autopar.passes.cost.buckets import bucket_collectives, sync_groups
    from autopar.passes.cost.cost_model import axes_label, reshard_collectives

    mesh = Mesh(lowered.mesh_shape, lowered.plan.mesh_axes, "cpu")
    merged = lowered.plan.merged_axes()  # as the plan was priced, whatever this mesh's links
    out: Totals = {}

    def add(kind: str, axis: str, reason: str, nbytes: float) -> None:
        slot = out.setdefault((kind, axis, reason), [0, 0.0])
        slot[0] += 1
        slot[1] += nbytes

    for meta, src, dst, reason in lowered.edges():
        if src != dst and meta is not None:
            for c in reshard_collectives(meta, src, dst, mesh, merged=merged):
                add(c.kind, c.axis, reason, c.bytes)
    for ax, nbytes in lowered.gather_collectives():
        add("all_gather", mesh.axes[ax], "parameter gather", nbytes)
    for group, kind in sync_groups(lowered.grad_moves(), mesh.shape, bucketed,
                                   lowered.plan.first_bucket_bytes):
        if kind is not None:
            for ckind, axes, nbytes in bucket_collectives(group, mesh.shape, merged):
                add(ckind, axes_label(mesh.axes, axes), "gradient sync", nbytes)
        else:
            for c in reshard_collectives(group[0].meta, group[0].src, group[0].dst, mesh,
                                         merged=merged):
                add(c.kind, c.axis, "gradient sync", c.bytes)
    return out


def _same(a: Totals, b: Totals) -> bool:
    return a.keys() == b.keys() and all(
        a[k][0] == b[k][0] and math.isclose(a[k][1], b[k][1], rel_tol=1e-9) for k in a)
