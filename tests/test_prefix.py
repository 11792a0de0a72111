"""Prefix caching: hashing, verified hits, namespaces, collisions, events, memory claims."""
import numpy as np
import pytest

from pagedkv import AllBlocksCleared, BlockRemoved, BlockStored, CacheConfig, PagedKVCache, PrefixIndex
from pagedkv._core.prefix import hash_bytes
from pagedkv.errors import CacheBusyError, InvalidArgumentError
from pagedkv.manager.namespaces import namespace_hash
from pagedkv.testing import weak_hash_cache


def make(num_blocks=11, block_size=16, **kw):
    cfg = CacheConfig(num_layers=1, num_kv_heads=1, head_dim=4, block_size=block_size,
                      num_blocks=num_blocks, **kw)
    return PagedKVCache(cfg, allocate_store=False)


def prefill(cache, seq, tokens, **kw):
    cached = cache.add_sequence(seq, tokens, **kw)
    cache.reserve(seq, len(tokens) - cached)
    cache.commit(seq, len(tokens) - cached)
    return cached


def test_hash_is_chained_seeded_and_namespaced():
    toks = np.arange(64, dtype=np.int32)
    a = PrefixIndex(16, 8, hash_seed=7).hash_tokens(toks)
    b = PrefixIndex(16, 8, hash_seed=7).hash_tokens(toks)
    assert a.tolist() == b.tolist() and len(a) == 4            # fixed seed: reproducible across processes
    assert PrefixIndex(16, 8, hash_seed=8).hash_tokens(toks).tolist() != a.tolist()
    assert PrefixIndex(16, 8).hash_tokens(toks).tolist() != PrefixIndex(16, 8).hash_tokens(toks).tolist()
    # chaining: the same block under another parent hashes differently
    other = toks.copy()
    other[0] = 99
    assert PrefixIndex(16, 8, hash_seed=7).hash_tokens(other)[1] != a[1]
    assert PrefixIndex(16, 8, hash_seed=7).hash_tokens(toks, ns_hash=5)[0] != a[0]


def test_issue_scenario_exact_blocks_with_11_blocks_of_16():
    cache = make()
    p1 = np.arange(55, dtype=np.int32)
    assert prefill(cache, "a", p1) == 0
    assert cache.block_table("a").tolist() == [0, 1, 2, 3]           # 55 tokens take 4 blocks
    assert cache.pool.num_free_blocks == 7
    p2 = np.concatenate([p1[:48], np.arange(500, 510, dtype=np.int32)])
    assert cache.add_sequence("b", p2) == 48                          # hits 3 blocks
    cache.reserve("b", len(p2) - 48)
    cache.commit("b", len(p2) - 48)
    assert cache.block_table("b").tolist() == [0, 1, 2, 4]           # takes 1 new one
    assert cache.pool.num_free_blocks == 6
    cache.free(["a", "b"])
    # unhashed first (3: a's partial tail, then 4: b's), then content-free blocks, then
    # cached blocks LRU with each sequence's tail before its prefix
    assert cache.pool.free_block_queue().tolist() == [4, 3, 5, 6, 7, 8, 9, 10, 2, 1, 0]
    cache.add_sequence("c")
    cache.reserve("c", 160)
    assert cache.block_table("c").tolist() == [4, 3, 5, 6, 7, 8, 9, 10, 2, 1]
    assert cache.stats().eviction_count == 2
    assert cache.match_prefix(p1) == 16                               # block 0, evicted last, still hits
    cache.check_invariants()
    cache.free(cache.sequences())


def test_hits_survive_free_until_evicted_and_never_the_whole_prompt():
    cache = make(num_blocks=16)
    p = np.arange(64, dtype=np.int32)                                 # exactly 4 full blocks
    prefill(cache, 1, p)
    cache.free(1)
    assert cache.pool.num_cached_free_blocks == 4
    # the last prompt token must be computed: an aligned, fully cached prompt reuses 3 blocks
    assert cache.add_sequence(2, p) == 48
    assert cache.num_tokens(2) == 48
    st = cache.stats()
    assert (st.hit_tokens, st.query_tokens) == (48, 128)
    cache.free(cache.sequences())


def test_seed004_memory_claim_eight_sessions_share_a_system_prompt():
    cache = make(num_blocks=256)
    system = np.arange(1024, dtype=np.int32)
    rng = np.random.default_rng(0)
    for s in range(8):
        prompt = np.concatenate([system, rng.integers(10_000, 20_000, 128, dtype=np.int32)])
        cached = prefill(cache, s, prompt)
        assert cached == (0 if s == 0 else 1024)
    # prefix_size + sum(unique): 1024/16 = 64 shared blocks + 8 x 128/16 unique blocks. The
    # last-token rule costs nothing here because every prompt extends past the shared part;
    # an aligned prompt equal to the system prompt alone would reuse 63 blocks, not 64.
    assert cache.pool.num_in_use_blocks == 64 + 8 * 8
    assert int((np.asarray(cache.pool.ref_cnt) == 8).sum()) == 64
    cache.free(cache.sequences())


def test_namespaces_never_share_and_are_domain_separated():
    cache = make(num_blocks=32)
    p = np.arange(40, dtype=np.int32)
    prefill(cache, "salted", p, cache_salt="X")
    assert cache.add_sequence("plain", p) == 0
    assert cache.add_sequence("adapter", p, adapter_id="X") == 0      # salt "X" != adapter "X"
    assert cache.add_sequence("salted2", p, cache_salt="X") == 32
    assert cache.add_sequence("mixed", p, cache_salt="X", adapter_id="X") == 0
    with pytest.raises(InvalidArgumentError, match=r"cache_salt: expected a str or None, got int"):
        cache.add_sequence("bad", p, cache_salt=5)
    assert "bad" not in cache
    cache.free(cache.sequences())


def test_weak_hash_collisions_cost_misses_never_wrong_kv():
    # A 4-valued hash: most distinct prefixes collide. Hits must still be exact.
    cfg = CacheConfig(num_layers=1, num_kv_heads=1, head_dim=4, block_size=4, num_blocks=64)
    cache = weak_hash_cache(cfg, allocate_store=False)
    rng = np.random.default_rng(1)
    stored = {}
    for s in range(40):
        p = rng.integers(0, 3, 12).astype(np.int32)
        cached = cache.add_sequence(s, p)
        blocks = cache.block_table(s).tolist()
        for i in range(cached // 4):
            assert stored[blocks[i]] == tuple(p[: (i + 1) * 4].tolist()), "collision served wrong KV"
        cache.reserve(s, len(p) - cached)
        cache.commit(s, len(p) - cached)
        for i, b in enumerate(cache.block_table(s).tolist()[:3]):
            if cache.index.is_cached(b):
                stored[b] = tuple(p[: (i + 1) * 4].tolist())
        if s >= 4:
            cache.free(s - 4)                  # keep four live sequences, recycle the rest
    assert cache.index.num_collisions > 0
    cache.check_invariants()
    cache.free(cache.sequences())


def test_fork_then_parent_fills_a_shared_block_child_copies_before_writing():
    # Regression (found by fuzz/core_fuzz.py): the child shares a block the parent later
    # fills and registers; the child's next write must go to a copy, or the registered
    # prefix KV would be overwritten.
    cache = make(num_blocks=8, block_size=4)
    cache.add_sequence("p", np.array([1, 1, 0, 1], np.int32))
    cache.reserve("p", 4)                       # slot 3 reserved before the fork: no CoW for p
    cache.commit("p", 3)
    cache.fork("p", "c")                        # shares block 0, child has 3 tokens
    cache.commit("p", 1)                        # parent fills and registers block 0
    shared = cache.block_table("p")[0]
    assert cache.index.is_cached(int(shared))
    cache.free("p")
    slots = cache.reserve("c", 1)               # the child writes position 3
    assert int(slots[0]) // 4 != shared
    assert cache.take_copies().tolist() == [[int(shared), int(slots[0]) // 4]]
    assert cache.match_prefix([1, 1, 0, 1, 9]) == 4
    cache.free("c")


def test_reset_prefix_cache_fails_while_blocks_are_held():
    cache = make()
    prefill(cache, 1, np.arange(40, dtype=np.int32))
    with pytest.raises(CacheBusyError):
        cache.reset_prefix_cache()
    cache.free(1)
    cache.reset_prefix_cache()
    assert cache.match_prefix(np.arange(40, dtype=np.int32)) == 0


def test_pinned_prefix_is_never_evicted():
    cache = make(num_blocks=6, block_size=4)
    p = np.arange(12, dtype=np.int32)
    prefill(cache, 1, p)
    assert cache.pin_prefix(p) == 12
    cache.free(1)
    cache.add_sequence(2)
    with pytest.raises(Exception):
        cache.reserve(2, 13)                    # needs 4 blocks, only 3 are evictable
    cache.reserve(2, 12)
    assert cache.match_prefix(p) == 12          # the pinned prefix survived the pressure
    cache.free(2)
    cache.unpin_prefix(p)
    cache.add_sequence(3)
    cache.reserve(3, 24)
    assert cache.match_prefix(p) == 0
    cache.free(cache.sequences())


def test_kv_events_mirror_the_cache():
    cache = make(num_blocks=6, block_size=4, enable_kv_events=True)
    p = np.arange(9, dtype=np.int32)
    prefill(cache, 1, p, cache_salt="s")
    ev = cache.drain_events()
    assert len(ev) == 1 and isinstance(ev[0], BlockStored)
    assert ev[0].parent_block_hash is None and ev[0].token_count == 8
    assert ev[0].namespace == ("s", None) and len(ev[0].block_hashes) == 2
    assert ev[0].block_hashes == cache.index.hash_tokens(p[:8], namespace_hash("s", None)).tolist()
    cache.free(1)
    cache.add_sequence(2)
    cache.reserve(2, 24)
    removed = cache.drain_events()
    assert isinstance(removed[0], BlockRemoved) and set(removed[0].block_hashes) == set(ev[0].block_hashes)
    cache.free(2)
    cache.reset_prefix_cache()
    assert cache.drain_events() == [AllBlocksCleared()]
    assert cache.drain_events() == []


def test_hash_bytes_is_stable():
    assert hash_bytes(b"abc", 1) == hash_bytes(b"abc", 1) != hash_bytes(b"abd", 1)


def test_tier_log_records_registration_lifecycle_with_tokens():
    from pagedkv import BlockPool, BlockTables

    index = PrefixIndex(4, 6, hash_seed=1, tier_log=True)
    pool = BlockPool(6, index=index)
    tables = BlockTables(pool, 4, index)
    toks = np.arange(100, 112, dtype=np.int32)
    tables.add(1, toks)
    tables.reserve(1, 12)
    tables.commit(1, 12)
    log = index.drain_tier_log()
    assert log["kind"].tolist() == [1, 1, 1]
    blocks = tables.blocks(1)
    assert log["block"].tolist() == blocks.tolist()
    assert log["parent_block"].tolist() == [-1, blocks[0], blocks[1]]
    assert log["tokens"].tolist() == toks.reshape(3, 4).tolist()
    assert log["hash"].tolist() == index.hash_tokens(toks).tolist()
    assert log["parent_hash"][1:].tolist() == log["hash"][:2].tolist()
    assert log["gen"].tolist() == [index.generation(int(b)) for b in blocks]
    assert log["lost"] == 0
    assert len(index.drain_tier_log()["kind"]) == 0          # drained
    tables.remove(1)
    tables.add(2)
    tables.reserve(2, 24)                                    # 6 blocks: evicts all three
    log = index.drain_tier_log()
    assert sorted(log["block"].tolist()) == sorted(blocks.tolist())
    assert set(log["kind"].tolist()) == {2}
    by_block = {int(b): t for b, t in zip(log["block"], log["tokens"].tolist())}
    assert by_block[int(blocks[2])] == toks[8:].tolist()
    # gen is the generation during the ended registration, one below the current one
    assert all(index.generation(int(b)) == g + 1 for b, g in zip(log["block"], log["gen"]))
    tables.remove(2)


def test_tier_log_needs_to_be_enabled():
    from pagedkv.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="tier_log: expected True to drain the tier log, got False"):
        PrefixIndex(4, 6).drain_tier_log()


def test_block_info_names_the_parent_registration():
    from pagedkv import BlockPool, BlockTables

    index = PrefixIndex(4, 6, hash_seed=1)
    pool = BlockPool(6, index=index)
    tables = BlockTables(pool, 4, index)
    tables.add(1, np.arange(8, dtype=np.int32))
    tables.reserve(1, 8)
    tables.commit(1, 8)
    first, second = tables.blocks(1).tolist()
    info = index.block_info(second)
    assert info["parent_block"] == first
    assert info["parent_generation"] == index.generation(first)
    assert index.block_info(first)["parent_block"] == -1
    tables.remove(1)
