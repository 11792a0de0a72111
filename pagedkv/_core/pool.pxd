# Block pool: ref counts, the free queue (via the evictor's lists), pins and counters.
from pagedkv._core._types cimport block_id_t, int8_t, uint8_t, int32_t, int64_t
from pagedkv._core.evict cimport Evictor
from pagedkv._core.prefix cimport PrefixIndex
from cpython.object cimport PyObject
cimport numpy as cnp

cdef enum:
    RESULT_RING = 4    # recent allocate() results kept for reuse once callers drop them

cdef class BlockPool:
    cdef readonly int32_t num_blocks       # blocks in the pool, >= 1
    cdef int32_t* ref_cnt                  # [num_blocks] references held; 0 = free or cached-free
    cdef uint8_t* cached                   # [num_blocks] 1 while the block holds a registered prefix
    cdef int32_t* pin_cnt                  # [num_blocks] pins; a pinned block is never evicted
    cdef int32_t* scratch                  # [num_blocks] all zero between calls; batch validation (unpin)
    cdef readonly Evictor evictor          # free-block lists and the eviction policy
    cdef PrefixIndex index                 # notified when a cached block is evicted; may be None
    cdef readonly int32_t num_in_use_blocks       # blocks with ref_cnt >= 1
    cdef readonly int32_t num_cached_free_blocks  # ref_cnt == 0 and cached (pinned ones included)
    cdef readonly int32_t num_pinned_free_blocks  # cached-free and pinned (never evictable)
    cdef readonly int64_t num_allocations  # blocks handed out by allocate, ever
    cdef readonly int64_t num_frees        # references released by free, ever
    cdef readonly int64_t num_touches      # references added by touch, ever
    cdef readonly int64_t num_evictions    # cached blocks whose content was dropped for reuse
    cdef object _ref_view                  # read-only NumPy view over ref_cnt
    cdef PyObject* ring[RESULT_RING]       # owned references to recent allocate() results
    cdef int ring_pos                      # next ring slot to replace, in [0, RESULT_RING)

    cdef int32_t num_free(self) noexcept nogil
    cdef cnp.ndarray result_array(self, cnp.npy_intp n)
    cdef void evict_block(self, block_id_t b) noexcept nogil
    cdef void drop_content(self, block_id_t b) noexcept nogil
    cdef void alloc_into(self, block_id_t* out, int32_t n) noexcept nogil
    cdef void maybe_batch_evict(self) noexcept nogil
    cdef int64_t release_batch(self, const block_id_t* ids, int64_t n,
                               const int32_t* classes, int8_t cls) noexcept nogil
    cdef void undo_release(self, const block_id_t* ids, int64_t n) noexcept nogil
    cdef void queue_cached(self, block_id_t b, int8_t cls) noexcept nogil
    cdef void incref(self, block_id_t b) noexcept nogil
    cdef int32_t check_touch(self, const block_id_t* ids, int64_t n) noexcept nogil
    cdef int raise_free_error(self, const block_id_t* ids, int64_t n, int64_t bad, str name) except -1
