# cython: language_level=3
"""Block tables: every live sequence's block table, token counts and token ids.

One class per attention type, behind one protocol (the Python API below, typed in
``tables.pyi``): ``FullAttentionTables`` keeps every block of a sequence;
``SlidingWindowTables`` (:mod:`pagedkv._core.sliding`) releases the blocks that left
its window. Both derive from ``TablesBase``, which holds the shared machinery and full
attention's behaviour; a kind overrides the few cdef steps marked "per attention type"
in ``tables.pxd``. ``BlockTables(pool, block_size, index, window=, sinks=)`` builds the
kind its arguments name (``window=0``: full attention).

A sequence's life: ``add`` (with its prompt: the longest verified cached prefix of
full blocks is reused, never the whole prompt), then per step ``reserve`` (slots for
the next tokens; new blocks only at block boundaries; copy-on-write of a shared
partial last block) and ``commit`` (the KV of those tokens is computed; blocks that
became full are registered in the prefix index through the pool), or both at once with
``advance``, and finally ``remove``.

Batch calls take int64 key arrays (or one int key) and do the whole batch in one
crossing. Each snapshots its arguments, validates everything (unknown or repeated keys,
counts, capacity) and only then applies, so a failed call changes nothing. Reserve,
commit and advance run the same per-row steps (``row_need``, ``reserve_row`` /
``reserve_one``, ``commit_row``).

Block tables are append-only while a sequence lives, with two exceptions:
copy-on-write swaps a shared (or registered), partially filled last block for a private
copy before the first write into it (``take_copies`` hands the (src, dst) pairs to the
KV store), and ``unreserve`` drops blocks that cover only reserved, uncommitted tokens.

A kind that releases blocks early (sliding window) marks their table entries -1 and
counts them in ``num_dropped`` after the first ``sink_blocks`` entries, so positions
stay absolute: position p is still in entry p // block_size.

Negative keys are reserved for the manager's interned (non-int) ids: batch calls reject
them unless ``internal=True``. Not thread-safe: callers serialise (PagedKVCache does).
"""
cimport cython
cimport numpy as cnp
from libc.stdlib cimport malloc, realloc, free as c_free
from libc.string cimport memcpy, memset

from pagedkv._core._types cimport uint8_t, uint32_t, uint64_t
from pagedkv._core._arrays cimport load_ints, check_int, check_count, check_u64, buf_reserve, new_i32, new_i64
from pagedkv._core.rows cimport (rs_init, rs_dealloc, rs_find, rs_add, rs_remove, row_grow_blocks,
                                 row_grow_tokens, row_room_blocks, row_room_tokens, blk_of, off_of,
                                 nblocks_for)
from pagedkv._core.pool cimport must_copy_at
from pagedkv._core.evict cimport default_class, POLICY_PRIORITY
from pagedkv._core.export cimport padded_table, csr_table, slots_of, lengths

import operator
from abc import ABCMeta

import numpy as np
from pagedkv.errors import (ArgumentTypeError, HostMemoryError, InternalError, InvalidArgumentError,
                            InvalidBlockError, OutOfBlocksError, SequenceExistsError, SequenceNotFoundError, ShapeError, expected)

cnp.import_array()

cdef enum:
    ERR_NONE = 0
    ERR_NOT_FOUND = 1
    ERR_DUPLICATE = 2

cdef int64_t INT64_MIN = -2**63
cdef int64_t INT64_MAX = 2**63 - 1


def _same(key):
    return key


# ---- per-row steps shared by reserve, commit and advance ------------------------------
cdef inline int64_t row_need(const SeqRow* row, int64_t n, int32_t bs, int32_t sh,
                             const int32_t* ref, const uint8_t* cached) noexcept nogil:
    """Blocks that reserving n more tokens takes from the pool: new blocks, plus one for
    a copy-on-write of a shared partial tail."""
    cdef int64_t need = nblocks_for(row.num_reserved + n, bs, sh) - row.num_blocks
    if n and off_of(row.num_reserved, bs, sh) and must_copy_at(ref, cached, row.blocks[row.num_blocks - 1]):
        need += 1
    return need


cdef inline bint row_needs_copy(const SeqRow* row, int64_t n, int32_t bs, int32_t sh,
                                const int32_t* ref, const uint8_t* cached) noexcept nogil:
    return n and off_of(row.num_reserved, bs, sh) and must_copy_at(ref, cached, row.blocks[row.num_blocks - 1])


cdef inline void reserve_row(TablesBase t, SeqRow* row, int64_t n, int64_t* out) noexcept nogil:
    # Slots for the next n tokens (the caller checked capacity and room).
    cdef int32_t bs = t.block_size, sh = t.bs_shift
    cdef int64_t p, end, newb, base, off, k, i
    if n <= 1:
        if n == 1:
            reserve_one(t, row, out)
        return
    p = row.num_reserved
    if off_of(p, bs, sh) and must_copy_at(t.ref, t.cached, row.blocks[row.num_blocks - 1]):
        copy_on_write(t, row)
    newb = nblocks_for(p + n, bs, sh) - row.num_blocks
    if newb:
        t.pool.alloc_into(row.blocks + row.num_blocks, <int32_t>newb)
        row.num_blocks += <int32_t>newb
    end = p + n
    while p < end:           # one block at a time: no division per token
        off = off_of(p, bs, sh)
        base = <int64_t>row.blocks[blk_of(p, bs, sh)] * bs + off
        k = bs - off
        if k > end - p:
            k = end - p
        for i in range(k):
            out[i] = base + i
        out += k
        p += k
    row.num_reserved = end


cdef void copy_on_write(TablesBase t, SeqRow* row) noexcept nogil:
    # Swap the last (partial) block for a private copy before writing into it; the
    # caller counted the new block and the pair's room. The old block keeps its other
    # references, or, if it was registered and ours was the last, becomes
    # cached-free with its registered content intact.
    cdef block_id_t fresh
    cdef block_id_t* last = &row.blocks[row.num_blocks - 1]
    t.pool.alloc_into(&fresh, 1)
    t.copies[2 * t.num_copies] = last[0]
    t.copies[2 * t.num_copies + 1] = fresh
    t.num_copies += 1
    t.num_cow += 1
    t.pool.release_batch(last, 1, NULL, 0)
    last[0] = fresh


cdef void release_blocks(TablesBase t, SeqRow* row, int32_t lo, int32_t hi) noexcept nogil:
    # Every block of the row back to the pool, tail first: a sequence's last block
    # enters the eviction order first, so it is evicted before its prefix. Entries
    # [lo, hi) were released already (lo == hi: none); the kept blocks close up first.
    # Under the priority policy each block carries its class (cls_buf was sized by the
    # caller) by its logical index.
    cdef int32_t n = row.num_blocks, i, k = 0
    cdef block_id_t b
    cdef int32_t* classes = NULL
    if t.pool.policy.kind == POLICY_PRIORITY:
        classes = <int32_t*>t.cls_buf.data
        for i in range(n):
            if lo <= i < hi:
                continue
            if row.block_cls != NULL and row.block_cls[i] >= 0:
                classes[k] = row.block_cls[i]
            elif row.priority >= 0:
                classes[k] = row.priority
            else:
                classes[k] = default_class(&t.pool.policy, i, n, t.block_size,
                                           row.prompt_len, t.recent_blocks)
            k += 1
        for i in range(k // 2):
            b = classes[i]
            classes[i] = classes[k - 1 - i]
            classes[k - 1 - i] = b
    if hi > lo:
        for i in range(hi, n):
            row.blocks[i - (hi - lo)] = row.blocks[i]
        n -= hi - lo
        row.num_dropped = 0
    for i in range(n // 2):
        b = row.blocks[i]
        row.blocks[i] = row.blocks[n - 1 - i]
        row.blocks[n - 1 - i] = b
    t.pool.release_batch(row.blocks, n, classes, 0)
    row.num_blocks = 0


cdef class TablesBase:
    """The shared machinery of every attention type's tables, with full attention's
    behaviour; build ``FullAttentionTables`` or ``SlidingWindowTables`` (or
    ``BlockTables(...)``, which picks one)."""

    def __cinit__(self, pool, block_size, index=None, recent_blocks=4, *args, **kwargs):
        # A kind's own __cinit__ runs after this one with the same arguments and checks
        # its own (window, sinks); this one checks what every kind shares.
        if not isinstance(pool, BlockPool):
            raise ArgumentTypeError(expected("pool", "a BlockPool", type(pool).__name__))
        if index is not None and not isinstance(index, PrefixIndex):
            raise ArgumentTypeError(expected("index", "a PrefixIndex or None", type(index).__name__))
        cdef int32_t bs = <int32_t>check_int(block_size, "block_size", 1, 2**20)
        if index is not None and (<PrefixIndex>index).block_size != bs:
            raise InvalidArgumentError(expected("index", f"a PrefixIndex with block_size {bs}",
                                                (<PrefixIndex>index).block_size))
        if index is not None and (<BlockPool>pool).index is not index:
            raise InvalidArgumentError(expected("index", "the PrefixIndex the pool was built with", "another one"))
        self.pool = pool
        self.index = index
        self.block_size = bs
        self.bs_shift = (bs.bit_length() - 1) if bs & (bs - 1) == 0 else -1
        self.max_tokens = <int64_t>self.pool.num_blocks * bs
        self.indexed = index is not None
        self.ref = self.pool.ref_cnt
        self.cached = self.pool.cached
        self.recent_blocks = <int32_t>check_int(recent_blocks, "recent_blocks", 0, 2**31 - 1)
        self.namer = _same
        rs_init(&self.store)

    def __dealloc__(self):
        rs_dealloc(&self.store)
        c_free(self.keys_buf.data)
        c_free(self.counts_buf.data)
        c_free(self.starts_buf.data)
        c_free(self.tokens_buf.data)
        c_free(self.rows_buf.data)
        c_free(self.cls_buf.data)
        c_free(self.copies)

    # ---- arguments ------------------------------------------------------------------
    @cython.final
    cdef int64_t load_keys(self, object keys) except -1:
        # One int key needs no array; anything else is snapshot into keys_buf.
        if type(keys) is int:
            if not INT64_MIN <= keys <= INT64_MAX:
                raise InvalidArgumentError(expected("seq_ids", "int64 keys", keys))
            self.single_key = keys
            self.kp = &self.single_key
            return 1
        cdef int64_t m = load_ints(keys, "seq_ids", cnp.NPY_INT64, &self.keys_buf)
        self.kp = <const int64_t*>self.keys_buf.data
        return m

    @cython.final
    cdef int64_t load_counts(self, object counts, int64_t m, str name, int64_t* scalar) except -1:
        # Counts into counts_buf (a scalar is repeated m times), each in [0, 2**63).
        # Per-row limits (capacity, reserved tokens) are the caller's.
        cdef int64_t i, n, k
        cdef int64_t* cp
        if type(counts) is int or not hasattr(counts, "__len__"):
            big = check_count(counts, name)
            if big > INT64_MAX:
                raise InvalidArgumentError(expected(name, "counts in [0, 2**63)", big))
            n = big
            buf_reserve(&self.counts_buf, m * 8)
            cp = <int64_t*>self.counts_buf.data
            for i in range(m):
                cp[i] = n
            scalar[0] = n
            return m
        k = load_ints(counts, name, cnp.NPY_INT64, &self.counts_buf)
        if k != m:
            raise ShapeError(expected(name, f"{m} counts (one per sequence)", k))
        cp = <int64_t*>self.counts_buf.data
        for i in range(m):
            if cp[i] < 0:
                raise InvalidArgumentError(expected(name, "counts >= 0", f"{cp[i]} at index {i}"))
        scalar[0] = -1
        return m

    @cython.final
    cdef int64_t load_tokens(self, object token_ids) except -1:
        return load_ints(token_ids, "token_ids", cnp.NPY_INT32, &self.tokens_buf)

    @cython.final
    cdef int32_t* rows_for(self, int64_t m, bint internal) except NULL:
        # Resolve the call's keys to rows; unknown and repeated keys raise, and so do
        # negative keys unless internal (the manager keys non-int ids below 0).
        # The previous call's rows are tried first: a scheduler passes the same batch
        # to reserve and commit, and mostly the same batch step after step, so most
        # keys resolve with one compare instead of a hash-table probe.
        cdef const int64_t* kp = self.kp
        cdef int64_t i, bad = -1, hints, key, bad_key = 0
        cdef int32_t r
        cdef int err = ERR_NONE
        if kp == &self.single_key:
            # A one-sequence call (admission, a prefill chunk) between two batch steps
            # must not overwrite the batch's hints.
            r = rs_find(&self.store, self.single_key)
            if r < 0 or (self.single_key < 0 and not internal):
                raise SequenceNotFoundError(self.namer(self.single_key), "seq_ids")
            self.single_row = r
            return &self.single_row
        # m + 1: an empty batch still gets a non-NULL buffer (NULL means "raised").
        buf_reserve(&self.rows_buf, (m + 1) * sizeof(int32_t))
        cdef int32_t* out = <int32_t*>self.rows_buf.data
        cdef SeqRow* rows = self.store.rows
        cdef int32_t num_rows = self.store.num_rows
        self.stamp += 1
        cdef int64_t stamp = self.stamp
        hints = self.hint_len if self.hint_len < m else m
        with nogil:
            for i in range(m):
                key = kp[i]
                r = out[i] if i < hints else -1
                if r < 0 or r >= num_rows or rows[r].key != key or not rows[r].live:
                    r = rs_find(&self.store, key)
                if r < 0 or (key < 0 and not internal):
                    err = ERR_NOT_FOUND
                    bad = i
                    bad_key = key
                    break
                if rows[r].stamp == stamp:
                    err = ERR_DUPLICATE
                    bad = i
                    bad_key = key
                    break
                rows[r].stamp = stamp
                out[i] = r
        # Every hint is verified before use, so a short call (freeing the few finished
        # sequences) keeps the batch's hints past its own length.
        if m > self.hint_len:
            self.hint_len = m
        if err == ERR_NOT_FOUND:
            raise SequenceNotFoundError(self.namer(bad_key), "seq_ids")
        if err == ERR_DUPLICATE:
            raise InvalidArgumentError(expected("seq_ids", "each sequence at most once per call",
                                                f"{self.namer(bad_key)!r} repeated at index {bad}"))
        return out

    @cython.final
    cdef SeqRow* row_of(self, object key, str name) except NULL:
        cdef int64_t k = check_int(key, name, INT64_MIN, INT64_MAX, "an int64 key")
        cdef int32_t r = rs_find(&self.store, k)
        if r < 0:
            raise SequenceNotFoundError(self.namer(k), name)
        return &self.store.rows[r]

    @cython.final
    cdef int check_room(self, int64_t need, str what) except -1:
        if need > self.pool.num_free():
            raise OutOfBlocksError(need, self.pool.num_free(), what)
        return 0

    @cython.final
    cdef int reserve_copies(self, int64_t n) except -1:
        # Room for n more copy-on-write pairs, taken before a batch applies, so the
        # apply phase cannot fail half-way.
        cdef int64_t cap = self.cap_copies
        cdef int32_t* grown
        if self.num_copies + n <= cap:
            return 0
        if cap < 16:
            cap = 16
        while cap < self.num_copies + n:
            cap *= 2
        grown = <int32_t*>realloc(self.copies, <size_t>(2 * cap) * sizeof(int32_t))
        if grown == NULL:
            raise HostMemoryError("cannot record copy-on-write pairs")
        self.copies = grown
        self.cap_copies = cap
        return 0

    # ---- shared per-row checks ------------------------------------------------------
    @cython.final
    cdef int prepare_reserve(self, SeqRow* row, int64_t n) except -1:
        # Per-row limit and table capacity for reserving n tokens; changes nothing visible.
        if n > self.max_tokens - row.num_reserved:
            return self.raise_too_long(row, n)
        cdef int64_t end = nblocks_for(row.num_reserved + n, self.block_size, self.bs_shift)
        if end - row.num_blocks > self.pool.num_blocks:
            # More new blocks than the pool has: refused before the table grows, or a
            # sliding table (whose length is not bounded by the pool) would reallocate
            # gigabytes for a hostile count, and keep them for the row's next sequences.
            return self.raise_too_long(row, n)
        return row_room_blocks(row, end)

    @cython.final
    cdef int raise_too_long(self, SeqRow* row, int64_t n) except -1:
        # n may exceed the pool; the count it would need is exact all the same.
        raise OutOfBlocksError(nblocks_for(row.num_reserved + n, self.block_size, self.bs_shift) - row.num_blocks,
                               self.pool.num_free(), "reserve")

    # ---- per attention type: full attention's steps (a kind overrides them) ---------
    cdef void commit_rows(self, SeqRow* rows, const int32_t* rp, int64_t m, const int64_t* cp,
                          const token_t* tp) noexcept nogil:
        cdef int64_t i, off = 0
        for i in range(m):
            commit_row(self, &rows[rp[i]], cp[i], tp + off if tp != NULL else NULL)
            off += cp[i]

    cdef void advance_rows(self, SeqRow* rows, const int32_t* rp, int64_t m, const token_t* tp,
                           int64_t* op) noexcept nogil:
        cdef int64_t i
        cdef SeqRow* row
        cdef int64_t c
        for i in range(m):
            row = &rows[rp[i]]
            c = row.num_reserved
            if row.num_computed < c:
                commit_row(self, row, c - row.num_computed, NULL)
            if c == row.num_known:
                row.tokens[c] = tp[i]
                row.num_known = c + 1
            reserve_one(self, row, op + i)

    cdef void settle_row(self, SeqRow* row) noexcept nogil:
        pass                     # full attention keeps every block

    cdef void release_row(self, SeqRow* row) noexcept nogil:
        release_blocks(self, row, row.num_blocks, row.num_blocks)

    cdef int check_truncate(self, SeqRow* row, int64_t n, int64_t i) except -1:
        if n > row.num_computed:
            raise InvalidArgumentError(expected(
                "num_tokens", f"at most {row.num_computed} (the committed tokens) for sequence "
                f"{self.namer(row.key)!r}", f"{n} at index {i}"))
        return 0

    cdef int check_row(self, SeqRow* row) except -1:
        if row.num_dropped:
            raise InternalError(f"sequence {row.key}: released blocks in a full-attention table")
        return 0

    # ---- Python API: lifecycle ------------------------------------------------------
    def add(self, key, tokens=None, ns=0, ns_hash=0, priority=-1, bint lookup=True, max_hit_blocks=None):
        """Add a sequence; returns the prompt tokens served from the prefix cache.

        Only full blocks are reused, and never the whole prompt: the last prompt token
        must still be computed to produce the first output, so a fully cached,
        block-aligned prompt reuses one block less. ``max_hit_blocks`` caps the reuse
        (the manager's layer groups reuse only what every group holds).
        """
        cdef int64_t k = check_int(key, "seq_id", INT64_MIN, INT64_MAX, "an int64 key")
        cdef int8_t prio = <int8_t>check_int(priority, "priority", -1, 127, "an int in [0, 127] or -1 (default rule)")
        cdef int32_t ns_id = <int32_t>check_int(ns, "ns", 0, 2**31 - 1)
        cdef uint64_t nh = check_u64(ns_hash, "ns_hash")
        cdef int64_t ntok = 0, max_hit, cap = -1
        cdef int32_t r, nhit = 0
        cdef SeqRow* row
        if max_hit_blocks is not None:
            cap = check_int(max_hit_blocks, "max_hit_blocks", 0, INT64_MAX, "an int >= 0 or None")
        if rs_find(&self.store, k) >= 0:
            raise SequenceExistsError(self.namer(k))
        if tokens is not None:
            ntok = self.load_tokens(tokens)
        r = rs_add(&self.store, k)
        row = &self.store.rows[r]
        max_hit = (ntok - 1) // self.block_size if ntok else 0
        if max_hit > self.pool.num_blocks:
            max_hit = self.pool.num_blocks
        if 0 <= cap < max_hit:
            max_hit = cap
        try:
            row_grow_tokens(row, ntok)
            row_grow_blocks(row, max_hit + 1)
        except BaseException:
            rs_remove(&self.store, r)
            raise
        row.priority = prio
        row.prompt_len = ntok
        row.num_known = ntok
        row.cur.ns_id = ns_id
        row.cur.ns_hash = nh
        if ntok:
            memcpy(row.tokens, self.tokens_buf.data, <size_t>ntok * sizeof(token_t))
        if self.index is not None:
            row.cur.last_hash = self.index.first_parent(nh)
            if lookup and ntok:
                nhit = self.pool.take_prefix(row.tokens, ntok, <int32_t>max_hit, row.blocks, &row.cur)
                row.num_blocks = row.num_prefix_hit = nhit
                row.num_computed = row.num_reserved = <int64_t>nhit * self.block_size
                self.num_query_tokens += ntok
                self.num_hit_tokens += <int64_t>nhit * self.block_size
                self.settle_row(row)
        return <int64_t>nhit * self.block_size

    def remove(self, keys, bint internal=False):
        """Free sequences (int64 keys): their blocks return to the pool, tail first."""
        cdef int64_t m = self.load_keys(keys), i, most = 0
        cdef int32_t* rp = self.rows_for(m, internal)
        cdef SeqRow* rows = self.store.rows
        for i in range(m):
            if rows[rp[i]].num_blocks > most:
                most = rows[rp[i]].num_blocks
        buf_reserve(&self.cls_buf, most * sizeof(int32_t))
        for i in range(m):
            self.release_row(&rows[rp[i]])
            rs_remove(&self.store, rp[i])

    def fork(self, src, dst):
        """``dst`` shares every block of ``src`` that holds committed tokens."""
        cdef int64_t sk = check_int(src, "src", INT64_MIN, INT64_MAX, "an int64 key")
        cdef int64_t dk = check_int(dst, "dst", INT64_MIN, INT64_MAX, "an int64 key")
        cdef int32_t rs = rs_find(&self.store, sk), rd, i, nb
        cdef int64_t known
        cdef SeqRow* s
        cdef SeqRow* d
        if rs < 0:
            raise SequenceNotFoundError(self.namer(sk), "src")
        if rs_find(&self.store, dk) >= 0:
            raise SequenceExistsError(self.namer(dk), "dst")
        rd = rs_add(&self.store, dk)
        s = &self.store.rows[rs]      # rs_add may have moved the rows
        d = &self.store.rows[rd]
        nb = <int32_t>nblocks_for(s.num_computed, self.block_size, self.bs_shift)
        known = s.num_computed if s.num_computed < s.num_known else s.num_known
        try:
            row_grow_blocks(d, nb + 1)
            row_grow_tokens(d, known)
        except BaseException:
            rs_remove(&self.store, rd)
            raise
        d.num_known = known
        if known:
            memcpy(d.tokens, s.tokens, <size_t>known * sizeof(token_t))
        memcpy(d.blocks, s.blocks, <size_t>nb * sizeof(block_id_t))
        d.num_blocks = nb
        d.num_computed = d.num_reserved = s.num_computed
        d.prompt_len = s.prompt_len
        d.num_prefix_hit = s.num_prefix_hit
        d.priority = s.priority
        d.cur = s.cur
        d.num_dropped = s.num_dropped
        d.hold = s.hold
        for i in range(nb):
            if d.blocks[i] >= 0:      # a sliding row's released entries are -1
                self.pool.incref(d.blocks[i])

    def reserve(self, keys, counts, bint internal=False):
        """Slots for the next ``counts`` tokens of each sequence, concatenated (int64).

        All or nothing across the batch. New blocks are taken only at block
        boundaries; a shared partial last block is first swapped for a private copy
        (see ``take_copies``).
        """
        cdef int64_t m = self.load_keys(keys), i, n, scalar, need = 0, ncow = 0, total = 0, b
        self.load_counts(counts, m, "num_tokens", &scalar)
        cdef const int64_t* cp = <const int64_t*>self.counts_buf.data
        cdef int32_t* rp = self.rows_for(m, internal)
        cdef SeqRow* rows = self.store.rows
        cdef SeqRow* row
        for i in range(m):
            row = &rows[rp[i]]
            n = cp[i]
            self.prepare_reserve(row, n)
            need += row_need(row, n, self.block_size, self.bs_shift, self.ref, self.cached)
            ncow += row_needs_copy(row, n, self.block_size, self.bs_shift, self.ref, self.cached)
            total += n
        self.check_room(need, "reserve")
        self.reserve_copies(ncow)
        cdef cnp.ndarray out = new_i64(total)
        cdef int64_t* op = <int64_t*>cnp.PyArray_DATA(out)
        with nogil:
            for i in range(m):
                reserve_row(self, &rows[rp[i]], cp[i], op)
                op += cp[i]
        return out

    def blocks_needed(self, keys, counts, bint internal=False):
        """Blocks ``reserve(keys, counts)`` would take from the pool now (new blocks and
        copy-on-write copies); changes nothing. Raises what reserve would raise for
        unknown keys, bad counts or a sequence past its capacity."""
        cdef int64_t m = self.load_keys(keys), i, scalar, need = 0
        self.load_counts(counts, m, "num_tokens", &scalar)
        cdef const int64_t* cp = <const int64_t*>self.counts_buf.data
        cdef int32_t* rp = self.rows_for(m, internal)
        cdef SeqRow* row
        for i in range(m):
            row = &self.store.rows[rp[i]]
            if cp[i] > self.max_tokens - row.num_reserved:
                self.raise_too_long(row, cp[i])
            need += row_need(row, cp[i], self.block_size, self.bs_shift, self.ref, self.cached)
        return need

    def commit(self, keys, counts, token_ids=None, bint internal=False):
        """Mark the next ``counts`` reserved tokens of each sequence as computed.

        ``token_ids`` (optional, int32, concatenated in batch order) are the ids of
        those positions; ids already known (the prompt) must match. Without them a
        sequence whose committed tokens outrun its known ids stops registering blocks.
        Blocks that became full are registered in the prefix index.
        """
        cdef int64_t m = self.load_keys(keys), i, n, scalar, total = 0, nt = 0, off, p, c
        self.load_counts(counts, m, "num_tokens", &scalar)
        cdef const int64_t* cp = <const int64_t*>self.counts_buf.data
        if token_ids is not None:
            nt = self.load_tokens(token_ids)
        cdef const token_t* tp = <const token_t*>self.tokens_buf.data if token_ids is not None else NULL
        cdef int32_t* rp = self.rows_for(m, internal)
        cdef SeqRow* rows = self.store.rows
        cdef SeqRow* row
        for i in range(m):
            row = &rows[rp[i]]
            n = cp[i]
            if n > row.num_reserved - row.num_computed:
                raise InvalidArgumentError(expected(
                    "num_tokens", f"at most {row.num_reserved - row.num_computed} (reserved, not yet committed) "
                    f"for sequence {self.namer(row.key)!r}", f"{n} at index {i}"))
            total += n
        if tp != NULL:
            if nt != total:
                raise ShapeError(expected("token_ids", f"{total} ids (the sum of num_tokens)", nt))
            off = 0
            for i in range(m):
                row = &rows[rp[i]]
                n = cp[i]
                c = row.num_computed
                for p in range(c, min(row.num_known, c + n)):
                    if row.tokens[p] != tp[off + p - c]:
                        raise InvalidArgumentError(expected(
                            "token_ids", f"id {row.tokens[p]} at position {p} of sequence "
                            f"{self.namer(row.key)!r} (already known)", tp[off + p - c]))
                row_room_tokens(row, c + n)
                off += n
        with nogil:
            self.commit_rows(rows, rp, m, cp, tp)

    def advance(self, keys, token_ids, bint internal=False):
        """One decode step in one crossing: commit every reserved token of each sequence
        (the previous step's KV is written), then reserve one slot for its next token,
        whose id is ``token_ids[i]`` (int32). Returns the int64 slots. All or nothing.
        """
        cdef int64_t m = self.load_keys(keys), i, c, nt, need = 0, ncow = 0, b
        nt = self.load_tokens(token_ids)
        if nt != m:
            raise ShapeError(expected("token_ids", f"{m} ids (one per sequence)", nt))
        cdef const token_t* tp = <const token_t*>self.tokens_buf.data
        cdef int32_t* rp = self.rows_for(m, internal)
        cdef SeqRow* rows = self.store.rows
        cdef SeqRow* row
        cdef int32_t bs = self.block_size, sh = self.bs_shift
        cdef const int32_t* ref = self.ref
        cdef const uint8_t* cached = self.cached
        # validation: the same per-row arithmetic as row_need(row, 1), unrolled for the
        # decode step that runs for every sequence every step
        for i in range(m):
            row = &rows[rp[i]]
            c = row.num_reserved
            if c < row.num_known and row.tokens[c] != tp[i]:
                raise InvalidArgumentError(expected(
                    "token_ids", f"id {row.tokens[c]} at position {c} of sequence {self.namer(row.key)!r} "
                    "(already known)", tp[i]))
            if c >= row.cap_tokens or row.num_blocks >= row.cap_blocks or c >= self.max_tokens:
                row_room_tokens(row, c + 1)          # rare: grow, or refuse past capacity
                self.prepare_reserve(row, 1)
            if off_of(c, bs, sh) == 0:
                need += 1
            elif must_copy_at(ref, cached, row.blocks[row.num_blocks - 1]):
                need += 1
                ncow += 1
        self.check_room(need, "advance")
        self.reserve_copies(ncow)
        cdef cnp.ndarray out = new_i64(m)
        cdef int64_t* op = <int64_t*>cnp.PyArray_DATA(out)
        with nogil:
            self.advance_rows(rows, rp, m, tp, op)
        return out

    def unreserve(self, keys, counts=None, bint internal=False):
        """Give back reserved, uncommitted tokens (all of them when ``counts`` is None),
        e.g. after a failed forward pass. Blocks no longer covering a reserved token are
        released. Committed tokens are never touched."""
        cdef int64_t m = self.load_keys(keys), i, n, keep, scalar = -1
        if counts is not None:
            self.load_counts(counts, m, "num_tokens", &scalar)
        cdef const int64_t* cp = <const int64_t*>self.counts_buf.data
        cdef int32_t* rp = self.rows_for(m, internal)
        cdef SeqRow* rows = self.store.rows
        cdef SeqRow* row
        for i in range(m):
            row = &rows[rp[i]]
            n = cp[i] if counts is not None else row.num_reserved - row.num_computed
            if n > row.num_reserved - row.num_computed:
                raise InvalidArgumentError(expected(
                    "num_tokens", f"0..{row.num_reserved - row.num_computed} (reserved, uncommitted) for sequence "
                    f"{self.namer(row.key)!r}", f"{n} at index {i}"))
        for i in range(m):
            row = &rows[rp[i]]
            n = cp[i] if counts is not None else row.num_reserved - row.num_computed
            row.num_reserved -= n
            keep = nblocks_for(row.num_reserved, self.block_size, self.bs_shift)
            if keep < row.num_blocks:
                self.pool.release_batch(row.blocks + keep, row.num_blocks - keep, NULL, 0)
                row.num_blocks = <int32_t>keep

    def truncate(self, keys, counts, bint internal=False, bint check_only=False):
        """Drop the last ``counts`` committed tokens of each sequence (rollback of
        rejected draft tokens); reserved, uncommitted slots after them go back too.

        Blocks left covering no token return to the pool, tail first. A block that
        stays is never written in place while shared or registered: the next reserve
        copies it first (copy-on-write), so forks and prefix hits keep their KV. The
        prefix cursor steps back to the last full block that remains; if that block's
        chain was evicted meanwhile, the sequence stops registering (a later lookup can
        only miss). All or nothing; ``check_only`` validates and changes nothing."""
        cdef int64_t m = self.load_keys(keys), i, n, keep, L, scalar, most = 0, nh, j
        self.load_counts(counts, m, "num_tokens", &scalar)
        cdef const int64_t* cp = <const int64_t*>self.counts_buf.data
        cdef int32_t* rp = self.rows_for(m, internal)
        cdef SeqRow* rows = self.store.rows
        cdef SeqRow* row
        cdef int32_t bs = self.block_size, sh = self.bs_shift, got
        cdef block_id_t t
        cdef block_id_t* scratch
        for i in range(m):
            row = &rows[rp[i]]
            self.check_truncate(row, cp[i], i)
            nh = blk_of(row.num_computed - cp[i], bs, sh)
            if nh > most:
                most = nh
        if check_only:
            return
        buf_reserve(&self.cls_buf, most * sizeof(block_id_t))   # the cursor walk's scratch
        scratch = <block_id_t*>self.cls_buf.data
        for i in range(m):
            row = &rows[rp[i]]
            L = row.num_computed - cp[i]
            keep = nblocks_for(L, bs, sh)
            if keep < row.num_blocks:
                n = row.num_blocks - keep
                for j in range(n // 2):       # tail first: the last block is evicted first
                    t = row.blocks[keep + j]
                    row.blocks[keep + j] = row.blocks[row.num_blocks - 1 - j]
                    row.blocks[row.num_blocks - 1 - j] = t
                if self.pool.release_batch(row.blocks + keep, n, NULL, 0) >= 0:
                    raise InternalError(f"truncate: sequence {self.namer(row.key)!r} held a block "
                                        "the pool counts as free (a bug)")
                row.num_blocks = <int32_t>keep
            row.num_computed = row.num_reserved = L
            if row.num_known > L:
                row.num_known = L
            if row.prompt_len > L:
                row.prompt_len = L
            if row.num_prefix_hit > keep:
                row.num_prefix_hit = <int32_t>keep
            nh = blk_of(L, bs, sh)
            if row.cur.num_hashed > nh:
                if row.cur.track and self.indexed:
                    got = self.index.lookup(row.tokens, nh * bs, row.cur.ns_id, row.cur.ns_hash,
                                            scratch, &row.cur, <int32_t>nh)
                    if got < nh:
                        row.cur.track = 0
                else:
                    row.cur.num_hashed = <int32_t>nh

    def take_copies(self):
        """Pending copy-on-write pairs as an int32 ``[P, 2]`` array of (src, dst); clears them.

        The KV of ``src`` must be copied to ``dst`` before the reserved slots are written.
        """
        cdef cnp.ndarray out = new_i32(2 * self.num_copies)
        if self.num_copies:
            memcpy(cnp.PyArray_DATA(out), self.copies, <size_t>(2 * self.num_copies) * sizeof(int32_t))
        self.num_copies = 0
        return out.reshape(-1, 2)

    @property
    def num_pending_copies(self):
        return self.num_copies

    def set_priority(self, key, priority, start_token=0, end_token=None):
        """Eviction class for a sequence, or for the blocks covering a token range.

        Applies when its blocks are freed under the ``priority`` policy (0 is evicted
        first). Without a range the whole sequence gets the class. A range may reach
        past the reserved tokens, up to the pool's capacity.
        """
        cdef SeqRow* row = self.row_of(key, "seq_id")
        cdef int8_t prio = <int8_t>check_int(priority, "priority", 0, 127)
        cdef int64_t start = check_int(start_token, "start_token", 0, INT64_MAX, "an int >= 0")
        cdef int64_t end, i, cap
        if end_token is None and start == 0:
            row.priority = prio
            return
        end = row.num_reserved if end_token is None else check_int(
            end_token, "end_token", 1, self.max_tokens, f"an int in [1, {self.max_tokens}] (the pool's capacity in tokens)")
        if not start < end:
            raise InvalidArgumentError(expected("start_token, end_token", "0 <= start < end", f"{start}, {end}"))
        row_grow_blocks(row, nblocks_for(end, self.block_size, self.bs_shift))
        if row.block_cls == NULL:
            cap = row.cap_blocks if row.cap_blocks > 0 else 1
            row.block_cls = <int8_t*>malloc(<size_t>cap * sizeof(int8_t))
            if row.block_cls == NULL:
                raise HostMemoryError("cannot allocate per-block classes")
            memset(row.block_cls, 0xff, <size_t>cap * sizeof(int8_t))
        for i in range(start // self.block_size, nblocks_for(end, self.block_size, self.bs_shift)):
            row.block_cls[i] = prio

    # ---- Python API: exports (see pagedkv._core.export) ------------------------------
    def block_table(self, keys, pad=-1, width=None, bint internal=False):
        """Padded ``[B, width]`` int32 block tables (width defaults to the longest)."""
        cdef int32_t p = <int32_t>check_int(pad, "pad", -2**31, 2**31 - 1)
        cdef int64_t m = self.load_keys(keys)
        return padded_table(self.store.rows, self.rows_for(m, internal), m, p, width, self.sink_blocks)

    def csr(self, keys, bint internal=False):
        """FlashInfer's page table: ``(indptr, indices, last_page_len)``, all int32.

        Covers every reserved token; ``last_page_len`` is 0 for an empty sequence.
        """
        cdef int64_t m = self.load_keys(keys)
        return csr_table(self.store.rows, self.rows_for(m, internal), m, self.block_size, self.sink_blocks)

    def slot_mapping(self, keys, starts, counts, bint internal=False):
        """int64 slots of positions ``[start, start + count)`` of each sequence, concatenated."""
        cdef int64_t m = self.load_keys(keys)
        cdef int64_t ns = load_ints(starts, "starts", cnp.NPY_INT64, &self.starts_buf)
        cdef int64_t nc = load_ints(counts, "counts", cnp.NPY_INT64, &self.counts_buf)
        if ns != m or nc != m:
            raise ShapeError(expected("starts, counts", f"{m} entries each", f"{ns}, {nc}"))
        return slots_of(self.store.rows, self.rows_for(m, internal), m, <const int64_t*>self.starts_buf.data,
                        <const int64_t*>self.counts_buf.data, self.block_size, self.bs_shift, self.namer,
                        self.sink_blocks)

    def seq_lens(self, keys, bint computed=False, bint internal=False):
        """Tokens per sequence (int64): reserved (default) or committed."""
        cdef int64_t m = self.load_keys(keys)
        return lengths(self.store.rows, self.rows_for(m, internal), m, computed)

    def hold_window(self, keys, bint hold=True, bint internal=False):
        """Hold (or stop holding) blocks that leave a sliding window, per sequence.

        Full attention releases nothing, so there is nothing to hold: the keys are
        checked and nothing changes."""
        self.rows_for(self.load_keys(keys), internal)

    def slide(self, keys, bint internal=False):
        """Release the blocks that left each sequence's sliding window now: none under
        full attention (the keys are checked)."""
        self.rows_for(self.load_keys(keys), internal)

    def released_tokens(self, keys, bint internal=False):
        """Per sequence (int64), the tokens a sliding-window table released: positions
        ``[sinks_end, sinks_end + released)`` with ``sinks_end = sink_blocks * block_size``.
        CSR exports and gathers cover the other ``seq_len - released`` positions."""
        cdef int64_t m = self.load_keys(keys), i
        cdef int32_t* rp = self.rows_for(m, internal)
        cdef cnp.ndarray out = new_i64(m)
        cdef int64_t* op = <int64_t*>cnp.PyArray_DATA(out)
        for i in range(m):
            op[i] = <int64_t>self.store.rows[rp[i]].num_dropped * self.block_size
        return out

    def relocate(self, key, moves):
        """Move blocks of one sequence's table into free blocks chosen by the caller.

        ``moves``: int ``[P, 2]`` of (block in this sequence's table, free block). Each
        new block is taken from the pool and replaces the old one at its position, and
        the old block is released. Only blocks this sequence holds alone move: a block
        shared with a fork or another sequence's prefix hit is refused
        (``InvalidBlockError``), since moving it for one holder would leave the others on
        the old block and cost a block instead of freeing one. A registered prefix block
        stays registered where it is, as cached-free with its content intact (as after a
        copy-on-write), so later prefix hits still find it. Counts, token ids, namespace
        and priorities are untouched. All or nothing.

        Returns the int32 ``[P, 2]`` (old, new) pairs: the caller copies their KV before
        the pool allocates again (the old blocks' data is intact until then).
        """
        cdef SeqRow* row = self.row_of(key, "seq_id")
        try:
            pairs = np.array(moves, copy=True)
        except (TypeError, ValueError, OverflowError):
            pairs = None
        if pairs is None or pairs.dtype.kind not in "iu" or pairs.size and pairs.dtype.kind == "u" and pairs.max() > 2**62:
            raise ArgumentTypeError(expected("moves", "an int [P, 2] array of (old block, new block)",
                                             type(moves).__name__ if pairs is None else f"{pairs.dtype} values"))
        pairs = pairs.astype(np.int64)
        if pairs.ndim != 2 or pairs.shape[1] != 2:
            raise ShapeError(expected("moves", "an int [P, 2] array of (old block, new block)", pairs.shape))
        cdef int64_t p = pairs.shape[0], i, pos
        if p == 0:
            return new_i32(0).reshape(0, 2)
        position = {}
        for i in range(row.num_blocks):
            if row.blocks[i] >= 0:
                position[row.blocks[i]] = i
        olds = pairs[:, 0].tolist()
        at = []
        for i in range(p):
            pos = position.get(olds[i], -1)
            if pos < 0:
                raise InvalidBlockError(expected("moves", f"old blocks of sequence {self.namer(row.key)!r}'s table",
                                                 f"block {olds[i]} at row {i}"))
            at.append(pos)
        if len(set(at)) != p:
            raise InvalidArgumentError(expected("moves", "each old block at most once", olds))
        for i in range(p):
            if self.pool.ref_cnt[<block_id_t>olds[i]] != 1:
                raise InvalidBlockError(expected("moves", "old blocks held by this sequence only",
                                                 f"block {olds[i]} at row {i}, held by "
                                                 f"{self.pool.ref_cnt[<block_id_t>olds[i]]} sequences"))
        news = pairs[:, 1]
        if news.min() < 0 or news.max() >= self.pool.num_blocks:
            raise InvalidBlockError(expected("moves", f"new block ids in [0, {self.pool.num_blocks})",
                                             news.tolist()))
        out = np.ascontiguousarray(pairs.astype(np.int32))
        cdef int32_t[:, ::1] ov = out
        cdef cnp.ndarray newc = np.ascontiguousarray(out[:, 1])
        cdef cnp.ndarray oldc = np.ascontiguousarray(out[:, 0])
        self.pool.check_takeable(<const block_id_t*>cnp.PyArray_DATA(newc), p, "moves")
        self.pool.take_into(<const block_id_t*>cnp.PyArray_DATA(newc), p)
        for i in range(p):
            row.blocks[<int64_t>at[i]] = ov[i, 1]
        if self.pool.release_batch(<const block_id_t*>cnp.PyArray_DATA(oldc), p, NULL, 0) >= 0:
            raise InternalError("relocate: an old block was not in use")
        return out

    # ---- Python API: single sequences ------------------------------------------------
    def blocks(self, key):
        cdef SeqRow* row = self.row_of(key, "seq_id")
        cdef cnp.ndarray out = new_i32(row.num_blocks)
        memcpy(cnp.PyArray_DATA(out), row.blocks, <size_t>row.num_blocks * sizeof(block_id_t))
        return out

    def tokens(self, key):
        cdef SeqRow* row = self.row_of(key, "seq_id")
        cdef cnp.ndarray out = new_i32(row.num_known)
        memcpy(cnp.PyArray_DATA(out), row.tokens, <size_t>row.num_known * sizeof(token_t))
        return out

    def num_computed(self, key):
        return self.row_of(key, "seq_id").num_computed

    def num_reserved(self, key):
        return self.row_of(key, "seq_id").num_reserved

    def info(self, key):
        cdef SeqRow* row = self.row_of(key, "seq_id")
        return {"num_blocks": row.num_blocks, "num_computed": row.num_computed,
                "num_reserved": row.num_reserved, "num_known": row.num_known,
                "prompt_len": row.prompt_len, "num_hashed": row.cur.num_hashed,
                "num_prefix_hit_blocks": row.num_prefix_hit, "priority": row.priority,
                "tracking": bool(row.cur.track), "namespace": row.cur.ns_id,
                "num_dropped_blocks": row.num_dropped, "holding": bool(row.hold)}

    def __contains__(self, key):
        return type(key) is int and INT64_MIN <= key <= INT64_MAX and rs_find(&self.store, key) >= 0

    def __len__(self):
        return self.store.num_live

    @property
    def num_seqs(self):
        return self.store.num_live

    def keys(self):
        """Live sequence keys (int64 array), in no particular order."""
        cdef cnp.ndarray out = new_i64(self.store.num_live)
        cdef int64_t* op = <int64_t*>cnp.PyArray_DATA(out)
        cdef int32_t r, n = 0
        for r in range(self.store.num_rows):
            if self.store.rows[r].live:
                op[n] = self.store.rows[r].key
                n += 1
        return out

    def total_tokens(self):
        """Committed tokens over all live sequences, and internal waste in partial last blocks."""
        cdef int64_t tok = 0, waste = 0
        cdef int32_t r
        cdef SeqRow* row
        for r in range(self.store.num_rows):
            row = &self.store.rows[r]
            if row.live:
                tok += row.num_computed
                waste += <int64_t>row.num_blocks * self.block_size - row.num_reserved
        return tok, waste

    def check_invariants(self, bint pool_refs=True):
        """Audit tables against the pool: every ref_cnt equals the references held.

        ``pool_refs=False`` audits the rows only, for tables that share their pool with
        other tables (layer groups), whose references the caller adds up."""
        cdef int32_t r, i, live = 0
        cdef SeqRow* row
        held = np.zeros(self.pool.num_blocks, dtype=np.int64)
        cdef int64_t[::1] h = held
        for r in range(self.store.num_rows):
            row = &self.store.rows[r]
            if not row.live:
                continue
            live += 1
            if rs_find(&self.store, row.key) != r:
                raise InternalError(f"sequence {row.key} is not mapped to its row")
            if row.num_blocks != nblocks_for(row.num_reserved, self.block_size, self.bs_shift):
                raise InternalError(f"sequence {row.key}: {row.num_blocks} blocks for {row.num_reserved} reserved tokens")
            if not 0 <= row.num_computed <= row.num_reserved:
                raise InternalError(f"sequence {row.key}: computed {row.num_computed} > reserved {row.num_reserved}")
            if <int64_t>row.cur.num_hashed * self.block_size > row.num_computed:
                raise InternalError(f"sequence {row.key}: hashed past its computed tokens")
            if row.num_blocks > row.cap_blocks or row.num_known > row.cap_tokens:
                raise InternalError(f"sequence {row.key}: table or token list over capacity")
            self.check_row(row)
            for i in range(row.num_blocks):
                if self.sink_blocks <= i < self.sink_blocks + row.num_dropped:
                    if row.blocks[i] != -1:
                        raise InternalError(f"sequence {row.key}: released entry {i} holds block {row.blocks[i]}")
                    continue
                if not 0 <= row.blocks[i] < self.pool.num_blocks:
                    raise InternalError(f"sequence {row.key}: block {row.blocks[i]} out of range")
                h[row.blocks[i]] += 1
        if live != self.store.num_live or self.store.map.size != live:
            raise InternalError(f"{live} live rows, {self.store.num_live} counted, {self.store.map.size} mapped")
        if not pool_refs:
            return
        ref = np.asarray(self.pool._ref_view, dtype=np.int64)
        if not np.array_equal(held, ref):
            bad = int(np.flatnonzero(held != ref)[0])
            raise InternalError(f"block {bad}: ref_cnt {ref[bad]} but sequences hold {held[bad]} references")
        self.pool.check_invariants()


@cython.final
cdef class FullAttentionTables(TablesBase):
    """Full attention: a sequence keeps every block until it is removed (or truncated).

    ``window`` and ``sinks`` are accepted only as 0, so that a caller that meant a
    sliding window is told, not silently given full attention."""

    def __cinit__(self, pool, block_size, index=None, recent_blocks=4, window=0, sinks=0):
        cdef int64_t w = check_int(window, "window", 0, 2**62, "an int >= 1 (tokens), or 0 for full attention")
        if w:
            raise InvalidArgumentError(expected("window", "0 (FullAttentionTables keeps every block; "
                                                "SlidingWindowTables releases those that left a window)", w))
        cdef int64_t s = check_int(sinks, "sinks", 0, 2**62, "an int >= 0")
        if s:
            raise InvalidArgumentError(expected("sinks", "0 for full attention (window=0)", s))

    @property
    def window(self):
        """0: every query sees every earlier position."""
        return 0

    @property
    def sinks(self):
        return 0


def _is_window(window):
    # The factory's choice only: anything but a positive int goes to full attention,
    # whose checks name what is wrong with it.
    try:
        return not isinstance(window, bool) and operator.index(window) > 0
    except TypeError:
        return False


class BlockTables(metaclass=ABCMeta):
    """The tables of one attention type, picked from ``window`` and ``sinks``:
    ``FullAttentionTables`` for ``window=0`` (the default), else
    ``SlidingWindowTables`` (:mod:`pagedkv._core.sliding`).

    ``BlockTables(pool, block_size, index=None, recent_blocks=4, window=0, sinks=0)``
    returns an instance of that class; every instance of either is an instance of
    ``BlockTables``. A new attention type is a new ``TablesBase`` subclass, not a flag
    here."""

    def __new__(cls, pool, block_size, index=None, recent_blocks=4, window=0, sinks=0):
        if _is_window(window):
            from pagedkv._core.sliding import SlidingWindowTables
            return SlidingWindowTables(pool, block_size, index, recent_blocks, window, sinks)
        return FullAttentionTables(pool, block_size, index, recent_blocks, window, sinks)


BlockTables.register(TablesBase)
