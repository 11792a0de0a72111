# Row storage: one SeqRow per live sequence, found by key through a hash map; dead rows
# are recycled. Rows own their block table and token ids; nothing here touches the pool.
from libc.stdlib cimport malloc, realloc, free as c_free
from libc.string cimport memset
from pagedkv._core._types cimport block_id_t, token_t, seq_key_t, int8_t, uint8_t, int32_t, int64_t, uint64_t
from pagedkv._core._hashmap cimport HashMap, hm_init, hm_dealloc, hm_get, hm_put_new, hm_delete, hm_reserve
from pagedkv._core.prefix cimport PrefixCursor

cdef struct SeqRow:
    # hot fields first: a decode step touches only these
    seq_key_t key            # the sequence's key (user int id, or a manager-interned key)
    int64_t stamp            # last batch call that resolved the row (duplicate detection)
    int64_t num_reserved     # tokens holding a slot, in [num_computed, num_blocks * block_size]
    int64_t num_computed     # tokens whose KV is committed, >= 0
    int64_t num_known        # token ids known (prompt, then committed inputs), >= 0
    block_id_t* blocks       # [cap_blocks] block table; append-only but for copy-on-write of the tail
    token_t* tokens          # [cap_tokens] known token ids
    int32_t num_blocks       # == ceil(num_reserved / block_size), <= pool size
    uint8_t live             # 1 while the row holds a sequence
    uint8_t hold             # sliding window: 1 while commits keep blocks that left the window (rollback)
    int8_t priority          # eviction class of all its blocks; -1 = seed 004's default rule
    PrefixCursor cur         # progress through the prefix index (registration of full blocks)
    # cold fields
    int64_t cap_blocks       # capacity of blocks (and of block_cls when set), >= num_blocks
    int64_t cap_tokens       # capacity of tokens, >= num_known
    int8_t* block_cls        # [cap_blocks] per-block class from set_priority; -1 = none; NULL = none at all
    int64_t prompt_len       # tokens given at admission (prefix-class blocks for the priority policy)
    int32_t num_prefix_hit   # blocks reused from the prefix cache at admission
    int32_t num_dropped      # sliding window: blocks after the sink blocks already released
                             # (their entries in blocks are -1), in [0, num_blocks]; 0 for full attention

cdef struct RowStore:
    SeqRow* rows             # [cap_rows]; rows[0:num_rows] were ever used
    int32_t num_rows
    int32_t cap_rows
    int32_t* free_rows       # [cap_rows] stack of dead row indices
    int32_t num_free_rows
    int32_t num_live         # live rows (== map.size)
    HashMap map              # key -> row index


cdef inline int rs_init(RowStore* s) except -1:
    s.cap_rows = 16
    s.rows = <SeqRow*>malloc(s.cap_rows * sizeof(SeqRow))
    s.free_rows = <int32_t*>malloc(s.cap_rows * sizeof(int32_t))
    if s.rows == NULL or s.free_rows == NULL:
        from pagedkv.errors import HostMemoryError
        raise HostMemoryError("cannot allocate block tables")
    hm_init(&s.map, 32)
    return 0


cdef inline void rs_dealloc(RowStore* s) noexcept:
    cdef int32_t r
    if s.rows != NULL:
        for r in range(s.num_rows):
            c_free(s.rows[r].blocks)
            c_free(s.rows[r].block_cls)
            c_free(s.rows[r].tokens)
    c_free(s.rows)
    c_free(s.free_rows)
    hm_dealloc(&s.map)


cdef inline int32_t rs_find(const RowStore* s, seq_key_t key) noexcept nogil:
    return hm_get(&s.map, <uint64_t>key)


cdef inline int32_t rs_add(RowStore* s, seq_key_t key) except -1:
    """A fresh, zeroed, live row mapped under key (absent); all or nothing."""
    cdef int32_t r
    cdef SeqRow* grown
    cdef int32_t* grown_free
    hm_reserve(&s.map, s.num_live + 1)
    if s.num_free_rows:
        s.num_free_rows -= 1
        r = s.free_rows[s.num_free_rows]
        s.rows[r].key = key
    else:
        if s.num_rows == s.cap_rows:
            if s.cap_rows >= 2**30:
                from pagedkv.errors import HostMemoryError
                raise HostMemoryError("block tables: too many sequences")
            grown = <SeqRow*>realloc(s.rows, 2 * s.cap_rows * sizeof(SeqRow))
            if grown == NULL:
                from pagedkv.errors import HostMemoryError
                raise HostMemoryError("cannot grow the block tables")
            s.rows = grown
            grown_free = <int32_t*>realloc(s.free_rows, 2 * s.cap_rows * sizeof(int32_t))
            if grown_free == NULL:
                from pagedkv.errors import HostMemoryError
                raise HostMemoryError("cannot grow the block tables")
            s.free_rows = grown_free
            s.cap_rows *= 2
        r = s.num_rows
        s.num_rows += 1
        memset(&s.rows[r], 0, sizeof(SeqRow))
    row_reset(&s.rows[r], key)
    hm_put_new(&s.map, <uint64_t>key, r)
    s.num_live += 1
    return r


cdef inline void row_reset(SeqRow* row, seq_key_t key) noexcept nogil:
    # Keep the row's buffers (a recycled row reuses them); clear everything else.
    row.key = key
    row.stamp = 0
    row.num_reserved = row.num_computed = row.num_known = 0
    row.num_blocks = 0
    row.live = 1
    row.hold = 0
    row.priority = -1
    memset(&row.cur, 0, sizeof(PrefixCursor))
    row.cur.canon_block = -1
    row.cur.track = 1
    row.prompt_len = 0
    row.num_prefix_hit = 0
    row.num_dropped = 0


cdef inline void rs_remove(RowStore* s, int32_t r) noexcept nogil:
    cdef SeqRow* row = &s.rows[r]
    hm_delete(&s.map, <uint64_t>row.key)
    row.live = 0
    row.num_blocks = 0
    c_free(row.block_cls)
    row.block_cls = NULL
    s.free_rows[s.num_free_rows] = r
    s.num_free_rows += 1
    s.num_live -= 1


cdef inline int row_grow_blocks(SeqRow* row, int64_t need) except -1:
    # Called with the GIL, from validation phases only: the nogil apply phases never grow.
    cdef int64_t cap = row.cap_blocks
    cdef block_id_t* nb
    cdef int8_t* nc
    if need <= cap:
        return 0
    if cap < 8:
        cap = 8
    while cap < need:
        cap *= 2
    nb = <block_id_t*>realloc(row.blocks, <size_t>cap * sizeof(block_id_t))
    if nb == NULL:
        from pagedkv.errors import HostMemoryError
        raise HostMemoryError(f"cannot grow a block table to {cap} blocks")
    row.blocks = nb
    if row.block_cls != NULL:
        nc = <int8_t*>realloc(row.block_cls, <size_t>cap * sizeof(int8_t))
        if nc == NULL:
            from pagedkv.errors import HostMemoryError
            raise HostMemoryError(f"cannot grow a block table to {cap} blocks")
        memset(nc + row.cap_blocks, 0xff, <size_t>(cap - row.cap_blocks) * sizeof(int8_t))
        row.block_cls = nc
    row.cap_blocks = cap
    return 0


cdef inline int row_grow_tokens(SeqRow* row, int64_t need) except -1:
    cdef int64_t cap = row.cap_tokens
    cdef token_t* nt
    if need <= cap:
        return 0
    if cap < 64:
        cap = 64
    while cap < need:
        cap *= 2
    nt = <token_t*>realloc(row.tokens, <size_t>cap * sizeof(token_t))
    if nt == NULL:
        from pagedkv.errors import HostMemoryError
        raise HostMemoryError(f"cannot grow a token list to {cap} tokens")
    row.tokens = nt
    row.cap_tokens = cap
    return 0


# Token position -> (block, offset) without integer division when block_size is a power
# of two (a 64-bit divide costs tens of cycles; a decode step does a few per sequence).
cdef inline int64_t blk_of(int64_t p, int32_t bs, int32_t shift) noexcept nogil:
    return (p >> shift) if shift >= 0 else p // bs


cdef inline int64_t off_of(int64_t p, int32_t bs, int32_t shift) noexcept nogil:
    return (p & (bs - 1)) if shift >= 0 else p % bs


cdef inline int64_t nblocks_for(int64_t n, int32_t bs, int32_t shift) noexcept nogil:
    return ((n + bs - 1) >> shift) if shift >= 0 else (n + bs - 1) // bs


cdef inline int row_room_blocks(SeqRow* row, int64_t need) except -1:
    """Capacity for `need` table entries (the common case is one compare)."""
    if need <= row.cap_blocks:
        return 0
    return row_grow_blocks(row, need)


cdef inline int row_room_tokens(SeqRow* row, int64_t need) except -1:
    """Capacity for `need` token ids."""
    if need <= row.cap_tokens:
        return 0
    return row_grow_tokens(row, need)
