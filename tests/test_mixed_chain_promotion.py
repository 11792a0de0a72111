"""A partly flushed device: a sliding group's blocks that left the window were released
early, so they are the first evicted (to the host tier) while the rest of its chain, and
the full group's whole chain, stay on the device. The device index cannot reach the
group's device tail (its chain starts with an evicted block), and the tier holds only
the head; admission must still hit every block that exists somewhere, each verified,
and read exactly what was written."""
import numpy as np
import pytest
import torch
from test_sliding_tiers import BS, LAYOUTS, assert_kv, fill, groups_of, make
from transformers import DynamicCache

from pagedkv import CacheConfig, PagedKVCache
from pagedkv.integrations.transformers import PagedCache
from pagedkv.testing.sliding_models import tiny_gemma2, tiny_gemma3


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


@pytest.mark.parametrize("squeezed", [11, 12])
def test_full_attention_head_evicted_first_by_priority_is_hit_whole(squeezed):
    """Full attention has the same gap when eviction order takes a chain's head first:
    a shared head freed last in the lowest priority class goes, the tail stays."""
    cfg = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=4, block_size=BS, dtype="float32", num_blocks=16,
                      prefix_host_blocks=16, eviction="priority")
    a = np.arange(100, 125, dtype=np.int32)
    with PagedKVCache(cfg) as cache:
        fill(cache, "a", a)
        fill(cache, "s", a[:9])                          # shares the head
        cache.set_priority("a", 2)
        cache.set_priority("s", 0)
        cache.free("a")
        cache.free("s")
        cache.add_sequence("x")
        for _ in range(squeezed):
            cache.reserve("x", BS)
        cache.free("x")
        assert cache.match_prefix_groups(a)["tokens"] < 8  # the head left the device
        assert_nothing_lost(cache)
        assert cache.match_prefix(a) == 24
        assert fill(cache, "b", a) == 24
        assert cache.stats().host_hit_tokens < 24        # the tail came from the device
        assert_kv(cache, "b", a)
        cache.free("b")
        cache.check_invariants()


def test_match_from_verifies_the_parent_incarnation_and_checks_its_arguments():
    from pagedkv.errors import InvalidArgumentError

    cfg = CacheConfig(num_layers=1, num_kv_heads=1, head_dim=4, block_size=BS, dtype="float32", num_blocks=8)
    a = np.arange(100, 113, dtype=np.int32)             # 3 full blocks + 1
    with PagedKVCache(cfg) as cache:
        fill(cache, "a", a)
        index = cache.index
        chain = index.match(a).tolist()
        assert len(chain) == 3
        h = index.hash_tokens(a).tolist()
        g0 = index.generation(chain[0])
        assert index.match_from(a, 1, h[0], chain[0], g0).tolist() == chain[1:]
        assert index.match_from(a, 2, h[1], chain[1], index.generation(chain[1])).tolist() == chain[2:]
        assert len(index.match_from(a, 1, h[0], chain[0], g0 + 1)) == 0     # another incarnation
        assert len(index.match_from(a, 1, h[0], chain[1], g0)) == 0         # another parent
        assert len(index.match_from(a, 1, h[0] ^ 1, chain[0], g0)) == 0     # a wrong hash: a miss
        other = a.copy()
        other[5] += 1                                     # block 1's tokens differ
        assert len(index.match_from(other, 1, h[0], chain[0], g0)) == 0
        with pytest.raises(InvalidArgumentError, match="start"):
            index.match_from(a, 0, h[0], chain[0], g0)
        with pytest.raises(InvalidArgumentError, match="parent_block"):
            index.match_from(a, 1, h[0], 8, g0)
        with pytest.raises(InvalidArgumentError, match="parent_generation"):
            index.match_from(a, 1, h[0], chain[0], -1)
        cache.free("a")
