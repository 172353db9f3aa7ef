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
    buckets = gradient_buckets(syncs, (2, 2), bucket_bytes=8192)
    as_ids = sorted(sorted(g.index for g in b) for b in buckets)
    assert as_ids == [[0, 1], [2], [3], [4]]  # 5 is a reduce-scatter: on its own
