"""The planner's modes are values; their labels are the strings tables and messages show."""

from __future__ import annotations

import pytest

from autopar.ir.errors import PlanError
from autopar.planning.modes import Mode, candidate_modes


def test_the_planner_modes_read_as_their_labels():
    for label in ("none", "none+zero3", "full+zero3+offload", "selective+zero1"):
        assert Mode.parse(label).label == label
    assert Mode("full", regather=True).offloaded().base == Mode.parse("full+zero3")
    assert Mode.parse("full+zero3").plain == Mode.parse("none+zero3")
    assert [m.label for m in candidate_modes("full", "auto")] == ["full+zero3"]
    with pytest.raises(PlanError, match=r"unknown part 'zero4' of planner mode 'none\+zero4'"):
        Mode.parse("none+zero4")
