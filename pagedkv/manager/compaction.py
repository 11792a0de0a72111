"""Compaction plans: which in-use blocks move into which free blocks.

A plan pairs the highest movable blocks with the lowest empty blocks while that lowers
them, so after :meth:`~pagedkv.manager.cache.PagedKVCache.compact` the blocks in use sit at
the bottom of the pool and the free ones form one run at the top (what a contiguous
allocator, or a pool that shrinks, wants).

A block is movable when exactly one sequence holds it (``ref_cnt`` 1): moving a block
that forks share would give the mover a private copy and cost a block. Targets are
empty blocks only, so no cached prefix is evicted to make room; pinned blocks are
never touched. A registered prefix block that moves stays registered where it was (as
a cached-free block, still findable), as after a copy-on-write.
"""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np

__all__ = ["plan_compaction"]


def plan_compaction(pool, tables, keys: Iterable[int]) -> dict[tuple[int, int], np.ndarray]:
    """``{(table, key): int64 [P, 2] (old, new)}`` moves for the sequences ``keys`` of
    each of ``tables`` (a list: one ``BlockTables`` per layer group, all over ``pool``;
    device-resident sequences), over ``pool``'s current state; empty when nothing can
    go lower. A hole goes to one move only, whichever group's block it takes."""
    ref = np.asarray(pool.ref_cnt)
    holes = np.flatnonzero(pool.states() == 0)              # empty blocks, ascending
    if not len(holes):
        return {}
    owners, blocks = [], []
    for g, t in enumerate(tables):
        for k in keys:
            b = t.blocks(k)
            b = b[b >= 0]                                    # a sliding group's released blocks
            b = b[ref[b] == 1]
            owners.append(np.full((len(b), 2), (g, k), dtype=np.int64))
            blocks.append(b.astype(np.int64))
    if not blocks:
        return {}
    owner, block = np.concatenate(owners), np.concatenate(blocks)
    order = np.argsort(block)[::-1]                          # highest first
    n = min(len(order), len(holes))
    owner, block, holes = owner[order[:n]], block[order[:n]], holes[:n]
    lower = holes < block                                    # block descends, hole ascends: a prefix
    owner, block, holes = owner[lower], block[lower], holes[lower]
    plan: dict[tuple[int, int], np.ndarray] = {}
    for g, k in {tuple(o) for o in owner.tolist()}:
        sel = (owner[:, 0] == g) & (owner[:, 1] == k)
        plan[(g, k)] = np.stack([block[sel], holes[sel]], axis=1)
    return dict(sorted(plan.items()))
