"""PagedKVCache.relocate / compact: blocks move with their KV (every arena, element for
element), tables are rewritten, bad moves change nothing."""
import numpy as np
import pytest
import torch

from pagedkv import CacheConfig, PagedKVCache
from pagedkv.errors import ArgumentTypeError, InvalidArgumentError, InvalidBlockError, SequenceNotFoundError, ShapeError

H, D, BS = 2, 4, 4


def make(num_blocks=32, **kw):
    kw.setdefault("dtype", "float32")
    return PagedKVCache(CacheConfig(num_layers=2, num_kv_heads=H, head_dim=D, block_size=BS,
                                    num_blocks=num_blocks, **kw))


def fill(cache, seq, n, gen):
    slots = cache.reserve([seq], [n])
    for layer in range(cache.config.num_layers):
        cache.write(layer, slots, torch.randn(n, H, D, generator=gen), torch.randn(n, H, D, generator=gen))
    cache.commit([seq], [n])


def snapshot(cache):
    seqs = cache.sequences()
    kv = {s: [cache.gather(s, layer) for layer in range(cache.config.num_layers)] for s in seqs}
    return kv, {s: cache.block_table(s).copy() for s in seqs}


def assert_same_kv(cache, before):
    """The gathered KV of every sequence is what it was, element for element."""
    kv, _ = before
    for s, per_layer in kv.items():
        for layer, (k, v) in enumerate(per_layer):
            k2, v2 = cache.gather(s, layer)
            assert torch.equal(k, k2) and torch.equal(v, v2)


def test_relocate_moves_kv_in_every_arena_and_rewrites_the_table():
    gen = torch.Generator().manual_seed(0)
    cache = make(kv_dtype="int8")
    assert len(cache.store.arenas) == 3                    # data, scale, zero point
    cache.add_sequence("a")
    fill(cache, "a", 10, gen)
    old = cache.block_table("a").copy()
    raw = {int(b): [a[:, int(b)].clone() for a in cache.store.arenas] for b in old}
    before = snapshot(cache)
    free = sorted(set(range(32)) - set(old.tolist()))
    moves = np.array([[old[0], free[-1]], [old[2], free[-2]]])
    pairs = cache.relocate("a", moves)
    assert pairs.dtype == np.int32 and pairs.tolist() == moves.tolist()
    assert cache.block_table("a").tolist() == [free[-1], old[1], free[-2]]
    for o, n in pairs.tolist():
        for a, r in zip(cache.store.arenas, raw[o]):
            assert torch.equal(a[:, n], r)
        assert cache.pool.is_free(o)
    assert_same_kv(cache, before)
    assert cache.num_tokens("a") == 10 and cache.num_reserved("a") == 10
    fill(cache, "a", 3, gen)                               # the moved table keeps working
    cache.check_invariants()
    cache.free(["a"])


@pytest.mark.parametrize("bad, err, match", [
    ([[999, 20]], InvalidBlockError, "old blocks of sequence 'a'"),
    ([[0, 40]], InvalidBlockError, r"new block ids in \[0, 32\)"),
    ("x", ArgumentTypeError, "moves"),
    ([1, 2], ShapeError, r"\[P, 2\]"),
])
def test_relocate_refuses_bad_moves_and_changes_nothing(bad, err, match):
    gen = torch.Generator().manual_seed(1)
    cache = make()
    cache.add_sequence("a")
    fill(cache, "a", 8, gen)
    if isinstance(bad, list) and bad and isinstance(bad[0], list) and bad[0][0] == 0:
        bad = [[int(cache.block_table("a")[0]), 40]]
    before = snapshot(cache)
    stats = cache.pool.num_free_blocks
    with pytest.raises(err, match=match):
        cache.relocate("a", bad)
    assert cache.pool.num_free_blocks == stats
    assert np.array_equal(cache.block_table("a"), before[1]["a"])
    assert_same_kv(cache, before)
    cache.check_invariants()
    cache.free(["a"])


def test_relocate_all_or_nothing_on_a_used_target_a_repeat_and_a_shared_block():
    gen = torch.Generator().manual_seed(2)
    cache = make()
    for s in ("a", "b"):
        cache.add_sequence(s)
        fill(cache, s, 8, gen)
    a, b = cache.block_table("a"), cache.block_table("b")
    free = sorted(set(range(32)) - set(a.tolist()) - set(b.tolist()))
    before = snapshot(cache)
    with pytest.raises(InvalidBlockError, match=f"block {b[0]} at index 1, which is in use"):
        cache.relocate("a", [[a[0], free[0]], [a[1], b[0]]])
    with pytest.raises(InvalidArgumentError, match="each block at most once"):
        cache.relocate("a", [[a[0], free[0]], [a[1], free[0]]])
    with pytest.raises(InvalidArgumentError, match="each old block at most once"):
        cache.relocate("a", [[a[0], free[0]], [a[0], free[1]]])
    with pytest.raises(SequenceNotFoundError):
        cache.relocate("zz", [[a[0], free[0]]])
    cache.fork("a", "c")
    with pytest.raises(InvalidBlockError, match=f"block {a[0]} at row 0, held by 2 sequences"):
        cache.relocate("a", [[a[0], free[0]]])
    assert all(np.array_equal(cache.block_table(s), t) for s, t in before[1].items())
    assert cache.pool.is_free(free[0]) and cache.pool.is_free(free[1])
    assert_same_kv(cache, before)
    cache.check_invariants()
    cache.free(["a", "b", "c"])


def test_relocate_prefix_registered_block_in_a_namespace_stays_findable():
    gen = torch.Generator().manual_seed(3)
    cache = make(enable_prefix_caching=True)
    prompt = list(range(100, 112))
    cache.add_sequence("a", prompt, cache_salt="tenant")
    fill(cache, "a", 12, gen)
    old = cache.block_table("a").copy()
    before = snapshot(cache)
    free = sorted(set(range(32)) - set(old.tolist()))
    pairs = cache.relocate("a", [[old[0], free[-1]], [old[1], free[-2]]])
    assert_same_kv(cache, before)
    assert cache.sequence_info("a")["namespace"] == ("tenant", None)
    assert all(cache.pool.is_cached(int(b)) for b in old[:2])       # registered content kept
    cache.free(["a"])
    cache.add_sequence("b", prompt, cache_salt="tenant")            # a prefix hit on the old blocks
    assert cache.sequence_info("b")["num_prefix_hit_blocks"] == 2
    assert cache.block_table("b").tolist() == old[:2].tolist()
    for layer in range(2):
        k, v = cache.gather("b", layer, 8)
        assert torch.equal(k, before[0]["a"][layer][0][:8]) and torch.equal(v, before[0]["a"][layer][1][:8])
    cache.free(["b"])


def test_compact_moves_every_lone_block_down_and_verifies_data():
    gen = torch.Generator().manual_seed(4)
    cache = make(num_blocks=40, shuffle_free_blocks=7, enable_prefix_caching=True)
    rng = np.random.default_rng(4)
    for i in range(8):
        cache.add_sequence(i, rng.integers(0, 1000, 6).tolist())
        fill(cache, i, int(rng.integers(1, 14)), gen)
    cache.fork(0, "f")                                      # shared blocks must stay put
    for i in (1, 4, 6):
        cache.free([i])
    shared = set(cache.block_table("f").tolist())
    before = snapshot(cache)
    pairs = cache.compact()
    assert len(pairs)
    assert not shared & set(pairs[:, 0].tolist())
    assert (pairs[:, 1] < pairs[:, 0]).all()
    assert_same_kv(cache, before)
    in_use = np.flatnonzero(np.asarray(cache.pool.ref_cnt) > 0)
    lone = [b for b in in_use if b not in shared]
    holes = np.flatnonzero(cache.pool.states() == 0)
    assert not len(holes) or holes.min() > max(lone)       # no empty block below a movable one
    assert len(cache.compact()) == 0                        # a fixed point
    cache.check_invariants()
    cache.free(cache.sequences())


def test_compact_without_a_store_owes_the_copies():
    cache = PagedKVCache(CacheConfig(num_layers=1, num_kv_heads=1, head_dim=4, block_size=4, num_blocks=16,
                                     dtype="float32"), allocate_store=False)
    for s in range(4):
        cache.add_sequence(s)
        cache.reserve([s], [8])
    cache.free([0, 2])
    pairs = cache.compact()
    assert len(pairs) and np.array_equal(cache.take_copies(), pairs)
    assert sorted(np.concatenate([cache.block_table(s) for s in (1, 3)]).tolist()) == [0, 1, 2, 3]
    cache.free([1, 3])


def test_compact_only_the_sequences_named():
    gen = torch.Generator().manual_seed(5)
    cache = make(num_blocks=16)
    for s in ("gap", "a", "b"):
        cache.add_sequence(s)
        fill(cache, s, 8, gen)                              # gap 0-1, a 2-3, b 4-5
    cache.free(["gap"])
    b_before = cache.block_table("b").copy()
    before = snapshot(cache)
    with pytest.raises(SequenceNotFoundError):
        cache.compact(["a", "nope"])
    assert cache.block_table("a").tolist() == [2, 3]        # nothing moved
    pairs = cache.compact(["a"])
    assert pairs.tolist() == [[3, 0], [2, 1]]
    assert cache.block_table("a").tolist() == [1, 0] and np.array_equal(cache.block_table("b"), b_before)
    assert_same_kv(cache, before)
    cache.free(["a", "b"])
