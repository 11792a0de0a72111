# The free block queue: intrusive doubly linked lists over block ids, owned by the pool.
#
# Every free block sits on exactly one list. List EMPTY holds blocks with no cached
# content (reused first). Lists 1..nbuckets hold cached-free blocks; the victim is the
# head of the lowest non-empty bucket, so within a bucket the order is least recently
# freed first (LRU). Every operation is O(1): prev/next arrays, no scans.
from pagedkv._core._types cimport block_id_t, int8_t, int32_t

cdef enum:
    MAX_LISTS = 34     # EMPTY + at most 33 eviction buckets
    EMPTY = 0          # free blocks without cached content
    NOT_LISTED = -1    # in use: ref_cnt >= 1
    PINNED_FREE = -2   # cached-free but pinned: never a victim

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


cdef inline block_id_t bl_first_cached(const BlockLists* L) noexcept nogil:
    """Head of the lowest non-empty eviction bucket (the next victim), or -1."""
    cdef int k
    for k in range(1, L.nlists):
        if L.size[k] > 0:
            return L.head[k]
    return -1


cdef inline int32_t bl_num_cached(const BlockLists* L) noexcept nogil:
    """Blocks on the eviction buckets (evictable cached-free blocks)."""
    cdef int k
    cdef int32_t n = 0
    for k in range(1, L.nlists):
        n += L.size[k]
    return n
