"""Snapshots of recurrent states at block boundaries, for prefix hits.

A snapshot is a state slot holding the state of a sequence right after its first
``k * block_size`` tokens, filed under the chained hash of those tokens' blocks (the
attention chain's hash at block ``k``: :meth:`PrefixIndex.hash_tokens`, in the state
group's own namespace) and verified on every lookup like a block: its tokens are
compared with the query's, and its namespace (cache salt, adapter) must be the query's.
A hash collision costs a miss, never a wrong state.

Eviction (when a slot is needed and none is free) takes snapshots no live sequence
shares, never a pinned one, in the cache's policy order:

- ``"lru"``: least recently stored or hit first;
- ``"priority"``: the lowest priority class first (a sequence's ``priority``; default
  the middle class), least recently used first within a class;
- ``"frequency"`` and ``"adaptive"``: the fewest hits first, least recently used first
  among equals.

Within that order a *superseded* snapshot goes first: one whose chain a deeper
snapshot extends (a request that extends the chain resumes from the deeper one). So a
multi-turn chat keeps each conversation's newest snapshot rather than the intermediate
checkpoints of its earlier turns (``benchmarks/recurrent.py``: at vLLM ``align``'s
state memory this is what keeps the hit rate).
"""
from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from pagedkv.state.slots import StateSlots

__all__ = ["Snapshot", "SnapshotIndex", "Lookup"]


@dataclass(eq=False)
class Snapshot:
    """One snapshot: the state after ``tokens`` (a whole number of blocks) in namespace
    ``ns_id``, held in ``slot``."""

    ns_id: int
    digest: int                 # chained hash of the tokens' blocks (the key, with ns_id and the length)
    tokens: np.ndarray          # int32, verified on every lookup
    slot: int
    priority: int
    pins: int = 0
    hits: int = 0
    superseded: int = 0         # deeper snapshots filed whose chains extend this one
    extends: tuple = ()         # the shallower snapshots this one supersedes (counted there)
    parent: int | None = None   # the chained hash of the block before the last (None: one block)

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.ns_id, len(self.tokens), self.digest)


@dataclass
class Lookup:
    """What a lookup of a prompt found: the block boundaries (ascending, in blocks) with
    a verified snapshot, and the snapshot at each."""

    boundaries: tuple[int, ...] = ()
    found: dict[int, Snapshot] = field(default_factory=dict)


class SnapshotIndex:
    """The snapshots of one cache (see the module docstring).

    Args:
        block_size: tokens per block (a snapshot sits on a block boundary).
        slots: the state pool the snapshots hold slots of.
        hash_tokens: ``PrefixIndex.hash_tokens`` of the cache (chained block hashes).
        eviction: the cache's eviction policy name.
        priority_classes: classes of the priority policy.
    """

    def __init__(self, block_size: int, slots: StateSlots, hash_tokens, eviction: str = "lru",
                 priority_classes: int = 3):
        self.block_size = block_size
        self.slots = slots
        self.hash_tokens = hash_tokens
        self.eviction = eviction
        self.priority_classes = priority_classes
        self.default_priority = priority_classes // 2
        self._by_key: collections.OrderedDict[tuple[int, int, int], Snapshot] = collections.OrderedDict()
        self.num_stored = 0            # snapshots taken, ever
        self.num_evicted = 0           # dropped to free a slot
        self.num_verify_failures = 0   # a digest matched, the tokens or namespace did not
        self.num_hits = 0              # lookups that resumed from a snapshot
        self.on_store: Callable[[Snapshot], None] | None = None   # each new snapshot (the tiers write it down)
        self.on_event: Callable[[Snapshot, bool], None] | None = None   # stored (True) or removed: KV events

    def __len__(self) -> int:
        return len(self._by_key)

    def snapshots(self) -> list[Snapshot]:
        """Every snapshot, least recently used first."""
        return list(self._by_key.values())

    # ---- lookups -------------------------------------------------------------------------
    def lookup(self, tokens: np.ndarray, ns_id: int, ns_hash: int, cap_blocks: int) -> Lookup:
        """The verified snapshots of ``tokens``' prefix at block boundaries 1..``cap_blocks``
        (pure query: nothing is touched)."""
        if not self._by_key or cap_blocks < 1:
            return Lookup()
        n = min(cap_blocks, len(tokens) // self.block_size)
        if n < 1:
            return Lookup()
        digests = self.hash_tokens(tokens[:n * self.block_size], ns_hash)
        found = {}
        for k in range(1, n + 1):
            snap = self._by_key.get((ns_id, k * self.block_size, int(digests[k - 1])))
            if snap is None:
                continue
            if not np.array_equal(snap.tokens, tokens[:k * self.block_size]):
                self.num_verify_failures += 1     # a collision: a miss, never the wrong state
                continue
            found[k] = snap
        return Lookup(tuple(found), found)

    def touch(self, snap: Snapshot) -> None:
        """A sequence resumed from ``snap``: it is used most recently."""
        snap.hits += 1
        self.num_hits += 1
        self._by_key.move_to_end(snap.key)

    def find(self, tokens: np.ndarray, ns_id: int, ns_hash: int) -> Snapshot | None:
        """The snapshot of exactly ``tokens`` (a whole number of blocks), verified."""
        k = len(tokens) // self.block_size
        if k < 1 or k * self.block_size != len(tokens):
            return None
        return self.lookup(tokens, ns_id, ns_hash, k).found.get(k)

    # ---- storing and dropping ---------------------------------------------------------------
    def store(self, tokens: np.ndarray, ns_id: int, ns_hash: int, slot: int, priority: int = -1) -> Snapshot | None:
        """File the state in ``slot`` (the caller's: it is shared here, not copied) as the
        snapshot after ``tokens``. None when one is filed there already (it is touched)."""
        k = len(tokens) // self.block_size
        digests = self.hash_tokens(tokens, ns_hash)
        digest = int(digests[k - 1])
        key = (ns_id, len(tokens), digest)
        old = self._by_key.get(key)
        if old is not None:
            if np.array_equal(old.tokens, tokens):
                self._by_key.move_to_end(key)
                return None
            self.num_verify_failures += 1        # another prefix holds this key: it stays
            return None
        snap = Snapshot(ns_id, digest, np.array(tokens, dtype=np.int32, copy=True), slot,
                        self.default_priority if priority < 0 else priority)
        below = []
        for j in range(k - 1):          # the snapshots of this chain's shorter prefixes: superseded now
            a = self._by_key.get((ns_id, (j + 1) * self.block_size, int(digests[j])))
            if a is not None and np.array_equal(a.tokens, snap.tokens[:len(a.tokens)]):
                a.superseded += 1
                below.append(a)
        snap.extends = tuple(below)
        snap.parent = int(digests[k - 2]) if k > 1 else None
        self.slots.incref(slot)
        self._by_key[key] = snap
        self.num_stored += 1
        if self.on_store is not None:
            self.on_store(snap)
        if self.on_event is not None:
            self.on_event(snap, True)
        return snap

    def remove(self, snap: Snapshot) -> None:
        del self._by_key[snap.key]
        self.slots.decref(snap.slot)
        for a in snap.extends:
            a.superseded -= 1
        snap.extends = ()
        if self.on_event is not None:
            self.on_event(snap, False)

    def num_evictable(self) -> int:
        """Snapshots whose slot frees when they go: unpinned, shared by no sequence."""
        ref = self.slots.ref
        return sum(1 for s in self._by_key.values() if not s.pins and ref[s.slot] == 1)

    def evict(self, n: int) -> int:
        """Drop up to ``n`` evictable snapshots in policy order; returns the slots freed."""
        done = 0
        while done < n:
            victim = self._victim()
            if victim is None:
                break
            self.remove(victim)
            self.num_evicted += 1
            done += 1
        return done

    def _victim(self) -> Snapshot | None:
        ref = self.slots.ref
        best = None
        best_rank: tuple = ()
        for age, s in enumerate(self._by_key.values()):     # least recently used first
            if s.pins or ref[s.slot] != 1:
                continue
            kept = not s.superseded
            if self.eviction == "lru":
                if not kept:
                    return s
                rank: tuple = (kept, age)
            else:
                rank = (s.priority, kept, age) if self.eviction == "priority" else (s.hits, kept, age)
            if best is None or rank < best_rank:
                best, best_rank = s, rank
        return best

    def pin(self, tokens: np.ndarray, ns_id: int, ns_hash: int, pin: bool) -> int:
        """Pin (or unpin) the snapshots of ``tokens``' prefix; returns the tokens of the
        longest prefix (un)pinned."""
        found = self.lookup(tokens, ns_id, ns_hash, len(tokens) // self.block_size).found
        for snap in found.values():
            snap.pins = snap.pins + 1 if pin else max(0, snap.pins - 1)
        return max(found, default=0) * self.block_size

    def clear(self) -> None:
        """Forget every snapshot (their slots are freed once no sequence shares them)."""
        for snap in list(self._by_key.values()):
            self.remove(snap)

    def held(self) -> np.ndarray:
        """References the snapshots hold, per slot (for the audit)."""
        out = np.zeros(self.slots.num_slots, dtype=np.int32)
        for s in self._by_key.values():
            out[s.slot] += 1
        return out
