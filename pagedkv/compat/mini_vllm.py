"""Seed 003 (mini-vllm's ``kv_cache.py``) on pagedkv.

``CacheConfig``, ``BlockAllocator``, ``BlockTable`` and ``KVCacheManager`` keep the
seed's names and behaviour, but own no allocator of their own: a ``BlockAllocator``
is a :class:`~pagedkv._core.pool.BlockPool`, and a ``KVCacheManager`` is a
:class:`~pagedkv.manager.cache.PagedKVCache` (its pool, block tables and KV store).

Where the seed raises ``RuntimeError`` (allocation failure, freeing or sharing a block
that is not allocated) the adapter raises pagedkv's typed error, in a subclass that is
also a ``RuntimeError`` (:class:`AllocatorOutOfBlocksError`,
:class:`UnallocatedBlockError`), so code written against the seed keeps catching it.

Deviations from the seed, each forced by pagedkv's design or by a seed bug:

- ``CacheConfig.kv_cache_shape`` is the *per-layer* shape
  ``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` (the seed's and its CUDA
  kernels' layout), and ``KVCacheManager.kv_cache`` holds every layer,
  ``[num_layers] + kv_cache_shape`` (the seed allocated one layer and ignored
  ``num_layers``). ``bytes_per_block`` and ``total_memory_gb`` count all layers, so
  they are the memory actually allocated; the seed's also sized bfloat16 at 4 bytes.
- ``get_slot_mapping`` returns int64 slots (pagedkv's slot dtype; ``PagedKVCache.write``
  rejects int32), where the seed returned int32.
- Blocks come from the front of pagedkv's free queue (lowest ids first on a fresh
  pool); the seed popped from the back of a list. Callers never relied on the order.
- ``allocate_sequence`` on a live ``seq_id`` raises ``SequenceExistsError`` (the seed
  overwrote the table and leaked its blocks); unknown ids raise
  ``SequenceNotFoundError`` (a ``KeyError``, as the seed's dict lookups did).
- A manager's block tables belong to its sequences, so its ``allocator`` answers
  queries but refuses direct ``allocate``/``free``/``add_ref`` (they would put blocks
  outside every table and break pagedkv's ref-count audit). Sharing, the reason the
  seed counts references, is :meth:`KVCacheManager.fork_sequence`.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np
import torch

from pagedkv._core.pool import BlockPool
from pagedkv.config.options import CacheConfig as _PagedKVConfig
from pagedkv.errors import (
    DeviceError,
    InvalidArgumentError,
    InvalidBlockError,
    OutOfBlocksError,
    SequenceNotFoundError,
    expected,
)
from pagedkv.manager.cache import PagedKVCache
from pagedkv.manager.pool_view import PoolView

__all__ = [
    "AllocatorOutOfBlocksError",
    "UnallocatedBlockError",
    "CacheConfig",
    "BlockAllocator",
    "BlockTable",
    "KVCacheManager",
]

_V = TypeVar("_V")


class AllocatorOutOfBlocksError(OutOfBlocksError, RuntimeError):
    """Out of blocks; also a ``RuntimeError``, which the seed raised for this case."""


class UnallocatedBlockError(InvalidBlockError, RuntimeError):
    """A block that is not allocated was freed or shared; also the seed's ``RuntimeError``."""


def _check_count(name: str, value: object, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise InvalidArgumentError(expected(name, f"an int >= {minimum}", repr(value)))
    return int(value)


# ---- config -------------------------------------------------------------------------
@dataclass
class CacheConfig:
    """The seed's cache configuration, validated by (and convertible to) pagedkv's.

    ``dtype`` is normalised to a torch dtype. See the module docstring for what
    ``kv_cache_shape``, ``bytes_per_block`` and ``total_memory_gb`` count.
    """

    num_blocks: int
    block_size: int = 16
    num_layers: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    dtype: torch.dtype = torch.float16
    device: str = "cuda"

    def __post_init__(self) -> None:
        self.dtype = self.to_pagedkv().torch_dtype   # validates every field

    def to_pagedkv(self, **overrides) -> _PagedKVConfig:
        """The equivalent :class:`pagedkv.CacheConfig` (prefix caching off: the seed's
        API never names tokens). ``overrides`` are passed through."""
        fields: dict[str, Any] = dict(num_layers=self.num_layers, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                      block_size=self.block_size, num_blocks=self.num_blocks, dtype=self.dtype,
                      device=self.device, enable_prefix_caching=False)
        fields.update(overrides)
        return _PagedKVConfig(**fields)

    @property
    def kv_cache_shape(self) -> tuple[int, ...]:
        """Per-layer shape ``[num_blocks, 2, block_size, num_kv_heads, head_dim]``."""
        return self.to_pagedkv().kv_cache_shape

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block, K and V, over all ``num_layers`` layers."""
        return self.to_pagedkv().bytes_per_block

    @property
    def total_memory_gb(self) -> float:
        """Bytes of the whole cache tensor in GiB."""
        return self.num_blocks * self.bytes_per_block / (1024 ** 3)


# ---- allocator ----------------------------------------------------------------------
class BlockAllocator:
    """The seed's ref-counted block allocator: a view of a pagedkv ``BlockPool``.

    ``BlockAllocator(num_blocks)`` owns a fresh pool; the allocator of a
    :class:`KVCacheManager` is a read-only view of the manager's pool.
    """

    def __init__(self, num_blocks: int):
        self._init(BlockPool(_check_count("num_blocks", num_blocks, 1)), threading.RLock(), owner=None)

    @classmethod
    def _view(cls, pool: BlockPool | PoolView, lock, owner: str) -> BlockAllocator:
        self = cls.__new__(cls)
        self._init(pool, lock, owner)
        return self

    def _init(self, pool: BlockPool | PoolView, lock, owner: str | None) -> None:
        self.pool = pool
        self.num_blocks = pool.num_blocks
        self._lock = lock
        self._owner = owner  # None: standalone, mutable; else who owns the blocks

    def _mutable(self, op: str) -> None:
        if self._owner is not None:
            raise InvalidArgumentError(expected(
                "allocator", f"a standalone BlockAllocator for {op}() (a manager's blocks belong to its "
                f"sequences: use {self._owner})", "the allocator of a KVCacheManager"))

    def _block(self, block_id: object) -> int:
        if isinstance(block_id, bool) or not isinstance(block_id, (int, np.integer)) \
                or not 0 <= block_id < self.num_blocks:
            raise InvalidBlockError(expected("block_id", f"a block id in [0, {self.num_blocks})", repr(block_id)))
        return int(block_id)

    def _allocated(self, block_id: object) -> int:
        b = self._block(block_id)
        if self.pool.ref_cnt[b] == 0:
            raise UnallocatedBlockError(expected("block_id", "an allocated block (ref_cnt >= 1)",
                                                 f"block {b}, which is free"))
        return b

    @property
    def num_free(self) -> int:
        return self.pool.num_free_blocks

    @property
    def free_blocks(self) -> list[int]:
        """Free block ids in the order ``allocate`` takes them (a snapshot)."""
        return self.pool.free_block_queue().tolist()

    @property
    def ref_counts(self) -> dict[int, int]:
        """``{block_id: ref_count}`` of the allocated blocks (a snapshot)."""
        ref = self.pool.ref_cnt
        return {int(b): int(ref[b]) for b in np.flatnonzero(ref)}

    def can_allocate(self, n: int) -> bool:
        return self.num_free >= _check_count("n", n)

    def allocate(self) -> int:
        """One block with ref count 1."""
        return self.allocate_n(1)[0]

    def allocate_n(self, n: int) -> list[int]:
        """``n`` blocks, all or nothing."""
        self._mutable("allocate")
        n = _check_count("n", n)
        with self._lock:
            try:
                return self.pool.allocate(n).tolist()
            except OutOfBlocksError as e:
                raise AllocatorOutOfBlocksError(e.needed, e.free, "allocate") from None

    def free(self, block_id: int) -> None:
        """Drop one reference; the block is free again when none is left."""
        self._mutable("free")
        with self._lock:
            self.pool.free([self._allocated(block_id)])

    def add_ref(self, block_id: int) -> None:
        """Share an allocated block: one more ``free`` is needed to release it."""
        self._mutable("add_ref")
        with self._lock:
            self.pool.touch([self._allocated(block_id)])

    def get_ref_count(self, block_id: int) -> int:
        """References held; 0 for a free block."""
        return int(self.pool.ref_cnt[self._block(block_id)])

    def __repr__(self) -> str:
        return f"BlockAllocator(num_blocks={self.num_blocks}, num_free={self.num_free})"


# ---- block tables -------------------------------------------------------------------
class BlockTable:
    """Logical -> physical block ids of one sequence (a plain list the caller fills)."""

    def __init__(self, block_ids: Sequence[int] = ()):
        self._ids: list[int] = [int(b) for b in block_ids]

    @property
    def table(self) -> list[int]:
        """The block ids (a copy)."""
        return list(self._ids)

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, idx: int) -> int:
        return self.table[idx]

    def __iter__(self) -> Iterator[int]:
        return iter(self.table)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, BlockTable):
            return self.table == other.table
        return NotImplemented

    def append(self, block_id: int) -> None:
        if isinstance(block_id, bool) or not isinstance(block_id, (int, np.integer)) or block_id < 0:
            raise InvalidBlockError(expected("block_id", "a block id >= 0", repr(block_id)))
        self._ids.append(int(block_id))

    def as_tensor(self, device: str | None = None) -> torch.Tensor:
        """int32 tensor of the ids (``device`` defaults to the CPU)."""
        return torch.tensor(self.table, dtype=torch.int32, device=device or "cpu")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.table})"


class _SequenceBlockTable(BlockTable):
    """The live table of a manager's sequence: reads the core's table on every access,
    so the object returned by ``allocate_sequence`` sees later extensions (as in the seed)."""

    def __init__(self, manager: KVCacheManager, seq_id: int):
        self._manager = manager
        self._seq_id = seq_id

    @property
    def table(self) -> list[int]:
        return self._manager.cache.block_table(self._seq_id).tolist()

    def append(self, block_id: int) -> None:
        raise InvalidArgumentError(expected(
            "block_table", "a standalone BlockTable (a sequence's table grows through extend_sequence)",
            f"the live table of sequence {self._seq_id!r}"))

    def as_tensor(self, device: str | None = None) -> torch.Tensor:
        return super().as_tensor(device or self._manager.config.device)


class _Sequences(Mapping[int, _V], Generic[_V]):
    """A live ``{seq_id: ...}`` view of the manager's sequences."""

    def __init__(self, manager: KVCacheManager):
        self._m = manager

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._m.cache

    def __iter__(self) -> Iterator[int]:
        return iter(self._m.cache.sequences())

    def __len__(self) -> int:
        return len(self._m.cache)


class _Tables(_Sequences[BlockTable]):
    """``sequence_tables``: ``{seq_id: BlockTable}``."""

    def __getitem__(self, seq_id: int) -> BlockTable:
        self._m.cache.num_tokens(seq_id)  # SequenceNotFoundError (a KeyError) when unknown
        return _SequenceBlockTable(self._m, seq_id)


class _Lengths(_Sequences[int]):
    """``sequence_lengths``: ``{seq_id: num_tokens}``."""

    def __getitem__(self, seq_id: int) -> int:
        return self._m.cache.num_tokens(seq_id)


# ---- manager ------------------------------------------------------------------------
class KVCacheManager:
    """The seed's high-level manager: per-sequence block tables, slot mapping, stats.

    A sequence's tokens are reserved and committed together (the seed has no separate
    "computed" state), so ``fork_sequence`` shares all of them. ``cache`` is the
    underlying :class:`PagedKVCache` for everything beyond the seed's API (``write``,
    ``gather``, ``block_tables``...).
    """

    def __init__(self, config: CacheConfig):
        if not isinstance(config, CacheConfig):
            raise InvalidArgumentError(expected("config", "a pagedkv.compat.mini_vllm.CacheConfig",
                                                type(config).__name__))
        if torch.device(config.device).type == "cuda" and not torch.cuda.is_available():
            raise DeviceError(expected("config.device", "a device torch can allocate on "
                                       "(torch.cuda.is_available() is False)", repr(config.device)))
        self.config = config
        self.cache = PagedKVCache(config.to_pagedkv())
        self._lock = threading.RLock()
        self.allocator = BlockAllocator._view(
            self.cache.pool, self._lock, "allocate_sequence/extend_sequence/free_sequence/fork_sequence")
        self.sequence_tables: Mapping[int, BlockTable] = _Tables(self)
        self.sequence_lengths: Mapping[int, int] = _Lengths(self)

    @property
    def kv_cache(self) -> torch.Tensor:
        """All layers: ``[num_layers] + config.kv_cache_shape``."""
        return self._store().kv

    def layer_cache(self, layer: int) -> torch.Tensor:
        """One layer's ``config.kv_cache_shape`` view (no copy), what the seed's kernels take."""
        return self._store().layer(layer)

    def _store(self):
        store = self.cache.store
        if store is None:
            raise InvalidArgumentError(expected("allocate_store", "True for KV data operations", False))
        return store

    def _grow(self, seq_id: int, num_tokens: int, what: str) -> None:
        try:
            self.cache.reserve([seq_id], [num_tokens])
        except OutOfBlocksError as e:
            raise AllocatorOutOfBlocksError(e.needed, e.free, what) from None
        self.cache.commit([seq_id], [num_tokens])

    def allocate_sequence(self, seq_id: int, num_tokens: int) -> BlockTable:
        """Blocks for ``num_tokens`` tokens of a new sequence, all or nothing; returns its
        (live) block table."""
        num_tokens = _check_count("num_tokens", num_tokens)
        with self._lock:
            self.cache.add_sequence(seq_id)
            try:
                self._grow(seq_id, num_tokens, "allocate_sequence")
            except BaseException:
                self.cache.free([seq_id])
                raise
        return _SequenceBlockTable(self, seq_id)

    def extend_sequence(self, seq_id: int, additional_tokens: int) -> None:
        """Grow a sequence by ``additional_tokens``; new blocks only at block boundaries."""
        additional_tokens = _check_count("additional_tokens", additional_tokens)
        with self._lock:
            if seq_id not in self.cache:
                raise SequenceNotFoundError(seq_id)
            self._grow(seq_id, additional_tokens, "extend_sequence")

    def fork_sequence(self, src_seq_id: int, dst_seq_id: int) -> BlockTable:
        """``dst`` shares every block of ``src`` (ref counts + 1); the first write into a
        shared partial block copies it (copy-on-write)."""
        with self._lock:
            self.cache.fork(src_seq_id, dst_seq_id)
        return _SequenceBlockTable(self, dst_seq_id)

    def free_sequence(self, seq_id: int) -> None:
        """Release a sequence's blocks; an unknown id is ignored, as in the seed."""
        with self._lock:
            if seq_id in self.cache:
                self.cache.free([seq_id])

    def get_block_table(self, seq_id: int) -> BlockTable:
        return self.sequence_tables[seq_id]

    def get_slot_mapping(self, seq_id: int, start_pos: int, num_tokens: int) -> torch.Tensor:
        """int64 slots ``block_id * block_size + offset`` of positions
        ``[start_pos, start_pos + num_tokens)``, on ``config.device``."""
        slots = self.cache.slot_mapping(seq_id, start_pos, num_tokens)
        return torch.from_numpy(slots).to(self.config.device)

    def get_stats(self) -> dict:
        with self._lock:
            free = self.allocator.num_free
            total = self.config.num_blocks
            return {
                "total_blocks": total,
                "free_blocks": free,
                "used_blocks": total - free,
                "utilization": 1.0 - free / total,
                "num_sequences": len(self.cache),
                "total_memory_gb": self.config.total_memory_gb,
            }

    def __repr__(self) -> str:
        return f"KVCacheManager({self.cache!r})"
