"""The tier protocol: one entry of the chain below the device (host, disk, remote, ...).

:class:`~pagedkv.tiers.PrefixTiers` holds the tiers as a list, top first, and calls only
the methods of :class:`PrefixTier`: a third (or fifth) tier is an entry, not a branch.

A tier names the blocks it holds by *handles* (a slot number for the host and disk
tiers, a chain digest for a remote one). Every handle a lookup returns was verified the
one way every tier verifies (:mod:`pagedkv.tiers.verify`): its tokens, its namespace, its
link to the previous block of the query and its tier's format; its bytes' checksum is
checked before they reach the device (:meth:`PrefixTier.verify`). A hash collision, a
damaged record or a hostile server costs a miss, never wrong KV.

Verbs (a tier may do them synchronously; a remote one does the network part in the
background, in the manner of LMCache's storage backends):

- queries: :meth:`~PrefixTier.lookup` (verified handles for a query's blocks),
  :meth:`~PrefixTier.contains` (how many consecutive blocks it holds, no data moved);
- moving payloads (:mod:`pagedkv.tiers.payload`): :meth:`~PrefixTier.load` into a
  :class:`~pagedkv.tiers.payload.Blocks`, :meth:`~PrefixTier.admit` +
  :meth:`~PrefixTier.store` + :meth:`~PrefixTier.commit` to put them (or
  :meth:`~PrefixTier.batched_put` for a query's run of blocks);
- asynchronous: :meth:`~PrefixTier.prefetch`, :meth:`~PrefixTier.get_non_blocking`;
- eviction and bookkeeping: :meth:`~PrefixTier.drop`, :meth:`~PrefixTier.clear`, pins
  and leases, :meth:`~PrefixTier.stats`, :meth:`~PrefixTier.close`.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Literal, NamedTuple, overload

import numpy as np
import torch

from pagedkv import ops
from pagedkv._core.prefix import hash_bytes
from pagedkv.tiers.chain import ROOT, ChainIndex
from pagedkv.tiers.payload import Blocks, move_rows
from pagedkv.tiers.stats import TierStats
from pagedkv.tiers.verify import ChainQuery

__all__ = ["PrefixTier", "SlotTier", "Tier", "TierRecord", "Handle", "mirror_arenas"]

#: a tier's name of a block it holds: a slot (int) for a local tier, a chain digest (bytes) for a remote one
Handle = Any


class TierRecord(NamedTuple):
    """What a tier knows of one block it holds (a copy's source)."""

    tokens: np.ndarray
    ns_key: bytes
    parent: tuple[Handle, int] | None    # (handle, stamp) of the parent; None at the root
    pins: int


def mirror_arenas(store_arenas: list[torch.Tensor], capacity: int, *, pin: bool) -> list[torch.Tensor]:
    """Zeroed CPU arenas with ``capacity`` blocks, one per store arena."""
    out = []
    for a in store_arenas:
        shape = (a.shape[0], capacity) + tuple(a.shape[2:])
        out.append(torch.zeros(shape, dtype=a.dtype, pin_memory=pin))
    return out


def _done(value) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


class PrefixTier:
    """The protocol every tier implements (see the module docstring).

    Attributes:
        medium: the tier's name in KV events and stats (``"host"``, ``"disk"``, ``"remote"``).
        num_hit_tokens: tokens promoted from this tier.
        num_written: blocks stored into it.
        num_corrupt: blocks refused at read (checksum, header).
    """

    medium = ""
    #: holding a block implies holding its whole chain (admission is chain-closed)
    chain_closed = False

    def __init__(self):
        self.num_hit_tokens = 0
        self.num_written = 0
        self.num_corrupt = 0

    # ---- queries -----------------------------------------------------------------------
    def lookup(self, query: ChainQuery, start: int, max_blocks: int, *, fetch: bool = True) -> list[Handle]:
        """Handles of the query's blocks ``start, start + 1, ...`` (at most up to block
        ``max_blocks``) that this tier holds, verified, stopping at the first it lacks.
        ``fetch``: the caller will load them (a remote tier brings the bytes now)."""
        raise NotImplementedError

    def contains(self, query: ChainQuery, start: int, max_blocks: int) -> int:
        """How many consecutive blocks from ``start`` the tier holds (no data moved)."""
        return len(self.lookup(query, start, max_blocks, fetch=False))

    def verify(self, handle: Handle) -> bool:
        """Whether a handle's bytes may be read (checksum); False counts a corrupt block."""
        return True

    # ---- payloads ------------------------------------------------------------------------
    def load(self, handles: Sequence[Handle], dst: Blocks, dst_ids: Sequence[int]) -> None:
        """Copy these blocks' payloads (data and rows) into ``dst_ids`` of ``dst``."""
        raise NotImplementedError

    def admit(self, parent: Handle | None, ns_key: bytes, tokens: np.ndarray) -> tuple[Handle | None, bool]:
        """``(handle, created)`` of the block ``tokens`` under ``parent`` (None: the root)
        in namespace ``ns_key``; a created one is held until :meth:`commit` or
        :meth:`abandon`, and its payload is owed (:meth:`store`). ``(None, False)``: not
        admitted (a collision, no room)."""
        raise NotImplementedError

    def store(self, src: Blocks, src_ids: Sequence[int], handles: Sequence[Handle]) -> None:
        """Copy ``src_ids`` of ``src`` (data and rows) into these just-admitted handles."""
        raise NotImplementedError

    def commit(self, handles: Sequence[Handle]) -> None:
        """The payloads of these admitted handles are complete: make them hits (seal, send)."""
        self.num_written += len(handles)

    def abandon(self, handles: Sequence[Handle]) -> None:
        """These admitted handles' payloads never landed: they must never be found."""

    def batched_put(self, query: ChainQuery, start: int, src: Blocks, src_ids: Sequence[int]) -> int:
        """Store the query's blocks ``start, start + 1, ...`` whose payloads are
        ``src_ids`` of ``src`` (chain-closed: the tier must hold block ``start - 1``);
        returns how many it now holds."""
        parent: Handle | None = None
        if start:
            held = self.lookup(query, start - 1, start, fetch=False)
            if not held:
                return 0
            parent = held[0]
        made: list[tuple[int, Handle]] = []
        count = 0
        try:
            for j, b in enumerate(src_ids):
                h, created = self.admit(parent, query.ns_key, query.block(start + j))
                if h is None:
                    break
                if created:
                    made.append((b, h))
                parent = h
                count += 1
            if made:
                self.store(src, [m[0] for m in made], [m[1] for m in made])
        except BaseException:
            self.abandon([m[1] for m in made])
            raise
        self.commit([m[1] for m in made])
        return count

    # ---- asynchronous verbs ------------------------------------------------------------------
    def prefetch(self, query: ChainQuery, start: int, max_blocks: int) -> None:
        """Start bringing these blocks close (a local tier: nothing to do)."""

    def get_non_blocking(self, query: ChainQuery, start: int, max_blocks: int) -> Future:
        """A future of :meth:`lookup` (with the bytes fetched)."""
        return _done(self.lookup(query, start, max_blocks))

    # ---- a handle's occupant over time -----------------------------------------------------------
    def stamp(self, handle: Handle) -> int:
        """The generation of the handle's occupant (a link remembers it)."""
        return 0

    def current(self, handle: Handle, stamp: int) -> bool:
        """Whether the handle still holds the occupant that had ``stamp``."""
        return True

    def record(self, handle: Handle) -> TierRecord | None:
        """The block a handle holds (None: unknown here, or gone)."""
        return None

    def chain(self, handle: Handle) -> list[Handle]:
        """The handles from the root down to ``handle`` (empty when unknown)."""
        return []

    # ---- pins, leases, use ---------------------------------------------------------------------
    def pin(self, handle: Handle) -> None:
        pass

    def unpin(self, handle: Handle) -> None:
        pass

    def pins(self, handle: Handle) -> int:
        return 0

    def pin_prefix(self, query: ChainQuery, pin: bool) -> int:
        """(Un)pin the query's blocks the tier holds; returns how many (0: cannot pin)."""
        return 0

    def lease(self, handles: Sequence[Handle]) -> None:
        """Hold these handles (no eviction, no reuse) until :meth:`release`."""

    def release(self, handles: Sequence[Handle]) -> None:
        pass

    def touch(self, handle: Handle, hit: bool = False) -> None:
        pass

    def set_callbacks(self, on_evict, on_removed, on_lost=None) -> None:
        """``on_evict(handle)`` before the tier drops a block to make room (the chain
        copies it down), ``on_removed(handle)`` after a block is gone (links forget it),
        ``on_lost(handles)`` when blocks this process stored turn out gone without it
        dropping them (another process or the server evicted them; None: the tier
        cannot say which, assume any), called while their records are still readable."""

    def reap(self) -> None:
        """Report (``on_lost``) what background work found gone since the last call."""

    # ---- removal, stats, close -------------------------------------------------------------------
    def subtree(self, handle: Handle) -> list[Handle]:
        """A block and the blocks hanging below it, deepest first (what :meth:`drop` removes)."""
        return [handle]

    def drop(self, handle: Handle) -> None:
        """Remove a block and what hangs below it (its bytes failed their checksum)."""

    def clear(self) -> list[Handle]:
        """Forget every block (this process's view of a shared tier); returns those held."""
        return []

    @property
    def source_blocks(self) -> Blocks | None:
        """Where the tier's payloads are, as a copy source (None: never a source)."""
        return None

    def stats(self) -> TierStats:
        raise NotImplementedError

    def check_invariants(self) -> None:
        pass

    def close(self) -> None:
        pass


class SlotTier(PrefixTier):
    """A local tier of numbered slots: a :class:`~pagedkv.tiers.chain.ChainIndex` over
    arenas shaped like the store's, and a namespace registry.

    A tier's arenas mirror the KV store's, whatever they are (data, then quantization
    scales and zero points): one tensor per store arena, ``[num_layers, capacity, ...]``
    with the store's per-block shape, so one block moves with all of its scales in a
    single ``ops.swap_blocks`` call.

    Attributes:
        index: the :class:`ChainIndex` over the tier's slots.
        arenas: ``[num_layers, capacity, ...]`` tensors matching the store's arenas.
        window: the model-precision sink/window rows of the tier's slots, where the tier
            keeps them (host: a RecentWindow over its slots; disk: DiskRows, in its
            records); None: its blocks come back codes only.
        lock: the lock rows copies take (the store window's).
    """

    chain_closed = True

    def __init__(self):
        super().__init__()
        self.index: ChainIndex
        self.arenas: list[torch.Tensor] = []
        self.window = None
        self.lock = None
        self.ns_ids: dict[bytes, int] = {}
        self.ns_keys: list[bytes] = []
        self.ns_hashes: list[int] = []
        self.on_lost: Callable[[list | None], None] | None = None

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

    def set_callbacks(self, on_evict, on_removed, on_lost=None) -> None:
        """``on_evict(slot)`` before a slot is emptied to make room, ``on_removed(slot)``
        after any slot is emptied (the tier's own record keeping runs first),
        ``on_lost(slots)`` when another process emptied or replaced slots (the disk tier)."""
        self.on_lost = on_lost
        self.index.on_evict = on_evict
        own = self.index.on_removed

        def removed(s: int) -> None:
            if own is not None:
                own(s)
            on_removed(s)

        self.index.on_removed = removed

    # ---- bytes ------------------------------------------------------------------------------
    def read(self, slots: list[int], dst_arenas: list[torch.Tensor], dst_blocks: list[int]) -> None:
        """Copy these slots' KV (all arenas, all layers) into ``dst_blocks``."""
        pairs = torch.tensor(list(zip(slots, dst_blocks)), dtype=torch.int64).reshape(-1, 2)
        ops.swap_blocks(self.arenas, dst_arenas, pairs)

    def write(self, src_arenas: list[torch.Tensor], src_blocks: list[int], slots: list[int]) -> None:
        """Copy ``src_blocks`` of ``src_arenas`` into these slots."""
        pairs = torch.tensor(list(zip(src_blocks, slots)), dtype=torch.int64).reshape(-1, 2)
        ops.swap_blocks(src_arenas, self.arenas, pairs)

    @property
    def source_blocks(self) -> Blocks:
        return Blocks(self.arenas, self.window, self.lock)

    def load(self, handles, dst: Blocks, dst_ids) -> None:
        slots = [int(h) for h in handles]
        self.read(slots, dst.arenas, list(dst_ids))
        move_rows(self.source_blocks, dst, list(zip(slots, dst_ids)))

    def store(self, src: Blocks, src_ids, handles) -> None:
        slots = [int(h) for h in handles]  
        self.write(src.arenas, list(src_ids), slots)
        move_rows(src, self.source_blocks, list(zip(src_ids, slots)))

    def written(self, slots: np.ndarray) -> None:
        """The data of these new slots has landed (the disk tier also seals them)."""
        self.num_written += len(slots)

    def commit(self, handles) -> None:
        slots = [int(h) for h in handles]  
        self.written(np.asarray(slots, dtype=np.int64))
        self.index.release(slots)

    def abandon(self, handles) -> None:
        for s in reversed([int(h) for h in handles]):
            self.index.release([s])
            if not self.index.children[s]:
                self.index.remove(s)

    # ---- chain walk --------------------------------------------------------------------------
    def lookup(self, query, start, max_blocks, *, fetch=True):
        ns = self.namespace(query.ns_key, create=False)
        if ns is None:
            return []
        return self.index.lookup(query.tokens, ns, self.ns_hashes[ns], max_blocks)[start:]

    def admit(self, parent, ns_key, tokens):
        ns = self.namespace(ns_key, create=True)
        slot, created = self.index.insert(ROOT if parent is None else parent, ns, self.ns_hashes[ns], tokens)
        return (None, False) if slot < 0 else (slot, created)

    def stamp(self, handle) -> int:
        return int(self.index.rec["gen"][handle])

    def current(self, handle, stamp) -> bool:
        r = self.index.rec
        return bool(r["valid"][handle] == 1 and r["gen"][handle] == stamp)

    def record(self, handle) -> TierRecord | None:
        r = self.index.rec
        if r["valid"][handle] != 1:
            return None
        p = int(r["parent"][handle])
        parent = None if p == ROOT else (p, int(r["parent_gen"][handle]))
        return TierRecord(np.array(r["tokens"][handle]), self.ns_keys[int(r["ns"][handle])], parent,
                          int(self.index.pins[handle]))

    def chain(self, handle) -> list[Handle]:
        return list(self.index.chain(handle))

    # ---- pins, leases, use ----------------------------------------------------------------------
    def pin(self, handle) -> None:
        self.index.pin(handle)

    def unpin(self, handle) -> None:
        self.index.unpin(handle)

    def pins(self, handle) -> int:
        return int(self.index.pins[handle])

    def pin_prefix(self, query, pin) -> int:
        chain = self.lookup(query, 0, len(query.tokens) // query.block_size)
        for s in chain:
            self.pin(s) if pin else self.unpin(s)
        return len(chain)

    def lease(self, handles) -> None:
        self.index.lease(handles)

    def release(self, handles) -> None:
        self.index.release(handles)

    def touch(self, handle, hit=False) -> None:
        self.index.touch(handle, hit=hit)

    # ---- removal, stats -------------------------------------------------------------------------
    def subtree(self, handle) -> list[Handle]:
        return self.index.descendants(handle) + [handle]

    def drop(self, handle) -> None:
        for s in self.subtree(handle):
            self.index.remove(s)

    def clear(self) -> list[Handle]:
        held = self.index.clear()
        self.cleared()
        return held

    def cleared(self) -> None:
        """Every slot was emptied (the disk tier persists that)."""

    def stats(self) -> TierStats:
        return TierStats(medium=self.medium, capacity=self.capacity, used_blocks=self.index.num_used,
                         pinned_blocks=self.index.num_pinned, hit_tokens=self.num_hit_tokens,
                         written_blocks=self.num_written, eviction_count=self.index.num_evictions,
                         corrupt_blocks=self.num_corrupt)

    def check_invariants(self) -> None:
        self.index.check_invariants()


#: the name before the tier protocol (a slot tier)
Tier = SlotTier
