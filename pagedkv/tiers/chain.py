"""ChainIndex: the prefix index of one lower tier (host memory or disk).

A tier slot holds one full block: its tokens, its namespace, and the slot that holds
its parent block together with that slot's generation when the two were linked. A
lookup walks the query from the root and accepts a slot only when its tokens, its
namespace and its parent identity all match, so by induction a hit's whole prefix
equals the query: a hash collision costs a miss, never wrong KV (exactly the device
index's rule). A slot's generation is bumped whenever it is emptied, so a child linked
to an older occupant can never be reached again.

Admission is chain-closed: a block enters only under a parent the tier holds (or at
the root). Eviction takes only leaves (slots without a child), never a pinned slot nor
one with a copy in flight (``busy``):

- ``lru``: the least recently used leaf first;
- ``frequency``: bucket = bit length of the slot's hit count (16 buckets), lowest
  bucket first, least recently used first inside a bucket (the device pool's rule).

Hashes are process independent (a fixed seed, not the device's per-process root), so
a disk tier's index stays valid across restarts.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from pagedkv._core.prefix import hash_bytes
from pagedkv.errors import InternalError
from pagedkv.tiers.verify import same_block

__all__ = ["ChainIndex", "slot_dtype", "ROOT", "ROOT_HASH", "chain_hash"]

ROOT = -1
_SEED = 0x7061676564746965          # "pagedtie": the tier hash's fixed seed
ROOT_HASH = hash_bytes(b"pagedkv-tier-root-v1", _SEED)
FREQUENCY_BUCKETS = 16


def slot_dtype(block_size: int) -> np.dtype:
    """One slot's record. Fields up to ``rec_crc`` decide correctness and are covered by
    it on disk; ``hits`` and ``stamp`` only order eviction."""
    return np.dtype([
        ("valid", "u1"), ("pad", "u1", (3,)), ("gen", "<u4"), ("parent", "<i4"),
        ("parent_gen", "<u4"), ("ns", "<i4"), ("crc", "<u4"), ("hash", "<u8"),
        ("tokens", "<i4", (block_size,)), ("rec_crc", "<u4"), ("hits", "<u4"), ("stamp", "<u8"),
    ])


def chain_hash(parent_hash: int, ns_hash: int, tokens: np.ndarray, weak: bool) -> int:
    """The tier hash of a block: its tokens chained to its parent's hash and namespace."""
    h = hash_bytes(tokens.tobytes() + parent_hash.to_bytes(8, "little") + ns_hash.to_bytes(8, "little"), _SEED)
    return h & 3 if weak else h


class ChainIndex:
    """Slots, their chain links and their eviction order (see the module docstring).

    Args:
        records: a ``slot_dtype(block_size)`` array (a memory map for the disk tier);
            slots with ``valid == 1`` are taken as they are (checked by the caller).
        eviction: ``"lru"`` or ``"frequency"``.
        weak_hash: tests only: a 4-valued hash, so collisions happen constantly.
        on_evict: called with a slot just before it is emptied to make room.
        on_removed: called with a slot just after it was emptied (for any reason).
        on_full: called when no slot is free, before evicting; True when it made room
            (:meth:`grow` was called: a disk tier grows its files up to its limit).

    The free list is lazy: a slot in it may have been filled since by :meth:`adopt`
    (another process's change, read back); taking a slot skips those.
    """

    def __init__(self, records: np.ndarray, block_size: int, *, eviction: str = "lru",
                 weak_hash: bool = False, on_evict: Callable[[int], None] | None = None,
                 on_removed: Callable[[int], None] | None = None, on_full: Callable[[], bool] | None = None):
        self._use(records)
        self.on_full = on_full
        self.block_size = block_size
        self.weak_hash = weak_hash
        self.frequency = eviction == "frequency"
        self.on_evict = on_evict
        self.on_removed = on_removed
        n = self.capacity
        self.children = np.zeros(n, dtype=np.int32)
        self.pins = np.zeros(n, dtype=np.int32)
        self.busy = np.zeros(n, dtype=np.int32)
        self.where = np.full(n, -1, dtype=np.int8)     # eviction bucket of a leaf; -1: not evictable
        nb = FREQUENCY_BUCKETS if self.frequency else 1
        self.buckets: list[OrderedDict] = [OrderedDict() for _ in range(nb)]
        self.by_hash: dict[int, int] = {}
        self.num_evictions = 0
        valid = records["valid"] == 1
        self.num_used = int(valid.sum())
        self.clock = int(records["stamp"][valid].max()) + 1 if self.num_used else 1
        parents = records["parent"][valid]
        if len(parents):
            counts = np.bincount(parents[parents >= 0], minlength=n)
            self.children[:] = counts[:n]
        for s in np.flatnonzero(valid).tolist():
            self.by_hash[int(records["hash"][s])] = s
        self.free: list[int] = np.flatnonzero(~valid)[::-1].tolist()   # pop() takes the lowest
        for s in np.flatnonzero(valid)[np.argsort(records["stamp"][valid], kind="stable")].tolist():
            self._refresh(s)

    # ---- queries ----------------------------------------------------------------------
    def slot_hash(self, slot: int) -> int:
        return ROOT_HASH if slot == ROOT else int(self._f["hash"][slot])

    def matches(self, slot: int, tokens: np.ndarray, ns: int, parent: int, parent_gen: int) -> bool:
        """Whether ``slot`` holds ``tokens`` in ``ns`` under ``parent`` at ``parent_gen``
        (the check every tier makes: :func:`pagedkv.tiers.verify.same_block`)."""
        f = self._f
        if f["valid"][slot] != 1:
            return False
        p = int(f["parent"][slot])
        link = (p, 0 if p == ROOT else int(f["parent_gen"][slot]))
        return same_block(f["tokens"][slot], int(f["ns"][slot]), link, tokens, ns,
                          (parent, 0 if parent == ROOT else parent_gen))

    def find_child(self, parent: int, ns: int, ns_hash: int, tokens: np.ndarray) -> int:
        """The slot holding ``tokens`` under ``parent`` in namespace ``ns``, or -1."""
        h = chain_hash(self.slot_hash(parent), ns_hash, tokens, self.weak_hash)
        s = self.by_hash.get(h)
        if s is None:
            return -1
        pgen = 0 if parent == ROOT else int(self._f["gen"][parent])
        return s if self.matches(s, tokens, ns, parent, pgen) else -1

    def lookup(self, tokens: np.ndarray, ns: int, ns_hash: int, max_blocks: int) -> list[int]:
        """Slots of the longest verified chain from the root that ``tokens`` starts with."""
        bs = self.block_size
        out: list[int] = []
        parent = ROOT
        for i in range(min(max_blocks, len(tokens) // bs)):
            s = self.find_child(parent, ns, ns_hash, tokens[i * bs:(i + 1) * bs])
            if s < 0:
                break
            out.append(s)
            parent = s
        return out

    def chain(self, slot: int) -> list[int]:
        """The slots from the root down to ``slot``."""
        out = []
        while slot != ROOT:
            out.append(slot)
            slot = int(self.rec["parent"][slot])
        return out[::-1]

    # ---- admission --------------------------------------------------------------------
    def insert(self, parent: int, ns: int, ns_hash: int, tokens: np.ndarray) -> tuple:
        """``(slot, created)``: the slot holding ``tokens`` under ``parent`` (touched), a
        new one (the caller owes its data and holds it busy), or ``(-1, False)`` when the
        hash belongs to other content (a collision) or no slot can be freed."""
        h = chain_hash(self.slot_hash(parent), ns_hash, tokens, self.weak_hash)
        found = self.by_hash.get(h)
        pgen = 0 if parent == ROOT else int(self.rec["gen"][parent])
        if found is not None:
            if self.matches(found, tokens, ns, parent, pgen):
                self.touch(found)
                return found, False
            return -1, False
        if parent != ROOT:
            self.busy[parent] += 1        # the parent must survive the eviction below
            self._refresh(parent)
        try:
            s = self._take_slot()
        finally:
            if parent != ROOT:
                self.busy[parent] -= 1
        if s < 0:
            if parent != ROOT:
                self._refresh(parent)
            return -1, False
        r = self.rec
        r["valid"][s] = 1
        r["parent"][s] = parent
        r["parent_gen"][s] = pgen
        r["ns"][s] = ns
        r["hash"][s] = h
        r["tokens"][s] = tokens
        r["hits"][s] = 0
        r["crc"][s] = 0
        self.by_hash[h] = s
        self.num_used += 1
        self.busy[s] += 1
        if parent != ROOT:
            self.children[parent] += 1
            self._refresh(parent)
        self.touch(s)
        return s, True

    def _use(self, records: np.ndarray) -> None:
        self.rec = records
        # field views, made once: a lookup reads a few fields of each block's record
        self._f = {k: records[k] for k in ("valid", "ns", "parent", "parent_gen", "gen", "hash", "tokens")}
        self.capacity = len(records)

    def grow(self, records: np.ndarray) -> None:
        """Take ``records``, a longer copy of the records (the new slots empty)."""
        old = self.capacity
        n = len(records)
        self._use(records)
        for name in ("children", "pins", "busy"):
            a = getattr(self, name)
            setattr(self, name, np.concatenate([a, np.zeros(n - old, dtype=a.dtype)]))
        self.where = np.concatenate([self.where, np.full(n - old, -1, dtype=np.int8)])
        self.free[:0] = range(n - 1, old - 1, -1)        # taken after the older free slots

    def _pop_free(self) -> int:
        valid = self._f["valid"]
        while self.free:
            s = self.free.pop()
            if valid[s] != 1:
                return s
        return -1

    def _take_slot(self) -> int:
        s = self._pop_free()
        if s >= 0:
            return s
        if self.on_full is not None and self.on_full():
            s = self._pop_free()
            if s >= 0:
                return s
        for bucket in self.buckets:
            if bucket:
                victim = next(iter(bucket))
                if self.on_evict is not None:
                    self.on_evict(victim)
                self.num_evictions += 1
                self.remove(victim)
                return self._pop_free()
        return -1

    def remove(self, slot: int) -> None:
        """Empty one slot (a leaf: its children would be unreachable anyway, but the
        caller drops them first, see :meth:`descendants`)."""
        r = self.rec
        if r["valid"][slot] != 1:
            raise InternalError(f"tier slot {slot} removed while empty")
        if self.children[slot]:
            raise InternalError(f"tier slot {slot} removed with {self.children[slot]} children")
        self._unlist(slot)
        h = int(r["hash"][slot])
        if self.by_hash.get(h) == slot:
            del self.by_hash[h]
        parent = int(r["parent"][slot])
        r["valid"][slot] = 0
        r["gen"][slot] += 1
        self.pins[slot] = 0
        self.num_used -= 1
        self.free.append(slot)
        if parent != ROOT:
            self.children[parent] -= 1
            self._refresh(parent)
        if self.on_removed is not None:
            self.on_removed(slot)

    def descendants(self, slot: int) -> list[int]:
        """Valid slots below ``slot``, deepest first (the order :meth:`remove` needs)."""
        r = self.rec
        valid = r["valid"] == 1
        found, frontier = [], np.array([slot])
        while len(frontier):
            kids = np.flatnonzero(valid & np.isin(r["parent"], frontier))
            kids = kids[r["parent_gen"][kids] == r["gen"][r["parent"][kids]]]
            found.append(kids)
            frontier = kids
        return np.concatenate(found)[::-1].tolist() if found else []

    def clear(self) -> list[int]:
        """Empty every slot; returns the slots that were valid."""
        r = self.rec
        held = np.flatnonzero(r["valid"] == 1)
        r["valid"][held] = 0
        r["gen"][held] += 1
        self.children[:] = 0
        self.pins[:] = 0
        self.where[:] = -1
        for b in self.buckets:
            b.clear()
        self.by_hash.clear()
        self.num_used = 0
        self.free = list(range(self.capacity))[::-1]
        return held.tolist()

    # ---- another process's changes, read back ------------------------------------------------
    def forget(self, slots) -> bool:
        """Drop these slots' current occupants from the index (their records changed on
        disk), without callbacks; the records themselves are the caller's to replace.
        False when an occupant has a child outside ``slots`` (its chain changed under
        it: the caller must check everything)."""
        r = self.rec
        gone = [s for s in slots if r["valid"][s] == 1]
        for s in gone:
            self._unlist(s)
            h = int(r["hash"][s])
            if self.by_hash.get(h) == s:
                del self.by_hash[h]
            r["valid"][s] = 0
            self.pins[s] = 0
            self.num_used -= 1
            self.free.append(s)
        for s in gone:
            p = int(r["parent"][s])
            if p != ROOT:
                self.children[p] -= 1
                self._refresh(p)
        return not any(self.children[s] for s in gone)

    def adopt(self, slot: int, ns_hash: int) -> bool:
        """Take a valid record another process wrote into an empty slot, if its parent
        is held (same generation), its hash is its tokens' and no other slot has it.
        The caller checked its CRC and namespace. False: not taken (a miss)."""
        r, f = self.rec, self._f
        p = int(f["parent"][slot])
        if p != ROOT and not (0 <= p < self.capacity and f["valid"][p] == 1 and f["gen"][p] == f["parent_gen"][slot]):
            return False
        h = chain_hash(self.slot_hash(p), ns_hash, np.asarray(f["tokens"][slot]), self.weak_hash)
        if h != int(f["hash"][slot]) or h in self.by_hash:
            return False
        r["valid"][slot] = 1
        self.by_hash[h] = slot
        self.num_used += 1
        if p != ROOT:
            self.children[p] += 1
            self._refresh(p)
        self._refresh(slot)
        return True

    # ---- use, pins, leases --------------------------------------------------------------
    def touch(self, slot: int, hit: bool = False) -> None:
        r = self.rec
        r["stamp"][slot] = self.clock
        self.clock += 1
        if hit and r["hits"][slot] != 0xFFFFFFFF:
            r["hits"][slot] += 1
        self._unlist(slot)
        self._refresh(slot)

    def pin(self, slot: int) -> None:
        self.pins[slot] += 1
        self._refresh(slot)

    def unpin(self, slot: int) -> None:
        if self.pins[slot] > 0:
            self.pins[slot] -= 1
            self._refresh(slot)

    def lease(self, slots) -> None:
        for s in slots:
            self.busy[s] += 1
            self._refresh(s)

    def release(self, slots) -> None:
        for s in slots:
            self.busy[s] -= 1
            self._refresh(s)

    @property
    def num_pinned(self) -> int:
        return int(np.count_nonzero(self.pins))

    def _bucket(self, slot: int) -> int:
        if not self.frequency:
            return 0
        return min(int(self.rec["hits"][slot]).bit_length(), FREQUENCY_BUCKETS - 1)

    def _unlist(self, slot: int) -> None:
        w = self.where[slot]
        if w >= 0:
            del self.buckets[w][slot]
            self.where[slot] = -1

    def _refresh(self, slot: int) -> None:
        # A slot is evictable exactly while it is a valid, unpinned, idle leaf.
        evictable = (self.rec["valid"][slot] == 1 and not self.children[slot] and not self.pins[slot]
                     and not self.busy[slot])
        if evictable and self.where[slot] < 0:
            b = self._bucket(slot)
            self.buckets[b][slot] = None
            self.where[slot] = b
        elif not evictable:
            self._unlist(slot)

    def check_invariants(self) -> None:
        r = self.rec
        valid = r["valid"] == 1
        free = {s for s in self.free if not valid[s]}
        if int(valid.sum()) != self.num_used or self.num_used + len(free) != self.capacity:
            raise InternalError(f"tier index: {int(valid.sum())} valid slots, {self.num_used} counted, "
                                f"{len(free)} free of {self.capacity}")
        kids = np.bincount(r["parent"][valid][r["parent"][valid] >= 0], minlength=self.capacity)
        if not np.array_equal(kids[:self.capacity], self.children):
            raise InternalError("tier index: child counts disagree with the parent links")
        if (self.busy != 0).any():
            raise InternalError(f"tier index: slots {np.flatnonzero(self.busy).tolist()} busy between calls")
        for s in np.flatnonzero(valid).tolist():
            p = int(r["parent"][s])
            if p != ROOT and (r["valid"][p] != 1 or r["gen"][p] != r["parent_gen"][s]):
                raise InternalError(f"tier index: slot {s} hangs off a slot that no longer holds its parent")
            if self.by_hash.get(int(r["hash"][s])) != s:
                raise InternalError(f"tier index: slot {s} is not findable by its hash")
