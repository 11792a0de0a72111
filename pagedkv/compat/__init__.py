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

Core calls these adapters work around (they would make them thinner):

- ``BlockPool.allocate_ids(block_ids) -> None``: allocate exactly these free blocks,
  all or nothing (``InvalidBlockError`` naming the first that is not free). Seed 002's
  contiguous runs could then live in pagedkv's pool (a run is ``allocate_ids(range(s,
  s + n))`` after a first-fit scan of ``states()``), and compaction could place blocks
  without staging the free queue.
- ``PagedKVCache.relocate(seq_id, moves) -> None`` (``moves``: int32 ``[P, 2]`` of
  (old block, new free block) of that sequence's table): validate all, copy the KV of
  each pair across all layers, swap the table entries, release the old blocks; token
  counts, token ids, namespace and priorities untouched. Compaction now frees and
  re-adds the sequence, staging the pool's free queue itself (see
  ``ContinuousBatchKVCacheManager.compact_cache``); it is the one place an adapter
  still allocates on ``cache.pool`` directly, until the core's ``relocate()`` and
  ``compact()`` replace it. It uses only the cache's public API otherwise
  (``PagedKVCache.lock``, ``sequence_info``).
"""
from __future__ import annotations

import importlib

__all__ = ["continuous_batching", "block_manager", "cortex", "mini_vllm"]


def __getattr__(name: str):
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
