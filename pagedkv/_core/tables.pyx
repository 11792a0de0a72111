# cython: language_level=3
"""BlockTables: every live sequence's block table, token counts and token ids.

A sequence's life: ``add`` (with its prompt: the longest verified cached prefix of
full blocks is reused, never the whole prompt), then per step ``reserve`` (slots for
the next tokens; new blocks only at block boundaries; copy-on-write of a shared
partial last block) and ``commit`` (the KV of those tokens is computed; blocks that
became full are registered in the prefix index), and finally ``remove``.

Batch calls take int64 key arrays and do the whole batch in one crossing. Each
validates everything first (unknown or repeated keys, counts, capacity) and then
applies, so a failed call changes nothing.

Block tables are append-only while a sequence lives, with two exceptions:
copy-on-write swaps a shared (or registered), partially filled last block for a private
copy before the first write into it (``take_copies`` hands the (src, dst) pairs to the
KV store), and ``unreserve`` drops blocks that cover only reserved, uncommitted tokens.

Negative keys are reserved for the manager's interned (non-int) ids: batch calls reject
them unless ``internal=True``. The batch loops run without the GIL, so the class is not
thread-safe on its own; :class:`pagedkv.PagedKVCache` serialises calls with a lock.
"""
cimport numpy as cnp
from libc.stdlib cimport malloc, realloc, free as c_free
from libc.string cimport memcpy, memset

from pagedkv._core.evict cimport POLICY_PRIORITY
from pagedkv._core._arrays cimport as_i32, as_i64, new_i32, new_i64

import numpy as np
from pagedkv.errors import (InternalError, InvalidArgumentError, OutOfBlocksError,
                            SequenceExistsError, SequenceNotFoundError, ShapeError, expected)

cnp.import_array()

cdef enum:
    ERR_NONE = 0
    ERR_NOT_FOUND = 1
    ERR_DUPLICATE = 2


cdef inline uint64_t mix64(uint64_t x) noexcept nogil:
    # splitmix64 finalizer: spreads sequential ids over the table
    x ^= x >> 30
    x *= <uint64_t>0xbf58476d1ce4e5b9
    x ^= x >> 27
    x *= <uint64_t>0x94d049bb133111eb
    x ^= x >> 31
    return x


cdef inline int64_t cdiv(int64_t a, int64_t b) noexcept nogil:
    return (a + b - 1) // b


# Block arithmetic without integer division when block_size is a power of two (a 64-bit
# divide costs tens of cycles; a decode step does a few per sequence).
cdef inline int64_t blk_of(int64_t p, int32_t bs, int32_t shift) noexcept nogil:
    return (p >> shift) if shift >= 0 else p // bs


cdef inline int64_t off_of(int64_t p, int32_t bs, int32_t shift) noexcept nogil:
    return (p & (bs - 1)) if shift >= 0 else p % bs


cdef inline bint must_copy(const int32_t* ref, const uint8_t* cached, block_id_t last) noexcept nogil:
    # Copy-on-write before writing into a partially filled last block that another
    # sequence also references, or that is registered in the prefix index: a fork can
    # share a block its parent later fills and registers, and registered KV is
    # immutable (a later prefix hit must find exactly what was registered).
    return ref[last] > 1 or cached[last]


cdef inline int64_t nblocks_for(int64_t n, int32_t bs, int32_t shift) noexcept nogil:
    return ((n + bs - 1) >> shift) if shift >= 0 else (n + bs - 1) // bs


cdef class BlockTables:
    def __cinit__(self, BlockPool pool, int32_t block_size, PrefixIndex index=None,
                  int32_t recent_blocks=4):
        if block_size < 1:
            raise InvalidArgumentError(expected("block_size", "an int >= 1", block_size))
        if index is not None and index.block_size != block_size:
            raise InvalidArgumentError(expected("index", f"a PrefixIndex with block_size {block_size}",
                                                index.block_size))
        if index is not None and pool.index is not index:
            raise InvalidArgumentError(expected("index", "the PrefixIndex the pool was built with", "another one"))
        if recent_blocks < 0:
            raise InvalidArgumentError(expected("recent_blocks", "an int >= 0", recent_blocks))
        self.pool = pool
        self.index = index
        self.block_size = block_size
        self.bs_shift = -1
        if block_size & (block_size - 1) == 0:
            self.bs_shift = block_size.bit_length() - 1
        self.recent_blocks = recent_blocks
        self.cap_rows = 16
        self.rows = <SeqRow*>malloc(self.cap_rows * sizeof(SeqRow))
        self.free_rows = <int32_t*>malloc(self.cap_rows * sizeof(int32_t))
        self.map_mask = 63
        self.map_keys = <int64_t*>malloc((self.map_mask + 1) * sizeof(int64_t))
        self.map_vals = <int32_t*>malloc((self.map_mask + 1) * sizeof(int32_t))
        if not (self.rows and self.free_rows and self.map_keys and self.map_vals):
            raise MemoryError("cannot allocate block tables")
        memset(self.map_vals, 0xff, (self.map_mask + 1) * sizeof(int32_t))

    def __dealloc__(self):
        cdef int32_t r
        if self.rows != NULL:
            for r in range(self.num_rows):
                c_free(self.rows[r].blocks)
                c_free(self.rows[r].block_cls)
                c_free(self.rows[r].tokens)
        c_free(self.rows)
        c_free(self.free_rows)
        c_free(self.map_keys)
        c_free(self.map_vals)
        c_free(self.scratch_rows)
        c_free(self.copies)

    # ---- key -> row map ---------------------------------------------------------------
    cdef int32_t find_row(self, seq_key_t key) noexcept nogil:
        cdef uint64_t i = mix64(<uint64_t>key) & self.map_mask
        cdef int32_t v
        while True:
            v = self.map_vals[i]
            if v < 0:
                return -1
            if self.map_keys[i] == key:
                return v
            i = (i + 1) & self.map_mask

    cdef int map_insert(self, seq_key_t key, int32_t row) except -1:
        cdef uint64_t i, cap, old_cap
        cdef int64_t* old_keys
        cdef int32_t* old_vals
        if 2 * (<uint64_t>self.num_seqs + 1) > self.map_mask + 1:
            old_cap = self.map_mask + 1
            old_keys = self.map_keys
            old_vals = self.map_vals
            cap = old_cap * 2
            self.map_keys = <int64_t*>malloc(cap * sizeof(int64_t))
            self.map_vals = <int32_t*>malloc(cap * sizeof(int32_t))
            if not (self.map_keys and self.map_vals):
                c_free(self.map_keys)
                c_free(self.map_vals)
                self.map_keys = old_keys
                self.map_vals = old_vals
                raise MemoryError("cannot grow the sequence map")
            memset(self.map_vals, 0xff, cap * sizeof(int32_t))
            self.map_mask = cap - 1
            for i in range(old_cap):
                if old_vals[i] >= 0:
                    self._place(old_keys[i], old_vals[i])
            c_free(old_keys)
            c_free(old_vals)
        self._place(key, row)
        return 0

    cdef void _place(self, seq_key_t key, int32_t row) noexcept nogil:
        cdef uint64_t i = mix64(<uint64_t>key) & self.map_mask
        while self.map_vals[i] >= 0:
            i = (i + 1) & self.map_mask
        self.map_keys[i] = key
        self.map_vals[i] = row

    cdef void map_delete(self, seq_key_t key) noexcept nogil:
        cdef uint64_t i = mix64(<uint64_t>key) & self.map_mask, j, k
        while self.map_keys[i] != key or self.map_vals[i] < 0:
            i = (i + 1) & self.map_mask
        j = i
        while True:
            j = (j + 1) & self.map_mask
            if self.map_vals[j] < 0:
                break
            k = mix64(<uint64_t>self.map_keys[j]) & self.map_mask
            if (i <= j and (k <= i or k > j)) or (i > j and (k <= i and k > j)):
                self.map_keys[i] = self.map_keys[j]
                self.map_vals[i] = self.map_vals[j]
                i = j
        self.map_vals[i] = -1

    # ---- rows -------------------------------------------------------------------------
    cdef int32_t new_row(self) except -1:
        cdef int32_t r
        cdef SeqRow* grown
        cdef int32_t* grown_free
        if self.num_free_rows:
            self.num_free_rows -= 1
            return self.free_rows[self.num_free_rows]
        if self.num_rows == self.cap_rows:
            grown = <SeqRow*>realloc(self.rows, 2 * self.cap_rows * sizeof(SeqRow))
            if grown == NULL:
                raise MemoryError("cannot grow the block tables")
            self.rows = grown
            grown_free = <int32_t*>realloc(self.free_rows, 2 * self.cap_rows * sizeof(int32_t))
            if grown_free == NULL:
                raise MemoryError("cannot grow the block tables")
            self.free_rows = grown_free
            self.cap_rows *= 2
        r = self.num_rows
        self.num_rows += 1
        memset(&self.rows[r], 0, sizeof(SeqRow))
        return r

    cdef int grow_blocks(self, SeqRow* row, int64_t need) except -1 nogil:
        cdef int64_t cap = row.cap_blocks
        cdef block_id_t* nb
        cdef int8_t* nc
        if need <= cap:
            return 0
        if cap < 8:
            cap = 8
        while cap < need:
            cap *= 2
        nb = <block_id_t*>realloc(row.blocks, cap * sizeof(block_id_t))
        if nb == NULL:
            with gil:
                raise MemoryError("cannot grow a block table")
        row.blocks = nb
        if row.block_cls != NULL:
            nc = <int8_t*>realloc(row.block_cls, cap * sizeof(int8_t))
            if nc == NULL:
                with gil:
                    raise MemoryError("cannot grow a block table")
            memset(nc + row.cap_blocks, 0xff, (cap - row.cap_blocks) * sizeof(int8_t))
            row.block_cls = nc
        row.cap_blocks = <int32_t>cap
        return 0

    cdef int grow_tokens(self, SeqRow* row, int64_t need) except -1 nogil:
        cdef int64_t cap = row.cap_tokens
        cdef token_t* nt
        if need <= cap:
            return 0
        if cap < 64:
            cap = 64
        while cap < need:
            cap *= 2
        nt = <token_t*>realloc(row.tokens, cap * sizeof(token_t))
        if nt == NULL:
            with gil:
                raise MemoryError("cannot grow a token list")
        row.tokens = nt
        row.cap_tokens = cap
        return 0

    cdef int64_t prep_keys(self, object keys) except -1:
        # Point self.kp at the call's keys: a lone int needs no array at all.
        cdef cnp.ndarray a
        if type(keys) is int:
            if not -2**63 <= keys < 2**63:
                raise InvalidArgumentError(expected("seq_ids", "int64 keys", keys))
            self.single_key = keys
            self.kp = &self.single_key
            return 1
        a = as_i64(keys, "seq_ids")
        self.keys_holder = a
        self.kp = <const int64_t*>cnp.PyArray_DATA(a)
        return cnp.PyArray_DIM(a, 0)

    cdef int32_t* rows_for(self, int64_t m, bint internal=False) except NULL:
        # Resolve the keys prepared by prep_keys to rows for one batch call; unknown and
        # repeated keys raise, and so do negative keys unless internal (the manager keys
        # non-int ids below 0).
        # The previous call's rows are tried first: a scheduler passes the same batch
        # to reserve and commit, and mostly the same batch step after step, so most
        # keys resolve with one compare instead of a hash-table probe.
        cdef const int64_t* kp = self.kp
        cdef int64_t i, bad = -1, hints
        cdef int32_t r
        cdef int err = ERR_NONE
        cdef int32_t* out
        cdef SeqRow* rows
        cdef int64_t stamp
        cdef int64_t key
        if m > self.scratch_cap:
            c_free(self.scratch_rows)
            self.hint_len = 0
            self.scratch_rows = <int32_t*>malloc(max(m, 64) * sizeof(int32_t))
            if self.scratch_rows == NULL:
                self.scratch_cap = 0
                raise MemoryError("cannot allocate a batch buffer")
            self.scratch_cap = max(m, 64)
        self.stamp += 1
        stamp = self.stamp
        out = self.scratch_rows
        rows = self.rows
        hints = self.hint_len if self.hint_len < m else m
        with nogil:
            for i in range(m):
                key = kp[i]
                r = out[i] if i < hints else -1
                if r < 0 or r >= self.num_rows or rows[r].key != key or not rows[r].live:
                    r = self.find_row(key)
                if r < 0 or (key < 0 and not internal):
                    err = ERR_NOT_FOUND
                    bad = i
                    break
                if rows[r].stamp == stamp:
                    err = ERR_DUPLICATE
                    bad = i
                    break
                rows[r].stamp = stamp
                out[i] = r
        self.hint_len = m if bad < 0 else bad
        if err == ERR_NOT_FOUND:
            raise SequenceNotFoundError(kp[bad], "seq_ids")
        if err == ERR_DUPLICATE:
            raise InvalidArgumentError(expected("seq_ids", "each sequence at most once per call",
                                                f"{kp[bad]} repeated at index {bad}"))
        return out

    cdef int push_copy(self, block_id_t src, block_id_t dst) except -1 nogil:
        cdef int64_t cap
        cdef int32_t* grown
        if self.num_copies == self.cap_copies:
            cap = 16 if self.cap_copies == 0 else 2 * self.cap_copies
            grown = <int32_t*>realloc(self.copies, 2 * cap * sizeof(int32_t))
            if grown == NULL:
                with gil:
                    raise MemoryError("cannot record a copy-on-write")
            self.copies = grown
            self.cap_copies = cap
        self.copies[2 * self.num_copies] = src
        self.copies[2 * self.num_copies + 1] = dst
        self.num_copies += 1
        self.num_cow += 1
        return 0

    cdef int copy_on_write(self, SeqRow* row) except -1 nogil:
        # Swap the last (partial) block for a private copy before writing into it; the
        # caller has counted the new block in its capacity check. The old block keeps its
        # other references, or, if it was registered and ours was the last, becomes
        # cached-free with its registered content intact.
        cdef block_id_t fresh
        cdef block_id_t* last = &row.blocks[row.num_blocks - 1]
        self.pool.alloc_into(&fresh, 1)
        self.push_copy(last[0], fresh)
        self.pool.release_batch(last, 1, NULL, 0)
        last[0] = fresh
        return 0

    cdef void register_full_blocks(self, SeqRow* row) noexcept nogil:
        # Offer every newly full block to the prefix index, in order. A block whose
        # content is already registered elsewhere stays private (a duplicate); a true
        # hash collision, or a parent that was evicted meanwhile, ends registration
        # for this sequence. Either way a later lookup can only miss, never mismatch.
        cdef int32_t bs = self.block_size
        cdef int32_t i
        cdef block_id_t b, c, parent
        cdef hash_t h
        cdef const token_t* toks
        while row.track and <int64_t>(row.num_hashed + 1) * bs <= row.num_computed:
            i = row.num_hashed
            if i > 0 and not self.index.canon_valid(row.canon_block, row.canon_gen):
                row.track = 0
                return
            parent = row.canon_block if i > 0 else -1
            b = row.blocks[i]
            toks = row.tokens + <int64_t>i * bs
            h = self.index.hash_block(toks, row.last_hash, row.ns_hash)
            c = self.index.find(h)
            if c < 0:
                if self.pool.cached[b]:
                    row.track = 0   # b already holds other content (cannot happen for a private block)
                    return
                self.index.insert(b, h, row.last_hash, toks, row.ns_id, parent, row.canon_gen)
                self.pool.cached[b] = 1
                c = b
            elif c != b and not self.index.matches(c, toks, row.ns_id, parent, row.canon_gen):
                if not self.index.is_orphan(c) or self.pool.pin_cnt[c]:
                    self.index.num_collisions = self.index.num_collisions + 1
                    row.track = 0
                    return
                # c holds this content chain's hash but hangs off an evicted parent, so
                # no lookup can reach it: replace it with this sequence's block.
                self.pool.drop_content(c)
                self.index.insert(b, h, row.last_hash, toks, row.ns_id, parent, row.canon_gen)
                self.pool.cached[b] = 1
                c = b
            row.canon_block = c
            row.canon_gen = self.index.gen[c]
            row.last_hash = h
            row.num_hashed += 1

    cdef int8_t block_class(self, SeqRow* row, int32_t i) noexcept nogil:
        # Seed 004's default order: prefix pages > recent pages > old pages.
        cdef int32_t top = self.pool.evictor.nbuckets - 1
        if row.block_cls != NULL and row.block_cls[i] >= 0:
            return row.block_cls[i]
        if row.priority >= 0:
            return row.priority
        if <int64_t>(i + 1) * self.block_size <= row.prompt_len:
            return <int8_t>top
        if i >= row.num_blocks - self.recent_blocks:
            return <int8_t>(1 if top >= 1 else 0)
        return 0

    cdef void release_row(self, SeqRow* row) noexcept nogil:
        # Tail first: a sequence's last block enters the eviction order first, so it is
        # evicted before its prefix.
        cdef int32_t n = row.num_blocks, i
        cdef block_id_t t
        cdef int32_t* classes = NULL
        if self.pool.evictor.policy == POLICY_PRIORITY:
            classes = <int32_t*>malloc(max(n, 1) * sizeof(int32_t))
            if classes != NULL:
                for i in range(n):
                    classes[n - 1 - i] = self.block_class(row, i)
        for i in range(n // 2):
            t = row.blocks[i]
            row.blocks[i] = row.blocks[n - 1 - i]
            row.blocks[n - 1 - i] = t
        self.pool.release_batch(row.blocks, n, classes, 0)
        c_free(classes)
        row.num_blocks = 0

    # ---- Python API: lifecycle ------------------------------------------------------
    def add(self, int64_t key, tokens=None, int32_t ns=0, uint64_t ns_hash=0, int priority=-1,
            bint lookup=True):
        """Add a sequence; returns the prompt tokens served from the prefix cache.

        Only full blocks are reused, and never the whole prompt: the last prompt token
        must still be computed to produce the first output, so a fully cached,
        block-aligned prompt reuses one block less.
        """
        cdef cnp.ndarray t = None
        cdef int64_t ntok = 0
        cdef int32_t r, nhit = 0, max_hit, i
        cdef SeqRow* row
        cdef hash_t last = 0
        if self.find_row(key) >= 0:
            raise SequenceExistsError(key)
        if not -1 <= priority <= 127:
            raise InvalidArgumentError(expected("priority", "an int in [0, 127] or -1 (default rule)", priority))
        if tokens is not None:
            t = as_i32(tokens, "tokens")
            ntok = cnp.PyArray_DIM(t, 0)
        r = self.new_row()
        row = &self.rows[r]
        try:
            self.grow_tokens(row, ntok)
            self.grow_blocks(row, cdiv(ntok, self.block_size) + 1)
            self.map_insert(key, r)
        except MemoryError:
            self.free_rows[self.num_free_rows] = r
            self.num_free_rows += 1
            raise
        row.key = key
        row.live = 1
        row.track = 1
        row.ns_id = ns
        row.ns_hash = ns_hash
        row.priority = <int8_t>priority
        row.canon_block = -1
        row.prompt_len = ntok
        row.num_known = ntok
        row.num_blocks = row.num_computed = row.num_reserved = row.num_hashed = row.num_prefix_hit = 0
        if ntok:
            memcpy(row.tokens, cnp.PyArray_DATA(t), ntok * sizeof(token_t))
        if self.index is not None:
            row.last_hash = self.index.first_parent(ns_hash)
            if lookup and ntok:
                max_hit = <int32_t>((ntok - 1) // self.block_size)
                nhit = self.index.lookup(row.tokens, ntok, ns, ns_hash, row.blocks, &last, max_hit)
                for i in range(nhit):
                    self.pool.incref(row.blocks[i])
                if nhit:
                    row.num_blocks = row.num_hashed = row.num_prefix_hit = nhit
                    row.num_computed = row.num_reserved = <int64_t>nhit * self.block_size
                    row.last_hash = last
                    row.canon_block = row.blocks[nhit - 1]
                    row.canon_gen = self.index.gen[row.canon_block]
                self.num_query_tokens += ntok
                self.num_hit_tokens += <int64_t>nhit * self.block_size
        self.num_seqs += 1
        return <int64_t>nhit * self.block_size

    def remove(self, keys, bint internal=False):
        """Free sequences (int64 keys): their blocks return to the pool, tail first."""
        cdef int64_t m = self.prep_keys(keys), i
        cdef int32_t* rp = self.rows_for(m, internal)
        cdef SeqRow* row
        for i in range(m):
            row = &self.rows[rp[i]]
            self.release_row(row)
            self.map_delete(row.key)
            row.live = 0
            c_free(row.block_cls)
            row.block_cls = NULL
            self.free_rows[self.num_free_rows] = rp[i]
            self.num_free_rows += 1
            self.num_seqs -= 1

    def fork(self, int64_t src, int64_t dst):
        """``dst`` shares every block of ``src`` that holds committed tokens."""
        cdef int32_t rs = self.find_row(src), rd, i, nb
        cdef SeqRow* s
        cdef SeqRow* d
        if rs < 0:
            raise SequenceNotFoundError(src, "src")
        if self.find_row(dst) >= 0:
            raise SequenceExistsError(dst, "dst")
        rd = self.new_row()
        d = &self.rows[rd]
        s = &self.rows[rs]   # new_row may have moved the rows
        nb = <int32_t>cdiv(s.num_computed, self.block_size)
        try:
            self.grow_blocks(d, nb + 1)
            self.grow_tokens(d, s.num_computed if s.num_computed < s.num_known else s.num_known)
            self.map_insert(dst, rd)
        except MemoryError:
            self.free_rows[self.num_free_rows] = rd
            self.num_free_rows += 1
            raise
        s = &self.rows[rs]
        d.key = dst
        d.live = 1
        d.num_known = s.num_computed if s.num_computed < s.num_known else s.num_known
        if d.num_known:
            memcpy(d.tokens, s.tokens, d.num_known * sizeof(token_t))
        memcpy(d.blocks, s.blocks, nb * sizeof(block_id_t))
        d.num_blocks = nb
        d.num_computed = d.num_reserved = s.num_computed
        d.prompt_len = s.prompt_len
        d.num_hashed = s.num_hashed
        d.num_prefix_hit = s.num_prefix_hit
        d.last_hash = s.last_hash
        d.canon_block = s.canon_block
        d.canon_gen = s.canon_gen
        d.ns_id = s.ns_id
        d.ns_hash = s.ns_hash
        d.priority = s.priority
        d.track = s.track
        for i in range(nb):
            self.pool.incref(d.blocks[i])
        self.num_seqs += 1

    def reserve(self, keys, counts, bint internal=False):
        """Slots for the next ``counts`` tokens of each sequence, concatenated (int64).

        All or nothing across the batch. New blocks are taken only at block
        boundaries; a shared partial last block is first swapped for a private copy
        (see ``take_copies``).
        """
        cdef int64_t m = self.prep_keys(keys), i, n, p, total = 0, need = 0
        cdef int64_t scalar = 0
        cdef const int64_t* cp = NULL
        cdef cnp.ndarray ca
        if type(counts) is int:
            scalar = counts
            if scalar < 0:
                raise InvalidArgumentError(expected("num_tokens", "counts >= 0", scalar))
        else:
            ca = as_i64(counts, "num_tokens")
            if cnp.PyArray_DIM(ca, 0) != m:
                raise ShapeError(expected("num_tokens", f"{m} counts (one per sequence)", cnp.PyArray_DIM(ca, 0)))
            cp = <const int64_t*>cnp.PyArray_DATA(ca)
        cdef int32_t* rp = self.rows_for(m, internal)
        cdef SeqRow* row
        cdef int32_t bs = self.block_size, newb, sh = self.bs_shift
        cdef int32_t* ref = self.pool.ref_cnt
        if cp == NULL and scalar == 1:
            return self.reserve_one(rp, m)
        for i in range(m):
            n = cp[i] if cp != NULL else scalar
            if n < 0:
                raise InvalidArgumentError(expected("num_tokens", "counts >= 0", f"{n} at index {i}"))
            row = &self.rows[rp[i]]
            newb = <int32_t>(nblocks_for(row.num_reserved + n, bs, sh) - row.num_blocks)
            need += newb
            if n and off_of(row.num_reserved, bs, sh) and must_copy(ref, self.pool.cached, row.blocks[row.num_blocks - 1]):
                need += 1
            if row.num_blocks + newb > row.cap_blocks:
                self.grow_blocks(row, row.num_blocks + newb)
            total += n
        if need > self.pool.num_free():
            raise OutOfBlocksError(need, self.pool.num_free(), "reserve")
        cdef cnp.ndarray out = new_i64(total)
        cdef int64_t* op = <int64_t*>cnp.PyArray_DATA(out)
        cdef block_id_t* blocks
        with nogil:
            for i in range(m):
                n = cp[i] if cp != NULL else scalar
                if n == 0:
                    continue
                row = &self.rows[rp[i]]
                if off_of(row.num_reserved, bs, sh) and must_copy(ref, self.pool.cached, row.blocks[row.num_blocks - 1]):
                    self.copy_on_write(row)
                newb = <int32_t>(nblocks_for(row.num_reserved + n, bs, sh) - row.num_blocks)
                if newb:
                    self.pool.alloc_into(row.blocks + row.num_blocks, newb)
                    row.num_blocks += newb
                blocks = row.blocks
                for p in range(row.num_reserved, row.num_reserved + n):
                    op[0] = <int64_t>blocks[blk_of(p, bs, sh)] * bs + off_of(p, bs, sh)
                    op += 1
                row.num_reserved += n
        return out

    cdef object reserve_one(self, const int32_t* rp, int64_t m):
        # The decode step: one token for each of m sequences. Same semantics as the
        # general path, specialised because it runs every step for every sequence.
        cdef SeqRow* rows = self.rows
        cdef SeqRow* row
        cdef int32_t* ref = self.pool.ref_cnt
        cdef int32_t bs = self.block_size, sh = self.bs_shift
        cdef int64_t i, need = 0, off
        for i in range(m):
            row = &rows[rp[i]]
            if off_of(row.num_reserved, bs, sh) == 0:
                need += 1
                if row.num_blocks + 1 > row.cap_blocks:
                    self.grow_blocks(row, row.num_blocks + 1)
            elif must_copy(ref, self.pool.cached, row.blocks[row.num_blocks - 1]):
                need += 1
        if need > self.pool.num_free():
            raise OutOfBlocksError(need, self.pool.num_free(), "reserve")
        cdef cnp.ndarray out = new_i64(m)
        cdef int64_t* op = <int64_t*>cnp.PyArray_DATA(out)
        with nogil:
            for i in range(m):
                row = &rows[rp[i]]
                off = off_of(row.num_reserved, bs, sh)
                if off == 0:
                    self.pool.alloc_into(row.blocks + row.num_blocks, 1)
                    row.num_blocks += 1
                elif must_copy(ref, self.pool.cached, row.blocks[row.num_blocks - 1]):
                    self.copy_on_write(row)
                op[i] = <int64_t>row.blocks[row.num_blocks - 1] * bs + off
                row.num_reserved += 1
        return out

    def commit(self, keys, counts, token_ids=None, bint internal=False):
        """Mark the next ``counts`` reserved tokens of each sequence as computed.

        ``token_ids`` (optional, int32, concatenated in batch order) are the ids of
        those positions; ids already known (the prompt) must match. Without them a
        sequence whose committed tokens outrun its known ids stops registering blocks.
        Blocks that became full are registered in the prefix index.
        """
        cdef int64_t m = self.prep_keys(keys), i, n, total = 0, scalar = 0, p, off
        cdef const int64_t* cp = NULL
        cdef cnp.ndarray ca, ta
        cdef const token_t* tp = NULL
        if type(counts) is int:
            scalar = counts
            if scalar < 0:
                raise InvalidArgumentError(expected("num_tokens", "counts >= 0", scalar))
        else:
            ca = as_i64(counts, "num_tokens")
            if cnp.PyArray_DIM(ca, 0) != m:
                raise ShapeError(expected("num_tokens", f"{m} counts (one per sequence)", cnp.PyArray_DIM(ca, 0)))
            cp = <const int64_t*>cnp.PyArray_DATA(ca)
        cdef int32_t* rp = self.rows_for(m, internal)
        cdef SeqRow* row
        if cp == NULL and scalar == 1:
            if token_ids is not None:
                ta = as_i32(token_ids, "token_ids")
                if cnp.PyArray_DIM(ta, 0) != m:
                    raise ShapeError(expected("token_ids", f"{m} ids (the sum of num_tokens)", cnp.PyArray_DIM(ta, 0)))
                tp = <const token_t*>cnp.PyArray_DATA(ta)
            self.commit_one(rp, m, tp)
            return
        for i in range(m):
            n = cp[i] if cp != NULL else scalar
            row = &self.rows[rp[i]]
            if n < 0 or row.num_computed + n > row.num_reserved:
                raise InvalidArgumentError(expected(
                    "num_tokens", f"at most {row.num_reserved - row.num_computed} (reserved, not yet committed) for sequence {row.key}",
                    f"{n} at index {i}"))
            total += n
        if token_ids is not None:
            ta = as_i32(token_ids, "token_ids")
            if cnp.PyArray_DIM(ta, 0) != total:
                raise ShapeError(expected("token_ids", f"{total} ids (the sum of num_tokens)", cnp.PyArray_DIM(ta, 0)))
            tp = <const token_t*>cnp.PyArray_DATA(ta)
            off = 0
            for i in range(m):
                n = cp[i] if cp != NULL else scalar
                row = &self.rows[rp[i]]
                for p in range(row.num_computed, min(row.num_known, row.num_computed + n)):
                    if row.tokens[p] != tp[off + p - row.num_computed]:
                        raise InvalidArgumentError(expected(
                            "token_ids", f"id {row.tokens[p]} at position {p} of sequence {row.key} (already known)",
                            tp[off + p - row.num_computed]))
                if row.num_computed + n > row.cap_tokens:
                    self.grow_tokens(row, row.num_computed + n)
                off += n
        with nogil:
            off = 0
            for i in range(m):
                n = cp[i] if cp != NULL else scalar
                row = &self.rows[rp[i]]
                if tp != NULL and row.num_computed + n > row.num_known:
                    if row.num_known >= row.num_computed:
                        for p in range(row.num_known - row.num_computed, n):
                            row.tokens[row.num_computed + p] = tp[off + p]
                        row.num_known = row.num_computed + n
                row.num_computed += n
                off += n
                if row.num_computed > row.num_known:
                    row.track = 0
                if (row.track and self.index is not None
                        and <int64_t>(row.num_hashed + 1) * self.block_size <= row.num_computed):
                    self.register_full_blocks(row)

    def advance(self, keys, token_ids, bint internal=False):
        """One decode step in one crossing: commit every reserved token of each sequence
        (the previous step's KV is written), then reserve one slot for its next token,
        whose id is ``token_ids[i]`` (int32). Returns the int64 slots. All or nothing.
        """
        cdef cnp.ndarray ta = as_i32(token_ids, "token_ids")
        cdef int64_t m = self.prep_keys(keys), i, c
        if cnp.PyArray_DIM(ta, 0) != m:
            raise ShapeError(expected("token_ids", f"{m} ids (one per sequence)", cnp.PyArray_DIM(ta, 0)))
        cdef const token_t* tp = <const token_t*>cnp.PyArray_DATA(ta)
        cdef int32_t* rp = self.rows_for(m, internal)
        cdef SeqRow* rows = self.rows
        cdef SeqRow* row
        cdef int32_t bs = self.block_size, sh = self.bs_shift
        cdef int32_t* ref = self.pool.ref_cnt
        cdef int64_t need = 0, off
        cdef bint indexed = self.index is not None
        for i in range(m):
            row = &rows[rp[i]]
            c = row.num_reserved
            if c < row.num_known and row.tokens[c] != tp[i]:
                raise InvalidArgumentError(expected(
                    "token_ids", f"id {row.tokens[c]} at position {c} of sequence {row.key} (already known)", tp[i]))
            if c >= row.cap_tokens:
                self.grow_tokens(row, c + 1)
            if off_of(c, bs, sh) == 0:
                need += 1
                if row.num_blocks + 1 > row.cap_blocks:
                    self.grow_blocks(row, row.num_blocks + 1)
            elif must_copy(ref, self.pool.cached, row.blocks[row.num_blocks - 1]):
                need += 1
        if need > self.pool.num_free():
            raise OutOfBlocksError(need, self.pool.num_free(), "advance")
        cdef cnp.ndarray out = new_i64(m)
        cdef int64_t* op = <int64_t*>cnp.PyArray_DATA(out)
        with nogil:
            for i in range(m):
                row = &rows[rp[i]]
                c = row.num_reserved
                if row.num_computed < c:       # commit the previous step
                    row.num_computed = c
                    if c > row.num_known:
                        row.track = 0
                    elif (indexed and row.track
                            and <int64_t>(row.num_hashed + 1) * bs <= c):
                        self.register_full_blocks(row)
                if c == row.num_known:         # record the new token's id
                    row.tokens[c] = tp[i]
                    row.num_known = c + 1
                off = off_of(c, bs, sh)
                if off == 0:
                    self.pool.alloc_into(row.blocks + row.num_blocks, 1)
                    row.num_blocks += 1
                elif must_copy(ref, self.pool.cached, row.blocks[row.num_blocks - 1]):
                    self.copy_on_write(row)
                op[i] = <int64_t>row.blocks[row.num_blocks - 1] * bs + off
                row.num_reserved = c + 1
        return out

    def unreserve(self, keys, counts=None, bint internal=False):
        """Give back reserved, uncommitted tokens (all of them when ``counts`` is None),
        e.g. after a failed forward pass. Blocks no longer covering a reserved token are
        released. Committed tokens are never touched."""
        cdef int64_t m = self.prep_keys(keys), i, n, keep
        cdef cnp.ndarray ca = None
        cdef const int64_t* cp = NULL
        if counts is not None:
            ca = as_i64(counts, "num_tokens")
            if cnp.PyArray_DIM(ca, 0) != m:
                raise ShapeError(expected("num_tokens", f"{m} counts (one per sequence)", cnp.PyArray_DIM(ca, 0)))
            cp = <const int64_t*>cnp.PyArray_DATA(ca)
        cdef int32_t* rp = self.rows_for(m, internal)
        cdef SeqRow* row
        for i in range(m):
            row = &self.rows[rp[i]]
            n = cp[i] if cp != NULL else row.num_reserved - row.num_computed
            if n < 0 or n > row.num_reserved - row.num_computed:
                raise InvalidArgumentError(expected(
                    "num_tokens", f"0..{row.num_reserved - row.num_computed} (reserved, uncommitted) for sequence {row.key}",
                    f"{n} at index {i}"))
        for i in range(m):
            row = &self.rows[rp[i]]
            n = cp[i] if cp != NULL else row.num_reserved - row.num_computed
            row.num_reserved -= n
            keep = nblocks_for(row.num_reserved, self.block_size, self.bs_shift)
            if keep < row.num_blocks:
                self.pool.release_batch(row.blocks + keep, row.num_blocks - keep, NULL, 0)
                row.num_blocks = <int32_t>keep

    cdef int commit_one(self, const int32_t* rp, int64_t m, const token_t* tp) except -1:
        # The decode step: one committed token per sequence (see commit()).
        cdef SeqRow* rows = self.rows
        cdef SeqRow* row
        cdef int64_t i, c
        cdef int32_t mask = self.block_size - 1 if self.bs_shift >= 0 else -1
        cdef bint indexed = self.index is not None
        for i in range(m):
            row = &rows[rp[i]]
            c = row.num_computed
            if c >= row.num_reserved:
                raise InvalidArgumentError(expected(
                    "num_tokens", f"at most 0 (reserved, not yet committed) for sequence {row.key}",
                    f"1 at index {i}"))
            if tp != NULL:
                if c < row.num_known:
                    if row.tokens[c] != tp[i]:
                        raise InvalidArgumentError(expected(
                            "token_ids", f"id {row.tokens[c]} at position {c} of sequence {row.key} (already known)",
                            tp[i]))
                elif c >= row.cap_tokens:
                    self.grow_tokens(row, c + 1)
        with nogil:
            for i in range(m):
                row = &rows[rp[i]]
                c = row.num_computed
                if c == row.num_known and tp != NULL:
                    row.tokens[c] = tp[i]
                    row.num_known = c + 1
                c += 1
                row.num_computed = c
                if c > row.num_known:
                    row.track = 0
                elif indexed and row.track and (((c & mask) == 0) if mask >= 0 else (c % self.block_size == 0)):
                    self.register_full_blocks(row)
        return 0

    def take_copies(self):
        """Pending copy-on-write pairs as an int32 ``[P, 2]`` array of (src, dst); clears them.

        The KV of ``src`` must be copied to ``dst`` before the reserved slots are written.
        """
        cdef cnp.ndarray out = new_i32(2 * self.num_copies)
        if self.num_copies:
            memcpy(cnp.PyArray_DATA(out), self.copies, 2 * self.num_copies * sizeof(int32_t))
        self.num_copies = 0
        return out.reshape(-1, 2)

    @property
    def num_pending_copies(self):
        return self.num_copies

    def set_priority(self, int64_t key, int priority, int64_t start_token=0, end_token=None):
        """Eviction class for a sequence, or for the blocks covering a token range.

        Applies when its blocks are freed under the ``priority`` policy (0 is evicted
        first). Without a range the whole sequence gets the class.
        """
        cdef int32_t r = self.find_row(key), i, first, last
        cdef SeqRow* row
        cdef int64_t end
        if r < 0:
            raise SequenceNotFoundError(key)
        if not 0 <= priority <= 127:
            raise InvalidArgumentError(expected("priority", "an int in [0, 127]", priority))
        row = &self.rows[r]
        if end_token is None and start_token == 0:
            row.priority = <int8_t>priority
            return
        end = row.num_reserved if end_token is None else end_token
        if not 0 <= start_token < end:
            raise InvalidArgumentError(expected("start_token, end_token", "0 <= start < end",
                                                f"{start_token}, {end}"))
        if row.block_cls == NULL:
            row.block_cls = <int8_t*>malloc(max(row.cap_blocks, 1) * sizeof(int8_t))
            if row.block_cls == NULL:
                raise MemoryError("cannot allocate per-block classes")
            memset(row.block_cls, 0xff, max(row.cap_blocks, 1) * sizeof(int8_t))
        self.grow_blocks(row, cdiv(end, self.block_size))
        first = <int32_t>(start_token // self.block_size)
        last = <int32_t>cdiv(end, self.block_size)
        for i in range(first, last):
            row.block_cls[i] = <int8_t>priority

    # ---- Python API: exports ----------------------------------------------------------
    def block_table(self, keys, int32_t pad=-1, width=None, bint internal=False):
        """Padded ``[B, width]`` int32 block tables (width defaults to the longest)."""
        cdef int64_t m = self.prep_keys(keys), i, j, w = 0
        cdef int32_t* rp = self.rows_for(m, internal)
        for i in range(m):
            if self.rows[rp[i]].num_blocks > w:
                w = self.rows[rp[i]].num_blocks
        if width is not None:
            if width < w:
                raise InvalidArgumentError(expected("width", f"at least {w} (the longest table)", width))
            w = width
        out = np.empty((m, w), dtype=np.int32)
        cdef int32_t[:, ::1] o = out
        cdef SeqRow* row
        with nogil:
            for i in range(m):
                row = &self.rows[rp[i]]
                for j in range(row.num_blocks):
                    o[i, j] = row.blocks[j]
                for j in range(row.num_blocks, w):
                    o[i, j] = pad
        return out

    def csr(self, keys, bint internal=False):
        """FlashInfer's page table: ``(indptr, indices, last_page_len)``, all int32.

        Covers every reserved token; ``last_page_len`` is 0 for an empty sequence.
        """
        cdef int64_t m = self.prep_keys(keys), i, nnz = 0
        cdef int32_t* rp = self.rows_for(m, internal)
        for i in range(m):
            nnz += self.rows[rp[i]].num_blocks
        cdef cnp.ndarray indptr = new_i32(m + 1), indices = new_i32(nnz), last = new_i32(m)
        cdef int32_t* ip = <int32_t*>cnp.PyArray_DATA(indptr)
        cdef int32_t* xp = <int32_t*>cnp.PyArray_DATA(indices)
        cdef int32_t* lp = <int32_t*>cnp.PyArray_DATA(last)
        cdef SeqRow* row
        with nogil:
            ip[0] = 0
            for i in range(m):
                row = &self.rows[rp[i]]
                memcpy(xp + ip[i], row.blocks, row.num_blocks * sizeof(block_id_t))
                ip[i + 1] = ip[i] + row.num_blocks
                lp[i] = <int32_t>(row.num_reserved - <int64_t>(row.num_blocks - 1) * self.block_size) if row.num_blocks else 0
        return indptr, indices, last

    def slot_mapping(self, keys, starts, counts, bint internal=False):
        """int64 slots of positions ``[start, start + count)`` of each sequence, concatenated."""
        cdef cnp.ndarray sa = as_i64(starts, "starts"), ca = as_i64(counts, "counts")
        cdef int64_t m = self.prep_keys(keys), i, p, total = 0
        if cnp.PyArray_DIM(sa, 0) != m or cnp.PyArray_DIM(ca, 0) != m:
            raise ShapeError(expected("starts, counts", f"{m} entries each", f"{cnp.PyArray_DIM(sa, 0)}, {cnp.PyArray_DIM(ca, 0)}"))
        cdef const int64_t* sp = <const int64_t*>cnp.PyArray_DATA(sa)
        cdef const int64_t* cp = <const int64_t*>cnp.PyArray_DATA(ca)
        cdef int32_t* rp = self.rows_for(m, internal)
        cdef SeqRow* row
        for i in range(m):
            row = &self.rows[rp[i]]
            if sp[i] < 0 or cp[i] < 0 or sp[i] + cp[i] > row.num_reserved:
                raise InvalidArgumentError(expected(
                    "starts, counts", f"a range inside the {row.num_reserved} reserved tokens of sequence {row.key}",
                    f"[{sp[i]}, {sp[i] + cp[i]})"))
            total += cp[i]
        cdef cnp.ndarray out = new_i64(total)
        cdef int64_t* op = <int64_t*>cnp.PyArray_DATA(out)
        cdef int32_t bs = self.block_size, sh = self.bs_shift
        with nogil:
            for i in range(m):
                row = &self.rows[rp[i]]
                for p in range(sp[i], sp[i] + cp[i]):
                    op[0] = <int64_t>row.blocks[blk_of(p, bs, sh)] * bs + off_of(p, bs, sh)
                    op += 1
        return out

    def seq_lens(self, keys, bint computed=False, bint internal=False):
        """Tokens per sequence (int64): reserved (default) or committed."""
        cdef int64_t m = self.prep_keys(keys), i
        cdef int32_t* rp = self.rows_for(m, internal)
        cdef cnp.ndarray out = new_i64(m)
        cdef int64_t* op = <int64_t*>cnp.PyArray_DATA(out)
        for i in range(m):
            op[i] = self.rows[rp[i]].num_computed if computed else self.rows[rp[i]].num_reserved
        return out

    # ---- Python API: single sequences ------------------------------------------------
    cdef SeqRow* _row(self, int64_t key) except NULL:
        cdef int32_t r = self.find_row(key)
        if r < 0:
            raise SequenceNotFoundError(key)
        return &self.rows[r]

    def blocks(self, int64_t key):
        cdef SeqRow* row = self._row(key)
        cdef cnp.ndarray out = new_i32(row.num_blocks)
        memcpy(cnp.PyArray_DATA(out), row.blocks, row.num_blocks * sizeof(block_id_t))
        return out

    def tokens(self, int64_t key):
        cdef SeqRow* row = self._row(key)
        cdef cnp.ndarray out = new_i32(row.num_known)
        memcpy(cnp.PyArray_DATA(out), row.tokens, row.num_known * sizeof(token_t))
        return out

    def num_computed(self, int64_t key):
        return self._row(key).num_computed

    def num_reserved(self, int64_t key):
        return self._row(key).num_reserved

    def info(self, int64_t key):
        cdef SeqRow* row = self._row(key)
        return {"num_blocks": row.num_blocks, "num_computed": row.num_computed,
                "num_reserved": row.num_reserved, "num_known": row.num_known,
                "prompt_len": row.prompt_len, "num_hashed": row.num_hashed,
                "num_prefix_hit_blocks": row.num_prefix_hit, "priority": row.priority,
                "tracking": bool(row.track), "namespace": row.ns_id}

    def __contains__(self, key):
        return isinstance(key, int) and -2**63 <= key < 2**63 and self.find_row(key) >= 0

    def __len__(self):
        return self.num_seqs

    def keys(self):
        """Live sequence keys (int64 array), in no particular order."""
        cdef cnp.ndarray out = new_i64(self.num_seqs)
        cdef int64_t* op = <int64_t*>cnp.PyArray_DATA(out)
        cdef int32_t r, n = 0
        for r in range(self.num_rows):
            if self.rows[r].live:
                op[n] = self.rows[r].key
                n += 1
        return out

    def total_tokens(self):
        """Committed tokens over all live sequences, and internal waste in partial last blocks."""
        cdef int64_t tok = 0, waste = 0
        cdef int32_t r
        for r in range(self.num_rows):
            if self.rows[r].live:
                tok += self.rows[r].num_computed
                waste += <int64_t>self.rows[r].num_blocks * self.block_size - self.rows[r].num_reserved
        return tok, waste

    def check_invariants(self):
        """Audit tables against the pool: every ref_cnt equals the references held."""
        cdef int32_t r, i
        cdef SeqRow* row
        held = np.zeros(self.pool.num_blocks, dtype=np.int64)
        cdef int64_t[::1] h = held
        for r in range(self.num_rows):
            row = &self.rows[r]
            if not row.live:
                continue
            if self.find_row(row.key) != r:
                raise InternalError(f"sequence {row.key} is not mapped to its row")
            if row.num_blocks != cdiv(row.num_reserved, self.block_size):
                raise InternalError(f"sequence {row.key}: {row.num_blocks} blocks for {row.num_reserved} reserved tokens")
            if not 0 <= row.num_computed <= row.num_reserved:
                raise InternalError(f"sequence {row.key}: computed {row.num_computed} > reserved {row.num_reserved}")
            if <int64_t>row.num_hashed * self.block_size > row.num_computed:
                raise InternalError(f"sequence {row.key}: hashed past its computed tokens")
            for i in range(row.num_blocks):
                h[row.blocks[i]] += 1
        ref = np.asarray(self.pool._ref_view, dtype=np.int64)
        if not np.array_equal(held, ref):
            bad = int(np.flatnonzero(held != ref)[0])
            raise InternalError(f"block {bad}: ref_cnt {ref[bad]} but sequences hold {held[bad]} references")
        self.pool.check_invariants()
