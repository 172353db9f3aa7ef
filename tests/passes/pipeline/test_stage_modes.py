"""Per-stage recomputation in the split DP: one stage profile per mode, each stage in the
fastest that fits its own microbatches in flight, the replay pricing each stage by its own.

A hand-worked case: 4 blocks on 2 ranks under 1F1B with 2 microbatches (stage 0 holds 2 in
flight, stage 1 holds 1). ``full`` recomputation: 4 s per block, 1 byte kept per block and
microbatch; ``none``: 3 s, 4 bytes. The splits (blocks on stage 0, stage 1):

- limit 8: ``none`` fits 2 blocks on stage 1 (2 * 4 * 1 = 8) but not on stage 0 (16), so
  (2, 2) runs ``full`` then ``none``: 8 s + 6 s, objective 14 + 1 * 8 = 22; (1, 3) and (3, 1)
  need 12 s on one stage (27); ``full`` throughout is (8, 8), 24. ``none`` alone fits nothing.
- limit 16: ``none`` fits both stages, (2, 2) runs it throughout.
- limit 4: ``none`` fits nowhere with two blocks, ``full`` throughout.
"""

from __future__ import annotations

import math

import pytest

from autopar.ir.errors import PlanError
from autopar.passes.pipeline.cost import Overheads, range_arrays, replay, weigh
from autopar.passes.pipeline.schedule import PipelineSchedule
from autopar.passes.pipeline.stage_profile import PartCost, StageProfile

SCHED = PipelineSchedule("1F1B", 2, 1, 2)
OVER = Overheads(0.0)


def _profile(fwd: float, bwd: float, kept: float, mode: str) -> StageProfile:
    block = PartCost(fwd, bwd, saved_bytes=kept, recompute_s=fwd if mode == "full" else 0.0)
    return StageProfile(PartCost(), block, PartCost(), 0.0, 0.5, recompute=mode)


FULL = _profile(1.0, 3.0, 1.0, "full")
NONE = _profile(1.0, 2.0, 4.0, "none")


@pytest.mark.parametrize("limit,modes", [
    (8.0, ("full", "none")), (16.0, ("none", "none")), (4.0, ("full", "full"))])
def test_each_stage_takes_the_fastest_mode_that_fits_it(limit: float, modes: tuple) -> None:
    opt = weigh(SCHED, [FULL, NONE], 4, limit, OVER)
    assert opt.split is not None
    assert opt.split.ranges == ((0, 2), (2, 4))
    assert tuple(p.recompute for p in opt.split.submeshes) == modes
    times = {"full": 8.0, "none": 6.0}
    assert opt.split.time_s == tuple(times[m] for m in modes)
    # the replay prices each stage by its own profile
    assert opt.step_s == replay(SCHED, opt.split.submeshes, opt.split.ranges, 4, OVER)[0]
    assert opt.split.memory_bytes[1] <= limit


def test_the_cheaper_mode_alone_fits_nothing_and_mixing_beats_the_leaner_alone() -> None:
    assert weigh(SCHED, NONE, 4, 8.0, OVER).split is None
    alone = weigh(SCHED, FULL, 4, 8.0, OVER)
    mixed = weigh(SCHED, [FULL, NONE], 4, 8.0, OVER)
    assert alone.split is not None and mixed.step_s < alone.step_s
    # the same step as pricing the stages by hand: stage 1 runs 2 s less per microbatch
    assert mixed.step_s == pytest.approx(replay(SCHED, [FULL, NONE], ((0, 2), (2, 4)), 4,
                                                OVER)[0])
    assert mixed.step_s < replay(SCHED, FULL, ((0, 2), (2, 4)), 4, OVER)[0]


def test_profiles_per_stage_must_match_the_stages() -> None:
    with pytest.raises(PlanError, match="3 stage profiles for 2 stages"):
        replay(SCHED, [FULL, NONE, FULL], ((0, 2), (2, 4)), 4, OVER)


def test_the_tabulated_ranges_are_the_chunk_costs() -> None:
    from autopar.passes.pipeline.cost import chunk_cost

    pre = PartCost(0.5, 1.0, state_bytes=7.0, saved_bytes=2.0, transient_bytes=9.0)
    post = PartCost(0.25, 2.0, state_bytes=3.0, saved_bytes=5.0, transient_bytes=1.0)
    block = PartCost(1.0, 2.0, state_bytes=1.0, saved_bytes=1.0, transient_bytes=4.0)
    prof = StageProfile(pre, block, post, 0.0, 0.5)
    table = range_arrays(prof, 5)
    for i in range(5):
        for j in range(i + 1, 6):
            fwd, bwd, _, held, kept = chunk_cost(prof, i, j, 5)
            assert (table.time[i, j], table.memory[i, j], table.activation[i, j]) == \
                (fwd + bwd, held, kept)
    assert math.isfinite(table.time[0, 5])
