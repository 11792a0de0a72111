"""Prefix tiers (host, disk, warm restart) with sliding-window layer groups: each
group's blocks go down and come back under its own namespace, every group is promoted
by the same blocks, and what is read is exactly what was written."""
import numpy as np
import pytest
import torch
from transformers import DynamicCache

from pagedkv import CacheConfig, PagedKVCache
from pagedkv.integrations.transformers import PagedCache
from pagedkv.testing.sliding_models import tiny_gemma2, tiny_gemma3, tiny_mistral, tiny_qwen2

from tier_helpers import expected_kv

BS = 4
# alternating sliding/full, and 5 sliding : 1 full (Gemma 3's ratio)
LAYOUTS = {"alternating": (6, 0, 6, 0), "five-to-one": (6, 6, 6, 6, 6, 0)}


def groups_of(windows) -> int:
    return len(CacheConfig(num_layers=len(windows), num_kv_heads=2, head_dim=4, num_blocks=1,
                           layer_windows=windows).layer_groups.groups)


def make(windows, **over) -> PagedKVCache:
    opts = dict(num_layers=len(windows), num_kv_heads=2, head_dim=4, block_size=BS, dtype="float32",
                layer_windows=windows, num_blocks=12 * groups_of(windows))
    opts.update(over)
    return PagedKVCache(CacheConfig(**opts))


def fill(cache, seq, tokens) -> int:
    tokens = np.asarray(tokens, dtype=np.int32)
    cfg = cache.config
    hit = cache.add_sequence(seq, tokens)
    n = len(tokens) - hit
    slots = cache.reserve(seq, n)
    for layer in range(cfg.num_layers):
        k, v = expected_kv(tokens, layer, cfg.num_kv_heads, cfg.head_dim)
        cache.write(layer, slots, k[hit:], v[hit:])
    cache.commit(seq, n)
    return hit


def assert_kv(cache, seq, tokens) -> None:
    """Every layer reads what fill wrote: a full layer all tokens, a sliding layer the
    tokens its group holds (by position)."""
    for layer in range(cache.config.num_layers):
        k, v, _, pos = cache.gather_window([seq], layer)
        ek, ev = expected_kv(tokens, layer, 2, 4)
        assert torch.equal(k, ek[pos]) and torch.equal(v, ev[pos]), f"layer {layer}"


def flush_device(cache) -> None:
    """Every cached prefix leaves the device (it is written back to the tiers)."""
    from pagedkv.errors import OutOfBlocksError

    cache.add_sequence("flush")
    try:
        while True:                       # a block per group at a time, until none is left
            cache.reserve("flush", BS)
    except OutOfBlocksError:
        pass
    cache.free("flush")


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_evicted_hybrid_prefix_comes_back_from_host_then_disk_then_after_restart(tmp_path, layout):
    windows = LAYOUTS[layout]
    g = groups_of(windows)                                 # a group a table (and a chain in each tier)
    opts = dict(prefix_host_blocks=4 * g, prefix_disk_dir=str(tmp_path / "tier"), prefix_disk_blocks=16 * g)
    a = np.arange(100, 117, dtype=np.int32)                # 4 full blocks + 1 token
    with make(windows, **opts) as cache:
        assert fill(cache, "a", a) == 0
        cache.free("a")
        flush_device(cache)
        assert cache.match_prefix(a) == 16
        assert fill(cache, "a", a) == 16                  # every group's chain, from the host tier
        assert cache.stats().host_hit_tokens == 16
        assert_kv(cache, "a", a)
        cache.check_invariants()
        cache.free("a")
        b = np.arange(500, 533, dtype=np.int32)           # fills the host tier: a moves on to disk
        fill(cache, "b", b)
        cache.free("b")
        flush_device(cache)
        assert fill(cache, "a", a) == 16
        assert cache.stats().disk_hit_tokens >= 16
        assert_kv(cache, "a", a)
        cache.free("a")
        cache.check_invariants()
    with make(windows, **opts) as again:                  # warm restart on the same directory
        assert again.match_prefix(a) == 16
        assert fill(again, "a", a) == 16
        assert again.stats().disk_hit_tokens == 16
        assert_kv(again, "a", a)
        again.free("a")
        again.check_invariants()


def test_a_group_missing_from_the_tier_limits_the_hit(tmp_path):
    """The hit is what every group can reach: a group whose chain is gone costs it."""
    windows = LAYOUTS["alternating"]
    a = np.arange(100, 117, dtype=np.int32)
    with make(windows, prefix_host_blocks=16) as cache:
        fill(cache, "a", a)
        cache.free("a")
        flush_device(cache)
        host = cache._tiers.host
        ns = host.namespace(cache._tiers.namespaces.key_of(1 << 24), create=False)   # group 1's chain
        chain = host.index.lookup(a, ns, host.ns_hashes[ns], 4)
        for slot in reversed(chain[2:]):                  # its third block and the one below it go
            host.index.remove(slot)
        assert cache.match_prefix(a) == 8
        assert fill(cache, "a", a) == 8
        assert_kv(cache, "a", a)
        cache.free("a")


def test_pinned_hybrid_prefix_survives_in_every_group():
    windows = LAYOUTS["five-to-one"]
    a = np.arange(100, 117, dtype=np.int32)
    with make(windows, prefix_host_blocks=4 * groups_of(windows) + 8) as cache:
        fill(cache, "a", a)
        cache.free("a")
        assert cache.pin_prefix(a) == 16
        flush_device(cache)
        for start in range(200, 400, 40):                 # churn: other prefixes pass through the host tier
            fill(cache, "x", np.arange(start, start + 17, dtype=np.int32))
            cache.free("x")
            flush_device(cache)
        assert fill(cache, "a", a) == 16
        assert_kv(cache, "a", a)
        cache.free("a")
        cache.unpin_prefix(a)


MODELS = {"mistral": lambda: tiny_mistral(window=8), "gemma2": lambda: tiny_gemma2(window=8),
          "gemma3": lambda: tiny_gemma3(window=8), "qwen2": lambda: tiny_qwen2(window=8)}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_greedy_after_a_warm_restart_matches_dynamic_cache(tmp_path, name):
    """A sliding model's prompt is computed, offloaded to disk, and served to a new
    cache on the same directory; greedy tokens equal DynamicCache's both times."""
    model, _ = MODELS[name]()
    ids = torch.randint(3, 250, (1, 29), generator=torch.Generator().manual_seed(4))
    gen = dict(max_new_tokens=16, do_sample=False, attention_mask=torch.ones_like(ids))
    want = model.generate(ids, past_key_values=DynamicCache(config=model.config), **gen).tolist()

    def run():
        cfg = CacheConfig.from_hf_config(model.config, num_blocks=96, block_size=BS, dtype=torch.float32,
                                         prefix_disk_dir=str(tmp_path / "tier"), prefix_disk_blocks=256,
                                         prefix_tier_write="through")
        with PagedKVCache(cfg) as kv:
            with PagedCache(kv) as cache:
                hit = cache.admit(ids)
                out = model.generate(ids, past_key_values=cache, **gen).tolist()
            return hit, out, kv.stats().disk_hit_tokens

    first = run()
    second = run()
    assert first[1] == want and second[1] == want
    assert first[0] in (0, [0]) and second[2] >= 24, (first[0], first[2], second[0], second[2])
