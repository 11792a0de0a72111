# Prefix index: chained block hash -> block, with the exact tokens kept for verification.
#
# The index owns the registration records and the hash map. Whether a block's record is
# live is the pool's cached bit (read through `live`); every change to the index goes
# through the pool (register, evict, reset), so the two can never disagree.
from pagedkv._core._types cimport (block_id_t, token_t, hash_t, int8_t, uint8_t, int32_t,
                                   uint32_t, int64_t, uint64_t)
from pagedkv._core._hashmap cimport HashMap
from pagedkv._core._arrays cimport IntBuf

cdef extern from "pkv_hash.h" nogil:
    uint64_t pkv_hash_bytes(const void* data, size_t length, uint64_t seed)
    uint64_t pkv_hash_block(const int32_t* tokens, int32_t ntokens, uint64_t parent, uint64_t ns_hash)
    uint64_t pkv_hash_block_weak(const int32_t* tokens, int32_t ntokens, uint64_t parent, uint64_t ns_hash)

cdef enum:
    EV_STORED = 1
    EV_REMOVED = 2
    EV_CLEARED = 3

cdef enum:
    TIER_STORED = 1      # a block was registered: its KV is now a reusable prefix
    TIER_REMOVED = 2     # a registration ended (eviction): the KV is intact until reused

cdef enum Probe:
    PROBE_ABSENT = 0     # no record under the hash: the block may be registered
    PROBE_MATCH = 1      # a live record with exactly this content and chain
    PROBE_ORPHAN = 2     # a record under the hash whose parent registration ended: unreachable
    PROBE_CONFLICT = 3   # another live, reachable record owns the hash (a true collision)

cdef struct PrefixCursor:
    # A sequence's progress through the index: its next full block to offer is
    # num_hashed, and that block's parent in the chain is (canon_block, canon_gen).
    hash_t last_hash         # chained hash of block num_hashed - 1 (the namespace root when 0)
    block_id_t canon_block   # registered block holding block num_hashed - 1's content; -1 = none
    uint32_t canon_gen       # generation of canon_block when it was taken
    int32_t num_hashed       # full blocks already offered to the index, >= 0
    int32_t ns_id            # interned namespace id (0 = default)
    uint64_t ns_hash         # namespace hash mixed into every block hash
    uint8_t track            # 1 while every committed token id is known (blocks can be registered)

cdef struct EventBuf:
    uint8_t* kind        # EV_* per record
    uint64_t* hash       # block hash (0 for EV_CLEARED)
    uint64_t* parent     # parent block hash; for a first block, the namespace root
    int32_t* ns          # interned namespace id
    int32_t* block       # block id
    token_t* tokens      # block_size token ids per record (EV_STORED: the block's; others: 0)
    int64_t n            # records held, <= cap
    int64_t cap
    int64_t lost         # records dropped since the last drain (buffer full or out of memory)

cdef struct TierLog:
    # Registration lifecycle for the prefix tiers below the device (host, disk). A
    # removed block's KV stays intact until its new owner writes, so the manager drains
    # this right after each allocating call, before any write, and copies what it needs.
    uint8_t* kind        # TIER_* per record
    int32_t* block       # device block id
    uint32_t* gen        # the block's generation during that registration
    uint64_t* hash       # chained block hash
    uint64_t* parent_hash
    int32_t* parent_block  # registered block holding the previous block; -1 for a first block
    uint32_t* parent_gen   # its generation when this block was registered
    int32_t* ns          # interned namespace id
    token_t* tokens      # [cap * block_size] the block's tokens
    int64_t n            # records held, <= cap
    int64_t cap
    int64_t lost         # records dropped because the log could not grow (a tier miss, never wrong KV)


cdef class PrefixIndex:
    cdef readonly int32_t block_size     # tokens per block, >= 1
    cdef readonly int32_t num_blocks     # blocks the index can describe
    cdef readonly uint64_t root          # root hash: per-process secret, or derived from a fixed seed
    cdef readonly bint weak_hash         # tests only: 4-valued hash that collides constantly
    cdef HashMap map                     # block hash -> block; at most num_blocks entries, never grows
    cdef const uint8_t* live             # the pool's cached bits: record b is live iff live[b]; NULL = none
    cdef object owner                    # the pool that attached itself (keeps `live` valid)
    cdef readonly int32_t num_cached     # live records
    # per block, meaningful while live[b]
    cdef uint64_t* block_hash
    cdef uint64_t* parent_hash
    cdef token_t* block_tokens           # [num_blocks * block_size]
    cdef int32_t* block_ns               # interned namespace id (0 = default namespace)
    cdef block_id_t* parent_block        # registered block holding the previous block; -1 for the first
    cdef uint32_t* parent_gen            # gen[parent_block] when this block was registered
    cdef uint32_t* gen                   # bumped whenever the block's registration ends
    cdef readonly int64_t num_collisions # registrations refused because another block owns the hash
    cdef readonly bint events_enabled    # record KV events for drain_events()
    cdef EventBuf ev
    cdef readonly int64_t max_events     # undrained KV events kept; later ones are counted as lost
    cdef readonly bint tier_log_enabled  # record the registration lifecycle for drain_tier_log()
    cdef TierLog tl
    cdef IntBuf arg                      # snapshot of the current call's token argument

    cdef hash_t hash_block(self, const token_t* toks, hash_t parent, uint64_t ns_hash) noexcept nogil
    cdef hash_t first_parent(self, uint64_t ns_hash) noexcept nogil
    cdef bint is_live(self, block_id_t b) noexcept nogil
    cdef block_id_t find(self, hash_t h) noexcept nogil
    cdef bint matches(self, block_id_t b, const token_t* toks, int32_t ns,
                      block_id_t parent, uint32_t pgen) noexcept nogil
    cdef bint canon_valid(self, block_id_t b, uint32_t g) noexcept nogil
    cdef Probe probe(self, hash_t h, const token_t* toks, int32_t ns, block_id_t parent,
                     uint32_t pgen, block_id_t* found) noexcept nogil
    cdef void note_collision(self) noexcept nogil
    cdef void insert(self, block_id_t b, hash_t h, hash_t parent_h, const token_t* toks,
                     int32_t ns, block_id_t parent, uint32_t pgen) noexcept nogil
    cdef void remove(self, block_id_t b) noexcept nogil
    cdef void clear(self) noexcept nogil
    cdef int32_t lookup(self, const token_t* toks, int64_t ntok, int32_t ns, uint64_t ns_hash,
                        block_id_t* out_blocks, PrefixCursor* cur, int32_t max_blocks) noexcept nogil
    cdef void push_event(self, uint8_t kind, uint64_t h, uint64_t parent, int32_t ns,
                         block_id_t b) noexcept nogil
    cdef void log_tier(self, uint8_t kind, block_id_t b) noexcept nogil
    cdef block_id_t _check_block(self, object block_id) except? -1
