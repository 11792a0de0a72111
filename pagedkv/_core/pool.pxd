# Block pool: the one owner of every block's state — ref counts, the cached bit, pins,
# hit counts, the free queue — and the only way into the prefix index.
from pagedkv._core._types cimport block_id_t, token_t, hash_t, int8_t, uint8_t, int32_t, uint32_t, int64_t
from pagedkv._core._arrays cimport IntBuf
from pagedkv._core.evict cimport EvictionPolicy
from pagedkv._core.freelist cimport BlockLists
from pagedkv._core.prefix cimport PrefixIndex, PrefixCursor
from cpython.object cimport PyObject
cimport numpy as cnp

cdef enum:
    RESULT_RING = 4    # recent allocate() results kept for reuse once callers drop them

cdef inline bint must_copy_at(const int32_t* ref_cnt, const uint8_t* cached, block_id_t b) noexcept nogil:
    # Copy-on-write before writing into a partially filled block that another sequence
    # also references, or that is registered: a fork can share a block its parent later
    # fills and registers, and registered KV is immutable (a later prefix hit must find
    # exactly what was registered). Reads the pool's arrays; never writes them.
    return ref_cnt[b] > 1 or cached[b] != 0


cdef class BlockPool:
    cdef readonly int32_t num_blocks       # blocks in the pool, in [1, 2**31 - 1]
    cdef int32_t* ref_cnt                  # [num_blocks] references held; 0 = free or cached-free
    cdef uint8_t* cached                   # [num_blocks] 1 while the block holds a registered prefix
    cdef int32_t* pin_cnt                  # [num_blocks] pins; a pinned block is never evicted
    cdef uint32_t* hits                    # [num_blocks] prefix hits since the block was filled (saturating)
    cdef int32_t* scratch                  # [num_blocks] all zero between calls; duplicate counting (unpin)
    cdef BlockLists queue                  # the free block queue (see freelist.pxd)
    cdef EvictionPolicy policy             # which bucket a freed cached block joins (see evict.pxd)
    cdef readonly PrefixIndex index        # attached prefix index, changed only through the pool; may be None
    cdef IntBuf arg                        # snapshot of the current call's block ids
    cdef IntBuf arg_cls                    # snapshot of the current call's priority classes
    cdef readonly int32_t num_in_use_blocks       # blocks with ref_cnt >= 1
    cdef readonly int32_t num_cached_free_blocks  # ref_cnt == 0 and cached (pinned ones included)
    cdef readonly int32_t num_pinned_free_blocks  # cached-free and pinned (never evictable)
    cdef readonly int64_t num_allocations  # blocks handed out, ever
    cdef readonly int64_t num_frees        # references released, ever
    cdef readonly int64_t num_touches      # references added to existing blocks, ever
    cdef readonly int64_t num_evictions    # cached blocks whose content was dropped, ever
    cdef readonly int64_t num_eviction_batches  # adaptive batch evictions run so far
    cdef readonly int32_t last_eviction_batch   # blocks evicted by the latest eviction (1 when lazy)
    cdef readonly int64_t max_eviction_batch    # largest eviction batch so far
    cdef object _ref_view                  # read-only NumPy view over ref_cnt
    cdef PyObject* ring[RESULT_RING]       # owned references to recent allocate() results
    cdef int ring_pos                      # next ring slot to replace, in [0, RESULT_RING)

    # allocation and release
    cdef int32_t num_free(self) noexcept nogil
    cdef void alloc_into(self, block_id_t* out, int32_t n) noexcept nogil
    cdef int check_takeable(self, const block_id_t* ids, int64_t n, str name) except -1
    cdef void take_into(self, const block_id_t* ids, int64_t n) noexcept nogil
    cdef int64_t release_batch(self, const block_id_t* ids, int64_t n,
                               const int32_t* classes, int8_t cls) noexcept nogil
    cdef void incref(self, block_id_t b) noexcept nogil
    # the prefix index, through the pool
    cdef int32_t take_prefix(self, const token_t* toks, int64_t ntok, int32_t max_blocks,
                             block_id_t* out, PrefixCursor* cur) noexcept nogil
    cdef void cache_full_blocks(self, PrefixCursor* cur, const block_id_t* blocks,
                                const token_t* tokens, int64_t num_computed) noexcept nogil
    # internals
    cdef void evict(self, block_id_t b) noexcept nogil
    cdef void drop_content(self, block_id_t b) noexcept nogil
    cdef void register(self, block_id_t b, hash_t h, const token_t* toks, PrefixCursor* cur,
                       block_id_t parent) noexcept nogil
    cdef void maybe_batch_evict(self) noexcept nogil
    cdef void undo_release(self, const block_id_t* ids, int64_t n) noexcept nogil
    cdef void queue_cached(self, block_id_t b, int8_t cls) noexcept nogil
    cdef int64_t load_ids(self, object block_ids) except -1
    cdef cnp.ndarray result_array(self, cnp.npy_intp n)
    cdef block_id_t _block(self, object block_id) except? -1
    cdef int raise_free_error(self, const block_id_t* ids, int64_t bad, str name) except -1
