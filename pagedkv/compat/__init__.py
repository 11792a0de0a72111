"""The seeds' APIs on pagedkv: thin adapters that keep each seed's semantics.

- seed 000, :mod:`pagedkv.compat.continuous_batching`: ``ContinuousBatchKVCacheManager``,
  ``KVCacheConfiguration``, ``CacheAllocation``, ``CachePage``. On a ``PagedKVCache``:
  requests are its sequences and pages its blocks; compaction is real (KV copied,
  tables rewritten).
- seed 001, :mod:`pagedkv.compat.block_manager`: ``KVCacheBlockManager``, ``MemoryBlock``,
  ``BlockAllocationResult``, ``BlockManagerStats``. On a ``BlockPool`` (the allocator)
  and a ``KVStore`` (HND arena; a block's K/V are views into it, nothing per block).
- seed 002, :mod:`pagedkv.compat.cortex`: ``KVCache``, ``KVBlockAllocator``, ``KVHandle``.
  Its own first-fit allocator of contiguous runs over a token-major arena, which is
  what makes its zero-copy ``[heads, tokens, head_dim]`` views possible.
- seed 003, :mod:`pagedkv.compat.mini_vllm`: ``CacheConfig``, ``BlockAllocator``,
  ``BlockTable``, ``KVCacheManager``. On a ``PagedKVCache`` (the manager's allocator is a
  view of its pool); a standalone ``BlockAllocator`` owns a ``BlockPool``.
- seed 004 is requirements, with no API of its own: pagedkv itself (kv_dtype, GQA,
  prefix cache, eviction policies, chunked prefill, the ops).

Each module's docstring lists where it departs from its seed and why. Submodules are
imported on first use, so ``import pagedkv.compat`` needs no torch.

Core calls the adapters use in place of their own machinery: seed 000's compaction is
``PagedKVCache.compact`` (``relocate`` underneath), and seed 002's contiguous runs come
from :class:`pagedkv.manager.buddy.BuddyAllocator` over the cache's one ``BlockPool``.
"""
from __future__ import annotations

import importlib

__all__ = ["continuous_batching", "block_manager", "cortex", "mini_vllm"]


def __getattr__(name: str):
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
