# cython: language_level=3
"""BlockPool: the allocator, and the one owner of every block's state.

Block states (exactly one at a time):

- **free**: ``ref_cnt == 0`` and no cached content; on the ``EMPTY`` list.
- **in use**: ``ref_cnt >= 1``; on no list.
- **cached-free**: ``ref_cnt == 0`` and holds a registered prefix; on an eviction bucket,
  or on no list when pinned.

``free + in_use + cached_free == num_blocks`` always holds.

Eviction order (the free queue): ``allocate`` takes free blocks from the front of
``EMPTY`` first, then evicts cached-free blocks, lowest bucket first and least recently
freed first inside a bucket (see :mod:`pagedkv._core.evict` for the policies).
``free`` returns blocks that reach ``ref_cnt == 0`` in the order given: blocks without
cached content go to the front of the queue (reused first), cached blocks to the back
of their bucket (evicted last), so the first id given is the first to go. ``touch``
adds references and takes cached-free blocks off the queue in O(1).

The pool owns the ref counts, the cached bit, pins, hit counts and the free queue
(like vLLM's ``BlockPool``); the prefix index attached to it is changed only through it:
``cache_full_blocks`` registers a sequence's newly full blocks, eviction ends a
registration, ``reset_cache`` clears them all.

Every call snapshots its array arguments, validates the whole batch and only then
changes anything, so a failed call leaves the pool exactly as it was. Thread safety:
not thread-safe on its own (callers serialise; :class:`pagedkv.PagedKVCache` holds a
lock). Batch loops may run without the GIL, on the call's private snapshot.
"""

cimport numpy as cnp
from libc.stdlib cimport calloc, free as c_free
from libc.stdint cimport UINT32_MAX
from cpython.object cimport PyObject

from pagedkv._core._arrays cimport load_ints, check_int, check_count, new_i32
from pagedkv._core.freelist cimport (bl_push_back, bl_push_front, bl_unlink, bl_first_cached,
                                     bl_num_cached, EMPTY, NOT_LISTED, PINNED_FREE, MAX_LISTS)
from pagedkv._core.evict cimport (bucket_for, make_policy, POLICY_ADAPTIVE, TOP_CLASS)
from pagedkv._core.prefix cimport PROBE_ABSENT, PROBE_MATCH, PROBE_CONFLICT, Probe

import numpy as np
from pagedkv._core.evict import POLICY_NAMES
from pagedkv.errors import (ArgumentTypeError, CacheBusyError, HostMemoryError, InternalError,
                            InvalidArgumentError, InvalidBlockError, OutOfBlocksError, expected)
from pagedkv.config.memory import check_fits

cnp.import_array()

cdef int64_t MAX_BLOCKS = 2**31 - 1
# Bytes of bookkeeping per block the pool writes at construction (ref, cached, pins,
# hits, scratch, the queue's prev/next/where): checked against free memory up front, so
# an absurd pool is refused instead of being killed by the OOM killer mid-way.
cdef int64_t POOL_BYTES_PER_BLOCK = 30

cdef extern from "Python.h":
    Py_ssize_t Py_REFCNT(PyObject* o)
    void Py_INCREF(PyObject* o)
    void Py_XDECREF(PyObject* o)


#: bookkeeping bytes per block, for callers that size a pool before making one
BYTES_PER_BLOCK = POOL_BYTES_PER_BLOCK


cdef class BlockPool:
    def __cinit__(self, num_blocks, str eviction="lru", *, priority_classes=3,
                  low_watermark=0.05, high_watermark=0.15, shuffle_seed=None,
                  PrefixIndex index=None):
        cdef int64_t nb = check_int(num_blocks, "num_blocks", 1, MAX_BLOCKS)
        cdef int32_t b, k
        self.policy = make_policy(eviction, nb, priority_classes, low_watermark, high_watermark)
        if index is not None:
            if index.num_blocks != nb:
                raise InvalidArgumentError(expected("index", f"a PrefixIndex over {nb} blocks",
                                                    f"one over {index.num_blocks}"))
            if index.owner is not None:
                raise InvalidArgumentError(expected("index", "a PrefixIndex not attached to another pool",
                                                    "one that already is"))
        check_fits("cpu", [("num_blocks", nb, nb * POOL_BYTES_PER_BLOCK)], "a pool whose bookkeeping fits")
        self.num_blocks = <int32_t>nb
        self.ref_cnt = <int32_t*>calloc(nb, sizeof(int32_t))
        self.cached = <uint8_t*>calloc(nb, sizeof(uint8_t))
        self.pin_cnt = <int32_t*>calloc(nb, sizeof(int32_t))
        self.hits = <uint32_t*>calloc(nb, sizeof(uint32_t))
        self.scratch = <int32_t*>calloc(nb, sizeof(int32_t))
        self.queue.prev = <int32_t*>calloc(nb, sizeof(int32_t))
        self.queue.next = <int32_t*>calloc(nb, sizeof(int32_t))
        self.queue.where = <int8_t*>calloc(nb, sizeof(int8_t))
        if not (self.ref_cnt and self.cached and self.pin_cnt and self.hits and self.scratch
                and self.queue.prev and self.queue.next and self.queue.where):
            raise HostMemoryError(f"cannot allocate a pool of {nb} blocks")
        self.queue.nlists = 1 + self.policy.nbuckets
        for k in range(MAX_LISTS):
            self.queue.head[k] = -1
            self.queue.tail[k] = -1
            self.queue.size[k] = 0
        if shuffle_seed is None:
            for b in range(self.num_blocks):
                bl_push_back(&self.queue, EMPTY, b)
        else:
            seed = check_int(shuffle_seed, "shuffle_seed", 0, 2**63 - 1)
            for b in np.random.default_rng(seed).permutation(nb).tolist():
                bl_push_back(&self.queue, EMPTY, b)
        self._ref_view = np.asarray(<int32_t[:nb]>self.ref_cnt)
        self._ref_view.flags.writeable = False
        if index is not None:
            index.live = self.cached
            index.owner = self
        self.index = index

    def __dealloc__(self):
        cdef int i
        for i in range(RESULT_RING):
            Py_XDECREF(self.ring[i])
            self.ring[i] = NULL
        c_free(self.ref_cnt)
        c_free(self.cached)
        c_free(self.pin_cnt)
        c_free(self.hits)
        c_free(self.scratch)
        c_free(self.queue.prev)
        c_free(self.queue.next)
        c_free(self.queue.where)
        c_free(self.arg.data)
        c_free(self.arg_cls.data)

    # ---- allocation and release ------------------------------------------------------
    cdef int32_t num_free(self) noexcept nogil:
        return self.queue.size[EMPTY] + bl_num_cached(&self.queue)

    cdef void alloc_into(self, block_id_t* out, int32_t n) noexcept nogil:
        # The caller has checked n <= num_free().
        cdef int32_t* ref = self.ref_cnt
        cdef uint32_t* hits = self.hits
        cdef int8_t* where = self.queue.where
        cdef const int32_t* nxt = self.queue.next
        cdef int32_t i = 0, take
        cdef block_id_t b
        # Fast path: pop a run off the EMPTY head (no content to drop, no list lookups).
        take = n if self.queue.size[EMPTY] >= n else self.queue.size[EMPTY]
        if take:
            b = self.queue.head[EMPTY]
            for i in range(take):
                out[i] = b
                ref[b] = 1
                hits[b] = 0
                where[b] = NOT_LISTED
                b = nxt[b]
            self.queue.head[EMPTY] = b
            if b >= 0:
                self.queue.prev[b] = -1
            else:
                self.queue.tail[EMPTY] = -1
            self.queue.size[EMPTY] -= take
        for i in range(take, n):
            b = bl_first_cached(&self.queue)
            bl_unlink(&self.queue, b)
            self.evict(b)
            self.last_eviction_batch = 1
            ref[b] = 1
            hits[b] = 0
            out[i] = b
        self.num_in_use_blocks += n
        self.num_allocations += n
        if n and self.policy.kind == POLICY_ADAPTIVE:
            self.maybe_batch_evict()

    cdef void maybe_batch_evict(self) noexcept nogil:
        cdef int32_t k = 0
        cdef block_id_t b
        if self.queue.size[EMPTY] >= self.policy.low_blocks:
            return
        while self.queue.size[EMPTY] < self.policy.high_blocks:
            b = bl_first_cached(&self.queue)
            if b < 0:
                break
            bl_unlink(&self.queue, b)
            self.evict(b)
            bl_push_back(&self.queue, EMPTY, b)
            k += 1
        if k:
            self.num_eviction_batches += 1
            self.last_eviction_batch = k
            if k > self.max_eviction_batch:
                self.max_eviction_batch = k

    cdef int64_t release_batch(self, const block_id_t* ids, int64_t n,
                               const int32_t* classes, int8_t cls) noexcept nogil:
        # One pass, in order: a block that reaches ref_cnt 0 is queued at once, so the
        # queue order is exactly the sequential order of the batch. Content-free blocks
        # are chained into one run that is spliced onto the front of EMPTY at the end.
        # An id out of range or already at 0 (a double free, or a duplicate beyond its
        # ref_cnt) undoes the pass and returns its index; -1 on success.
        # Locals, not self->fields: stores through int32_t* may alias int32 fields of
        # self, which would force the compiler to reload every pointer per block.
        cdef int32_t* ref = self.ref_cnt
        cdef const uint8_t* cached = self.cached
        cdef int8_t* where = self.queue.where
        cdef int32_t* nxt = self.queue.next
        cdef int32_t* prv = self.queue.prev
        cdef int32_t nb = self.num_blocks
        cdef int64_t i
        cdef block_id_t b, old, run_head = -1, run_tail = -1
        cdef int32_t run_len = 0, zeroed = 0, r, c
        for i in range(n):
            b = ids[i]
            if <uint32_t>b >= <uint32_t>nb:       # also catches negative ids
                self.undo_release(ids, i)
                return i
            r = ref[b]
            if r == 0:
                self.undo_release(ids, i)
                return i
            r -= 1
            ref[b] = r
            if r:
                continue
            zeroed += 1
            if cached[b]:
                if classes != NULL:
                    c = classes[i]
                    cls = <int8_t>(0 if c < 0 else (127 if c > 127 else c))
                self.queue_cached(b, cls)
                continue
            where[b] = EMPTY
            prv[b] = run_tail
            if run_tail < 0:
                run_head = b
            else:
                nxt[run_tail] = b
            run_tail = b
            run_len += 1
        if run_len:
            old = self.queue.head[EMPTY]
            nxt[run_tail] = old
            if old >= 0:
                prv[old] = run_tail
            else:
                self.queue.tail[EMPTY] = run_tail
            self.queue.head[EMPTY] = run_head
            self.queue.size[EMPTY] += run_len
        self.num_in_use_blocks -= zeroed
        self.num_frees += n
        return -1

    cdef void undo_release(self, const block_id_t* ids, int64_t n) noexcept nogil:
        # Walk the applied prefix backwards; the first time a block is seen at 0 is the
        # release that queued it. The content-free run was never spliced, so its
        # blocks only need their list mark cleared.
        cdef int64_t j
        cdef block_id_t b
        for j in range(n - 1, -1, -1):
            b = ids[j]
            if self.ref_cnt[b] == 0:
                if self.cached[b]:
                    self.num_cached_free_blocks -= 1
                    if self.queue.where[b] == PINNED_FREE:
                        self.num_pinned_free_blocks -= 1
                        self.queue.where[b] = NOT_LISTED
                    else:
                        bl_unlink(&self.queue, b)
                else:
                    self.queue.where[b] = NOT_LISTED
            self.ref_cnt[b] += 1

    cdef void queue_cached(self, block_id_t b, int8_t cls) noexcept nogil:
        # b just reached ref_cnt 0 and holds a registered prefix.
        self.num_cached_free_blocks += 1
        if self.pin_cnt[b]:
            self.queue.where[b] = PINNED_FREE
            self.num_pinned_free_blocks += 1
        else:
            bl_push_back(&self.queue, bucket_for(&self.policy, self.hits[b], cls), b)

    cdef void incref(self, block_id_t b) noexcept nogil:
        # The caller has checked that b is in use or cached-free.
        if self.ref_cnt[b] == 0:
            if self.queue.where[b] == PINNED_FREE:
                self.queue.where[b] = NOT_LISTED
                self.num_pinned_free_blocks -= 1
            else:
                bl_unlink(&self.queue, b)
            self.num_cached_free_blocks -= 1
            self.num_in_use_blocks += 1
        self.ref_cnt[b] += 1
        if self.hits[b] != UINT32_MAX:
            self.hits[b] += 1
        self.num_touches += 1

    # ---- the prefix index, through the pool ------------------------------------------
    cdef void evict(self, block_id_t b) noexcept nogil:
        # A cached-free block, just taken off its list, loses its content.
        if self.index is not None:
            self.index.remove(b)
        self.cached[b] = 0
        self.num_cached_free_blocks -= 1
        self.num_evictions += 1

    cdef void drop_content(self, block_id_t b) noexcept nogil:
        # Forget a block's cached content without allocating it (an orphaned prefix
        # block being replaced). A cached-free block becomes plain free.
        if not self.cached[b]:
            return
        if self.ref_cnt[b] == 0:
            if self.queue.where[b] == PINNED_FREE:
                self.num_pinned_free_blocks -= 1
                self.queue.where[b] = NOT_LISTED
            else:
                bl_unlink(&self.queue, b)
            self.evict(b)
            bl_push_front(&self.queue, EMPTY, b)
        else:
            self.index.remove(b)
            self.cached[b] = 0
            self.num_evictions += 1

    cdef void register(self, block_id_t b, hash_t h, const token_t* toks, PrefixCursor* cur,
                       block_id_t parent) noexcept nogil:
        self.index.insert(b, h, cur.last_hash, toks, cur.ns_id, parent, cur.canon_gen)
        self.cached[b] = 1

    cdef int32_t take_prefix(self, const token_t* toks, int64_t ntok, int32_t max_blocks,
                             block_id_t* out, PrefixCursor* cur) noexcept nogil:
        # The longest verified cached prefix (at most max_blocks full blocks) becomes the
        # sequence's: one reference each, cur advanced past it.
        cdef int32_t n, i
        if self.index is None:
            return 0
        n = self.index.lookup(toks, ntok, cur.ns_id, cur.ns_hash, out, cur, max_blocks)
        for i in range(n):
            self.incref(out[i])
        return n

    cdef void cache_full_blocks(self, PrefixCursor* cur, const block_id_t* blocks,
                                const token_t* tokens, int64_t num_computed) noexcept nogil:
        # Offer a sequence's newly full blocks to the index, in order. A block whose
        # content is already registered elsewhere stays private (a duplicate); a true
        # hash collision, or a parent that was evicted meanwhile, ends registration
        # for this sequence. Either way a later lookup can only miss, never mismatch.
        cdef int32_t bs = self.index.block_size
        cdef int32_t i
        cdef block_id_t b, c, parent
        cdef hash_t h
        cdef Probe r
        cdef const token_t* toks
        while cur.track and <int64_t>(cur.num_hashed + 1) * bs <= num_computed:
            i = cur.num_hashed
            if i > 0 and not self.index.canon_valid(cur.canon_block, cur.canon_gen):
                cur.track = 0
                return
            parent = cur.canon_block if i > 0 else -1
            b = blocks[i]
            toks = tokens + <int64_t>i * bs
            h = self.index.hash_block(toks, cur.last_hash, cur.ns_hash)
            r = self.index.probe(h, toks, cur.ns_id, parent, cur.canon_gen, &c)
            if r == PROBE_ABSENT or (c != b and r != PROBE_MATCH):
                if self.cached[b]:
                    cur.track = 0     # b already holds other content (a shared block)
                    return
                if r != PROBE_ABSENT:
                    if r == PROBE_CONFLICT or self.pin_cnt[c]:
                        self.index.note_collision()
                        cur.track = 0
                        return
                    # c holds this content's hash but hangs off an evicted parent, so no
                    # lookup can reach it: replace it with this sequence's block.
                    self.drop_content(c)
                self.register(b, h, toks, cur, parent)
                c = b
            cur.canon_block = c
            cur.canon_gen = self.index.gen[c]
            cur.last_hash = h
            cur.num_hashed += 1

    # ---- snapshots and results -----------------------------------------------------
    cdef int64_t load_ids(self, object block_ids) except -1:
        return load_ints(block_ids, "block_ids", cnp.NPY_INT32, &self.arg)

    cdef cnp.ndarray result_array(self, cnp.npy_intp n):
        # allocate() returns a fresh-looking int32 array, but creating and destroying a
        # NumPy array costs more than allocating 32 blocks. The pool keeps its last few
        # results; one whose only reference is this ring has been dropped by the caller
        # (views and buffer exports hold references), so nobody can observe it being
        # refilled. Shape, dtype and contiguity are re-checked because they can be
        # reassigned in place.
        cdef int i
        cdef PyObject* p
        cdef cnp.ndarray a
        for i in range(RESULT_RING):
            p = self.ring[i]
            if (p != NULL and Py_REFCNT(p) == 1 and cnp.PyArray_NDIM(<cnp.ndarray>p) == 1
                    and cnp.PyArray_DIM(<cnp.ndarray>p, 0) == n and cnp.PyArray_TYPE(<cnp.ndarray>p) == cnp.NPY_INT32
                    and cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>p) and cnp.PyArray_ISWRITEABLE(<cnp.ndarray>p)
                    and cnp.PyArray_ISNOTSWAPPED(<cnp.ndarray>p)):
                return <cnp.ndarray>p
        a = new_i32(n)
        Py_INCREF(<PyObject*>a)
        Py_XDECREF(self.ring[self.ring_pos])
        self.ring[self.ring_pos] = <PyObject*>a
        self.ring_pos = (self.ring_pos + 1) % RESULT_RING
        return a

    cdef int raise_free_error(self, const block_id_t* ids, int64_t bad, str name) except -1:
        cdef block_id_t b = ids[bad]
        cdef int64_t i, times = 0
        if b < 0 or b >= self.num_blocks:
            raise InvalidBlockError(expected(name, f"block ids in [0, {self.num_blocks})",
                                             f"{b} at index {bad}"))
        for i in range(bad + 1):
            if ids[i] == b:
                times += 1
        if times == 1:
            raise InvalidBlockError(expected(name, "blocks that are in use",
                                             f"block {b} at index {bad}, which is free (double free?)"))
        raise InvalidBlockError(expected(
            name, f"at most {self.ref_cnt[b]} release(s) of block {b} (its ref_cnt)",
            f"{times} in this batch"))

    # ---- Python API -----------------------------------------------------------------
    def allocate(self, n):
        """Allocate ``n`` blocks, all or nothing. Returns their ids (int32 array)."""
        cdef int64_t k
        cdef int32_t free_now = self.num_free()
        if not (type(n) is int and 0 <= n <= free_now):
            n = check_count(n, "n")
            if n > free_now:
                raise OutOfBlocksError(n, free_now)
        k = n
        cdef cnp.ndarray out = self.result_array(k)
        self.alloc_into(<block_id_t*>cnp.PyArray_DATA(out), <int32_t>k)
        return out

    def allocate_many(self, counts):
        """Allocate for many requests in one call, all or nothing.

        ``counts``: blocks wanted per request (int32 array or list). Returns
        ``(indptr, block_ids)``: request ``i`` got ``block_ids[indptr[i]:indptr[i+1]]``.
        """
        cdef int64_t m = load_ints(counts, "counts", cnp.NPY_INT32, &self.arg)
        cdef const int32_t* cp = <const int32_t*>self.arg.data
        cdef int64_t i, total = 0
        for i in range(m):
            if cp[i] < 0:
                raise InvalidArgumentError(expected("counts", "block counts >= 0", f"{cp[i]} at index {i}"))
            total += cp[i]                    # int32 values, at most 2**31 of them: no overflow
        cdef int32_t free_now = self.num_free()
        if total > free_now:
            raise OutOfBlocksError(total, free_now)
        cdef cnp.ndarray indptr = new_i32(m + 1), out = new_i32(total)
        cdef int32_t* ip = <int32_t*>cnp.PyArray_DATA(indptr)
        ip[0] = 0
        for i in range(m):
            ip[i + 1] = ip[i] + cp[i]
        self.alloc_into(<block_id_t*>cnp.PyArray_DATA(out), <int32_t>total)
        return indptr, out

    cdef int check_takeable(self, const block_id_t* ids, int64_t n, str name) except -1:
        # Each id in range, free (ref_cnt 0), not pinned, listed once; changes nothing
        # (scratch marks the ids seen and is cleared again on every path).
        cdef int64_t i, j, bad = -1
        cdef block_id_t b = 0
        cdef int why = 0
        for i in range(n):
            b = ids[i]
            if b < 0 or b >= self.num_blocks:
                why = 1
            elif self.ref_cnt[b] != 0:
                why = 2
            elif self.queue.where[b] == PINNED_FREE:
                why = 3
            elif self.scratch[b]:
                why = 4
            if why:
                bad = i
                break
            self.scratch[b] = 1
        for j in range(bad if bad >= 0 else n):
            self.scratch[ids[j]] = 0
        if why == 1:
            raise InvalidBlockError(expected(name, f"block ids in [0, {self.num_blocks})", f"{b} at index {bad}"))
        if why == 2:
            raise InvalidBlockError(expected(name, "free blocks", f"block {b} at index {bad}, which is in use"))
        if why == 3:
            raise InvalidBlockError(expected(name, "free, unpinned blocks", f"block {b} at index {bad}, which is pinned"))
        if why == 4:
            raise InvalidArgumentError(expected(name, "each block at most once", f"block {b} repeated at index {bad}"))
        return 0

    cdef void take_into(self, const block_id_t* ids, int64_t n) noexcept nogil:
        # Allocate exactly these blocks (checked by check_takeable): off their free list,
        # a cached one losing its content as a victim would.
        cdef int64_t i
        cdef block_id_t b
        for i in range(n):
            b = ids[i]
            bl_unlink(&self.queue, b)
            if self.cached[b]:
                self.evict(b)
            self.ref_cnt[b] = 1
            self.hits[b] = 0
        self.num_in_use_blocks += <int32_t>n
        self.num_allocations += n
        if n and self.policy.kind == POLICY_ADAPTIVE:
            self.maybe_batch_evict()

    def take(self, block_ids):
        """Allocate exactly these free blocks, all or nothing.

        For callers that place blocks themselves (contiguous runs, compaction targets).
        Each must be free and unpinned, and listed once; a cached-free block loses its
        prefix as an eviction victim would. Release them with :meth:`free`.
        """
        cdef int64_t n = self.load_ids(block_ids)
        cdef const block_id_t* ip = <const block_id_t*>self.arg.data
        self.check_takeable(ip, n, "block_ids")
        self.take_into(ip, n)

    def is_free(self, block_id):
        """Whether the block can be taken now (ref_cnt 0 and not pinned)."""
        cdef block_id_t b = self._block(block_id)
        return self.ref_cnt[b] == 0 and self.queue.where[b] != PINNED_FREE

    def free(self, block_ids, priority=None):
        """Release one reference to each id, in the order given.

        ``priority``: eviction class of the cached blocks freed (``priority`` policy;
        0 is evicted first), an int in [0, 127] or an int32 array parallel to
        ``block_ids``. An id listed more than once returns to the queue at its first
        position once all its references are gone.
        """
        cdef int64_t n = self.load_ids(block_ids), bad, nc
        cdef const block_id_t* ip = <const block_id_t*>self.arg.data
        cdef int8_t cls = 0
        cdef const int32_t* cp = NULL
        if priority is not None:
            if type(priority) is int or isinstance(priority, bool) or not hasattr(priority, "__len__"):
                cls = <int8_t>check_int(priority, "priority", 0, 127)
            else:
                nc = load_ints(priority, "priority", cnp.NPY_INT32, &self.arg_cls)
                if nc != n:
                    raise InvalidArgumentError(expected("priority", f"{n} classes (one per block id)", nc))
                cp = <const int32_t*>self.arg_cls.data
        with nogil:
            bad = self.release_batch(ip, n, cp, cls)
        if bad >= 0:
            self.raise_free_error(ip, bad, "block_ids")

    def touch(self, block_ids):
        """Add one reference to each id (in use or cached-free); a cached-free block
        leaves the free queue in O(1)."""
        cdef int64_t n = self.load_ids(block_ids), i
        cdef const block_id_t* ip = <const block_id_t*>self.arg.data
        cdef block_id_t b
        for i in range(n):
            b = ip[i]
            if b < 0 or b >= self.num_blocks:
                raise InvalidBlockError(expected("block_ids", f"block ids in [0, {self.num_blocks})",
                                                 f"{b} at index {i}"))
            if self.ref_cnt[b] == 0 and not self.cached[b]:
                raise InvalidBlockError(expected("block_ids", "blocks in use or cached-free",
                                                 f"block {b} at index {i}, which is free and holds no content"))
        for i in range(n):
            self.incref(ip[i])

    def mark_cached(self, block_ids):
        """Record that in-use blocks now hold reusable content (they will be evicted
        LRU instead of being reused first). Only for a pool without a prefix index:
        with one, blocks become cached by registration (``BlockTables`` commits)."""
        if self.index is not None:
            raise InvalidArgumentError(expected("mark_cached", "a pool without a prefix index (with one, "
                                                "blocks are cached by registration)", "a pool with one"))
        cdef int64_t n = self.load_ids(block_ids), i
        cdef const block_id_t* ip = <const block_id_t*>self.arg.data
        for i in range(n):
            if ip[i] < 0 or ip[i] >= self.num_blocks or self.ref_cnt[ip[i]] == 0:
                raise InvalidBlockError(expected("block_ids", "blocks that are in use", f"{ip[i]} at index {i}"))
        for i in range(n):
            self.cached[ip[i]] = 1

    def pin(self, block_ids):
        """Pin cached blocks: a pinned block is never evicted, even when free."""
        cdef int64_t n = self.load_ids(block_ids), i
        cdef const block_id_t* ip = <const block_id_t*>self.arg.data
        cdef block_id_t b
        for i in range(n):
            b = ip[i]
            if b < 0 or b >= self.num_blocks or not self.cached[b]:
                raise InvalidBlockError(expected("block_ids", "blocks holding cached content", f"{b} at index {i}"))
        for i in range(n):
            b = ip[i]
            self.pin_cnt[b] += 1
            if self.ref_cnt[b] == 0 and self.queue.where[b] != PINNED_FREE:
                bl_unlink(&self.queue, b)
                self.queue.where[b] = PINNED_FREE
                self.num_pinned_free_blocks += 1

    def unpin(self, block_ids):
        """Drop one pin per id; a cached-free block with no pins left becomes evictable."""
        cdef int64_t n = self.load_ids(block_ids), i, bad = -1
        cdef const block_id_t* ip = <const block_id_t*>self.arg.data
        cdef block_id_t b
        for i in range(n):
            b = ip[i]
            if b < 0 or b >= self.num_blocks:
                raise InvalidBlockError(expected("block_ids", f"block ids in [0, {self.num_blocks})", f"{b} at index {i}"))
        # count each id's releases in scratch; scratch is restored on every path
        for i in range(n):
            self.scratch[ip[i]] += 1
            if bad < 0 and self.scratch[ip[i]] > self.pin_cnt[ip[i]]:
                bad = i
        for i in range(n):
            self.scratch[ip[i]] = 0
        if bad >= 0:
            raise InvalidBlockError(expected("block_ids", "pinned blocks", f"block {ip[bad]}, which is not pinned"))
        for i in range(n):
            b = ip[i]
            self.pin_cnt[b] -= 1
            if self.pin_cnt[b] == 0 and self.ref_cnt[b] == 0:
                self.num_pinned_free_blocks -= 1
                bl_push_back(&self.queue, bucket_for(&self.policy, self.hits[b], TOP_CLASS), b)

    def reset_cache(self):
        """Drop every cached prefix (and pin). Fails while any block is in use."""
        cdef block_id_t b
        if self.num_in_use_blocks:
            raise CacheBusyError(f"reset_prefix_cache: expected no block in use, got {self.num_in_use_blocks} in use")
        if self.index is not None:
            self.index.clear()
        for b in range(self.num_blocks):
            if self.cached[b]:
                if self.queue.where[b] >= 1:
                    bl_unlink(&self.queue, b)
                else:
                    self.queue.where[b] = NOT_LISTED
                self.cached[b] = 0
                self.pin_cnt[b] = 0
                self.hits[b] = 0
                bl_push_back(&self.queue, EMPTY, b)
        self.num_cached_free_blocks = 0
        self.num_pinned_free_blocks = 0

    # ---- inspection -----------------------------------------------------------------
    @property
    def num_free_blocks(self):
        """Blocks an allocation can take now: free plus evictable cached-free."""
        return self.num_free()

    @property
    def num_empty_blocks(self):
        """Free blocks with no cached content."""
        return self.queue.size[EMPTY]

    @property
    def ref_cnt(self):
        """Read-only int32 view of every block's ref count (live, not a copy)."""
        return self._ref_view

    @property
    def eviction(self):
        return POLICY_NAMES[self.policy.kind]

    @property
    def num_buckets(self):
        """Eviction buckets of the policy (lists 1..num_buckets of the free queue)."""
        return self.policy.nbuckets

    cdef block_id_t _block(self, object block_id) except? -1:
        # an id out of range is a bad block id (InvalidBlockError, as free() and unpin()
        # say), a non-int a wrong type (ArgumentTypeError)
        if type(block_id) is int and 0 <= block_id < self.num_blocks:
            return <block_id_t>block_id
        if type(block_id) is not int:
            if isinstance(block_id, bool) or not hasattr(type(block_id), "__index__"):
                raise ArgumentTypeError(expected("block_id", f"an int in [0, {self.num_blocks})", repr(block_id)))
            block_id = block_id.__index__()
        if not 0 <= block_id < self.num_blocks:
            raise InvalidBlockError(expected("block_id", f"a block id in [0, {self.num_blocks})", repr(block_id)))
        return <block_id_t>block_id

    def is_cached(self, block_id):
        return bool(self.cached[self._block(block_id)])

    def pin_count(self, block_id):
        return self.pin_cnt[self._block(block_id)]

    def hit_count(self, block_id):
        return self.hits[self._block(block_id)]

    def free_lists(self):
        """The free queue as lists, victim first: ``[EMPTY, bucket 1, ..., bucket n]``."""
        out = []
        cdef int k
        cdef block_id_t b
        for k in range(self.queue.nlists):
            lst = []
            b = self.queue.head[k]
            while b >= 0:
                lst.append(b)
                b = self.queue.next[b]
            out.append(lst)
        return out

    def free_list_sizes(self):
        """Blocks on each list of the free queue: ``[EMPTY, bucket 1, ..., bucket n]``."""
        return [self.queue.size[k] for k in range(self.queue.nlists)]

    def free_block_queue(self):
        """Allocatable blocks in the order allocate() takes them (int32 array)."""
        return np.asarray([b for lst in self.free_lists() for b in lst], dtype=np.int32)

    def block_state(self, block_id):
        """'free', 'in_use' or 'cached_free'."""
        cdef block_id_t b = self._block(block_id)
        if self.ref_cnt[b]:
            return "in_use"
        return "cached_free" if self.cached[b] else "free"

    def states(self):
        """Per-block state codes (uint8 array): 0 free, 1 in use, 2 cached-free."""
        out = np.zeros(self.num_blocks, dtype=np.uint8)
        cdef unsigned char[::1] o = out
        cdef block_id_t b
        for b in range(self.num_blocks):
            o[b] = 1 if self.ref_cnt[b] else (2 if self.cached[b] else 0)
        return out

    def pinned_blocks(self):
        """Ids of blocks with at least one pin (int32 array)."""
        return np.asarray([b for b in range(self.num_blocks) if self.pin_cnt[b]], dtype=np.int32)

    def eviction_stats(self):
        return {"evictions": self.num_evictions, "eviction_batches": self.num_eviction_batches,
                "last_eviction_batch": self.last_eviction_batch, "max_eviction_batch": self.max_eviction_batch,
                "low_watermark_blocks": self.policy.low_blocks, "high_watermark_blocks": self.policy.high_blocks}

    def check_invariants(self):
        """O(num_blocks) audit of every structural invariant; raises InternalError."""
        cdef int k
        cdef int32_t n, in_use = 0, cached_free = 0, pinned = 0, empty = 0
        cdef block_id_t b, prev
        for k in range(self.queue.nlists):
            n = 0
            prev = -1
            b = self.queue.head[k]
            while b >= 0:
                if self.queue.where[b] != k or self.queue.prev[b] != prev:
                    raise InternalError(f"free list {k} is corrupt at block {b}")
                n += 1
                if n > self.num_blocks:
                    raise InternalError(f"free list {k} has a cycle")
                prev = b
                b = self.queue.next[b]
            if self.queue.tail[k] != prev or self.queue.size[k] != n:
                raise InternalError(f"free list {k}: size {self.queue.size[k]} / tail {self.queue.tail[k]} "
                                    f"disagree with its {n} blocks")
        for b in range(self.num_blocks):
            if self.scratch[b]:
                raise InternalError(f"scratch[{b}] left non-zero")
            if self.ref_cnt[b] < 0:
                raise InternalError(f"block {b} has ref_cnt {self.ref_cnt[b]}")
            if self.ref_cnt[b] > 0:
                in_use += 1
                if self.queue.where[b] != NOT_LISTED:
                    raise InternalError(f"in-use block {b} is on free list {self.queue.where[b]}")
            elif not self.cached[b]:
                empty += 1
                if self.queue.where[b] != EMPTY:
                    raise InternalError(f"free block {b} is not on the EMPTY list")
            else:
                cached_free += 1
                if self.pin_cnt[b]:
                    pinned += 1
                    if self.queue.where[b] != PINNED_FREE:
                        raise InternalError(f"pinned cached-free block {b} is on list {self.queue.where[b]}")
                elif self.queue.where[b] < 1:
                    raise InternalError(f"cached-free block {b} is not on an eviction bucket")
            if self.pin_cnt[b] and not self.cached[b]:
                raise InternalError(f"block {b} is pinned but holds no cached content")
        if (in_use != self.num_in_use_blocks or cached_free != self.num_cached_free_blocks
                or pinned != self.num_pinned_free_blocks or empty != self.queue.size[EMPTY]):
            raise InternalError(
                f"counters disagree: in_use {in_use}/{self.num_in_use_blocks}, cached_free "
                f"{cached_free}/{self.num_cached_free_blocks}, pinned {pinned}/{self.num_pinned_free_blocks}, "
                f"empty {empty}/{self.queue.size[EMPTY]}")
        if empty + in_use + cached_free != self.num_blocks:
            raise InternalError("free + in_use + cached_free != num_blocks")
        if self.index is not None:
            self.index.check_invariants()

    # ---- snapshots (replay a failing fuzz run) ---------------------------------------
    def __getstate__(self):
        return {
            "ref_cnt": np.array(<int32_t[:self.num_blocks]>self.ref_cnt, copy=True),
            "cached": np.array(<uint8_t[:self.num_blocks]>self.cached, copy=True),
            "pin_cnt": np.array(<int32_t[:self.num_blocks]>self.pin_cnt, copy=True),
            "hits": np.array(<uint32_t[:self.num_blocks]>self.hits, copy=True),
            "lists": self.free_lists(),
            "counters": (self.num_allocations, self.num_frees, self.num_touches, self.num_evictions),
        }

    def __reduce__(self):
        low = self.policy.low_blocks / self.num_blocks
        high = self.policy.high_blocks / self.num_blocks
        classes = self.policy.nbuckets if self.eviction == "priority" else 3
        return (_rebuild_pool, (self.num_blocks, self.eviction, classes, low, high, self.__getstate__()))

    def __setstate__(self, state):
        """Restore a snapshot into a fresh pool without a prefix index (fuzz replay)."""
        cdef int k
        cdef block_id_t b
        if self.num_in_use_blocks or self.num_cached_free_blocks or self.index is not None:
            raise CacheBusyError("__setstate__: expected a fresh pool without a prefix index")
        for k in range(self.queue.nlists):
            self.queue.head[k] = -1
            self.queue.tail[k] = -1
            self.queue.size[k] = 0
        for b in range(self.num_blocks):
            self.queue.where[b] = NOT_LISTED
            self.ref_cnt[b] = state["ref_cnt"][b]
            self.cached[b] = state["cached"][b]
            self.pin_cnt[b] = state["pin_cnt"][b]
            self.hits[b] = state["hits"][b]
        for k, lst in enumerate(state["lists"]):
            for b in lst:
                bl_push_back(&self.queue, k, b)
        for b in range(self.num_blocks):
            if self.ref_cnt[b] == 0 and self.cached[b] and self.pin_cnt[b]:
                self.queue.where[b] = PINNED_FREE
        self.num_in_use_blocks = int(np.count_nonzero(state["ref_cnt"]))
        free_mask = state["ref_cnt"] == 0
        self.num_cached_free_blocks = int(np.count_nonzero(free_mask & (state["cached"] != 0)))
        self.num_pinned_free_blocks = int(np.count_nonzero(free_mask & (state["cached"] != 0) & (state["pin_cnt"] != 0)))
        (self.num_allocations, self.num_frees, self.num_touches, self.num_evictions) = state["counters"]
        self.check_invariants()


def _rebuild_pool(num_blocks, policy, classes, low, high, state):
    pool = BlockPool(num_blocks, policy, priority_classes=classes, low_watermark=low, high_watermark=high)
    pool.__setstate__(state)
    return pool
