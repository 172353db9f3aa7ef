"""What a pipeline stage runs as: one lowered program, or a plain module.

A stage whose layout splits something runs its intra-op plan as one program lowered on the
stage submesh (``runtime/pipeline/stage_program.py``). Under a schedule that splits the
backward, the program's lowered backward splits too (:func:`program_splits_backward`): the
steps its input's gradient needs in the input action, the weights' gradients in the weight
action. A stage that keeps every parameter and its optimizer state whole on a
``dp``-only submesh runs as a plain module replicated over ``dp``. The pipeline planner
prices the one (:mod:`autopar.passes.pipeline.stage_profile`) and the runtime builds it
(:mod:`autopar.runtime.pipeline.module`) from this one definition.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from autopar.ir.placements import R, Spec

if TYPE_CHECKING:
    from autopar.ir.plan import Plan


def runs_as_program(mesh_axes: Sequence[str], mesh_shape: Sequence[int],
                    param_specs: Iterable[Spec], zero1: bool) -> bool:
    """Whether a stage of this layout runs as one lowered program: a submesh axis other than
    ``dp`` of size > 1 (tensor parallelism), a parameter split over an axis, or ZeRO-1
    (optimizer state split over ``dp``)."""
    if zero1 or any(a != "dp" and n > 1 for a, n in zip(mesh_axes, mesh_shape)):
        return True
    return any(p != R for spec in param_specs for p in spec)


def program_splits_backward(gathers_in_backward: bool) -> bool:
    """Whether a stage program splits its backward into input and weight gradients: unless
    its backward gathers parameters (ZeRO-3 re-gathering), where each half would gather them
    again, collectives the plan did not price (``LoweredGraph._split_backward`` in
    ``runtime/lower.py``, which also keeps whole a backward whose input gradient needs a
    parameter's, which no layer does)."""
    return not gathers_in_backward


def plan_runs_as_program(plan: Plan) -> bool:
    """:func:`runs_as_program` of a pipeline plan's stages (every stage runs the layout the
    plan's placements give on the stage submesh)."""
    d = plan.decided
    return runs_as_program(d.mesh_axes, d.mesh_shape, d.params.values(),
                           d.param_state.zero1)
