import time

from autopar.ir.placements import R, S
from autopar.passes.cost.reshard_route import _block_permutations, route


def test_nested_shards_gathered_in_ascending_order_need_a_local_permutation():
    # (S(0), S(0)) -> (R, R) on 2 x 4, ascending: gathering axis 0 first interleaves the blocks
    steps, perms = route((S(0), S(0)), (R, R), (4, 3), (2, 4))
    assert steps == [(0, R), (1, R)]
    assert perms == {0: [0, 2, 4, 6, 1, 3, 5, 7]}
    # inner axis first: the blocks stay in order
    assert _block_permutations((S(0), S(0)), (R, R), [(1, R), (0, R)], (4, 3), (2, 4)) == {}


def test_no_single_permutation_falls_back_to_another_order():
    # (S(0), S(0)) -> (R, S(0)): gathering axis 0 first leaves each rank other blocks
    assert _block_permutations((S(0), S(0)), (R, S(0)), [(0, R)], (4,), (2, 4)) is None
    assert _block_permutations((R, S(0)), (S(0), S(0)), [(0, S(0))], (4,), (2, 4)) is None


def test_eight_thousand_devices_route_in_milliseconds():
    # every rank's block list used to be simulated one by one: 8,192 ranks x 8,192 blocks
    mesh = (16, 64, 8)
    t = time.perf_counter()
    perms = _block_permutations((S(0), S(0), S(0)), (R, R, R), [(0, R), (1, R), (2, R)],
                                (4, 8), mesh)
    assert time.perf_counter() - t < 1.0
    assert sorted(perms[0]) == list(range(8192))
    # rank (c0, c1, c2) holds block c0*512 + c1*8 + c2; gathering axis 0, then 1, then 2 lists
    # it at position c2*1024 + c1*16 + c0
    assert perms[0] == [c2 * 1024 + c1 * 16 + c0
                        for c0 in range(16) for c1 in range(64) for c2 in range(8)]
