# Eviction policy: which bucket of the free queue a freed cached block joins, and the
# seed 004 default class of a sequence's block. Pure functions of their arguments: the
# pool owns the queue and every per-block count these read.
from pagedkv._core._types cimport int8_t, int32_t, uint32_t, int64_t

cdef enum Policy:
    POLICY_LRU = 0
    POLICY_PRIORITY = 1
    POLICY_ADAPTIVE = 2
    POLICY_FREQUENCY = 3

cdef enum:
    FREQUENCY_BUCKETS = 16
    TOP_CLASS = 127            # clamped to the highest bucket (unpinned prefixes)

cdef struct EvictionPolicy:
    Policy kind
    int32_t nbuckets           # eviction buckets (free-queue lists 1..nbuckets), in [1, 33]
    int32_t low_blocks         # adaptive: evict in a batch below this many empty blocks
    int32_t high_blocks        # adaptive: a batch restores this many empty blocks, >= low_blocks


cdef inline int bucket_for(const EvictionPolicy* p, uint32_t hits, int8_t cls) noexcept nogil:
    """Free-queue list (1..nbuckets) of a cached block freed with class `cls` after
    `hits` prefix hits."""
    cdef int bits = 0
    if p.kind == POLICY_PRIORITY:
        if cls < 0:
            return 1
        return 1 + (cls if cls < p.nbuckets else p.nbuckets - 1)
    if p.kind == POLICY_FREQUENCY:
        while hits:
            bits += 1
            hits >>= 1
        return 1 + (bits if bits < p.nbuckets else p.nbuckets - 1)
    return 1


cdef inline int8_t default_class(const EvictionPolicy* p, int64_t block_index, int64_t num_blocks,
                                 int32_t block_size, int64_t prompt_len,
                                 int32_t recent_blocks) noexcept nogil:
    """Seed 004's order for a sequence's block with no explicit class: prompt (prefix)
    blocks outlive the most recent blocks, which outlive older generated blocks."""
    cdef int32_t top = p.nbuckets - 1
    if (block_index + 1) * block_size <= prompt_len:
        return <int8_t>top
    if block_index >= num_blocks - recent_blocks:
        return <int8_t>(1 if top >= 1 else 0)
    return 0


cdef EvictionPolicy make_policy(str name, int64_t num_blocks, object priority_classes,
                                object low_watermark, object high_watermark) except *
