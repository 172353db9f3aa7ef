import torch

from autopar.ir.graph import TensorMeta
from autopar.ir.placements import Partial, R, S
from autopar.passes.cost.buckets import (
    BucketKind,
    GradSync,
    bucket_collectives,
    bucket_kind,
    gradient_buckets,
)
from autopar.passes.cost.cost_model import sum_axes

P = Partial()


def test_only_pure_all_reduce_moves_can_be_bucketed():
    assert sum_axes((P, R), (R, R)) == (0,)
    assert sum_axes((P, S(0)), (R, S(0))) == (0,)
    assert sum_axes((P, P), (R, R)) == (0, 1)
    assert sum_axes((P, R), (S(0), R)) is None  # a reduce-scatter
    assert sum_axes((S(0), R), (R, R)) is None  # a gather
    assert sum_axes((R, R), (R, R)) is None  # nothing to do


def test_buckets_fill_in_order_up_to_the_size_and_split_by_axes_and_dtype():
    m = TensorMeta((1024,), torch.float32)  # 4 KiB
    half = TensorMeta((1024,), torch.bfloat16)
    syncs = [GradSync(0, m, (P, R), (R, R)), GradSync(1, m, (P, R), (R, R)),
             GradSync(2, m, (P, R), (R, R)), GradSync(3, m, (R, P), (R, R)),
             GradSync(4, half, (P, R), (R, R)), GradSync(5, m, (P, R), (S(0), R))]
    buckets = gradient_buckets(syncs, (2, 2), bucket_bytes=8192, first_bucket_bytes=8192)
    as_ids = sorted(sorted(g.index for g in b) for b in buckets)
    # filled from the last gradient back, as the backward produces them; closed when full
    assert as_ids == [[0], [1, 2], [3], [4], [5]]  # 5 is a reduce-scatter: a bucket of its own


def test_the_first_bucket_is_smaller_so_its_all_reduce_starts_early():
    m = TensorMeta((1024,), torch.float32)  # 4 KiB each
    syncs = [GradSync(i, m, (P,), (R,)) for i in range(6)]
    buckets = gradient_buckets(syncs, (2,), bucket_bytes=16384, first_bucket_bytes=4096)
    assert [[g.index for g in b] for b in buckets] == [[5], [4, 3, 2, 1], [0]]
    # a bucket closes once it holds its size, so a large gradient joins the first one
    syncs[4] = GradSync(4, TensorMeta((4096,), torch.float32), (P,), (R,))
    buckets = gradient_buckets(syncs, (2,), bucket_bytes=16384, first_bucket_bytes=8192)
    assert [[g.index for g in b] for b in buckets] == [[5, 4], [3, 2, 1, 0]]


def test_single_reduce_scatters_are_bucketed_by_axis_whatever_dim_they_shard():
    assert bucket_kind((P, R), (R, R)) == BucketKind("all_reduce", (0,))
    assert bucket_kind((P, R), (S(1), R)) == BucketKind("reduce_scatter", (0,), 1)
    assert bucket_kind((R, P), (S(0), S(0))) is None  # two axes change
    assert bucket_kind((P, S(0)), (S(0), S(0))) is None  # nested: axis 1 splits dim 0 too
    assert bucket_kind((S(0), R), (R, R)) is None  # a gather
    m = TensorMeta((8, 4), torch.float32)  # 128 B
    syncs = [GradSync(0, m, (P,), (S(0),)), GradSync(1, m, (P,), (S(1),)),
             GradSync(2, m, (P,), (R,))]
    buckets = gradient_buckets(syncs, (2,))
    assert sorted(sorted(g.index for g in b) for b in buckets) == [[0, 1], [2]]
    rs = next(b for b in buckets if len(b) == 2)
    # each rank hands in its whole partial gradients: 2 x 128 B
    assert bucket_collectives(rs, (2,)) == [("reduce_scatter", (0,), 256.0)]
