import math
from collections import Counter

import pytest

from autopar.ir.errors import PlanError
from autopar.passes.pipeline.schedule import (
    SCHEDULES,
    PipelineSchedule,
    StageTime,
    canonical_name,
    core_speed,
    events,
    rank_orders,
    receive_posts,
    simulate,
    step_and_bubble,
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
    # a transfer starts when the receiver posts its receive, just before the reading action
    # (torch's single-stage runtimes): the critical path crosses the boundary three times,
    # the first forward, rank 1's second forward (posted after its first backward, though
    # the activation was ready long before) and the last backward
    assert math.isclose(simulate(s, StageTime(1.0, 2.0, send_s=0.5)).step_s, free + 3 * 0.5)
    # one rank, V: stages 0 and 1 both live on rank 0, so nothing is sent
    v = PipelineSchedule("ZBVZeroBubble", 1, 2, 2)
    assert math.isclose(simulate(v, StageTime(1.0, 1.0, 1.0, send_s=5.0)).step_s, 12.0)


@pytest.mark.parametrize("name,v,m", [("Interleaved1F1B", 2, 8), ("InterleavedZeroBubble", 2, 4),
                                      ("ZBVZeroBubble", 2, 8), ("DualPipeV", 2, 8),
                                      ("LoopedBFS", 2, 4)])
def test_receives_are_posted_before_their_readers_in_torchs_lowered_program(name, v, m):
    # the replay reads where torch's runtime posts each receive off its lowered program:
    # every action that reads from another rank has one, posted before that action runs
    s = PipelineSchedule(name, 3, v, m)
    for r, (order, posts) in enumerate(zip(rank_orders(s), receive_posts(name, 3, v, m))):
        for k, a in enumerate(order):
            src = {"F": a.stage - 1, "B": a.stage + 1, "I": a.stage + 1}.get(a.kind)
            if src is None or not 0 <= src < s.num_stages or s.stage_rank(src) == r:
                continue
            key = (a.stage, a.microbatch, "F" if a.kind == "F" else "B")
            assert key in posts and -1 <= posts[key] < k, (r, a)


def test_a_receive_posted_early_hides_the_send_where_one_posted_late_does_not(monkeypatch):
    # torch's lowered Interleaved1F1B posts some receives an action ahead of their readers;
    # replayed as if each were posted just before its reader (the single-stage runtimes'
    # way), the same schedule pays those sends on its critical path
    import autopar.passes.pipeline.schedule as ps

    s = PipelineSchedule("Interleaved1F1B", 2, 2, 4)
    t = StageTime(1.0, 1.0, 0.0, send_s=0.5)
    early = simulate(s, t).step_s
    monkeypatch.setattr(ps, "receive_posts", lambda name, p, v, m: ({},) * p)
    ps._program.cache_clear()  # the replay reads the posts once per schedule
    try:
        late = simulate(s, t).step_s
    finally:
        ps._program.cache_clear()  # none of the patched posts left for later tests
    assert early < late - 0.4


def test_runtime_costs_add_per_action_per_post_and_per_split_backward():
    # one rank, a V: 2 stages x 2 microbatches x (F, I, W), nothing sent
    v = PipelineSchedule("ZBVZeroBubble", 1, 2, 2)
    base = simulate(v, StageTime(1.0, 1.0, 1.0)).step_s
    assert math.isclose(simulate(v, StageTime(1.0, 1.0, 1.0, action_s=0.1)).step_s, base + 1.2)
    # the split's cost lands on the 4 input backwards; posts cost nothing on one rank
    assert math.isclose(simulate(v, StageTime(1.0, 1.0, 1.0, split_s=0.25, post_s=9.0)).step_s,
                        base + 1.0)
    # GPipe on 2 ranks, 1 microbatch: each of the 4 actions posts one send or receive
    g = PipelineSchedule("GPipe", 2, 1, 1)
    assert math.isclose(simulate(g, StageTime(1.0, 2.0, post_s=0.5)).step_s,
                        simulate(g, StageTime(1.0, 2.0)).step_s + 4 * 0.5)


def test_core_speed_is_relative_to_every_process_computing():
    assert core_speed(4, 1, 4) is None and core_speed(2, 2, 8) is None  # a core each
    # 4 processes on 2 cores: alone or with one other a process has a core of its own
    assert core_speed(4, 1, 2) == (2.0, 2.0, 2.0, 4 / 3, 1.0)
    # pp=2 x dp=2 on 2 cores: one pipeline rank busy is its 2 dp processes, a core each
    assert core_speed(2, 2, 2) == (2.0, 2.0, 1.0)


def test_ranks_sharing_cores_run_faster_alone():
    # GPipe, 2 ranks, 1 microbatch: one rank computes at any time, at twice the speed
    g = PipelineSchedule("GPipe", 2, 1, 1)
    t = StageTime(1.0, 2.0)
    assert math.isclose(simulate(g, t).step_s, 6.0)
    shared = simulate(g, t, core_speed(2, 2, 2))
    assert math.isclose(shared.step_s, 3.0) and shared.busy_s == (1.5, 1.5)
    # a speed of 1 for every count is the replay without sharing, for every schedule
    for name, v, m in VALID[::4]:
        s = PipelineSchedule(name, 4, v, m)
        times = [StageTime(1.0 + 0.1 * k, 1.5, 0.5, send_s=0.2) for k in range(s.num_stages)]
        assert math.isclose(simulate(s, times, (1.0,) * 5).step_s, simulate(s, times).step_s)


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


# --- any number of stages per rank (Megatron's interleaved layouts run 3: SC'21's 76B, 530B) --


@pytest.mark.parametrize("p,v,m", [(4, 3, 8), (2, 3, 4), (4, 3, 12), (35 // 5, 3, 14)])
def test_interleaved_v3_bubble_and_in_flight_are_megatrons(p, v, m):
    cost = simulate(PipelineSchedule("Interleaved1F1B", p, v, m), EQUAL)
    # equal chunks of forward 1, backward 2: the bubble is (p - 1) chunk round trips, a
    # v-th of 1F1B's on the same work (Narayanan et al. 2021, eq. 2: (p-1)/(v m))
    assert math.isclose(cost.step_s, (m * v + p - 1) * 3.0)
    assert math.isclose(cost.bubble_fraction, (p - 1) / (m * v + p - 1))
    # chunk activations rank r holds at its peak: 2(p - r - 1) + (v - 1)p + 1
    assert cost.peak_in_flight == tuple(2 * (p - r - 1) + (v - 1) * p + 1 for r in range(p))


def test_schedule_options_take_any_stages_per_rank_when_given():
    from autopar.passes.pipeline.cost import LOOPED_SEARCH_V, schedule_options

    got = schedule_options(SCHEDULES, 4, 28, 60, 3)
    assert {(s.name, s.v) for s in got} == {
        ("Interleaved1F1B", 3), ("InterleavedZeroBubble", 3), ("LoopedBFS", 3)}
    # SC'21's 530B: 35 ranks x 3 stages of its 105 blocks, one block each
    assert [s.v for s in schedule_options(["Interleaved1F1B"], 35, 280, 105, 3)] == [3]
    assert schedule_options(["Interleaved1F1B"], 35, 280, 104, 3) == []  # a stage left empty
    # unasked, the planner tries a few counts only (each is a split and replay per layout)
    free = {(s.name, s.v) for s in schedule_options(SCHEDULES, 4, 28, 60, None)}
    assert {v for n, v in free if n == "Interleaved1F1B"} == set(LOOPED_SEARCH_V)
    # one per rank is 1F1B's and GPipe's, not a looped schedule's
    assert {s.name for s in schedule_options(SCHEDULES, 4, 28, 60, 1)} == {"GPipe", "1F1B"}


def test_split_into_three_stages_per_rank():
    from autopar.passes.pipeline.stage_split import layer_cost, split_stages

    # SC'21's 76B: 60 equal blocks on pp=4 x 3 stages per rank, 28 microbatches
    split = split_stages(60, layer_cost([1.0] * 60), 4, 28, v=3, schedule="Interleaved1F1B")
    assert split.ranges == tuple((5 * k, 5 * k + 5) for k in range(12))
    assert split.schedule.v == 3 and split.schedule.num_stages == 12
    # stage k runs on rank k % 4: each rank holds three chunks, a quarter of the model
    assert [split.schedule.stage_rank(k) for k in range(12)] == [0, 1, 2, 3] * 3


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("shared", [False, True])
def test_step_and_bubble_are_the_replays_own(name, shared):
    """What the planner weighs splits by is simulate's step and bubble, to the bit, with
    unequal stages, sends, overheads and (where ranks share cores) changing speeds."""
    p, m = 4, 8
    v = 1 if name in ("GPipe", "1F1B") else 2
    sched = PipelineSchedule(name, p, v, m)
    times = [StageTime(0.5 + 0.1 * k, 0.7 + 0.05 * k, 0.3, send_s=0.02, action_s=0.001,
                       post_s=0.003, split_s=0.01 * (k % 2)) for k in range(sched.num_stages)]
    speed = core_speed(p, 2, 4) if shared else None
    full = simulate(sched, times, speed)
    assert step_and_bubble(sched, times, speed) == (full.step_s, full.bubble_fraction)
    # the orders are built once and shared: a second replay gives the same
    assert rank_orders(sched) is rank_orders(sched)
    assert simulate(sched, times, speed) == full


@pytest.mark.parametrize("name,p,v,m", [("1F1B", 4, 1, 8), ("GPipe", 3, 1, 6),
                                        ("Interleaved1F1B", 4, 2, 8),
                                        ("InterleavedZeroBubble", 4, 2, 8),
                                        ("ZBVZeroBubble", 4, 2, 8), ("DualPipeV", 4, 2, 8),
                                        ("LoopedBFS", 2, 2, 4)])
def test_the_replay_run_ahead_is_the_event_by_event_replay_at_full_speed(name, p, v, m):
    # two ways to the same timeline: each rank run ahead as far as it can (every length
    # known up front), and time advanced event by event (ranks sharing cores), here with no
    # core shared; unequal stages, sends that cross ranks, split backwards
    import random

    import autopar.passes.pipeline.schedule as ps

    rng = random.Random(7)
    s = PipelineSchedule(name, p, v, m)
    times = [StageTime(rng.uniform(0.5, 2.0), rng.uniform(0.3, 1.0), rng.uniform(0.3, 1.0),
                       send_s=rng.choice([0.0, rng.uniform(0.05, 0.3)]), action_s=0.01,
                       post_s=0.002, split_s=0.01) for _ in range(s.num_stages)]
    ahead = ps._replay(s, tuple(times))
    stepped = ps._replay(s, tuple(times), (1.0,) * (p + 1))
    assert [[(a, st) for a, st, _ in rank] for rank in ahead] == \
        [[(a, pytest.approx(st, abs=1e-9)) for a, st, _ in rank] for rank in stepped]
    assert [[end for *_, end in rank] for rank in ahead] == \
        [[pytest.approx(end, abs=1e-9) for *_, end in rank] for rank in stepped]
