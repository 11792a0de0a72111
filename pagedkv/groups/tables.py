"""Block tables per layer group, over the one shared pool (see :mod:`pagedkv.groups.layers`).

A cache whose model mixes full-attention and sliding-window layers keeps one set of
block tables per layer group, of the class for the group's attention type
(:data:`TABLES_FOR`): :class:`~pagedkv._core.tables.FullAttentionTables` keeps every
block, :class:`~pagedkv._core.sliding.SlidingWindowTables` releases the blocks that
left its window. Both implement :class:`AttentionTables`, the one protocol this
coordinator drives; the mix of types is checked once, when the groups are built. A new
attention type is a new class (a ``TablesBase`` subclass in ``pagedkv/_core``) and one
entry in :data:`TABLES_FOR`. Every sequence lives in all groups with the same token
counts; only the blocks differ. Each call here applies one manager operation to every
group, all or nothing:

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
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import numpy as np

from pagedkv._core.prefix import hash_bytes
from pagedkv._core.sliding import SlidingWindowTables
from pagedkv._core.tables import FullAttentionTables
from pagedkv.errors import InternalError, InvalidArgumentError, InvalidBlockError, OutOfBlocksError, expected
from pagedkv.groups.layers import GroupPlan
from pagedkv.groups.spec import KVSpec

__all__ = ["AttentionTables", "TABLES_FOR", "GroupTables", "GroupNamespaces", "GROUP_NS_BITS", "group_key"]


@runtime_checkable
class AttentionTables(Protocol):
    """What every attention type's block tables implement (see ``_core/tables.pyi`` for
    the signatures): the lifecycle calls (``add``, ``reserve``, ``commit``, ``advance``,
    ``unreserve``, ``truncate``, ``fork``, ``remove``), the window calls (``hold_window``,
    ``slide``, ``released_tokens``: no-ops and zeros for a type that releases nothing
    early), the exports and the per-sequence queries. ``window`` is 0 for a type
    whose queries see every earlier position."""

    namer: Callable[[int], Any]

    @property
    def block_size(self) -> int: ...
    @property
    def window(self) -> int: ...
    @property
    def sinks(self) -> int: ...
    @property
    def sink_blocks(self) -> int: ...
    @property
    def num_pending_copies(self) -> int: ...
    @property
    def num_cow(self) -> int: ...
    @property
    def num_query_tokens(self) -> int: ...
    @property
    def num_hit_tokens(self) -> int: ...

    def add(self, key: int, tokens: Any = None, ns: int = 0, ns_hash: int = 0, priority: int = -1,
            lookup: bool = True, max_hit_blocks: int | None = None) -> int: ...
    def remove(self, keys: Any, internal: bool = False) -> None: ...
    def fork(self, src: int, dst: int) -> None: ...
    def reserve(self, keys: Any, counts: Any, internal: bool = False) -> np.ndarray: ...
    def advance(self, keys: Any, token_ids: Any, internal: bool = False) -> np.ndarray: ...
    def commit(self, keys: Any, counts: Any, token_ids: Any = None, internal: bool = False) -> None: ...
    def unreserve(self, keys: Any, counts: Any = None, internal: bool = False) -> None: ...
    def truncate(self, keys: Any, counts: Any, internal: bool = False, check_only: bool = False) -> None: ...
    def blocks_needed(self, keys: Any, counts: Any, internal: bool = False) -> int: ...
    def hold_window(self, keys: Any, hold: bool = True, internal: bool = False) -> None: ...
    def slide(self, keys: Any, internal: bool = False) -> None: ...
    def released_tokens(self, keys: Any, internal: bool = False) -> np.ndarray: ...
    def take_copies(self) -> np.ndarray: ...
    def set_priority(self, key: int, priority: int, start_token: int = 0, end_token: int | None = None) -> None: ...
    def block_table(self, keys: Any, pad: int = -1, width: int | None = None, internal: bool = False) -> np.ndarray: ...
    def csr(self, keys: Any, internal: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...
    def slot_mapping(self, keys: Any, starts: Any, counts: Any, internal: bool = False) -> np.ndarray: ...
    def seq_lens(self, keys: Any, computed: bool = False, internal: bool = False) -> np.ndarray: ...
    def relocate(self, key: int, moves: Any) -> np.ndarray: ...
    def blocks(self, key: int) -> np.ndarray: ...
    def tokens(self, key: int) -> np.ndarray: ...
    def num_computed(self, key: int) -> int: ...
    def num_reserved(self, key: int) -> int: ...
    def info(self, key: int) -> dict[str, Any]: ...
    def keys(self) -> np.ndarray: ...
    def total_tokens(self) -> tuple[int, int]: ...
    def __contains__(self, key: object) -> bool: ...
    def __len__(self) -> int: ...
    def check_invariants(self, pool_refs: bool = True) -> None: ...


def _full(pool, block_size: int, index, group: KVSpec) -> AttentionTables:
    return FullAttentionTables(pool, block_size, index)


def _sliding(pool, block_size: int, index, group: KVSpec) -> AttentionTables:
    return SlidingWindowTables(pool, block_size, index, window=group.window, sinks=group.sinks)


# A layer group's spec type (its attention name) -> how its tables are built over the
# shared pool. MLA keeps every block, as full attention (vLLM's MLAAttentionSpec reuses
# the full-attention manager); only its rows differ, which the tables never see.
TABLES_FOR: dict[str, Callable[..., AttentionTables]] = {"full": _full, "sliding": _sliding, "mla": _full}


def make_tables(pool, block_size: int, index, spec: KVSpec, namer) -> AttentionTables:
    """The block tables of one group, of its spec's class."""
    t = TABLES_FOR[spec.attention](pool, block_size, index, spec)
    t.namer = namer      # core errors name the caller's id, not the key
    return t


def check_mix(plan: GroupPlan) -> list[str]:
    """The attention type of every group, once all are known to have a tables class
    (refused otherwise, naming the group and its type)."""
    types = [g.attention for g in plan.groups]
    for i, a in enumerate(types):
        if a not in TABLES_FOR:
            raise InvalidArgumentError(expected("layer_groups", f"attention types with block tables "
                                                f"({', '.join(sorted(TABLES_FOR))})", f"{a!r} in group {i}"))
    return types

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

    The lifecycle calls take the arguments of the same :class:`AttentionTables` calls,
    so the manager drives either through one code path."""

    def __init__(self, pool, index, block_size: int, plan: GroupPlan, namer):
        check_mix(plan)
        self.plan = plan
        self.pool = pool
        self.index = index
        self.block_size = block_size
        self.specs: tuple[KVSpec, ...] = tuple(plan.groups)
        self.tables: list[AttentionTables] = [make_tables(pool, block_size, index, g, namer) for g in plan.groups]
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

    def prefix_hits(self, tokens: np.ndarray, ns_id: int, ns_hash: int, cap: int | None = None) -> list[int]:
        """Full blocks of ``tokens`` each group may reuse by its own rule (pure query):
        its cached chain, cut by its spec's :meth:`~pagedkv.groups.spec.KVSpec.longest_hit`
        (at most ``cap`` blocks)."""
        if self.index is None:
            return [0] * len(self.tables)
        top = len(tokens) // self.block_size if cap is None else cap
        return [spec.longest_hit(t, len(self.index.match(tokens, *self.namespace(g, ns_id, ns_hash))), top)
                for g, (spec, t) in enumerate(zip(self.specs, self.tables))]

    def agreed_hit(self, hits: list[int], cap: int) -> int:
        """The longest hit every group agrees on, at most ``cap`` blocks: each group's rule
        is asked again at the current bound until none lowers it (a group whose hits are
        only at some boundaries may lower it below the others' chains)."""
        best = min(min(hits), cap)
        while True:
            low = best
            for spec, t, h in zip(self.specs, self.tables, hits):
                low = spec.longest_hit(t, h, low)
            if low == best:
                return best
            best = low

    def match(self, tokens: np.ndarray, ns_id: int, ns_hash: int) -> dict:
        """What an admission of ``tokens`` would reuse now: ``tokens`` (the longest
        prefix every group holds), ``per_group`` (tokens each group holds) and
        ``limited_by`` (the group holding the least; None when all hold the same)."""
        blocks = self.prefix_hits(tokens, ns_id, ns_hash)
        hits = [h * self.block_size for h in blocks]
        least = self.agreed_hit(blocks, min(blocks)) * self.block_size
        return {"tokens": least, "per_group": hits,
                "limited_by": None if hits.count(least) == len(hits) else hits.index(min(hits))}

    def blocks_to_admit(self, tokens: np.ndarray, total: int, ns_id: int, ns_hash: int) -> int:
        """Free blocks an admission of ``tokens`` then a reserve up to ``total`` tokens
        takes, over all groups (see ``PagedKVCache.blocks_to_admit``)."""
        bs = self.block_size
        cap = max(0, (len(tokens) - 1) // bs)
        per = []
        for g in range(len(self.tables)):
            per.append(self.index.match(tokens, *self.namespace(g, ns_id, ns_hash))[:cap]
                       if self.index is not None else np.empty(0, np.int32))
        h = self.agreed_hit([spec.longest_hit(t, len(b), cap) for spec, t, b in zip(self.specs, self.tables, per)],
                            cap)
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
            limit = min((len(tokens) - 1) // self.block_size, cap if cap is not None else len(tokens))
            hits = self.prefix_hits(tokens, ns_id, ns_hash, limit)
            least = min(hits)
            if least < limit and hits.count(least) < len(hits):
                self.limited_by[hits.index(least)] += 1     # this group held the least
            cap = self.agreed_hit(hits, limit)
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
            for g, (spec, t) in enumerate(zip(self.specs, self.tables)):
                t.add(key, tokens if spec.tracks_restored() else None, *self.namespace(g, ns_id, ns_hash),
                      priority, False)
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

    def group_for(self, group: int | None) -> AttentionTables:
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
            out.append({"window": g.window, "attention": g.kind, "layers": tuple(g.layers), "blocks_held": held,
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

