import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.ir.errors import PlanError
from autopar.passes.pipeline.schedule import PipelineSchedule, StageTime, simulate
from autopar.passes.pipeline.stage_split import (
    StageCost,
    layer_cost,
    objective,
    schedule_in_flight,
    split_stages,
)


def brute_force(L, cost, n, m, v, cap, held, submeshes, rank_limit=None):
    """Every contiguous split and every submesh per chunk: the least objective, or None.
    With ``rank_limit`` = (schedule, limit), each rank's chunks must also sum within it."""
    best = None
    for cuts in itertools.combinations(range(1, L), n - 1):
        bounds = (0, *cuts, L)
        per_chunk = []
        for k in range(n):
            i, j = bounds[k], bounds[k + 1]
            opts = []
            for s in submeshes:
                c = cost(i, j, s)
                c = c if isinstance(c, StageCost) else StageCost(*c)
                if c.memory_bytes + held[k] * c.activation_bytes <= cap:
                    opts.append((c.time_s, c.memory_bytes + held[k] * c.activation_bytes))
            per_chunk.append(opts)
        if not all(per_chunk):
            continue
        for picks in itertools.product(*per_chunk):
            if rank_limit is not None:
                sched, limit = rank_limit
                ranks = [0.0] * sched.p
                for k, (_, mem) in enumerate(picks):
                    ranks[sched.stage_rank(k)] += mem
                if max(ranks) > limit:
                    continue
            value = objective([t for t, _ in picks], m, v)
            best = value if best is None else min(best, value)
    return best


@st.composite
def problems(draw):
    L = draw(st.integers(1, 7))
    v = draw(st.sampled_from([1, 1, 2]))
    # mostly splits that exist; sometimes more stages than layers
    p = draw(st.integers(1, 4)) if draw(st.integers(0, 9)) == 0 else \
        draw(st.integers(1, min(4, max(1, L // v))))
    m = draw(st.integers(p, 3 * p))
    if v == 2:
        m = p * draw(st.integers(1, 3))  # a valid Interleaved1F1B count
    nsub = draw(st.integers(1, 2))
    table = {}
    for i in range(L):
        for j in range(i + 1, L + 1):
            for s in range(nsub):
                table[(i, j, s)] = (
                    draw(st.floats(0.1, 10.0)),
                    draw(st.floats(0.0, 10.0)),
                    draw(st.floats(0.0, 3.0)),
                )
    limit = draw(st.sampled_from([math.inf, 4.0, 8.0, 12.0]))
    return L, p, v, m, tuple(range(nsub)), table, limit


@settings(max_examples=200, deadline=None)
@given(problems())
def test_dp_objective_equals_brute_force(problem):
    L, p, v, m, submeshes, table, limit = problem
    cost = lambda i, j, s: table[(i, j, s)]  # noqa: E731
    n = p * v
    if n > L:
        with pytest.raises(PlanError, match="cannot cut"):
            split_stages(L, cost, p, m, limit, v=v, submeshes=submeshes)
        return
    sched = PipelineSchedule("1F1B" if v == 1 else "Interleaved1F1B", p, v, m)
    flight = schedule_in_flight(sched)
    held = [flight(k, n) for k in range(n)]
    expected = brute_force(L, cost, n, m, v, limit / v, held, submeshes)
    if expected is None:
        with pytest.raises(PlanError, match="no split"):
            split_stages(L, cost, p, m, limit, v=v, submeshes=submeshes)
        return
    got = split_stages(L, cost, p, m, limit, v=v, submeshes=submeshes)
    # each chunk within limit / v is the DP's optimum; what a rank's chunks leave of the
    # limit is then spent on faster submeshes: never worse, never beyond a split whose
    # ranks (not chunks) fit the limit
    ranks_fit = brute_force(L, cost, n, m, v, limit, held, submeshes, (sched, limit))
    assert got.objective_s <= expected * (1 + 1e-9)
    assert got.objective_s >= ranks_fit * (1 - 1e-9)
    if v == 1 or len(submeshes) == 1:
        assert math.isclose(got.objective_s, expected, rel_tol=1e-9)
    # replaying candidates may trade the formula for the replayed step, never beat the optimum
    top = split_stages(L, cost, p, m, limit, v=v, submeshes=submeshes, refine=3)
    assert top.objective_s >= got.objective_s - 1e-9
    assert math.isclose(objective(got.time_s, m, v), got.objective_s)
    # the ranges tile the layers, and each chunk's figures are its table entry's
    assert got.ranges[0][0] == 0 and got.ranges[-1][1] == L
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(got.ranges, got.ranges[1:]))
    for k, ((i, j), s) in enumerate(zip(got.ranges, got.submeshes)):
        t, mem, act = table[(i, j, s)]
        assert got.time_s[k] == t
        assert math.isclose(got.memory_bytes[k], mem + held[k] * act)
    assert max(got.rank_memory_bytes) <= limit
    assert math.isclose(sum(got.rank_memory_bytes), sum(got.memory_bytes))


def test_a_heavy_head_gets_a_stage_of_fewer_layers():
    # embedding, 8 blocks, a head 5x a block: equal layer counts (5 + 5) would give stages
    # of 5 and 9; balancing by cost moves blocks to the first stage
    times = [1.0] + [1.0] * 8 + [5.0]
    split = split_stages(len(times), layer_cost(times), p=2, m=8)
    sizes = [j - i for i, j in split.ranges]
    assert sizes != [5, 5]
    assert sizes[0] > sizes[1]
    assert max(split.time_s) <= 8.0
    assert split.ranges == ((0, 7), (7, 10))


def test_memory_position_matters_in_1f1b():
    # equal layers, but the first stage holds p microbatches and the last one: with a tight
    # limit the first stage must take fewer layers
    L, p = 8, 4
    cost = layer_cost([1.0] * L, memory=[1.0] * L, activations=[1.0] * L)
    free = split_stages(L, cost, p, m=8)
    assert [j - i for i, j in free.ranges] == [2, 2, 2, 2]
    # a layer costs 1 + (microbatches held) at its stage: 5, 4, 3, 2
    tight = split_stages(L, cost, p, m=8, memory_limit=8.0)
    sizes = [j - i for i, j in tight.ranges]
    assert sizes[0] == 1 and sizes[-1] >= 3
    assert all(mem <= 8.0 for mem in tight.memory_bytes)
    assert tight.memory_bytes[0] == 1.0 + 4 * 1.0


def test_each_range_and_submesh_is_priced_once():
    calls = []

    def cost(i, j, s):
        calls.append((i, j, s))
        return (j - i) * (1.0 if s == "wide" else 1.5), 0.0

    L = 12
    split = split_stages(L, cost, p=4, m=8, submeshes=("narrow", "wide"))
    assert len(calls) == len(set(calls)) <= L * (L + 1) // 2 * 2
    assert set(split.submeshes) == {"wide"}


def test_v_chunks_go_round_robin_or_in_a_v():
    cost = layer_cost([1.0] * 8, memory=[1.0] * 8)
    loop = split_stages(8, cost, p=2, m=4, v=2)
    assert len(loop.ranges) == 4
    assert loop.rank_memory_bytes == (4.0, 4.0)
    vee = split_stages(8, cost, p=2, m=4, v=2, schedule="ZBVZeroBubble")
    assert vee.schedule.rank_stages(0) == (0, 3)
    assert math.isclose(vee.objective_s, (4 * 2 + 2 - 1) * 2.0)  # (m*v + p - 1) * chunk


def test_refine_replays_the_best_few_in_the_schedule():
    # interleaved: the formula's best split is not the fastest once replayed
    times = [2.7, 1.4, 1.1, 2.5, 1.7, 2.4, 2.8, 1.8, 1.9, 2.8]
    cost = layer_cost(times)
    plain = split_stages(len(times), cost, p=2, m=2, v=2)
    assert plain.step_s is None
    refined = split_stages(len(times), cost, p=2, m=2, v=2, refine=6)
    plain_step = simulate(plain.schedule, plain.stage_times()).step_s
    assert refined.step_s < plain_step
    assert math.isclose(refined.step_s, simulate(refined.schedule,
                                                 refined.stage_times()).step_s)
    assert refined.objective_s >= plain.objective_s


def test_a_rank_spends_the_memory_its_chunks_leave_on_less_recomputation():
    # two submeshes per chunk, as the planner's recomputation modes: "keep" (fast, saves its
    # activations) and "recompute" (slower, saves none). Interleaved p=2, v=2, m=4 holds
    # 3.33, 2.25, 1.67 and 0.75 microbatches in chunks 0-3 (chunks 0 and 2 on rank 0). A
    # chunk alone may use limit / v = 3.5: only chunk 3 keeps; a rank may hold 7, so rank 0
    # can keep chunk 2 (2 + 3.67) and rank 1 both of its chunks (4.25 + 2.75).
    keep = (1.0, 2.0, 1.0)  # (time, memory, activations per microbatch)
    recompute = (1.3, 2.0, 0.0)
    cost = lambda i, j, s: keep if s == "keep" else recompute  # noqa: E731
    sched = PipelineSchedule("Interleaved1F1B", 2, 2, 4)
    held = [schedule_in_flight(sched)(k, 4) for k in range(4)]
    subs = ("recompute", "keep")
    split = split_stages(4, cost, p=2, m=4, memory_limit=7.0, v=2, submeshes=subs)
    assert split.submeshes == ("recompute", "keep", "keep", "keep")
    assert max(split.rank_memory_bytes) <= 7.0
    assert split.objective_s == objective([1.3, 1.0, 1.0, 1.0], 4, 2)
    # a chunk-by-chunk cap of limit / v keeps chunk 3 only
    assert brute_force(4, cost, 4, 4, 2, 3.5, held, subs) == objective([1.3] * 3 + [1.0], 4, 2)
    # the best any split can do with the ranks' sums within the limit
    assert brute_force(4, cost, 4, 4, 2, 7.0, held, subs, (sched, 7.0)) == split.objective_s


def test_in_flight_is_a_callable_input():
    cost = layer_cost([1.0] * 4, activations=[1.0] * 4)
    split = split_stages(4, cost, p=2, m=4, in_flight=lambda k, n: 10.0)
    assert split.memory_bytes == (20.0, 20.0)
    gpipe = split_stages(4, cost, p=2, m=4, schedule="GPipe")
    assert gpipe.memory_bytes == (8.0, 8.0)  # every microbatch held


def test_more_stages_than_layers_is_an_error():
    with pytest.raises(PlanError, match=r"cannot cut 3 layers into 4 .*at most 3 stages"):
        split_stages(3, layer_cost([1.0] * 3), p=4, m=4)


def test_no_fit_names_the_memory_that_would_fit_and_what_helps():
    GiB = 1024**3
    cost = layer_cost([1.0] * 4, memory=[GiB] * 4, activations=[GiB] * 4)
    with pytest.raises(PlanError) as e:
        split_stages(4, cost, p=2, m=4, memory_limit=3 * GiB)
    msg = str(e.value)
    # stage 0 holds 2 microbatches (3 GiB a layer), stage 1 one (2 GiB a layer): splits 1+3
    # and 2+2 both need 6 GiB on their fuller stage
    assert "needs 6 GiB" in msg
    for hint in ("more pipeline stages", "fewer microbatches in flight", "recomputation"):
        assert hint in msg.lower()


@pytest.mark.parametrize("p, v, m", [(4, 2, 8), (4, 4, 8), (8, 2, 16)])
def test_an_interleaved_ranks_in_flight_is_what_it_holds_at_once_not_its_stages_peaks(p, v, m):
    sched = PipelineSchedule("Interleaved1F1B", p, v, m)
    flight = schedule_in_flight(sched)
    held = [sum(flight(k, sched.num_stages) for k in sched.rank_stages(r)) for r in range(p)]
    # Megatron's interleaved warm-up: 2(p-r-1) + (v-1)p forwards, then one more in 1F1B
    assert held == pytest.approx([2 * (p - r - 1) + (v - 1) * p + 1 for r in range(p)])
    # less than the sum of each stage's own peak, which come at different times
    peaks = simulate(sched, StageTime(1.0, 1.0, 1.0)).stage_peak_in_flight
    assert sum(held) < sum(peaks)
    one = PipelineSchedule("1F1B", p, 1, m)
    assert [schedule_in_flight(one)(k, p) for k in range(p)] == [p - k for k in range(p)]
