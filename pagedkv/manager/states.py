"""The table coordinator of a cache with recurrent-state layers: the attention groups'
coordinator (:mod:`pagedkv.manager.coordinator`) plus the state group
(:class:`~pagedkv.state.tables.StateTables`), driven as one.

Every lifecycle call goes to both, all or nothing: the state pool's room is checked
before the attention tables change, and what fails in the tables leaves the states as
they were. The prefix hit of an admission is the longest prefix *every* group agrees
on: the attention groups' chains and windows, and a state snapshot at exactly that
boundary (:meth:`~pagedkv.groups.spec.RecurrentStateSpec.longest_hit`); the admission
is capped there, so a KV-only hit never advances a request. A rollback resumes where a
state can be restored, and drops the tokens after it from every group
(:meth:`~pagedkv.state.tables.StateTables.resume_point`).
"""
from __future__ import annotations

import dataclasses
import struct
from typing import Any

import numpy as np

from pagedkv._core.prefix import hash_bytes
from pagedkv.errors import InternalError, InvalidArgumentError, expected
from pagedkv.state.slots import StateSlots
from pagedkv.state.snapshots import Lookup, SnapshotIndex
from pagedkv.state.tables import StateTables

__all__ = ["StateGroups", "StateStats"]

# the state group's prefix namespace is the cache namespace's, hashed with this tag
_STATE_TAG = 0x7374617465        # "state"


@dataclasses.dataclass(frozen=True)
class StateStats:
    """The state pool's figures (``CacheStats.states``)."""

    total_slots: int
    free_slots: int
    live_slots: int                # slots held by sequences (their state or a restore point)
    snapshots: int                 # snapshots held (pinned ones included)
    pinned_snapshots: int
    snapshots_stored: int          # taken, ever
    snapshot_hits: int             # admissions that resumed from a snapshot
    snapshots_evicted: int
    verify_failures: int           # a digest matched, the tokens or namespace did not (a miss)
    state_copies: int              # copy-on-write state copies
    recomputed_tokens: int         # tokens rollbacks sent back to be computed again
    slot_bytes: int                # one slot: one sequence's state in every state layer
    bytes_in_use: int              # slots held, live or snapshot
    tiers: tuple = ()              # per prefix tier keeping snapshots: its shelf's figures (a dict)

    def describe(self) -> str:
        return (f"State pool: {self.total_slots - self.free_slots}/{self.total_slots} slots in use "
                f"({self.live_slots} held by sequences, {self.snapshots} snapshots, {self.pinned_snapshots} pinned), "
                f"{self.slot_bytes:,} B per slot; {self.snapshot_hits} snapshot hits, {self.snapshots_stored} "
                f"stored, {self.snapshots_evicted} evicted, {self.state_copies} copies, "
                f"{self.recomputed_tokens} tokens recomputed after rollbacks")


def _keys(keys) -> list[int]:
    return [keys] if type(keys) is int else np.asarray(keys, dtype=np.int64).tolist()


def _counts(counts, n: int) -> list[int]:
    if counts is None:
        return [0] * n
    if isinstance(counts, (int, np.integer)):
        return [int(counts)] * n
    return np.asarray(counts, dtype=np.int64).reshape(-1).tolist()


class StateGroups:
    """``inner`` (a :class:`~pagedkv.manager.coordinator.OneGroup` or
    :class:`~pagedkv.manager.coordinator.Groups`) with the state group of ``config``.

    ``store``: the :class:`~pagedkv.state.store.StateStore`, or None for a
    bookkeeping-only cache (the state copies are then owed: :meth:`take_state_copies`)."""

    def __init__(self, inner, config, index, store=None):
        self.inner = inner
        self.config = config
        self.spec = config.state_spec
        self.block_size = config.block_size
        self.tables = inner.tables
        self.specs = inner.specs
        self.pool = inner.pool
        self.index = index
        self.store = store
        self.slots = StateSlots(config.resolved_state_slots)
        self.snapshots = None if index is None else SnapshotIndex(
            config.block_size, self.slots, index.hash_tokens, config.eviction, config.priority_classes)
        first = inner.tables[0]
        self.states = StateTables(self.spec, self.slots, self.snapshots, first.tokens)
        self.limited_by = inner.limited_by
        self.state_limited = 0          # admissions whose hit the state group lowered
        self._owed: tuple[list, list] = ([], [])
        self.tier_states = None         # snapshots on the prefix tiers (pagedkv.manager.state_tiers)
        # KV events of the snapshots (the state group's, after the attention groups)
        self.state_group = len(inner.tables)
        self._events: list = []
        self._names = None
        if self.snapshots is not None and getattr(index, "events_enabled", False):
            self.snapshots.on_event = self._snapshot_event

    def names(self, registry):
        self._names = registry
        return self.inner.names(registry)

    def _snapshot_event(self, snap, stored: bool) -> None:
        from pagedkv.events import BlockRemoved, BlockStored

        if not stored:
            self._events.append(BlockRemoved([snap.digest], [snap.slot], group=self.state_group))
            return
        ns = None if snap.ns_id == 0 or self._names is None else self._names.name(snap.ns_id)
        self._events.append(BlockStored([snap.digest], snap.parent, self.block_size, ns, [snap.slot],
                                        token_ids=snap.tokens[-self.block_size:].tolist(), group=self.state_group))

    def drain_state_events(self) -> list:
        """The snapshots' events since the last drain: a :class:`~pagedkv.events.BlockStored`
        of the block a snapshot ends (hashed in the state group's namespace, its parent the
        block before) when one is taken or loaded, a :class:`~pagedkv.events.BlockRemoved`
        when it is dropped; ``group`` is the state group's index."""
        out, self._events = self._events, []
        return out

    def close_tiers(self) -> None:
        """Close the tiers' shelves (a remote shelf's connections)."""
        if self.tier_states is not None:
            self.tier_states.close()

    def attach_tiers(self, shelves: list, key_of) -> None:
        """Keep snapshots on the prefix tiers' ``shelves`` too (``key_of``: the cache
        namespace registry's)."""
        from pagedkv.manager.state_tiers import StateTiers

        if shelves and self.snapshots is not None and self.store is not None:
            self.tier_states = StateTiers(shelves, self.states, self.store, key_of)

    # ---- a state that moves whole (swap, transfer) -----------------------------------------
    def export_state_of(self, key: int) -> bytes | None:
        """``key``'s state as bytes (zeros for the initial state; None without a store),
        covering exactly its committed tokens: one written past them is refused."""
        s = self.states.seqs[key]
        if s.written:
            raise InvalidArgumentError(expected(
                "seq_id", "a sequence whose state covers its committed tokens (commit or unreserve the step)",
                f"{self.inner.tables[0].namer(key)!r} with a state written past them"))
        if self.store is None:
            return None
        return bytes(self.store.slot_nbytes()) if s.slot < 0 else self.store.export_slot(s.slot)

    def import_state_of(self, key: int, data: bytes | None) -> None:
        """Write ``data`` (:meth:`export_state_of`'s) into ``key``'s own slot (after a
        reserve); the next commit files it where a snapshot is due."""
        if data is None or self.store is None:
            return
        s = self.states.seqs[key]
        if s.slot < 0 or self.slots.ref[s.slot] != 1:
            raise InternalError(f"a state imported into sequence {key} without a slot of its own (a bug)")
        self.store.import_slot(s.slot, data)
        s.written = True

    # ---- a promotion from the prefix tiers (PrefixTiers.promote) ------------------------------
    @property
    def attention(self):
        """The attention groups' coordinator: a promotion reserves and commits their
        blocks there; the state resumes from a snapshot (:meth:`resume_promoted`)."""
        return self.inner

    def cap_promotion(self, key: int, tokens: np.ndarray, have: int, n: int) -> int:
        """The most of ``n`` promoted blocks past ``have`` that end where a verified
        snapshot exists (device or tier): a KV-only promotion never advances a request."""
        if self.tier_states is not None:
            return self.tier_states.cap(key, tokens, have, n)
        s = self.states.seqs[key]
        for m in range(n, 0, -1):
            if self.snapshots is not None and self.snapshots.find(
                    tokens[:(have + m) * self.block_size], s.ns_id, s.ns_hash) is not None:
                return m
        return 0

    def cap_match(self, tokens: np.ndarray, ns_key: bytes, ns: tuple[int, int] | None, upto: int) -> int:
        """Tokens of a tier match (``upto``) that end where a snapshot exists."""
        dev = None if ns is None else self.state_namespace(*ns)
        if self.tier_states is not None:
            return self.tier_states.held(tokens, ns_key, dev, upto)
        for k in range(upto // self.block_size, 0, -1):
            if dev is not None and self.snapshots is not None and self.snapshots.find(
                    tokens[:k * self.block_size], *dev) is not None:
                return k * self.block_size
        return 0

    def resume_promoted(self, key: int, tokens: np.ndarray, blocks: int) -> None:
        s = self.states.seqs[key]
        snap = self.snapshots.find(tokens[:blocks * self.block_size], s.ns_id, s.ns_hash)  # type: ignore[union-attr]
        if snap is None:
            raise InternalError(f"the state snapshot at {blocks} blocks vanished during a promotion (a bug)")
        self.states.resume(key, snap)

    def __getattr__(self, name: str) -> Any:
        # what the state group does not change (queries, exports, relocation) is the inner coordinator's
        return getattr(self.__dict__["inner"], name)

    @property
    def book(self) -> StateGroups:
        return self

    @property
    def num_pending_copies(self) -> int:
        return self.inner.num_pending_copies

    def state_namespace(self, ns_id: int, ns_hash: int) -> tuple[int, int]:
        """The state group's prefix namespace for a cache namespace."""
        return ns_id, hash_bytes(struct.pack("<QQ", ns_hash & (2**64 - 1), _STATE_TAG))

    # ---- prefix hits -----------------------------------------------------------------------
    def _hit(self, tokens: np.ndarray, ns_id: int, ns_hash: int, cap: int) -> tuple[int, Lookup, int]:
        """``(blocks every group agrees on, the state lookup, blocks of the attention chain)``."""
        inner = self.inner
        hits = inner.prefix_hits(tokens, ns_id, ns_hash, cap)
        chain = inner.agreed_hit(hits, cap)
        found = self.states.lookup(tokens, *self.state_namespace(ns_id, ns_hash), chain)
        best = self.spec.longest_hit(found, chain, cap)
        while True:
            again = inner.agreed_hit(hits, best)
            if again == best:
                return best, found, chain
            best = self.spec.longest_hit(found, again, again)

    def prefix_hits(self, tokens, ns_id: int, ns_hash: int, cap: int | None = None) -> list[int]:
        """Per group (the attention groups, then the state group), the blocks each may reuse."""
        top = len(tokens) // self.block_size if cap is None else cap
        hits = self.inner.prefix_hits(tokens, ns_id, ns_hash, top)
        chain = self.inner.agreed_hit(hits, top)
        found = self.states.lookup(tokens, *self.state_namespace(ns_id, ns_hash), chain)
        return hits + [self.spec.longest_hit(found, chain, top)]

    def match(self, tokens: np.ndarray, ns_id: int, ns_hash: int) -> dict:
        bs = self.block_size
        top = len(tokens) // bs
        hits = self.inner.prefix_hits(tokens, ns_id, ns_hash, top)
        best, _, chain = self._hit(tokens, ns_id, ns_hash, top)
        per = [h * bs for h in hits] + [best * bs]
        least = best * bs
        limited = None
        if per.count(least) != len(per):
            limited = len(per) - 1 if best < chain else per.index(min(per))
        return {"tokens": least, "per_group": per, "limited_by": limited}

    def blocks_to_admit(self, tokens: np.ndarray, total: int, ns_id: int, ns_hash: int) -> int:
        cap = max(0, (len(tokens) - 1) // self.block_size)
        best = self._hit(tokens, ns_id, ns_hash, cap)[0] if self.index is not None else 0
        # the attention groups' count, their hit capped where the state resumes
        return self.inner.blocks_to_admit(tokens[:best * self.block_size + 1], total, ns_id, ns_hash)

    # ---- lifecycle -------------------------------------------------------------------------------
    def add(self, key: int, tokens=None, ns_id: int = 0, ns_hash: int = 0, priority: int = -1,
            lookup: bool = True, max_hit_blocks: int | None = None) -> int:
        hit, found, chain = 0, Lookup(), 0
        if self.index is not None and tokens is not None and len(tokens) and lookup:
            cap = (len(tokens) - 1) // self.block_size
            if max_hit_blocks is not None:
                cap = min(cap, max_hit_blocks)
            hit, found, chain = self._hit(tokens, ns_id, ns_hash, cap)
            if hit < chain:
                self.state_limited += 1
        got = self.inner.add(key, tokens, ns_id, ns_hash, priority, max_hit_blocks=hit)
        if got != hit * self.block_size:
            self.inner.remove(key, internal=True)
            raise InternalError(f"the attention groups reused {got} tokens where every group agreed on "
                                f"{hit * self.block_size} (a bug)")
        self.states.add(key, *self.state_namespace(ns_id, ns_hash), priority, hit, found, chain)
        return got

    def add_restored(self, key: int, tokens, ns_id: int, ns_hash: int, priority: int = -1) -> None:
        self.inner.add_restored(key, tokens, ns_id, ns_hash, priority)
        self.states.add_restored(key, *self.state_namespace(ns_id, ns_hash), priority)

    def _known(self, keys, internal: bool) -> list[int]:
        self.tables[0].seq_lens(keys, internal=internal)     # unknown or malformed ids raise here, typed
        return _keys(keys)

    def reserve(self, keys, counts, internal: bool = False) -> np.ndarray:
        ks = self._known(keys, internal)
        need = self.states.need(ks)
        self.states.check_room(need, "reserve")
        slots = self.inner.reserve(keys, counts, internal=internal)
        self._prepare(ks, need)
        return slots

    def advance(self, keys, token_ids, internal: bool = False) -> np.ndarray:
        ks = self._known(keys, internal)
        first = self.tables[0]
        pending = [first.num_reserved(k) - first.num_computed(k) for k in ks]
        due = self.states.snapshot_due(ks, pending)
        need = self.states.need(ks, due)
        self.states.check_room(need, "advance")
        slots = self.inner.advance(keys, token_ids, internal=internal)
        self.states.commit(ks, np.asarray(pending, dtype=np.int64), np.zeros(len(ks), dtype=bool))
        self._prepare(ks, need)
        return slots

    def _prepare(self, ks: list[int], need: int) -> None:
        self.states.make_room(need)
        self.states.prepare(ks)
        self._flush()

    def _flush(self) -> None:
        copies, zeroed = self.states.take()
        if self.store is not None:
            self.store.copy(copies)
            self.store.zero(zeroed)
        else:
            self._owed[0].extend(copies)
            self._owed[1].extend(zeroed)

    def take_state_copies(self) -> tuple[list[tuple[int, int]], list[int]]:
        """The state copies ``(src, dst)`` and zero fills a bookkeeping-only cache owes
        its own state store."""
        owed, self._owed = self._owed, ([], [])
        return owed

    def commit(self, keys, counts, token_ids=None, internal: bool = False) -> None:
        ks = self._known(keys, internal)
        n = np.asarray(_counts(counts, len(ks)), dtype=np.int64)
        self.inner.commit(keys, counts, token_ids, internal=internal)
        # tokens known before the step (a prompt chunk) end a prefill chunk; new ids are decoded tokens
        self.states.commit(ks, n, np.full(len(ks), token_ids is None))

    def _rewind(self, keys, internal: bool, targets: list[int]) -> None:
        """Bring each sequence back to where its state can resume at or before its target
        (every group drops the tokens after it)."""
        ks = _keys(keys)
        first = self.tables[0]
        points = [self.states.resume_point(k, t) for k, t in zip(ks, targets)]
        extra = np.array([first.num_computed(k) - p for k, p in zip(ks, points)], dtype=np.int64)
        if extra.any():
            self.inner.truncate(np.asarray(ks, dtype=np.int64), extra, internal=True)
        for k, p, t in zip(ks, points, targets):
            self.states.rewind(k, p, t)
        self._flush()

    def unreserve(self, keys, counts=None, internal: bool = False) -> None:
        ks = self._known(keys, internal)
        self.inner.unreserve(keys, counts, internal=internal)
        dirty = [k for k in ks if self.states.seqs[k].written]
        if dirty:           # a step given back after its state was written: resume where a state is kept
            self._rewind(np.asarray(dirty, dtype=np.int64), True, [self.states.seqs[k].pos for k in dirty])

    def truncate(self, keys, counts, internal: bool = False, check_only: bool = False) -> None:
        """Drop the last ``counts`` committed tokens, and more where the state cannot
        resume there: back to the newest restore point or snapshot of the sequence's own
        prefix (the caller computes those tokens again; ``num_tokens`` says where each
        resumes). All or nothing."""
        ks = self._known(keys, internal)
        first = self.tables[0]
        for t in self.tables:       # the counts asked for are valid (typed errors name them)
            t.truncate(keys, counts, internal=internal, check_only=True)
        n = _counts(counts, len(ks))
        targets = [first.num_computed(k) - c for k, c in zip(ks, n)]
        points = [self.states.resume_point(k, t) for k, t in zip(ks, targets)]
        drop = np.array([first.num_computed(k) - p for k, p in zip(ks, points)], dtype=np.int64)
        arr = np.asarray(ks, dtype=np.int64)
        for t in self.tables:
            t.truncate(arr, drop, internal=True, check_only=True)
        if check_only:
            return
        self.inner.truncate(arr, drop, internal=True)
        for k, p, t in zip(ks, points, targets):
            self.states.rewind(k, p, t)
        self._flush()

    def fork(self, src: int, dst: int) -> None:
        self.inner.fork(src, dst)
        self.states.fork(src, dst)

    def remove(self, keys, internal: bool = False) -> None:
        ks = self._known(keys, internal)
        self.inner.remove(keys, internal=internal)
        self.states.remove(ks)

    def hold_window(self, keys, hold: bool = True, internal: bool = False) -> None:
        ks = self._known(keys, internal)
        self.inner.hold_window(keys, hold, internal=internal)
        self.states.record(ks, hold)

    def set_priority(self, key: int, priority: int, start_token: int = 0, end_token: int | None = None) -> None:
        self.inner.set_priority(key, priority, start_token, end_token)
        self.states.set_priority(key, priority)

    # ---- pins, stats, audit ------------------------------------------------------------------------
    def pin_states(self, tokens: np.ndarray, ns_id: int, ns_hash: int, pin: bool) -> int:
        if self.snapshots is None:
            return 0
        return self.snapshots.pin(tokens, *self.state_namespace(ns_id, ns_hash), pin)

    def clear_states(self) -> None:
        if self.snapshots is not None:
            self.snapshots.clear()
        if self.tier_states is not None:
            self.tier_states.clear()

    def state_stats(self) -> StateStats:
        snaps = self.snapshots
        live = int((self.states.held() > 0).sum())
        used = self.slots.num_in_use
        return StateStats(
            total_slots=self.slots.num_slots, free_slots=self.slots.num_free, live_slots=live,
            snapshots=len(snaps) if snaps else 0,
            pinned_snapshots=sum(1 for s in snaps.snapshots() if s.pins) if snaps else 0,
            snapshots_stored=snaps.num_stored if snaps else 0, snapshot_hits=snaps.num_hits if snaps else 0,
            snapshots_evicted=snaps.num_evicted if snaps else 0,
            verify_failures=snaps.num_verify_failures if snaps else 0,
            state_copies=self.states.num_copies, recomputed_tokens=self.states.num_recomputed,
            slot_bytes=self.spec.slot_bytes(), bytes_in_use=used * self.spec.slot_bytes(),
            tiers=self.tier_states.stats() if self.tier_states is not None else ())

    def stats(self, pool, config, host, tiers):
        base = self.inner.stats(pool, config, host, tiers)
        return dataclasses.replace(base, states=self.state_stats(),
                                   group_hit_limits=tuple(base.group_hit_limits) + (self.state_limited,))

    def sequence_info(self, info: dict, key: int) -> dict:
        info = self.inner.sequence_info(info, key)
        s = self.states.seqs[key]
        info["state"] = {"slot": s.slot, "tokens": s.pos, "next_checkpoint": self.states.next_checkpoint(key),
                         "restore_point": s.restore_pos if s.restore_slot >= 0 else None}
        return info

    def check_invariants(self) -> None:
        self.inner.check_invariants()
        first = self.tables[0]
        if sorted(self.states.seqs) != sorted(first.keys().tolist()):
            raise InternalError("the state group holds other sequences than the attention tables")
        self.states.check_invariants(first.num_computed)
