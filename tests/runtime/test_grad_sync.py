"""Gradient syncs in buckets, all ranks simulated with LocalTensorMode.

Each rank holds a random partial gradient per parameter (the full gradient is their sum); the
schedule starts each bucket at the step its last gradient is computed and must hand back every
gradient placed as its parameter, one collective per bucket.
"""

from __future__ import annotations

import pytest
import torch
from spmd_harness import fake_world

from autopar.graph import TensorMeta
from autopar.passes.buckets import GradSync
from autopar.passes.strategies.simulate import coords, shard, unshard
from autopar.placements import Partial, R, Shard
from autopar.runtime._compat import reconcile
from autopar.runtime.deferred_loss import LossValue
from autopar.runtime.grad_sync import GradSyncSchedule
from autopar.runtime.redistribute import CollectiveCounter, Comm, redistribute

P = Partial()


def test_buckets_mix_dims_start_when_ready_and_hand_back_each_gradient() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    n = 2
    shapes = [(4, 6), (6, 4), (8,), (6,)]
    # two reduce-scatters along different dims (one bucket), two all-reduces (another)
    dsts = [(Shard(0),), (Shard(1),), (R,), (R,)]
    names = ["g0", "g1", "g2", "g3"]
    fulls = [torch.randn(s, dtype=torch.float64) for s in shapes]
    with fake_world(n) as mode:
        dm = init_device_mesh("cpu", (n,), mesh_dim_names=("dp",))
        counter = CollectiveCounter()
        comm = Comm(dm, ("dp",), (n,), tuple(dm.get_coordinate()), counter)
        order = coords((n,))
        env = {}
        with mode.disable():
            pieces = [shard(f, (P,), (n,), torch.Generator().manual_seed(i))
                      for i, f in enumerate(fulls)]
        for name, piece in zip(names, pieces):
            env[name] = mode.rank_map(lambda r, p=piece: p[order[r]].clone())
        # g0, g1 are made by backward steps 0 and 2, g2 and g3 exist before the backward
        moves = [GradSync(i, TensorMeta(s, torch.float64), (P,), d)
                 for i, (s, d) in enumerate(zip(shapes, dsts))]
        schedule = GradSyncSchedule(["g0", "x", "g1"], {}, names, moves, (n,), bucketed=True,
                                    loss=(TensorMeta((), torch.float64), (R,)))
        run = schedule.start(comm, env, None)
        assert [r.kind for r in counter.records] == ["all_reduce"]  # g2+g3 at once, at -1
        run.step_done(0)
        run.step_done(1)
        assert len(counter.records) == 1  # g1 is not computed yet: its bucket waits
        run.step_done(2)
        assert [r.kind for r in counter.records] == ["all_reduce", "reduce_scatter"]
        got = run.finish()
        for g, full, dst in zip(got, fulls, dsts):
            per = {order[r]: t for r, t in g._local_tensors.items()}
            with mode.disable():
                back = unshard(per, dst, (n,), atol=1e-9, rtol=1e-9)
                assert torch.allclose(back, full, atol=1e-9), dst


@pytest.mark.parametrize("read_first", [False, True])
@pytest.mark.parametrize("bucket", ["all_reduce", "reduce_scatter"])
@pytest.mark.parametrize("reduce", ["sum", "avg"])
def test_the_loss_rides_in_the_first_bucket_over_its_axis(bucket: str, reduce: str,
                                                          read_first: bool) -> None:
    """A partial loss is reduced by the first gradient bucket over its axis, at no collective of
    its own (its value in every row block of a reduce-scatter); read before the backward, it
    is reduced alone and the bucket leaves it out."""
    from torch.distributed.device_mesh import init_device_mesh

    n = 2
    shape, dst = ((4, 6), (Shard(0),)) if bucket == "reduce_scatter" else ((8,), (R,))
    full = torch.randn(shape, dtype=torch.float64)
    loss_spec = (Partial(reduce),)
    want = 3.0 if reduce == "sum" else 1.5  # ranks hold 1 and 2
    with fake_world(n) as mode:
        dm = init_device_mesh("cpu", (n,), mesh_dim_names=("dp",))
        counter = CollectiveCounter()
        comm = Comm(dm, ("dp",), (n,), tuple(dm.get_coordinate()), counter)
        order = coords((n,))
        with mode.disable():
            piece = shard(full, (P,), (n,), torch.Generator().manual_seed(0))
        env = {"g": mode.rank_map(lambda r: piece[order[r]].clone())}
        local = mode.rank_map(lambda r: torch.tensor(float(r + 1), dtype=torch.float64))
        move = GradSync(0, TensorMeta(shape, torch.float64), (P,), dst)
        schedule = GradSyncSchedule(["g"], {}, ["g"], [move], (n,), bucketed=True,
                                    loss=(TensorMeta((), torch.float64), loss_spec))
        assert schedule.loss_rides
        loss = LossValue(local, lambda t: redistribute(t, loss_spec, (R,), comm, "loss"),
                         in_bucket=True)
        assert counter.records == []  # nothing issued for the loss at the forward's end
        if read_first:
            assert reconcile(loss.resolve()).item() == pytest.approx(want)
        run = schedule.start(comm, env, loss)
        run.step_done(0)
        got = run.finish()
        kinds = [(r.kind, r.reason, r.bytes) for r in counter.records]
        grad_bytes = full.numel() * 8
        if read_first:
            assert kinds == [("all_reduce", "loss", 8), (bucket, "gradient sync", grad_bytes)]
        else:  # 8 more bytes, once per row block of a reduce-scatter
            extra = 8 * (n if bucket == "reduce_scatter" else 1)
            assert kinds == [(bucket, "gradient sync", grad_bytes + extra)]
        assert reconcile(loss.resolve()).item() == pytest.approx(want)
        per = {order[r]: t for r, t in got[0]._local_tensors.items()}
        with mode.disable():
            back = unshard(per, dst, (n,), atol=1e-9, rtol=1e-9)
            assert torch.allclose(back, full, atol=1e-9)
