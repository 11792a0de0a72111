# An open-addressing map from uint64 keys to int32 values: linear probing, load factor
# at most 1/2, backward-shift deletion (no tombstones, so probe chains stay short after
# any number of deletions). Shared by the sequence map (key -> row) and the prefix
# index (block hash -> block). Keys are unique: callers insert only absent keys.
from libc.stdlib cimport malloc, free as c_free
from libc.string cimport memset
from pagedkv._core._types cimport int32_t, int64_t, uint64_t

cdef struct HashMap:
    uint64_t* keys       # [mask + 1] key of each occupied slot
    int32_t* vals        # [mask + 1] value of each slot; -1 marks an empty slot
    uint64_t mask        # capacity - 1; capacity is a power of two >= 16
    int64_t size         # occupied slots, <= (mask + 1) / 2


cdef inline uint64_t hm_home(uint64_t key, uint64_t mask) noexcept nogil:
    # splitmix64 finalizer: sequential ids and weak hashes spread over the table
    key ^= key >> 30
    key *= <uint64_t>0xbf58476d1ce4e5b9
    key ^= key >> 27
    key *= <uint64_t>0x94d049bb133111eb
    key ^= key >> 31
    return key & mask


cdef inline int hm_init(HashMap* m, int64_t min_entries) except -1:
    """Room for min_entries keys at load <= 1/2."""
    cdef uint64_t cap = 16
    while cap < 2 * <uint64_t>min_entries:
        cap <<= 1
    m.keys = <uint64_t*>malloc(cap * sizeof(uint64_t))
    m.vals = <int32_t*>malloc(cap * sizeof(int32_t))
    if m.keys == NULL or m.vals == NULL:
        c_free(m.keys)
        c_free(m.vals)
        m.keys = NULL
        m.vals = NULL
        raise MemoryError(f"cannot allocate a hash map of {cap} slots")
    memset(m.vals, 0xff, cap * sizeof(int32_t))
    m.mask = cap - 1
    m.size = 0
    return 0


cdef inline void hm_dealloc(HashMap* m) noexcept nogil:
    c_free(m.keys)
    c_free(m.vals)
    m.keys = NULL
    m.vals = NULL


cdef inline void hm_clear(HashMap* m) noexcept nogil:
    memset(m.vals, 0xff, (m.mask + 1) * sizeof(int32_t))
    m.size = 0


cdef inline int32_t hm_get(const HashMap* m, uint64_t key) noexcept nogil:
    """The value of key, or -1."""
    cdef uint64_t i = hm_home(key, m.mask)
    cdef int32_t v
    while True:
        v = m.vals[i]
        if v < 0 or m.keys[i] == key:
            return v
        i = (i + 1) & m.mask


cdef inline void hm_put_new(HashMap* m, uint64_t key, int32_t val) noexcept nogil:
    # key is absent and the table has room (hm_reserve, or a fixed bound on entries).
    cdef uint64_t i = hm_home(key, m.mask)
    while m.vals[i] >= 0:
        i = (i + 1) & m.mask
    m.keys[i] = key
    m.vals[i] = val
    m.size += 1


cdef inline void hm_delete(HashMap* m, uint64_t key) noexcept nogil:
    # key is present.
    cdef uint64_t i = hm_home(key, m.mask), j, k
    while m.vals[i] < 0 or m.keys[i] != key:
        i = (i + 1) & m.mask
    j = i
    while True:
        j = (j + 1) & m.mask
        if m.vals[j] < 0:
            break
        k = hm_home(m.keys[j], m.mask)
        # move j back into the hole at i unless its home k lies cyclically in (i, j]
        if (i <= j and (k <= i or k > j)) or (i > j and k <= i and k > j):
            m.keys[i] = m.keys[j]
            m.vals[i] = m.vals[j]
            i = j
    m.vals[i] = -1
    m.size -= 1


cdef inline int hm_reserve(HashMap* m, int64_t entries) except -1:
    """Grow (rehash) so that `entries` keys fit at load <= 1/2."""
    cdef HashMap grown
    cdef uint64_t i
    if 2 * <uint64_t>entries <= m.mask + 1:
        return 0
    hm_init(&grown, entries)       # raises MemoryError with m untouched
    for i in range(m.mask + 1):
        if m.vals[i] >= 0:
            hm_put_new(&grown, m.keys[i], m.vals[i])
    hm_dealloc(m)
    m[0] = grown
    return 0
