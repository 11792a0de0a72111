"""KV events of the tiers: the device's, then every tier's stores and removals, in order.

Hashes are always this process's device hashes (a router mirrors one hash space); a
tier block's device hash is the one its copy source had, or is recomputed from the
tokens of its chain. See :mod:`pagedkv.events`.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from pagedkv.events import AllBlocksCleared, BlockRemoved, BlockStored, events_from_records
from pagedkv.tiers.base import Handle, PrefixTier

__all__ = ["TierEvents"]


class TierEvents:
    """The event buffer of one :class:`~pagedkv.tiers.PrefixTiers`.

    Args:
        index: the device prefix index (its events, its hashes).
        namespaces: the device namespace registry view (``name``, ``hash_of_key``, ``name_of_key``).
        block_size: tokens per block.
    """

    def __init__(self, index, namespaces, block_size: int):
        self.index = index
        self.namespaces = namespaces
        self.bs = block_size
        self.buffer: list = []
        self.dev_hash: dict[tuple[PrefixTier, Handle], int] = {}

    def pull_device(self, promoted: dict[int, str] | None = None) -> None:
        events = events_from_records(self.index.drain_events(tokens=True), self.namespaces.name, self.bs, self.index.root)
        if promoted:
            events = [e for ev in events for e in _split_loaded(ev, promoted)]
        self.buffer.extend(events)

    def drain(self) -> list:
        self.pull_device()
        out, self.buffer = self.buffer, []
        return out

    def cleared(self, medium: str) -> None:
        self.buffer.append(AllBlocksCleared(medium=medium))

    def forget(self, tier: PrefixTier, handle: Handle) -> None:
        self.dev_hash.pop((tier, handle), None)

    def forget_tier(self, tier: PrefixTier) -> None:
        for k in [k for k in self.dev_hash if k[0] is tier]:
            del self.dev_hash[k]

    def device_hash(self, tier: PrefixTier, handle: Handle) -> int | None:
        """This process's device hash of a tier block, from its copy source or its chain
        (None: the tier cannot name its chain, e.g. a remote block another host wrote)."""
        h = self.dev_hash.get((tier, handle))
        if h is None:
            chain = tier.chain(handle)
            recs = [tier.record(s) for s in chain]
            if not chain or any(r is None for r in recs):
                return None
            toks = np.concatenate([r.tokens for r in recs])        # type: ignore[union-attr]  # checked above
            ns_hash = self.namespaces.hash_of_key(recs[-1].ns_key)  # type: ignore[union-attr]
            for s, hs in zip(chain, self.index.hash_tokens(toks, ns_hash).tolist()):
                self.dev_hash[(tier, s)] = hs
            h = self.dev_hash[(tier, handle)]
        return h

    def tier_block(self, tier: PrefixTier, handle: Handle, stored: bool) -> None:
        """A block was stored into (or removed from) ``tier``."""
        h = self.device_hash(tier, handle)
        if h is None:
            return
        last = self.buffer[-1] if self.buffer else None
        rec = tier.record(handle)
        if rec is None:
            return
        group = group_of_key(rec.ns_key)
        if not stored:
            if isinstance(last, BlockRemoved) and last.medium == tier.medium and last.group == group:
                last.block_hashes.append(h)
                last.block_ids.append(_id(handle))
            else:
                self.buffer.append(BlockRemoved([h], [_id(handle)], medium=tier.medium, group=group))
            return
        ph = None if rec.parent is None else self.device_hash(tier, rec.parent[0])
        ns = self.namespaces.name_of_key(rec.ns_key)
        if (isinstance(last, BlockStored) and last.medium == tier.medium and last.block_hashes[-1] == ph
                and last.namespace == ns and last.group == group):
            last.block_hashes.append(h)
            last.block_ids.append(_id(handle))
            last.token_ids.extend(rec.tokens.tolist())
            object.__setattr__(last, "token_count", last.token_count + self.bs)
        else:
            self.buffer.append(BlockStored([h], ph, self.bs, ns, [_id(handle)], medium=tier.medium,
                                           token_ids=rec.tokens.tolist(), group=group))


def _id(handle: Handle) -> int:
    """A block id for an event: a slot, or the first 8 bytes of a digest (signed int64)."""
    if isinstance(handle, (bytes, bytearray)):
        return int.from_bytes(bytes(handle[:8]), "big", signed=True)
    return int(handle)


def group_of_key(ns_key: bytes) -> int:
    """The layer group of a tier namespace key (the inverse of
    :func:`pagedkv.groups.tables.group_key`: group 0 keeps the cache's key)."""
    head, sep, tail = ns_key.rpartition(b"\x00layer-group:")
    return int(tail) if sep and tail.isdigit() else 0


def _split_loaded(event, promoted: dict[int, str]):
    """A device BlockStored of promoted blocks, split by the tier each block came from."""
    if not isinstance(event, BlockStored) or not any(b in promoted for b in event.block_ids):
        return [event]
    out: list[Any] = []
    parent = event.parent_block_hash
    per = event.token_count // len(event.block_ids)
    for i, (h, b) in enumerate(zip(event.block_hashes, event.block_ids)):
        src = promoted.get(b)
        last = out[-1] if out else None
        toks = event.token_ids[i * per:(i + 1) * per]
        if last is not None and last.loaded_from == src:
            last.block_hashes.append(h)
            last.block_ids.append(b)
            last.token_ids.extend(toks)
            object.__setattr__(last, "token_count", last.token_count + per)
        else:
            out.append(BlockStored([h], parent, per, event.namespace, [b], medium=event.medium, loaded_from=src,
                                   token_ids=list(toks), group=event.group))
        parent = h
    return out
