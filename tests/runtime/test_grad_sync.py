"""Gradient syncs in buckets, all ranks simulated with LocalTensorMode.

Each rank holds a random partial gradient per parameter (the full gradient is their sum); the
schedule starts each bucket at the step its last gradient is computed and must hand back every
gradient placed as its parameter, one collective per bucket.
"""

from __future__ import annotations

import pytest
import torch
from harness.spmd import fake_world

from autopar.ir.graph import TensorMeta
from autopar.ir.placements import Partial, R, Shard
from autopar.passes.cost.buckets import GradSync
from autopar.passes.strategies.simulate import coords, shard, unshard
from autopar.runtime.grad_sync import GradSyncSchedule
from autopar.runtime.redistribute import CollectiveCounter, Comm

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
                                    first_bucket_bytes=2**20)
        run = schedule.start(comm, env)
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


@pytest.mark.parametrize("bucketed", [True, False])
def test_a_sync_deferred_over_microbatches_moves_their_sum_once(bucketed: bool) -> None:
    """Pipeline stages' gradient accumulation: backwards with ``sync=False`` run no collective
    and keep their partial gradients in the carry; the last moves the sum of all of them
    (all-reduces and ZeRO's reduce-scatters alike), as many collectives as one backward."""
    from torch.distributed.device_mesh import init_device_mesh

    n, m = 2, 3
    shapes = [(4, 6), (6, 4), (8,), (6,)]
    dsts = [(Shard(0),), (Shard(1),), (R,), (R,)]
    names = ["g0", "g1", "g2", "g3"]
    fulls = [[torch.randn(s, dtype=torch.float64) for s in shapes] for _ in range(m)]
    with fake_world(n) as mode:
        dm = init_device_mesh("cpu", (n,), mesh_dim_names=("dp",))
        counter = CollectiveCounter()
        comm = Comm(dm, ("dp",), (n,), tuple(dm.get_coordinate()), counter)
        order = coords((n,))
        moves = [GradSync(i, TensorMeta(s, torch.float64), (P,), d)
                 for i, (s, d) in enumerate(zip(shapes, dsts))]
        schedule = GradSyncSchedule(["g0", "x", "g1"], {}, names, moves, (n,), bucketed=bucketed,
                                    first_bucket_bytes=2**20)
        carry: dict = {}
        for mb in range(m):
            env = {}
            with mode.disable():
                pieces = [shard(f, (P,), (n,), torch.Generator().manual_seed(10 * mb + i))
                          for i, f in enumerate(fulls[mb])]
            for name, piece in zip(names, pieces):
                env[name] = mode.rank_map(lambda r, p=piece: p[order[r]].clone())
            last = mb == m - 1
            run = schedule.start(comm, env, carry, sync=last)
            for step in range(3):
                run.step_done(step)
            got = run.finish()
            if not last:
                assert counter.records == [] and got == [None] * 4
                assert sorted(carry) == [0, 1, 2, 3]
        assert carry == {}  # handed to the sync
        assert len(counter.records) == (2 if bucketed else 4)
        for g, dst, *per_mb in zip(got, dsts, *fulls):
            per = {order[r]: t for r, t in g._local_tensors.items()}
            with mode.disable():
                back = unshard(per, dst, (n,), atol=1e-9, rtol=1e-9)
                assert torch.allclose(back, sum(per_mb), atol=1e-9), dst
