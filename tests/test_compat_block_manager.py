"""pagedkv.compat.block_manager (seed 001): KVCacheBlockManager on a BlockPool + KVStore.

Threaded tests are in tests/test_threads.py."""
import pytest
import torch

from pagedkv.compat.block_manager import (NO_FREE_BLOCKS, BlockAllocationResult, BlockManagerStats,
                                          KVCacheBlockManager, MemoryBlock)
from pagedkv.errors import InvalidArgumentError, InvalidBlockError

L, H, BS, D = 2, 3, 4, 5


def make(total=8, **kw):
    kw.setdefault("dtype", "float32")
    return KVCacheBlockManager(total, BS, D, L, H, "cpu", **kw)


def state(m):
    return m.get_stats(), m.pool.free_block_queue().tolist(), {s: m.get_sequence_blocks(s) for s in range(4)}


def test_single_block_allocation():
    m = make()
    r = m.allocate_block(7)
    assert r == BlockAllocationResult(True, r.block_id, None) and 0 <= r.block_id < 8
    assert m.get_sequence_blocks(7) == [r.block_id]
    blk = m.get_block(r.block_id)
    assert isinstance(blk, MemoryBlock)
    assert (blk.block_id, blk.sequence_id, blk.block_size, blk.is_allocated, blk.token_count) == (r.block_id, 7, BS, True, 0)
    assert m.allocated_blocks == 1 and m.total_blocks == 8 and m.block_size == BS
    m.check_invariants()


def test_allocate_block_reports_failure_as_a_result():
    m = make(total=2)
    m.allocate_blocks(0, 2)
    before = state(m)
    r = m.allocate_block(1)
    assert r == BlockAllocationResult(False, -1, NO_FREE_BLOCKS) and r.error == "No free blocks available"
    assert state(m) == before


def test_allocate_blocks_is_all_or_nothing():
    m = make(total=6)
    got = m.allocate_blocks(1, 4)
    assert len(got) == 4 and len(set(got)) == 4 and m.get_sequence_blocks(1) == got
    before = state(m)
    assert m.allocate_blocks(2, 3) == []
    assert state(m) == before and m.get_sequence_blocks(2) == []
    assert m.allocate_blocks(2, 0) == [] and m.get_stats().active_sequences == 1
    assert len(m.allocate_blocks(2, 2)) == 2 and not m.has_available_blocks(1)
    m.check_invariants()


def test_sequence_tracking_and_free_block():
    m = make()
    a = m.allocate_blocks(0, 3)
    b = m.allocate_block(1).block_id
    assert m.free_block(a[1]) is True
    assert m.get_sequence_blocks(0) == [a[0], a[2]] and m.get_block(a[1]) is None
    assert m.free_block(b) is True
    assert m.get_sequence_blocks(1) == [] and m.get_stats().active_sequences == 1
    assert m.free_sequence_blocks(0) == 2 and m.free_sequence_blocks(0) == 0
    assert m.get_stats().active_sequences == 0 and m.has_available_blocks(8)
    m.check_invariants()


def test_freeing_a_free_block_is_a_no_op():
    m = make()
    b = m.allocate_block(0).block_id
    m.free_block(b)
    before = state(m)
    assert m.free_block(b) is False       # the seed enqueued it a second time
    assert m.free_sequence_blocks(3) == 0
    assert state(m) == before
    m.check_invariants()


def test_ids_are_validated():
    m = make()
    for bad in (-1, True, "0", 1.5):
        with pytest.raises(InvalidArgumentError, match=r"sequence_id: expected an int >= 0"):
            m.allocate_block(bad)
        with pytest.raises(InvalidArgumentError, match=r"sequence_id: expected an int >= 0"):
            m.get_sequence_blocks(bad)
    for bad in (-1, 8, False, None):
        with pytest.raises(InvalidBlockError, match=r"block_id: expected a block id in \[0, 8\)"):
            m.free_block(bad)
        with pytest.raises(InvalidBlockError, match=r"block_id: expected a block id in \[0, 8\)"):
            m.get_block(bad)
    with pytest.raises(InvalidArgumentError, match=r"count: expected an int >= 0, got -1"):
        m.allocate_blocks(0, -1)
    with pytest.raises(InvalidArgumentError, match=r"count: expected an int >= 0, got -1"):
        m.has_available_blocks(-1)
    assert m.get_stats().allocation_count == 0


def test_stats():
    m = make(total=10)
    a = m.allocate_blocks(0, 3)
    m.allocate_block(1)
    m.get_block(a[0]).token_count = 4
    m.get_block(a[1]).token_count = 2
    m.free_block(a[2])
    assert m.get_stats() == BlockManagerStats(total_blocks=10, allocated_blocks=3, active_sequences=2,
                                              total_tokens=6, memory_utilization_percentage=30.0,
                                              allocation_count=4, deallocation_count=1)
    with pytest.raises(InvalidArgumentError, match=rf"token_count: expected an int in \[0, {BS}\], got 5"):
        m.get_block(a[0]).token_count = 5


def test_block_views_alias_one_arena():
    m = make()
    x, y = m.allocate_blocks(0, 2)
    bx, by = m.get_block(x), m.get_block(y)
    assert bx.key_tensor.shape == (L, H, BS, D) and bx.value_tensor.shape == (L, H, BS, D)
    bx.key_tensor.fill_(1.0)
    by.value_tensor.fill_(2.0)
    arena = m._store.kv
    assert bx.key_tensor.data_ptr() - arena.data_ptr() == arena[:, x, 0].data_ptr() - arena.data_ptr()
    assert torch.equal(arena[:, x, 0], torch.ones(L, H, BS, D)) and arena[:, x, 1].abs().sum() == 0
    assert torch.equal(m.get_block(y).value_tensor, torch.full((L, H, BS, D), 2.0))
    assert arena.sum() == L * H * BS * D * 3


def test_freed_blocks_are_disposed_and_reused_zeroed():
    m = make(total=4)
    arena_ptr, arena_bytes = m._store.kv.data_ptr(), m._store.nbytes
    b = m.allocate_block(0).block_id
    view = m.get_block(b)
    view.key_tensor.fill_(3.0)
    view.token_count = 2
    m.free_block(b)
    assert not view.is_allocated
    for stale in (lambda: view.key_tensor, lambda: view.value_tensor, lambda: view.token_count):
        with pytest.raises(InvalidBlockError, match=rf"block: expected an allocated block, got block {b}, freed since"):
            stale()
    # No per-block tensors: many cycles leave the one arena as it was.
    for i in range(50):
        for blk in m.allocate_blocks(i, 4):
            assert m.get_block(blk).key_tensor.abs().sum() == 0   # a new block reads as zeros
            m.get_block(blk).key_tensor.fill_(float(i))
        m.free_sequence_blocks(i)
    assert (m._store.kv.data_ptr(), m._store.nbytes) == (arena_ptr, arena_bytes)
    assert m.get_stats().allocation_count == m.get_stats().deallocation_count == 201
    m.check_invariants()


def test_dispose_returns_everything_and_stops_allocation():
    m = make()
    m.allocate_blocks(0, 3)
    view = m.get_block(m.get_sequence_blocks(0)[0])
    m.dispose()
    assert m.allocated_blocks == 0 and m.get_stats().active_sequences == 0 and not view.is_allocated
    with pytest.raises(InvalidArgumentError, match=r"manager: expected a live KVCacheBlockManager, got one that was disposed"):
        m.allocate_block(0)
    with pytest.raises(InvalidArgumentError, match="disposed"):
        m.allocate_blocks(0, 1)
    m.check_invariants()
    with make() as scoped:
        scoped.allocate_block(0)
    assert scoped.allocated_blocks == 0


def test_bookkeeping_only_manager():
    m = make(allocate_tensors=False)
    b = m.allocate_block(0).block_id
    with pytest.raises(InvalidArgumentError, match=r"manager: expected a manager with block tensors, got one without \(allocate_tensors=False\)"):
        m.get_block(b).key_tensor
    m.get_block(b).token_count = 3
    assert m.get_stats().total_tokens == 3
