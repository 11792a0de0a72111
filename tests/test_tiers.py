"""Prefix tiers below the device: host memory and a disk arena that survives restarts."""
import json
import os

import numpy as np
import pytest
import torch

from pagedkv import BlockRemoved, BlockStored, CacheConfig, PagedKVCache
from pagedkv.errors import InvalidArgumentError, TierFileError

from tier_helpers import SHAPE, assert_clean, assert_kv, fill, make

BS = SHAPE["block_size"]


def prompt(start: int, n: int = 13) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int32)


def flush_device(cache: PagedKVCache) -> None:
    """Push every cached prefix off the device: one sequence of unknown tokens (it
    registers nothing) takes every allocatable block."""
    cache.add_sequence("flush")
    cache.reserve("flush", cache.pool.num_free_blocks * BS)
    cache.free("flush")


def reference_kv(tokens, **cfg):
    """K/V of ``tokens`` computed from scratch in a cache without tiers (same dtypes)."""
    ref = make(num_blocks=16, **cfg)
    fill(ref, "r", tokens)
    out = [ref.gather("r", layer) for layer in range(SHAPE["num_layers"])]
    ref.free("r")
    return out


# int4/int3: grouped codes with float32 / bfloat16 parameters, rotated; head_dim 8 (int3
# packs 8 codes per 3 bytes) and no recent window, so every read is of the stored codes
LOW_BIT = dict(head_dim=8, kv_window=0, kv_sink_tokens=0)   # the tiers carry no window rows


@pytest.mark.parametrize("kv_dtype, extra", [(None, {}), ("int8", {}), ("fp8_e4m3", {}), ("int4", LOW_BIT),
                                             ("int3", LOW_BIT), ("int4", dict(LOW_BIT, kv_key_quant="block")),
                                             ("int2", LOW_BIT)],
                         ids=["float32", "int8", "fp8_e4m3", "int4", "int3", "int4-block-keys", "int2"])
def test_evicted_prefix_is_served_from_host_then_disk_then_after_restart_bit_exact(tmp_path, kv_dtype, extra):
    opts = dict(num_blocks=6, kv_dtype=kv_dtype, prefix_host_blocks=4,
                prefix_disk_dir=str(tmp_path / "tier"), prefix_disk_blocks=32, **extra)
    a = prompt(100)                                  # 3 full blocks + 1 token
    want = reference_kv(a, kv_dtype=kv_dtype, **extra)
    with make(**opts) as cache:
        assert fill(cache, "a", a) == 0
        cache.free("a")
        flush_device(cache)                          # a leaves the device: written back to host
        assert cache.match_prefix(a) == 12
        assert fill(cache, "a", a) == 12             # served from the host tier
        st = cache.stats()
        assert (st.device_hit_tokens, st.host_hit_tokens, st.disk_hit_tokens) == (0, 12, 0)
        for layer, (k, v) in enumerate(want):
            got = cache.gather("a", layer)
            assert torch.equal(got[0], k) and torch.equal(got[1], v)
        cache.free("a")
        fill(cache, "b", prompt(200, 16))            # 4 blocks: b fills the host,
        cache.free("b")
        flush_device(cache)                          # so a moves on from the host to disk
        host, disk = cache.stats().tiers
        assert (host.used_blocks, host.eviction_count, disk.used_blocks) == (4, 3, 3)
        assert fill(cache, "a", a) == 12
        st = cache.stats()
        assert (st.host_hit_tokens, st.disk_hit_tokens) == (12, 12)
        for layer, (k, v) in enumerate(want):
            got = cache.gather("a", layer)
            assert torch.equal(got[0], k) and torch.equal(got[1], v)
        cache.free("a")
        assert_clean(cache)
    with make(**opts) as again:                      # a new cache on the same directory
        assert fill(again, "a", a) == 12
        assert again.stats().disk_hit_tokens == 12
        for layer, (k, v) in enumerate(want):
            got = again.gather("a", layer)
            assert torch.equal(got[0], k) and torch.equal(got[1], v)
        again.free("a")
        assert_clean(again)


def test_restart_in_a_new_process_reuses_the_disk_tier(tmp_path):
    import subprocess
    import sys
    import textwrap

    here = os.path.dirname(os.path.abspath(__file__))
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {here!r})
        import numpy as np
        from tier_helpers import assert_kv, fill, make
        a = np.arange(100, 113, dtype=np.int32)
        with make(num_blocks=4, prefix_disk_dir={str(tmp_path)!r}, prefix_disk_blocks=16) as c:
            hit = fill(c, "a", a)
            assert_kv(c, "a", a)
            c.free("a")
            fill(c, "f", np.arange(9000, 9016, dtype=np.int32))   # evicts a to disk
            c.free("f")
            print(hit, c.stats().disk_hit_tokens)
    """)
    runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
            for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr
    assert runs[0].stdout.split() == ["0", "0"]
    assert runs[1].stdout.split() == ["12", "12"]     # the second process hit the first one's prefix


def test_write_through_copies_on_registration():
    with make(num_blocks=8, prefix_host_blocks=8, prefix_tier_write="through") as cache:
        fill(cache, "a", prompt(100))
        assert cache.stats().tiers[0].used_blocks == 3        # before any eviction
        assert cache.stats().eviction_count == 0
        cache.free("a")
        assert_clean(cache)
    with make(num_blocks=8, prefix_host_blocks=8) as back:
        fill(back, "a", prompt(100))
        assert back.stats().tiers[0].used_blocks == 0         # write-back: nothing yet
        back.free("a")


def test_an_ancestor_still_on_the_device_is_copied_with_its_evicted_child():
    with make(num_blocks=6, prefix_host_blocks=8) as cache:
        a = prompt(100)
        fill(cache, "a", a)
        cache.free("a")                                       # tail first: a's third block is the LRU
        fill(cache, "b", prompt(7000, 16))                    # three empty blocks + a's third block
        assert len(cache.index.match(a)) == 2                 # the device kept a's first two
        assert cache.stats().tiers[0].used_blocks == 3        # the evicted block and its ancestors
        cache.free("b")
        # device holds a's first blocks; the host serves the rest of the chain
        assert fill(cache, "a2", a) == 12
        assert_kv(cache, "a2", a)
        cache.free("a2")
        assert_clean(cache)


@pytest.mark.parametrize("seed", range(3))
def test_weak_hash_collisions_in_every_tier_cost_misses_never_wrong_kv(tmp_path, seed):
    """A 4-valued hash on the device and in both tiers: almost every lookup collides.
    Prompts share prefixes; every admission's KV must be exactly the prompt's."""
    rng = np.random.default_rng(seed)
    stems = [rng.integers(0, 3, size=rng.integers(4, 12)).astype(np.int32) for _ in range(4)]

    def draw():
        tail = rng.integers(0, 3, size=rng.integers(1, 10)).astype(np.int32)
        return np.concatenate([stems[rng.integers(len(stems))], tail])

    with make(num_blocks=10, weak_hash=True, prefix_host_blocks=6, prefix_disk_dir=str(tmp_path),
              prefix_disk_blocks=12, host_num_blocks=8,
              prefix_tier_write=("back", "through")[seed % 2]) as cache:
        hits = 0
        for i in range(60):
            tokens = draw()
            hits += fill(cache, i, tokens)
            assert_kv(cache, i, tokens)
            if rng.random() < 0.3:
                flush_device(cache)                       # every cached block goes down
            if rng.random() < 0.3:                    # preempt it while others churn the tiers
                cache.swap_out(i)
                other = draw()
                hits += fill(cache, "other", other)
                assert_kv(cache, "other", other)
                cache.free("other")
                cache.swap_in(i)
                assert_kv(cache, i, tokens)
            cache.free(i)
        st = cache.stats()
        assert st.hit_tokens == hits
        assert st.host_hit_tokens + st.disk_hit_tokens > 0   # the tiers did serve hits
        assert_clean(cache)


def test_weak_hash_collision_in_the_host_tier_is_a_miss():
    with make(num_blocks=4, weak_hash=True, prefix_host_blocks=8) as cache:
        a = np.array([1, 0, 0, 0, 9], dtype=np.int32)           # block sums 1
        b = np.array([0, 0, 0, 1, 9], dtype=np.int32)           # same weak hash, other tokens
        fill(cache, "a", a)
        cache.free("a")
        flush_device(cache)
        assert cache.stats().tiers[0].used_blocks == 1
        assert cache.match_prefix(b) == 0                         # the hash hits, the tokens do not
        assert fill(cache, "b", b) == 0
        assert_kv(cache, "b", b)
        cache.free("b")
        assert fill(cache, "a", a) == 4                           # a itself still hits
        assert_kv(cache, "a", a)
        cache.free("a")
        assert_clean(cache)


def _scan(cache, hot, rounds_hot, cold_prompts):
    for r in range(rounds_hot):
        fill(cache, "hot", hot)
        cache.free("hot")
        flush_device(cache)
    for i, p in enumerate(cold_prompts):
        fill(cache, f"cold{i}", p)
        cache.free(f"cold{i}")
        flush_device(cache)


def test_frequency_policy_keeps_the_hot_prefix_through_a_scan():
    hot = prompt(1, 9)                                             # 2 full blocks
    cold = [prompt(1000 + 20 * i, 9) for i in range(8)]
    kept = {}
    for policy in ("lru", "frequency"):
        with make(num_blocks=4, prefix_host_blocks=6, prefix_tier_eviction=policy) as cache:
            _scan(cache, hot, 4, cold)
            before = cache.stats().host_hit_tokens
            fill(cache, "hot", hot)
            kept[policy] = cache.stats().host_hit_tokens - before
            assert_kv(cache, "hot", hot)
            cache.free("hot")
            assert_clean(cache)
    assert kept == {"lru": 0, "frequency": 8}


def test_lru_policy_keeps_the_recently_used_prefix():
    hot = prompt(1, 9)
    with make(num_blocks=4, prefix_host_blocks=6) as cache:
        for i in range(8):                                         # hot is re-used between cold ones
            fill(cache, "hot", hot)
            cache.free("hot")
            flush_device(cache)
            fill(cache, f"cold{i}", prompt(1000 + 20 * i, 9))
            cache.free(f"cold{i}")
            flush_device(cache)
        assert cache.stats().host_hit_tokens == 7 * 8              # every re-use after the first
        assert_clean(cache)


def test_pinned_prefix_never_leaves_the_tier():
    hot = prompt(1, 9)
    with make(num_blocks=4, prefix_host_blocks=4) as cache:
        fill(cache, "hot", hot)
        cache.free("hot")
        flush_device(cache)                                        # hot now lives in the host only
        assert cache.pin_prefix(hot) == 8                          # pinned where it is: the host
        assert cache.stats().tiers[0].pinned_blocks == 2
        for i in range(6):                                         # far more than the host holds
            fill(cache, f"cold{i}", prompt(1000 + 20 * i, 9))
            cache.free(f"cold{i}")
            flush_device(cache)
        assert cache.stats().tiers[0].eviction_count >= 8
        assert fill(cache, "hot", hot) == 8
        assert cache.stats().host_hit_tokens == 8
        assert_kv(cache, "hot", hot)
        cache.free("hot")
        cache.unpin_prefix(hot)
        assert cache.stats().tiers[0].pinned_blocks == 0
        assert_clean(cache)


def test_promotion_is_limited_by_free_device_blocks():
    with make(num_blocks=6, prefix_host_blocks=8) as cache:
        a = prompt(100, 21)                                         # 5 full blocks
        fill(cache, "a", a)
        cache.free("a")
        flush_device(cache)
        fill(cache, "hold", prompt(9000, 16))                       # 4 blocks stay in use
        assert cache.add_sequence("a", a) == 8                     # only 2 blocks free
        cache.free(["hold", "a"])
        assert_clean(cache)


def test_events_name_the_medium_and_the_tier_that_served_the_hit():
    with make(num_blocks=6, prefix_host_blocks=8, enable_kv_events=True) as cache:
        a = prompt(100)
        fill(cache, "a", a)
        cache.free("a")
        flush_device(cache)
        events = cache.drain_events()
        host_stores = [e for e in events if isinstance(e, BlockStored) and e.medium == "host"]
        stored_hashes = [h for e in host_stores for h in e.block_hashes]
        assert cache.index.hash_tokens(a).tolist() == stored_hashes[:3]   # one device hash space
        assert any(isinstance(e, BlockRemoved) and e.medium == "device" for e in events)
        fill(cache, "a", a)
        loaded = [e for e in cache.drain_events() if isinstance(e, BlockStored) and e.loaded_from]
        assert [(e.medium, e.loaded_from, e.token_count) for e in loaded] == [("device", "host", 12)]
        cache.free("a")
        assert_clean(cache)


def test_reset_prefix_cache_clears_the_tiers(tmp_path):
    with make(num_blocks=6, prefix_host_blocks=8, prefix_disk_dir=str(tmp_path), prefix_disk_blocks=8,
              prefix_tier_write="through") as cache:
        fill(cache, "a", prompt(100))
        cache.free("a")
        cache.reset_prefix_cache()
        assert [t.used_blocks for t in cache.stats().tiers] == [0, 0]
        assert cache.match_prefix(prompt(100)) == 0
        assert_clean(cache)
    with make(num_blocks=6, prefix_disk_dir=str(tmp_path), prefix_disk_blocks=8) as again:
        assert again.match_prefix(prompt(100)) == 0                   # the reset reached the files


def test_swap_in_and_advance_keep_tiers_exact():
    with make(num_blocks=9, prefix_host_blocks=8, host_num_blocks=8) as cache:
        a = prompt(100)
        fill(cache, "a", a)
        cache.free("a")
        fill(cache, "s", prompt(300))
        cache.swap_out("s")
        cache.swap_in("s")           # evicts a's third block: it goes down before the load
        assert cache.stats().tiers[0].used_blocks == 3
        assert_kv(cache, "s", prompt(300))
        for _ in range(3):                                           # decode steps through advance()
            cache.advance(["s"], np.array([7], dtype=np.int32))
        assert fill(cache, "a", a) == 12
        assert_kv(cache, "a", a)
        cache.free(["s", "a"])
        assert_clean(cache)


# ---- the disk tier's files ------------------------------------------------------------------
def _disk_with_a_prefix(path, **over):
    opts = dict(num_blocks=4, prefix_disk_dir=str(path), prefix_disk_blocks=8)
    opts.update(over)
    with make(**opts) as cache:
        fill(cache, "a", prompt(100))
        cache.free("a")
        flush_device(cache)
        assert cache.stats().tiers[0].used_blocks == 3
    return opts


def test_a_corrupt_block_costs_a_miss_not_the_tier(tmp_path):
    opts = _disk_with_a_prefix(tmp_path)
    with open(tmp_path / "blocks.bin", "r+b") as f:
        f.seek(5)
        byte = f.read(1)
        f.seek(5)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.warns(RuntimeWarning, match=r"index\.bin: dropped 1 damaged record\(s\) and \d+ record\(s\) below"):
        kv = make(**opts)
    with kv:                              # slot 0 (the chain's first block) costs a miss, never the tier
        tier = kv._tiers.disk
        assert tier.num_corrupt_dropped == 1 and tier.num_corrupt == 1
        assert int(tier.records["valid"].sum()) == 0                # its descendants went with it
    assert _unlocked(tmp_path)                                      # closed and released


def _unlocked(path) -> bool:
    import fcntl

    fd = os.open(path / "lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def test_a_corrupt_index_record_costs_a_miss_not_the_tier(tmp_path):
    opts = _disk_with_a_prefix(tmp_path)
    with open(tmp_path / "index.bin", "r+b") as f:
        f.seek(40)                                                   # a token of slot 0
        f.write(b"\x07")
    with pytest.warns(RuntimeWarning, match=r"dropped 1 damaged record\(s\)"):
        kv = make(**opts)
    with kv:
        assert kv._tiers.disk.num_corrupt_dropped == 1 and int(kv._tiers.disk.records["valid"].sum()) == 0


def test_a_truncated_file_is_refused(tmp_path):
    opts = _disk_with_a_prefix(tmp_path)
    os.truncate(tmp_path / "blocks.bin", 100)
    with pytest.raises(TierFileError, match=r"blocks\.bin: expected \d+ bytes, got 100 bytes"):
        make(**opts)


def test_a_tier_written_for_another_model_shape_is_refused(tmp_path):
    opts = _disk_with_a_prefix(tmp_path)
    with pytest.raises(TierFileError, match=r"meta\.json: expected a tier written for this model shape and "
                                            r"settings \(arenas=.*\), got arenas="):
        make(**dict(opts, head_dim=8))
    with pytest.raises(TierFileError, match=r"expected a tier written .* \(tag='llama'\), got tag=''"):
        make(**dict(opts, prefix_disk_tag="llama"))
    # prefix_disk_blocks is a limit the files grow to: one below what they hold is refused,
    # a larger one is taken (and written down)
    with pytest.raises(TierFileError, match=r"prefix_disk_blocks: expected >= 8 \(the slots .*index\.bin holds; "
                                            r"a smaller limit would drop blocks\), got 4"):
        make(**dict(opts, prefix_disk_blocks=4))
    with make(**dict(opts, prefix_disk_blocks=16)) as bigger:
        assert bigger.match_prefix(prompt(100)) == 12
    assert json.loads((tmp_path / "meta.json").read_text())["capacity"] == 16
    with make(**dict(opts, prefix_disk_blocks=16)) as fine:         # the settings still work
        assert fine.match_prefix(prompt(100)) == 12


def test_a_tier_open_in_another_cache_is_refused(tmp_path):
    opts = dict(num_blocks=4, prefix_disk_dir=str(tmp_path), prefix_disk_blocks=8)
    with make(**opts):
        with pytest.raises(TierFileError, match="locked by another cache"):
            make(**opts)
    with make(**opts):                                               # released on close
        pass


def test_a_block_corrupted_after_opening_is_dropped_and_costs_a_miss(tmp_path):
    opts = _disk_with_a_prefix(tmp_path)
    with make(**opts) as cache:
        rec = cache._tiers.disk.record_bytes
        with open(tmp_path / "blocks.bin", "r+b") as f:              # slot 1: the second block
            f.seek(rec + 3)
            f.write(b"\xAA\xBB")
        a = prompt(100)
        assert fill(cache, "a", a) == 4                              # the first block only
        assert_kv(cache, "a", a)
        disk = cache.stats().tiers[0]
        assert disk.corrupt_blocks == 1
        cache.free("a")
        assert_clean(cache)


def test_tier_options_are_validated():
    base = dict(SHAPE, num_blocks=4)
    with pytest.raises(InvalidArgumentError, match="prefix_tier_write: expected 'back' or 'through', got 'later'"):
        CacheConfig(**base, prefix_host_blocks=4, prefix_tier_write="later")
    with pytest.raises(InvalidArgumentError, match="prefix_tier_eviction: expected 'lru' or 'frequency', got 'arc'"):
        CacheConfig(**base, prefix_host_blocks=4, prefix_tier_eviction="arc")
    with pytest.raises(InvalidArgumentError, match="prefix_disk_dir: expected a directory together with "
                                                   "prefix_disk_blocks > 0"):
        CacheConfig(**base, prefix_disk_blocks=4)
    with pytest.raises(InvalidArgumentError, match="prefix_host_blocks: expected an int >= 0, got -1"):
        CacheConfig(**base, prefix_host_blocks=-1)
    with pytest.raises(InvalidArgumentError, match="enable_prefix_caching: expected True with prefix tiers"):
        CacheConfig(**base, prefix_host_blocks=4, enable_prefix_caching=False)
    with pytest.raises(InvalidArgumentError, match=r"allocate_store: expected True with prefix tiers \(they hold KV\)"):
        PagedKVCache(CacheConfig(**base, prefix_host_blocks=4), allocate_store=False)
