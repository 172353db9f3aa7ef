"""The pure functions of ``benchmarks/pipeline.py`` (``benchmarks/_pipeline_stats.py``): the
measured bubble is defined as the schedule model defines its prediction, and the rank
correlation is Spearman's. No processes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from autopar.passes.pipeline.schedule import PipelineSchedule, StageTime, events, simulate

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "_pipeline_stats.py"
_spec = importlib.util.spec_from_file_location("bench_pipeline_stats", _PATH)
stats = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(stats)

LETTER = {"forward": "F", "backward": "B", "backward_input": "I", "backward_weight": "W"}


def _as_measured(schedule: PipelineSchedule, times: list[StageTime], offset: float = 0.0):
    """The predicted timeline as the benchmark reads a measured one: (rank, kind, start,
    end) compute actions, a gradient sync after them, the clock starting at ``offset``."""
    out = []
    for rank_events in events(schedule, times):
        for e in rank_events:
            if e.kind in LETTER:
                out.append((e.rank, LETTER[e.kind], offset + e.start_s, offset + e.end_s))
        end = max(e.end_s for e in rank_events if e.kind in LETTER)
        out.append((rank_events[0].rank, "sync", offset + end, offset + end + 5.0))
    return out


@pytest.mark.parametrize("name,p,v,m", [("GPipe", 2, 1, 4), ("1F1B", 4, 1, 8),
                                         ("Interleaved1F1B", 2, 2, 4),
                                         ("ZBVZeroBubble", 2, 2, 4), ("DualPipeV", 2, 2, 4)])
def test_measured_bubble_is_the_models_definition(name, p, v, m):
    """On the model's own timeline (uneven stages, sends between ranks, split backwards) the
    measured definition gives the model's bubble and span, whatever the clock's origin."""
    sched = PipelineSchedule(name, p, v, m)
    times = [StageTime.of(1.0 + 0.3 * k, 2.0 + 0.1 * k, 0.4, 0.05)
             for k in range(sched.num_stages)]
    want = simulate(sched, times)
    bubble, span = stats.schedule_bubble(_as_measured(sched, times, offset=123.0), p)
    assert bubble == pytest.approx(want.bubble_fraction)
    assert span == pytest.approx(want.step_s)


def test_bubble_counts_the_wait_and_an_idle_rank():
    # rank 0 computes 0-2; rank 1 waits 1 s, computes 1-3; the sync is no action
    evs = [(0, "F", 10.0, 11.0), (0, "B", 11.0, 12.0), (1, "F", 11.0, 12.0),
           (1, "B", 12.0, 13.0), (1, "sync", 13.0, 20.0)]
    bubble, span = stats.schedule_bubble(evs, 2)
    assert span == pytest.approx(3.0)
    assert bubble == pytest.approx(1 - 4.0 / 6.0)
    # a third rank with no action is idle throughout
    assert stats.schedule_bubble(evs, 3)[0] == pytest.approx(1 - 4.0 / 9.0)
    assert stats.schedule_bubble([], 2) == (0.0, 0.0)


def test_textbook_share():
    assert stats.textbook_share(2, 8) == pytest.approx((1 / 8) / (1 + 1 / 8))
    assert stats.textbook_share(4, 8, 2) == pytest.approx((3 / 16) / (1 + 3 / 16))


def test_ranks_and_spearman():
    assert stats.rank_of([3.0, 1.0, 2.0, 1.0]) == [4.0, 1.5, 3.0, 1.5]
    assert stats.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert stats.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # with ties: scipy.stats.spearmanr gives 0.8207826816681233
    assert stats.spearman([1, 2, 3, 4, 5], [5, 6, 7, 8, 7]) == pytest.approx(0.8207826816681233)
    with pytest.raises(ValueError):
        stats.spearman([1.0], [1.0])


def test_bootstrap_interval():
    pred = [1.0, 2.0, 3.0]
    steady = [[1.0] * 6, [2.0] * 6, [3.0] * 6]
    assert stats.bootstrap_rho(pred, steady, n=50) == (pytest.approx(1.0), pytest.approx(1.0))
    noisy = [[1.0, 2.5, 1.0, 1.0, 2.5, 1.0], [2.0] * 6, [3.0] * 6]
    lo, hi = stats.bootstrap_rho(pred, noisy, n=200)
    assert lo < hi == pytest.approx(1.0)
