# Eviction order over free blocks: intrusive doubly linked lists plus the policy that
# decides which list a freed block joins.
#
# Every free block sits on exactly one list. List EMPTY holds blocks with no cached
# content (reused first). Lists 1..nbuckets hold cached-free blocks; the victim is the
# head of the lowest non-empty bucket, so within a bucket the order is least recently
# freed first (LRU). All list operations are O(1): prev/next arrays, no scans.
from pagedkv._core._types cimport block_id_t, int8_t, int32_t, uint32_t, int64_t

cdef enum:
    MAX_LISTS = 34     # EMPTY + at most 33 eviction buckets
    EMPTY = 0          # free blocks without cached content
    NOT_LISTED = -1    # in use: ref_cnt >= 1
    PINNED_FREE = -2   # cached-free but pinned: never a victim

cdef enum Policy:
    POLICY_LRU = 0
    POLICY_PRIORITY = 1
    POLICY_ADAPTIVE = 2
    POLICY_FREQUENCY = 3

cdef struct BlockLists:
    int32_t* prev              # [num_blocks] previous block on its list; -1 at the head
    int32_t* next              # [num_blocks] next block on its list; -1 at the tail
    int8_t* where              # [num_blocks] list index, NOT_LISTED or PINNED_FREE
    int32_t head[MAX_LISTS]    # first block of each list; -1 when empty
    int32_t tail[MAX_LISTS]    # last block of each list; -1 when empty
    int32_t size[MAX_LISTS]    # blocks on each list, >= 0
    int32_t nlists             # 1 + number of eviction buckets, in [2, MAX_LISTS]


cdef inline void bl_push_back(BlockLists* L, int lst, block_id_t b) noexcept nogil:
    cdef block_id_t t = L.tail[lst]
    L.prev[b] = t
    L.next[b] = -1
    if t >= 0:
        L.next[t] = b
    else:
        L.head[lst] = b
    L.tail[lst] = b
    L.where[b] = <int8_t>lst
    L.size[lst] += 1


cdef inline void bl_push_front(BlockLists* L, int lst, block_id_t b) noexcept nogil:
    cdef block_id_t h = L.head[lst]
    L.next[b] = h
    L.prev[b] = -1
    if h >= 0:
        L.prev[h] = b
    else:
        L.tail[lst] = b
    L.head[lst] = b
    L.where[b] = <int8_t>lst
    L.size[lst] += 1


cdef inline void bl_insert_after(BlockLists* L, block_id_t after, block_id_t b) noexcept nogil:
    # `after` must be listed; b joins the same list right behind it.
    cdef int lst = L.where[after]
    cdef block_id_t n = L.next[after]
    L.prev[b] = after
    L.next[b] = n
    L.next[after] = b
    if n >= 0:
        L.prev[n] = b
    else:
        L.tail[lst] = b
    L.where[b] = <int8_t>lst
    L.size[lst] += 1


cdef inline void bl_unlink(BlockLists* L, block_id_t b) noexcept nogil:
    # b must be on a list.
    cdef int lst = L.where[b]
    cdef block_id_t p = L.prev[b]
    cdef block_id_t n = L.next[b]
    if p >= 0:
        L.next[p] = n
    else:
        L.head[lst] = n
    if n >= 0:
        L.prev[n] = p
    else:
        L.tail[lst] = p
    L.prev[b] = -1
    L.next[b] = -1
    L.where[b] = NOT_LISTED
    L.size[lst] -= 1


cdef class Evictor:
    cdef BlockLists L
    cdef readonly int32_t num_blocks
    cdef Policy policy
    cdef readonly int32_t nbuckets        # eviction buckets, lists 1..nbuckets
    cdef uint32_t* hits                   # [num_blocks] prefix hits since the block was filled
    cdef readonly int32_t low_blocks      # adaptive: evict in a batch below this many empty blocks
    cdef readonly int32_t high_blocks     # adaptive: a batch restores this many empty blocks
    cdef readonly int64_t num_batches     # adaptive batch evictions run so far
    cdef readonly int32_t last_batch      # blocks evicted by the latest eviction (1 when lazy)
    cdef readonly int64_t max_batch       # largest eviction batch so far

    cdef int bucket_for(self, block_id_t b, int8_t cls) noexcept nogil
    cdef block_id_t victim(self) noexcept nogil
    cdef int32_t num_evictable(self) noexcept nogil
    cdef block_id_t batch_victim(self) noexcept nogil
