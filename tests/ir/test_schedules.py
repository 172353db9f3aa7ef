"""The one table of pipeline schedules (``autopar.ir.schedules``): torch's classes, every
accepted spelling, and the stage placement torch's schedules assume."""

from __future__ import annotations

import pytest

from autopar.ir.errors import PlanError
from autopar.ir.schedules import (
    SCHEDULE_TABLE,
    SCHEDULES,
    canonical_name,
    schedule,
    stage_placement,
    stage_rank,
)


def test_every_schedule_names_torchs_class() -> None:
    for info in SCHEDULE_TABLE:
        assert info.torch_class().__name__ == f"Schedule{info.name}"
        # torch's own multi-stage base class where a rank holds several stages
        from torch.distributed.pipelining.schedules import PipelineScheduleSingle

        assert issubclass(info.torch_class(), PipelineScheduleSingle) == info.single_stage


@pytest.mark.parametrize("spelling, name", [
    ("zbv", "ZBVZeroBubble"), ("ZBV", "ZBVZeroBubble"), ("zbvzerobubble", "ZBVZeroBubble"),
    ("dualpipev", "DualPipeV"), ("interleaved", "Interleaved1F1B"),
    ("interleaved_1f1b", "Interleaved1F1B"), ("interleaved-1f1b", "Interleaved1F1B"),
    ("interleaved_zb", "InterleavedZeroBubble"), ("looped_bfs", "LoopedBFS"),
    ("gpipe", "GPipe"), ("1f1b", "1F1B"), ("1F1B", "1F1B")])
def test_every_spelling_resolves_through_the_table(spelling: str, name: str) -> None:
    assert canonical_name(spelling) == name
    assert schedule(name).key == schedule(spelling).key


def test_an_unknown_schedule_names_every_known_one() -> None:
    with pytest.raises(PlanError, match="unknown pipeline schedule 'pipedream': use one of "
                                        "GPipe, 1F1B.*1f1b.*zbv"):
        schedule("pipedream")
    assert SCHEDULES[:2] == ("GPipe", "1F1B")


def test_split_backward_and_placement() -> None:
    split = {s.name for s in SCHEDULE_TABLE if s.splits_backward}
    assert split == {"InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"}
    assert {s.name for s in SCHEDULE_TABLE if s.v_shaped} == {"ZBVZeroBubble", "DualPipeV"}
    assert [stage_rank("zbv", 2, s) for s in range(4)] == [0, 1, 1, 0]
    assert [stage_rank("Interleaved1F1B", 2, s) for s in range(4)] == [0, 1, 0, 1]


def test_stage_placement_is_torchs() -> None:
    """Our placement must be the one torch's schedules assume (theirs is private: if torch
    changes it, this fails before a pipeline hangs on a message to the wrong rank)."""
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    for pp in (1, 2, 3, 4):
        for virtual in (1, 2, 3):
            for style in ("loop", "v"):
                assert stage_placement(pp, pp * virtual, style) == \
                    generate_stage_to_rank_mapping(pp, pp * virtual, style=style)
                name = "ZBVZeroBubble" if style == "v" else "Interleaved1F1B"
                assert [stage_rank(name, pp, s) for s in range(pp * virtual)] == \
                    [stage_placement(pp, pp * virtual, style)[s] for s in range(pp * virtual)]
    assert stage_placement(2, 4, "v") == {0: 0, 1: 1, 2: 1, 3: 0}

