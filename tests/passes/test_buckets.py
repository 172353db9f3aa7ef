import torch

from autopar.graph import TensorMeta
from autopar.passes.buckets import GradSync, gradient_buckets, reduce_axes
from autopar.placements import Partial, R, S

P = Partial()


def test_only_pure_all_reduce_moves_can_be_bucketed():
    assert reduce_axes((P, R), (R, R)) == (0,)
    assert reduce_axes((P, S(0)), (R, S(0))) == (0,)
    assert reduce_axes((P, P), (R, R)) == (0, 1)
    assert reduce_axes((P, R), (S(0), R)) is None  # a reduce-scatter
    assert reduce_axes((S(0), R), (R, R)) is None  # a gather
    assert reduce_axes((R, R), (R, R)) is None  # nothing to do


def test_buckets_fill_in_order_up_to_the_size_and_split_by_axes_and_dtype():
    m = TensorMeta((1024,), torch.float32)  # 4 KiB
    half = TensorMeta((1024,), torch.bfloat16)
    syncs = [GradSync(0, m, (P, R), (R, R)), GradSync(1, m, (P, R), (R, R)),
             GradSync(2, m, (P, R), (R, R)), GradSync(3, m, (R, P), (R, R)),
             GradSync(4, half, (P, R), (R, R)), GradSync(5, m, (P, R), (S(0), R))]
    buckets = gradient_buckets(syncs, (2, 2), bucket_bytes=8192, first_bucket_bytes=8192)
    as_ids = sorted(sorted(g.index for g in b) for b in buckets)
    # filled from the last gradient back, as the backward produces them; closed when full
    assert as_ids == [[0], [1, 2], [3], [4]]  # 5 is a reduce-scatter: on its own


def test_the_first_bucket_is_smaller_so_its_all_reduce_starts_early():
    m = TensorMeta((1024,), torch.float32)  # 4 KiB each
    syncs = [GradSync(i, m, (P,), (R,)) for i in range(6)]
    buckets = gradient_buckets(syncs, (2,), bucket_bytes=16384, first_bucket_bytes=4096)
    assert [[g.index for g in b] for b in buckets] == [[5], [4, 3, 2, 1], [0]]
    # a bucket closes once it holds its size, so a large gradient joins the first one
    syncs[4] = GradSync(4, TensorMeta((4096,), torch.float32), (P,), (R,))
    buckets = gradient_buckets(syncs, (2,), bucket_bytes=16384, first_bucket_bytes=8192)
    assert [[g.index for g in b] for b in buckets] == [[5, 4], [3, 2, 1, 0]]
