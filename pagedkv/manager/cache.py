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

The class is the API and the wiring; the work lives in one module per concept, each
given what it needs, never the cache: :mod:`~pagedkv.manager.lifecycle` (admission, the
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
from pagedkv.manager.arguments import as_token_ids, check_attention_call
from pagedkv.manager.coordinator import coordinator
from pagedkv.manager.data import DataPath
from pagedkv.manager.lifecycle import CallerLock, Lifecycle
from pagedkv.manager.moves import Moves
from pagedkv.manager.namespaces import NamespaceRegistry, namespace_key  # noqa: F401 (imported from here)
from pagedkv.manager.pool_view import PoolView
from pagedkv.manager.prefix import Prefixes
from pagedkv.manager.queries import Queries
from pagedkv.manager.seq_ids import SequenceIds
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
        self._groups = coordinator(self._pool, self.index, config, self._ids.name)
        self.tables: AttentionTables = self._groups.tables[0]
        self._namespaces = NamespaceRegistry()
        names = self._groups.names(self._namespaces)
        self._tiers: PrefixTiers | NoTiers = NoTiers(self.index, names, config.block_size)
        if config.has_prefix_tiers:
            if store is None:
                raise InvalidArgumentError(expected("allocate_store", "True with prefix tiers (they hold KV)", False))
            from pagedkv.tiers import PrefixTiers

            self._tiers = PrefixTiers(config, self.index, store, self._pool, names, self._groups)
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

    def _admit_restored(self, seq_id: SeqId, tokens: np.ndarray, cache_salt, adapter_id, priority) -> None:
        """Admit a sequence of a layer-grouped cache whose KV is about to arrive whole
        from elsewhere (a transfer): no prefix lookup, sliding groups untracked (see
        :meth:`~pagedkv.groups.tables.GroupTables.add_restored`)."""
        self._life.admit_restored(seq_id, tokens, cache_salt, adapter_id, priority)

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

    def match_prefix(self, token_ids: Iterable[int], *, cache_salt: str | None = None,
                     adapter_id: Any = None) -> int:
        """Tokens of ``token_ids`` a new sequence would find cached now (no side effects),
        on the device or in a prefix tier (whichever holds more full blocks). With
        layer groups: the longest prefix every group holds (:meth:`match_prefix_groups`)."""
        return self._prefix.match_prefix(token_ids, cache_salt, adapter_id)

    def match_prefix_groups(self, token_ids: Iterable[int], *, cache_salt: str | None = None,
                            adapter_id: Any = None) -> dict:
        """Per layer group, the cached prefix of ``token_ids``: a dict of ``tokens`` (what
        an admission reuses: the longest prefix every group holds), ``per_group`` and
        ``limited_by`` (the group holding the least, or None). No side effects."""
        return self._prefix.match_prefix_groups(token_ids, cache_salt, adapter_id)

    def has_available_blocks(self, n: int = 1) -> bool:
        """Whether ``n`` blocks can be allocated now (free or evictable).

        It does not know about prefix hits; for an admission use :meth:`can_admit`."""
        return self._prefix.has_available_blocks(n)

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
        return self._prefix.blocks_to_admit(prompt_token_ids, num_tokens, cache_salt, adapter_id)

    def can_admit(self, prompt_token_ids: Iterable[int], num_tokens: int | None = None, *,
                  cache_salt: str | None = None, adapter_id: Any = None) -> bool:
        """Whether :meth:`add_sequence` of this prompt, then reserving ``num_tokens``
        tokens in all (default: the prompt), would succeed now
        (see :meth:`blocks_to_admit`)."""
        return self._prefix.can_admit(prompt_token_ids, num_tokens, cache_salt, adapter_id)

    # ---- prefix cache ---------------------------------------------------------------
    def pin_prefix(self, token_ids: Iterable[int], *, cache_salt: str | None = None,
                   adapter_id: Any = None) -> int:
        """Pin the cached full blocks of ``token_ids``; returns the tokens pinned.

        Pinned blocks are never evicted, under any policy, until :meth:`unpin_prefix`.
        The blocks of this prefix that a prefix tier holds are pinned there too (the
        count is then the longest prefix pinned in any medium).
        """
        return self._prefix.pin_prefix(token_ids, cache_salt, adapter_id, True)

    def unpin_prefix(self, token_ids: Iterable[int], *, cache_salt: str | None = None,
                     adapter_id: Any = None) -> int:
        """Release the pins :meth:`pin_prefix` set on the cached full blocks of
        ``token_ids`` (same namespace: ``cache_salt``, ``adapter_id``), on the device and
        in the prefix tiers; returns the tokens unpinned. The blocks stay cached and
        become evictable again once no sequence references them."""
        return self._prefix.pin_prefix(token_ids, cache_salt, adapter_id, False)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix, in the prefix tiers too. Raises
        :class:`CacheBusyError` while any block is in use."""
        self._prefix.reset_prefix_cache()

    def set_priority(self, seq_id: SeqId, priority: int, start_token: int = 0,
                     end_token: int | None = None) -> None:
        """Eviction class of a sequence's blocks (or of a token range) when freed."""
        self._life.set_priority(seq_id, priority, start_token, end_token)

    def drain_events(self) -> list[KVEvent]:
        """KV events since the last drain (``enable_kv_events=True``), oldest first."""
        return self._prefix.drain_events()

    # ---- data -----------------------------------------------------------------------
    def _require_store(self):
        return self._data.require_store()

    @property
    def device(self):
        """The ``torch.device`` of the KV arena (None for a bookkeeping-only cache)."""
        return None if self.store is None else self.store.device

    def write(self, layer: int, slot_mapping, key, value) -> None:
        """Store new K/V ``[num_tokens, num_kv_heads, head_dim]`` at ``slot_mapping``
        (from :meth:`reserve`; negative slots are skipped)."""
        self._data.write(layer, slot_mapping, key, value)

    def gather(self, seq_id: SeqId, layer: int, num_tokens: int | None = None):
        """Contiguous K and V ``[n, num_kv_heads, head_dim]`` in token order: the first
        ``num_tokens`` tokens, by default every token holding a slot (committed plus
        reserved this step). A quantized layer reads committed tokens only (see
        :meth:`gather_batch`)."""
        k, v, _ = self.gather_batch([seq_id], layer, None if num_tokens is None else [num_tokens])
        return k, v

    def gather_batch(self, seq_ids: SeqIds, layer: int, num_tokens=None):
        """K, V ``[sum(lens), H, D]`` of many sequences, and ``cu_seqlens`` (int64 ``[B+1]``).

        ``num_tokens`` (optional, one per sequence) gathers only each sequence's first
        tokens; by default all reserved tokens. A sliding-window layer returns the
        tokens its group holds (sinks, then the window; :meth:`gather_window` adds
        their positions).

        One definition of what a read returns: the rows a forward pass wrote are read at
        model precision until they are committed. A quantized layer's arena holds them
        quantized, so gathering a sequence's reserved but uncommitted tokens from it is
        refused (``InvalidArgumentError``): gather the committed ones (``num_tokens``)
        and use the pass's K/V as computed, or read before writing with
        :meth:`gather_pages` (``pending=``)."""
        return self._data.gather(seq_ids, layer, num_tokens, False)

    def gather_window(self, seq_ids: SeqIds, layer: int, num_tokens=None):
        """:meth:`gather_batch` plus the int64 absolute position of every gathered token
        (concatenated per sequence): all of them for a full-attention layer; for a
        sliding one the sinks, then the window."""
        return self._data.gather(seq_ids, layer, num_tokens, True)

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
        Within a forward pass, a caller that has written the pass's rows to a quantized
        layer reads them from its own K/V, not from here: the pass's rows are read at
        model precision (one definition of what a read returns; :meth:`attention` takes
        them as ``k_new``/``v_new``). Without ``pending`` every row is read as stored.

        ``rotated=True`` (a cache with ``kv_rotation``): K/V in the rotated domain, as
        stored, without the per-row unrotation, which costs more than the dequantization.
        The rotation is orthonormal, so an attention that rotates its queries
        (``pagedkv.format.rotation.rotate(q, cache.rotation_signs)``) gets the same scores, and
        its output is unrotated once per query (``unrotate(out, signs)``) instead of once
        per cached token."""
        return self._data.gather_pages(layer, indptr, indices, seq_lens, pending=pending, rotated=rotated)

    def attention(self, layer: int, q, indptr, indices, seq_lens, q_indptr, *, k_new=None, v_new=None,
                  pending=None, **options):
        """:func:`pagedkv.ops.paged_attention` of ``q`` over ``layer``'s pages, reading
        what :meth:`gather_pages` reads (one definition of what a read returns): the rows
        this forward pass wrote at model precision, from ``k_new``/``v_new``
        (``[num_q_tokens, H, D]``, q's dtype: each query token's own K/V as computed;
        ``pending``: ints ``[B]``, each row's last positions they cover, default every
        query's); older rows in place in their stored format, except the ``kv_window``
        rows before the pass's and the sink rows, in model precision from the window
        arena; the rotation folded into ``q`` and the output. The table is as for
        :meth:`gather_pages` (with layer groups, the layer's group's).

        A quantized layer needs ``k_new``/``v_new``, or ``pending`` of zeros when no query's
        row was written by this pass: reading the pass's rows back quantized would differ
        from every other read, so it is refused (``InvalidArgumentError``). ``options``: the
        op's keywords (``sm_scale``, ``soft_cap``, ``window``, ``sink_tokens``,
        ``num_splits``, ``out``, ``backend``)."""
        check_attention_call(options, q, self.config.torch_dtype)
        return self._data.attention(layer, q, indptr, indices, seq_lens, q_indptr, k_new=k_new, v_new=v_new,
                                    pending=pending, **options)

    @property
    def rotation_signs(self):
        """The float32 ``[head_dim]`` signs of the cache's rotation (a copy), or None
        without ``kv_rotation``: what :func:`pagedkv.format.rotation.rotate` takes."""
        return self._data.rotation_signs()

    def copy_blocks(self, pairs) -> None:
        """Copy (src, dst) block pairs ``[P, 2]`` across all layers."""
        self._data.copy_blocks(pairs)

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
