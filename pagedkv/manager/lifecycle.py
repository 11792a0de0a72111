"""A sequence's life in the manager: admission, the per-step reserve/advance/commit,
rollback, forks and release, deferred frees, and the caller's lock.

:class:`Lifecycle` works on what it is given (the id map, the namespace registry, the
table coordinator, the prefix tiers, the host tier, the copier), never on the cache;
absent parts are stand-ins (:mod:`pagedkv.manager.absent`), so no call asks whether a
part exists. Every method takes the manager's lock itself.
"""
from __future__ import annotations

import collections
import threading

import numpy as np

from pagedkv.errors import (
    ArgumentTypeError,
    InvalidArgumentError,
    PagedKVError,
    SequenceExistsError,
    expected,
)
from pagedkv.manager.absent import NoTiers
from pagedkv.manager.arguments import as_count, as_counts, as_int, as_token_ids, optional_int

# the window arena's block marks (pagedkv.store.window.WARM/SOON/COLD; that module imports torch)
WARM, SOON, COLD = 0, 1, 2

__all__ = ["CallerLock", "Lifecycle"]

_I64 = np.dtype(np.int64)


class CallerLock:
    """The manager's lock as callers hold it to make several calls atomic.

    While a caller holds it, frees queued by :meth:`PagedKVCache.free_deferred` wait,
    so they never land between two calls the caller meant to run together.
    """

    __slots__ = ("_lock", "depth")

    def __init__(self, lock: threading.RLock):
        self._lock = lock
        self.depth = 0          # caller acquisitions held now (changed only under the lock)

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        ok = self._lock.acquire(blocking, timeout)
        if ok:
            self.depth += 1
        return ok

    def release(self) -> None:
        self.depth -= 1
        self._lock.release()

    def __enter__(self) -> CallerLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class Lifecycle:
    """The calls that change which sequences hold which blocks (see ``PagedKVCache``).

    Args:
        config: the cache's ``CacheConfig``.
        lock: the manager's re-entrant lock; ``caller_lock`` its :class:`CallerLock`.
        ids: the :class:`~pagedkv.manager.seq_ids.SequenceIds` map.
        namespaces: the :class:`~pagedkv.manager.namespaces.NamespaceRegistry`.
        groups: the table coordinator (:mod:`pagedkv.manager.coordinator`).
        tiers: the prefix tiers, or :class:`~pagedkv.manager.absent.NoTiers`.
        host: the host tier, or :class:`~pagedkv.manager.absent.NoHost`.
        copies: where copy-on-write pairs go (:mod:`pagedkv.manager.absent`).
        sink_store: the KV store when it has a window arena (recent and sink tokens in
            model precision), else None.
    """

    def __init__(self, config, lock, caller_lock: CallerLock, ids, namespaces, groups, tiers, host, copies,
                 sink_store):
        self.config = config
        self.block_size = config.block_size
        self.lock = lock
        self.caller_lock = caller_lock
        self.ids = ids
        self.namespaces = namespaces
        self.groups = groups
        self.book = groups.book            # the per-step calls' target (see coordinator)
        self.first = groups.tables[0]      # token counts: the same in every group
        self.tiers = tiers
        # The per-step calls skip the stand-in's no-op calls: a Python call costs a
        # step measurably more than this test does.
        self.tiered = type(tiers) is not NoTiers
        self.host = host
        self.swapped = host.swapped        # key -> what is swapped out (a C-level membership test)
        self.copies = copies
        self.sink_store = sink_store
        self.sink_tokens = (config.kv_sink_tokens or 0) if sink_store is not None else 0
        window = sink_store.window if sink_store is not None else None
        # the newest tokens whose blocks keep their window copies (see window_marks): the
        # recent window; with block keys at least the newest block (its seal, a rollback)
        self.recent_tokens = window.window if window is not None else 0
        if window is not None and config.block_keys:
            self.recent_tokens = max(self.recent_tokens, 1)
        self.sink_blocks = config.precise_sink_blocks if self.sink_tokens else 0
        self.deferred: collections.deque = collections.deque()   # batches queued by free_deferred

    # ---- admission --------------------------------------------------------------------
    def add_sequence(self, seq_id, prompt_token_ids=None, *, cache_salt=None, adapter_id=None, priority=None,
                     max_cached_tokens=None) -> int:
        tokens = None if prompt_token_ids is None else as_token_ids(prompt_token_ids, "prompt_token_ids")
        priority = optional_int(priority, "priority", 0, 127)
        cap = None if max_cached_tokens is None else as_count(max_cached_tokens, "max_cached_tokens") // \
            self.block_size
        with self.lock:
            if self.deferred:
                self.run_deferred()
            key, fresh = self.ids.intern(seq_id)
            mark = len(self.namespaces)
            book = self.book
            try:
                if key in self.swapped:
                    raise SequenceExistsError(seq_id)
                ns_id, ns_hash = self.namespaces.register(cache_salt, adapter_id)
                prio = -1 if priority is None else priority
                hit = book.add(key, tokens, ns_id, ns_hash, prio) if cap is None else \
                    book.add(key, tokens, ns_id, ns_hash, prio, max_hit_blocks=cap)
            except BaseException:
                if fresh:
                    self.ids.forget(key)
                self.namespaces.rollback(mark)
                raise
            if tokens is not None and self.tiered:
                try:
                    hit = self.tiers.promote(key, tokens, ns_id, hit, max_blocks=cap)
                except BaseException:
                    book.remove(key, internal=True)
                    if fresh:
                        self.ids.forget(key)
                    raise
            if hit and self.sink_store is not None:
                if self.sink_tokens:        # a shared first block keeps its exact sink rows
                    self.sink_store.pin_sinks(self.first_blocks(np.array([key], np.int64), True), held_only=True)
                # the hit's newest blocks are this sequence's window now (another's may have left them cold)
                n = np.array([hit], np.int64)
                self._mark_blocks(np.array([key], np.int64), True, self._recent_from(n), -(-n // self.block_size), WARM)
            return hit

    def admit_restored(self, seq_id, tokens: np.ndarray, cache_salt, adapter_id, priority) -> None:
        """Admit a sequence of a layer-grouped cache whose KV is about to arrive whole
        from elsewhere (a transfer): no prefix lookup, sliding groups untracked (see
        :meth:`~pagedkv.groups.tables.GroupTables.add_restored`)."""
        if self.config.layer_groups is None:     # the transfer takes this path only for a layer-grouped cache
            raise InvalidArgumentError(expected("config.layer_groups", "a layer-grouped cache", None))
        with self.lock:
            if self.deferred:
                self.run_deferred()
            key, fresh = self.ids.intern(seq_id)
            mark = len(self.namespaces)
            try:
                if key in self.first or key in self.swapped:
                    raise SequenceExistsError(seq_id)
                ns_id, ns_hash = self.namespaces.register(cache_salt, adapter_id)
                self.groups.add_restored(key, tokens, ns_id, ns_hash, -1 if priority is None else priority)
            except BaseException:
                if fresh:
                    self.ids.forget(key)
                self.namespaces.rollback(mark)
                raise

    # ---- each step --------------------------------------------------------------------
    def reserve(self, seq_ids, num_tokens) -> np.ndarray:
        if not (type(num_tokens) is int or (type(num_tokens) is np.ndarray and num_tokens.dtype is _I64)):
            num_tokens = as_counts(num_tokens)
        with self.lock:
            if self.deferred:
                self.run_deferred()
            keys, internal = self.ids.batch(seq_ids)
            book = self.book
            slots = book.reserve(keys, num_tokens, internal=internal)
            if self.tiered:
                self.tiers.sync()      # evicted KV goes down before anything overwrites it
            if book.num_pending_copies:
                self.copies.copy(book.take_copies())
            if self.sink_store is not None:
                self.window_marks(keys, internal, num_tokens, slots)
                if self.sink_tokens:
                    self.pin_sinks(keys, internal, num_tokens)
            return slots

    def advance(self, seq_ids, token_ids) -> np.ndarray:
        token_ids = as_token_ids(token_ids)
        with self.lock:
            if self.deferred:
                self.run_deferred()
            keys, internal = self.ids.batch(seq_ids)
            book = self.book
            slots = book.advance(keys, token_ids, internal=internal)
            if self.tiered:
                self.tiers.sync()
            if book.num_pending_copies:
                self.copies.copy(book.take_copies())
            if self.sink_store is not None:
                self.window_marks(keys, internal, 1, slots)
                if self.sink_tokens:
                    self.pin_sinks(keys, internal, 1)
            return slots

    def commit(self, seq_ids, num_tokens, token_ids=None) -> None:
        if not (type(num_tokens) is int or (type(num_tokens) is np.ndarray and num_tokens.dtype is _I64)):
            num_tokens = as_counts(num_tokens)
        if token_ids is not None:
            token_ids = as_token_ids(token_ids)
        with self.lock:
            keys, internal = self.ids.batch(seq_ids)
            self.book.commit(keys, num_tokens, token_ids, internal=internal)
            if self.tiered:
                self.tiers.sync()
            if self.sink_store is not None:
                self.left_window(keys, internal, num_tokens)

    def window_marks(self, keys, internal: bool, reserved, slots: np.ndarray) -> None:
        """Tell the window arena what reads will want the reserved blocks' rows exact
        (:meth:`RecentWindow.mark`). A sequence's sink blocks and the blocks holding its
        newest ``kv_window`` tokens are warm. A fresh block of the reservation (no rows
        before it) that is neither is cold: a long prefill's early blocks, read only in
        flight by this pass; a reused block loses its old mark. The blocks of the
        previous newest tokens that this pass leaves behind are read only by this pass
        (soon cold). So a prefill cannot push other sequences' windows out; per
        sequence the warm blocks never outnumber ``ceil(kv_window / block_size) + 1``
        (a decode step: its newest ``kv_window + 1`` tokens), what the arena holds."""
        bs = self.block_size
        blocks = slots // bs
        window = self.sink_store.window
        if type(reserved) is int and reserved <= self.recent_tokens:   # decode: every block is warm
            # (a reservation's slots are >= 0; one assignment: the lock adds nothing here;
            # a decode step runs these few array operations, nothing per sequence)
            window.cold[blocks] = WARM
            # a one-token commit marks nothing (see left_window): the block whose last row
            # left the newest kv_window with the previous token goes cold here, found by
            # each sequence's first reserved slot (position = slot mod block_size), rarely
            if np.count_nonzero(slots[..., ::reserved] % bs == self.recent_tokens % bs):
                self._mark_previous(keys, internal, reserved)
            return
        keep = slots >= 0
        lens = np.atleast_1d(self.first.seq_lens(keys, False, internal=internal)).astype(np.int64)
        counts = np.broadcast_to(np.asarray(reserved, dtype=np.int64), lens.shape)
        total = int(counts.sum())
        starts = np.repeat(np.cumsum(counts) - counts, counts)
        pos = np.repeat(lens - counts, counts) + np.arange(total, dtype=np.int64) - starts
        first = pos - slots % bs            # each slot's block's first position (every group's row)
        fresh = first >= np.repeat(lens - counts, counts)
        cold = fresh & (first >= self.sink_blocks * bs) & (first + bs <= np.repeat(lens, counts) - self.recent_tokens)
        window.mark(blocks[keep], np.where(cold, COLD, WARM)[keep])
        before = lens - counts
        lo, hi = self._recent_from(before), np.minimum(self._recent_from(lens), -(-before // bs))
        self._mark_blocks(keys, internal, lo, hi, SOON)
        self._mark_blocks(keys, internal, self._recent_from(before - 1), self._recent_from(before), COLD)

    def _mark_previous(self, keys, internal: bool, reserved: int) -> None:
        """Cold: the block each sequence's token before this reservation pushed out of its
        newest ``kv_window`` (a one-token commit leaves that to the next reservation)."""
        before = np.atleast_1d(self.first.seq_lens(keys, False, internal=internal)).astype(np.int64) - reserved
        self._mark_blocks(keys, internal, self._recent_from(before - 1), self._recent_from(before), COLD)

    def left_window(self, keys, internal: bool, committed) -> None:
        """After a commit: the blocks whose rows all left their sequence's newest
        ``kv_window`` committed tokens (and hold no sink token) become cold, so their
        window slots are the first to go and the sequences that still read theirs keep
        them (least-recently-written alone would take a paused sequence's window first)."""
        if type(committed) is int and committed == 1:   # a decode step: its next reservation marks it
            return
        lens = np.atleast_1d(self.first.seq_lens(keys, True, internal=internal)).astype(np.int64)
        before = lens - np.asarray(committed, dtype=np.int64)
        self._mark_blocks(keys, internal, self._recent_from(before), self._recent_from(lens), COLD)

    def _recent_from(self, lens: np.ndarray) -> np.ndarray:
        """Per sequence of ``lens`` tokens, the first block (past the sinks') that holds
        one of its newest ``kv_window`` tokens."""
        return np.maximum(np.maximum(lens - self.recent_tokens, 0) // self.block_size, self.sink_blocks)

    def _mark_blocks(self, keys, internal: bool, lo: np.ndarray, hi: np.ndarray, state: int) -> None:
        """Mark ``state`` the blocks ``[lo[b], hi[b])`` of each sequence's tables."""
        moved = np.nonzero(hi > lo)[0]
        if not len(moved):
            return
        arr = np.atleast_1d(np.asarray(keys, dtype=np.int64))[moved]
        found = []
        for t in self.groups.tables:
            table = t.block_table(arr, -1, None, internal=internal)
            for r, b in enumerate(moved.tolist()):
                found.append(table[r, lo[b]:hi[b]])
        blocks = np.concatenate(found).astype(np.int64)
        self.sink_store.window.mark(blocks[blocks >= 0], state)

    def pin_sinks(self, keys, internal: bool, reserved) -> None:
        """Pin the first blocks of the sequences whose reservation just covered one of
        their first ``kv_sink_tokens`` tokens, so those tokens stay in model precision."""
        lens = np.atleast_1d(self.first.seq_lens(keys, False, internal=internal))
        starts = lens - reserved
        fresh = starts < self.sink_tokens
        if not fresh.any():
            return
        self.sink_store.pin_sinks(self.first_blocks(np.atleast_1d(np.asarray(keys, dtype=np.int64))[fresh], internal))

    def first_blocks(self, keys: np.ndarray, internal: bool) -> np.ndarray:
        """The blocks holding the sink tokens of ``keys``, in every layer group's table
        (-1 where a table has none yet)."""
        width = self.config.precise_sink_blocks
        firsts = [t.block_table(keys, -1, None, internal=internal)[:, :width].reshape(-1) for t in self.groups.tables]
        return np.concatenate(firsts).astype(np.int64)

    # ---- rollback and windows ---------------------------------------------------------------
    def unreserve(self, seq_ids, num_tokens) -> None:
        with self.lock:
            keys, internal = self.ids.batch(seq_ids)
            if num_tokens is not None:
                if type(num_tokens) is int or isinstance(num_tokens, np.integer):
                    num_tokens = np.full(1 if isinstance(keys, int) else len(keys), as_count(num_tokens), np.int64)
                else:
                    num_tokens = as_counts(num_tokens)
            self.book.unreserve(keys, num_tokens, internal=internal)

    def truncate(self, seq_ids, num_tokens) -> None:
        with self.lock:
            if self.deferred:
                self.run_deferred()
            keys, internal = self.ids.batch(seq_ids)
            if type(num_tokens) is int or isinstance(num_tokens, np.integer):
                num_tokens = np.full(1 if isinstance(keys, int) else len(keys), as_count(num_tokens, "num_tokens"),
                                     np.int64)
            else:
                num_tokens = as_counts(num_tokens, "num_tokens")
            self.book.truncate(keys, num_tokens, internal=internal)

    def hold_window(self, seq_ids, hold: bool) -> None:
        if not isinstance(hold, bool):
            raise ArgumentTypeError(expected("hold", "True or False", repr(hold)))
        with self.lock:
            keys, internal = self.ids.batch(seq_ids)
            self.book.hold_window(keys, hold, internal=internal)

    def slide_window(self, seq_ids) -> None:
        with self.lock:
            keys, internal = self.ids.batch(seq_ids)
            self.book.slide(keys, internal=internal)

    def set_priority(self, seq_id, priority, start_token, end_token) -> None:
        priority = as_int(priority, "priority", 0, 127)
        start_token = as_count(start_token, "start_token")
        end_token = optional_int(end_token, "end_token")
        with self.lock:
            self.book.set_priority(self.ids.key(seq_id), priority, start_token, end_token)

    # ---- forks and release ------------------------------------------------------------------
    def fork(self, src, dst) -> None:
        with self.lock:
            if self.deferred:
                self.run_deferred()
            sk = self.ids.key(src, "src")
            dk, fresh = self.ids.intern(dst, "dst")
            try:
                if dk in self.first or dk in self.swapped:
                    raise SequenceExistsError(dst, "dst")
                self.book.fork(sk, dk)
            except BaseException:
                if fresh:
                    self.ids.forget(dk)
                raise

    def free(self, seq_ids) -> None:
        with self.lock:
            if self.deferred:
                self.run_deferred()
            self._free(seq_ids)

    def _free(self, seq_ids) -> None:
        keys, internal = self.ids.batch(seq_ids)
        if not self.swapped:
            self.book.remove(keys, internal=internal)
            if internal:
                self._forget(keys)
            return
        arr = np.array([keys], dtype=np.int64) if type(keys) is int else np.asarray(keys, dtype=np.int64)
        listed = arr.tolist()
        held = self.swapped
        swapped = np.fromiter(((internal or k >= 0) and k in held for k in listed), dtype=bool,
                              count=len(listed))
        if not swapped.any():
            self.book.remove(keys, internal=internal)
        else:
            # Validate the whole batch before anything is released: each id once, and
            # every id that is not swapped out live on the device.
            seen = set()
            for i, k in enumerate(listed):
                if k in seen:
                    raise InvalidArgumentError(expected("seq_ids", "each sequence at most once per call",
                                                        f"{self.ids.name(k)!r} repeated at index {i}"))
                seen.add(k)
            live = arr[~swapped]
            if len(live):
                self.first.seq_lens(live, internal=internal)     # raises for an unknown id: nothing freed
                self.book.remove(live, internal=internal)
            for k in arr[swapped].tolist():
                self.host.discard(k)
        if internal:
            self._forget(arr)

    def _forget(self, keys) -> None:
        if type(keys) is int:
            self.ids.forget(keys)
            return
        for k in keys[keys < 0].tolist():
            self.ids.forget(k)

    def free_deferred(self, seq_ids) -> None:
        self.deferred.append(list(seq_ids) if isinstance(seq_ids, (list, range, np.ndarray)) else [seq_ids])

    def run_deferred(self) -> None:
        """Free the batches :meth:`free_deferred` queued (their ids still live), unless a
        caller holds the lock to compose calls."""
        if self.caller_lock.depth:
            return                     # a caller is composing calls under the lock: wait
        while self.deferred:
            live = []
            for sid in self.deferred.popleft():
                try:
                    key = self.ids.key(sid)
                except PagedKVError:
                    continue
                if key in self.first or key in self.swapped:
                    live.append(sid)
            if live:
                self._free(live)

    def settle(self) -> None:
        """Run the queued frees now (the start of an allocating call or a capacity query)."""
        if self.deferred:
            self.run_deferred()
