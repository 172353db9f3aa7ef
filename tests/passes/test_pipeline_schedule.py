import math
from collections import Counter

import pytest

from autopar.errors import PlanError
from autopar.passes.pipeline_schedule import (
    SCHEDULES,
    PipelineSchedule,
    StageTime,
    canonical_name,
    events,
    rank_orders,
    simulate,
    textbook_bubble,
)

EQUAL = StageTime(1.0, 1.0, 1.0)  # forward 1, backward 2 (split 1 + 1)
LETTER = {"forward": "F", "backward": "B", "backward_input": "I", "backward_weight": "W"}

VALID = [("GPipe", 1, m) for m in (1, 3, 8)] + [("1F1B", 1, m) for m in (4, 5, 8)] + [
    ("Interleaved1F1B", v, m) for v in (1, 2, 3) for m in (1, 3, 4, 8, 12)] + [
    ("InterleavedZeroBubble", 2, m) for m in (1, 4, 8)] + [
    ("ZBVZeroBubble", 2, m) for m in (1, 2, 4, 7, 8, 9)] + [
    ("DualPipeV", 2, m) for m in (8, 9, 16)] + [("LoopedBFS", 2, m) for m in (3, 8)]


@pytest.mark.parametrize("name,v,m", VALID)
def test_every_order_runs_each_action_once_on_its_rank(name, v, m):
    # torch's own orders, built without a process group; fails loudly if torch changes them
    s = PipelineSchedule(name, 4, v, m)
    seen = Counter()
    for r, order in enumerate(rank_orders(s)):
        for a in order:
            assert s.stage_rank(a.stage) == r
            assert 0 <= a.microbatch < m
            seen[(a.stage, a.kind, a.microbatch)] += 1
    assert all(n == 1 for n in seen.values())
    for st in range(s.num_stages):
        for mb in range(m):
            assert seen[(st, "F", mb)] == 1
            assert seen[(st, "B", mb)] + seen[(st, "I", mb)] == 1
            assert seen[(st, "W", mb)] == seen[(st, "I", mb)]
    cost = simulate(s, EQUAL)  # no deadlock, sane numbers
    assert cost.step_s > 0 and 0 <= cost.bubble_fraction < 1
    assert all(math.isclose(b, 3 * m * v) for b in cost.busy_s)


@pytest.mark.parametrize("p,m", [(2, 2), (4, 4), (4, 8), (3, 7), (8, 32)])
def test_gpipe_and_1f1b_bubble_is_the_textbook_one_with_equal_stages(p, m):
    expected = (p - 1) / (m + p - 1)
    x = textbook_bubble(p, m)
    assert math.isclose(x / (1 + x), expected)
    for name in ("GPipe", "1F1B"):
        cost = simulate(PipelineSchedule(name, p, 1, m), EQUAL)
        assert math.isclose(cost.bubble_fraction, expected)
        assert math.isclose(cost.step_s, (m + p - 1) * 3.0)


def test_interleaving_lowers_the_bubble():
    p, m = 4, 8
    one = simulate(PipelineSchedule("1F1B", p, 1, m), StageTime(2.0, 2.0, 2.0))
    # the same work per rank in v=2 chunks of half the size
    inter = simulate(PipelineSchedule("Interleaved1F1B", p, 2, m), EQUAL)
    assert inter.bubble_fraction < one.bubble_fraction
    assert inter.step_s < one.step_s
    assert math.isclose(inter.bubble_fraction,
                        textbook_bubble(p, m, 2) / (1 + textbook_bubble(p, m, 2)))


def test_1f1b_holds_at_most_p_microbatches_and_gpipe_all_of_them():
    p, m = 4, 12
    one = simulate(PipelineSchedule("1F1B", p, 1, m), EQUAL)
    gpipe = simulate(PipelineSchedule("GPipe", p, 1, m), EQUAL)
    assert max(one.peak_in_flight) <= p
    assert one.peak_in_flight == (4, 3, 2, 1)
    assert gpipe.peak_in_flight == (m,) * p


def test_activation_bytes_follow_the_in_flight_count():
    t = StageTime(1.0, 2.0, activation_bytes=100.0)
    cost = simulate(PipelineSchedule("1F1B", 4, 1, 8), t)
    assert cost.peak_activation_bytes == (400.0, 300.0, 200.0, 100.0)


def test_zero_bubble_beats_1f1b_when_backward_is_split():
    p, m = 4, 8
    one = simulate(PipelineSchedule("1F1B", p, 1, m), StageTime(2.0, 2.0, 2.0))
    for name in ("ZBVZeroBubble", "DualPipeV", "InterleavedZeroBubble"):
        zb = simulate(PipelineSchedule(name, p, 2, m), EQUAL)
        assert zb.bubble_fraction < one.bubble_fraction / 2, name
        assert zb.step_s < one.step_s


@pytest.mark.parametrize("name,v,m", [("GPipe", 1, 6), ("1F1B", 1, 6), ("Interleaved1F1B", 2, 8),
                                      ("ZBVZeroBubble", 2, 8), ("DualPipeV", 2, 8)])
def test_step_time_is_monotone_in_stage_times(name, v, m):
    s = PipelineSchedule(name, 4, v, m)
    base = [StageTime(1.0, 1.0, 0.5, send_s=0.1) for _ in range(s.num_stages)]
    step = simulate(s, base).step_s
    for k in range(s.num_stages):
        for field in ("forward_s", "backward_input_s", "backward_weight_s", "send_s"):
            slower = list(base)
            t = slower[k]
            kwargs = {f: getattr(t, f) for f in t.__slots__}
            kwargs[field] += 0.7
            slower[k] = StageTime(**kwargs)
            assert simulate(s, slower).step_s >= step - 1e-12, (k, field)


def test_sends_delay_the_step_across_ranks_but_not_within_the_v_turn():
    s = PipelineSchedule("1F1B", 2, 1, 2)
    free = simulate(s, StageTime(1.0, 2.0)).step_s
    # the critical path crosses the boundary twice: the first forward, the last backward
    assert math.isclose(simulate(s, StageTime(1.0, 2.0, send_s=0.5)).step_s, free + 2 * 0.5)
    # one rank, V: stages 0 and 1 both live on rank 0, so nothing is sent
    v = PipelineSchedule("ZBVZeroBubble", 1, 2, 2)
    assert math.isclose(simulate(v, StageTime(1.0, 1.0, 1.0, send_s=5.0)).step_s, 12.0)


def test_events_tile_each_rank_and_carry_torch_names():
    s = PipelineSchedule("ZBVZeroBubble", 2, 2, 4)
    cost = simulate(s, StageTime(1.0, 1.0, 1.0, send_s=0.25))
    timeline = events(s, StageTime(1.0, 1.0, 1.0, send_s=0.25))
    assert len(timeline) == 2
    for r, evs in enumerate(timeline):
        lane = [e for e in evs if e.kind != "send"]
        assert lane[0].start_s == 0.0 and math.isclose(lane[-1].end_s, cost.step_s)
        for a, b in zip(lane, lane[1:]):
            assert math.isclose(a.end_s, b.start_s)
        idle = sum(e.duration_s for e in lane if e.kind == "idle")
        assert math.isclose(idle, cost.idle_s[r])
        kinds = {e.kind for e in evs}
        assert {"forward", "backward_input", "backward_weight", "send"} <= kinds
        for e in evs:
            if e.kind == "send":
                assert e.peer != r and "SEND_" in e.action
            elif e.kind != "idle":
                assert e.action == f"{e.stage}{LETTER[e.kind]}{e.microbatch}"


def test_v_schedules_place_stages_in_a_v():
    s = PipelineSchedule("DualPipeV", 4, 2, 8)
    assert [s.rank_stages(r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert PipelineSchedule("Interleaved1F1B", 4, 2, 8).rank_stages(1) == (1, 5)


def test_names_are_torch_names():
    assert canonical_name("zbv") == "ZBVZeroBubble"
    assert canonical_name("1f1b") == "1F1B"
    from torch.distributed.pipelining.schedules import get_schedule_class

    for name in SCHEDULES:
        assert get_schedule_class(name).__name__.endswith(name)


@pytest.mark.parametrize("args,words", [
    (("1F1B", 4, 1, 3), ["m=3 < p=4", "m >= 4"]),
    (("DualPipeV", 4, 2, 7), ["m=7", "m >= 8"]),
    (("Interleaved1F1B", 4, 2, 9), ["multiple", "m=8", "m=10"]),
    (("InterleavedZeroBubble", 4, 2, 13), ["multiple", "m=12"]),
    (("ZBVZeroBubble", 4, 3, 8), ["exactly 2", "v=2"]),
    (("GPipe", 4, 2, 8), ["one stage per rank", "Interleaved1F1B"]),
    (("Chimera", 4, 1, 8), ["unknown", "1F1B"]),
    (("GPipe", 0, 1, 8), ["p must be a positive"]),
    (("GPipe", 2, 1, 0), ["m must be a positive"]),
])
def test_invalid_choices_name_the_cause_and_the_fix(args, words):
    with pytest.raises(PlanError) as e:
        PipelineSchedule(*args)
    for w in words:
        assert w in str(e.value)


def test_wrong_number_of_stage_times_is_an_error():
    with pytest.raises(PlanError, match="one StageTime per virtual stage"):
        simulate(PipelineSchedule("Interleaved1F1B", 2, 2, 4), [EQUAL] * 2)
