# cython: language_level=3
"""Eviction policies over cached-free blocks.

Eviction order (the victim is always the head of the first non-empty list of the
pool's free queue, see :mod:`pagedkv._core.freelist`):

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
from pagedkv._core._arrays cimport check_int, check_fraction
from pagedkv._core.freelist cimport MAX_LISTS

from pagedkv.errors import InvalidArgumentError, expected

POLICIES = {"lru": POLICY_LRU, "priority": POLICY_PRIORITY,
            "adaptive": POLICY_ADAPTIVE, "frequency": POLICY_FREQUENCY}
POLICY_NAMES = {v: k for k, v in POLICIES.items()}


cdef EvictionPolicy make_policy(str name, int64_t num_blocks, object priority_classes,
                                object low_watermark, object high_watermark) except *:
    cdef EvictionPolicy p
    cdef double low, high
    if name not in POLICIES:
        raise InvalidArgumentError(expected("eviction", f"one of {sorted(POLICIES)}", repr(name)))
    p.kind = POLICIES[name]
    classes = check_int(priority_classes, "priority_classes", 1, MAX_LISTS - 1)
    low = check_fraction(low_watermark, "low_watermark")
    high = check_fraction(high_watermark, "high_watermark")
    if low > high:
        raise InvalidArgumentError(expected("low_watermark, high_watermark", "0 <= low <= high <= 1",
                                            f"{low}, {high}"))
    if p.kind == POLICY_PRIORITY:
        p.nbuckets = classes
    elif p.kind == POLICY_FREQUENCY:
        p.nbuckets = FREQUENCY_BUCKETS
    else:
        p.nbuckets = 1
    p.low_blocks = <int32_t>(low * num_blocks)
    p.high_blocks = <int32_t>(high * num_blocks)
    return p
