# Block tables: each live sequence's blocks, token counts and token ids, and the calls
# that move a sequence through its life (add, reserve, commit, advance, fork, remove).
cimport cython
from pagedkv._core._types cimport block_id_t, token_t, seq_key_t, int8_t, uint8_t, int32_t, int64_t
from pagedkv._core._arrays cimport IntBuf
from pagedkv._core.pool cimport BlockPool
from pagedkv._core.prefix cimport PrefixIndex
from pagedkv._core.rows cimport SeqRow, RowStore

@cython.final
cdef class BlockTables:
    cdef readonly BlockPool pool
    cdef readonly PrefixIndex index        # the pool's index; None when prefix caching is off
    cdef bint indexed                      # index is not None (read in nogil loops)
    cdef readonly int32_t block_size       # tokens per block, >= 1
    cdef int32_t bs_shift                  # log2(block_size) when a power of two, else -1
    cdef int64_t max_tokens                # tokens a sequence could ever hold: pool blocks * block_size
    cdef readonly int32_t recent_blocks    # priority policy: trailing blocks counted as "recent"
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

    # argument snapshots and row resolution
    cdef int64_t load_keys(self, object keys) except -1
    cdef int64_t load_counts(self, object counts, int64_t m, str name, int64_t* scalar) except -1
    cdef int64_t load_tokens(self, object token_ids) except -1
    cdef int32_t* rows_for(self, int64_t m, bint internal) except NULL
    cdef SeqRow* row_of(self, object key, str name) except NULL
    # per-row steps shared by reserve, commit and advance
    cdef int prepare_reserve(self, SeqRow* row, int64_t n) except -1
    cdef int raise_too_long(self, SeqRow* row, int64_t n) except -1
    cdef void reserve_row(self, SeqRow* row, int64_t n, int64_t* out) noexcept nogil
    cdef void register_row(self, SeqRow* row) noexcept nogil
    cdef void copy_on_write(self, SeqRow* row) noexcept nogil
    cdef int reserve_copies(self, int64_t n) except -1
    cdef int check_room(self, int64_t need, str what) except -1
    cdef void release_row(self, SeqRow* row) noexcept nogil
