"""The host-memory prefix tier: CPU arenas (pinned when the device is a GPU)."""
from __future__ import annotations

from typing import Callable, List, Optional

import numpy as np
import torch

from pagedkv.tiers.base import Tier, mirror_arenas
from pagedkv.tiers.chain import ChainIndex, slot_dtype

__all__ = ["HostPrefixTier"]


class HostPrefixTier(Tier):
    medium = "host"

    def __init__(self, store_arenas: List[torch.Tensor], capacity: int, block_size: int, *,
                 eviction: str, weak_hash: bool, pin: bool,
                 on_evict: Optional[Callable[[int], None]] = None):
        super().__init__()
        self.arenas = mirror_arenas(store_arenas, capacity, pin=pin)
        records = np.zeros(capacity, dtype=slot_dtype(block_size))
        self.index = ChainIndex(records, block_size, eviction=eviction, weak_hash=weak_hash, on_evict=on_evict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.arenas)
