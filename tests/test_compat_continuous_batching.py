"""pagedkv.compat.continuous_batching (seed 000) on a real PagedKVCache (the seed mocked it).

Threaded tests are in tests/test_threads.py."""
import dataclasses
from datetime import timedelta

import numpy as np
import pytest
import torch

from pagedkv import CacheConfig, PagedKVCache
from pagedkv.compat.continuous_batching import (CacheAllocation, CachePage, ContinuousBatchKVCacheManager,
                                                KVCacheConfiguration)
from pagedkv.errors import InvalidArgumentError, OutOfBlocksError, SequenceExistsError

BS, NB, H, D, LAYERS = 4, 32, 2, 3, 2


def make_cache(store=True, **kw):
    cfg = CacheConfig(num_layers=LAYERS, num_kv_heads=H, head_dim=D, block_size=BS, num_blocks=NB,
                      dtype="float32", **kw)
    return PagedKVCache(cfg, allocate_store=store)


def make(store=True, **overrides):
    cache = make_cache(store)
    overrides.setdefault("initial_pages_per_request", 2)
    overrides.setdefault("max_pages_per_request", 6)
    return ContinuousBatchKVCacheManager(cache, KVCacheConfiguration.for_cache(cache, **overrides))


def release_all(m):
    for rid in m.requests():
        assert m.release_cache(rid)
    others = m.cache.sequences()          # sequences the test made beside the manager
    if others:
        m.cache.free(others)


def snapshot(m):
    c = m.cache
    return (c.pool.free_block_queue().tolist(), sorted(map(str, c.sequences())),
            {r: c.block_table(r).tolist() for r in m.requests()}, m.get_current_usage_bytes())


# ---- configuration ---------------------------------------------------------------------------
def test_default_configuration_is_the_seeds():
    d = KVCacheConfiguration.DEFAULT
    assert (d.page_size_tokens, d.initial_pages_per_request, d.max_pages_per_request, d.cache_block_size_bytes,
            d.target_utilization, d.enable_compaction) == (16, 16, 256, 1024, 0.85, True)
    assert d.page_size_bytes == 16 * 1024
    assert KVCacheConfiguration() == d


def test_configuration_validates():
    with pytest.raises(InvalidArgumentError, match=r"page_size_tokens: expected an int >= 1, got 0"):
        KVCacheConfiguration(page_size_tokens=0)
    with pytest.raises(InvalidArgumentError, match=r"target_utilization: expected a fraction in \[0, 1\], got 1.5"):
        KVCacheConfiguration(target_utilization=1.5)
    with pytest.raises(InvalidArgumentError, match=r"enable_compaction: expected True or False, got 1"):
        KVCacheConfiguration(enable_compaction=1)


def test_page_size_must_be_the_block_size():
    cache = make_cache()
    with pytest.raises(InvalidArgumentError, match=r"config.page_size_tokens: expected the cache's block_size \(4\), got 16"):
        ContinuousBatchKVCacheManager(cache, KVCacheConfiguration.DEFAULT)
    m = ContinuousBatchKVCacheManager(cache)
    assert m.config == KVCacheConfiguration.for_cache(cache)
    assert m.config.cache_block_size_bytes == cache.config.bytes_per_token
    with pytest.raises(InvalidArgumentError, match=r"paged_cache: expected a PagedKVCache, got str"):
        ContinuousBatchKVCacheManager("cache")


# ---- allocation ------------------------------------------------------------------------------
def test_allocate_returns_bytes_and_records_pages():
    m = make()
    page_bytes = BS * m.cache.config.bytes_per_token
    assert m.allocate_cache("r1", 10) == 3 * page_bytes       # ceil(10 / 4) = 3 pages
    a = m.get_allocation("r1")
    assert isinstance(a, CacheAllocation) and a.request_id == "r1" and a.page_count == 3
    blocks = m.cache.block_table("r1").tolist()
    assert a.pages == tuple(CachePage(i, i * BS, BS, b) for i, b in enumerate(blocks))
    assert a.pages[2].end_token == 12 and m.cache.num_reserved("r1") == 12
    assert (a.total_tokens_allocated, a.total_bytes_allocated) == (12, 3 * page_bytes)
    assert timedelta(0) <= a.age < timedelta(minutes=1)
    release_all(m)


def test_page_count_is_clamped_between_initial_and_max():
    m = make()
    assert m.allocate_cache("zero", 0) // m.config.page_size_bytes == 2    # initial pages
    assert m.allocate_cache("huge", 1000) // m.config.page_size_bytes == 6  # max pages
    assert m.get_allocation("huge").page_count == 6
    release_all(m)


def test_failed_allocation_rolls_back():
    m = make(max_pages_per_request=40)
    m.allocate_cache("a", 30 * BS)
    before = snapshot(m)
    with pytest.raises(OutOfBlocksError, match=r"reserve needs 3 block\(s\), 2 free"):
        m.allocate_cache("b", 3 * BS)
    assert snapshot(m) == before and "b" not in m.cache and m.get_allocation("b") is None
    m.cache.check_invariants()
    release_all(m)


def test_duplicate_and_invalid_requests():
    m = make()
    m.allocate_cache("a", 4)
    m.cache.add_sequence("engine-owned")
    before = snapshot(m)
    for rid in ("a", "engine-owned"):
        with pytest.raises(SequenceExistsError, match=rf"request_id: expected a new sequence id, got '{rid}'"):
            m.allocate_cache(rid, 4)
    with pytest.raises(InvalidArgumentError, match=r"max_tokens: expected an int >= 0, got -1"):
        m.allocate_cache("c", -1)
    for call in (lambda: m.allocate_cache(["c"], 4), lambda: m.release_cache(["a"]),
                 lambda: m.try_extend_cache(["a"], 4), lambda: m.get_allocation(["a"])):
        with pytest.raises(InvalidArgumentError, match=r"request_id: expected a hashable id, got list"):
            call()
    assert snapshot(m) == before
    release_all(m)


# ---- release and usage ------------------------------------------------------------------------
def test_release_and_usage_tracking():
    m = make()
    pb = m.config.page_size_bytes
    assert m.get_current_usage_bytes() == 0
    m.allocate_cache(1, 12)
    m.allocate_cache(2, 20)
    assert m.get_current_usage_bytes() == (3 + 5) * pb
    assert m.release_cache(1) is True
    assert m.get_current_usage_bytes() == 5 * pb and 1 not in m.cache
    assert m.release_cache(1) is False and m.release_cache("never") is False
    assert m.release_cache(2) is True
    assert m.get_current_usage_bytes() == 0 and m.cache.pool.num_free_blocks == NB
    m.cache.check_invariants()


# ---- extension ------------------------------------------------------------------------------------
def test_extend_adds_pages_up_to_the_cap():
    m = make()
    m.allocate_cache("a", 8)                        # 2 pages
    assert m.try_extend_cache("a", 5)               # + 2 pages
    assert m.get_allocation("a").page_count == 4
    assert m.try_extend_cache("a", 100)             # capped: + 2 pages
    assert m.get_allocation("a").page_count == 6
    before = snapshot(m)
    assert not m.try_extend_cache("a", 1)           # at the maximum
    assert not m.try_extend_cache("a", 0)
    assert not m.try_extend_cache("unknown", 4)
    assert snapshot(m) == before
    with pytest.raises(InvalidArgumentError, match=r"additional_tokens: expected an int >= 0, got -4"):
        m.try_extend_cache("a", -4)
    release_all(m)


def test_extend_failure_changes_nothing():
    m = make(max_pages_per_request=40)
    m.allocate_cache("a", 29 * BS)
    m.allocate_cache("b", 2 * BS)
    before = snapshot(m)
    assert not m.try_extend_cache("b", 2 * BS)       # needs 2 blocks, 1 free
    assert snapshot(m) == before
    assert m.try_extend_cache("b", 1)
    release_all(m)


# ---- compaction -------------------------------------------------------------------------------------
def fill(m, rid):
    """Write distinct K/V into every reserved slot of ``rid``; returns what was written per layer."""
    n = m.cache.num_reserved(rid)
    slots = m.cache.slot_mapping(rid, 0, n)
    written = []
    for layer in range(LAYERS):
        k = torch.randn(n, H, D)
        m.cache.write(layer, slots, k, -k)
        written.append(k)
    return written


def test_compaction_moves_blocks_low_and_preserves_kv():
    m = make()
    for rid, tokens in (("a", 8), ("b", 8), ("c", 12), ("d", 8)):
        m.allocate_cache(rid, tokens)
    m.cache.commit(["c"], [5])
    data = {rid: fill(m, rid) for rid in ("c", "d")}
    m.release_cache("a")
    m.release_cache("b")
    before = {rid: m.cache.block_table(rid).tolist() for rid in ("c", "d")}
    assert before == {"c": [4, 5, 6], "d": [7, 8]}
    pairs = m.compact_cache()
    # Highest first into the lowest holes: 8->0, 7->1, 6->2, 5->3; block 4 stays.
    assert pairs.dtype == np.int32 and pairs.tolist() == [[8, 0], [7, 1], [6, 2], [5, 3]]
    after = {rid: m.cache.block_table(rid).tolist() for rid in ("c", "d")}
    assert after == {"c": [4, 3, 2], "d": [1, 0]}
    for rid in ("c", "d"):
        k, v = m.cache.gather(rid, 0)
        assert torch.equal(k, data[rid][0]) and torch.equal(v, -data[rid][0])
        assert torch.equal(m.cache.gather(rid, 1)[0], data[rid][1])
        assert [p.block_index for p in m.get_allocation(rid).pages] == after[rid]
    assert (m.cache.num_reserved("c"), m.cache.num_tokens("c"), m.cache.num_tokens("d")) == (12, 5, 0)
    m.cache.check_invariants()
    assert m.compact_cache().shape == (0, 2)        # nothing left to lower
    assert m.allocate_cache("e", 8) and m.try_extend_cache("c", 4)
    m.cache.check_invariants()
    release_all(m)


def test_compaction_skips_when_disabled_or_utilization_is_high():
    m = make(target_utilization=0.5)
    for rid in range(8):
        m.allocate_cache(rid, 8)                    # 16 of 32 blocks
    for rid in range(6):
        m.release_cache(rid)
    m.allocate_cache("big", 6 * BS)                 # utilization 10 / 32
    m.config = dataclasses.replace(m.config, enable_compaction=False)
    before = snapshot(m)
    assert m.compact_cache().shape == (0, 2) and snapshot(m) == before
    m.config = dataclasses.replace(m.config, enable_compaction=True, target_utilization=0.25)
    assert m.utilization() == 10 / 32
    assert m.compact_cache().shape == (0, 2) and snapshot(m) == before
    m.config = dataclasses.replace(m.config, target_utilization=0.5)
    assert len(m.compact_cache()) > 0
    assert max(max(m.cache.block_table(r).tolist()) for r in m.requests()) == 9
    with pytest.raises(InvalidArgumentError, match=r"config: expected a KVCacheConfiguration, got dict"):
        m.config = {}
    release_all(m)


def test_compaction_leaves_shared_and_foreign_blocks_alone():
    m = make(initial_pages_per_request=1)
    m.allocate_cache("gap", 8)                      # blocks 0-1
    m.allocate_cache("shared", 8)                   # blocks 2-3
    m.cache.commit(["shared"], [8])
    m.cache.fork("shared", "child")                 # ref_cnt 2: not movable
    m.cache.add_sequence("foreign")
    m.cache.reserve(["foreign"], [4])               # block 4, not this manager's
    m.allocate_cache("mine", 4)                     # block 5
    m.release_cache("gap")
    shared, foreign = m.cache.block_table("shared").tolist(), m.cache.block_table("foreign").tolist()
    pairs = m.compact_cache()
    assert pairs.tolist() == [[5, 0]]
    assert m.cache.block_table("shared").tolist() == shared and m.cache.block_table("foreign").tolist() == foreign
    assert m.cache.block_table("mine").tolist() == [0]
    m.cache.check_invariants()
    release_all(m)


def test_compaction_without_a_store_returns_the_copies_owed():
    m = make(store=False, initial_pages_per_request=1)
    m.allocate_cache("a", 4)
    m.allocate_cache("b", 8)
    m.release_cache("a")
    pairs = m.compact_cache()
    assert pairs.tolist() == [[2, 0]] and sorted(m.cache.block_table("b").tolist()) == [0, 1]
    m.cache.check_invariants()
    release_all(m)


def test_swapped_out_requests_hold_no_device_pages():
    cache = make_cache(host_num_blocks=8)
    m = ContinuousBatchKVCacheManager(cache, KVCacheConfiguration.for_cache(cache, initial_pages_per_request=1))
    pb = m.config.page_size_bytes
    m.allocate_cache("a", 3 * BS)
    m.allocate_cache("b", BS)
    cache.commit(["a"], [BS + 1])
    cache.swap_out("a")
    assert m.get_current_usage_bytes() == pb and m.get_allocation("a").pages == ()
    assert not m.try_extend_cache("a", BS)
    m.release_cache("b")
    assert m.compact_cache().shape == (0, 2)        # a swapped request is not moved
    cache.swap_in("a")                              # back with its committed tokens' pages
    assert m.get_allocation("a").page_count == 2 and m.get_current_usage_bytes() == 2 * pb
    assert m.release_cache("a") and cache.pool.num_free_blocks == NB
    cache.check_invariants()
