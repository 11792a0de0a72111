"""What every lower prefix tier has: a chain index, arenas shaped like the device's, and
a namespace registry.

A tier's arenas mirror the KV store's, whatever they are (data, then quantization
scales and zero points): one tensor per store arena, ``[num_layers, capacity, ...]``
with the store's per-block shape, so one block moves with all of its scales in a single
``ops.swap_blocks`` call.
"""
from __future__ import annotations

from typing import Literal, overload

import numpy as np
import torch

from pagedkv import ops
from pagedkv._core.prefix import hash_bytes
from pagedkv.tiers.chain import ChainIndex

__all__ = ["Tier", "mirror_arenas"]


def mirror_arenas(store_arenas: list[torch.Tensor], capacity: int, *, pin: bool) -> list[torch.Tensor]:
    """Zeroed CPU arenas with ``capacity`` blocks, one per store arena."""
    out = []
    for a in store_arenas:
        shape = (a.shape[0], capacity) + tuple(a.shape[2:])
        out.append(torch.zeros(shape, dtype=a.dtype, pin_memory=pin))
    return out


class Tier:
    """A lower prefix tier. Subclasses fill ``arenas`` and ``index`` and may persist.

    Attributes:
        medium: ``"host"`` or ``"disk"`` (the name KV events and stats use).
        index: the :class:`ChainIndex` over the tier's slots.
        arenas: ``[num_layers, capacity, ...]`` tensors matching the store's arenas.
    """

    medium = ""

    def __init__(self):
        self.index: ChainIndex
        self.arenas: list[torch.Tensor] = []
        # the model-precision sink/window rows of the tier's slots, where the tier keeps
        # them (host: a RecentWindow over its slots; disk: DiskRows, in its records);
        # None: its blocks come back codes only
        self.window = None
        self.ns_ids: dict[bytes, int] = {}
        self.ns_keys: list[bytes] = []
        self.ns_hashes: list[int] = []
        self.num_hit_tokens = 0       # tokens promoted from this tier
        self.num_written = 0          # blocks copied into this tier
        self.num_corrupt = 0          # blocks refused at read (disk: checksum)

    @property
    def capacity(self) -> int:
        return self.index.capacity

    @overload
    def namespace(self, key: bytes, create: Literal[True]) -> int: ...
    @overload
    def namespace(self, key: bytes, create: bool) -> int | None: ...

    def namespace(self, key: bytes, create: bool) -> int | None:
        """The tier's id of a namespace key (None when unknown and not created)."""
        ns = self.ns_ids.get(key)
        if ns is None and create:
            ns = len(self.ns_keys)
            self.ns_ids[key] = ns
            self.ns_keys.append(key)
            self.ns_hashes.append(hash_bytes(key))
            self._namespace_added(key)
        return ns

    def _namespace_added(self, key: bytes) -> None:
        pass

    def read(self, slots: list[int], dst_arenas: list[torch.Tensor], dst_blocks: list[int]) -> None:
        """Copy these slots' KV (all arenas, all layers) into ``dst_blocks``."""
        pairs = torch.tensor(list(zip(slots, dst_blocks)), dtype=torch.int64).reshape(-1, 2)
        ops.swap_blocks(self.arenas, dst_arenas, pairs)

    def write(self, src_arenas: list[torch.Tensor], src_blocks: list[int], slots: list[int]) -> None:
        """Copy ``src_blocks`` of ``src_arenas`` into these slots."""
        pairs = torch.tensor(list(zip(src_blocks, slots)), dtype=torch.int64).reshape(-1, 2)
        ops.swap_blocks(src_arenas, self.arenas, pairs)

    def verify(self, slot: int) -> bool:
        """Whether a slot's data may be read (the disk tier checks its checksum)."""
        return True

    def written(self, slots: np.ndarray) -> None:
        """The data of these new slots has landed (the disk tier also seals them)."""
        self.num_written += len(slots)

    def cleared(self) -> None:
        """Every slot was emptied (the disk tier persists that)."""

    def close(self) -> None:
        pass
