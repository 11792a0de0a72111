"""The host-memory prefix tier: CPU arenas (pinned when the device is a GPU)."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from pagedkv.config.memory import arena_bytes, check_fits
from pagedkv.tiers.base import SlotTier, mirror_arenas
from pagedkv.tiers.chain import ChainIndex, slot_dtype

__all__ = ["HostPrefixTier"]


class HostPrefixTier(SlotTier):
    medium = "host"

    def __init__(self, store_arenas: list[torch.Tensor], capacity: int, block_size: int, *,
                 eviction: str, weak_hash: bool, pin: bool,
                 on_evict: Callable[[int], None] | None = None, window=None):
        super().__init__()
        # sized before anything is allocated: a huge prefix_host_blocks is a typed error
        check_fits("cpu", [("prefix_host_blocks", capacity,
                            sum(arena_bytes("prefix_host_blocks", capacity, (a.shape[0], capacity) + tuple(a.shape[2:]),
                                            a.element_size()) for a in store_arenas)
                            + arena_bytes("prefix_host_blocks", capacity, (capacity,), slot_dtype(block_size).itemsize))])
        self.arenas = mirror_arenas(store_arenas, capacity, pin=pin)
        records = np.zeros(capacity, dtype=slot_dtype(block_size))
        self.index = ChainIndex(records, block_size, eviction=eviction, weak_hash=weak_hash, on_evict=on_evict)
        # the sink/window rows of its slots (a host window arena sharing the store's lock)
        self.window = window
        self.lock = None if window is None else window.lock

    @property
    def nbytes(self) -> int:
        """Bytes of the tier's arenas and of its sink/window row arena (if it keeps one)."""
        rows = self.window.nbytes if self.window is not None else 0
        return sum(t.numel() * t.element_size() for t in self.arenas) + rows
