"""The overlap of communication with compute (passes/cost/overlap.py)."""

import pytest

from autopar.passes.cost.overlap import Segment, exposed_after, overlapped_step, serial_step


def test_gradient_syncs_hide_behind_the_backward_still_to_run():
    # four layers' backward of 1 s each, each making a 0.5 s sync: only the last is exposed
    segs = [Segment(1.0, sync_s=0.5, copies=4)]
    assert overlapped_step(segs) == pytest.approx(4.5)
    assert serial_step(segs) == pytest.approx(6.0)
    # syncs longer than the compute behind them pile up: the backlog is exposed
    assert overlapped_step([Segment(1.0, sync_s=2.0, copies=4)]) == pytest.approx(1.0 + 8.0)


def test_parameter_gathers_prefetch_one_segment_ahead_the_first_exposed():
    segs = [Segment(1.0, gather_s=0.25, copies=4)]
    # the first gather waits; each next hides behind the segment before it
    assert overlapped_step(segs) == pytest.approx(0.25 + 4.0)
    # a gather longer than the compute it hides behind delays the next segment
    assert overlapped_step([Segment(1.0, gather_s=1.5, copies=3)]) == pytest.approx(
        1.5 + 1.5 + 1.5 + 1.0)


def test_a_backlog_of_syncs_delays_the_next_gather():
    # FSDP's backward: each layer gathers its parameters and reduce-scatters its gradients
    fsdp = [Segment(1.0, gather_s=0.4, sync_s=0.4, copies=3)]
    alone = overlapped_step([Segment(1.0, gather_s=0.4, copies=3)])
    assert overlapped_step(fsdp) > alone
    assert overlapped_step(fsdp) <= serial_step(fsdp)


def test_in_line_communication_is_never_hidden():
    segs = [Segment(2.0), Segment(0.5)]
    assert overlapped_step(segs) == serial_step(segs) == pytest.approx(2.5)
    assert overlapped_step([]) == 0.0


def test_exposed_after():
    assert exposed_after(1.0, 0.25) == pytest.approx(0.75)
    assert exposed_after(1.0, 3.0) == 0.0


def test_exposed_gradient_sync_of_a_pipeline_ranks_last_backward():
    from autopar.passes.cost.overlap import exposed_gradient_sync

    # 4 layers: 1 s of backward each, 2 s of syncs in all: the last layer's 0.5 s is exposed
    assert exposed_gradient_sync(4.0, 2.0, 4) == pytest.approx(0.5)
    # syncs that outrun the backward: everything but what ran beside the first 3 layers
    assert exposed_gradient_sync(4.0, 12.0, 4) == pytest.approx(12.0 - 3.0)
    assert exposed_gradient_sync(4.0, 0.0, 4) == 0.0


def test_a_segment_of_no_compute_between_layers_changes_nothing():
    layers = [Segment(1.0, gather_s=0.25, sync_s=0.5)] * 4
    with_views = [s for seg in layers for s in (seg, Segment(0.0))]
    assert overlapped_step(with_views) == pytest.approx(overlapped_step(layers))
    # a gather needed by nothing but the next layer is prefetched with it
    split = [Segment(1.0), Segment(0.0, gather_s=0.25), Segment(1.0)]
    assert overlapped_step(split) == pytest.approx(2.0)
