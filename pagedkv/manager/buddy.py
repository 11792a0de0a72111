"""Contiguous mode: a buddy allocator of power-of-two block runs over a shared BlockPool.

A run of order ``k`` is ``2**k`` blocks starting at a multiple of ``2**k``, so a
sequence's KV in a token-major arena is one zero-copy slice. The runs are taken from the
same :class:`~pagedkv._core.pool.BlockPool` that paged mode allocates from
(``BlockPool.take`` of the run's ids) and given back to it on free, so both modes share
one budget of blocks.

Free lists, one set of run starts per order, are *candidates*: paged mode may take a
block of a listed run at any time without telling this allocator. A candidate is
checked by the pool's all-or-nothing ``take`` when it is used; a stale one is split into
its two halves and they are tried instead, so a block paged mode took costs
``O(log n)`` splits once and the rest of the run stays usable. Blocks that paged mode
frees are found by :meth:`BuddyAllocator.refresh` (one ``O(n)`` scan of the pool),
which :meth:`~BuddyAllocator.allocate` runs by itself when no candidate fits.

Costs: finding a run and coalescing on free are ``O(log n)`` set operations; taking and
releasing the run's ``2**k`` blocks in the pool is ``O(2**k)`` (every block's reference
count changes), which no allocator of those blocks can avoid.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from pagedkv._core.pool import BlockPool
from pagedkv.errors import InvalidArgumentError, InvalidBlockError, OutOfBlocksError, expected

__all__ = ["BuddyAllocator", "order_for"]


def order_for(num_blocks: int) -> int:
    """The smallest ``k`` with ``2**k >= num_blocks`` (``num_blocks >= 1``)."""
    return (int(num_blocks) - 1).bit_length()


def _count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise InvalidArgumentError(expected(name, "an int >= 1", repr(value)))
    return int(value)


class BuddyAllocator:
    """Power-of-two runs of blocks of ``pool``, allocated and freed in ``O(log n)``.

    Not thread-safe by itself: callers serialise it with the pool's other users (the
    pool is not thread-safe either).
    """

    def __init__(self, pool: BlockPool):
        if not isinstance(pool, BlockPool):
            raise InvalidArgumentError(expected("pool", "a BlockPool", type(pool).__name__))
        self.pool = pool
        self.max_order = order_for(pool.num_blocks) if pool.num_blocks > 1 else 0
        self._free: list[set[int]] = [set() for _ in range(self.max_order + 1)]
        self._live: dict[int, int] = {}           # start -> order of every run handed out
        self.num_refreshes = 0
        self.refresh()

    # ---- queries -------------------------------------------------------------------
    def order_of(self, start: int) -> int:
        """Order of the live run starting at ``start``."""
        ok = isinstance(start, (int, np.integer)) and not isinstance(start, bool)
        order = self._live.get(int(start) if ok else -1)
        if order is None:
            raise InvalidBlockError(expected("start", "the start of a live run (double free?)", repr(start)))
        return order

    def runs(self) -> dict[int, int]:
        """``{start: num_blocks}`` of the live runs."""
        return {s: 1 << k for s, k in self._live.items()}

    def free_candidates(self) -> dict[int, list[int]]:
        """``{order: sorted starts}`` of the listed free runs (candidates, see module doc)."""
        return {k: sorted(f) for k, f in enumerate(self._free) if f}

    @property
    def num_live_blocks(self) -> int:
        return sum(1 << k for k in self._live.values())

    # ---- allocation ----------------------------------------------------------------
    def allocate(self, num_blocks: int) -> int:
        """Take a run of ``2**order_for(num_blocks)`` blocks; returns its start.

        ``OutOfBlocksError`` (nothing taken) when no aligned run of that size is free.
        """
        k = order_for(_count("num_blocks", num_blocks))
        if k > self.max_order or (1 << k) > self.pool.num_blocks:
            raise OutOfBlocksError(1 << k, self.pool.num_free_blocks, "a contiguous run")
        start = self._take(k)
        if start < 0:
            self.refresh()
            start = self._take(k)
            if start < 0:
                raise OutOfBlocksError(1 << k, self.pool.num_free_blocks, "a contiguous run")
        self._live[start] = k
        return start

    def free(self, start: int) -> None:
        """Give the run starting at ``start`` back to the pool, merging it with its free
        buddies."""
        k = self.order_of(start)
        self.pool.free(np.arange(start, start + (1 << k), dtype=np.int32))
        del self._live[start]
        self._insert(start, k)

    def grow(self, start: int, num_blocks: int,
             copy: Callable[[int, int, int], None] | None = None) -> int:
        """Make the run at ``start`` hold at least ``num_blocks`` blocks; returns its start.

        In place when the run is aligned for the larger order and its buddies are free
        (merged without moving a block); otherwise a new run is allocated,
        ``copy(old_start, new_start, old_num_blocks)`` moves the data, and the old run is
        freed. ``OutOfBlocksError`` leaves the run as it was.
        """
        k = self.order_of(start)
        want = order_for(_count("num_blocks", num_blocks))
        if want <= k:
            return start
        if start % (1 << want) == 0 and self._claim_buddies(start, k, want):
            self._live[start] = want
            return start
        new = self.allocate(1 << want)
        try:
            if copy is not None:
                copy(start, new, 1 << k)
        except BaseException:
            self.free(new)
            raise
        self.free(start)
        return new

    def refresh(self) -> None:
        """Rebuild the free lists from the pool: every free, unpinned block this
        allocator does not hold, in maximal aligned power-of-two runs (``O(n)``)."""
        self.num_refreshes += 1
        n = self.pool.num_blocks
        free = np.zeros(n, dtype=bool)
        free[self.pool.free_block_queue()] = True        # allocatable: pinned blocks excluded
        for f in self._free:
            f.clear()
        for k in range(self.max_order, -1, -1):
            size = 1 << k
            whole = n // size * size
            if not whole:
                continue
            chunks = free[:whole].reshape(-1, size).all(axis=1)
            self._free[k].update((np.flatnonzero(chunks) * size).tolist())
            free[:whole] &= ~np.repeat(chunks, size)      # covered by this order

    # ---- internals -----------------------------------------------------------------
    def _take(self, k: int) -> int:
        """Pop a candidate of order >= k, split down to k, and take it in the pool;
        stale candidates are split until their free parts are found. -1 if none."""
        while True:
            j = next((j for j in range(k, self.max_order + 1) if self._free[j]), -1)
            if j < 0:
                return -1
            start = self._free[j].pop()
            while j > k:                              # split: keep the low half
                j -= 1
                self._free[j].add(start + (1 << j))
            try:
                self.pool.take(np.arange(start, start + (1 << k), dtype=np.int32))
                return start
            except InvalidBlockError:                 # stale: relist the halves with a free block
                if k:
                    ref, h = np.asarray(self.pool.ref_cnt), 1 << (k - 1)
                    self._free[k - 1].update(s for s in (start, start + h) if (ref[s:s + h] == 0).any())

    def _insert(self, start: int, k: int) -> None:
        """List a free run, coalescing with its buddy while the buddy is listed."""
        while k < self.max_order:
            buddy = start ^ (1 << k)
            if buddy not in self._free[k] or buddy + (1 << k) > self.pool.num_blocks:
                break
            self._free[k].remove(buddy)
            start = min(start, buddy)
            k += 1
        self._free[k].add(start)

    def _claim_buddies(self, start: int, k: int, want: int) -> bool:
        """Take the buddies ``start + 2**j`` for ``j`` in ``[k, want)`` if all are listed
        and free in the pool; all or nothing."""
        parts = [(start + (1 << j), j) for j in range(k, want)]
        if start + (1 << want) > self.pool.num_blocks or any(s not in self._free[j] for s, j in parts):
            return False
        ids = np.arange(start + (1 << k), start + (1 << want), dtype=np.int32)
        try:
            self.pool.take(ids)
        except InvalidBlockError:
            return False                              # paged mode holds one: grow by moving
        for s, j in parts:
            self._free[j].remove(s)
        return True

    def __repr__(self) -> str:
        return (f"BuddyAllocator(blocks={self.pool.num_blocks}, runs={len(self._live)}, "
                f"live_blocks={self.num_live_blocks})")
