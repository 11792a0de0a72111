"""Host tier: preempted sequences park their KV in host blocks and come back later.

``swap_out`` copies a sequence's committed KV to host blocks (one batched copy over all
layers), then frees its device blocks (full ones stay cached on the device until
evicted). ``swap_in`` allocates device blocks, copies the KV back and re-registers the
full blocks for prefix reuse. Both are all or nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

import numpy as np

from pagedkv._core.pool import BlockPool
from pagedkv.errors import InternalError, OutOfBlocksError, SequenceNotFoundError

__all__ = ["HostTier"]


@dataclass
class _Swapped:
    host_blocks: np.ndarray   # int32 host block ids, in token order
    tokens: np.ndarray        # known token ids
    num_computed: int
    ns_id: int
    ns_hash: int
    priority: int


class HostTier:
    def __init__(self, cache, num_blocks: int):
        self.cache = cache
        self.pool = BlockPool(num_blocks)
        self.swapped: Dict[int, _Swapped] = {}

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    def holds(self, key: int) -> bool:
        return key in self.swapped

    def swap_out(self, key: int) -> int:
        cache = self.cache
        tables = cache.tables
        if key not in tables:
            raise SequenceNotFoundError(cache._seq_id(key))
        info = tables.info(key)
        computed = info["num_computed"]
        n = -(-computed // cache.config.block_size)
        device_blocks = tables.blocks(key)[:n]
        if n > self.pool.num_free_blocks:
            raise OutOfBlocksError(n, self.pool.num_free_blocks, "swap_out to the host tier")
        host_blocks = self.pool.allocate(n)
        if cache.store is not None and n:
            import torch

            pairs = np.stack([device_blocks, host_blocks], axis=1).astype(np.int64)
            cache.store.offload(torch.from_numpy(pairs))
        tokens = tables.tokens(key)
        self.swapped[key] = _Swapped(host_blocks, tokens, computed, info["namespace"],
                                     cache._namespace(*cache._ns_names[info["namespace"]])[1],
                                     info["priority"])
        released = info["num_blocks"]
        tables.remove(np.array([key], dtype=np.int64), internal=True)
        return released

    def swap_in(self, key: int) -> int:
        cache = self.cache
        tables = cache.tables
        rec = self.swapped.get(key)
        if rec is None:
            raise SequenceNotFoundError(cache._seq_id(key))
        n = len(rec.host_blocks)
        if n > cache.pool.num_free_blocks:
            raise OutOfBlocksError(n, cache.pool.num_free_blocks, "swap_in from the host tier")
        keys = np.array([key], dtype=np.int64)
        tables.add(key, rec.tokens, rec.ns_id, rec.ns_hash, rec.priority, False)
        tables.reserve(keys, rec.num_computed, internal=True)
        if cache._tiers is not None:
            cache._tiers.sync()     # prefix blocks it evicted go down before the load overwrites them
        device_blocks = tables.blocks(key)
        if cache.store is not None and n:
            import torch

            pairs = np.stack([rec.host_blocks, device_blocks], axis=1).astype(np.int64)
            cache.store.load(torch.from_numpy(pairs))
        tables.commit(keys, rec.num_computed, internal=True)
        if cache._tiers is not None:
            cache._tiers.sync()
        self.pool.free(rec.host_blocks)
        del self.swapped[key]
        return n

    def discard(self, key: int) -> None:
        rec = self.swapped.pop(key)
        self.pool.free(rec.host_blocks)

    def check_invariants(self) -> None:
        held = sum(len(r.host_blocks) for r in self.swapped.values())
        if held != self.pool.num_in_use_blocks:
            raise InternalError(f"host tier: swapped sequences hold {held} blocks, pool has "
                                f"{self.pool.num_in_use_blocks} in use")
        self.pool.check_invariants()
