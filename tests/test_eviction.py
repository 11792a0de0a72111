"""Each eviction policy shows its order; referenced and pinned blocks are never evicted."""
import numpy as np
import pytest

from pagedkv import BlockPool, CacheConfig, PagedKVCache
from pagedkv.errors import InvalidArgumentError, OutOfBlocksError


def cached_free(pool, ids, cls=None):
    pool.mark_cached(ids)
    pool.free(ids, cls)


def test_lru_evicts_least_recently_freed_first():
    pool = BlockPool(4)
    a = pool.allocate(4)
    cached_free(pool, [2])
    cached_free(pool, [0])
    cached_free(pool, [3, 1])
    assert pool.free_block_queue().tolist() == [2, 0, 3, 1]
    pool.touch([0])                   # a hit: 0 leaves the queue...
    pool.free([0])                    # ...and is freed again: now most recently used
    assert pool.allocate(3).tolist() == [2, 3, 1]
    assert pool.num_evictions == 3


def test_priority_evicts_lowest_class_first_lru_within_a_class():
    pool = BlockPool(6, "priority", priority_classes=3)
    pool.allocate(6)
    cached_free(pool, [0, 1], 2)      # prefix pages
    cached_free(pool, [2, 3], 0)      # old pages
    cached_free(pool, [4, 5], 1)      # recent pages
    assert pool.free_lists() == [[], [2, 3], [4, 5], [0, 1]]
    assert pool.allocate(5).tolist() == [2, 3, 4, 5, 0]


def test_priority_default_rule_prefix_over_recent_over_old_and_pins():
    cfg = CacheConfig(num_layers=1, num_kv_heads=1, head_dim=4, block_size=4, num_blocks=12,
                      eviction="priority")
    cache = PagedKVCache(cfg, allocate_store=False, )
    cache.tables  # noqa: B018
    prompt = np.arange(8, dtype=np.int32)               # 2 prompt (prefix) blocks
    cache.add_sequence(1, prompt)
    cache.reserve(1, 8)
    cache.commit(1, 8)
    toks = np.arange(100, 124, dtype=np.int32)          # 6 generated blocks: 2 old + 4 recent
    for t in toks:
        cache.advance([1], [int(t)])
    cache.commit(1, 1)
    blocks = cache.block_table(1).tolist()
    assert len(blocks) == 8
    assert cache.pin_prefix(prompt[:4]) == 4            # pin the first prefix block
    cache.free(1)
    order = cache.pool.free_lists()
    assert order[1] == [blocks[3], blocks[2]]           # old pages go first (tail first)
    assert order[2] == [blocks[7], blocks[6], blocks[5], blocks[4]]   # then recent pages
    assert order[3] == [blocks[1]]                      # prefix pages last; blocks[0] is pinned
    assert blocks[0] not in cache.pool.free_block_queue().tolist()
    cache.add_sequence(2)
    with pytest.raises(OutOfBlocksError):
        cache.reserve(2, 12 * 4)                        # the pinned block can't be taken
    cache.reserve(2, 11 * 4)
    assert cache.match_prefix(prompt) == 4              # the pinned prefix block survived
    cache.free(cache.sequences())


def test_set_priority_for_a_token_range():
    cfg = CacheConfig(num_layers=1, num_kv_heads=1, head_dim=4, block_size=4, num_blocks=8,
                      eviction="priority")
    cache = PagedKVCache(cfg, allocate_store=False)
    cache.add_sequence(1, np.arange(16, dtype=np.int32))
    cache.reserve(1, 16)
    cache.commit(1, 16)
    b = cache.block_table(1).tolist()
    cache.set_priority(1, 0)                            # whole sequence: evict first...
    cache.set_priority(1, 2, start_token=4, end_token=8)   # ...except block 1
    cache.free(1)
    assert cache.pool.free_lists()[1] == [b[3], b[2], b[0]] and cache.pool.free_lists()[3] == [b[1]]


def test_adaptive_evicts_in_batches_under_pressure_one_at_a_time_otherwise():
    pool = BlockPool(20, "adaptive", low_watermark=0.2, high_watermark=0.5)   # 4 / 10 blocks
    ids = pool.allocate(12)
    cached_free(pool, ids)
    assert pool.num_empty_blocks == 8 and pool.num_cached_free_blocks == 12
    pool.allocate(4)                                    # 4 empty left: not below the low mark
    assert pool.num_evictions == 0
    pool.allocate(1)                                    # 3 empty < 4: batch up to 10
    st = pool.eviction_stats()
    assert pool.num_empty_blocks == 10 and st["last_eviction_batch"] == 7 and st["eviction_batches"] == 1
    assert pool.num_evictions == 7
    lru = BlockPool(20, "lru")
    ids = lru.allocate(12)
    cached_free(lru, ids)
    lru.allocate(5)
    assert lru.num_evictions == 0                       # lazy: nothing evicted while empty blocks remain
    lru.allocate(4)
    assert lru.num_evictions == 1 and lru.eviction_stats()["last_eviction_batch"] == 1


def test_frequency_keeps_a_hot_system_prompt_block_through_a_scan():
    pool = BlockPool(8, "frequency")
    hot = pool.allocate(1)
    pool.mark_cached(hot)
    for _ in range(10_000):                             # a system-prompt block hit 10,000 times
        pool.touch(hot)
        pool.free(hot)
    pool.free(hot)
    assert pool.hit_count(int(hot[0])) == 10_000
    for _ in range(20):                                 # a scan of one-off cached blocks
        scan = pool.allocate(7)
        cached_free(pool, scan)
        assert pool.block_state(int(hot[0])) == "cached_free"
    lru = BlockPool(8, "lru")
    hot = lru.allocate(1)
    lru.mark_cached(hot)
    for _ in range(100):
        lru.touch(hot)
        lru.free(hot)
    lru.free(hot)
    scan = lru.allocate(7)
    cached_free(lru, scan)
    lru.allocate(7)
    assert lru.block_state(int(hot[0])) == "in_use"     # plain LRU lost the hot block to the scan


def test_in_use_blocks_are_never_evicted_under_any_policy():
    for policy in ("lru", "priority", "adaptive", "frequency"):
        pool = BlockPool(6, policy, low_watermark=0.5, high_watermark=1.0)
        held = pool.allocate(3)
        pool.mark_cached(held)
        with pytest.raises(OutOfBlocksError):
            pool.allocate(4)
        pool.allocate(3)
        assert np.asarray(pool.ref_cnt)[held].tolist() == [1, 1, 1] and pool.num_evictions == 0


def test_unknown_policy_is_rejected():
    with pytest.raises(InvalidArgumentError, match=r"eviction: expected one of \['adaptive', 'frequency', 'lru', 'priority'\], got 'fifo'"):
        BlockPool(4, "fifo")
