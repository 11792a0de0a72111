# cython: language_level=3
"""BlockPool: the allocator. Ref counts and the free queue in C arrays, O(1) per block.

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

Every batch call validates the whole batch before changing anything; a failed call
leaves the pool exactly as it was. Thread safety: the pool relies on the GIL (its
methods never release it while mutating); the manager adds its own lock.
"""
cimport numpy as cnp
from libc.stdlib cimport calloc, free as c_free
from libc.string cimport memset
from libc.stdint cimport UINT32_MAX
from cpython.object cimport PyObject
from pagedkv._core._types cimport uint32_t

from pagedkv._core.evict cimport (BlockLists, bl_push_back, bl_push_front, bl_insert_after,
                                  bl_unlink, EMPTY, NOT_LISTED, PINNED_FREE, POLICY_ADAPTIVE)
from pagedkv._core._arrays cimport as_i32, new_i32

import numpy as np
from pagedkv.errors import (CacheBusyError, InternalError, InvalidArgumentError,
                            InvalidBlockError, OutOfBlocksError, expected)

cnp.import_array()

cdef int8_t TOP_CLASS = 127   # clamped to the highest bucket: used for unpinned prefixes

cdef extern from "Python.h":
    Py_ssize_t Py_REFCNT(PyObject* o)
    void Py_INCREF(PyObject* o)
    void Py_XDECREF(PyObject* o)


cdef class BlockPool:
    def __cinit__(self, int32_t num_blocks, str eviction="lru", *, int priority_classes=3,
                  double low_watermark=0.05, double high_watermark=0.15, shuffle_seed=None,
                  PrefixIndex index=None):
        cdef int32_t b
        self.evictor = Evictor(num_blocks, eviction, priority_classes, low_watermark, high_watermark)
        if index is not None and index.num_blocks != num_blocks:
            raise InvalidArgumentError(expected("index", f"a PrefixIndex over {num_blocks} blocks",
                                                f"one over {index.num_blocks}"))
        self.num_blocks = num_blocks
        self.index = index
        self.ref_cnt = <int32_t*>calloc(num_blocks, sizeof(int32_t))
        self.cached = <uint8_t*>calloc(num_blocks, sizeof(uint8_t))
        self.pin_cnt = <int32_t*>calloc(num_blocks, sizeof(int32_t))
        self.scratch = <int32_t*>calloc(num_blocks, sizeof(int32_t))
        if not (self.ref_cnt and self.cached and self.pin_cnt and self.scratch):
            raise MemoryError(f"cannot allocate a pool of {num_blocks} blocks")
        if shuffle_seed is None:
            for b in range(num_blocks):
                bl_push_back(&self.evictor.L, EMPTY, b)
        else:
            for b in np.random.default_rng(shuffle_seed).permutation(num_blocks).tolist():
                bl_push_back(&self.evictor.L, EMPTY, b)
        self._ref_view = np.asarray(<int32_t[:num_blocks]>self.ref_cnt)
        self._ref_view.flags.writeable = False

    def __dealloc__(self):
        cdef int i
        for i in range(RESULT_RING):
            Py_XDECREF(self.ring[i])
            self.ring[i] = NULL
        c_free(self.ref_cnt)
        c_free(self.cached)
        c_free(self.pin_cnt)
        c_free(self.scratch)

    # ---- C-level operations (shared with BlockTables) -------------------------------
    cdef int32_t num_free(self) noexcept nogil:
        return self.evictor.L.size[EMPTY] + self.evictor.num_evictable()

    cdef void evict_block(self, block_id_t b) noexcept nogil:
        self.cached[b] = 0
        self.num_cached_free_blocks -= 1
        self.num_evictions += 1
        if self.index is not None:
            self.index.remove_block(b)

    cdef void drop_content(self, block_id_t b) noexcept nogil:
        # Forget a block's cached content without allocating it (an orphaned prefix
        # block being replaced). A cached-free block becomes plain free.
        cdef BlockLists* L = &self.evictor.L
        if not self.cached[b]:
            return
        if self.ref_cnt[b] == 0:
            bl_unlink(L, b)
            self.evict_block(b)
            bl_push_front(L, EMPTY, b)
        else:
            self.cached[b] = 0
            self.num_evictions += 1
            if self.index is not None:
                self.index.remove_block(b)

    cdef void alloc_into(self, block_id_t* out, int32_t n) noexcept nogil:
        # The caller has checked n <= num_free().
        cdef BlockLists* L = &self.evictor.L
        cdef uint32_t* hits = self.evictor.hits
        cdef int32_t* ref = self.ref_cnt
        cdef int8_t* where = L.where
        cdef const int32_t* nxt = L.next
        cdef int32_t i = 0, take
        cdef block_id_t b
        # Fast path: pop a run off the EMPTY head (no content to drop, no list lookups).
        take = n if L.size[EMPTY] >= n else L.size[EMPTY]
        if take:
            b = L.head[EMPTY]
            for i in range(take):
                out[i] = b
                ref[b] = 1
                hits[b] = 0
                where[b] = NOT_LISTED
                b = nxt[b]
            L.head[EMPTY] = b
            if b >= 0:
                L.prev[b] = -1
            else:
                L.tail[EMPTY] = -1
            L.size[EMPTY] -= take
        for i in range(take, n):
            b = self.evictor.batch_victim()
            bl_unlink(L, b)
            self.evict_block(b)
            self.evictor.last_batch = 1
            ref[b] = 1
            hits[b] = 0
            out[i] = b
        self.num_in_use_blocks += n
        self.num_allocations += n
        if n and self.evictor.policy == POLICY_ADAPTIVE:
            self.maybe_batch_evict()

    cdef void maybe_batch_evict(self) noexcept nogil:
        cdef BlockLists* L = &self.evictor.L
        cdef int32_t k = 0
        cdef block_id_t b
        if self.evictor.policy != POLICY_ADAPTIVE or L.size[EMPTY] >= self.evictor.low_blocks:
            return
        while L.size[EMPTY] < self.evictor.high_blocks:
            b = self.evictor.batch_victim()
            if b < 0:
                break
            bl_unlink(L, b)
            self.evict_block(b)
            bl_push_back(L, EMPTY, b)
            k += 1
        if k:
            self.evictor.num_batches += 1
            self.evictor.last_batch = k
            if k > self.evictor.max_batch:
                self.evictor.max_batch = k

    cdef int64_t release_batch(self, const block_id_t* ids, int64_t n,
                               const int32_t* classes, int8_t cls) noexcept nogil:
        # One pass, in order: a block that reaches ref_cnt 0 is queued at once, so the
        # queue order is exactly the sequential order of the batch. Content-free blocks
        # are chained into one run that is spliced onto the front of EMPTY at the end.
        # An id out of range or already at 0 (a double free, or a duplicate beyond its
        # ref_cnt) undoes the pass and returns its index; -1 on success.
        # Locals, not self->fields: stores through int32_t* may alias int32 fields of
        # self, which would force the compiler to reload every pointer per block.
        cdef BlockLists* L = &self.evictor.L
        cdef int32_t* ref = self.ref_cnt
        cdef const uint8_t* cached = self.cached
        cdef int8_t* where = L.where
        cdef int32_t* nxt = L.next
        cdef int32_t* prv = L.prev
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
            old = L.head[EMPTY]
            nxt[run_tail] = old
            if old >= 0:
                prv[old] = run_tail
            else:
                L.tail[EMPTY] = run_tail
            L.head[EMPTY] = run_head
            L.size[EMPTY] += run_len
        self.num_in_use_blocks -= zeroed
        self.num_frees += n
        return -1

    cdef void undo_release(self, const block_id_t* ids, int64_t n) noexcept nogil:
        # Walk the applied prefix backwards; the first time a block is seen at 0 is the
        # release that queued it. The content-free run was never spliced, so its
        # blocks only need their list mark cleared.
        cdef BlockLists* L = &self.evictor.L
        cdef int64_t j
        cdef block_id_t b
        for j in range(n - 1, -1, -1):
            b = ids[j]
            if self.ref_cnt[b] == 0:
                if self.cached[b]:
                    self.num_cached_free_blocks -= 1
                    if L.where[b] == PINNED_FREE:
                        self.num_pinned_free_blocks -= 1
                        L.where[b] = NOT_LISTED
                    else:
                        bl_unlink(L, b)
                else:
                    L.where[b] = NOT_LISTED
            self.ref_cnt[b] += 1

    cdef void queue_cached(self, block_id_t b, int8_t cls) noexcept nogil:
        # b just reached ref_cnt 0 and holds a registered prefix.
        self.num_cached_free_blocks += 1
        if self.pin_cnt[b]:
            self.evictor.L.where[b] = PINNED_FREE
            self.num_pinned_free_blocks += 1
        else:
            bl_push_back(&self.evictor.L, self.evictor.bucket_for(b, cls), b)

    cdef void incref(self, block_id_t b) noexcept nogil:
        # The caller has checked that b is in use or cached-free.
        cdef BlockLists* L = &self.evictor.L
        if self.ref_cnt[b] == 0:
            if L.where[b] == PINNED_FREE:
                L.where[b] = NOT_LISTED
                self.num_pinned_free_blocks -= 1
            else:
                bl_unlink(L, b)
            self.num_cached_free_blocks -= 1
            self.num_in_use_blocks += 1
        cdef uint32_t* hits = self.evictor.hits
        self.ref_cnt[b] += 1
        if hits[b] != UINT32_MAX:
            hits[b] += 1
        self.num_touches += 1

    cdef int32_t check_touch(self, const block_id_t* ids, int64_t n) noexcept nogil:
        cdef int64_t i
        cdef block_id_t b
        for i in range(n):
            b = ids[i]
            if b < 0 or b >= self.num_blocks or (self.ref_cnt[b] == 0 and not self.cached[b]):
                return <int32_t>i
        return -1

    cdef int raise_free_error(self, const block_id_t* ids, int64_t n, int64_t bad, str name) except -1:
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
                    and cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>p) and cnp.PyArray_ISWRITEABLE(<cnp.ndarray>p)):
                return <cnp.ndarray>p
        a = new_i32(n)
        Py_INCREF(<PyObject*>a)
        Py_XDECREF(self.ring[self.ring_pos])
        self.ring[self.ring_pos] = <PyObject*>a
        self.ring_pos = (self.ring_pos + 1) % RESULT_RING
        return a

    # ---- Python API -----------------------------------------------------------------
    def allocate(self, n):
        """Allocate ``n`` blocks, all or nothing. Returns their ids (int32 array)."""
        cdef int64_t k
        if type(n) is not int or n < 0:
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise InvalidArgumentError(expected("n", "an int >= 0", repr(n)))
        k = n
        cdef int32_t free_now = self.num_free()
        if k > free_now:
            raise OutOfBlocksError(k, free_now)
        cdef cnp.ndarray out = self.result_array(k)
        self.alloc_into(<block_id_t*>cnp.PyArray_DATA(out), <int32_t>k)
        return out

    def allocate_many(self, counts):
        """Allocate for many requests in one call, all or nothing.

        ``counts``: blocks wanted per request (int32 array or list). Returns
        ``(indptr, block_ids)``: request ``i`` got ``block_ids[indptr[i]:indptr[i+1]]``.
        """
        cdef cnp.ndarray c = as_i32(counts, "counts")
        cdef const int32_t* cp = <const int32_t*>cnp.PyArray_DATA(c)
        cdef int64_t m = cnp.PyArray_DIM(c, 0), i, total = 0
        for i in range(m):
            if cp[i] < 0:
                raise InvalidArgumentError(expected("counts", "block counts >= 0", f"{cp[i]} at index {i}"))
            total += cp[i]
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

    def free(self, block_ids, priority=None):
        """Release one reference to each id, in the order given.

        ``priority``: eviction class of the cached blocks freed (``priority`` policy;
        0 is evicted first), a scalar or an int32 array parallel to ``block_ids``.
        An id listed more than once returns to the queue at its first position once
        all its references are gone.
        """
        cdef cnp.ndarray ids = as_i32(block_ids, "block_ids")
        cdef const block_id_t* ip = <const block_id_t*>cnp.PyArray_DATA(ids)
        cdef int64_t n = cnp.PyArray_DIM(ids, 0), bad
        cdef int8_t cls = 0
        cdef cnp.ndarray classes
        cdef const int32_t* cp = NULL
        if priority is not None:
            if isinstance(priority, int) and not isinstance(priority, bool):
                cls = <int8_t>max(0, min(priority, 127))
            else:
                classes = as_i32(priority, "priority")
                if cnp.PyArray_DIM(classes, 0) != n:
                    raise InvalidArgumentError(expected("priority", f"{n} classes (one per block id)",
                                                        cnp.PyArray_DIM(classes, 0)))
                cp = <const int32_t*>cnp.PyArray_DATA(classes)
        bad = self.release_batch(ip, n, cp, cls)
        if bad >= 0:
            self.raise_free_error(ip, n, bad, "block_ids")

    def touch(self, block_ids):
        """Add one reference to each id (in use or cached-free); a cached-free block
        leaves the free queue in O(1)."""
        cdef cnp.ndarray ids = as_i32(block_ids, "block_ids")
        cdef const block_id_t* ip = <const block_id_t*>cnp.PyArray_DATA(ids)
        cdef int64_t n = cnp.PyArray_DIM(ids, 0), i
        cdef int32_t bad = self.check_touch(ip, n)
        if bad >= 0:
            b = ip[bad]
            if b < 0 or b >= self.num_blocks:
                raise InvalidBlockError(expected("block_ids", f"block ids in [0, {self.num_blocks})",
                                                 f"{b} at index {bad}"))
            raise InvalidBlockError(expected("block_ids", "blocks in use or cached-free",
                                             f"block {b} at index {bad}, which is free and holds no content"))
        for i in range(n):
            self.incref(ip[i])

    def mark_cached(self, block_ids):
        """Record that in-use blocks now hold reusable content (they will be evicted
        LRU instead of being reused first). The manager does this via the prefix index."""
        cdef cnp.ndarray ids = as_i32(block_ids, "block_ids")
        cdef const block_id_t* ip = <const block_id_t*>cnp.PyArray_DATA(ids)
        cdef int64_t n = cnp.PyArray_DIM(ids, 0), i
        for i in range(n):
            if ip[i] < 0 or ip[i] >= self.num_blocks or self.ref_cnt[ip[i]] == 0:
                raise InvalidBlockError(expected("block_ids", "blocks that are in use", f"{ip[i]} at index {i}"))
        for i in range(n):
            self.cached[ip[i]] = 1

    def pin(self, block_ids):
        """Pin cached blocks: a pinned block is never evicted, even when free."""
        cdef cnp.ndarray ids = as_i32(block_ids, "block_ids")
        cdef const block_id_t* ip = <const block_id_t*>cnp.PyArray_DATA(ids)
        cdef int64_t n = cnp.PyArray_DIM(ids, 0), i
        cdef block_id_t b
        for i in range(n):
            b = ip[i]
            if b < 0 or b >= self.num_blocks or not self.cached[b]:
                raise InvalidBlockError(expected("block_ids", "blocks holding cached content", f"{b} at index {i}"))
        for i in range(n):
            b = ip[i]
            self.pin_cnt[b] += 1
            if self.ref_cnt[b] == 0 and self.evictor.L.where[b] != PINNED_FREE:
                bl_unlink(&self.evictor.L, b)
                self.evictor.L.where[b] = PINNED_FREE
                self.num_pinned_free_blocks += 1

    def unpin(self, block_ids):
        """Drop one pin per id; a cached-free block with no pins left becomes evictable."""
        cdef cnp.ndarray ids = as_i32(block_ids, "block_ids")
        cdef const block_id_t* ip = <const block_id_t*>cnp.PyArray_DATA(ids)
        cdef int64_t n = cnp.PyArray_DIM(ids, 0), i
        cdef block_id_t b
        for i in range(n):
            b = ip[i]
            if b < 0 or b >= self.num_blocks:
                raise InvalidBlockError(expected("block_ids", f"block ids in [0, {self.num_blocks})", f"{b} at index {i}"))
            self.scratch[b] += 1
            if self.scratch[b] > self.pin_cnt[b]:
                for i in range(n):
                    if 0 <= ip[i] < self.num_blocks:
                        self.scratch[ip[i]] = 0
                raise InvalidBlockError(expected("block_ids", "pinned blocks", f"block {b}, which is not pinned"))
        for i in range(n):
            self.scratch[ip[i]] = 0
        for i in range(n):
            b = ip[i]
            self.pin_cnt[b] -= 1
            if self.pin_cnt[b] == 0 and self.ref_cnt[b] == 0:
                self.num_pinned_free_blocks -= 1
                bl_push_back(&self.evictor.L, self.evictor.bucket_for(b, TOP_CLASS), b)

    def reset_cache(self):
        """Drop every cached prefix (and pin). Fails while any block is in use."""
        cdef block_id_t b
        cdef BlockLists* L = &self.evictor.L
        if self.num_in_use_blocks:
            raise CacheBusyError(f"reset_prefix_cache: expected no block in use, got {self.num_in_use_blocks} in use")
        for b in range(self.num_blocks):
            if self.cached[b]:
                if L.where[b] >= 1:
                    bl_unlink(L, b)
                else:
                    L.where[b] = NOT_LISTED
                self.cached[b] = 0
                self.pin_cnt[b] = 0
                self.evictor.hits[b] = 0
                bl_push_back(L, EMPTY, b)
        self.num_cached_free_blocks = 0
        self.num_pinned_free_blocks = 0
        if self.index is not None:
            self.index.clear()

    # ---- inspection -----------------------------------------------------------------
    @property
    def num_free_blocks(self):
        """Blocks an allocation can take now: free plus evictable cached-free."""
        return self.num_free()

    @property
    def num_empty_blocks(self):
        """Free blocks with no cached content."""
        return self.evictor.L.size[EMPTY]

    @property
    def ref_cnt(self):
        """Read-only int32 view of every block's ref count (live, not a copy)."""
        return self._ref_view

    @property
    def eviction(self):
        return self.evictor.policy_name

    def is_cached(self, int32_t block_id):
        if not 0 <= block_id < self.num_blocks:
            raise InvalidBlockError(expected("block_id", f"an id in [0, {self.num_blocks})", block_id))
        return bool(self.cached[block_id])

    def pin_count(self, int32_t block_id):
        if not 0 <= block_id < self.num_blocks:
            raise InvalidBlockError(expected("block_id", f"an id in [0, {self.num_blocks})", block_id))
        return self.pin_cnt[block_id]

    def hit_count(self, int32_t block_id):
        if not 0 <= block_id < self.num_blocks:
            raise InvalidBlockError(expected("block_id", f"an id in [0, {self.num_blocks})", block_id))
        return self.evictor.hits[block_id]

    def free_block_queue(self):
        """Allocatable blocks in the order allocate() takes them (int32 array)."""
        order = self.evictor.order()
        flat = [b for lst in order for b in lst]
        return np.asarray(flat, dtype=np.int32)

    def block_state(self, int32_t block_id):
        """'free', 'in_use' or 'cached_free'."""
        if not 0 <= block_id < self.num_blocks:
            raise InvalidBlockError(expected("block_id", f"an id in [0, {self.num_blocks})", block_id))
        if self.ref_cnt[block_id]:
            return "in_use"
        return "cached_free" if self.cached[block_id] else "free"

    def states(self):
        """Per-block state codes (uint8 array): 0 free, 1 in use, 2 cached-free."""
        out = np.zeros(self.num_blocks, dtype=np.uint8)
        cdef unsigned char[::1] o = out
        cdef block_id_t b
        for b in range(self.num_blocks):
            o[b] = 1 if self.ref_cnt[b] else (2 if self.cached[b] else 0)
        return out

    def eviction_stats(self):
        return {"evictions": self.num_evictions, "eviction_batches": self.evictor.num_batches,
                "last_eviction_batch": self.evictor.last_batch, "max_eviction_batch": self.evictor.max_batch,
                "low_watermark_blocks": self.evictor.low_blocks, "high_watermark_blocks": self.evictor.high_blocks}

    def check_invariants(self):
        """O(num_blocks) audit of every structural invariant; raises InternalError."""
        cdef BlockLists* L = &self.evictor.L
        cdef int k
        cdef int32_t n, in_use = 0, cached_free = 0, pinned = 0, empty = 0
        cdef block_id_t b, prev
        for k in range(L.nlists):
            n = 0
            prev = -1
            b = L.head[k]
            while b >= 0:
                if L.where[b] != k or L.prev[b] != prev:
                    raise InternalError(f"free list {k} is corrupt at block {b}")
                n += 1
                if n > self.num_blocks:
                    raise InternalError(f"free list {k} has a cycle")
                prev = b
                b = L.next[b]
            if L.tail[k] != prev or L.size[k] != n:
                raise InternalError(f"free list {k}: size {L.size[k]} / tail {L.tail[k]} disagree with its {n} blocks")
        for b in range(self.num_blocks):
            if self.scratch[b]:
                raise InternalError(f"scratch[{b}] left non-zero")
            if self.ref_cnt[b] < 0:
                raise InternalError(f"block {b} has ref_cnt {self.ref_cnt[b]}")
            if self.ref_cnt[b] > 0:
                in_use += 1
                if L.where[b] != NOT_LISTED:
                    raise InternalError(f"in-use block {b} is on free list {L.where[b]}")
            elif not self.cached[b]:
                empty += 1
                if L.where[b] != EMPTY:
                    raise InternalError(f"free block {b} is not on the EMPTY list")
            else:
                cached_free += 1
                if self.pin_cnt[b]:
                    pinned += 1
                    if L.where[b] != PINNED_FREE:
                        raise InternalError(f"pinned cached-free block {b} is on list {L.where[b]}")
                elif L.where[b] < 1:
                    raise InternalError(f"cached-free block {b} is not on an eviction bucket")
            if self.pin_cnt[b] and not self.cached[b]:
                raise InternalError(f"block {b} is pinned but holds no cached content")
            if self.index is not None and bool(self.index.registered[b]) != bool(self.cached[b]):
                raise InternalError(f"block {b}: pool cached={self.cached[b]} but index registered={self.index.registered[b]}")
        if (in_use != self.num_in_use_blocks or cached_free != self.num_cached_free_blocks
                or pinned != self.num_pinned_free_blocks or empty != L.size[EMPTY]):
            raise InternalError(
                f"counters disagree: in_use {in_use}/{self.num_in_use_blocks}, cached_free "
                f"{cached_free}/{self.num_cached_free_blocks}, pinned {pinned}/{self.num_pinned_free_blocks}, "
                f"empty {empty}/{L.size[EMPTY]}")
        if empty + in_use + cached_free != self.num_blocks:
            raise InternalError("free + in_use + cached_free != num_blocks")

    # ---- snapshots (replay a failing fuzz run) ---------------------------------------
    def __getstate__(self):
        return {
            "ref_cnt": np.array(<int32_t[:self.num_blocks]>self.ref_cnt, copy=True),
            "cached": np.array(<uint8_t[:self.num_blocks]>self.cached, copy=True),
            "pin_cnt": np.array(<int32_t[:self.num_blocks]>self.pin_cnt, copy=True),
            "hits": np.array(<uint32_t[:self.num_blocks]>self.evictor.hits, copy=True),
            "lists": self.evictor.order(),
            "counters": (self.num_allocations, self.num_frees, self.num_touches, self.num_evictions),
        }

    def __reduce__(self):
        ev = self.evictor
        low = ev.low_blocks / self.num_blocks
        high = ev.high_blocks / self.num_blocks
        return (_rebuild_pool, (self.num_blocks, ev.policy_name, ev.nbuckets if ev.policy_name == "priority" else 3,
                                low, high, self.__getstate__()))

    def __setstate__(self, state):
        cdef BlockLists* L = &self.evictor.L
        cdef int k
        cdef block_id_t b
        if self.num_in_use_blocks or self.num_cached_free_blocks:
            raise CacheBusyError("__setstate__: expected a fresh pool")
        for k in range(L.nlists):
            L.head[k] = -1
            L.tail[k] = -1
            L.size[k] = 0
        for b in range(self.num_blocks):
            L.where[b] = NOT_LISTED
            self.ref_cnt[b] = state["ref_cnt"][b]
            self.cached[b] = state["cached"][b]
            self.pin_cnt[b] = state["pin_cnt"][b]
            self.evictor.hits[b] = state["hits"][b]
        for k, lst in enumerate(state["lists"]):
            for b in lst:
                bl_push_back(L, k, b)
        for b in range(self.num_blocks):
            if self.ref_cnt[b] == 0 and self.cached[b] and self.pin_cnt[b]:
                L.where[b] = PINNED_FREE
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
