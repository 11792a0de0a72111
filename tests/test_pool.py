"""BlockPool: every call and every error path, messages pinned."""
import pickle

import numpy as np
import pytest

from pagedkv import BlockPool
from pagedkv.errors import (ArgumentTypeError, CacheBusyError, DTypeError, InvalidArgumentError, InvalidBlockError,
                            OutOfBlocksError, PagedKVError, ShapeError)


def test_allocate_returns_int32_ids_in_free_queue_order():
    pool = BlockPool(8)
    ids = pool.allocate(3)
    assert ids.dtype == np.int32 and ids.tolist() == [0, 1, 2]
    assert pool.num_free_blocks == 5 and pool.num_in_use_blocks == 3
    assert np.asarray(pool.ref_cnt).tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    assert pool.num_allocations == 3
    pool.check_invariants()


def test_allocate_zero_and_all():
    pool = BlockPool(4)
    assert pool.allocate(0).tolist() == []
    assert sorted(pool.allocate(4).tolist()) == [0, 1, 2, 3]
    assert pool.num_free_blocks == 0


def test_allocate_is_all_or_nothing():
    pool = BlockPool(4)
    pool.allocate(3)
    before = pool.free_block_queue().tolist()
    with pytest.raises(OutOfBlocksError, match=r"needs 2 block\(s\), 1 free") as e:
        pool.allocate(2)
    assert isinstance(e.value, MemoryError) and isinstance(e.value, PagedKVError)
    assert (e.value.needed, e.value.free) == (2, 1)
    assert pool.free_block_queue().tolist() == before and pool.num_free_blocks == 1


@pytest.mark.parametrize("bad, err", [(-1, InvalidArgumentError), (1.5, ArgumentTypeError),
                                      ("3", ArgumentTypeError), (True, ArgumentTypeError),
                                      (None, ArgumentTypeError)])
def test_allocate_rejects_bad_counts(bad, err):
    with pytest.raises(err, match=r"n: expected an int >= 0, got"):
        BlockPool(4).allocate(bad)


def test_ref_cnt_view_is_read_only_and_live():
    pool = BlockPool(4)
    view = pool.ref_cnt
    with pytest.raises(ValueError):
        view[0] = 3
    pool.allocate(1)
    assert view[0] == 1


def test_free_returns_content_free_blocks_to_the_front_in_order_given():
    pool = BlockPool(6)
    a = pool.allocate(4)                       # queue now [4, 5]
    pool.free(np.array([2, 0, 3], np.int32))
    assert pool.free_block_queue().tolist() == [2, 0, 3, 4, 5]
    assert pool.allocate(2).tolist() == [2, 0]
    assert pool.num_frees == 3
    pool.check_invariants()


def test_free_sends_cached_blocks_to_the_back_so_they_are_evicted_last():
    pool = BlockPool(6)
    ids = pool.allocate(4)
    pool.mark_cached([1, 3])
    pool.free([3, 0, 1, 2])
    # content-free 0, 2 at the front (given order), cached 3 then 1 at the back
    assert pool.free_block_queue().tolist() == [0, 2, 4, 5, 3, 1]
    assert pool.num_cached_free_blocks == 2 and pool.num_empty_blocks == 4
    assert pool.block_state(3) == "cached_free" and pool.block_state(0) == "free"
    got = pool.allocate(6).tolist()
    assert got == [0, 2, 4, 5, 3, 1]
    assert pool.num_evictions == 2 and not pool.is_cached(3)


def test_double_free_is_rejected_and_changes_nothing():
    pool = BlockPool(4)
    ids = pool.allocate(2)
    pool.free(ids[:1])
    before = (np.asarray(pool.ref_cnt).tolist(), pool.free_block_queue().tolist())
    with pytest.raises(InvalidBlockError, match=r"block_ids: expected blocks that are in use, got block 0 at index 1, which is free \(double free\?\)"):
        pool.free([1, 0])
    assert (np.asarray(pool.ref_cnt).tolist(), pool.free_block_queue().tolist()) == before


def test_duplicate_beyond_ref_cnt_is_rejected():
    pool = BlockPool(4)
    b = pool.allocate(1)
    pool.touch(b)                              # ref 2
    with pytest.raises(InvalidBlockError, match=r"at most 2 release\(s\) of block 0 \(its ref_cnt\), got 3 in this batch"):
        pool.free([0, 0, 0])
    assert pool.ref_cnt[0] == 2
    pool.free([0, 0])
    assert pool.ref_cnt[0] == 0


def test_free_rejects_out_of_range_ids():
    pool = BlockPool(4)
    pool.allocate(2)
    with pytest.raises(InvalidBlockError, match=r"block_ids: expected block ids in \[0, 4\), got 7 at index 1"):
        pool.free([0, 7])
    assert pool.ref_cnt[0] == 1


@pytest.mark.parametrize("bad, err, msg", [
    (np.array([0], np.int64), DTypeError, r"block_ids: expected a 1-D int32 array, got int64 array of shape \(1,\)"),
    (np.array([[0]], np.int32), ShapeError, r"block_ids: expected a 1-D int32 array, got int32 array of shape \(1, 1\)"),
    ([0.5], DTypeError, r"block_ids: expected a sequence of ints fitting int32, got float64 values"),
    ([2**40], InvalidArgumentError, r"block_ids: expected ints fitting int32, got an out-of-range int"),
    ("0", ArgumentTypeError, r"block_ids: expected a 1-D int32 array or a list of ints, got str"),
])
def test_free_rejects_wrong_dtypes_and_shapes(bad, err, msg):
    pool = BlockPool(4)
    pool.allocate(1)
    with pytest.raises(err, match=msg):
        pool.free(bad)
    assert pool.ref_cnt[0] == 1


def test_touch_shares_in_use_and_revives_cached_free_blocks():
    pool = BlockPool(4)
    ids = pool.allocate(2)
    pool.touch([0])
    assert pool.ref_cnt[0] == 2 and pool.num_touches == 1
    pool.mark_cached([1])
    pool.free([1])
    assert 1 in pool.free_block_queue().tolist()
    pool.touch([1])                            # O(1) removal from the middle of the queue
    assert 1 not in pool.free_block_queue().tolist() and pool.ref_cnt[1] == 1
    assert pool.hit_count(1) == 1
    pool.check_invariants()


def test_touch_rejects_content_free_blocks():
    pool = BlockPool(4)
    with pytest.raises(InvalidBlockError, match=r"block_ids: expected blocks in use or cached-free, got block 2 at index 0, which is free and holds no content"):
        pool.touch([2])
    with pytest.raises(InvalidBlockError, match=r"expected block ids in \[0, 4\), got -1 at index 0"):
        pool.touch([-1])


def test_pins_keep_cached_blocks_out_of_the_free_queue():
    pool = BlockPool(3)
    pool.allocate(3)
    pool.mark_cached([0, 1])
    pool.pin([0])
    pool.free([0, 1, 2])
    assert pool.free_block_queue().tolist() == [2, 1]      # 0 is pinned: never a victim
    assert pool.num_pinned_free_blocks == 1 and pool.num_free_blocks == 2
    with pytest.raises(OutOfBlocksError):
        pool.allocate(3)
    pool.unpin([0])
    assert pool.free_block_queue().tolist() == [2, 1, 0]
    with pytest.raises(InvalidBlockError, match=r"expected pinned blocks, got block 0, which is not pinned"):
        pool.unpin([0])
    with pytest.raises(InvalidBlockError, match=r"expected blocks holding cached content, got 2 at index 0"):
        pool.pin([2])


def test_reset_cache_needs_an_idle_pool():
    pool = BlockPool(3)
    ids = pool.allocate(2)
    pool.mark_cached(ids)
    with pytest.raises(CacheBusyError, match=r"expected no block in use, got 2 in use"):
        pool.reset_cache()
    pool.free(ids)
    pool.reset_cache()
    assert pool.num_cached_free_blocks == 0 and pool.num_empty_blocks == 3
    pool.check_invariants()


def test_allocate_many_is_one_all_or_nothing_call():
    pool = BlockPool(10)
    indptr, ids = pool.allocate_many([2, 0, 3])
    assert indptr.tolist() == [0, 2, 2, 5] and len(set(ids.tolist())) == 5
    with pytest.raises(OutOfBlocksError, match="needs 6 block"):
        pool.allocate_many([3, 3])
    assert pool.num_free_blocks == 5
    with pytest.raises(InvalidArgumentError, match=r"counts: expected block counts >= 0, got -1 at index 1"):
        pool.allocate_many([1, -1])


def test_shuffled_free_list_and_snapshot_replay():
    pool = BlockPool(16, shuffle_seed=3)
    order = pool.free_block_queue().tolist()
    assert sorted(order) == list(range(16)) and order != list(range(16))
    ids = pool.allocate(5)
    pool.mark_cached(ids[:2])
    pool.free(ids[:3])
    clone = pickle.loads(pickle.dumps(pool))
    assert clone.free_block_queue().tolist() == pool.free_block_queue().tolist()
    assert np.asarray(clone.ref_cnt).tolist() == np.asarray(pool.ref_cnt).tolist()
    assert clone.allocate(14).tolist() == pool.allocate(14).tolist()


def test_states_partition_the_pool():
    pool = BlockPool(6)
    ids = pool.allocate(4)
    pool.mark_cached(ids[:2])
    pool.free(ids[:1])
    st = pool.states()
    assert st.tolist() == [2, 1, 1, 1, 0, 0]
    assert pool.num_empty_blocks + pool.num_in_use_blocks + pool.num_cached_free_blocks == 6


def test_result_arrays_are_recycled_only_once_the_caller_dropped_them():
    pool = BlockPool(64)
    kept = pool.allocate(4)
    view = pool.allocate(4)[:2]               # a view keeps its base alive
    exported = memoryview(pool.allocate(4))   # so does a buffer export
    snapshot = (kept.tolist(), view.tolist(), exported.tolist())
    for _ in range(10):                       # many more results of the same size
        pool.free(pool.allocate(4))
    assert (kept.tolist(), view.tolist(), exported.tolist()) == snapshot
    reshaped = pool.allocate(4)
    reshaped.shape = (2, 2)                   # reassigned in place, then dropped
    del reshaped
    got = pool.allocate(4)
    assert got.shape == (4,) and got.dtype == np.int32 and got.flags.writeable
    assert len(set(got.tolist()) & set(kept.tolist() + view.tolist() + exported.tolist())) == 0


def test_take_allocates_exactly_the_ids_given_all_or_nothing():
    pool = BlockPool(8)
    pool.take(np.array([5, 2], dtype=np.int32))
    assert pool.ref_cnt.tolist() == [0, 0, 1, 0, 0, 1, 0, 0] and pool.num_free_blocks == 6
    assert not pool.is_free(5) and pool.is_free(4)
    assert 5 not in pool.free_block_queue().tolist() and 2 not in pool.allocate(6).tolist()
    pool.free(np.arange(8, dtype=np.int32))
    assert pool.num_free_blocks == 8


@pytest.mark.parametrize("ids, err, match", [
    ([1, 8], InvalidBlockError, r"block_ids: expected block ids in \[0, 8\), got 8 at index 1"),
    ([1, 3], InvalidBlockError, r"block_ids: expected free blocks, got block 3 at index 1, which is in use"),
    ([1, 1], InvalidArgumentError, r"block_ids: expected each block at most once, got block 1 repeated at index 1"),
])
def test_take_refuses_and_changes_nothing(ids, err, match):
    pool = BlockPool(8)
    pool.take([3])
    queue = pool.free_block_queue().tolist()
    with pytest.raises(err, match=match):
        pool.take(ids)
    assert pool.free_block_queue().tolist() == queue and pool.ref_cnt.tolist() == [0, 0, 0, 1, 0, 0, 0, 0]
    pool.take([1])                              # the scratch marks were cleared
    pool.free([1, 3])


def test_take_of_a_cached_free_block_evicts_it_and_pinned_ones_are_refused():
    pool = BlockPool(4)
    ids = pool.allocate(2)
    pool.mark_cached(ids)
    pool.free(ids)
    assert pool.is_cached(int(ids[0]))
    pool.take([int(ids[0])])
    assert not pool.is_cached(int(ids[0])) and pool.num_cached_free_blocks == 1
    pool.pin([int(ids[1])])
    assert not pool.is_free(int(ids[1]))
    with pytest.raises(InvalidBlockError, match=f"expected free, unpinned blocks, got block {ids[1]} at index 0, which is pinned"):
        pool.take([int(ids[1])])
    pool.unpin([int(ids[1])])
    pool.free([int(ids[0])])
