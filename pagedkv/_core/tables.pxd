# Block tables: per-sequence block lists, token counts and token ids.
from pagedkv._core._types cimport (block_id_t, token_t, hash_t, seq_key_t, int8_t, uint8_t,
                                   int32_t, uint32_t, int64_t, uint64_t)
from pagedkv._core.pool cimport BlockPool
from pagedkv._core.prefix cimport PrefixIndex

cdef struct SeqRow:
    # hot fields first: a decode step touches only the first cache line
    seq_key_t key            # the sequence's key (user int id or an interned key)
    int64_t stamp            # last batch call that touched the row (duplicate detection)
    int64_t num_reserved     # tokens holding a slot
    int64_t num_computed     # tokens whose KV is committed, <= num_reserved
    block_id_t* blocks       # block table; append-only but for copy-on-write of the last partial block
    int32_t num_blocks       # == ceil(num_reserved / block_size)
    int32_t cap_blocks       # capacity of blocks / block_cls
    int64_t num_known        # token ids known, >= 0
    int64_t cap_tokens       # capacity of tokens
    token_t* tokens          # known token ids: the prompt, then committed decode inputs
    uint8_t track            # 1 while every committed token id is known (blocks can be registered)
    uint8_t live             # 1 while the row holds a sequence
    int8_t priority          # eviction class of all its blocks; -1 = seed 004's default rule
    int32_t num_hashed       # full blocks already offered to the prefix index
    # cold fields
    int8_t* block_cls        # per-block eviction class set by set_priority; NULL or -1 = default rule
    int64_t prompt_len       # tokens given at admission (prefix-class blocks for the priority policy)
    int32_t num_prefix_hit   # blocks reused from the prefix cache at admission
    hash_t last_hash         # chained hash of block num_hashed-1 (the root when 0)
    block_id_t canon_block   # registered block with the content of block num_hashed-1; -1 = none
    uint32_t canon_gen       # generation of canon_block when it was taken
    int32_t ns_id            # interned namespace id (0 = default)
    uint64_t ns_hash         # namespace hash mixed into every block hash


cdef class BlockTables:
    cdef readonly BlockPool pool
    cdef readonly PrefixIndex index        # None when prefix caching is off
    cdef readonly int32_t block_size       # tokens per block, >= 1
    cdef int32_t bs_shift                  # log2(block_size) when a power of two, else -1
    cdef readonly int32_t recent_blocks    # priority policy: trailing blocks counted as "recent"
    cdef SeqRow* rows
    cdef int32_t num_rows                  # rows ever created (live or on the free-row stack)
    cdef int32_t cap_rows
    cdef int32_t* free_rows                # stack of dead row indices
    cdef int32_t num_free_rows
    cdef readonly int32_t num_seqs         # live sequences
    # key -> row: open addressing, linear probing, backward-shift deletion
    cdef int64_t* map_keys
    cdef int32_t* map_vals                 # row index; -1 = empty slot
    cdef uint64_t map_mask
    cdef int64_t stamp
    cdef int64_t single_key                # the key of a call given one int key
    cdef const int64_t* kp                 # keys of the current batch call (prep_keys)
    cdef object keys_holder                # keeps the current call's key array alive
    cdef int32_t* scratch_rows             # per-call row indices, grown on demand
    cdef int64_t scratch_cap
    cdef int64_t hint_len                  # entries of scratch_rows valid as hints for the next call
    cdef int32_t* copies                   # pending copy-on-write pairs (src, dst), flattened
    cdef int64_t num_copies
    cdef int64_t cap_copies
    cdef readonly int64_t num_query_tokens # prompt tokens looked up in the prefix cache
    cdef readonly int64_t num_hit_tokens   # of those, tokens served from cached blocks
    cdef readonly int64_t num_cow          # copy-on-write block copies requested

    cdef int32_t find_row(self, seq_key_t key) noexcept nogil
    cdef int map_insert(self, seq_key_t key, int32_t row) except -1
    cdef void _place(self, seq_key_t key, int32_t row) noexcept nogil
    cdef SeqRow* _row(self, int64_t key) except NULL
    cdef void map_delete(self, seq_key_t key) noexcept nogil
    cdef int32_t new_row(self) except -1
    cdef int grow_blocks(self, SeqRow* row, int64_t need) except -1 nogil
    cdef int grow_tokens(self, SeqRow* row, int64_t need) except -1 nogil
    cdef int64_t prep_keys(self, object keys) except -1
    cdef int32_t* rows_for(self, int64_t m, bint internal=*) except NULL
    cdef int push_copy(self, block_id_t src, block_id_t dst) except -1 nogil
    cdef int copy_on_write(self, SeqRow* row) except -1 nogil
    cdef void register_full_blocks(self, SeqRow* row) noexcept nogil
    cdef void release_row(self, SeqRow* row) noexcept nogil
    cdef int commit_one(self, const int32_t* rp, int64_t m, const token_t* tp) except -1
    cdef object reserve_one(self, const int32_t* rp, int64_t m)
    cdef int8_t block_class(self, SeqRow* row, int32_t i) noexcept nogil
