"""Caches built for tests."""
from __future__ import annotations

from pagedkv._core.prefix import PrefixIndex
from pagedkv.config.options import CacheConfig
from pagedkv.manager.cache import PagedKVCache

__all__ = ["weak_hash_cache"]


class _WeakHashCache(PagedKVCache):
    def _prefix_index(self, config: CacheConfig) -> PrefixIndex:
        return PrefixIndex(config.block_size, config.resolved_num_blocks, hash_seed=config.hash_seed,
                           weak_hash=True, events=config.enable_kv_events,
                           tier_log=config.has_prefix_tiers)


def weak_hash_cache(config: CacheConfig, *, allocate_store: bool = True) -> PagedKVCache:
    """A :class:`~pagedkv.manager.cache.PagedKVCache` whose prefix index uses the core's 4-valued
    block hash (``PrefixIndex(weak_hash=True)``): distinct prefixes collide constantly,
    so tests can prove that a collision costs a miss and never serves wrong KV.
    Never use it outside tests: every lookup degrades to token comparisons."""
    return _WeakHashCache(config, allocate_store=allocate_store)
