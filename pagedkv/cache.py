"""PagedKVCache: the manager that joins the bookkeeping core to the KV store.

An engine calls it at four points:

- **admission**: :meth:`PagedKVCache.add_sequence` learns how much of the prompt is
  already cached (full blocks only, never the whole prompt);
- **each step**: :meth:`reserve` slots for the next tokens of many sequences in one
  call, :meth:`write` their K/V per layer, :meth:`gather` (or hand
  :meth:`page_table_csr` / :meth:`block_tables` to an attention kernel);
- **after the step**: :meth:`commit` the computed tokens (full blocks become
  reusable prefixes);
- **completion**: :meth:`free`.

Thread safety: one re-entrant lock in the manager serialises every call, queries
included, because the core's batch loops release the GIL while they mutate. The core
classes used directly are not thread-safe. Reads of the store that race with writes of
the same slots are the caller's business, as with any KV cache.

Sequence ids may be any hashable. Non-negative ints address the core directly, so a
batch call given an int64 NumPy array crosses into Cython once with no per-id Python
work; other ids are interned to private negative keys.
"""
from __future__ import annotations

import threading
from typing import Any, Dict, Hashable, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np

from pagedkv._core.pool import BlockPool
from pagedkv._core.prefix import PrefixIndex, hash_bytes
from pagedkv._core.tables import BlockTables
from pagedkv.config import CacheConfig, format_bytes
from pagedkv.errors import (InvalidArgumentError, SequenceExistsError,
                            SequenceNotFoundError, expected)
from pagedkv.events import AllBlocksCleared, BlockRemoved, BlockStored, events_from_records
from pagedkv.stats import CacheStats, render_block_map

__all__ = ["PagedKVCache", "as_token_ids"]

SeqId = Hashable
SeqIds = Union[SeqId, Sequence[SeqId], np.ndarray]

_INT64_MAX = 2**63 - 1


class PagedKVCache:
    """A paged KV cache for one model (see the module docstring for the call order).

    Args:
        config: the :class:`~pagedkv.config.CacheConfig`.
        allocate_store: allocate the KV arenas (torch). ``False`` gives a
            bookkeeping-only cache (no torch needed), e.g. for a scheduler or tests.
        weak_hash: tests only: a 4-valued block hash that collides constantly, to
            prove that collisions cost misses and never wrong KV.

    With prefix tiers configured (``config.prefix_host_blocks``,
    ``config.prefix_disk_blocks``), evicted prefix blocks move down to host memory and
    disk and come back on admission (:mod:`pagedkv.tiers`); :meth:`close` releases the
    disk tier's files (also on leaving a ``with`` block).
    """

    def __init__(self, config: CacheConfig, *, allocate_store: bool = True, weak_hash: bool = False):
        if not isinstance(config, CacheConfig):
            raise InvalidArgumentError(expected("config", "a CacheConfig", type(config).__name__))
        self.store = None
        if allocate_store:
            from pagedkv.store import KVStore

            self.store = KVStore(config)
            config = self.store.config  # may differ: fp8 -> int8 fallback
        self.config = config
        nb = config.resolved_num_blocks
        bs = config.block_size
        self.index: Optional[PrefixIndex] = None
        if config.enable_prefix_caching:
            self.index = PrefixIndex(bs, nb, hash_seed=config.hash_seed, weak_hash=weak_hash,
                                     events=config.enable_kv_events, tier_log=config.has_prefix_tiers)
        self.pool = BlockPool(nb, config.eviction, priority_classes=config.priority_classes,
                              low_watermark=config.low_watermark, high_watermark=config.high_watermark,
                              shuffle_seed=config.shuffle_free_blocks, index=self.index)
        self.tables = BlockTables(self.pool, bs, self.index)
        self._lock = threading.RLock()
        self._keys: Dict[Any, int] = {}       # non-int sequence id -> interned negative key
        self._names: Dict[int, Any] = {}      # interned key -> sequence id
        self._next_key = -1
        self._namespaces: Dict[Tuple[Any, Any], Tuple[int, int]] = {(None, None): (0, 0)}
        self._ns_names: Dict[int, Tuple[Any, Any]] = {0: (None, None)}
        default = namespace_key(None, None)
        self._ns_keys: Dict[int, bytes] = {0: default}   # namespace id -> process-independent key
        self._ns_by_key: Dict[bytes, int] = {default: 0}
        self._copies: List[np.ndarray] = []   # CoW pairs owed by a bookkeeping-only cache
        self._host = None
        if config.host_num_blocks:
            from pagedkv.offload import HostTier

            self._host = HostTier(self, config.host_num_blocks)
        self._tiers = None
        if config.has_prefix_tiers:
            if self.store is None:
                raise InvalidArgumentError(expected("allocate_store", "True with prefix tiers (they hold KV)", False))
            from pagedkv.tiers import PrefixTiers

            self._tiers = PrefixTiers(self)

    # ---- ids ----------------------------------------------------------------------
    def _key(self, seq_id: SeqId, create: bool = False, argument: str = "seq_id") -> int:
        if type(seq_id) is int and 0 <= seq_id <= _INT64_MAX:
            return seq_id
        if isinstance(seq_id, (int, np.integer)) and not isinstance(seq_id, bool):
            k = int(seq_id)
            if not 0 <= k <= _INT64_MAX:
                raise InvalidArgumentError(expected(argument, "an int id in [0, 2**63) or another hashable", k))
            return k
        try:
            k = self._keys.get(seq_id)
        except TypeError:
            raise InvalidArgumentError(expected(argument, "a hashable sequence id", type(seq_id).__name__)) from None
        if k is None:
            if not create:
                raise SequenceNotFoundError(seq_id, argument)
            k = self._next_key
            self._next_key -= 1
            self._keys[seq_id] = k
            self._names[k] = seq_id
        return k

    def _batch(self, seq_ids: SeqIds) -> Tuple[Union[int, np.ndarray], bool]:
        """Keys for a batch call (an int64 array, or one int), and whether they may be
        interned (negative)."""
        t = type(seq_ids)
        if t is int and 0 <= seq_ids <= _INT64_MAX:
            return seq_ids, False                # a lone int goes to the core as is
        if t is np.ndarray and seq_ids.dtype == np.int64:
            return seq_ids, False   # int ids, straight to the core (it rejects negatives)
        if isinstance(seq_ids, (list, tuple, np.ndarray, range)):
            keys = np.fromiter((self._key(s, argument="seq_ids") for s in seq_ids), dtype=np.int64,
                               count=len(seq_ids))
            return keys, True
        return self._key(seq_ids), True          # one id: the core takes a Python int

    def _seq_id(self, key: int) -> SeqId:
        return self._names.get(key, key) if key < 0 else key

    def _namespace(self, cache_salt: Optional[str], adapter_id: Any) -> Tuple[int, int]:
        ns = (cache_salt, adapter_id)
        found = self._namespaces.get(ns)
        if found is not None:
            return found
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise InvalidArgumentError(expected("cache_salt", "a str or None", type(cache_salt).__name__))
        key = namespace_key(cache_salt, adapter_id)
        ns_hash = hash_bytes(key)
        ns_id = len(self._namespaces)
        self._namespaces[ns] = (ns_id, ns_hash)
        self._ns_names[ns_id] = ns
        self._ns_keys[ns_id] = key
        self._ns_by_key[key] = ns_id
        return ns_id, ns_hash

    def _namespace_key(self, ns_id: int) -> bytes:
        return self._ns_keys[ns_id]

    def _namespace_hash_of_key(self, key: bytes) -> int:
        ns_id = self._ns_by_key.get(key)
        return hash_bytes(key) if ns_id is None else self._namespaces[self._ns_names[ns_id]][1]

    def _namespace_of_key(self, key: bytes):
        """``(cache_salt, adapter_id)`` of a namespace key as KV events name it (None:
        the default); the raw key when this process has not used that namespace."""
        ns_id = self._ns_by_key.get(key)
        if ns_id is None:
            return key
        ns = self._ns_names[ns_id]
        return None if ns == (None, None) else ns

    # ---- lifecycle ----------------------------------------------------------------
    def add_sequence(self, seq_id: SeqId, prompt_token_ids: Optional[Iterable[int]] = None, *,
                     cache_salt: Optional[str] = None, adapter_id: Any = None,
                     priority: Optional[int] = None) -> int:
        """Admit a sequence; returns how many prompt tokens are already cached.

        Those tokens' KV is in the arena already (full blocks reused by reference);
        reserve and compute the rest. Never the whole prompt: the last prompt token is
        always computed, so a fully cached, block-aligned prompt reuses one block less.
        ``cache_salt`` / ``adapter_id`` select a namespace; different namespaces never
        share blocks. ``priority`` is the eviction class of its blocks under the
        ``priority`` policy (0 is evicted first; default: seed 004's
        prefix > recent > old rule).
        """
        tokens = None
        if prompt_token_ids is not None:
            tokens = as_token_ids(prompt_token_ids)
        if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)
                                     or not 0 <= priority <= 127):
            raise InvalidArgumentError(expected("priority", "None or an int in [0, 127]", repr(priority)))
        with self._lock:
            mark = self._next_key
            key = self._key(seq_id, True)
            fresh = self._next_key != mark          # interned just now: forget it on failure
            try:
                if self._host is not None and self._host.holds(key):
                    raise SequenceExistsError(seq_id)
                ns_id, ns_hash = self._namespace(cache_salt, adapter_id)
                hit = self.tables.add(key, tokens, ns_id, ns_hash, -1 if priority is None else priority)
            except SequenceExistsError:
                raise SequenceExistsError(seq_id) from None   # name the caller's id, not the key
            except BaseException:
                if fresh:
                    self._forget(key)
                raise
            if self._tiers is not None and tokens is not None:
                try:
                    hit = self._tiers.promote(key, tokens, ns_id, hit)
                except BaseException:
                    self.tables.remove(key, internal=True)
                    if fresh:
                        self._forget(key)
                    raise
            return hit

    def _forget(self, key: int) -> None:
        name = self._names.pop(key, None)
        if name is not None:
            self._keys.pop(name, None)

    def reserve(self, seq_ids: SeqIds, num_tokens: Union[int, Sequence[int], np.ndarray]) -> np.ndarray:
        """Slots (int64, concatenated in batch order) for the next tokens of each sequence.

        One call for the whole batch, all or nothing: on :class:`OutOfBlocksError`
        nothing changed. Blocks are allocated only at block boundaries. A shared,
        partially filled last block (after :meth:`fork`) is copied first, so the write
        never touches another sequence's KV.
        """
        if not (type(num_tokens) is int or type(num_tokens) is np.ndarray):
            num_tokens = _as_counts(num_tokens)
        with self._lock:
            keys, internal = self._batch(seq_ids)
            slots = self.tables.reserve(keys, num_tokens, internal=internal)
            if self._tiers is not None:
                self._tiers.sync()      # evicted KV goes down before anything overwrites it
            if self.tables.num_pending_copies:
                self._copy_on_write()
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
            keys, internal = self._batch(seq_ids)
            slots = self.tables.advance(keys, token_ids, internal=internal)
            if self._tiers is not None:
                self._tiers.sync()
            if self.tables.num_pending_copies:
                self._copy_on_write()
            return slots

    def _copy_on_write(self) -> None:
        pairs = self.tables.take_copies()
        if self.store is not None:
            import torch

            self.store.copy_blocks(torch.from_numpy(pairs))
        else:
            self._copies.append(pairs)

    def take_copies(self) -> np.ndarray:
        """Copy-on-write pairs ``[P, 2]`` (src, dst) a bookkeeping-only cache owes its
        own KV store; with an arena the manager performs them itself."""
        with self._lock:
            pending = self._copies
            out = np.concatenate(pending) if pending else np.empty((0, 2), dtype=np.int32)
            pending.clear()
            return out

    def commit(self, seq_ids: SeqIds, num_tokens: Union[int, Sequence[int], np.ndarray],
               token_ids: Optional[Iterable[int]] = None) -> None:
        """The KV of the next ``num_tokens`` reserved tokens of each sequence is written.

        ``token_ids`` (concatenated in batch order) name those tokens when they are not
        known yet, e.g. a decode step's inputs; prompt tokens are known from admission.
        Blocks that became full are registered for prefix reuse.
        """
        if not (type(num_tokens) is int or type(num_tokens) is np.ndarray):
            num_tokens = _as_counts(num_tokens)
        if token_ids is not None:
            token_ids = as_token_ids(token_ids)
        with self._lock:
            keys, internal = self._batch(seq_ids)
            self.tables.commit(keys, num_tokens, token_ids, internal=internal)
            if self._tiers is not None:
                self._tiers.sync()

    def unreserve(self, seq_ids: SeqIds, num_tokens=None) -> None:
        """Give back reserved, uncommitted tokens (all when ``num_tokens`` is None), e.g.
        after a failed forward pass; blocks left covering no token are released."""
        with self._lock:
            keys, internal = self._batch(seq_ids)
            if num_tokens is not None and not (type(num_tokens) is np.ndarray):
                n = 1 if type(keys) is int else len(keys)
                num_tokens = _as_counts(np.full(n, num_tokens) if np.ndim(num_tokens) == 0 else num_tokens)
            self.tables.unreserve(keys, num_tokens, internal=internal)

    def num_blocks(self, seq_id: SeqId) -> int:
        """Blocks the sequence holds (``ceil(num_reserved / block_size)``)."""
        return -(-self.num_reserved(seq_id) // self.config.block_size)

    def fork(self, src: SeqId, dst: SeqId) -> None:
        """``dst`` shares all of ``src``'s committed KV by reference (beam search, n > 1)."""
        with self._lock:
            sk = self._key(src, argument="src")
            mark = self._next_key
            dk = self._key(dst, True, "dst")
            fresh = self._next_key != mark
            try:
                if dk in self.tables or (self._host is not None and self._host.holds(dk)):
                    raise SequenceExistsError(dst, "dst")
                self.tables.fork(sk, dk)
            except BaseException:
                if fresh:
                    self._forget(dk)
                raise

    def free(self, seq_ids: SeqIds) -> None:
        """Release sequences. Their full blocks stay cached (findable) until evicted."""
        with self._lock:
            keys, internal = self._batch(seq_ids)
            if type(keys) is int and (self._host is None or not self._host.num_swapped):
                self.tables.remove(keys, internal=internal)
                if keys < 0:
                    self._forget(keys)
                return
            if type(keys) is int:
                keys = np.array([keys], dtype=np.int64)
            if self._host is not None and self._host.num_swapped:
                swapped = np.fromiter((self._host.holds(k) for k in keys.tolist()), dtype=bool, count=len(keys))
                if swapped.any():
                    self.tables.seq_lens(keys[~swapped], internal=internal)  # validate the rest first
                    for k in keys[swapped].tolist():
                        self._host.discard(k)
                    keys = keys[~swapped]
            self.tables.remove(keys, internal=internal)
            if internal:
                for k in keys.tolist():
                    if k < 0:
                        self._forget(k)

    # ---- queries (under the lock: the core's batch loops run without the GIL) -------
    def __contains__(self, seq_id: SeqId) -> bool:
        with self._lock:
            try:
                return self._key(seq_id) in self.tables
            except (SequenceNotFoundError, InvalidArgumentError):
                return False

    def __len__(self) -> int:
        return len(self.tables)

    def sequences(self) -> List[SeqId]:
        """Live sequence ids (device-resident)."""
        with self._lock:
            return [self._seq_id(k) for k in self.tables.keys().tolist()]

    def num_tokens(self, seq_id: SeqId) -> int:
        """Committed tokens of a sequence."""
        with self._lock:
            return self.tables.num_computed(self._key(seq_id))

    def num_reserved(self, seq_id: SeqId) -> int:
        """Tokens holding a slot (committed plus reserved this step)."""
        with self._lock:
            return self.tables.num_reserved(self._key(seq_id))

    def token_ids(self, seq_id: SeqId) -> np.ndarray:
        with self._lock:
            return self.tables.tokens(self._key(seq_id))

    def sequence_info(self, seq_id: SeqId) -> dict:
        """Counts, prefix-hit blocks, priority and namespace of one sequence."""
        with self._lock:
            info = self.tables.info(self._key(seq_id))
            info["namespace"] = self._ns_names[info["namespace"]]
            return info

    def block_table(self, seq_id: SeqId) -> np.ndarray:
        """The sequence's physical blocks in token order (int32)."""
        with self._lock:
            return self.tables.blocks(self._key(seq_id))

    def block_tables(self, seq_ids: SeqIds, pad: int = -1, width: Optional[int] = None) -> np.ndarray:
        """Padded ``[B, width]`` int32 block tables."""
        with self._lock:
            keys, internal = self._batch(seq_ids)
            return self.tables.block_table(keys, pad, width, internal=internal)

    def page_table_csr(self, seq_ids: SeqIds) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """FlashInfer's ``(indptr, indices, last_page_len)``, int32, over reserved tokens."""
        with self._lock:
            keys, internal = self._batch(seq_ids)
            return self.tables.csr(keys, internal=internal)

    def seq_lens(self, seq_ids: SeqIds, computed: bool = False) -> np.ndarray:
        with self._lock:
            keys, internal = self._batch(seq_ids)
            return self.tables.seq_lens(keys, computed, internal=internal)

    def slot_mapping(self, seq_id: SeqId, start: int, count: int) -> np.ndarray:
        """int64 slots of positions ``[start, start + count)`` (must be reserved)."""
        with self._lock:
            k = self._key(seq_id)
            return self.tables.slot_mapping(np.array([k], np.int64), np.array([start], np.int64),
                                            np.array([count], np.int64), internal=True)

    @property
    def lock(self) -> threading.RLock:
        """The manager's lock, for callers composing several calls atomically."""
        return self._lock

    def match_prefix(self, token_ids: Iterable[int], *, cache_salt: Optional[str] = None,
                     adapter_id: Any = None) -> int:
        """Tokens of ``token_ids`` a new sequence would find cached now (no side effects),
        on the device or in a prefix tier (whichever holds more full blocks)."""
        if self.index is None:
            return 0
        tokens = as_token_ids(token_ids)
        with self._lock:
            ns_id, ns_hash = self._namespace(cache_salt, adapter_id)
            found = len(self.index.match(tokens, ns_id, ns_hash)) * self.config.block_size
            if self._tiers is not None:
                found = max(found, self._tiers.match(tokens, self._ns_keys[ns_id]))
            return found

    def has_available_blocks(self, n: int = 1) -> bool:
        """Whether ``n`` blocks can be allocated now (free or evictable)."""
        with self._lock:
            return self.pool.num_free_blocks >= n

    def can_allocate(self, num_tokens: int) -> bool:
        return self.has_available_blocks(self.config.blocks_for_tokens(num_tokens))

    # ---- prefix cache ---------------------------------------------------------------
    def pin_prefix(self, token_ids: Iterable[int], *, cache_salt: Optional[str] = None,
                   adapter_id: Any = None) -> int:
        """Pin the cached full blocks of ``token_ids``; returns the tokens pinned.

        Pinned blocks are never evicted, under any policy, until :meth:`unpin_prefix`.
        The blocks of this prefix that a prefix tier holds are pinned there too (the
        count is then the longest prefix pinned in any medium).
        """
        blocks = self._prefix_blocks(token_ids, cache_salt, adapter_id)
        with self._lock:
            self.pool.pin(blocks)
            tiers = self._pin_tiers(token_ids, cache_salt, adapter_id, True)
        return max(len(blocks) * self.config.block_size, tiers)

    def unpin_prefix(self, token_ids: Iterable[int], *, cache_salt: Optional[str] = None,
                     adapter_id: Any = None) -> int:
        blocks = self._prefix_blocks(token_ids, cache_salt, adapter_id)
        with self._lock:
            self.pool.unpin(blocks)
            tiers = self._pin_tiers(token_ids, cache_salt, adapter_id, False)
        return max(len(blocks) * self.config.block_size, tiers)

    def _pin_tiers(self, token_ids, cache_salt, adapter_id, pin: bool) -> int:
        if self._tiers is None:
            return 0
        ns_id, _ = self._namespace(cache_salt, adapter_id)
        return self._tiers.pin(as_token_ids(token_ids), self._ns_keys[ns_id], pin)

    def _prefix_blocks(self, token_ids, cache_salt, adapter_id) -> np.ndarray:
        if self.index is None:
            raise InvalidArgumentError(expected("config.enable_prefix_caching", "True to pin prefixes", False))
        tokens = as_token_ids(token_ids)
        with self._lock:
            ns_id, ns_hash = self._namespace(cache_salt, adapter_id)
            return self.index.match(tokens, ns_id, ns_hash)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix, in the prefix tiers too. Raises
        :class:`CacheBusyError` while any block is in use."""
        with self._lock:
            self.pool.reset_cache()
            if self._tiers is not None:
                self._tiers.clear()

    def set_priority(self, seq_id: SeqId, priority: int, start_token: int = 0,
                     end_token: Optional[int] = None) -> None:
        """Eviction class of a sequence's blocks (or of a token range) when freed."""
        with self._lock:
            self.tables.set_priority(self._key(seq_id), priority, start_token, end_token)

    def drain_events(self) -> List[Union[BlockStored, BlockRemoved, AllBlocksCleared]]:
        """KV events since the last drain (``enable_kv_events=True``), oldest first."""
        if self.index is None or not self.index.events_enabled:
            raise InvalidArgumentError(expected("config.enable_kv_events", "True to drain events", False))
        with self._lock:
            if self._tiers is not None:
                return self._tiers.drain_events()
            records = self.index.drain_events()
        return events_from_records(records, self._ns_names, self.config.block_size, self.index.root)

    # ---- data -----------------------------------------------------------------------
    def _require_store(self):
        if self.store is None:
            raise InvalidArgumentError(expected("allocate_store", "True for KV data operations", False))
        return self.store

    def write(self, layer: int, slot_mapping, key, value) -> None:
        """Store new K/V ``[num_tokens, num_kv_heads, head_dim]`` at ``slot_mapping``
        (from :meth:`reserve`; negative slots are skipped)."""
        store = self._require_store()
        store.write(layer, _slots_tensor(slot_mapping, store.device), key, value)

    def gather(self, seq_id: SeqId, layer: int, num_tokens: Optional[int] = None):
        """Contiguous K and V ``[n, num_kv_heads, head_dim]`` in token order: the first
        ``num_tokens`` tokens, by default every token holding a slot (committed plus
        reserved this step)."""
        k, v, _ = self.gather_batch([seq_id], layer, None if num_tokens is None else [num_tokens])
        return k, v

    def gather_batch(self, seq_ids: SeqIds, layer: int, num_tokens=None):
        """K, V ``[sum(lens), H, D]`` of many sequences, and ``cu_seqlens`` (int64 ``[B+1]``).

        ``num_tokens`` (optional, one per sequence) gathers only each sequence's first
        tokens; by default all reserved tokens."""
        import torch

        store = self._require_store()
        with self._lock:
            keys, internal = self._batch(seq_ids)
            indptr, indices, _ = self.tables.csr(keys, internal=internal)
            lens = self.tables.seq_lens(keys, internal=internal)
        if num_tokens is not None:
            want = _as_counts(num_tokens)
            if want.shape != lens.shape or (want < 0).any() or (want > lens).any():
                raise InvalidArgumentError(expected(
                    "num_tokens", f"{len(lens)} counts within the reserved lengths {lens.tolist()}", want.tolist()))
            lens = want
        dev = store.device
        k, v = store.gather(layer, torch.from_numpy(indptr).to(dev), torch.from_numpy(indices).to(dev),
                            torch.from_numpy(lens.astype(np.int32)).to(dev))
        cu = np.zeros(len(lens) + 1, dtype=np.int64)
        np.cumsum(lens, out=cu[1:])
        return k, v, torch.from_numpy(cu)

    def copy_blocks(self, pairs) -> None:
        """Copy (src, dst) block pairs across all layers."""
        import torch

        store = self._require_store()
        if isinstance(pairs, np.ndarray):
            pairs = torch.from_numpy(pairs)
        elif not isinstance(pairs, torch.Tensor):
            pairs = torch.as_tensor(pairs, dtype=torch.int64)
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
        with self._lock:
            return host.swap_out(self._key(seq_id))

    def swap_in(self, seq_id: SeqId) -> int:
        """Bring a swapped-out sequence back onto the device (all or nothing)."""
        host = self._require_host()
        with self._lock:
            return host.swap_in(self._key(seq_id))

    def is_swapped(self, seq_id: SeqId) -> bool:
        return self._host is not None and self._host.holds(self._key(seq_id))

    # ---- stats ----------------------------------------------------------------------
    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats.collect(self)

    def dump_block_map(self, width: int = 64) -> str:
        """One character per block: ``.`` free, ``#`` in use, ``+`` shared, ``c`` cached-free, ``p`` pinned."""
        with self._lock:
            return render_block_map(self.pool, width)

    def dump_stats(self) -> str:
        s = self.stats()
        lines = ["=== pagedkv cache ===", s.describe()]
        with self._lock:
            lines.append("Sequences:")
            for k in self.tables.keys().tolist()[:32]:
                info = self.tables.info(k)
                blocks = self.tables.blocks(k)
                shown = " ".join(map(str, blocks[:8].tolist())) + (" ..." if len(blocks) > 8 else "")
                lines.append(f"  {self._seq_id(k)!r}: {info['num_computed']}/{info['num_reserved']} tokens, "
                             f"{info['num_blocks']} blocks [{shown}]")
            lines.append("Block map:")
            lines.append(render_block_map(self.pool, 64))
        return "\n".join(lines)

    def check_invariants(self) -> None:
        """Audit every invariant of DESIGN.md (O(num_blocks)); raises InternalError."""
        with self._lock:
            self.tables.check_invariants()
            if self._host is not None:
                self._host.check_invariants()
            if self._tiers is not None:
                self._tiers.check_invariants()

    def close(self) -> None:
        """Release what outlives the process: the disk prefix tier's files are flushed
        and unlocked, so another cache (or process) can open them. Idempotent; the
        cache must not be used afterwards."""
        with self._lock:
            if self._tiers is not None:
                self._tiers.close()
                self._tiers = None

    def __enter__(self) -> "PagedKVCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        c = self.config
        return (f"PagedKVCache(blocks={c.resolved_num_blocks}x{c.block_size}, layers={c.num_layers}, "
                f"kv_heads={c.num_kv_heads}, head_dim={c.head_dim}, kv_dtype={c.cache_dtype}, "
                f"sequences={len(self)}, free_blocks={self.pool.num_free_blocks}, "
                f"arena={format_bytes(c.total_bytes)})")


def namespace_key(cache_salt: Optional[str], adapter_id: Any) -> bytes:
    """The process-independent key of a prefix namespace (its hash keys the device
    index; lower tiers and peers compare the key itself)."""
    # Domain separation: each field is tagged and length-prefixed, so a salt "X"
    # and an adapter "X" (or "a" + "bc" vs "ab" + "c") never share a namespace.
    parts = [b"pagedkv-namespace-v1"]
    for tag, value in ((b"salt", cache_salt), (b"adapter", adapter_id)):
        if value is None:
            parts.append(tag + b":none")
        else:
            raw = repr(value).encode() if not isinstance(value, str) else value.encode()
            kind = type(value).__name__.encode()
            parts.append(tag + b":" + kind + b":" + str(len(raw)).encode() + b":" + raw)
    return b"\x00".join(parts)


def as_token_ids(token_ids) -> np.ndarray:
    """Token ids as a flat int32 array (lists, arrays, tensors); typed errors otherwise."""
    if type(token_ids) is np.ndarray and token_ids.dtype == np.int32 and token_ids.ndim == 1:
        return token_ids
    try:
        import torch

        if isinstance(token_ids, torch.Tensor):
            if token_ids.dtype.is_floating_point or token_ids.dtype == torch.bool:
                raise InvalidArgumentError(expected("token_ids", "integer token ids", f"a {token_ids.dtype} tensor"))
            token_ids = token_ids.detach().cpu().reshape(-1).numpy()
    except ImportError:
        pass
    arr = np.asarray(list(token_ids) if not isinstance(token_ids, np.ndarray) else token_ids)
    if arr.size == 0:
        return np.empty(0, dtype=np.int32)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise InvalidArgumentError(expected("token_ids", "a flat sequence of integer token ids",
                                            f"{arr.dtype} values of shape {arr.shape}"))
    if int(arr.min()) < -2**31 or int(arr.max()) >= 2**31:
        raise InvalidArgumentError(expected("token_ids", "token ids fitting int32", "an out-of-range id"))
    return arr.astype(np.int32, copy=False)


def _as_counts(counts) -> np.ndarray:
    arr = np.asarray(counts)
    if arr.size == 0:
        return np.empty(0, dtype=np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise InvalidArgumentError(expected("num_tokens", "an int or a flat sequence of ints",
                                            f"{arr.dtype} values of shape {arr.shape}"))
    return arr.astype(np.int64, copy=False)


def _slots_tensor(slot_mapping, device):
    import torch

    if isinstance(slot_mapping, np.ndarray):
        if slot_mapping.dtype != np.int64:
            from pagedkv.errors import DTypeError

            raise DTypeError(expected("slot_mapping", "an int64 array", f"{slot_mapping.dtype} array"))
        slot_mapping = torch.from_numpy(slot_mapping)
    if isinstance(slot_mapping, torch.Tensor) and slot_mapping.device != device:
        slot_mapping = slot_mapping.to(device, non_blocking=True)
    return slot_mapping
