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

The class is the API and the wiring (its prefix-cache and KV data calls are written in
:mod:`~pagedkv.manager.prefix_calls` and :mod:`~pagedkv.manager.data_calls`, mixed in);
the work lives in one module per concept, each given what it needs, never the cache: :mod:`~pagedkv.manager.lifecycle` (admission, the
per-step calls, release), :mod:`~pagedkv.manager.prefix` (lookups, admission costs,
pins, events), :mod:`~pagedkv.manager.data` (writes, gathers, attention),
:mod:`~pagedkv.manager.moves` (relocate, compact, host swap) and
:mod:`~pagedkv.manager.queries` (counts, tables, stats, audits). They reach the tables
through one coordinator whatever the layer groups (:mod:`~pagedkv.manager.coordinator`),
and a part the cache was configured without is a stand-in with the same interface
(:mod:`~pagedkv.manager.absent`).
"""
from __future__ import annotations

import threading
import warnings
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from pagedkv._core.pool import BlockPool
from pagedkv._core.prefix import PrefixIndex
from pagedkv.config.options import CacheConfig, format_bytes
from pagedkv.errors import ArgumentTypeError, InvalidArgumentError, expected
from pagedkv.events import KVEvent
from pagedkv.manager.absent import NoHost, NoTiers, OwedCopies, StoreCopies
from pagedkv.manager.arguments import as_token_ids
from pagedkv.manager.coordinator import coordinator
from pagedkv.manager.data import DataPath
from pagedkv.manager.data_calls import KVDataCalls
from pagedkv.manager.lifecycle import CallerLock, Lifecycle
from pagedkv.manager.moves import Moves
from pagedkv.manager.namespaces import NamespaceRegistry, namespace_key  # noqa: F401 (imported from here)
from pagedkv.manager.pool_view import PoolView
from pagedkv.manager.prefix import Prefixes
from pagedkv.manager.prefix_calls import PrefixCalls
from pagedkv.manager.queries import Queries
from pagedkv.manager.seq_ids import SequenceIds
from pagedkv.manager.state_calls import StateCalls
from pagedkv.manager.stats import CacheStats, with_window_figures

if TYPE_CHECKING:
    from pagedkv.groups.tables import AttentionTables
    from pagedkv.tiers import PrefixTiers
    from pagedkv.tiers.swap import HostSwap

__all__ = ["PagedKVCache", "as_token_ids"]

# calls an engine makes every step, bound per instance (see __init__); the class's
# methods of the same names stay the documented API, with the same signatures
_PER_STEP = ("add_sequence", "reserve", "advance", "commit", "free")

SeqId = Any
SeqIds = SeqId | Sequence[SeqId] | np.ndarray


class PagedKVCache(PrefixCalls, KVDataCalls, StateCalls):
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
        self.state_store = None     # recurrent-state layers' states (pagedkv.state.store)
        if allocate_store:
            from pagedkv.store.stores import make_store

            self.store = make_store(config)     # the arenas the layer groups' spec asks for
            config = self.store.config  # may differ: fp8 -> int8 fallback
            if config.state_spec is not None:
                from pagedkv.state.store import StateStore

                self.state_store = StateStore(config.state_spec, config.resolved_state_slots, config.device)
        self.config = config
        store = self.store
        # sink tokens matter only where a store keeps model-precision copies of them
        if config.window_note is not None and allocate_store:
            warnings.warn(f"pagedkv: {config.window_note}", RuntimeWarning, stacklevel=2)
        nb = config.resolved_num_blocks
        self.index: PrefixIndex | None = self._prefix_index(config) if config.enable_prefix_caching else None
        self._pool = BlockPool(nb, config.eviction, priority_classes=config.priority_classes,
                              low_watermark=config.low_watermark, high_watermark=config.high_watermark,
                              shuffle_seed=config.shuffle_free_blocks, index=self.index)
        self.pool = PoolView(self._pool)   # callers watch the pool; the cache alone changes it
        self._lock = threading.RLock()
        self._caller_lock = CallerLock(self._lock)
        self._ids = SequenceIds()
        # one table per layer group (one group when every layer is full attention)
        self._groups = coordinator(self._pool, self.index, config, self._ids.name, self.state_store)
        self.tables: AttentionTables = self._groups.tables[0]
        self._namespaces = NamespaceRegistry()
        names = self._groups.names(self._namespaces)
        self._tiers: PrefixTiers | NoTiers = NoTiers(self.index, names, config.block_size)
        if config.has_prefix_tiers:
            if store is None:
                raise InvalidArgumentError(expected("allocate_store", "True with prefix tiers (they hold KV)", False))
            from pagedkv.tiers import PrefixTiers

            self._tiers = PrefixTiers(config, self.index, store, self._pool, names, self._groups)
            if self.state_store is not None and self.index is not None:
                from pagedkv.tiers.state_shelf import build_shelves

                try:
                    self._groups.attach_tiers(build_shelves(config, store), self._namespaces.key_of)
                except BaseException:
                    self._tiers.close()         # the disk tier's lock goes with the failed cache
                    raise
        self._host: HostSwap | NoHost = NoHost()
        if config.host_num_blocks:
            from pagedkv.tiers.swap import HostSwap

            self._host = HostSwap(self._groups, store, config.host_num_blocks, self._namespaces.hash_of,
                                  sync=self._tiers.sync)
        copies = OwedCopies() if store is None else StoreCopies(store)
        window = store if store is not None and store.window is not None else None
        self._life = Lifecycle(config, self._lock, self._caller_lock, self._ids, self._namespaces, self._groups,
                               self._tiers, self._host, copies, window)
        settle = self._life.settle
        self._prefix = Prefixes(config, self._lock, settle, self.index, self._pool, self._namespaces, self._groups,
                                self._tiers)
        self._data = DataPath(config, store, self._groups, self._ids, self._lock)
        self._moves = Moves(self._lock, settle, self._ids, self._pool, self._groups, copies, self._host)
        self._queries = Queries(config, self._lock, settle, self._ids, self._namespaces, self._pool, self._groups,
                                self._host, self._tiers)
        # The per-step calls go to the lifecycle with no delegation frame, which would
        # cost every step measurably (the branch's report); a subclass's override wins.
        for name in _PER_STEP:
            if getattr(type(self), name) is getattr(PagedKVCache, name):
                self.__dict__[name] = getattr(self._life, name)

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
        return self._life.add_sequence(seq_id, prompt_token_ids, cache_salt=cache_salt, adapter_id=adapter_id,
                                       priority=priority, max_cached_tokens=max_cached_tokens)

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
        return self._life.reserve(seq_ids, num_tokens)

    def advance(self, seq_ids: SeqIds, token_ids) -> np.ndarray:
        """One decode step in one call: commit every reserved token of each sequence
        (the previous step's KV is written), then reserve a slot for its next token.

        ``token_ids`` (one per sequence) are the ids of the tokens being fed now, so
        full blocks can be registered for prefix reuse. Returns the int64 slots. This is
        ``commit`` + ``reserve(…, 1)`` fused: half the crossings and lookups.
        """
        return self._life.advance(seq_ids, token_ids)

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
        return self._moves.relocate(seq_id, moves)

    def compact(self, seq_ids: SeqIds | None = None) -> np.ndarray:
        """Move blocks into the lowest empty blocks, highest first (see
        :mod:`pagedkv.manager.compaction`), so the blocks in use sit at the bottom of the pool.

        ``seq_ids``: the sequences whose blocks may move (all device-resident ones by
        default). Only blocks a sequence holds alone move (as :meth:`relocate`); shared
        blocks, pinned blocks and cached prefixes stay where they are, and no cached
        prefix is evicted to make room. Returns the int32 ``[P, 2]`` (old, new) pairs,
        highest old block first; KV is copied as by :meth:`relocate`."""
        return self._moves.compact(seq_ids)

    def take_copies(self) -> np.ndarray:
        """Copy-on-write pairs ``[P, 2]`` (src, dst) a bookkeeping-only cache owes its
        own KV store; with an arena the manager performs them itself."""
        return self._moves.take_copies()

    def commit(self, seq_ids: SeqIds, num_tokens: int | Sequence[int] | np.ndarray,
               token_ids: Iterable[int] | None = None) -> None:
        """The KV of the next ``num_tokens`` reserved tokens of each sequence is written.

        ``token_ids`` (concatenated in batch order) name those tokens when they are not
        known yet, e.g. a decode step's inputs; prompt tokens are known from admission.
        Blocks that became full are registered for prefix reuse.
        """
        self._life.commit(seq_ids, num_tokens, token_ids)

    def unreserve(self, seq_ids: SeqIds, num_tokens=None) -> None:
        """Give back reserved, uncommitted tokens (all when ``num_tokens`` is None), e.g.
        after a failed forward pass; blocks left covering no token are released."""
        self._life.unreserve(seq_ids, num_tokens)

    def truncate(self, seq_ids: SeqIds, num_tokens: int | Sequence[int] | np.ndarray) -> None:
        """Drop the last ``num_tokens`` committed tokens of each sequence, e.g. draft
        tokens a speculative step rejected; reserved, uncommitted slots go back too.

        Blocks left empty return to the pool. Shared blocks (forks, prefix hits) and
        registered ones are never altered: the next write into a kept, partially filled
        one copies it first. The sequence registers full blocks again from its last
        remaining full block. All or nothing."""
        self._life.truncate(seq_ids, num_tokens)

    def hold_window(self, seq_ids: SeqIds, hold: bool = True) -> None:
        """Sliding-window layers: keep (``hold=True``) the blocks that leave the window
        of these sequences until :meth:`slide_window` or ``hold=False``, so that
        :meth:`truncate` can roll back speculative tokens past the window (what
        transformers calls recording the past). Forks inherit the hold. No-op when every
        layer is full attention (nothing is ever released)."""
        self._life.hold_window(seq_ids, hold)

    def slide_window(self, seq_ids: SeqIds) -> None:
        """Release, now, the blocks that left the sliding windows of these sequences
        (held ones included)."""
        self._life.slide_window(seq_ids)

    def num_blocks(self, seq_id: SeqId) -> int:
        """Blocks the sequence holds: ``ceil(num_reserved / block_size)``, or with layer
        groups the sum over groups of the blocks each holds (a sliding group releases
        the blocks that left its window)."""
        return self._queries.num_blocks(seq_id)

    def fork(self, src: SeqId, dst: SeqId) -> None:
        """``dst`` shares all of ``src``'s committed KV by reference (beam search, n > 1)."""
        self._life.fork(src, dst)

    def free(self, seq_ids: SeqIds) -> None:
        """Release sequences (device-resident or swapped out). Their full blocks stay
        cached (findable) until evicted. All or nothing: the whole batch is checked
        (known ids, each once) before anything is released."""
        self._life.free(seq_ids)

    def free_deferred(self, seq_ids: SeqIds) -> None:
        """Free sequences at the manager's next call instead of now.

        For finalizers and garbage-collector callbacks, which may run in the middle of
        another call of this manager (even on its own thread): this only queues the ids
        (no lock, no state read). The queue runs at the start of the next allocating
        call, ``free``, or capacity query, never while a caller holds :attr:`lock`. Ids
        that are no longer live by then are skipped.
        """
        self._life.free_deferred(seq_ids)

    # ---- queries (under the lock: the core's batch loops run without the GIL) -------
    def __contains__(self, seq_id: SeqId) -> bool:
        """Whether ``seq_id`` is a device-resident sequence (not swapped out)."""
        return self._queries.contains(seq_id)

    def __len__(self) -> int:
        return self._queries.count()

    def sequences(self) -> list[SeqId]:
        """Live sequence ids (device-resident)."""
        return self._queries.sequences()

    def num_tokens(self, seq_id: SeqId) -> int:
        """Committed tokens of a sequence."""
        return self._queries.one(self.tables.num_computed, seq_id)

    def num_reserved(self, seq_id: SeqId) -> int:
        """Tokens holding a slot (committed plus reserved this step)."""
        return self._queries.one(self.tables.num_reserved, seq_id)

    def token_ids(self, seq_id: SeqId) -> np.ndarray:
        """The token ids the cache knows for ``seq_id`` (int32 copy): its prompt and every
        token added since (by :meth:`advance`), in order."""
        return self._queries.one(self.tables.tokens, seq_id)

    def sequence_info(self, seq_id: SeqId) -> dict:
        """Counts, prefix-hit blocks, priority and namespace (``(cache_salt,
        adapter_id)``) of one sequence. With layer groups, ``groups`` lists each group's
        block counts and priority, and the block counts are their sums."""
        return self._queries.sequence_info(seq_id)

    def block_table(self, seq_id: SeqId, group: int | None = None) -> np.ndarray:
        """The sequence's physical blocks in token order (int32); of a layer group's
        tables with ``group`` (-1 where a sliding group released the block)."""
        return self._queries.one(self._groups.group_for(group).blocks, seq_id)

    def block_tables(self, seq_ids: SeqIds, pad: int = -1, width: int | None = None,
                     group: int | None = None) -> np.ndarray:
        """Padded ``[B, width]`` int32 block tables (of layer group ``group``: column j is
        block j of the sequence, ``pad`` where a sliding group released it)."""
        return self._queries.block_tables(seq_ids, pad, width, group)

    def page_table_csr(self, seq_ids: SeqIds, group: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """FlashInfer's ``(indptr, indices, last_page_len)``, int32, over reserved tokens
        (of layer group ``group``: a sliding group lists only the blocks it holds)."""
        return self._queries.batch(self._groups.group_for(group).csr, seq_ids)

    def released_tokens(self, seq_ids: SeqIds, group: int | None = None) -> np.ndarray:
        """Tokens per sequence (int64) that sliding layer group ``group`` released (left
        its window): its gathers return the others. Zeros for full attention."""
        return self._queries.released_tokens(seq_ids, group)

    def seq_lens(self, seq_ids: SeqIds, computed: bool = False) -> np.ndarray:
        """Tokens per sequence (int64): reserved, or committed with ``computed=True``."""
        return self._queries.seq_lens(seq_ids, computed)

    def slot_mapping(self, seq_id: SeqId, start: int, count: int, group: int | None = None) -> np.ndarray:
        """int64 slots of positions ``[start, start + count)`` (must be reserved, and
        held by layer group ``group``)."""
        return self._queries.slot_mapping(seq_id, start, count, group)

    @property
    def lock(self) -> CallerLock:
        """The manager's lock, for callers composing several calls atomically
        (``with cache.lock: ...``)."""
        return self._caller_lock

    def set_priority(self, seq_id: SeqId, priority: int, start_token: int = 0,
                     end_token: int | None = None) -> None:
        """Eviction class of a sequence's blocks (or of a token range) when freed."""
        self._life.set_priority(seq_id, priority, start_token, end_token)

    def drain_events(self) -> list[KVEvent]:
        """KV events since the last drain (``enable_kv_events=True``), oldest first."""
        return self._prefix.drain_events()

    def swap_out(self, seq_id: SeqId) -> int:
        """Preempt a sequence to the host tier: its KV moves to host blocks and its
        device blocks are freed. Returns the device blocks released."""
        return self._moves.swap_out(seq_id)

    def swap_in(self, seq_id: SeqId) -> int:
        """Bring a swapped-out sequence back onto the device (all or nothing)."""
        return self._moves.swap_in(seq_id)

    def is_swapped(self, seq_id: SeqId) -> bool:
        """True when ``seq_id`` is swapped out to the host tier (:meth:`swap_out`): its KV
        lives in host memory until :meth:`swap_in`. False for a live sequence, an unknown
        id, or a cache without a host tier."""
        return self._moves.is_swapped(seq_id)

    # ---- stats ----------------------------------------------------------------------
    def stats(self) -> CacheStats:
        """A snapshot of the cache's counters (:class:`pagedkv.CacheStats`): blocks free /
        in use / cached, live and swapped sequences, prefix hits per medium, evictions.
        ``stats().describe()`` renders it as text."""
        return with_window_figures(self._queries.stats(), self.store)

    def dump_block_map(self, width: int = 64) -> str:
        """One character per block: ``.`` free, ``#`` in use, ``+`` shared, ``c`` cached-free, ``p`` pinned."""
        return self._queries.dump_block_map(width)

    def dump_stats(self) -> str:
        """A human-readable report for debugging: :meth:`stats` described, the first 32
        sequences with their computed/reserved tokens and first blocks, and a map of the
        block pool's states."""
        return self._queries.dump_stats()

    def check_invariants(self) -> None:
        """Audit every invariant of DESIGN.md (O(num_blocks)); raises InternalError.

        Also: every interned id names a live or swapped-out sequence (no id leaks)."""
        self._queries.check_invariants()

    def close(self) -> None:
        """Release what outlives the process: the disk prefix tier's files are flushed
        and unlocked, so another cache (or process) can open them. Idempotent; the
        cache must not be used afterwards."""
        with self._lock:
            self._tiers.close()
            close_states = getattr(self._groups, "close_tiers", None)   # recurrent states: their shelves
            if close_states is not None:
                close_states()
            # closed: the cache answers as one without tiers (its final stats, its audit)
            absent = NoTiers(self.index, self._groups.names(self._namespaces), self.config.block_size)
            self._tiers = self._life.tiers = self._prefix.tiers = self._queries.tiers = absent

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
