"""A pure-Python model of the Cython core, written for clarity, not speed.

It exists for two reasons:

- the hypothesis state machines run the Cython core and this model side by side with
  the same random operations and demand identical results (blocks, slots, hits, the
  free-queue order);
- the benchmarks use it as the in-process pure-Python baseline.

The model keys its prefix index by exact content (namespace and the whole token prefix),
so it needs no hashing; the core must behave the same wherever hashes do not collide.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from pagedkv.errors import (
    CacheBusyError,
    InvalidArgumentError,
    InvalidBlockError,
    OutOfBlocksError,
    SequenceExistsError,
    SequenceNotFoundError,
    expected,
)

__all__ = ["PyBlockPool", "PyTables"]

EMPTY = 0
PINNED = "pinned"
_BUCKETS = {"lru": None, "adaptive": None, "priority": None, "frequency": 16}
_HITS_MAX = 2**32 - 1


class PyBlockPool:
    """Same semantics as :class:`pagedkv._core.pool.BlockPool` (see its docstring)."""

    def __init__(self, num_blocks: int, eviction: str = "lru", priority_classes: int = 3,
                 low_watermark: float = 0.05, high_watermark: float = 0.15, order=None):
        if eviction not in _BUCKETS:
            raise InvalidArgumentError(expected("eviction", f"one of {sorted(_BUCKETS)}", repr(eviction)))
        self.num_blocks = num_blocks
        self.policy = eviction
        self.nbuckets = {"priority": priority_classes, "frequency": 16}.get(eviction, 1)
        self.low = int(low_watermark * num_blocks)
        self.high = int(high_watermark * num_blocks)
        self.ref = [0] * num_blocks
        self.cached = [False] * num_blocks
        self.pins = [0] * num_blocks
        self.hits = [0] * num_blocks
        self.lists: list[OrderedDict] = [OrderedDict() for _ in range(1 + self.nbuckets)]
        self.where: dict[int, int | str] = {}    # block -> its list, or PINNED
        for b in (range(num_blocks) if order is None else order):
            self.lists[EMPTY][b] = None
            self.where[b] = EMPTY
        self.num_allocations = self.num_frees = self.num_touches = self.num_evictions = 0
        self.on_evict: Callable[[int], None] | None = None   # callback(block) when cached content is dropped

    # -- helpers -----------------------------------------------------------------------
    def bucket_for(self, b: int, cls: int) -> int:
        if self.policy == "priority":
            return 1 + min(max(cls, 0), self.nbuckets - 1)
        if self.policy == "frequency":
            return 1 + min(self.hits[b].bit_length(), self.nbuckets - 1)
        return 1

    def _unlist(self, b: int) -> None:
        w = self.where.pop(b)
        if isinstance(w, int):      # not PINNED
            del self.lists[w][b]

    def _push_back(self, lst: int, b: int) -> None:
        self.lists[lst][b] = None
        self.where[b] = lst

    def _evict(self, b: int) -> None:
        self.cached[b] = False
        self.num_evictions += 1
        if self.on_evict is not None:
            self.on_evict(b)

    @property
    def num_free_blocks(self) -> int:
        return sum(len(lst) for lst in self.lists)

    @property
    def num_in_use_blocks(self) -> int:
        return sum(1 for r in self.ref if r)

    @property
    def num_cached_free_blocks(self) -> int:
        return sum(1 for b in range(self.num_blocks) if not self.ref[b] and self.cached[b])

    def free_block_queue(self) -> list[int]:
        return [b for lst in self.lists for b in lst]

    def _check_range(self, b: int, i: int) -> None:
        if not 0 <= b < self.num_blocks:
            raise InvalidBlockError(expected("block_ids", f"block ids in [0, {self.num_blocks})", f"{b} at index {i}"))

    # -- operations --------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise InvalidArgumentError(expected("n", "an int >= 0", repr(n)))
        free = self.num_free_blocks
        if n > free:
            raise OutOfBlocksError(n, free)
        out = []
        for _ in range(n):
            lst = next(k for k, blocks in enumerate(self.lists) if blocks)
            b, _ = self.lists[lst].popitem(last=False)
            del self.where[b]
            if self.cached[b]:
                self._evict(b)
            self.ref[b] = 1
            self.hits[b] = 0
            out.append(b)
        self.num_allocations += n
        if n and self.policy == "adaptive" and len(self.lists[EMPTY]) < self.low:
            while len(self.lists[EMPTY]) < self.high:
                victim = next((k for k in range(1, len(self.lists)) if self.lists[k]), None)
                if victim is None:
                    break
                b, _ = self.lists[victim].popitem(last=False)
                del self.where[b]
                self._evict(b)
                self._push_back(EMPTY, b)
        return out

    def free(self, block_ids, priority=None) -> None:
        ids = [int(b) for b in block_ids]
        seen: dict[int, int] = {}
        for i, b in enumerate(ids):
            self._check_range(b, i)
            seen[b] = seen.get(b, 0) + 1
            if seen[b] > self.ref[b]:
                raise InvalidBlockError(expected("block_ids", "blocks that are in use", f"block {b} at index {i}"))
        classes = [priority] * len(ids) if priority is None or isinstance(priority, int) else list(priority)
        run = []
        for i, b in enumerate(ids):
            self.ref[b] -= 1
            if self.ref[b]:
                continue
            if self.cached[b]:
                if self.pins[b]:
                    self.where[b] = PINNED
                else:
                    self._push_back(self.bucket_for(b, classes[i] or 0), b)
            else:
                run.append(b)
        if run:
            rest = self.lists[EMPTY]
            self.lists[EMPTY] = OrderedDict((b, None) for b in run)
            self.lists[EMPTY].update(rest)
            for b in run:
                self.where[b] = EMPTY
        self.num_frees += len(ids)

    def touch(self, block_ids) -> None:
        ids = [int(b) for b in block_ids]
        for i, b in enumerate(ids):
            self._check_range(b, i)
            if not self.ref[b] and not self.cached[b]:
                raise InvalidBlockError(expected("block_ids", "blocks in use or cached-free", f"block {b} at index {i}"))
        for b in ids:
            self.incref(b)

    def incref(self, b: int) -> None:
        if not self.ref[b]:
            self._unlist(b)
        self.ref[b] += 1
        self.hits[b] = min(self.hits[b] + 1, _HITS_MAX)
        self.num_touches += 1

    def mark_cached(self, block_ids) -> None:
        ids = [int(b) for b in block_ids]
        for i, b in enumerate(ids):
            if not 0 <= b < self.num_blocks or not self.ref[b]:
                raise InvalidBlockError(expected("block_ids", "blocks that are in use", f"{b} at index {i}"))
        for b in ids:
            self.cached[b] = True

    def pin(self, block_ids) -> None:
        ids = [int(b) for b in block_ids]
        for i, b in enumerate(ids):
            if not 0 <= b < self.num_blocks or not self.cached[b]:
                raise InvalidBlockError(expected("block_ids", "blocks holding cached content", f"{b} at index {i}"))
        for b in ids:
            self.pins[b] += 1
            if not self.ref[b] and self.where.get(b) != PINNED:
                self._unlist(b)
                self.where[b] = PINNED

    def unpin(self, block_ids) -> None:
        ids = [int(b) for b in block_ids]
        seen: dict[int, int] = {}
        for i, b in enumerate(ids):
            self._check_range(b, i)
            seen[b] = seen.get(b, 0) + 1
            if seen[b] > self.pins[b]:
                raise InvalidBlockError(expected("block_ids", "pinned blocks", f"block {b}, which is not pinned"))
        for b in ids:
            self.pins[b] -= 1
            if not self.pins[b] and not self.ref[b]:
                del self.where[b]
                self._push_back(self.bucket_for(b, 127), b)

    def drop_content(self, b: int) -> None:
        if not self.cached[b]:
            return
        if not self.ref[b]:
            self._unlist(b)
            self._evict(b)
            rest = self.lists[EMPTY]
            self.lists[EMPTY] = OrderedDict([(b, None)])
            self.lists[EMPTY].update(rest)
            self.where[b] = EMPTY
        else:
            self._evict(b)

    def reset_cache(self) -> None:
        used = self.num_in_use_blocks
        if used:
            raise CacheBusyError(f"reset_prefix_cache: expected no block in use, got {used} in use")
        for b in range(self.num_blocks):
            if self.cached[b]:
                self._unlist(b)
                self.cached[b] = False
                self.pins[b] = 0
                self.hits[b] = 0
                self._push_back(EMPTY, b)


class _Row:
    __slots__ = ("blocks", "tokens", "prompt_len", "computed", "reserved", "hashed", "canon",
                 "canon_gen", "ns", "priority", "track", "prefix_hit", "cls", "dropped", "hold")

    def __init__(self, tokens, ns, priority):
        self.blocks: list[int] = []
        self.tokens: list[int] = list(tokens)
        self.prompt_len = len(self.tokens)
        self.computed = self.reserved = self.hashed = self.prefix_hit = 0
        self.canon, self.canon_gen = -1, 0
        self.ns, self.priority, self.track = ns, priority, True
        self.cls: dict[int, int] = {}
        self.dropped = 0    # sliding window: released blocks after the sinks (entries -1)
        self.hold = False   # sliding window: commits release nothing (rollback pending)


class PyTables:
    """Same semantics as :class:`pagedkv._core.tables.BlockTables` with a prefix index
    keyed by exact content (no hashes). ``window``/``sinks``: a sliding-window table."""

    def __init__(self, pool: PyBlockPool, block_size: int, prefix: bool = True, recent_blocks: int = 4,
                 window: int = 0, sinks: int = 0):
        self.pool, self.bs, self.prefix, self.recent = pool, block_size, prefix, recent_blocks
        self.window, self.sinks = window, sinks
        self.sink_blocks = -(-sinks // block_size)
        self.rows: dict[int, _Row] = {}
        self.reg: dict[int, tuple[int, tuple, int, int]] = {}     # block -> (ns, chain, parent, pgen)
        self.chains: dict[tuple[int, tuple], int] = {}            # (ns, chain) -> block
        self.gen = [0] * pool.num_blocks
        self.copies: list[tuple[int, int]] = []
        self.num_query_tokens = self.num_hit_tokens = 0
        pool.on_evict = self._unregister

    def _slide(self, row: _Row, force: bool = False) -> None:
        """Release the blocks wholly before the next query's window, oldest first."""
        if not self.window or (row.hold and not force):
            return
        keep_from = row.computed - self.window + 1
        first = self.sink_blocks + row.dropped
        upto = keep_from // self.bs if keep_from > 0 else 0
        if upto > first:
            self.pool.free(row.blocks[first:upto])
            row.blocks[first:upto] = [-1] * (upto - first)
            row.dropped = upto - self.sink_blocks

    def _unregister(self, b: int) -> None:
        entry = self.reg.pop(b, None)
        if entry is not None:
            del self.chains[(entry[0], entry[1])]
            self.gen[b] += 1

    def _valid(self, b: int, g: int) -> bool:
        return b in self.reg and self.gen[b] == g

    def _row(self, key) -> _Row:
        row = self.rows.get(key)
        if row is None:
            raise SequenceNotFoundError(key, "seq_ids")
        return row

    def _rows(self, keys) -> list[_Row]:
        seen = set()
        rows = []
        for k in keys:      # in order: the first unknown or repeated key decides the error
            rows.append(self._row(k))
            if k in seen:
                raise InvalidArgumentError(expected("seq_ids", "each sequence at most once per call", "a repeat"))
            seen.add(k)
        return rows

    def match(self, tokens, ns: int = 0, max_blocks: int | None = None) -> list[int]:
        hits: list[int] = []
        parent, pgen = -1, 0
        n = len(tokens) // self.bs if max_blocks is None else min(max_blocks, len(tokens) // self.bs)
        for i in range(n):
            b = self.chains.get((ns, tuple(tokens[:(i + 1) * self.bs])))
            if b is None:
                break
            _, _, p, g = self.reg[b]
            if p != parent or (p >= 0 and g != pgen):
                break
            hits.append(b)
            parent, pgen = b, self.gen[b]
        return hits

    def add(self, key, tokens=None, ns: int = 0, priority: int = -1) -> int:
        if key in self.rows:
            raise SequenceExistsError(key)
        row = _Row(tokens or [], ns, priority)
        hits: list[int] = []
        if self.prefix and row.tokens:
            hits = self.match(row.tokens, ns, (len(row.tokens) - 1) // self.bs)
            for b in hits:
                self.pool.incref(b)
            self.num_query_tokens += len(row.tokens)
            self.num_hit_tokens += len(hits) * self.bs
        row.blocks = list(hits)
        row.hashed = row.prefix_hit = len(hits)
        row.computed = row.reserved = len(hits) * self.bs
        if hits:
            row.canon, row.canon_gen = hits[-1], self.gen[hits[-1]]
        self._slide(row)
        self.rows[key] = row
        return len(hits) * self.bs

    def reserve(self, keys, counts) -> list[int]:
        keys = list(keys)
        counts = [counts] * len(keys) if isinstance(counts, int) else [int(c) for c in counts]
        rows = self._rows(keys)
        need = 0
        for row, n in zip(rows, counts):
            if n < 0 or n >= 2**63:
                raise InvalidArgumentError(expected("num_tokens", "counts in [0, 2**63)", n))
            need += -(-(row.reserved + n) // self.bs) - len(row.blocks)
            if n and row.reserved % self.bs and self._must_copy(row.blocks[-1]):
                need += 1
        if need > self.pool.num_free_blocks:
            raise OutOfBlocksError(need, self.pool.num_free_blocks, "reserve")
        slots = []
        for row, n in zip(rows, counts):
            if not n:
                continue
            if row.reserved % self.bs and self._must_copy(row.blocks[-1]):
                nb = self.pool.allocate(1)[0]
                self.copies.append((row.blocks[-1], nb))
                self.pool.free([row.blocks[-1]])
                row.blocks[-1] = nb
            newb = -(-(row.reserved + n) // self.bs) - len(row.blocks)
            row.blocks += self.pool.allocate(newb)
            for p in range(row.reserved, row.reserved + n):
                slots.append(row.blocks[p // self.bs] * self.bs + p % self.bs)
            row.reserved += n
        return slots

    def commit(self, keys, counts, token_ids=None) -> None:
        keys = list(keys)
        counts = [counts] * len(keys) if isinstance(counts, int) else [int(c) for c in counts]
        rows = self._rows(keys)
        for row, n in zip(rows, counts):
            if n < 0 or n >= 2**63 or row.computed + n > row.reserved:
                raise InvalidArgumentError(expected("num_tokens", "at most the reserved tokens", n))
        if token_ids is not None:
            token_ids = [int(t) for t in token_ids]
            if len(token_ids) != sum(counts):
                raise InvalidArgumentError(expected("token_ids", f"{sum(counts)} ids", len(token_ids)))
            off = 0
            for row, n in zip(rows, counts):
                for p in range(row.computed, min(len(row.tokens), row.computed + n)):
                    if row.tokens[p] != token_ids[off + p - row.computed]:
                        raise InvalidArgumentError(expected("token_ids", "ids matching the known tokens", "a mismatch"))
                off += n
        off = 0
        for row, n in zip(rows, counts):
            if token_ids is not None and row.computed + n > len(row.tokens) >= row.computed:
                row.tokens += token_ids[off + len(row.tokens) - row.computed: off + n]
            row.computed += n
            off += n
            if row.computed > len(row.tokens):
                row.track = False
            if self.prefix and row.track:
                self._register(row)
            self._slide(row)

    def advance(self, keys, token_ids) -> list[int]:
        keys = list(keys)
        token_ids = [int(t) for t in token_ids]
        if len(token_ids) != len(keys):
            raise InvalidArgumentError(expected("token_ids", f"{len(keys)} ids", len(token_ids)))
        rows = self._rows(keys)
        need = 0
        for row, t in zip(rows, token_ids):
            c = row.reserved
            if c < len(row.tokens) and row.tokens[c] != t:
                raise InvalidArgumentError(expected("token_ids", "ids matching the known tokens", "a mismatch"))
            if c % self.bs == 0 or self._must_copy(row.blocks[-1]):
                need += 1
        if need > self.pool.num_free_blocks:
            raise OutOfBlocksError(need, self.pool.num_free_blocks, "advance")
        slots = []
        for row, t in zip(rows, token_ids):
            c = row.reserved
            if row.computed < c:
                row.computed = c
                if c > len(row.tokens):
                    row.track = False
                elif self.prefix and row.track:
                    self._register(row)
                self._slide(row)
            if c == len(row.tokens):
                row.tokens.append(t)
            if c % self.bs == 0:
                row.blocks += self.pool.allocate(1)
            elif self._must_copy(row.blocks[-1]):
                nb = self.pool.allocate(1)[0]
                self.copies.append((row.blocks[-1], nb))
                self.pool.free([row.blocks[-1]])
                row.blocks[-1] = nb
            slots.append(row.blocks[-1] * self.bs + c % self.bs)
            row.reserved = c + 1
        return slots

    def unreserve(self, keys, counts=None) -> None:
        keys = list(keys)
        rows = self._rows(keys)
        counts = [r.reserved - r.computed for r in rows] if counts is None else [int(c) for c in counts]
        for row, n in zip(rows, counts):
            if not 0 <= n <= row.reserved - row.computed:
                raise InvalidArgumentError(expected("num_tokens", "at most the uncommitted tokens", n))
        for row, n in zip(rows, counts):
            row.reserved -= n
            keep = -(-row.reserved // self.bs)
            if keep < len(row.blocks):
                self.pool.free(row.blocks[keep:])
                del row.blocks[keep:]

    def truncate(self, keys, counts) -> None:
        keys = list(keys)
        rows = self._rows(keys)
        counts = [counts] * len(keys) if isinstance(counts, int) else [int(c) for c in counts]
        for row, n in zip(rows, counts):
            if not 0 <= n <= row.computed:
                raise InvalidArgumentError(expected("num_tokens", "at most the committed tokens", n))
            if row.dropped and row.computed - n - self.window + 1 < (self.sink_blocks + row.dropped) * self.bs:
                raise InvalidArgumentError(expected("num_tokens", "a length whose window is still held", n))
        for row, n in zip(rows, counts):
            length = row.computed - n
            keep = -(-length // self.bs)
            if keep < len(row.blocks):
                self.pool.free(row.blocks[keep:][::-1])
                del row.blocks[keep:]
            row.computed = row.reserved = length
            del row.tokens[length:]
            row.prompt_len = min(row.prompt_len, length)
            row.prefix_hit = min(row.prefix_hit, keep)
            full = length // self.bs
            if row.hashed > full:
                if row.track and self.prefix:
                    # step the cursor back along the registered chain of the kept blocks
                    hits = self.match(row.tokens, row.ns, full)
                    row.hashed = len(hits)
                    row.canon, row.canon_gen = (hits[-1], self.gen[hits[-1]]) if hits else (-1, 0)
                    row.track = len(hits) == full
                else:
                    row.hashed = full

    def _must_copy(self, b: int) -> bool:
        return self.pool.ref[b] > 1 or self.pool.cached[b]

    def _register(self, row: _Row) -> None:
        bs = self.bs
        while row.track and (row.hashed + 1) * bs <= row.computed:
            i = row.hashed
            if i > 0 and not self._valid(row.canon, row.canon_gen):
                row.track = False
                return
            parent = row.canon if i > 0 else -1
            b = row.blocks[i]
            key = (row.ns, tuple(row.tokens[:(i + 1) * bs]))
            c = self.chains.get(key)
            if c is None:
                if self.pool.cached[b]:
                    row.track = False
                    return
                self._insert(b, key, parent, row.canon_gen)
                c = b
            elif c != b:
                _, _, p, g = self.reg[c]
                if p != parent or (p >= 0 and g != row.canon_gen):
                    orphan = p >= 0 and not self._valid(p, g)
                    if not orphan or self.pool.pins[c]:
                        row.track = False
                        return
                    self.pool.drop_content(c)
                    self._insert(b, key, parent, row.canon_gen)
                    c = b
            row.canon, row.canon_gen = c, self.gen[c]
            row.hashed += 1

    def _insert(self, b, key, parent, pgen) -> None:
        self.reg[b] = (key[0], key[1], parent, pgen)
        self.chains[key] = b
        self.pool.cached[b] = True

    def _class(self, row: _Row, i: int) -> int:
        top = self.pool.nbuckets - 1
        if row.cls.get(i, -1) >= 0:
            return row.cls[i]
        if row.priority >= 0:
            return row.priority
        if (i + 1) * self.bs <= row.prompt_len:
            return top
        if i >= len(row.blocks) - self.recent:
            return 1 if top >= 1 else 0
        return 0

    def remove(self, keys) -> None:
        for key, row in zip(list(keys), self._rows(keys)):
            n = len(row.blocks)
            held = [i for i in range(n) if row.blocks[i] >= 0]     # a sliding row's released entries are -1
            classes = [self._class(row, i) for i in held][::-1]
            self.pool.free([row.blocks[i] for i in held][::-1], classes if self.pool.policy == "priority" else None)
            del self.rows[key]

    def fork(self, src, dst) -> None:
        s = self._row(src)
        if dst in self.rows:
            raise SequenceExistsError(dst, "dst")
        d = _Row(s.tokens[:min(s.computed, len(s.tokens))], s.ns, s.priority)
        nb = -(-s.computed // self.bs)
        d.blocks = s.blocks[:nb]
        d.computed = d.reserved = s.computed
        d.prompt_len, d.hashed, d.prefix_hit = s.prompt_len, s.hashed, s.prefix_hit
        d.canon, d.canon_gen, d.track = s.canon, s.canon_gen, s.track
        d.dropped, d.hold = s.dropped, s.hold
        for b in d.blocks:
            if b >= 0:
                self.pool.incref(b)
        self.rows[dst] = d

    def hold_window(self, keys, hold: bool = True) -> None:
        rows = self._rows(keys)
        if not self.window:
            return
        for row in rows:
            row.hold = hold
            if not hold:
                self._slide(row, force=True)

    def slide(self, keys) -> None:
        for row in self._rows(keys):
            self._slide(row, force=True)

    def set_priority(self, key, priority: int, start_token: int = 0, end_token=None) -> None:
        row = self._row(key)
        if end_token is None and start_token == 0:
            row.priority = priority
            return
        end = row.reserved if end_token is None else end_token
        for i in range(start_token // self.bs, -(-end // self.bs)):
            row.cls[i] = priority
