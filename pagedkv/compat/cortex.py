"""Seed 002 (CortexStream's ``KVCache`` and ``KVBlockAllocator``) in pagedkv.

CortexStream's design rests on one invariant that paged caches drop on purpose: a
sequence owns ONE contiguous run of blocks, so its K (or V) for a layer is a single
zero-copy tensor view. Two allocators of runs:

- ``allocator="buddy"``: :class:`BuddyBlockAllocator`, pagedkv's
  :class:`~pagedkv.manager.buddy.BuddyAllocator` over a :class:`~pagedkv._core.pool.BlockPool`:
  power-of-two runs, ``O(log n)`` allocate and free, and :meth:`KVCache.grow_for`
  grows a run by merging its free buddies in place, or by moving it (the K/V copied).
  A request's run is its block count rounded up to a power of two.
- ``allocator="first_fit"`` (the default, the seed's own): a bitmap scanned first fit,
  ``O(total_blocks)`` per allocation as the seed states, runs of exactly the blocks
  asked for. It stays the default because the seed promises that: a pool of 10
  blocks serves one 10-block request, which power-of-two runs cannot.

Sizes and validation come from :class:`pagedkv.CacheConfig`.

Memory layout. The seed's arena ``[layers, blocks, heads, block_size, head_dim]`` cannot
give the promised ``[heads, tokens, head_dim]`` view once a run spans two blocks (the
next token of a head lies a whole block of other heads further on). The arena here is
per layer and head, token-major:

    K, V: [num_layers, num_heads, total_blocks * block_size, head_dim]

so block ``b`` holds tokens ``[b * block_size, (b + 1) * block_size)`` of every
(layer, head) row, and a run ``[start, start + n)`` is one strided slice:
``K[layer, :, start * block_size : start * block_size + used, :]``.

Writing a token: ``append_token`` claims the next position, after which
``get_k_view(...)[:, -1]`` is that token's K (write into it; no copy is made).

Fragmentation (the seed promised "no fragmentation", but freeing runs does leave
holes) is defined as ``1 - largest free run / free blocks``: 0.0 when the free blocks
form one run (or none is free), approaching 1.0 when they are scattered.
"""
from __future__ import annotations

import sys
import threading
from collections.abc import Hashable
from dataclasses import dataclass
from typing import TextIO

import numpy as np
import torch

from pagedkv._core.pool import BlockPool
from pagedkv.config.options import CacheConfig
from pagedkv.errors import (
    InvalidArgumentError,
    InvalidBlockError,
    OutOfBlocksError,
    SequenceExistsError,
    SequenceNotFoundError,
    expected,
)
from pagedkv.manager.buddy import BuddyAllocator

__all__ = ["KVHandle", "INVALID_HANDLE", "KVBlockAllocator", "BuddyBlockAllocator", "KVCache"]


@dataclass(frozen=True)
class KVHandle:
    """A run of ``num_blocks`` contiguous blocks starting at ``start_block_index``."""

    start_block_index: int = -1
    num_blocks: int = 0

    @property
    def is_valid(self) -> bool:
        return self.start_block_index >= 0 and self.num_blocks > 0

    @property
    def end_block_index(self) -> int:
        """One past the last block of the run."""
        return self.start_block_index + self.num_blocks


INVALID_HANDLE = KVHandle()


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise InvalidArgumentError(expected(name, f"an int >= {minimum}", repr(value)))
    return int(value)


def _request(request_id: object) -> Hashable:
    try:
        hash(request_id)
    except TypeError:
        raise InvalidArgumentError(expected("request_id", "a hashable id", type(request_id).__name__)) from None
    return request_id


def _free_runs(used: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Starts and lengths of the maximal runs of free blocks, in block order."""
    edges = np.diff(np.concatenate(([0], (~used).view(np.int8), [0])))
    starts = np.flatnonzero(edges == 1)
    return starts, np.flatnonzero(edges == -1) - starts


class KVBlockAllocator:
    """Hands out contiguous block runs, first fit; knows nothing of sequences."""

    def __init__(self, total_blocks: int):
        total_blocks = _check_int("total_blocks", total_blocks, 1)
        self._used = np.zeros(total_blocks, dtype=bool)
        self._runs: dict[int, int] = {}     # start -> num_blocks of every live handle
        self._lock = threading.Lock()

    def allocate(self, blocks_needed: int) -> KVHandle:
        """The first free run of ``blocks_needed`` blocks, or :data:`INVALID_HANDLE`
        (fail fast: nothing is allocated partially)."""
        n = _check_int("blocks_needed", blocks_needed, 1)
        with self._lock:
            starts, lengths = _free_runs(self._used)
            fits = np.flatnonzero(lengths >= n)
            if not len(fits):
                return INVALID_HANDLE
            start = int(starts[fits[0]])
            self._used[start:start + n] = True
            self._runs[start] = n
            return KVHandle(start, n)

    def free(self, handle: KVHandle) -> None:
        """Release a run returned by :meth:`allocate` (exactly once)."""
        if not isinstance(handle, KVHandle):
            raise InvalidArgumentError(expected("handle", "a KVHandle", type(handle).__name__))
        with self._lock:
            if not handle.is_valid or self._runs.get(handle.start_block_index) != handle.num_blocks:
                raise InvalidBlockError(expected("handle", "a live handle from allocate() (double free?)", handle))
            del self._runs[handle.start_block_index]
            self._used[handle.start_block_index:handle.end_block_index] = False

    def free_blocks(self) -> int:
        return int(self._used.size - np.count_nonzero(self._used))

    def used_blocks(self) -> int:
        return int(np.count_nonzero(self._used))

    def total_blocks(self) -> int:
        return int(self._used.size)

    def largest_free_run(self) -> int:
        with self._lock:
            _, lengths = _free_runs(self._used)
        return int(lengths.max()) if len(lengths) else 0

    def fragmentation(self) -> float:
        """``1 - largest free run / free blocks``; 0.0 with no free block."""
        with self._lock:
            _, lengths = _free_runs(self._used)
        free = int(lengths.sum())
        return 1.0 - int(lengths.max()) / free if free else 0.0

    def block_map(self, width: int = 64) -> str:
        """The seed's debug dump as a string (``.`` free, ``X`` used)."""
        width = _check_int("width", width, 1)
        with self._lock:
            used = self._used.copy()
        cells = np.where(used, ord("X"), ord(".")).astype(np.uint8).tobytes().decode()
        lines = ["KVBlockAllocator State:",
                 f"  Total blocks: {used.size}",
                 f"  Used: {int(used.sum())} Free: {int(used.size - used.sum())}",
                 f"  Fragmentation: {self.fragmentation():.2f}",
                 "  Block map (. = free, X = used):"]
        lines += ["    " + cells[i:i + width] for i in range(0, len(cells), width)]
        return "\n".join(lines) + "\n"

    def dump_block_map(self, stream: TextIO | None = None) -> None:
        (stream or sys.stdout).write(self.block_map())

    def __repr__(self) -> str:
        return f"KVBlockAllocator(total={self.total_blocks()}, used={self.used_blocks()})"


class BuddyBlockAllocator(KVBlockAllocator):
    """:class:`KVBlockAllocator`'s interface on pagedkv's buddy allocator: runs of
    ``2**k`` blocks from a :class:`~pagedkv._core.pool.BlockPool` (``self.pool``), so a
    handle's ``num_blocks`` is the run's power-of-two size."""

    def __init__(self, total_blocks: int):
        total_blocks = _check_int("total_blocks", total_blocks, 1)
        self.pool = BlockPool(total_blocks)
        self.buddy = BuddyAllocator(self.pool)
        self._lock = threading.Lock()

    @property
    def _used(self) -> np.ndarray:  # type: ignore[override]  # the base's bitmap, derived from the pool here
        return np.asarray(self.pool.ref_cnt) > 0

    def allocate(self, blocks_needed: int) -> KVHandle:
        """A free aligned run of ``2**ceil(log2(blocks_needed))`` blocks, or
        :data:`INVALID_HANDLE` (nothing allocated)."""
        n = _check_int("blocks_needed", blocks_needed, 1)
        with self._lock:
            try:
                start = self.buddy.allocate(n)
            except OutOfBlocksError:
                return INVALID_HANDLE
            return KVHandle(start, 1 << self.buddy.order_of(start))

    def grow(self, handle: KVHandle, blocks_needed: int, copy) -> KVHandle:
        """The run of ``handle`` grown to hold ``blocks_needed`` blocks (in place, or
        moved with ``copy(old_start, new_start, num_blocks)``); :data:`INVALID_HANDLE`
        and nothing changed when no run fits."""
        n = _check_int("blocks_needed", blocks_needed, 1)
        with self._lock:
            self._check_live(handle)
            try:
                start = self.buddy.grow(handle.start_block_index, n, copy)
            except OutOfBlocksError:
                return INVALID_HANDLE
            return KVHandle(start, 1 << self.buddy.order_of(start))

    def free(self, handle: KVHandle) -> None:
        with self._lock:
            self._check_live(handle)
            self.buddy.free(handle.start_block_index)

    def _check_live(self, handle: object) -> None:
        if not isinstance(handle, KVHandle):
            raise InvalidArgumentError(expected("handle", "a KVHandle", type(handle).__name__))
        try:
            size = 1 << self.buddy.order_of(handle.start_block_index)
        except InvalidBlockError:
            size = 0
        if not handle.is_valid or size != handle.num_blocks:
            raise InvalidBlockError(expected("handle", "a live handle from allocate() (double free?)", handle))

    def __repr__(self) -> str:
        return f"BuddyBlockAllocator(total={self.total_blocks()}, used={self.used_blocks()})"


@dataclass
class _Entry:
    handle: KVHandle
    tokens_used: int
    max_allowed: int


class KVCache:
    """Sequences -> contiguous block runs, with zero-copy K/V views (see module docstring).

    Args:
        num_layers, num_heads, head_dim, block_size: the model and block shape.
        max_total_tokens: arena capacity; ``max_total_tokens // block_size`` blocks.
        dtype, device: of the arena (validated as :class:`pagedkv.CacheConfig` does).
        allocator: ``"first_fit"`` (the seed's) or ``"buddy"`` (see the module docstring).
    """

    def __init__(self, num_layers: int, num_heads: int, head_dim: int, block_size: int,
                 max_total_tokens: int, *, dtype="float16", device="cpu", allocator: str = "first_fit"):
        if allocator not in ("first_fit", "buddy"):
            raise InvalidArgumentError(expected("allocator", "'first_fit' or 'buddy'", repr(allocator)))
        block_size = _check_int("block_size", block_size, 1)
        total = _check_int("max_total_tokens", max_total_tokens, block_size) // block_size
        self.config = CacheConfig(num_layers=num_layers, num_kv_heads=num_heads, head_dim=head_dim,
                                  block_size=block_size, num_blocks=total, dtype=dtype, device=device,
                                  enable_prefix_caching=False)
        c = self.config
        shape = (c.num_layers, c.num_kv_heads, total * block_size, c.head_dim)
        self.k = torch.zeros(shape, dtype=c.torch_dtype, device=c.device)
        self.v = torch.zeros(shape, dtype=c.torch_dtype, device=c.device)
        self.allocator = KVBlockAllocator(total) if allocator == "first_fit" else BuddyBlockAllocator(total)
        self._sequences: dict[Hashable, _Entry] = {}
        self._lock = threading.RLock()

    @classmethod
    def from_config(cls, config: CacheConfig, allocator: str = "first_fit") -> KVCache:
        """A cache with the shape, block count, dtype and device of a pagedkv config."""
        if not isinstance(config, CacheConfig):
            raise InvalidArgumentError(expected("config", "a CacheConfig", type(config).__name__))
        return cls(config.num_layers, config.num_kv_heads, config.head_dim, config.block_size,
                   config.num_slots, dtype=config.dtype, device=config.device, allocator=allocator)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    # ---- lifecycle -------------------------------------------------------------------
    def allocate_for(self, request_id: Hashable, initial_tokens: int) -> bool:
        """One run for ``initial_tokens`` tokens; False (nothing allocated) when no run fits."""
        request_id = _request(request_id)
        initial_tokens = _check_int("initial_tokens", initial_tokens, 1)
        blocks = -(-initial_tokens // self.block_size)
        with self._lock:
            if request_id in self._sequences:
                raise SequenceExistsError(request_id, "request_id")
            handle = self.allocator.allocate(blocks)
            if not handle.is_valid:
                return False
            self._sequences[request_id] = _Entry(handle, initial_tokens, blocks * self.block_size)
            return True

    def free_for(self, request_id: Hashable) -> bool:
        """Release a request's run; False for an unknown request."""
        request_id = _request(request_id)
        with self._lock:
            entry = self._sequences.pop(request_id, None)
            if entry is None:
                return False
            self.allocator.free(entry.handle)
            return True

    def grow_for(self, request_id: Hashable, max_tokens: int) -> bool:
        """Raise the request's capacity to ``max_tokens`` (``allocator="buddy"`` only).

        The run grows in place when its buddies are free; otherwise it moves to a new
        run and its K/V (every layer and head) are copied, so views taken before are
        stale. False (nothing changed) when no run of the new size is free.
        """
        request_id = _request(request_id)
        max_tokens = _check_int("max_tokens", max_tokens, 1)
        if not isinstance(self.allocator, BuddyBlockAllocator):
            raise InvalidArgumentError(expected("allocator", "'buddy' for grow_for", "'first_fit'"))
        with self._lock:
            e = self._entry(request_id)
            if max_tokens <= e.max_allowed:
                return True
            blocks = -(-max_tokens // self.block_size)
            handle = self.allocator.grow(e.handle, blocks, self._copy_run)
            if not handle.is_valid:
                return False
            e.handle, e.max_allowed = handle, blocks * self.block_size
            return True

    def _copy_run(self, old: int, new: int, num_blocks: int) -> None:
        bs = self.block_size
        for arena in (self.k, self.v):
            arena[:, :, new * bs:(new + num_blocks) * bs] = arena[:, :, old * bs:(old + num_blocks) * bs]

    def _entry(self, request_id: Hashable) -> _Entry:
        entry = self._sequences.get(_request(request_id))
        if entry is None:
            raise SequenceNotFoundError(request_id, "request_id")
        return entry

    # ---- views -----------------------------------------------------------------------
    def _view(self, arena: torch.Tensor, request_id: Hashable, layer: int) -> torch.Tensor:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.config.num_layers:
            raise InvalidArgumentError(expected("layer", f"an int in [0, {self.config.num_layers})", repr(layer)))
        with self._lock:
            e = self._entry(request_id)
            first = e.handle.start_block_index * self.block_size
            return arena[layer, :, first:first + e.tokens_used]

    def get_k_view(self, request_id: Hashable, layer: int) -> torch.Tensor:
        """K of the request's used tokens, ``[num_heads, used_tokens, head_dim]``, a view
        of the arena (writes go to the cache). Valid until the request is freed."""
        return self._view(self.k, request_id, layer)

    def get_v_view(self, request_id: Hashable, layer: int) -> torch.Tensor:
        """V, as :meth:`get_k_view`."""
        return self._view(self.v, request_id, layer)

    # ---- tokens ----------------------------------------------------------------------
    def used_tokens(self, request_id: Hashable) -> int:
        with self._lock:
            return self._entry(request_id).tokens_used

    def capacity(self, request_id: Hashable) -> int:
        """Tokens the request's run can hold."""
        with self._lock:
            return self._entry(request_id).max_allowed

    def append_token(self, request_id: Hashable) -> bool:
        """Claim the next position; False when the run is full (the seed's fail-fast)."""
        with self._lock:
            e = self._entry(request_id)
            if e.tokens_used >= e.max_allowed:
                return False
            e.tokens_used += 1
            return True

    def get_token_offset_in_block(self, request_id: Hashable) -> int:
        """Offset inside its block of position ``used_tokens``: where the next appended
        token goes (the seed's ``tokensUsed % blockSize``)."""
        return self.used_tokens(request_id) % self.block_size

    # ---- monitoring ------------------------------------------------------------------
    def get_total_allocated(self) -> int:
        """Bytes of the allocated blocks (K and V, all layers)."""
        return self.allocator.used_blocks() * self.config.bytes_per_block

    def get_total_free(self) -> int:
        return self.allocator.free_blocks() * self.config.bytes_per_block

    def get_num_allocated_sequences(self) -> int:
        return len(self._sequences)

    def is_full(self) -> bool:
        """True when no block is free."""
        return self.allocator.free_blocks() == 0

    def get_fragmentation(self) -> float:
        return self.allocator.fragmentation()

    def cache_stats(self) -> str:
        """The seed's statistics dump as a string."""
        c, mib = self.config, 1024.0 ** 2
        with self._lock:
            lines = ["=== KVCache Statistics ===", "Configuration:",
                     f"  Layers: {c.num_layers}, Heads: {c.num_kv_heads}, HeadDim: {c.head_dim}",
                     f"  BlockSize: {c.block_size}, TotalBlocks: {c.num_blocks}", "",
                     "Allocation State:",
                     f"  Allocated sequences: {len(self._sequences)}",
                     f"  Total allocated: {self.get_total_allocated() / mib:.2f} MB",
                     f"  Total free: {self.get_total_free() / mib:.2f} MB",
                     f"  Fragmentation: {self.get_fragmentation():.2f}", "", "Sequences:"]
            for rid, e in self._sequences.items():
                lines.append(f"  {rid}: {e.tokens_used}/{e.max_allowed} tokens, "
                             f"blocks [{e.handle.start_block_index}, +{e.handle.num_blocks}]")
        return "\n".join(lines) + "\n"

    def dump_cache_stats(self, stream: TextIO | None = None) -> None:
        (stream or sys.stdout).write(self.cache_stats())

    def __repr__(self) -> str:
        c = self.config
        return (f"KVCache(layers={c.num_layers}, heads={c.num_kv_heads}, head_dim={c.head_dim}, "
                f"blocks={self.allocator.used_blocks()}/{c.num_blocks}x{c.block_size}, "
                f"sequences={len(self._sequences)})")
