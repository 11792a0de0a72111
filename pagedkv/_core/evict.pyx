# cython: language_level=3
"""Eviction policies over cached-free blocks.

Eviction order (the victim is always the head of the first non-empty list):

1. ``EMPTY``: free blocks that hold no cached prefix. Reusing them loses nothing.
2. Eviction buckets ``1..nbuckets``, lowest first; inside a bucket, the block freed
   longest ago goes first (LRU).

The policy only decides which bucket a freed cached block joins:

- ``lru`` (default): one bucket, so the order is plain least-recently-used.
- ``priority``: bucket = the block's priority class (0 = evicted first). Seed 004's
  default classes are old pages < recent pages < prefix pages.
- ``frequency``: bucket = bit length of the block's prefix-hit count (16 buckets), so a
  system-prompt block hit 10,000 times (bucket 14) outlives any number of one-off blocks
  (bucket 0) pushed through by a scan. LRU inside each bucket.
- ``adaptive``: LRU order; when the empty blocks fall below ``low_blocks`` after an
  allocation, the pool evicts a whole batch, LRU first, until ``high_blocks`` are empty
  again (aggressive under pressure); otherwise it evicts one block at a time, lazily,
  only when an allocation finds no empty block (conservative).

Pinned cached-free blocks are on no list, so no policy can pick them; in-use blocks
(ref_cnt >= 1) are never on a list either.
"""
from libc.stdlib cimport calloc, free as c_free
from libc.string cimport memset

from pagedkv.errors import InvalidArgumentError, expected

POLICIES = {"lru": POLICY_LRU, "priority": POLICY_PRIORITY,
            "adaptive": POLICY_ADAPTIVE, "frequency": POLICY_FREQUENCY}
FREQUENCY_BUCKETS = 16


cdef class Evictor:
    def __cinit__(self, int32_t num_blocks, str policy="lru", int priority_classes=3,
                  double low_watermark=0.05, double high_watermark=0.15):
        cdef int32_t i
        if policy not in POLICIES:
            raise InvalidArgumentError(expected("eviction", f"one of {sorted(POLICIES)}", repr(policy)))
        if num_blocks < 1:
            raise InvalidArgumentError(expected("num_blocks", "an int >= 1", num_blocks))
        if not 1 <= priority_classes <= MAX_LISTS - 1:
            raise InvalidArgumentError(
                expected("priority_classes", f"an int in [1, {MAX_LISTS - 1}]", priority_classes))
        if not (0.0 <= low_watermark <= high_watermark <= 1.0):
            raise InvalidArgumentError(expected(
                "low_watermark, high_watermark", "0 <= low <= high <= 1",
                f"{low_watermark}, {high_watermark}"))
        self.num_blocks = num_blocks
        self.policy = POLICIES[policy]
        if self.policy == POLICY_PRIORITY:
            self.nbuckets = priority_classes
        elif self.policy == POLICY_FREQUENCY:
            self.nbuckets = FREQUENCY_BUCKETS
        else:
            self.nbuckets = 1
        self.low_blocks = <int32_t>(low_watermark * num_blocks)
        self.high_blocks = <int32_t>(high_watermark * num_blocks)
        self.L.prev = <int32_t*>calloc(num_blocks, sizeof(int32_t))
        self.L.next = <int32_t*>calloc(num_blocks, sizeof(int32_t))
        self.L.where = <int8_t*>calloc(num_blocks, sizeof(int8_t))
        self.hits = <uint32_t*>calloc(num_blocks, sizeof(uint32_t))
        if not (self.L.prev and self.L.next and self.L.where and self.hits):
            raise MemoryError(f"cannot allocate eviction lists for {num_blocks} blocks")
        self.L.nlists = 1 + self.nbuckets
        for i in range(MAX_LISTS):
            self.L.head[i] = -1
            self.L.tail[i] = -1
            self.L.size[i] = 0
        for i in range(num_blocks):
            self.L.where[i] = NOT_LISTED

    def __dealloc__(self):
        c_free(self.L.prev)
        c_free(self.L.next)
        c_free(self.L.where)
        c_free(self.hits)

    @property
    def policy_name(self):
        for name, value in POLICIES.items():
            if value == self.policy:
                return name

    cdef int bucket_for(self, block_id_t b, int8_t cls) noexcept nogil:
        cdef uint32_t h
        cdef int bits = 0
        if self.policy == POLICY_PRIORITY:
            if cls < 0:
                cls = 0
            if cls >= self.nbuckets:
                cls = <int8_t>(self.nbuckets - 1)
            return 1 + cls
        if self.policy == POLICY_FREQUENCY:
            h = self.hits[b]
            while h:
                bits += 1
                h >>= 1
            if bits >= self.nbuckets:
                bits = self.nbuckets - 1
            return 1 + bits
        return 1

    cdef block_id_t victim(self) noexcept nogil:
        if self.L.size[EMPTY] > 0:
            return self.L.head[EMPTY]
        return self.batch_victim()

    cdef block_id_t batch_victim(self) noexcept nogil:
        cdef int k
        for k in range(1, self.L.nlists):
            if self.L.size[k] > 0:
                return self.L.head[k]
        return -1

    cdef int32_t num_evictable(self) noexcept nogil:
        cdef int k
        cdef int32_t n = 0
        for k in range(1, self.L.nlists):
            n += self.L.size[k]
        return n

    def list_sizes(self):
        """Blocks on each list: ``[EMPTY, bucket 1, ..., bucket nbuckets]``."""
        return [self.L.size[k] for k in range(self.L.nlists)]

    def order(self):
        """Free blocks in eviction order (victim first), as a list of lists per list."""
        out = []
        cdef int k
        cdef block_id_t b
        for k in range(self.L.nlists):
            lst = []
            b = self.L.head[k]
            while b >= 0:
                lst.append(b)
                b = self.L.next[b]
            out.append(lst)
        return out
