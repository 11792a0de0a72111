"""pagedkv.compat.cortex (seed 002): contiguous runs, zero-copy views, stats and dumps."""
import io

import pytest
import torch

from pagedkv.compat.cortex import INVALID_HANDLE, BuddyBlockAllocator, KVBlockAllocator, KVCache, KVHandle
from pagedkv.config.options import CacheConfig
from pagedkv.errors import InvalidArgumentError, InvalidBlockError, SequenceExistsError, SequenceNotFoundError

L, H, D, BS = 2, 3, 4, 4


def alloc_state(a):
    return a.block_map(), a.used_blocks(), dict(a._runs)


# ---- KVBlockAllocator ------------------------------------------------------------------
def test_first_fit_reuses_the_first_hole_that_fits():
    a = KVBlockAllocator(12)
    h1, h2, h3 = a.allocate(3), a.allocate(2), a.allocate(4)
    assert [(h.start_block_index, h.num_blocks) for h in (h1, h2, h3)] == [(0, 3), (3, 2), (5, 4)]
    a.free(h2)
    assert a.allocate(3) == KVHandle(9, 3)   # the 2-block hole is too small
    assert a.allocate(1) == KVHandle(3, 1)   # first fit: the hole
    assert (a.used_blocks(), a.free_blocks(), a.total_blocks()) == (11, 1, 12)


def test_no_contiguous_run_fails_fast_and_changes_nothing():
    a = KVBlockAllocator(6)
    hs = [a.allocate(1) for _ in range(6)]
    a.free(hs[1])
    a.free(hs[3])
    a.free(hs[5])
    before = alloc_state(a)
    handle = a.allocate(2)               # 3 blocks free, none adjacent
    assert handle is INVALID_HANDLE and not handle.is_valid
    assert alloc_state(a) == before


def test_fragmentation_is_one_minus_largest_run_over_free():
    a = KVBlockAllocator(10)
    assert a.fragmentation() == 0.0
    hs = [a.allocate(2) for _ in range(5)]
    assert a.fragmentation() == 0.0 and a.largest_free_run() == 0   # nothing free
    a.free(hs[0])
    a.free(hs[2])
    a.free(hs[3])                        # free runs: [0, 2) and [4, 8)
    assert a.largest_free_run() == 4
    assert a.fragmentation() == pytest.approx(1 - 4 / 6)


def test_free_validates_the_handle():
    a = KVBlockAllocator(8)
    h = a.allocate(3)
    with pytest.raises(InvalidBlockError, match=r"handle: expected a live handle from allocate\(\) \(double free\?\), got KVHandle\(start_block_index=0, num_blocks=2\)"):
        a.free(KVHandle(0, 2))           # not the run that was handed out
    a.free(h)
    before = alloc_state(a)
    with pytest.raises(InvalidBlockError, match="double free"):
        a.free(h)
    with pytest.raises(InvalidBlockError, match="double free"):
        a.free(INVALID_HANDLE)
    with pytest.raises(InvalidArgumentError, match=r"handle: expected a KVHandle, got tuple"):
        a.free((0, 3))
    with pytest.raises(InvalidArgumentError, match=r"blocks_needed: expected an int >= 1, got 0"):
        a.allocate(0)
    assert alloc_state(a) == before


def test_block_map_dump():
    a = KVBlockAllocator(10)
    a.allocate(3)
    h = a.allocate(2)
    a.allocate(1)
    a.free(h)
    out = io.StringIO()
    a.dump_block_map(out)
    assert out.getvalue() == (
        "KVBlockAllocator State:\n"
        "  Total blocks: 10\n"
        "  Used: 4 Free: 6\n"
        "  Fragmentation: 0.33\n"
        "  Block map (. = free, X = used):\n"
        "    XXX..X....\n")
    assert a.block_map(width=4).splitlines()[-3:] == ["    XXX.", "    .X..", "    .."]


# ---- KVCache ---------------------------------------------------------------------------------
@pytest.fixture
def cache():
    return KVCache(L, H, D, BS, max_total_tokens=10 * BS + 3, dtype="float32")


def test_allocate_for_takes_one_run(cache):
    assert cache.config.num_blocks == 10          # max_total_tokens rounds down to whole blocks
    assert cache.allocate_for("a", 9)             # 3 blocks
    assert cache.allocate_for("b", 4)             # 1 block
    assert (cache.used_tokens("a"), cache.capacity("a"), cache.used_tokens("b")) == (9, 12, 4)
    assert cache.get_num_allocated_sequences() == 2 and cache.allocator.used_blocks() == 4
    with pytest.raises(SequenceExistsError, match=r"request_id: expected a new sequence id, got 'a' \(already live\)"):
        cache.allocate_for("a", 1)
    assert cache.used_tokens("a") == 9


def test_allocate_for_fails_without_a_contiguous_run(cache):
    for i in range(10):
        assert cache.allocate_for(i, BS)
    for i in (0, 2, 4, 6, 8):
        cache.free_for(i)
    state = cache.cache_stats()
    assert not cache.allocate_for("long", 2 * BS)  # 5 free blocks, no two adjacent
    assert cache.cache_stats() == state and cache.get_fragmentation() == pytest.approx(0.8)
    assert cache.allocate_for("short", BS)


def test_views_are_zero_copy_over_the_run(cache):
    cache.allocate_for("x", 2)
    cache.allocate_for("a", 6)                    # blocks [1, 3): spans two blocks
    k = cache.get_k_view("a", 1)
    assert k.shape == (H, 6, D)
    assert k.untyped_storage().data_ptr() == cache.k.untyped_storage().data_ptr()
    assert k.data_ptr() == cache.k[1, 0, BS].data_ptr()
    k.copy_(torch.arange(H * 6 * D, dtype=torch.float32).reshape(H, 6, D))
    v = cache.get_v_view("a", 1)
    v.fill_(-1.0)
    # The arena sees the writes at block * block_size + offset, per (layer, head).
    assert torch.equal(cache.k[1, 2, BS + 5], k[2, 5]) and cache.k[1, :, :BS].abs().sum() == 0
    assert cache.k[0].abs().sum() == 0 and cache.v[1, :, BS:BS + 6].eq(-1).all()
    assert torch.equal(cache.get_k_view("a", 1), k)


def test_append_token_grows_the_view_until_the_run_is_full(cache):
    cache.allocate_for("a", 6)                    # 2 blocks: capacity 8
    assert cache.get_token_offset_in_block("a") == 6 % BS
    assert cache.append_token("a")
    cache.get_k_view("a", 0)[:, -1] = 7.0         # the new token's K
    assert cache.k[0, :, 6].eq(7.0).all()
    assert cache.append_token("a") and cache.get_token_offset_in_block("a") == 0
    assert not cache.append_token("a")            # fail fast at capacity
    assert cache.used_tokens("a") == 8 and cache.get_k_view("a", 0).shape == (H, 8, D)


def test_free_for_releases_and_unknown_requests(cache):
    cache.allocate_for("a", 5)
    assert cache.free_for("a") is True and cache.free_for("a") is False
    assert cache.allocator.used_blocks() == 0
    for call in (lambda: cache.get_k_view("a", 0), lambda: cache.used_tokens("a"),
                 lambda: cache.append_token("a"), lambda: cache.get_token_offset_in_block("a")):
        with pytest.raises(SequenceNotFoundError, match=r"request_id: expected a live sequence id, got 'a' \(unknown\)"):
            call()


def test_argument_validation(cache):
    cache.allocate_for("a", 1)
    with pytest.raises(InvalidArgumentError, match=r"layer: expected an int in \[0, 2\), got 2"):
        cache.get_v_view("a", 2)
    with pytest.raises(InvalidArgumentError, match=r"initial_tokens: expected an int >= 1, got 0"):
        cache.allocate_for("b", 0)
    for call in (lambda: cache.allocate_for(["b"], 1), lambda: cache.free_for(["a"]),
                 lambda: cache.get_k_view(["a"], 0), lambda: cache.append_token(["a"])):
        with pytest.raises(InvalidArgumentError, match=r"request_id: expected a hashable id, got list"):
            call()
    assert cache.used_tokens("a") == 1 and cache.get_num_allocated_sequences() == 1
    with pytest.raises(InvalidArgumentError, match=r"max_total_tokens: expected an int >= 4, got 3"):
        KVCache(L, H, D, BS, 3)
    with pytest.raises(InvalidArgumentError, match=r"num_layers: expected an int >= 1, got 0"):
        KVCache(0, H, D, BS, 64)


def test_bytes_and_full(cache):
    per_block = 2 * L * H * BS * D * 4
    assert cache.config.bytes_per_block == per_block
    assert (cache.get_total_allocated(), cache.get_total_free()) == (0, 10 * per_block)
    assert cache.allocate_for("a", 10 * BS)
    assert cache.is_full() and cache.get_total_allocated() == 10 * per_block and cache.get_total_free() == 0
    assert not cache.allocate_for("b", 1)


def test_dump_cache_stats(cache):
    cache.allocate_for("req_001", 8)
    cache.allocate_for("req_002", 3)
    out = io.StringIO()
    cache.dump_cache_stats(out)
    mib = 2 * L * H * BS * D * 4 / 2**20
    assert out.getvalue() == (
        "=== KVCache Statistics ===\n"
        "Configuration:\n"
        f"  Layers: {L}, Heads: {H}, HeadDim: {D}\n"
        f"  BlockSize: {BS}, TotalBlocks: 10\n"
        "\n"
        "Allocation State:\n"
        "  Allocated sequences: 2\n"
        f"  Total allocated: {3 * mib:.2f} MB\n"
        f"  Total free: {7 * mib:.2f} MB\n"
        "  Fragmentation: 0.00\n"
        "\n"
        "Sequences:\n"
        "  req_001: 8/8 tokens, blocks [0, +2]\n"
        "  req_002: 3/4 tokens, blocks [2, +1]\n")


def test_from_pagedkv_config():
    cfg = CacheConfig(num_layers=L, num_kv_heads=H, head_dim=D, block_size=BS, num_blocks=5, dtype="bfloat16")
    c = KVCache.from_config(cfg)
    assert c.k.shape == (L, H, 5 * BS, D) and c.k.dtype == torch.bfloat16 and c.config.num_blocks == 5


# ---- KVCache in buddy mode -------------------------------------------------------------------
@pytest.fixture
def bcache():
    c = KVCache(L, H, D, BS, max_total_tokens=16 * BS, dtype="float32", allocator="buddy")
    yield c
    for rid in list(c._sequences):
        c.free_for(rid)
    assert c.allocator.pool.num_free_blocks == 16       # every run went back to the pool


def fill_view(cache, rid, seed):
    g = torch.Generator().manual_seed(seed)
    data = []
    for layer in range(L):
        k, v = torch.randn(H, cache.used_tokens(rid), D, generator=g), torch.randn(H, cache.used_tokens(rid), D, generator=g)
        cache.get_k_view(rid, layer).copy_(k)
        cache.get_v_view(rid, layer).copy_(v)
        data.append((k, v))
    return data


def assert_view(cache, rid, data):
    for layer, (k, v) in enumerate(data):
        n = k.shape[1]
        assert torch.equal(cache.get_k_view(rid, layer)[:, :n], k) and torch.equal(cache.get_v_view(rid, layer)[:, :n], v)


def test_buddy_runs_are_power_of_two_and_aligned(bcache):
    assert isinstance(bcache.allocator, BuddyBlockAllocator)
    assert bcache.allocate_for("a", 9)            # 3 blocks -> a run of 4
    assert bcache.allocate_for("b", 4)            # 1 block
    assert bcache._sequences["a"].handle == KVHandle(0, 4) and bcache._sequences["b"].handle == KVHandle(4, 1)
    assert bcache.capacity("a") == 12 and bcache.allocator.used_blocks() == 5
    k = bcache.get_k_view("a", 1)                 # zero copy over the run
    assert k.shape == (H, 9, D) and k.data_ptr() == bcache.k[1, 0, 0].data_ptr()
    assert not bcache.allocate_for("big", 16 * BS)


def test_buddy_grow_in_place_then_by_move_keeps_the_kv(bcache):
    bcache.allocate_for("a", 2 * BS)              # blocks 0-1
    data = fill_view(bcache, "a", 0)
    assert bcache.grow_for("a", 4 * BS)           # buddy 2-3 free: merged, no move
    assert bcache._sequences["a"].handle == KVHandle(0, 4) and bcache.capacity("a") == 4 * BS
    assert_view(bcache, "a", data)
    bcache.allocate_for("b", 4 * BS)              # blocks 4-7: a's next buddy is taken
    other = fill_view(bcache, "b", 1)
    for _ in range(2 * BS):
        assert bcache.append_token("a")
    data = fill_view(bcache, "a", 2)
    assert bcache.grow_for("a", 5 * BS)           # moves to blocks 8-15, K/V copied
    assert bcache._sequences["a"].handle == KVHandle(8, 8)
    assert_view(bcache, "a", data)
    assert_view(bcache, "b", other)
    assert not bcache.grow_for("b", 16 * BS) and bcache._sequences["b"].handle == KVHandle(4, 4)
    assert bcache.free_for("a") and bcache.free_for("b")
    assert bcache.allocator.buddy.free_candidates() == {4: [0]}


def test_buddy_mode_arguments():
    with pytest.raises(InvalidArgumentError, match=r"allocator: expected 'first_fit' or 'buddy', got 'best'"):
        KVCache(L, H, D, BS, 64, allocator="best")
    c = KVCache(L, H, D, BS, 16 * BS, dtype="float32")
    c.allocate_for("a", 1)
    with pytest.raises(InvalidArgumentError, match=r"allocator: expected 'buddy' for grow_for, got 'first_fit'"):
        c.grow_for("a", 8)
    c.free_for("a")
    b = KVCache(L, H, D, BS, 16 * BS, dtype="float32", allocator="buddy")
    b.allocate_for("a", 1)
    with pytest.raises(InvalidArgumentError, match=r"max_tokens: expected an int >= 1, got 0"):
        b.grow_for("a", 0)
    with pytest.raises(SequenceNotFoundError):
        b.grow_for("zz", 8)
    h = b._sequences["a"].handle
    b.free_for("a")
    with pytest.raises(InvalidBlockError, match=r"handle: expected a live handle"):
        b.allocator.free(h)
    assert b.allocator.pool.num_free_blocks == 16
