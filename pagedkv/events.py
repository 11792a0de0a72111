"""KV events: what a router needs to mirror which prefixes a cache holds.

Enable with ``CacheConfig(enable_kv_events=True)`` and drain with
:meth:`pagedkv.PagedKVCache.drain_events`. Consecutive stores of one chain (each
block's parent is the previous block) are grouped into one :class:`BlockStored`.

Every event carries the ``medium`` it happened in: ``"device"``, or a prefix tier
(``"host"``, ``"disk"``). Block ids are that medium's (device block ids, tier slots);
hashes are always this process's device hashes, so a router mirrors one hash space.
A device store of blocks promoted from a tier names it in ``loaded_from``: that is
the tier that served the hit.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["BlockStored", "BlockRemoved", "AllBlocksCleared", "EventsLost", "KVEvent", "events_from_records"]

_STORED, _REMOVED, _CLEARED = 1, 2, 3


@dataclass(frozen=True)
class BlockStored:
    """Full blocks became reusable. ``parent_block_hash`` is None for a chain that starts
    at the root; ``namespace`` is ``(cache_salt, adapter_id)`` or None (default)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_count: int
    namespace: tuple[Any, Any] | None
    block_ids: list[int]
    medium: str = "device"
    loaded_from: str | None = None


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks were evicted from ``medium``: their hashes no longer resolve there."""

    block_hashes: list[int]
    block_ids: list[int]
    medium: str = "device"


@dataclass(frozen=True)
class AllBlocksCleared:
    """The prefix cache of ``medium`` was reset."""

    medium: str = "device"


@dataclass(frozen=True)
class EventsLost:
    """``count`` events after the preceding ones could not be kept (too many undrained,
    or no memory): a consumer mirroring the cache must resync from scratch."""

    count: int


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared | EventsLost


def events_from_records(records, namespace_of: Callable[[int], tuple[Any, Any]], block_size: int,
                        root: int) -> list[KVEvent]:
    """Group the core's event records; ``namespace_of(ns_id)`` gives ``(cache_salt, adapter_id)``."""
    kind, hashes, parents, ns, blocks, lost = records
    out: list[KVEvent] = []
    last_ns = -1
    for i in range(len(kind)):
        k = int(kind[i])
        h, p, n, b = int(hashes[i]), int(parents[i]), int(ns[i]), int(blocks[i])
        if k == _CLEARED:
            out.append(AllBlocksCleared())
            continue
        last = out[-1] if out else None
        if k == _REMOVED:
            if isinstance(last, BlockRemoved):
                last.block_hashes.append(h)
                last.block_ids.append(b)
            else:
                out.append(BlockRemoved([h], [b]))
            continue
        # grouped by namespace id: equal-looking namespaces (adapter 1 vs True) differ
        if isinstance(last, BlockStored) and last.block_hashes[-1] == p and last_ns == n:
            last.block_hashes.append(h)
            last.block_ids.append(b)
            object.__setattr__(last, "token_count", last.token_count + block_size)
        else:
            namespace = namespace_of(n)
            out.append(BlockStored([h], None if p == root else p, block_size,
                                   None if n == 0 else namespace, [b]))
            last_ns = n
    if lost:
        out.append(EventsLost(int(lost)))
    return out
