"""Each sequence's recurrent state through its life: which slot holds it, how many tokens
it covers, when a snapshot is taken and where a rollback resumes.

A sequence's state covers exactly its committed tokens (``pos``), or nothing yet
(``slot == -1``: the initial, all-zero state). The rules:

- **Admission** resumes from the snapshot at the hit boundary (shared by reference), or
  from the initial state; a hit is granted only where the snapshot exists
  (:meth:`pagedkv.groups.spec.RecurrentStateSpec.longest_hit`), so a KV-only hit never
  advances a request.
- **Reserve** makes the state writable before a step: a state shared with a snapshot, a
  fork or a prefix hit is copied into a slot of the sequence's own (``copies``), and a
  first state is zeroed (``zeroed``); the store performs them.
- **Commit** advances ``pos``; where it lands on a checkpoint boundary (every
  ``checkpoint_every`` blocks; the end of a prefill chunk on a block boundary; the
  junction where a shared prefix ended at admission) the state is filed as a snapshot
  by reference (the next reserve copies it).
- **Rollback**: a state cannot be rewound, so ``truncate`` resumes from the newest state
  the sequence can restore at or before the target (its restore point, kept while it
  records its past, or a snapshot of its own prefix) and reports the tokens the caller
  must compute again. A step that is given back after the state was written
  (``unreserve``) does the same.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from pagedkv.errors import InternalError, OutOfBlocksError
from pagedkv.groups.spec import RecurrentStateSpec
from pagedkv.state.slots import StateSlots
from pagedkv.state.snapshots import Lookup, Snapshot, SnapshotIndex

__all__ = ["StateTables", "OutOfStateSlotsError"]


class OutOfStateSlotsError(OutOfBlocksError):
    """The state pool ran out of slots (every slot holds a live state or a pinned or
    shared snapshot). Carries the slots needed and the slots free or evictable."""

    def __init__(self, needed: int, free: int, what: str = "allocation"):
        super().__init__(needed, free, what)
        self.args = (f"out of state slots: {what} needs {self.needed} slot(s), {self.free} free or evictable",)


class _Seq:
    __slots__ = ("slot", "pos", "ns_id", "ns_hash", "priority", "junction", "restore_slot", "restore_pos",
                 "recording", "written")

    def __init__(self, slot: int, pos: int, ns_id: int, ns_hash: int, priority: int, junction: int):
        self.slot = slot                # live state, -1: the initial state
        self.pos = pos                  # tokens the live state covers
        self.ns_id = ns_id              # the state group's namespace
        self.ns_hash = ns_hash
        self.priority = priority        # eviction class of its snapshots (-1: default)
        self.junction = junction        # tokens where a shared prefix ended (a snapshot is due there), 0: none
        self.restore_slot = -1          # the state at restore_pos, kept while recording
        self.restore_pos = 0
        self.recording = False          # keep a restore point at each step (rollback of speculative tokens)
        self.written = False            # the live state was written since the last commit


class StateTables:
    """The recurrent-state group's per-sequence bookkeeping (see the module docstring).

    Args:
        spec: the group's :class:`~pagedkv.groups.spec.RecurrentStateSpec` (its
            ``block_size`` is the attention blocks', the boundary grid of snapshots).
        slots: the state pool.
        snapshots: the snapshot index, or None without prefix caching.
        tokens_of: a sequence key's known token ids (the attention tables' record).
    """

    def __init__(self, spec: RecurrentStateSpec, slots: StateSlots, snapshots: SnapshotIndex | None,
                 tokens_of: Callable[[int], np.ndarray]):
        self.spec = spec
        self.block_size = spec.block_size
        self.every = spec.checkpoint_every * spec.block_size
        self.slots = slots
        self.snapshots = snapshots
        self.tokens_of = tokens_of
        self.seqs: dict[int, _Seq] = {}
        self.copies: list[tuple[int, int]] = []    # (src, dst) slot copies the store owes
        self.zeroed: list[int] = []                 # slots the store owes zeros
        self.num_copies = 0            # copy-on-write state copies, ever
        self.num_recomputed = 0        # tokens a rollback sent back to be computed again

    def __contains__(self, key: int) -> bool:
        return key in self.seqs

    # ---- admission -------------------------------------------------------------------------
    def lookup(self, tokens: np.ndarray, ns_id: int, ns_hash: int, cap_blocks: int) -> Lookup:
        if self.snapshots is None:
            return Lookup()
        return self.snapshots.lookup(tokens, ns_id, ns_hash, cap_blocks)

    def add(self, key: int, ns_id: int, ns_hash: int, priority: int, hit_blocks: int, found: Lookup,
            chain_blocks: int) -> None:
        """Admit ``key`` resuming at ``hit_blocks`` (a boundary of ``found``, or 0); the
        attention chain held ``chain_blocks``: at least a block more marks a junction."""
        slot = -1
        if hit_blocks:
            snap = found.found[hit_blocks]
            slot = snap.slot
            self.slots.incref(slot)
            if self.snapshots is not None:
                self.snapshots.touch(snap)
        junction = chain_blocks * self.block_size if chain_blocks > hit_blocks else 0
        self.seqs[key] = _Seq(slot, hit_blocks * self.block_size, ns_id, ns_hash, priority, junction)

    def add_restored(self, key: int, ns_id: int, ns_hash: int, priority: int) -> None:
        """Admit a sequence whose state arrives from elsewhere (:meth:`restore`)."""
        self.seqs[key] = _Seq(-1, 0, ns_id, ns_hash, priority, 0)

    # ---- each step ---------------------------------------------------------------------------
    def _need(self, s: _Seq, shared_after: bool) -> int:
        """1 when a reserve gives ``s`` a new slot: a first state, a copy of a shared one
        (``shared_after``: a commit just before will share it with a snapshot), or a copy
        beside the restore point a recording sequence keeps."""
        if s.slot < 0 or shared_after or self.slots.ref[s.slot] > 1:
            return 1
        return 1 if s.recording and s.restore_pos != s.pos else 0

    def need(self, keys: list[int], snapshot_due: list[bool] | None = None) -> int:
        """Slots a reserve of ``keys`` takes (after a commit that snapshots where
        ``snapshot_due``)."""
        n = 0
        for i, k in enumerate(keys):
            n += self._need(self.seqs[k], bool(snapshot_due and snapshot_due[i]))
        return n

    def check_room(self, need: int, what: str) -> None:
        """Raise :class:`OutOfStateSlotsError` unless ``need`` slots are free or can be
        freed by evicting snapshots (nothing changes either way)."""
        free = self.slots.num_free
        if need <= free:
            return
        evictable = self.snapshots.num_evictable() if self.snapshots is not None else 0
        if need > free + evictable:
            raise OutOfStateSlotsError(need, free + evictable, what)

    def make_room(self, need: int) -> None:
        """Evict snapshots until ``need`` slots are free (checked by :meth:`check_room`)."""
        short = need - self.slots.num_free
        if short > 0 and self.snapshots is not None:
            self.snapshots.evict(short)

    def snapshot_due(self, keys: list[int], counts: list[int]) -> list[bool]:
        """Whether committing ``counts`` decoded tokens of each sequence takes a snapshot."""
        bs = self.block_size
        out = []
        for k, n in zip(keys, counts):
            s = self.seqs[k]
            p = s.pos + n
            out.append(bool(n) and self.snapshots is not None and s.slot >= 0 and p % bs == 0 and
                       (p % self.every == 0 or p == s.junction))
        return out

    def prepare(self, keys: list[int]) -> None:
        """After :meth:`room`: give every sequence of ``keys`` a slot of its own to write."""
        for k in keys:
            s = self.seqs[k]
            if s.recording and s.slot >= 0 and s.restore_pos != s.pos:
                if s.restore_slot >= 0:
                    self.slots.decref(s.restore_slot)
                s.restore_slot, s.restore_pos = s.slot, s.pos
                self.slots.incref(s.slot)
            if s.slot < 0:
                s.slot = self.slots.allocate()
                self.zeroed.append(s.slot)
            elif self.slots.ref[s.slot] > 1:
                old = s.slot
                s.slot = self.slots.allocate()
                self.slots.decref(old)
                self.copies.append((old, s.slot))
                self.num_copies += 1

    def take(self) -> tuple[list[tuple[int, int]], list[int]]:
        copies, zeroed = self.copies, self.zeroed
        self.copies, self.zeroed = [], []
        return copies, zeroed

    def mark_written(self, keys: list[int]) -> None:
        for k in keys:
            self.seqs[k].written = True

    def commit(self, keys: list[int], counts: np.ndarray, prefill: np.ndarray) -> None:
        """``counts`` tokens of each sequence are computed (its state written); snapshot
        where due. ``prefill``: per sequence, whether this was a prompt chunk (tokens known
        before the step; its end is a checkpoint when it lands on a block boundary)."""
        bs = self.block_size
        for k, n, chunk in zip(keys, counts.tolist(), prefill.tolist()):
            s = self.seqs[k]
            if not n:
                continue
            s.pos += n
            s.written = False
            if s.slot < 0 or s.pos % bs or self.snapshots is None:
                continue
            if chunk or s.pos % self.every == 0 or s.pos == s.junction:
                self.snapshot(k)

    def snapshot(self, key: int) -> bool:
        """File ``key``'s current state as a snapshot (its position a block boundary and
        its tokens known); False when it cannot be."""
        s = self.seqs[key]
        if self.snapshots is None or s.slot < 0 or s.pos == 0 or s.pos % self.block_size:
            return False
        tokens = self.tokens_of(key)
        if len(tokens) < s.pos:
            return False                # tokens unknown (no prompt given): no key to file it under
        return self.snapshots.store(tokens[:s.pos], s.ns_id, s.ns_hash, s.slot, s.priority) is not None

    def next_checkpoint(self, key: int) -> int:
        """The position of the next periodic or junction snapshot of ``key``."""
        s = self.seqs[key]
        nxt = (s.pos // self.every + 1) * self.every
        if s.junction > s.pos:
            nxt = min(nxt, s.junction)
        return nxt

    def resume(self, key: int, snap: Snapshot) -> None:
        """``key``'s state becomes ``snap`` (its tables now cover the snapshot's tokens:
        a prefix promoted from a tier)."""
        s = self.seqs[key]
        self.slots.incref(snap.slot)
        if s.slot >= 0:
            self.slots.decref(s.slot)
        s.slot, s.pos, s.written = snap.slot, len(snap.tokens), False
        if self.snapshots is not None:
            self.snapshots.touch(snap)

    # ---- rollback ----------------------------------------------------------------------------------
    def resume_point(self, key: int, target: int) -> int:
        """The position at or before ``target`` from which ``key``'s state can resume:
        its live state if it is there, its restore point, a snapshot of its own prefix,
        or 0."""
        s = self.seqs[key]
        if target == s.pos and not s.written:
            return target
        best = 0
        if s.restore_slot >= 0 and s.restore_pos <= target:
            best = s.restore_pos
        if self.snapshots is not None and target >= self.block_size:
            tokens = self.tokens_of(key)
            found = self.snapshots.lookup(tokens[:target], s.ns_id, s.ns_hash, target // self.block_size)
            if found.boundaries:
                best = max(best, found.boundaries[-1] * self.block_size)
        return best

    def rewind(self, key: int, point: int, target: int) -> None:
        """Set ``key``'s state back to ``point``, the :meth:`resume_point` of ``target``
        (the tokens between them are computed again)."""
        s = self.seqs[key]
        if point == s.pos and not s.written:
            return
        self.num_recomputed += target - point
        if s.slot >= 0:
            self.slots.decref(s.slot)
        if point == 0:
            s.slot = -1
        elif s.restore_slot >= 0 and s.restore_pos == point:
            s.slot = s.restore_slot
            self.slots.incref(s.slot)
        else:
            snap = self.snapshots.find(self.tokens_of(key)[:point], s.ns_id, s.ns_hash)  # type: ignore[union-attr]
            if snap is None:
                raise InternalError(f"the state snapshot at {point} tokens vanished during a rollback (a bug)")
            s.slot = snap.slot
            self.slots.incref(s.slot)
        s.pos = point
        s.written = False
        if s.restore_pos > point and s.restore_slot >= 0:
            self.slots.decref(s.restore_slot)
            s.restore_slot, s.restore_pos = -1, 0

    def record(self, keys: list[int], on: bool) -> None:
        """Keep (or stop keeping) a restore point at each step of ``keys``."""
        for k in keys:
            s = self.seqs[k]
            s.recording = on
            if not on and s.restore_slot >= 0:
                self.slots.decref(s.restore_slot)
                s.restore_slot, s.restore_pos = -1, 0

    # ---- forks and release ---------------------------------------------------------------------
    def fork(self, src: int, dst: int) -> None:
        s = self.seqs[src]
        d = _Seq(s.slot, s.pos, s.ns_id, s.ns_hash, s.priority, s.junction)
        d.recording, d.written = s.recording, s.written
        if s.slot >= 0:
            self.slots.incref(s.slot)
        if s.restore_slot >= 0:
            d.restore_slot, d.restore_pos = s.restore_slot, s.restore_pos
            self.slots.incref(s.restore_slot)
        self.seqs[dst] = d

    def remove(self, keys: list[int]) -> None:
        for k in keys:
            s = self.seqs.pop(k)
            if s.slot >= 0:
                self.slots.decref(s.slot)
            if s.restore_slot >= 0:
                self.slots.decref(s.restore_slot)

    def set_priority(self, key: int, priority: int) -> None:
        self.seqs[key].priority = priority

    # ---- queries ---------------------------------------------------------------------------------
    def live_slots(self, keys: list[int]) -> np.ndarray:
        return np.array([self.seqs[k].slot for k in keys], dtype=np.int64)

    def positions(self, keys: list[int]) -> np.ndarray:
        return np.array([self.seqs[k].pos for k in keys], dtype=np.int64)

    def held(self) -> np.ndarray:
        out = np.zeros(self.slots.num_slots, dtype=np.int32)
        for s in self.seqs.values():
            if s.slot >= 0:
                out[s.slot] += 1
            if s.restore_slot >= 0:
                out[s.restore_slot] += 1
        return out

    def check_invariants(self, computed: Callable[[int], int]) -> None:
        """Every slot's references add up; every state covers its sequence's committed
        tokens (``computed``)."""
        held = self.held()
        if self.snapshots is not None:
            held += self.snapshots.held()
        self.slots.check_invariants(held)
        for k, s in self.seqs.items():
            if s.pos != computed(k):
                raise InternalError(f"sequence {k}: its state covers {s.pos} tokens, its tables {computed(k)}")
