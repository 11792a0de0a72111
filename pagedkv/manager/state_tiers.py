"""Recurrent-state snapshots on the prefix tiers: written down with their chain, found
again when a prefix comes back up.

Every snapshot the state pool takes is written through to each tier's shelf
(:mod:`pagedkv.tiers.state_shelf`): a snapshot is taken rarely (every
``state_checkpoint_every`` blocks, at prefill chunk ends and shared-prefix junctions),
and written through it is on disk when the chain's blocks get there, whichever order
the device evicts blocks and states in, so a warm restart finds it.

A promotion from the tiers (:meth:`pagedkv.tiers.manager.PrefixTiers.promote`) is
capped at the longest boundary where a verified snapshot exists, in the device pool or
on a shelf (loaded into a state slot and filed as a device snapshot), and the sequence
resumes from it: a chain whose snapshot is missing or fails verification gives a
shorter hit, never a KV-only advance.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from pagedkv.state.snapshots import Snapshot
from pagedkv.state.tables import OutOfStateSlotsError, StateTables
from pagedkv.tiers.state_shelf import StateShelf, shelf_keys

__all__ = ["StateTiers"]

_STATE_NS = b"\x00state"      # appended to a cache namespace's key: the state group's key on a shelf


class StateTiers:
    """The shelves of one cache's state group, top tier first.

    Args:
        shelves: one :class:`~pagedkv.tiers.state_shelf.StateShelf` per tier that keeps states.
        states: the state group's tables (their snapshot index and slots).
        store: the :class:`~pagedkv.state.store.StateStore` (the bytes).
        key_of: the cache namespace registry's ``key_of`` (namespace id -> key bytes).
    """

    def __init__(self, shelves: list[StateShelf], states: StateTables, store, key_of: Callable[[int], bytes]):
        self.shelves = shelves
        self.states = states
        self.snapshots = states.snapshots
        self.store = store
        self.key_of = key_of
        self.bs = states.block_size
        self.num_loaded = 0            # snapshots brought up from a shelf
        self._loading = False
        if self.snapshots is not None:
            self.snapshots.on_store = self.written

    def _ns_key(self, ns_id: int) -> bytes:
        return self.key_of(ns_id) + _STATE_NS

    def written(self, snap: Snapshot) -> None:
        """A new device snapshot: onto every shelf (write-through)."""
        if self._loading:
            return
        k = len(snap.tokens) // self.bs
        nskey = self._ns_key(snap.ns_id)
        key = shelf_keys(nskey, snap.tokens, self.bs, k)[-1]
        payload = self.store.export_slot(snap.slot)
        for shelf in self.shelves:
            shelf.put(key, nskey, snap.tokens, payload)

    def cap(self, key: int, tokens: np.ndarray, have: int, n: int) -> int:
        """The most of ``n`` blocks past ``have`` a promotion of ``key`` may add: the
        longest boundary with a verified snapshot, on the device or on a shelf (then
        loaded into the pool); 0 when none."""
        if self.snapshots is None or n <= 0:
            return 0
        s = self.states.seqs[key]
        nskey = self._ns_key(s.ns_id)
        keys = shelf_keys(nskey, tokens, self.bs, have + n)
        for shelf in self.shelves:
            shelf.prefetch(keys[have:have + n])
        for m in range(n, 0, -1):
            end = (have + m) * self.bs
            if self.snapshots.find(tokens[:end], s.ns_id, s.ns_hash) is not None:
                return m
            for i, shelf in enumerate(self.shelves):
                if keys[have + m - 1] not in shelf:
                    continue
                payload = shelf.get(keys[have + m - 1], nskey, tokens[:end])
                if payload is not None and self._load(tokens[:end], s.ns_id, s.ns_hash, payload):
                    for above in self.shelves[:i]:          # the tiers above keep it again
                        above.put(keys[have + m - 1], nskey, tokens[:end], payload)
                    return m
        return 0

    def _load(self, tokens: np.ndarray, ns_id: int, ns_hash: int, payload: bytes) -> bool:
        """File ``payload`` as the device snapshot after ``tokens``; False without a slot."""
        st = self.states
        try:
            st.check_room(1, "state promotion")
        except OutOfStateSlotsError:
            return False
        if len(payload) != self.store.slot_nbytes():
            return False
        st.make_room(1)
        slot = st.slots.allocate()
        try:
            self.store.import_slot(slot, payload)
            self._loading = True
            try:
                snap = self.snapshots.store(tokens, ns_id, ns_hash, slot)   # type: ignore[union-attr]
            finally:
                self._loading = False
        finally:
            st.slots.decref(slot)          # the snapshot holds it now (or it is free again)
        if snap is None:
            return False
        self.num_loaded += 1
        return True

    def held(self, tokens: np.ndarray, ns_key: bytes, device_ns: tuple[int, int] | None, upto: int) -> int:
        """Tokens of the longest prefix of ``tokens`` up to ``upto`` with a snapshot on
        the device (namespace ``device_ns``, None when the device never used it) or a
        shelf (namespace key ``ns_key``); a pure query (a shelf's record is verified when
        a promotion reads it)."""
        n = upto // self.bs
        if n < 1:
            return 0
        keys = shelf_keys(ns_key + _STATE_NS, tokens, self.bs, n)
        for shelf in self.shelves:
            shelf.prefetch(keys)
        for k in range(n, 0, -1):
            if device_ns is not None and self.snapshots is not None and self.snapshots.find(
                    tokens[:k * self.bs], *device_ns) is not None:
                return k * self.bs
            if any(keys[k - 1] in shelf for shelf in self.shelves):
                return k * self.bs
        return 0

    def clear(self) -> None:
        for shelf in self.shelves:
            shelf.clear()

    def close(self) -> None:
        for shelf in self.shelves:
            shelf.close()

    def stats(self) -> tuple[dict, ...]:
        return tuple(shelf.stats() for shelf in self.shelves)
