"""PagedKVCache: the manager that joins the bookkeeping core to the KV store.

An engine calls it at four points:

- **admission**: :meth:`PagedKVCache.add_sequence` learns how much of the prompt is
  already cached (full blocks only, never the whole prompt); :meth:`can_admit` says
  beforehand, exactly, whether the blocks are there;
- **each step**: :meth:`reserve` slots for the next tokens of many sequences in one
  call, :meth:`write` their K/V per layer, :meth:`gather` (or hand
  :meth:`page_table_csr` / :meth:`block_tables` to an attention kernel);
- **after the step**: :meth:`commit` the computed tokens (full blocks become
  reusable prefixes);
- **completion**: :meth:`free`.

Thread safety: one re-entrant lock in the manager serialises every call, queries
included, because the core's batch loops release the GIL while they mutate. The data
calls (:meth:`write`, the read of :meth:`gather`, :meth:`gather_pages`) run outside it,
so that sequences' KV moves in parallel; the one store state they share between
sequences, the window arena's slot map (``kv_window``, ``kv_sink_tokens``), has its own
lock (:mod:`pagedkv.store.window`). The core classes used directly are not thread-safe. Reads of the store that race with writes of
the same slots are the caller's business, as with any KV cache.

Sequence ids may be any hashable (see :mod:`pagedkv.manager.seq_ids` for the rule: a list, a
``range`` or a 1-D array is a batch, anything else, tuples included, is one id).
Non-negative ints address the core directly, so a batch call given an int64 NumPy
array crosses into Cython once with no per-id Python work; other ids are interned to
private negative keys, and errors always name the caller's id.

Bad input raises a typed :mod:`pagedkv.errors` error (checks in
:mod:`pagedkv.manager.arguments`), and a call that raises changes nothing.
"""
from __future__ import annotations

import collections
import threading
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from pagedkv._core.pool import BlockPool
from pagedkv._core.prefix import PrefixIndex
from pagedkv._core.tables import BlockTables
from pagedkv.config.options import CacheConfig, format_bytes
from pagedkv.errors import (
    ArgumentTypeError,
    InvalidArgumentError,
    InvalidBlockError,
    PagedKVError,
    SequenceExistsError,
    SequenceNotFoundError,
    expected,
)
from pagedkv.manager.arguments import as_count, as_counts, as_int, as_token_ids, optional_int, tensor_values
from pagedkv.manager.events import KVEvent, events_from_records
from pagedkv.manager.namespaces import NamespaceRegistry, namespace_key
from pagedkv.manager.pool_view import PoolView
from pagedkv.manager.seq_ids import SequenceIds
from pagedkv.manager.stats import CacheStats, render_block_map

if TYPE_CHECKING:
    from pagedkv.groups.tables import GroupNamespaces

__all__ = ["PagedKVCache", "as_token_ids"]

SeqId = Any
SeqIds = SeqId | Sequence[SeqId] | np.ndarray

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


class PagedKVCache:
    """A paged KV cache for one model (see the module docstring for the call order).

    Args:
        config: the :class:`~pagedkv.config.options.CacheConfig`.
        allocate_store: allocate the KV arenas (torch). ``False`` gives a
            bookkeeping-only cache (no torch needed), e.g. for a scheduler or tests.

    (A cache whose block hash collides on purpose, for tests, comes from
    :func:`pagedkv.testing.weak_hash_cache`.)

    With prefix tiers configured (``config.prefix_host_blocks``,
    ``config.prefix_disk_blocks``), evicted prefix blocks move down to host memory and
    disk and come back on admission (:mod:`pagedkv.tiers`); :meth:`close` releases the
    disk tier's files (also on leaving a ``with`` block).
    """

    def __init__(self, config: CacheConfig, *, allocate_store: bool = True):
        if not isinstance(config, CacheConfig):
            raise InvalidArgumentError(expected("config", "a CacheConfig", type(config).__name__))
        if not isinstance(allocate_store, bool):
            raise ArgumentTypeError(expected("allocate_store", "True or False", repr(allocate_store)))
        self.store = None
        if allocate_store:
            from pagedkv.store.kvstore import KVStore

            self.store = KVStore(config)
            config = self.store.config  # may differ: fp8 -> int8 fallback
        self.config = config
        # sink tokens matter only where a store keeps model-precision copies of them
        if config.window_note is not None and allocate_store:
            warnings.warn(f"pagedkv: {config.window_note}", RuntimeWarning, stacklevel=2)
        self._sink_tokens = config.kv_sink_tokens if self.store is not None and self.store.window is not None else 0
        nb = config.resolved_num_blocks
        self.index: PrefixIndex | None = self._prefix_index(config) if config.enable_prefix_caching else None
        self._pool = BlockPool(nb, config.eviction, priority_classes=config.priority_classes,
                              low_watermark=config.low_watermark, high_watermark=config.high_watermark,
                              shuffle_seed=config.shuffle_free_blocks, index=self.index)
        self.pool = PoolView(self._pool)   # callers watch the pool; the cache alone changes it
        self._lock = threading.RLock()
        self._caller_lock = CallerLock(self._lock)
        self._ids = SequenceIds()
        self._groups = None
        if config.layer_groups is None:
            self.tables = BlockTables(self._pool, config.block_size, self.index)
            self.tables.namer = self._ids.name   # core errors name the caller's id, not the key
        else:   # sliding-window layers: one table per layer group (pagedkv.groups.tables)
            from pagedkv.groups.tables import GroupTables

            self._groups = GroupTables(self._pool, self.index, config.block_size, config.layer_groups, self._ids.name)
            self.tables = self._groups.tables[0]
        # Every change of the tables goes through _book: the tables, or all groups' tables.
        self._book = self.tables if self._groups is None else self._groups
        self._namespaces = NamespaceRegistry()
        self._copies: list[np.ndarray] = []   # CoW pairs owed by a bookkeeping-only cache
        self._deferred: collections.deque = collections.deque()   # batches queued by free_deferred
        self._tiers = None
        if config.has_prefix_tiers:
            if self.store is None:
                raise InvalidArgumentError(expected("allocate_store", "True with prefix tiers (they hold KV)", False))
            from pagedkv.tiers import PrefixTiers

            names: NamespaceRegistry | GroupNamespaces = self._namespaces
            if self._groups is not None:
                from pagedkv.groups.tables import GroupNamespaces

                names = GroupNamespaces(self._namespaces)
            self._tiers = PrefixTiers(config, self.index, self.store, self._pool, names, self._book)
        self._host = None
        if config.host_num_blocks:
            from pagedkv.tiers.swap import HostTier

            self._host = HostTier(self._book, self.store, config.host_num_blocks, self._namespaces.hash_of,
                                  sync=self._tiers.sync if self._tiers is not None else None)

    def _prefix_index(self, config: CacheConfig) -> PrefixIndex:
        """The prefix index (a hook: :func:`pagedkv.testing.weak_hash_cache` overrides it)."""
        return PrefixIndex(config.block_size, config.resolved_num_blocks, hash_seed=config.hash_seed,
                           events=config.enable_kv_events, tier_log=config.has_prefix_tiers)

    # ---- lifecycle ----------------------------------------------------------------
    def add_sequence(self, seq_id: SeqId, prompt_token_ids: Iterable[int] | None = None, *,
                     cache_salt: str | None = None, adapter_id: Any = None,
                     priority: int | None = None, max_cached_tokens: int | None = None) -> int:
        """Admit a sequence; returns how many prompt tokens are already cached.

        Those tokens' KV is in the arena already (full blocks reused by reference);
        reserve and compute the rest. Never the whole prompt: the last prompt token is
        always computed, so a fully cached, block-aligned prompt reuses one block less.
        ``cache_salt`` / ``adapter_id`` select a namespace; different namespaces never
        share blocks (see :mod:`pagedkv.manager.namespaces`). ``priority`` is the eviction
        class of its blocks under the ``priority`` policy (0 is evicted first;
        default: seed 004's prefix > recent > old rule). ``max_cached_tokens`` caps the
        reuse (whole blocks below it).
        """
        tokens = None if prompt_token_ids is None else as_token_ids(prompt_token_ids, "prompt_token_ids")
        priority = optional_int(priority, "priority", 0, 127)
        cap = None if max_cached_tokens is None else as_count(max_cached_tokens, "max_cached_tokens") // \
            self.config.block_size
        with self._lock:
            if self._deferred:
                self._run_deferred()
            key, fresh = self._ids.intern(seq_id)
            mark = len(self._namespaces)
            try:
                if self._host is not None and self._host.holds(key):
                    raise SequenceExistsError(seq_id)
                ns_id, ns_hash = self._namespaces.register(cache_salt, adapter_id)
                prio = -1 if priority is None else priority
                hit = self._book.add(key, tokens, ns_id, ns_hash, prio) if cap is None else \
                    self._book.add(key, tokens, ns_id, ns_hash, prio, max_hit_blocks=cap)
            except BaseException:
                if fresh:
                    self._ids.forget(key)
                self._namespaces.rollback(mark)
                raise
            if self._tiers is not None and tokens is not None:
                try:
                    hit = self._tiers.promote(key, tokens, ns_id, hit, max_blocks=cap)
                except BaseException:
                    self._book.remove(key, internal=True)
                    if fresh:
                        self._ids.forget(key)
                    raise
            if hit and self._sink_tokens:     # a shared first block keeps its exact sink rows
                self._require_store().pin_sinks(self._first_blocks(np.array([key], np.int64), True), held_only=True)
            return hit

    def _admit_restored(self, seq_id: SeqId, tokens: np.ndarray, cache_salt, adapter_id, priority) -> None:
        """Admit a sequence of a layer-grouped cache whose KV is about to arrive whole
        from elsewhere (a transfer): no prefix lookup, sliding groups untracked (see
        :meth:`~pagedkv.groups.tables.GroupTables.add_restored`)."""
        groups = self._groups
        if groups is None:     # the transfer takes this path only for a layer-grouped cache
            raise InvalidArgumentError(expected("config.layer_groups", "a layer-grouped cache", None))
        with self._lock:
            if self._deferred:
                self._run_deferred()
            key, fresh = self._ids.intern(seq_id)
            mark = len(self._namespaces)
            try:
                if key in self.tables or (self._host is not None and self._host.holds(key)):
                    raise SequenceExistsError(seq_id)
                ns_id, ns_hash = self._namespaces.register(cache_salt, adapter_id)
                groups.add_restored(key, tokens, ns_id, ns_hash, -1 if priority is None else priority)
            except BaseException:
                if fresh:
                    self._ids.forget(key)
                self._namespaces.rollback(mark)
                raise

    def reserve(self, seq_ids: SeqIds, num_tokens: int | Sequence[int] | np.ndarray) -> np.ndarray:
        """Slots (int64, concatenated in batch order) for the next tokens of each sequence.

        One call for the whole batch, all or nothing: on :class:`OutOfBlocksError`
        nothing changed. Blocks are allocated only at block boundaries. A shared,
        partially filled last block (after :meth:`fork`) is copied first, so the write
        never touches another sequence's KV.

        With sliding-window layer groups (``config.layer_groups``) the slots are int64
        ``[num_groups, N]``: row g for the layers of group g. :meth:`write` takes the
        whole array and picks its layer's row.
        """
        if not (type(num_tokens) is int or (type(num_tokens) is np.ndarray and num_tokens.dtype is _I64)):
            num_tokens = as_counts(num_tokens)
        with self._lock:
            if self._deferred:
                self._run_deferred()
            keys, internal = self._ids.batch(seq_ids)
            slots = self._book.reserve(keys, num_tokens, internal=internal)
            if self._tiers is not None:
                self._tiers.sync()      # evicted KV goes down before anything overwrites it
            if self._book.num_pending_copies:
                self._copy_on_write()
            if self._sink_tokens:
                self._pin_sinks(keys, internal, num_tokens)
            return slots

    def advance(self, seq_ids: SeqIds, token_ids) -> np.ndarray:
        """One decode step in one call: commit every reserved token of each sequence
        (the previous step's KV is written), then reserve a slot for its next token.

        ``token_ids`` (one per sequence) are the ids of the tokens being fed now, so
        full blocks can be registered for prefix reuse. Returns the int64 slots. This is
        ``commit`` + ``reserve(…, 1)`` fused: half the crossings and lookups.
        """
        token_ids = as_token_ids(token_ids)
        with self._lock:
            if self._deferred:
                self._run_deferred()
            keys, internal = self._ids.batch(seq_ids)
            slots = self._book.advance(keys, token_ids, internal=internal)
            if self._tiers is not None:
                self._tiers.sync()
            if self._book.num_pending_copies:
                self._copy_on_write()
            if self._sink_tokens:
                self._pin_sinks(keys, internal, 1)
            return slots

    def _pin_sinks(self, keys, internal: bool, reserved) -> None:
        """Pin the first blocks of the sequences whose reservation just covered one of
        their first ``kv_sink_tokens`` tokens, so those tokens stay in model precision."""
        lens = np.atleast_1d(self.tables.seq_lens(keys, False, internal=internal))
        starts = lens - reserved
        fresh = starts < self._sink_tokens
        if not fresh.any():
            return
        self._require_store().pin_sinks(self._first_blocks(np.atleast_1d(np.asarray(keys, dtype=np.int64))[fresh], internal))

    def _first_blocks(self, keys: np.ndarray, internal: bool) -> np.ndarray:
        """The blocks holding the sink tokens of ``keys``, in every layer group's table
        (-1 where a table has none yet)."""
        width = self.config.sink_blocks
        tables = self._groups.tables if self._groups is not None else [self.tables]
        firsts = [t.block_table(keys, -1, None, internal=internal)[:, :width].reshape(-1) for t in tables]
        return np.concatenate(firsts).astype(np.int64)

    def _copy_on_write(self) -> None:
        self._copy_pairs(self._book.take_copies())

    def _copy_pairs(self, pairs: np.ndarray) -> None:
        """Copy KV of (src, dst) block pairs now, or owe them (bookkeeping-only cache)."""
        if self.store is not None:
            import torch

            self.store.copy_blocks(torch.from_numpy(pairs))
        else:
            self._copies.append(pairs)

    def relocate(self, seq_id: SeqId, moves) -> np.ndarray:
        """Move blocks of one sequence into free blocks of the caller's choice.

        ``moves``: int ``[P, 2]`` of (a block of ``seq_id``'s table, a free unpinned
        block). The KV is copied across all layers and the table rewritten; token
        counts, token ids, namespace and priorities are unchanged, and the old block is
        released. Works for any sequence and namespace, but only for blocks it holds
        alone: a block shared with a fork or a prefix hit is refused with
        ``InvalidBlockError`` (moving it for one holder would cost a block, not free
        one). A registered prefix block stays registered where it is (cached-free, its
        content intact), as after a copy-on-write. All or nothing: a bad move raises a
        typed error and changes nothing. Returns the int32 (old, new) pairs. Slots and
        tables taken before are stale afterwards. (A bookkeeping-only cache owes the
        copies: :meth:`take_copies`.) With layer groups, a move names a block of any
        group's table of the sequence; the block moves within its group.
        """
        with self._lock:
            if self._deferred:
                self._run_deferred()
            pairs = self._book.relocate(self._ids.key(seq_id), moves)
            if len(pairs):
                self._copy_pairs(pairs)
            return pairs

    def compact(self, seq_ids: SeqIds | None = None) -> np.ndarray:
        """Move blocks into the lowest empty blocks, highest first (see
        :mod:`pagedkv.manager.compaction`), so the blocks in use sit at the bottom of the pool.

        ``seq_ids``: the sequences whose blocks may move (all device-resident ones by
        default). Only blocks a sequence holds alone move (as :meth:`relocate`); shared
        blocks, pinned blocks and cached prefixes stay where they are, and no cached
        prefix is evicted to make room. Returns the int32 ``[P, 2]`` (old, new) pairs,
        highest old block first; KV is copied as by :meth:`relocate`."""
        from pagedkv.manager.compaction import plan_compaction

        with self._lock:
            if self._deferred:
                self._run_deferred()
            tables = self._groups.tables if self._groups is not None else [self.tables]
            if seq_ids is None:
                keys = self.tables.keys().tolist()
            else:
                keys, internal = self._ids.batch(seq_ids)
                keys = list(dict.fromkeys(np.atleast_1d(keys).tolist()))
                for k in keys:
                    if k < 0 and not internal:      # negative keys name interned ids only
                        raise SequenceNotFoundError(k, "seq_ids")
                    self.tables.blocks(k)           # unknown ids raise before anything moves
            plan = plan_compaction(self._pool, tables, keys)
            done = []
            try:
                for (g, k), moves in plan.items():
                    done.append(tables[g].relocate(k, moves))
            finally:                   # moves applied are copied whatever happens next
                pairs = np.concatenate(done) if done else np.empty((0, 2), dtype=np.int32)
                if len(pairs):
                    self._copy_pairs(pairs)
            return pairs[np.argsort(-pairs[:, 0].astype(np.int64), kind="stable")]

    def _no_groups(self, what: str) -> None:
        from pagedkv.config.support import require

        require(what, self.config)

    def take_copies(self) -> np.ndarray:
        """Copy-on-write pairs ``[P, 2]`` (src, dst) a bookkeeping-only cache owes its
        own KV store; with an arena the manager performs them itself."""
        with self._lock:
            pending = self._copies
            out = np.concatenate(pending) if pending else np.empty((0, 2), dtype=np.int32)
            pending.clear()
            return out

    def commit(self, seq_ids: SeqIds, num_tokens: int | Sequence[int] | np.ndarray,
               token_ids: Iterable[int] | None = None) -> None:
        """The KV of the next ``num_tokens`` reserved tokens of each sequence is written.

        ``token_ids`` (concatenated in batch order) name those tokens when they are not
        known yet, e.g. a decode step's inputs; prompt tokens are known from admission.
        Blocks that became full are registered for prefix reuse.
        """
        if not (type(num_tokens) is int or (type(num_tokens) is np.ndarray and num_tokens.dtype is _I64)):
            num_tokens = as_counts(num_tokens)
        if token_ids is not None:
            token_ids = as_token_ids(token_ids)
        with self._lock:
            keys, internal = self._ids.batch(seq_ids)
            self._book.commit(keys, num_tokens, token_ids, internal=internal)
            if self._tiers is not None:
                self._tiers.sync()

    def unreserve(self, seq_ids: SeqIds, num_tokens=None) -> None:
        """Give back reserved, uncommitted tokens (all when ``num_tokens`` is None), e.g.
        after a failed forward pass; blocks left covering no token are released."""
        with self._lock:
            keys, internal = self._ids.batch(seq_ids)
            if num_tokens is not None:
                if type(num_tokens) is int or isinstance(num_tokens, np.integer):
                    num_tokens = np.full(1 if isinstance(keys, int) else len(keys), as_count(num_tokens), np.int64)
                else:
                    num_tokens = as_counts(num_tokens)
            self._book.unreserve(keys, num_tokens, internal=internal)

    def truncate(self, seq_ids: SeqIds, num_tokens: int | Sequence[int] | np.ndarray) -> None:
        """Drop the last ``num_tokens`` committed tokens of each sequence, e.g. draft
        tokens a speculative step rejected; reserved, uncommitted slots go back too.

        Blocks left empty return to the pool. Shared blocks (forks, prefix hits) and
        registered ones are never altered: the next write into a kept, partially filled
        one copies it first. The sequence registers full blocks again from its last
        remaining full block. All or nothing."""
        with self._lock:
            if self._deferred:
                self._run_deferred()
            keys, internal = self._ids.batch(seq_ids)
            if type(num_tokens) is int or isinstance(num_tokens, np.integer):
                num_tokens = np.full(1 if isinstance(keys, int) else len(keys), as_count(num_tokens, "num_tokens"),
                                     np.int64)
            else:
                num_tokens = as_counts(num_tokens, "num_tokens")
            self._book.truncate(keys, num_tokens, internal=internal)

    def hold_window(self, seq_ids: SeqIds, hold: bool = True) -> None:
        """Sliding-window layers: keep (``hold=True``) the blocks that leave the window
        of these sequences until :meth:`slide_window` or ``hold=False``, so that
        :meth:`truncate` can roll back speculative tokens past the window (what
        transformers calls recording the past). Forks inherit the hold. No-op when every
        layer is full attention (nothing is ever released)."""
        if not isinstance(hold, bool):
            raise ArgumentTypeError(expected("hold", "True or False", repr(hold)))
        with self._lock:
            keys, internal = self._ids.batch(seq_ids)
            self._book.hold_window(keys, hold, internal=internal)

    def slide_window(self, seq_ids: SeqIds) -> None:
        """Release, now, the blocks that left the sliding windows of these sequences
        (held ones included)."""
        with self._lock:
            keys, internal = self._ids.batch(seq_ids)
            self._book.slide(keys, internal=internal)

    def num_blocks(self, seq_id: SeqId) -> int:
        """Blocks the sequence holds: ``ceil(num_reserved / block_size)``, or with layer
        groups the sum over groups of the blocks each holds (a sliding group releases
        the blocks that left its window)."""
        with self._lock:
            key = self._ids.key(seq_id)
            if self._groups is None:
                return -(-self.tables.num_reserved(key) // self.config.block_size)
            return sum(self._groups.held_blocks(key))

    def fork(self, src: SeqId, dst: SeqId) -> None:
        """``dst`` shares all of ``src``'s committed KV by reference (beam search, n > 1)."""
        with self._lock:
            if self._deferred:
                self._run_deferred()
            sk = self._ids.key(src, "src")
            dk, fresh = self._ids.intern(dst, "dst")
            try:
                if dk in self.tables or (self._host is not None and self._host.holds(dk)):
                    raise SequenceExistsError(dst, "dst")
                self._book.fork(sk, dk)
            except BaseException:
                if fresh:
                    self._ids.forget(dk)
                raise

    def free(self, seq_ids: SeqIds) -> None:
        """Release sequences (device-resident or swapped out). Their full blocks stay
        cached (findable) until evicted. All or nothing: the whole batch is checked
        (known ids, each once) before anything is released."""
        with self._lock:
            if self._deferred:
                self._run_deferred()
            self._free(seq_ids)

    def _free(self, seq_ids: SeqIds) -> None:
        keys, internal = self._ids.batch(seq_ids)
        host = self._host
        if host is None or not host.num_swapped:
            self._book.remove(keys, internal=internal)
            if internal:
                self._forget(keys)
            return
        arr = np.array([keys], dtype=np.int64) if type(keys) is int else np.asarray(keys, dtype=np.int64)
        listed = arr.tolist()
        swapped = np.fromiter(((internal or k >= 0) and host.holds(k) for k in listed), dtype=bool,
                              count=len(listed))
        if not swapped.any():
            self._book.remove(keys, internal=internal)
        else:
            # Validate the whole batch before anything is released: each id once, and
            # every id that is not swapped out live on the device.
            seen = set()
            for i, k in enumerate(listed):
                if k in seen:
                    raise InvalidArgumentError(expected("seq_ids", "each sequence at most once per call",
                                                        f"{self._ids.name(k)!r} repeated at index {i}"))
                seen.add(k)
            live = arr[~swapped]
            if len(live):
                self.tables.seq_lens(live, internal=internal)     # raises for an unknown id: nothing freed
                self._book.remove(live, internal=internal)
            for k in arr[swapped].tolist():
                host.discard(k)
        if internal:
            self._forget(arr)

    def _forget(self, keys) -> None:
        if type(keys) is int:
            self._ids.forget(keys)
            return
        for k in keys[keys < 0].tolist():
            self._ids.forget(k)

    def free_deferred(self, seq_ids: SeqIds) -> None:
        """Free sequences at the manager's next call instead of now.

        For finalizers and garbage-collector callbacks, which may run in the middle of
        another call of this manager (even on its own thread): this only queues the ids
        (no lock, no state read). The queue runs at the start of the next allocating
        call, ``free``, or capacity query, never while a caller holds :attr:`lock`. Ids
        that are no longer live by then are skipped.
        """
        self._deferred.append(list(seq_ids) if isinstance(seq_ids, (list, range, np.ndarray)) else [seq_ids])

    def _run_deferred(self) -> None:
        if self._caller_lock.depth:
            return                     # a caller is composing calls under the lock: wait
        while self._deferred:
            live = []
            for sid in self._deferred.popleft():
                try:
                    key = self._ids.key(sid)
                except PagedKVError:
                    continue
                if key in self.tables or (self._host is not None and self._host.holds(key)):
                    live.append(sid)
            if live:
                self._free(live)

    # ---- queries (under the lock: the core's batch loops run without the GIL) -------
    def __contains__(self, seq_id: SeqId) -> bool:
        """Whether ``seq_id`` is a device-resident sequence (not swapped out)."""
        with self._lock:
            try:
                return self._ids.key(seq_id) in self.tables
            except (SequenceNotFoundError, InvalidArgumentError):
                return False

    def __len__(self) -> int:
        with self._lock:
            if self._deferred:
                self._run_deferred()
            return len(self.tables)

    def sequences(self) -> list[SeqId]:
        """Live sequence ids (device-resident)."""
        with self._lock:
            if self._deferred:
                self._run_deferred()
            return [self._ids.name(k) for k in self.tables.keys().tolist()]

    def _one(self, method, seq_id: SeqId, argument: str = "seq_id"):
        """``method(key)`` of one sequence."""
        with self._lock:
            return method(self._ids.key(seq_id, argument))

    def num_tokens(self, seq_id: SeqId) -> int:
        """Committed tokens of a sequence."""
        return self._one(self.tables.num_computed, seq_id)

    def num_reserved(self, seq_id: SeqId) -> int:
        """Tokens holding a slot (committed plus reserved this step)."""
        return self._one(self.tables.num_reserved, seq_id)

    def token_ids(self, seq_id: SeqId) -> np.ndarray:
        """The token ids the cache knows for ``seq_id`` (int32 copy): its prompt and every
        token added since (by :meth:`advance`), in order."""
        return self._one(self.tables.tokens, seq_id)

    def sequence_info(self, seq_id: SeqId) -> dict:
        """Counts, prefix-hit blocks, priority and namespace (``(cache_salt,
        adapter_id)``) of one sequence. With layer groups, ``groups`` lists each group's
        block counts and priority, and the block counts are their sums."""
        with self._lock:
            info = self._one(self.tables.info, seq_id)
            info["namespace"] = self._namespaces.name(info["namespace"])
            if self._groups is not None:   # counts of blocks differ per group: each, and their sums
                key = self._ids.key(seq_id)
                per = []
                for t in self._groups.tables:
                    g = t.info(key)
                    per.append({"num_blocks": int((t.blocks(key) >= 0).sum()),
                                "num_dropped_blocks": g["num_dropped_blocks"],
                                "num_prefix_hit_blocks": g["num_prefix_hit_blocks"], "priority": g["priority"]})
                info["groups"] = per
                for field in ("num_blocks", "num_dropped_blocks", "num_prefix_hit_blocks"):
                    info[field] = sum(g[field] for g in per)
            return info

    def block_table(self, seq_id: SeqId, group: int | None = None) -> np.ndarray:
        """The sequence's physical blocks in token order (int32); of a layer group's
        tables with ``group`` (-1 where a sliding group released the block)."""
        return self._one(self._tables_of(group).blocks, seq_id)

    def _tables_of(self, group: int | None):
        if self._groups is None:
            if group is not None and not (isinstance(group, (int, np.integer)) and not isinstance(group, bool)
                                          and group == 0):
                raise InvalidArgumentError(expected("group", "None or 0 (every layer is full attention)", repr(group)))
            return self.tables
        return self._groups.group_for(group)

    def _batch_query(self, method, seq_ids: SeqIds, *args):
        with self._lock:
            keys, internal = self._ids.batch(seq_ids)
            return method(keys, *args, internal=internal)

    def block_tables(self, seq_ids: SeqIds, pad: int = -1, width: int | None = None,
                     group: int | None = None) -> np.ndarray:
        """Padded ``[B, width]`` int32 block tables (of layer group ``group``: column j is
        block j of the sequence, ``pad`` where a sliding group released it)."""
        pad = as_int(pad, "pad", -2**31, 2**31 - 1)
        width = optional_int(width, "width", 0, 2**31 - 1)
        return self._batch_query(self._tables_of(group).block_table, seq_ids, pad, width)

    def page_table_csr(self, seq_ids: SeqIds, group: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """FlashInfer's ``(indptr, indices, last_page_len)``, int32, over reserved tokens
        (of layer group ``group``: a sliding group lists only the blocks it holds)."""
        return self._batch_query(self._tables_of(group).csr, seq_ids)

    def released_tokens(self, seq_ids: SeqIds, group: int | None = None) -> np.ndarray:
        """Tokens per sequence (int64) that sliding layer group ``group`` released (left
        its window): its gathers return the others. Zeros for full attention."""
        tables = self._tables_of(group)
        if not tables.window:
            return np.zeros(len(self.seq_lens(seq_ids)), dtype=np.int64)
        return self._batch_query(tables.released_tokens, seq_ids)

    def seq_lens(self, seq_ids: SeqIds, computed: bool = False) -> np.ndarray:
        """Tokens per sequence (int64): reserved, or committed with ``computed=True``."""
        if not isinstance(computed, bool):
            raise ArgumentTypeError(expected("computed", "True or False", repr(computed)))
        return self._batch_query(self.tables.seq_lens, seq_ids, computed)

    def slot_mapping(self, seq_id: SeqId, start: int, count: int, group: int | None = None) -> np.ndarray:
        """int64 slots of positions ``[start, start + count)`` (must be reserved, and
        held by layer group ``group``)."""
        start, count = as_count(start, "start"), as_count(count, "count")
        with self._lock:
            k = self._ids.key(seq_id)
            return self._tables_of(group).slot_mapping(np.array([k], np.int64), np.array([start], np.int64),
                                            np.array([count], np.int64), internal=True)

    @property
    def lock(self) -> CallerLock:
        """The manager's lock, for callers composing several calls atomically
        (``with cache.lock: ...``)."""
        return self._caller_lock

    def match_prefix(self, token_ids: Iterable[int], *, cache_salt: str | None = None,
                     adapter_id: Any = None) -> int:
        """Tokens of ``token_ids`` a new sequence would find cached now (no side effects),
        on the device or in a prefix tier (whichever holds more full blocks). With
        layer groups: the longest prefix every group holds (:meth:`match_prefix_groups`)."""
        if self._groups is not None:
            found = self.match_prefix_groups(token_ids, cache_salt=cache_salt, adapter_id=adapter_id)["tokens"]
        else:
            found = len(self._prefix_blocks(token_ids, cache_salt, adapter_id, required=False)) * self.config.block_size
        if self._tiers is not None:
            with self._lock:
                found = max(found, self._tiers.match(as_token_ids(token_ids), namespace_key(cache_salt, adapter_id)))
        return found

    def match_prefix_groups(self, token_ids: Iterable[int], *, cache_salt: str | None = None,
                            adapter_id: Any = None) -> dict:
        """Per layer group, the cached prefix of ``token_ids``: a dict of ``tokens`` (what
        an admission reuses: the longest prefix every group holds), ``per_group`` and
        ``limited_by`` (the group holding the least, or None). No side effects."""
        tokens = as_token_ids(token_ids)
        with self._lock:
            ns = self._namespaces.find(cache_salt, adapter_id)
            if self._groups is None:
                found = 0 if ns is None or self.index is None else \
                    len(self.index.match(tokens, ns[0], ns[1])) * self.config.block_size
                return {"tokens": found, "per_group": [found], "limited_by": None}
            if ns is None:
                return {"tokens": 0, "per_group": [0] * len(self._groups.tables), "limited_by": None}
            return self._groups.match(tokens, ns[0], ns[1])

    def has_available_blocks(self, n: int = 1) -> bool:
        """Whether ``n`` blocks can be allocated now (free or evictable).

        It does not know about prefix hits; for an admission use :meth:`can_admit`."""
        n = as_count(n, "n")
        with self._lock:
            if self._deferred:
                self._run_deferred()
            return self._pool.num_free_blocks >= n

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether ``num_tokens`` tokens' worth of new blocks can be allocated now."""
        return self.has_available_blocks(self.config.blocks_for_tokens(num_tokens))

    def blocks_to_admit(self, prompt_token_ids: Iterable[int], num_tokens: int | None = None, *,
                        cache_salt: str | None = None, adapter_id: Any = None) -> int:
        """Free blocks that admitting this prompt, then reserving ``num_tokens`` tokens
        in all (default: the prompt), takes out of the pool now.

        Exact, where counting blocks is not: the prompt's cached prefix (in its
        namespace, without its last token, which is always computed) is not allocated,
        but each of its blocks that sits cached-free and evictable *is* taken off the
        free list when the admission revives it. Blocks in use by other sequences and
        pinned blocks cost nothing.
        """
        tokens = as_token_ids(prompt_token_ids, "prompt_token_ids")
        total = len(tokens) if num_tokens is None else as_count(num_tokens, "num_tokens")
        if total < len(tokens):
            raise InvalidArgumentError(expected("num_tokens", f"at least the prompt's {len(tokens)} tokens", total))
        bs = self.config.block_size
        with self._lock:
            if self._deferred:
                self._run_deferred()
            if self._groups is not None:
                ns = self._namespaces.find(cache_salt, adapter_id) or (None, None)
                if ns[0] is not None:
                    return self._groups.blocks_to_admit(tokens, total, ns[0], ns[1])
                return len(self._groups.tables) * -(-total // bs)
            hits = self._prefix_blocks(tokens, cache_salt, adapter_id, required=False)
            hits = hits[:max(0, (len(tokens) - 1) // bs)]
            ref = self._pool.ref_cnt
            revived = sum(1 for b in hits[ref[hits] == 0].tolist() if not self._pool.pin_count(b))
            return -(-total // bs) - len(hits) + revived

    def can_admit(self, prompt_token_ids: Iterable[int], num_tokens: int | None = None, *,
                  cache_salt: str | None = None, adapter_id: Any = None) -> bool:
        """Whether :meth:`add_sequence` of this prompt, then reserving ``num_tokens``
        tokens in all (default: the prompt), would succeed now
        (see :meth:`blocks_to_admit`)."""
        with self._lock:
            need = self.blocks_to_admit(prompt_token_ids, num_tokens, cache_salt=cache_salt, adapter_id=adapter_id)
            return need <= self._pool.num_free_blocks

    # ---- prefix cache ---------------------------------------------------------------
    def pin_prefix(self, token_ids: Iterable[int], *, cache_salt: str | None = None,
                   adapter_id: Any = None) -> int:
        """Pin the cached full blocks of ``token_ids``; returns the tokens pinned.

        Pinned blocks are never evicted, under any policy, until :meth:`unpin_prefix`.
        The blocks of this prefix that a prefix tier holds are pinned there too (the
        count is then the longest prefix pinned in any medium).
        """
        with self._lock:
            blocks = self._prefix_blocks(token_ids, cache_salt, adapter_id)
            self._pool.pin(blocks)
            tiers = self._pin_tiers(token_ids, cache_salt, adapter_id, True)
        return max(self._pinned_tokens(blocks, token_ids, cache_salt, adapter_id), tiers)

    def unpin_prefix(self, token_ids: Iterable[int], *, cache_salt: str | None = None,
                     adapter_id: Any = None) -> int:
        """Release the pins :meth:`pin_prefix` set on the cached full blocks of
        ``token_ids`` (same namespace: ``cache_salt``, ``adapter_id``), on the device and
        in the prefix tiers; returns the tokens unpinned. The blocks stay cached and
        become evictable again once no sequence references them."""
        with self._lock:
            blocks = self._prefix_blocks(token_ids, cache_salt, adapter_id)
            self._pool.unpin(blocks)
            tiers = self._pin_tiers(token_ids, cache_salt, adapter_id, False)
        return max(self._pinned_tokens(blocks, token_ids, cache_salt, adapter_id), tiers)

    def _pinned_tokens(self, blocks, token_ids, cache_salt, adapter_id) -> int:
        if self._groups is None:
            return len(blocks) * self.config.block_size
        return self.match_prefix_groups(token_ids, cache_salt=cache_salt, adapter_id=adapter_id)["tokens"]

    def _pin_tiers(self, token_ids, cache_salt, adapter_id, pin: bool) -> int:
        if self._tiers is None:
            return 0
        return self._tiers.pin(as_token_ids(token_ids), namespace_key(cache_salt, adapter_id), pin)

    def _prefix_blocks(self, token_ids, cache_salt, adapter_id, required: bool = True) -> np.ndarray:
        """Blocks of the verified cached prefix of ``token_ids`` in a namespace, looked up
        without registering it (an unknown namespace holds nothing)."""
        if self.index is None:
            if required:
                raise InvalidArgumentError(expected("config.enable_prefix_caching", "True to pin prefixes", False))
            return np.empty(0, dtype=np.int32)
        tokens = as_token_ids(token_ids)
        with self._lock:
            ns = self._namespaces.find(cache_salt, adapter_id)
            if ns is None:
                return np.empty(0, dtype=np.int32)
            if self._groups is not None:     # every group's cached chain of this prefix
                return np.concatenate([self.index.match(tokens, *self._groups.namespace(g, ns[0], ns[1]))
                                       for g in range(len(self._groups.tables))])
            return self.index.match(tokens, ns[0], ns[1])

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix, in the prefix tiers too. Raises
        :class:`CacheBusyError` while any block is in use."""
        with self._lock:
            self._pool.reset_cache()
            if self._tiers is not None:
                self._tiers.clear()

    def set_priority(self, seq_id: SeqId, priority: int, start_token: int = 0,
                     end_token: int | None = None) -> None:
        """Eviction class of a sequence's blocks (or of a token range) when freed."""
        priority = as_int(priority, "priority", 0, 127)
        start_token = as_count(start_token, "start_token")
        end_token = optional_int(end_token, "end_token")
        with self._lock:
            self._book.set_priority(self._ids.key(seq_id), priority, start_token, end_token)

    def drain_events(self) -> list[KVEvent]:
        """KV events since the last drain (``enable_kv_events=True``), oldest first."""
        if self.index is None or not self.index.events_enabled:
            raise InvalidArgumentError(expected("config.enable_kv_events", "True to drain events", False))
        with self._lock:
            if self._tiers is not None:
                return self._tiers.drain_events()
            records = self.index.drain_events()
            name: Callable[[int], tuple[Any, Any]] = self._namespaces.name
            if self._groups is not None:     # every group registers under its own id (group_tables)
                from pagedkv.groups.tables import GROUP_NS_BITS

                low = (1 << GROUP_NS_BITS) - 1
                name = lambda ns: self._namespaces.name(ns & low)  # noqa: E731
            return events_from_records(records, name, self.config.block_size, self.index.root)

    # ---- data -----------------------------------------------------------------------
    def _require_store(self):
        if self.store is None:
            raise InvalidArgumentError(expected("allocate_store", "True for KV data operations", False))
        return self.store

    @property
    def device(self):
        """The ``torch.device`` of the KV arena (None for a bookkeeping-only cache)."""
        return None if self.store is None else self.store.device

    def write(self, layer: int, slot_mapping, key, value) -> None:
        """Store new K/V ``[num_tokens, num_kv_heads, head_dim]`` at ``slot_mapping``
        (from :meth:`reserve`; negative slots are skipped)."""
        store = self._require_store()
        if self._groups is not None:
            from pagedkv.groups.data import layer_slots

            layer, slot_mapping = layer_slots(self._groups.plan, layer, slot_mapping)
        store.write(layer, _slots_tensor(slot_mapping, store.device), key, value)

    def gather(self, seq_id: SeqId, layer: int, num_tokens: int | None = None):
        """Contiguous K and V ``[n, num_kv_heads, head_dim]`` in token order: the first
        ``num_tokens`` tokens, by default every token holding a slot (committed plus
        reserved this step)."""
        k, v, _ = self.gather_batch([seq_id], layer, None if num_tokens is None else [num_tokens])
        return k, v

    def gather_batch(self, seq_ids: SeqIds, layer: int, num_tokens=None):
        """K, V ``[sum(lens), H, D]`` of many sequences, and ``cu_seqlens`` (int64 ``[B+1]``).

        ``num_tokens`` (optional, one per sequence) gathers only each sequence's first
        tokens; by default all reserved tokens. A sliding-window layer returns the
        tokens its group holds (sinks, then the window; :meth:`gather_window` adds
        their positions)."""
        return self._gather(seq_ids, layer, num_tokens, False)

    def gather_window(self, seq_ids: SeqIds, layer: int, num_tokens=None):
        """:meth:`gather_batch` plus the int64 absolute position of every gathered token
        (concatenated per sequence): all of them for a full-attention layer; for a
        sliding one the sinks, then the window."""
        return self._gather(seq_ids, layer, num_tokens, True)

    def _gather(self, seq_ids: SeqIds, layer: int, num_tokens, with_positions: bool):
        import torch

        store = self._require_store()
        want = None if num_tokens is None else as_counts(num_tokens)
        with self._lock:
            keys, internal = self._ids.batch(seq_ids)
            tables, slot = self.tables, layer
            if self._groups is not None:
                from pagedkv.groups.data import layer_slot

                g, slot = layer_slot(self._groups.plan, layer)
                tables = self._groups.tables[g]
            indptr, indices, _ = tables.csr(keys, internal=internal)
            lens = tables.seq_lens(keys, internal=internal)
            gone = tables.released_tokens(keys, internal=internal) if tables.window else None
        if gone is not None and gone.any():
            if want is not None:
                raise InvalidArgumentError(expected("num_tokens", "None for a sliding-window layer whose "
                                                    "sequences released tokens", want.tolist()))
            want = lens - gone
        if want is not None:
            if want.shape != lens.shape or (want > lens).any():
                raise InvalidArgumentError(expected(
                    "num_tokens", f"{len(lens)} counts within the reserved lengths {lens.tolist()}", want.tolist()))
            lens = want
        dev = store.device
        k, v = store.gather(slot, torch.from_numpy(indptr).to(dev), torch.from_numpy(indices).to(dev),
                            torch.from_numpy(lens.astype(np.int32)).to(dev))
        cu = np.zeros(len(lens) + 1, dtype=np.int64)
        np.cumsum(lens, out=cu[1:])
        if not with_positions:
            return k, v, torch.from_numpy(cu)
        from pagedkv.groups.data import kept_positions

        positions = kept_positions(tables, lens, np.zeros_like(lens) if gone is None else gone)
        return k, v, torch.from_numpy(cu), torch.from_numpy(positions)

    def gather_pages(self, layer: int, indptr, indices, seq_lens, *, pending=None, rotated=False):
        """K, V ``[sum(seq_lens), H, D]`` of ``layer`` read through a CSR page table
        (``indptr``, ``indices``: int32 tensors on :attr:`device`, or the NumPy arrays
        :meth:`page_table_csr` returns; ``seq_lens``: int32 tokens per row, a tensor or
        a NumPy integer array such as :meth:`seq_lens` returns). NumPy integer arrays are
        moved to :attr:`device` as int32; values outside int32 are refused.

        For a caller that plans a step once and gathers every layer with the same table
        (no bookkeeping lookup per layer). The table must come from this cache and be
        current: the store checks shapes, dtypes and block ranges, not ownership. With
        layer groups the table must be the layer's group's (``page_table_csr(ids,
        group=...)``).

        ``pending``: for a caller that reads before it writes the pass's own tokens
        (it attends to their K/V as computed): ints ``[B]``, each row's trailing tokens
        not written yet. Their rows hold stale bytes for the caller to overwrite, and
        ``kv_window`` then keeps the ``kv_window`` tokens *before* them in model
        precision, so every query of the pass sees at least that many exact tokens.

        ``rotated=True`` (a cache with ``kv_rotation``): K/V in the rotated domain, as
        stored, without the per-row unrotation, which costs more than the dequantization.
        The rotation is orthonormal, so an attention that rotates its queries
        (``pagedkv.store.rotation.rotate(q, cache.rotation_signs)``) gets the same scores, and
        its output is unrotated once per query (``unrotate(out, signs)``) instead of once
        per cached token."""
        if rotated is not False and rotated is not True:
            raise ArgumentTypeError(expected("rotated", "True or False", repr(rotated)))
        if rotated and not self.config.kv_rotation:
            raise InvalidArgumentError(expected("rotated", "False for a cache without kv_rotation", True))
        if rotated and self.config.block_keys:   # full blocks' keys are stored unrotated, per channel
            raise InvalidArgumentError(expected("rotated", "False for a cache with kv_key_quant='block'", True))
        if self._groups is not None:
            from pagedkv.groups.data import layer_slot

            layer = layer_slot(self._groups.plan, layer)[1]
        indptr, indices, seq_lens = (self._table_tensor(a, n) for a, n in
                                     ((indptr, "indptr"), (indices, "indices"), (seq_lens, "seq_lens")))
        if pending is not None:
            pending = self._pending(pending, seq_lens)
        return self._require_store().gather(layer, indptr, indices, seq_lens, pending=pending, rotated=rotated)

    def attention(self, layer: int, q, indptr, indices, seq_lens, q_indptr, **options):
        """:func:`pagedkv.ops.paged_attention` of ``q`` over ``layer``'s pages, reading
        exactly what :meth:`gather_pages` (no ``pending``) reads: the quantized rows in
        place, the window and sink rows in model precision from the window arena, the
        rotation folded into ``q`` and the output. The table is as for :meth:`gather_pages`
        (with layer groups, the layer's group's). ``options``: the op's keywords
        (``sm_scale``, ``soft_cap``, ``window``, ``sink_tokens``, ``num_splits``, ``out``,
        ``backend``)."""
        from pagedkv.ops import ExactRows, paged_attention

        store = self._require_store()
        if self._groups is not None:
            from pagedkv.groups.data import layer_slot

            layer = layer_slot(self._groups.plan, layer)[1]
        view = store.layer(layer)
        scale, zero = store.layer_scales(layer)
        kscale, kzero = store.layer_key_params(layer)
        main, i = store._where[layer]
        w, exact = store.window, None
        if main and w is not None and (w.window or w.sink):
            exact = ExactRows(w.data[i], w.slot_of, w.valid[i], w.window, w.sink)
        if exact is None:
            return paged_attention(q, view, indptr, indices, seq_lens, q_indptr, layout=store.layout,
                                   kv_scale=scale, kv_zero=zero, key_scale=kscale, key_zero=kzero,
                                   rotation_signs=store.rotation_signs if main else None, **options)
        with w.lock:     # the window's slot map is shared by every sequence (see pagedkv.store.window)
            return self._attention_exact(w, i, q, view, indptr, indices, seq_lens, q_indptr, scale, zero, kscale,
                                         kzero, exact, options)

    def _attention_exact(self, w, i, q, view, indptr, indices, seq_lens, q_indptr, scale, zero, kscale, kzero,
                         exact, options):
        from pagedkv.ops import paged_attention

        store = self._require_store()
        out = paged_attention(q, view, indptr, indices, seq_lens, q_indptr, layout=store.layout, kv_scale=scale,
                              kv_zero=zero, key_scale=kscale, key_zero=kzero, rotation_signs=store.rotation_signs,
                              exact_rows=exact, **options)
        if i == 0 and w.sink:     # the sinks' pins stay most recently used, as a gather's
            ptr, idx = np.asarray(indptr.cpu() if hasattr(indptr, "cpu") else indptr), np.asarray(
                indices.cpu() if hasattr(indices, "cpu") else indices)
            lens = np.asarray(seq_lens.cpu() if hasattr(seq_lens, "cpu") else seq_lens).astype(np.int64)
            heads = np.minimum(w.sink, np.maximum(lens - w.window, 0))
            first = [idx[ptr[b]:ptr[b] + (n - 1) // w.block_size + 1] for b, n in enumerate(heads.tolist()) if n]
            if first:
                ws = w.slot_of[np.concatenate(first).astype(np.int64)]
                ws = ws[ws >= 0]
                w.clock += 1
                w.stamp[ws[w.pinned[ws]]] = w.clock
        return out

    def _table_tensor(self, a, name: str):
        """A NumPy integer page-table array as an int32 tensor on the cache's device;
        anything else unchanged (the store checks and refuses it)."""
        if not isinstance(a, np.ndarray) or a.dtype.kind not in "iu":
            return a
        if a.size and (a.min() < np.iinfo(np.int32).min or a.max() > np.iinfo(np.int32).max):
            raise InvalidArgumentError(expected(name, "values within int32", f"{a.min()}..{a.max()}"))
        import torch

        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32)).to(self._require_store().device)

    @property
    def rotation_signs(self):
        """The float32 ``[head_dim]`` signs of the cache's rotation (a copy), or None
        without ``kv_rotation``: what :func:`pagedkv.store.rotation.rotate` takes."""
        if not self.config.kv_rotation:
            return None
        if self.store is not None and self.store.rotation_signs is not None:   # a kv_rotation store has them
            return self.store.rotation_signs.clone()


        from pagedkv.store.rotation import rotation_signs

        return rotation_signs(self.config.head_dim, self.config.kv_rotation_seed)

    @staticmethod
    def _pending(pending, seq_lens) -> np.ndarray:
        import torch

        want = "ints [B], 0 <= pending[b] <= seq_lens[b]"
        try:
            p = np.array(pending.cpu() if isinstance(pending, torch.Tensor) else pending)
        except (TypeError, ValueError, RuntimeError):
            raise ArgumentTypeError(expected("pending", want, type(pending).__name__)) from None
        if p.dtype.kind not in "iu" or p.ndim != 1:
            raise ArgumentTypeError(expected("pending", want, f"{p.dtype} array of shape {p.shape}"))
        lens = seq_lens.cpu().numpy() if isinstance(seq_lens, torch.Tensor) else np.asarray(seq_lens)
        p = p.astype(np.int64)
        if p.shape != lens.shape or (p < 0).any() or (p > lens).any():
            raise InvalidArgumentError(expected("pending", want + f" with B = {lens.shape[0]}", p.tolist()))
        return p

    def copy_blocks(self, pairs) -> None:
        """Copy (src, dst) block pairs ``[P, 2]`` across all layers."""
        import torch

        store = self._require_store()
        if isinstance(pairs, np.ndarray):
            pairs = torch.from_numpy(pairs)
        elif not isinstance(pairs, torch.Tensor):
            if isinstance(pairs, (str, bytes)) or not hasattr(pairs, "__len__"):
                raise ArgumentTypeError(expected("pairs", "an int [P, 2] array of (src, dst) block ids",
                                                 type(pairs).__name__))
            _check_pair_values(pairs, self.config.resolved_num_blocks)
            try:
                pairs = torch.as_tensor(pairs, dtype=torch.int64)
            except (TypeError, ValueError, RuntimeError, OverflowError):
                raise ArgumentTypeError(expected("pairs", "an int [P, 2] array of (src, dst) block ids",
                                                 f"a {type(pairs).__name__} of other values")) from None
        store.copy_blocks(pairs)

    # ---- host tier ------------------------------------------------------------------
    def _require_host(self):
        if self._host is None:
            raise InvalidArgumentError(expected("config.host_num_blocks", "> 0 for swapping", 0))
        return self._host

    def swap_out(self, seq_id: SeqId) -> int:
        """Preempt a sequence to the host tier: its KV moves to host blocks and its
        device blocks are freed. Returns the device blocks released."""
        host = self._require_host()
        return self._one(host.swap_out, seq_id)

    def swap_in(self, seq_id: SeqId) -> int:
        """Bring a swapped-out sequence back onto the device (all or nothing)."""
        host = self._require_host()
        with self._lock:
            if self._deferred:
                self._run_deferred()
            return self._one(host.swap_in, seq_id)

    def is_swapped(self, seq_id: SeqId) -> bool:
        """True when ``seq_id`` is swapped out to the host tier (:meth:`swap_out`): its KV
        lives in host memory until :meth:`swap_in`. False for a live sequence, an unknown
        id, or a cache without a host tier."""
        if self._host is None:
            return False
        with self._lock:
            try:
                return self._host.holds(self._ids.key(seq_id))
            except (SequenceNotFoundError, InvalidArgumentError):
                return False

    # ---- stats ----------------------------------------------------------------------
    def stats(self) -> CacheStats:
        """A snapshot of the cache's counters (:class:`pagedkv.CacheStats`): blocks free /
        in use / cached, live and swapped sequences, prefix hits per medium, evictions.
        ``stats().describe()`` renders it as text."""
        with self._lock:
            if self._deferred:
                self._run_deferred()
            return CacheStats.collect(self._pool, self.tables, self.config, self._host, self._tiers, self._groups)

    def dump_block_map(self, width: int = 64) -> str:
        """One character per block: ``.`` free, ``#`` in use, ``+`` shared, ``c`` cached-free, ``p`` pinned."""
        width = as_int(width, "width", 1)
        with self._lock:
            return render_block_map(self._pool, width)

    def dump_stats(self) -> str:
        """A human-readable report for debugging: :meth:`stats` described, the first 32
        sequences with their computed/reserved tokens and first blocks, and a map of the
        block pool's states."""
        s = self.stats()
        lines = ["=== pagedkv cache ===", s.describe()]
        with self._lock:
            lines.append("Sequences:")
            groups = self._groups.tables if self._groups is not None else [self.tables]
            for k in self.tables.keys().tolist()[:32]:
                info = self.tables.info(k)
                shown = []
                for g, t in enumerate(groups):
                    blocks = t.blocks(k)
                    held = blocks[blocks >= 0]
                    text = " ".join(map(str, held[:8].tolist())) + (" ..." if len(held) > 8 else "")
                    shown.append(f"{len(held)} blocks [{text}]" if len(groups) == 1 else
                                 f"group {g}: {len(held)} blocks [{text}]")
                lines.append(f"  {self._ids.name(k)!r}: {info['num_computed']}/{info['num_reserved']} tokens, "
                             + "; ".join(shown))
            lines.append("Block map:")
            lines.append(render_block_map(self._pool, 64))
        return "\n".join(lines)

    def check_invariants(self) -> None:
        """Audit every invariant of DESIGN.md (O(num_blocks)); raises InternalError.

        Also: every interned id names a live or swapped-out sequence (no id leaks)."""
        from pagedkv.errors import InternalError

        with self._lock:
            if self._deferred:
                self._run_deferred()
            self._book.check_invariants()
            if self._host is not None:
                self._host.check_invariants()
            if self._tiers is not None:
                self._tiers.check_invariants()
            for k in self._ids.interned_keys():
                if k not in self.tables and not (self._host is not None and self._host.holds(k)):
                    raise InternalError(f"sequence id {self._ids.name(k)!r} is interned as key {k}, "
                                        "which no live or swapped-out sequence has")

    def close(self) -> None:
        """Release what outlives the process: the disk prefix tier's files are flushed
        and unlocked, so another cache (or process) can open them. Idempotent; the
        cache must not be used afterwards."""
        with self._lock:
            if self._tiers is not None:
                self._tiers.close()
                self._tiers = None

    def __enter__(self) -> PagedKVCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        c = self.config
        return (f"PagedKVCache(blocks={c.resolved_num_blocks}x{c.block_size}, layers={c.num_layers}, "
                f"kv_heads={c.num_kv_heads}, head_dim={c.head_dim}, kv_dtype={c.cache_dtype}, "
                f"sequences={len(self)}, free_blocks={self._pool.num_free_blocks}, "
                f"arena={format_bytes(c.total_bytes)})")


def _slots_tensor(slot_mapping, device):
    import torch

    if isinstance(slot_mapping, np.ndarray):
        if slot_mapping.dtype != np.int64:
            from pagedkv.errors import DTypeError

            raise DTypeError(expected("slot_mapping", "an int64 array", f"{slot_mapping.dtype} array"))
        slot_mapping = torch.from_numpy(slot_mapping)
    if isinstance(slot_mapping, torch.Tensor) and slot_mapping.device != device:
        if slot_mapping.layout != torch.strided or slot_mapping.device.type == "meta":
            tensor_values(slot_mapping, "slot_mapping")      # raises the typed error
        slot_mapping = slot_mapping.to(device, non_blocking=True)
    return slot_mapping


def _check_pair_values(pairs, num_blocks: int) -> None:
    """copy_blocks' list input, value by value, before torch converts it: a float or
    bool is a wrong type (torch would truncate 1.5 to 1), an int past int64 is an
    out-of-range block id (torch would fail with an overflow)."""
    want = "an int [P, 2] array of (src, dst) block ids"
    for i, row in enumerate(pairs):
        items = row if hasattr(row, "__len__") and not isinstance(row, (str, bytes)) else (row,)
        for j, v in enumerate(items):
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
                raise ArgumentTypeError(expected("pairs", want, f"{type(v).__name__} {v!r} at row {i}"))
            if not -2**63 <= v < 2**63:
                where = f"{('src', 'dst')[j]} row {i}" if j < 2 else f"row {i}"   # op_checks.block_id_error's words
                raise InvalidBlockError(expected("pairs", f"block ids in [0, {num_blocks})", f"{int(v)} at {where}"))
