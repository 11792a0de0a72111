# Block tables: each live sequence's blocks, token counts and token ids, and the calls
# that move a sequence through its life (add, reserve, commit, advance, fork, remove).
#
# One class per attention type, in the manner of vLLM's single-type managers:
# TablesBase holds the shared machinery and full attention's behaviour;
# FullAttentionTables (here) and SlidingWindowTables (sliding.pxd) are the two kinds.
# What differs between kinds are the virtual cdef methods below marked "per attention
# type"; each is called once per batch on the decode path (commit_rows, advance_rows),
# or once per row off it, so the hot loops themselves carry no mode flag.
cimport cython
from libc.string cimport memcpy
from pagedkv._core._types cimport block_id_t, token_t, seq_key_t, int8_t, uint8_t, int32_t, int64_t
from pagedkv._core._arrays cimport IntBuf
from pagedkv._core.pool cimport BlockPool, must_copy_at
from pagedkv._core.prefix cimport PrefixIndex
from pagedkv._core.rows cimport SeqRow, RowStore, off_of


cdef class TablesBase:
    cdef readonly BlockPool pool
    cdef readonly PrefixIndex index        # the pool's index; None when prefix caching is off
    cdef bint indexed                      # index is not None (read in nogil loops)
    cdef readonly int32_t block_size       # tokens per block, >= 1
    cdef int32_t bs_shift                  # log2(block_size) when a power of two, else -1
    cdef int64_t max_tokens                # tokens a sequence could ever hold (pool blocks * block_size
                                           # unless the attention type bounds a row otherwise)
    cdef readonly int32_t recent_blocks    # priority policy: trailing blocks counted as "recent"
    cdef readonly int32_t sink_blocks      # leading blocks a row never releases before the released run
                                           # (exports skip entries [sink_blocks, sink_blocks + num_dropped));
                                           # 0 for full attention
    cdef const int32_t* ref                # the pool's ref counts (read-only here: copy-on-write checks)
    cdef const uint8_t* cached             # the pool's cached bits (read-only here)
    cdef public object namer               # key -> the caller's id, for messages (default: the key)
    cdef RowStore store
    cdef int64_t stamp                     # batch calls so far (duplicate detection)
    # the current call's private snapshots of its arguments
    cdef int64_t single_key                # the key of a call given one int key
    cdef int32_t single_row                # its row (rows_buf keeps the batch's hints)
    cdef const int64_t* kp                 # keys of the current call (single_key or keys_buf)
    cdef IntBuf keys_buf                   # int64 keys
    cdef IntBuf counts_buf                 # int64 counts
    cdef IntBuf starts_buf                 # int64 starts (slot_mapping)
    cdef IntBuf tokens_buf                 # int32 token ids
    cdef IntBuf rows_buf                   # int32 row index per key; also next call's hints
    cdef IntBuf cls_buf                    # int32 eviction classes of a row being released
    cdef int64_t hint_len                  # entries of rows_buf valid as hints for the next call
    cdef int32_t* copies                   # pending copy-on-write pairs (src, dst), flattened
    cdef int64_t num_copies
    cdef int64_t cap_copies
    cdef readonly int64_t num_query_tokens # prompt tokens looked up in the prefix cache
    cdef readonly int64_t num_hit_tokens   # of those, tokens served from cached blocks
    cdef readonly int64_t num_cow          # copy-on-write block copies requested

    # argument snapshots and row resolution (final: called directly, never overridden)
    @cython.final
    cdef int64_t load_keys(self, object keys) except -1
    @cython.final
    cdef int64_t load_counts(self, object counts, int64_t m, str name, int64_t* scalar) except -1
    @cython.final
    cdef int64_t load_tokens(self, object token_ids) except -1
    @cython.final
    cdef int32_t* rows_for(self, int64_t m, bint internal) except NULL
    @cython.final
    cdef SeqRow* row_of(self, object key, str name) except NULL
    # shared per-row checks
    @cython.final
    cdef int prepare_reserve(self, SeqRow* row, int64_t n) except -1
    @cython.final
    cdef int raise_too_long(self, SeqRow* row, int64_t n) except -1
    @cython.final
    cdef int reserve_copies(self, int64_t n) except -1
    @cython.final
    cdef int check_room(self, int64_t need, str what) except -1
    # per attention type (the base implements full attention)
    cdef void commit_rows(self, SeqRow* rows, const int32_t* rp, int64_t m, const int64_t* cp,
                          const token_t* tp) noexcept nogil   # commit's apply phase
    cdef void advance_rows(self, SeqRow* rows, const int32_t* rp, int64_t m, const token_t* tp,
                           int64_t* op) noexcept nogil        # advance's apply phase
    cdef void settle_row(self, SeqRow* row) noexcept nogil   # after a prefix hit at add
    cdef void release_row(self, SeqRow* row) noexcept nogil  # remove: every block back, tail first
    cdef int check_truncate(self, SeqRow* row, int64_t n, int64_t i) except -1
    cdef int check_row(self, SeqRow* row) except -1           # check_invariants, per live row


@cython.final
cdef class FullAttentionTables(TablesBase):
    pass


# ---- per-row steps every attention type shares (inline: no call in the hot loops) ------
cdef void release_blocks(TablesBase t, SeqRow* row, int32_t lo, int32_t hi) noexcept nogil


cdef void copy_on_write(TablesBase t, SeqRow* row) noexcept nogil   # rare: a call, not inlined


cdef inline void reserve_one(TablesBase t, SeqRow* row, int64_t* out) noexcept nogil:
    # The decode step's reserve: one slot; a new block at a boundary, else copy-on-write
    # of a shared tail. The caller checked capacity and room.
    cdef int32_t bs = t.block_size
    cdef int64_t p = row.num_reserved
    cdef int64_t off = off_of(p, bs, t.bs_shift)
    if off == 0:
        t.pool.alloc_into(row.blocks + row.num_blocks, 1)
        row.num_blocks += 1
    elif must_copy_at(t.ref, t.cached, row.blocks[row.num_blocks - 1]):
        copy_on_write(t, row)
    out[0] = <int64_t>row.blocks[row.num_blocks - 1] * bs + off
    row.num_reserved = p + 1


cdef inline void commit_row(TablesBase t, SeqRow* row, int64_t n, const token_t* tp) noexcept nogil:
    # The KV of the next n reserved tokens is written; tp (or NULL) names them. The
    # caller checked n and made room for the ids. Newly full blocks are offered to the
    # prefix index (through the pool) while every committed id is known.
    cdef int64_t c = row.num_computed
    if tp != NULL and c + n > row.num_known and row.num_known >= c:
        memcpy(row.tokens + row.num_known, tp + (row.num_known - c),
               <size_t>(c + n - row.num_known) * sizeof(token_t))
        row.num_known = c + n
    c += n
    row.num_computed = c
    if c > row.num_known:
        row.cur.track = 0
    elif row.cur.track and t.indexed and <int64_t>(row.cur.num_hashed + 1) * t.block_size <= c:
        t.pool.cache_full_blocks(&row.cur, row.blocks, row.tokens, row.num_computed)


cdef inline void advance_one(TablesBase t, SeqRow* row, token_t tok, int64_t* out) noexcept nogil:
    # advance's per-row step after the commit: the next token's id, then its slot.
    cdef int64_t c = row.num_reserved
    if c == row.num_known:
        row.tokens[c] = tok
        row.num_known = c + 1
    reserve_one(t, row, out)

