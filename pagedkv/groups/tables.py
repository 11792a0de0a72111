"""Block tables per layer group, over the one shared pool (see :mod:`pagedkv.groups.layers`).

A cache whose model mixes full-attention and sliding-window layers keeps one
:class:`~pagedkv._core.tables.BlockTables` per layer group: a full group keeps every
block, a sliding group releases the blocks that left its window. Every sequence lives
in all groups with the same token counts; only the blocks differ. Each call here
applies one manager operation to every group, all or nothing:

- capacity is counted over all groups before any reserves (``blocks_needed``), so a
  reserve that fails changes nothing;
- validation is the same in every group (same rows, same counts, same known token
  ids), so the first group's checks stand for all, except truncation, which a sliding
  group refuses once the window it would need is gone: every group checks first.

Prefix caching: each group registers its blocks under its own namespace (a block
holds only its group's layers, so a hit in another group's block would read the wrong
layers). An admission reuses the longest prefix *every* group holds; the group that
held the least is reported as the limit.
"""
from __future__ import annotations

import struct

import numpy as np

from pagedkv._core.prefix import hash_bytes
from pagedkv._core.tables import BlockTables
from pagedkv.errors import InternalError, InvalidArgumentError, InvalidBlockError, OutOfBlocksError, expected
from pagedkv.groups.layers import GroupPlan

__all__ = ["GroupTables", "GroupNamespaces", "GROUP_NS_BITS", "group_key"]

GROUP_NS_BITS = 24     # namespace ids below 2**24; the group index goes above them


def group_key(nkey: bytes, group: int) -> bytes:
    """The process-independent key of a cache namespace's layer-group namespace (what
    a prefix tier files group ``group``'s blocks under; group 0 keeps the cache's key)."""
    return nkey if group == 0 else nkey + b"\x00layer-group:" + str(group).encode()


class GroupNamespaces:
    """The namespace registry as the prefix tiers see it with layer groups: a device
    namespace id carries its group above ``GROUP_NS_BITS``, and each group's blocks are
    filed under :func:`group_key`, whose hash seed is the group's device seed, so tier
    chains and device chains hash alike."""

    def __init__(self, registry):
        self.registry = registry

    @staticmethod
    def split(ns_id: int) -> tuple[int, int]:
        return ns_id & ((1 << GROUP_NS_BITS) - 1), ns_id >> GROUP_NS_BITS

    def key_of(self, ns_id: int) -> bytes:
        base, g = self.split(ns_id)
        return group_key(self.registry.key_of(base), g)

    def name(self, ns_id: int):
        return self.registry.name(self.split(ns_id)[0])

    def _parse(self, nkey: bytes) -> tuple[bytes, int]:
        base, sep, g = nkey.rpartition(b"\x00layer-group:")
        return (base, int(g)) if sep and g.isdigit() else (nkey, 0)

    def hash_of_key(self, nkey: bytes) -> int:
        base, g = self._parse(nkey)
        h = self.registry.hash_of_key(base)
        return h if g == 0 else hash_bytes(struct.pack("<QQ", h, g))

    def name_of_key(self, nkey: bytes):
        return self.registry.name_of_key(self._parse(nkey)[0])


class GroupTables:
    """The tables of every layer group; ``tables[0]`` is the manager's own ``tables``.

    The lifecycle calls take the arguments of the same ``BlockTables`` calls, so the
    manager drives either through one code path."""

    def __init__(self, pool, index, block_size: int, plan: GroupPlan, namer):
        self.plan = plan
        self.pool = pool
        self.index = index
        self.block_size = block_size
        self.tables: list[BlockTables] = []
        for g in plan.groups:
            t = BlockTables(pool, block_size, index, window=g.window, sinks=g.sinks)
            t.namer = namer
            self.tables.append(t)
        self.limited_by = [0] * len(plan.groups)   # admissions whose hit each group limited

    # ---- namespaces ------------------------------------------------------------------
    def namespace(self, group: int, ns_id: int, ns_hash: int) -> tuple[int, int]:
        """The group's own prefix namespace for a cache namespace (group 0: the same)."""
        if group == 0:
            return ns_id, ns_hash
        if ns_id >= 1 << GROUP_NS_BITS:
            raise InvalidArgumentError(expected("cache_salt, adapter_id", f"fewer than 2**{GROUP_NS_BITS} "
                                                "namespaces with layer groups", f"namespace id {ns_id}"))
        return ns_id | (group << GROUP_NS_BITS), hash_bytes(struct.pack("<QQ", ns_hash, group))

    def prefix_hits(self, tokens: np.ndarray, ns_id: int, ns_hash: int) -> list[int]:
        """Cached full blocks of ``tokens`` per group (pure query)."""
        if self.index is None:
            return [0] * len(self.tables)
        return [len(self.index.match(tokens, *self.namespace(g, ns_id, ns_hash))) for g in range(len(self.tables))]

    def match(self, tokens: np.ndarray, ns_id: int, ns_hash: int) -> dict:
        """What an admission of ``tokens`` would reuse now: ``tokens`` (the longest
        prefix every group holds), ``per_group`` (tokens each group holds) and
        ``limited_by`` (the group holding the least; None when all hold the same)."""
        hits = [h * self.block_size for h in self.prefix_hits(tokens, ns_id, ns_hash)]
        least = min(hits)
        return {"tokens": least, "per_group": hits,
                "limited_by": None if hits.count(least) == len(hits) else hits.index(least)}

    def blocks_to_admit(self, tokens: np.ndarray, total: int, ns_id: int, ns_hash: int) -> int:
        """Free blocks an admission of ``tokens`` then a reserve up to ``total`` tokens
        takes, over all groups (see ``PagedKVCache.blocks_to_admit``)."""
        bs = self.block_size
        cap = max(0, (len(tokens) - 1) // bs)
        per = []
        for g in range(len(self.tables)):
            per.append(self.index.match(tokens, *self.namespace(g, ns_id, ns_hash))[:cap]
                       if self.index is not None else np.empty(0, np.int32))
        h = min(len(b) for b in per)
        ref = self.pool.ref_cnt
        need = 0
        for blocks in per:
            hit = blocks[:h]
            revived = sum(1 for b in hit[ref[hit] == 0].tolist() if not self.pool.pin_count(b))
            need += -(-total // bs) - h + revived
        return need

    # ---- lifecycle -------------------------------------------------------------------
    def add(self, key: int, tokens: np.ndarray | None = None, ns_id: int = 0, ns_hash: int = 0,
            priority: int = -1, max_hit_blocks: int | None = None) -> int:
        cap = max_hit_blocks
        if self.index is not None and tokens is not None and len(tokens):
            hits = self.prefix_hits(tokens, ns_id, ns_hash)
            least = min(hits)
            limit = min((len(tokens) - 1) // self.block_size, cap if cap is not None else len(tokens))
            if least < limit and hits.count(least) < len(hits):
                self.limited_by[hits.index(least)] += 1     # this group held the least
            cap = min(least, limit)
        spaces = [self.namespace(g, ns_id, ns_hash) for g in range(len(self.tables))]
        done = []
        got = []
        try:
            for t, (nid, nh) in zip(self.tables, spaces):
                got.append(t.add(key, tokens, nid, nh, priority, max_hit_blocks=cap))
                done.append(t)
            if len(set(got)) != 1:
                raise InternalError(f"layer groups reused different prefixes {got} (the index changed "
                                    "during an admission: a bug)")
        except BaseException:
            for t in done:
                t.remove(key, internal=True)
            raise
        return got[0]

    def add_restored(self, key: int, tokens: np.ndarray | None, ns_id: int, ns_hash: int,
                     priority: int = -1) -> None:
        """Admit a sequence whose KV arrives from elsewhere (the host tier, another
        process), with no prefix lookup. Full-attention groups track its tokens as usual;
        sliding groups do not, because the KV of the positions that left their window is
        not coming: those blocks are reserved, left blank and released at the commit, and
        an untracked table never registers a block as a prefix. All or nothing."""
        done = []
        try:
            for g, t in enumerate(self.tables):
                t.add(key, tokens if not t.window else None, *self.namespace(g, ns_id, ns_hash), priority, False)
                done.append(t)
        except BaseException:
            for t in done:
                t.remove(key, internal=True)
            raise

    def _check_room(self, keys, counts, internal: bool, what: str) -> None:
        # Each row takes at most ceil(count / bs) new blocks plus one copy-on-write per
        # group; when that many are free, the exact count (a pass per group) is skipped.
        free = self.pool.num_free_blocks
        m = 1 if type(keys) is int else len(keys)
        bs = self.block_size
        if type(counts) is int:
            bound = m * (-(-counts // bs) + 1)
        else:
            bound = int(((np.asarray(counts, dtype=np.int64) + bs - 1) // bs + 1).sum())
        if bound * len(self.tables) <= free:
            return
        need = 0
        for t in self.tables:
            need += t.blocks_needed(keys, counts, internal=internal)
        free = self.pool.num_free_blocks
        if need > free:
            raise OutOfBlocksError(need, free, what)

    def reserve(self, keys, counts, internal: bool = False) -> np.ndarray:
        """Slots ``[num_groups, N]``: row g holds group g's slots."""
        self._check_room(keys, counts, internal, "reserve")
        return self._rows([t.reserve(keys, counts, internal=internal) for t in self.tables])

    def advance(self, keys, token_ids, internal: bool = False) -> np.ndarray:
        self._check_room(keys, 1, internal, "advance")
        return self._rows([t.advance(keys, token_ids, internal=internal) for t in self.tables])

    @staticmethod
    def _rows(parts: list[np.ndarray]) -> np.ndarray:
        out = np.empty((len(parts), len(parts[0])), dtype=np.int64)   # np.stack costs microseconds
        for g, p in enumerate(parts):
            out[g] = p
        return out

    def commit(self, keys, counts, token_ids=None, internal: bool = False) -> None:
        for t in self.tables:
            t.commit(keys, counts, token_ids, internal=internal)

    def unreserve(self, keys, counts=None, internal: bool = False) -> None:
        for t in self.tables:
            t.unreserve(keys, counts, internal=internal)

    def truncate(self, keys, counts, internal: bool = False) -> None:
        for t in self.tables:
            t.truncate(keys, counts, internal=internal, check_only=True)
        for t in self.tables:
            t.truncate(keys, counts, internal=internal)

    def fork(self, src: int, dst: int) -> None:
        done = []
        try:
            for t in self.tables:
                t.fork(src, dst)
                done.append(t)
        except BaseException:
            for t in done:
                t.remove(dst, internal=True)
            raise

    def hold_window(self, keys, hold: bool = True, internal: bool = False) -> None:
        for t in self.tables:
            t.hold_window(keys, hold, internal=internal)

    def slide(self, keys, internal: bool = False) -> None:
        for t in self.tables:
            t.slide(keys, internal=internal)

    def remove(self, keys, internal: bool = False) -> None:
        for t in self.tables:
            t.remove(keys, internal=internal)

    def relocate(self, key: int, moves) -> np.ndarray:
        """Moves of one sequence's blocks, each within the group whose table holds it.

        Every move is checked against every group before any group moves (the old
        block in exactly one group's table of the sequence and held by it alone, the new
        block free, unpinned and used once), so the per-group moves that follow cannot
        fail: all or nothing, as for one table. Returns the (old, new) pairs in order."""
        if len(self.tables) == 1:
            return self.tables[0].relocate(key, moves)
        try:
            pairs = np.array(moves, copy=True)
        except (TypeError, ValueError, OverflowError):
            pairs = None
        if pairs is None or pairs.dtype.kind not in "iu" or pairs.ndim != 2 or pairs.shape[-1:] != (2,):
            return self.tables[0].relocate(key, moves)      # group 0 names the malformed argument
        if not len(pairs):
            return self.tables[0].relocate(key, pairs)
        if pairs.dtype.kind == "u" and pairs.max() > 2**62:
            return self.tables[0].relocate(key, moves)
        pairs = pairs.astype(np.int64)
        where = {}
        for g, t in enumerate(self.tables):
            for b in t.blocks(key).tolist():
                if b >= 0:
                    where[b] = g
        olds, news = pairs[:, 0].tolist(), pairs[:, 1].tolist()
        name = self.tables[0].namer(key)
        for i, b in enumerate(olds):
            if b not in where:
                raise InvalidBlockError(expected("moves", f"old blocks of sequence {name!r}'s tables",
                                                 f"block {b} at row {i}"))
        if len(set(olds)) != len(olds):
            raise InvalidArgumentError(expected("moves", "each old block at most once", olds))
        ref = self.pool.ref_cnt
        for i, b in enumerate(olds):
            if ref[b] != 1:
                raise InvalidBlockError(expected("moves", "old blocks held by this sequence only",
                                                 f"block {b} at row {i}, held by {ref[b]} sequences"))
        for i, b in enumerate(news):
            if not 0 <= b < self.pool.num_blocks:
                raise InvalidBlockError(expected("moves", f"new block ids in [0, {self.pool.num_blocks})", news))
            if not self.pool.is_free(b):
                raise InvalidBlockError(expected("moves", "free unpinned new blocks", f"block {b} at index {i}"))
        if len(set(news)) != len(news):
            raise InvalidBlockError(expected("moves", "each new block at most once", news))
        groups = np.array([where[b] for b in olds])
        done = np.empty((len(pairs), 2), dtype=np.int32)
        for g, t in enumerate(self.tables):
            sel = np.flatnonzero(groups == g)
            if len(sel):
                done[sel] = t.relocate(key, pairs[sel])
        return done

    def take_copies(self) -> np.ndarray:
        """Copy-on-write pairs of every group (a block copy moves all its layer slots)."""
        return np.concatenate([t.take_copies() for t in self.tables])

    @property
    def num_pending_copies(self) -> int:
        n = 0
        for t in self.tables:
            n += t.num_pending_copies
        return n

    def group_for(self, group: int | None) -> BlockTables:
        if group is None:
            return self.tables[0]
        if isinstance(group, bool) or not isinstance(group, (int, np.integer)) or not 0 <= group < len(self.tables):
            raise InvalidArgumentError(expected("group", f"a layer group in [0, {len(self.tables)})", repr(group)))
        return self.tables[int(group)]

    def set_priority(self, key: int, priority: int, start_token: int = 0, end_token: int | None = None) -> None:
        """Every group's blocks of the sequence (or of a token range) get the class; the
        rows and counts are the same in every group, so group 0's checks stand for all."""
        for t in self.tables:
            t.set_priority(key, priority, start_token, end_token)

    def held_blocks(self, key: int) -> list[int]:
        """Blocks each group holds for one sequence (released ones not counted)."""
        return [int((t.blocks(key) >= 0).sum()) for t in self.tables]

    def group_figures(self) -> list[dict]:
        """Per group: its window, the blocks its live sequences hold, the unused slots in
        their partial last blocks, copy-on-write copies and prefix-hit tokens (stats)."""
        out = []
        for g, t in zip(self.plan.groups, self.tables):
            held = waste = 0
            for k in t.keys().tolist():
                blocks = t.blocks(k)
                n = int((blocks >= 0).sum())
                held += n
                if n and blocks[-1] >= 0:       # a released last block wastes nothing
                    waste += len(blocks) * self.block_size - t.num_reserved(k)
            out.append({"window": g.window, "layers": tuple(g.layers), "blocks_held": held,
                        "waste_slots": waste, "cow_copies": t.num_cow, "query_tokens": t.num_query_tokens,
                        "hit_tokens": t.num_hit_tokens})
        return out

    def check_invariants(self) -> None:
        """Every group's tables against the pool: the references all groups hold add up
        to each block's ref_cnt, and every sequence has the same counts in every group."""
        held = np.zeros(self.pool.num_blocks, dtype=np.int64)
        keys = sorted(self.tables[0].keys().tolist())
        for g, t in enumerate(self.tables):
            t.check_invariants(pool_refs=False)
            if sorted(t.keys().tolist()) != keys:
                raise InternalError(f"layer group {g} holds other sequences than group 0")
            for k in keys:
                if (t.num_computed(k), t.num_reserved(k)) != (self.tables[0].num_computed(k),
                                                              self.tables[0].num_reserved(k)):
                    raise InternalError(f"sequence {k}: layer group {g} disagrees with group 0 on its tokens")
                b = t.blocks(k)
                np.add.at(held, b[b >= 0].astype(np.int64), 1)
        ref = np.asarray(self.pool.ref_cnt, dtype=np.int64)
        if not np.array_equal(held, ref):
            bad = int(np.flatnonzero(held != ref)[0])
            raise InternalError(f"block {bad}: ref_cnt {ref[bad]} but layer groups hold {held[bad]} references")
        self.pool.check_invariants()

