"""Seed 001 (``KVCacheBlockManager``) on pagedkv.

Blocks are allocated one at a time or in atomic batches for integer sequence ids, and
any single block can be freed again, so a sequence's blocks are an unordered set, not
an append-only table. That rules out :class:`~pagedkv.manager.cache.PagedKVCache`'s block
tables; the manager sits directly on a :class:`~pagedkv._core.pool.BlockPool` (the
allocator: ref counts, free queue, counters) and a :class:`~pagedkv.store.kvstore.KVStore`
(the tensors), and keeps only the sequence -> blocks map itself.

No tensor is allocated per block. The seed created two ``[num_layers, num_heads,
block_size, head_dim]`` tensors per allocated block and disposed of them on free; here
the store allocates one arena at construction (HND layout, so one block's K of all
layers is exactly that shape) and :class:`MemoryBlock` hands out strided views into
it. What the seed's per-block tensors guaranteed is kept: a newly allocated block
reads as zeros, and the views of a freed block stop working (they raise instead of
aliasing the block's next owner).

Differences from the seed, each a seed bug or a stated requirement:

- freeing a block that is not allocated is a no-op (the seed's "graceful" path), but
  the seed also left it in its block map, so a second free enqueued it twice; ids out
  of range and sequence ids that are not ints >= 0 raise typed errors ("validation of
  sequence and block ids");
- ``allocate_blocks`` is all or nothing in one pool call, so concurrent callers never
  see a half-made batch (the seed allocated one by one and rolled back);
- ``dispose()`` returns every block and drops the arena; allocating afterwards raises.

Thread safety: one re-entrant lock serialises every call.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from pagedkv._core.pool import BlockPool
from pagedkv.config.options import CacheConfig
from pagedkv.errors import InternalError, InvalidArgumentError, InvalidBlockError, OutOfBlocksError, expected

__all__ = ["BlockAllocationResult", "BlockManagerStats", "MemoryBlock", "KVCacheBlockManager"]

NO_FREE_BLOCKS = "No free blocks available"


@dataclass(frozen=True)
class BlockAllocationResult:
    """Outcome of :meth:`KVCacheBlockManager.allocate_block`; ``block_id`` is -1 on failure."""

    success: bool
    block_id: int = -1
    error: str | None = None

    @classmethod
    def successful(cls, block_id: int) -> BlockAllocationResult:
        return cls(True, block_id)

    @classmethod
    def failed(cls, error: str) -> BlockAllocationResult:
        return cls(False, -1, error)


@dataclass(frozen=True)
class BlockManagerStats:
    total_blocks: int
    allocated_blocks: int
    active_sequences: int                 # sequences holding at least one block
    total_tokens: int                     # sum of the allocated blocks' token_count
    memory_utilization_percentage: float  # allocated / total * 100
    allocation_count: int                 # blocks handed out, ever
    deallocation_count: int               # blocks returned, ever


class MemoryBlock:
    """One allocated block, as the seed's ``MemoryBlock``: ids, a token count, and its
    K/V as views ``[num_layers, num_heads, block_size, head_dim]`` into the shared
    arena (no copy, no tensor of its own). Once the block is freed the object is stale:
    ``is_allocated`` is False and every accessor raises :class:`InvalidBlockError`."""

    __slots__ = ("_manager", "block_id", "block_size", "sequence_id", "_generation")

    def __init__(self, manager: KVCacheBlockManager, block_id: int, sequence_id: int, generation: int):
        self._manager = manager
        self.block_id = block_id
        self.block_size = manager.block_size
        self.sequence_id = sequence_id
        self._generation = generation

    @property
    def is_allocated(self) -> bool:
        return self._manager._generation[self.block_id] == self._generation

    def _live(self) -> None:
        if not self.is_allocated:
            raise InvalidBlockError(expected("block", "an allocated block",
                                             f"block {self.block_id}, freed since this view was taken"))

    @property
    def token_count(self) -> int:
        """Tokens stored in the block (the caller sets it as it writes)."""
        self._live()
        return int(self._manager._tokens[self.block_id])

    @token_count.setter
    def token_count(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value <= self.block_size:
            raise InvalidArgumentError(expected("token_count", f"an int in [0, {self.block_size}]", repr(value)))
        with self._manager._lock:
            self._live()
            self._manager._tokens[self.block_id] = value

    def _tensor(self, kv: int):
        self._live()
        return self._manager._arena()[:, self.block_id, kv]

    @property
    def key_tensor(self):
        """K of every layer, ``[num_layers, num_heads, block_size, head_dim]`` (a view)."""
        return self._tensor(0)

    @property
    def value_tensor(self):
        """V of every layer, ``[num_layers, num_heads, block_size, head_dim]`` (a view)."""
        return self._tensor(1)

    def __repr__(self) -> str:
        state = "allocated" if self.is_allocated else "stale"
        return f"MemoryBlock(block_id={self.block_id}, sequence_id={self.sequence_id}, {state})"


def _check_id(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise InvalidArgumentError(expected(name, "an int >= 0", repr(value)))
    return int(value)


class KVCacheBlockManager:
    """Allocates KV blocks to sequences (see the module docstring).

    Args:
        total_blocks, block_size, head_dim, num_layers, num_attention_heads, device:
            as in the seed (K/V hold ``num_attention_heads`` heads).
        dtype: element type of the arena.
        allocate_tensors: ``False`` keeps the bookkeeping only (no arena; block views
            then raise).
    """

    def __init__(self, total_blocks: int, block_size: int, head_dim: int, num_layers: int,
                 num_attention_heads: int, device: str = "cpu", *, dtype="float16",
                 allocate_tensors: bool = True):
        self.config = CacheConfig(num_layers=num_layers, num_kv_heads=num_attention_heads, head_dim=head_dim,
                                  block_size=block_size, num_blocks=total_blocks, dtype=dtype, device=device,
                                  layout="HND", enable_prefix_caching=False)
        self.pool = BlockPool(self.config.resolved_num_blocks)
        self._store = None
        if allocate_tensors:
            from pagedkv.store.kvstore import KVStore

            self._store = KVStore(self.config)
        self._lock = threading.RLock()
        self._sequence_blocks: dict[int, list[int]] = {}
        nb = self.config.resolved_num_blocks
        self._owner = np.full(nb, -1, dtype=np.int64)       # sequence holding the block; -1 free
        self._tokens = np.zeros(nb, dtype=np.int32)          # token_count per block
        self._generation = np.zeros(nb, dtype=np.int64)      # bumped on free: stale MemoryBlocks
        self._disposed = False

    # ---- properties -----------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def total_blocks(self) -> int:
        return self.config.resolved_num_blocks

    @property
    def allocated_blocks(self) -> int:
        return self.pool.num_in_use_blocks

    def _arena(self):
        if self._store is None:
            reason = "disposed" if self._disposed else "allocate_tensors=False"
            raise InvalidArgumentError(expected("manager", "a manager with block tensors", f"one without ({reason})"))
        return self._store.kv   # HND: [num_layers, num_blocks, 2, heads, block_size, head_dim]

    def _block_id(self, block_id: object) -> int:
        if isinstance(block_id, bool) or not isinstance(block_id, (int, np.integer)) \
                or not 0 <= block_id < self.total_blocks:
            raise InvalidBlockError(expected("block_id", f"a block id in [0, {self.total_blocks})", repr(block_id)))
        return int(block_id)

    # ---- allocation -------------------------------------------------------------------
    def _take(self, sequence_id: int, count: int) -> list[int] | None:
        """``count`` blocks for ``sequence_id`` in one pool call; None when out of blocks."""
        if self._disposed:
            raise InvalidArgumentError(expected("manager", "a live KVCacheBlockManager", "one that was disposed"))
        try:
            blocks = self.pool.allocate(count)
        except OutOfBlocksError:
            return None
        self._owner[blocks] = sequence_id
        self._tokens[blocks] = 0
        if self._store is not None and count:
            self._store.kv[:, blocks] = 0   # a new block reads as zeros, as the seed's fresh tensors did
        ids = blocks.tolist()
        self._sequence_blocks.setdefault(sequence_id, []).extend(ids)
        return ids

    def allocate_block(self, sequence_id: int) -> BlockAllocationResult:
        """One block for ``sequence_id``; a failed result (not an exception) when none is free."""
        sequence_id = _check_id("sequence_id", sequence_id)
        with self._lock:
            ids = self._take(sequence_id, 1)
        return BlockAllocationResult.failed(NO_FREE_BLOCKS) if ids is None else BlockAllocationResult.successful(ids[0])

    def allocate_blocks(self, sequence_id: int, count: int) -> list[int]:
        """``count`` blocks, all or nothing: their ids, or ``[]`` when not enough are free."""
        sequence_id = _check_id("sequence_id", sequence_id)
        count = _check_id("count", count)
        if count == 0:
            return []
        with self._lock:
            return self._take(sequence_id, count) or []

    # ---- release ------------------------------------------------------------------------
    def _release(self, blocks: list[int]) -> None:
        self.pool.free(blocks)
        self._owner[blocks] = -1
        self._tokens[blocks] = 0
        self._generation[blocks] += 1

    def free_block(self, block_id: int) -> bool:
        """Return one block to the pool; False (and nothing done) if it was not allocated."""
        b = self._block_id(block_id)
        with self._lock:
            seq = int(self._owner[b])
            if seq < 0:
                return False
            owned = self._sequence_blocks[seq]
            owned.remove(b)
            if not owned:
                del self._sequence_blocks[seq]
            self._release([b])
            return True

    def free_sequence_blocks(self, sequence_id: int) -> int:
        """Return every block of a sequence; the number freed (0 for an unknown sequence)."""
        sequence_id = _check_id("sequence_id", sequence_id)
        with self._lock:
            blocks = self._sequence_blocks.pop(sequence_id, None)
            if not blocks:
                return 0
            self._release(blocks)
            return len(blocks)

    def dispose(self) -> None:
        """Return every block and drop the arena; the manager cannot allocate afterwards."""
        with self._lock:
            held = [b for blocks in self._sequence_blocks.values() for b in blocks]
            if held:
                self._release(held)
            self._sequence_blocks.clear()
            self._store = None
            self._disposed = True

    def __enter__(self) -> KVCacheBlockManager:
        return self

    def __exit__(self, *exc) -> None:
        self.dispose()

    # ---- queries -------------------------------------------------------------------------
    def get_sequence_blocks(self, sequence_id: int) -> list[int]:
        """The sequence's block ids in allocation order (a copy; ``[]`` when unknown)."""
        sequence_id = _check_id("sequence_id", sequence_id)
        with self._lock:
            return list(self._sequence_blocks.get(sequence_id, ()))

    def get_block(self, block_id: int) -> MemoryBlock | None:
        """A view of an allocated block, or None when the block is free."""
        b = self._block_id(block_id)
        with self._lock:
            seq = int(self._owner[b])
            return None if seq < 0 else MemoryBlock(self, b, seq, int(self._generation[b]))

    def has_available_blocks(self, count: int = 1) -> bool:
        return self.pool.num_free_blocks >= _check_id("count", count)

    def get_stats(self) -> BlockManagerStats:
        with self._lock:
            allocated = self.pool.num_in_use_blocks
            return BlockManagerStats(
                total_blocks=self.total_blocks,
                allocated_blocks=allocated,
                active_sequences=len(self._sequence_blocks),
                total_tokens=int(self._tokens.sum()),
                memory_utilization_percentage=allocated * 100.0 / self.total_blocks,
                allocation_count=self.pool.num_allocations,
                deallocation_count=self.pool.num_frees,
            )

    def check_invariants(self) -> None:
        """Audit: every allocated block belongs to exactly one sequence; raises InternalError."""
        with self._lock:
            self.pool.check_invariants()
            held = np.zeros(self.total_blocks, dtype=np.int64)
            for seq, blocks in self._sequence_blocks.items():
                if not blocks:
                    raise InternalError(f"sequence {seq} is listed with no blocks")
                np.add.at(held, blocks, 1)
                if (self._owner[blocks] != seq).any():
                    raise InternalError(f"sequence {seq} lists a block it does not own")
            ref = np.asarray(self.pool.ref_cnt, dtype=np.int64)
            if not np.array_equal(held, ref) or not np.array_equal(held > 0, self._owner >= 0):
                bad = int(np.flatnonzero((held != ref) | ((held > 0) != (self._owner >= 0)))[0])
                raise InternalError(f"block {bad}: ref_cnt {ref[bad]}, owner {self._owner[bad]}, "
                                    f"but sequences hold {held[bad]} references")
            if (self._tokens[self._owner < 0] != 0).any():
                raise InternalError("a free block has a non-zero token_count")

    def __repr__(self) -> str:
        c = self.config
        return (f"KVCacheBlockManager(blocks={self.allocated_blocks}/{c.num_blocks}x{c.block_size}, "
                f"layers={c.num_layers}, heads={c.num_kv_heads}, head_dim={c.head_dim}, "
                f"sequences={len(self._sequence_blocks)})")
