"""A partly flushed device: a sliding group's blocks that left the window were released
early, so they are the first evicted (to the host tier) while the rest of its chain, and
the full group's whole chain, stay on the device. The device index cannot reach the
group's device tail (its chain starts with an evicted block), and the tier holds only
the head; admission must still hit every block that exists somewhere, each verified,
and read exactly what was written."""
import numpy as np
import pytest
import torch
from transformers import DynamicCache

from pagedkv import CacheConfig, PagedKVCache
from pagedkv.integrations.transformers import PagedCache
from pagedkv.testing.sliding_models import tiny_gemma2, tiny_gemma3

from test_sliding_tiers import BS, LAYOUTS, assert_kv, fill, groups_of, make


def squeeze(cache, tokens, extra: int) -> None:
    """Allocate (and then free, unregistered) blocks, a block per group at a time, until
    the device alone no longer holds every group's chain of ``tokens``, then ``extra``
    more: the least recently used cached blocks are evicted to the host tier."""
    full = (len(tokens) - 1) // BS * BS
    assert min(cache.match_prefix_groups(tokens)["per_group"]) == full
    cache.add_sequence("squeeze")
    while min(cache.match_prefix_groups(tokens)["per_group"]) == full:
        cache.reserve("squeeze", BS)
    for _ in range(extra):
        cache.reserve("squeeze", BS)
    cache.free("squeeze")


def assert_nothing_lost(cache) -> None:
    # Every evicted block went to the host tier and stayed there, so every block of every
    # group's chain is on the device or in the host tier: the hit can reach the whole prompt.
    tiers = cache._tiers
    assert tiers.num_lost == 0 and tiers.host.index.num_evictions == 0


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("extra", [0, 1, 2, 3, 4])
def test_a_chain_split_between_host_and_device_is_hit_whole(layout, extra):
    windows = LAYOUTS[layout]
    g = groups_of(windows)
    a = np.arange(100, 125, dtype=np.int32)              # 6 full blocks + 1 token
    with make(windows, prefix_host_blocks=16 * g, num_blocks=16 * g) as cache:
        assert fill(cache, "a", a) == 0
        cache.free("a")
        squeeze(cache, a, extra)
        assert_nothing_lost(cache)
        assert cache.match_prefix(a) == 24
        assert fill(cache, "a", a) == 24
        assert_kv(cache, "a", a)
        cache.check_invariants()
        cache.free("a")
        assert fill(cache, "b", a) == 24                  # the promoted chain is the device's now
        assert_kv(cache, "b", a)
        cache.free("b")
        cache.check_invariants()


MODELS = {"gemma2": lambda: tiny_gemma2(window=8), "gemma3": lambda: tiny_gemma3(window=8)}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_greedy_after_a_partial_flush_matches_dynamic_cache(name):
    model, _ = MODELS[name]()
    ids = torch.randint(3, 250, (1, 29), generator=torch.Generator().manual_seed(4))
    gen = dict(max_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(ids))
    want = model.generate(ids, past_key_values=DynamicCache(config=model.config), **gen).tolist()
    cfg = CacheConfig.from_hf_config(model.config, num_blocks=128, block_size=BS, dtype=torch.float32,
                                     prefix_host_blocks=64)
    with PagedKVCache(cfg) as kv:
        with PagedCache(kv) as cache:
            cache.admit(ids)
            assert model.generate(ids, past_key_values=cache, **gen).tolist() == want
        squeeze(kv, ids[0, :29].numpy(), 1)              # the sliding groups' heads leave the device
        assert_nothing_lost(kv)
        with PagedCache(kv) as cache:
            hit = cache.admit(ids)
            assert hit in (28, [28])                     # 7 full blocks, all found somewhere
            assert model.generate(ids, past_key_values=cache, **gen).tolist() == want
