"""What a pipeline stage runs as (``autopar.ir.stage_kind``): the one definition the
pipeline planner prices and the runtime builds."""

from __future__ import annotations

from autopar.ir.placements import R, S
from autopar.ir.stage_kind import runs_as_program


def test_a_stage_runs_as_a_program_where_its_layout_splits_something() -> None:
    whole = [(R, R), (R, R)]
    assert not runs_as_program(("dp",), (4,), [(R,), (R,)], zero1=False)
    assert not runs_as_program(("dp", "tp"), (2, 1), whole, zero1=False)  # tp of size 1
    assert runs_as_program(("dp", "tp"), (2, 2), whole, zero1=False)  # tensor parallel
    assert runs_as_program(("dp",), (4,), [(S(0),), (R,)], zero1=False)  # FSDP-style split
    assert runs_as_program(("dp",), (4,), [(R,)], zero1=True)  # optimizer state split
