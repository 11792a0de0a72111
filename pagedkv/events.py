"""KV events: what a router needs to mirror which prefixes a cache holds.

Enable with ``CacheConfig(enable_kv_events=True)`` and drain with
:meth:`pagedkv.PagedKVCache.drain_events`. Consecutive stores of one chain (each
block's parent is the previous block) are grouped into one :class:`BlockStored`.

Every event carries the ``medium`` it happened in: ``"device"``, or a prefix tier
(``"host"``, ``"disk"``, ``"remote"``). Block ids are that medium's (device block ids,
tier slots); hashes are always this process's device hashes, so a router mirrors one
hash space. A device store of blocks promoted from a tier names it in
``loaded_from``: that is the tier that served the hit. A store carries its blocks'
token ids (a router may key blocks by tokens, not by this process's hashes) and, with
layer groups, the group's index.

:mod:`pagedkv.kv_events` publishes them over ZMQ in vLLM's wire format.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedkv.groups.tables import GROUP_NS_BITS

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
    token_ids: list[int] = field(default_factory=list)   # every block's tokens, in order
    group: int = 0                                       # the layer group (0 without groups)


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks were evicted from ``medium``: their hashes no longer resolve there."""

    block_hashes: list[int]
    block_ids: list[int]
    medium: str = "device"
    group: int = 0


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
    """Group the core's event records (``PrefixIndex.drain_events``, with or without
    tokens); ``namespace_of(ns_id)`` gives ``(cache_salt, adapter_id)``; a namespace id
    carries its layer group above ``GROUP_NS_BITS``."""
    kind, hashes, parents, ns, blocks, lost = records[:6]
    tokens = records[6] if len(records) > 6 else None
    out: list[KVEvent] = []
    last_ns = -1
    for i in range(len(kind)):
        k = int(kind[i])
        h, p, n, b = int(hashes[i]), int(parents[i]), int(ns[i]), int(blocks[i])
        if k == _CLEARED:
            out.append(AllBlocksCleared())
            continue
        last = out[-1] if out else None
        group = n >> GROUP_NS_BITS
        if k == _REMOVED:
            if isinstance(last, BlockRemoved) and last.group == group:
                last.block_hashes.append(h)
                last.block_ids.append(b)
            else:
                out.append(BlockRemoved([h], [b], group=group))
            continue
        toks = [] if tokens is None else tokens[i].tolist()
        # grouped by namespace id: equal-looking namespaces (adapter 1 vs True) differ
        if isinstance(last, BlockStored) and last.block_hashes[-1] == p and last_ns == n:
            last.block_hashes.append(h)
            last.block_ids.append(b)
            last.token_ids.extend(toks)
            object.__setattr__(last, "token_count", last.token_count + block_size)
        else:
            namespace = namespace_of(n)
            out.append(BlockStored([h], None if p == root else p, block_size,
                                   None if n == 0 else namespace, [b],
                                   token_ids=toks, group=group))
            last_ns = n
    if lost:
        out.append(EventsLost(int(lost)))
    return out
