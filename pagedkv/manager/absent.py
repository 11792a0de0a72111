"""Stand-ins for the parts a cache was configured without: no prefix tiers
(:class:`NoTiers`), no host tier (:class:`NoHost`), no KV store (:class:`OwedCopies`).

Each answers the interface of the part it stands for, as that part would if it held
nothing, so the manager calls it without asking whether the part exists.
"""
from __future__ import annotations

import numpy as np

from pagedkv.errors import InvalidArgumentError, expected
from pagedkv.events import KVEvent, events_from_records

__all__ = ["NoTiers", "NoHost", "StoreCopies", "OwedCopies"]


class NoTiers:
    """No prefix tiers below the device (:class:`~pagedkv.tiers.PrefixTiers`' interface):
    nothing to promote, copy down, match or pin; KV events come from the device index."""

    host = None
    disk = None

    def __init__(self, index, names, block_size: int):
        self.index = index
        self.names = names          # ``name(ns_id)`` of device namespace ids (per group with layer groups)
        self.block_size = block_size

    def promote(self, key: int, tokens: np.ndarray, ns_id: int, hit: int, max_blocks: int | None = None) -> int:
        return hit

    def sync(self) -> None:
        pass

    def match(self, tokens: np.ndarray, ns_key: bytes, ns_id: int | None = None) -> int:
        return 0

    def pin(self, tokens: np.ndarray, ns_key: bytes, pin: bool) -> int:
        return 0

    def clear(self) -> None:
        pass

    def drain_events(self) -> list[KVEvent]:
        return events_from_records(self.index.drain_events(), self.names.name, self.block_size, self.index.root)

    def stats(self) -> list:
        return []

    def check_invariants(self) -> None:
        pass

    def close(self) -> None:
        pass


class NoHost:
    """No host tier (:class:`~pagedkv.tiers.swap.HostSwap`'s interface): nothing is ever
    swapped out, and swapping is refused."""

    num_swapped = 0
    num_blocks_in_use = 0

    def __init__(self):
        self.swapped: dict = {}     # key -> record of what is swapped out: nothing, ever

    @staticmethod
    def require() -> None:
        raise InvalidArgumentError(expected("config.host_num_blocks", "> 0 for swapping", 0))

    @staticmethod
    def holds(key: int) -> bool:
        return False

    def discard(self, key: int) -> None:
        raise KeyError(key)

    def check_invariants(self) -> None:
        pass


class StoreCopies:
    """Copy-on-write and moved blocks' KV, copied in the store at once."""

    def __init__(self, store):
        self.store = store

    def copy(self, pairs: np.ndarray) -> None:
        import torch

        self.store.copy_blocks(torch.from_numpy(pairs))

    @staticmethod
    def take() -> np.ndarray:
        return np.empty((0, 2), dtype=np.int32)


class OwedCopies:
    """A bookkeeping-only cache owes the copies to its caller's own KV store
    (``PagedKVCache.take_copies``)."""

    def __init__(self):
        self.pending: list[np.ndarray] = []

    def copy(self, pairs: np.ndarray) -> None:
        self.pending.append(pairs)

    def take(self) -> np.ndarray:
        pending = self.pending
        out = np.concatenate(pending) if pending else np.empty((0, 2), dtype=np.int32)
        pending.clear()
        return out
