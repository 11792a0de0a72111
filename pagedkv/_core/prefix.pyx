# cython: language_level=3
"""Prefix index: maps chained block hashes to cached blocks, and verifies every hit.

A full block's key is ``hash(parent_hash, tokens, namespace)``. The index keeps, for
each registered block, its exact tokens, its namespace id and the registered block that
holds its parent (plus that parent's generation). A lookup walks the query block by
block and accepts a candidate only when all of these match, so by induction a hit
block's whole prefix equals the query's: a hash collision costs a miss, never wrong KV.
A block's generation is bumped whenever its registration ends, so a child registered
under an older incarnation of its parent can never be matched again.

Lookups are pure queries. Registration, eviction and reset happen only through the
:class:`~pagedkv._core.pool.BlockPool` the index is attached to, which owns the cached
bit that says whether a record is live.
"""
import os

cimport numpy as cnp
from libc.stdlib cimport calloc, realloc, free as c_free
from libc.string cimport memcmp, memcpy, memset

from pagedkv._core._hashmap cimport hm_init, hm_dealloc, hm_clear, hm_get, hm_put_new, hm_delete
from pagedkv._core._arrays cimport (load_ints, check_int, check_u64, new_u64, new_i32, new_u8, new_u32)

from pagedkv.errors import HostMemoryError, InvalidArgumentError, InvalidBlockError, expected

cnp.import_array()

cdef int64_t MAX_BLOCKS = 2**31 - 1
cdef int64_t MAX_BLOCK_SIZE = 2**20


def hash_bytes(bytes data, seed=0):
    """64-bit hash of ``data`` (used to key namespaces: salts and adapter ids)."""
    cdef const unsigned char* p = data
    cdef uint64_t s = check_u64(seed, "seed")
    return pkv_hash_bytes(p, len(data), s)


cdef bint _grow(void** p, int64_t cap, size_t item) noexcept nogil:
    cdef void* q = realloc(p[0], <size_t>cap * item)
    if q == NULL:
        return False
    p[0] = q
    return True


cdef class PrefixIndex:
    def __cinit__(self, block_size, num_blocks, hash_seed=None, bint weak_hash=False,
                  bint events=False, bint tier_log=False, max_events=1 << 22):
        cdef bytes secret
        self.block_size = <int32_t>check_int(block_size, "block_size", 1, MAX_BLOCK_SIZE)
        self.num_blocks = <int32_t>check_int(num_blocks, "num_blocks", 1, MAX_BLOCKS)
        self.weak_hash = weak_hash
        self.events_enabled = events
        self.max_events = check_int(max_events, "max_events", 1, 2**40)
        self.tier_log_enabled = tier_log
        if hash_seed is None:
            secret = os.urandom(8)
            self.root = pkv_hash_bytes(<const unsigned char*>secret, 8, 0x7061676564)
        else:
            if isinstance(hash_seed, bool) or not isinstance(hash_seed, int) or not 0 <= hash_seed < 2 ** 64:
                raise InvalidArgumentError(expected("hash_seed", "None or an int in [0, 2**64)", repr(hash_seed)))
            secret = b"pagedkv-root-v1"
            self.root = pkv_hash_bytes(<const unsigned char*>secret, len(secret), <uint64_t>hash_seed)
        cdef size_t nb = <size_t>self.num_blocks
        hm_init(&self.map, nb)
        self.block_hash = <uint64_t*>calloc(nb, sizeof(uint64_t))
        self.parent_hash = <uint64_t*>calloc(nb, sizeof(uint64_t))
        self.block_tokens = <token_t*>calloc(nb * <size_t>self.block_size, sizeof(token_t))
        self.block_ns = <int32_t*>calloc(nb, sizeof(int32_t))
        self.parent_block = <block_id_t*>calloc(nb, sizeof(block_id_t))
        self.parent_gen = <uint32_t*>calloc(nb, sizeof(uint32_t))
        self.gen = <uint32_t*>calloc(nb, sizeof(uint32_t))
        if not (self.block_hash and self.parent_hash and self.block_tokens and self.block_ns
                and self.parent_block and self.parent_gen and self.gen):
            raise HostMemoryError(f"cannot allocate a prefix index for {nb} blocks of {self.block_size} tokens")

    def __dealloc__(self):
        hm_dealloc(&self.map)
        c_free(self.block_hash)
        c_free(self.parent_hash)
        c_free(self.block_tokens)
        c_free(self.block_ns)
        c_free(self.parent_block)
        c_free(self.parent_gen)
        c_free(self.gen)
        c_free(self.ev.kind)
        c_free(self.ev.hash)
        c_free(self.ev.parent)
        c_free(self.ev.ns)
        c_free(self.ev.block)
        c_free(self.ev.tokens)
        c_free(self.tl.kind)
        c_free(self.tl.block)
        c_free(self.tl.gen)
        c_free(self.tl.hash)
        c_free(self.tl.parent_hash)
        c_free(self.tl.parent_block)
        c_free(self.tl.parent_gen)
        c_free(self.tl.ns)
        c_free(self.tl.tokens)
        c_free(self.arg.data)

    # ---- hashing -------------------------------------------------------------------
    cdef hash_t hash_block(self, const token_t* toks, hash_t parent, uint64_t ns_hash) noexcept nogil:
        if self.weak_hash:
            return pkv_hash_block_weak(toks, self.block_size, parent, ns_hash)
        return pkv_hash_block(toks, self.block_size, parent, ns_hash)

    cdef hash_t first_parent(self, uint64_t ns_hash) noexcept nogil:
        return 0 if self.weak_hash else self.root

    # ---- records -------------------------------------------------------------------
    cdef bint is_live(self, block_id_t b) noexcept nogil:
        return self.live != NULL and self.live[b] != 0

    cdef block_id_t find(self, hash_t h) noexcept nogil:
        return hm_get(&self.map, h)

    cdef bint matches(self, block_id_t b, const token_t* toks, int32_t ns,
                      block_id_t parent, uint32_t pgen) noexcept nogil:
        if not self.is_live(b) or self.block_ns[b] != ns or self.parent_block[b] != parent:
            return False
        if parent >= 0 and self.parent_gen[b] != pgen:
            return False
        return memcmp(self.block_tokens + <size_t>b * self.block_size, toks,
                      self.block_size * sizeof(token_t)) == 0

    cdef bint canon_valid(self, block_id_t b, uint32_t g) noexcept nogil:
        return b >= 0 and self.is_live(b) and self.gen[b] == g

    cdef Probe probe(self, hash_t h, const token_t* toks, int32_t ns, block_id_t parent,
                     uint32_t pgen, block_id_t* found) noexcept nogil:
        cdef block_id_t c = self.find(h)
        found[0] = c
        if c < 0:
            return PROBE_ABSENT
        if self.matches(c, toks, ns, parent, pgen):
            return PROBE_MATCH
        if self.parent_block[c] >= 0 and not self.canon_valid(self.parent_block[c], self.parent_gen[c]):
            return PROBE_ORPHAN
        return PROBE_CONFLICT

    cdef void note_collision(self) noexcept nogil:
        self.num_collisions += 1

    cdef void insert(self, block_id_t b, hash_t h, hash_t parent_h, const token_t* toks,
                     int32_t ns, block_id_t parent, uint32_t pgen) noexcept nogil:
        # Called by the pool, which has checked that h is absent and b is not live, and
        # sets b's cached bit right after. The map holds at most one entry per block.
        hm_put_new(&self.map, h, b)
        self.block_hash[b] = h
        self.parent_hash[b] = parent_h
        memcpy(self.block_tokens + <size_t>b * self.block_size, toks, self.block_size * sizeof(token_t))
        self.block_ns[b] = ns
        self.parent_block[b] = parent
        self.parent_gen[b] = pgen
        self.num_cached += 1
        if self.tier_log_enabled:
            self.log_tier(TIER_STORED, b)
        if self.events_enabled:
            self.push_event(EV_STORED, h, parent_h, ns, b)

    cdef void remove(self, block_id_t b) noexcept nogil:
        # Called by the pool for a live record, before it clears b's cached bit.
        hm_delete(&self.map, self.block_hash[b])
        if self.tier_log_enabled:
            self.log_tier(TIER_REMOVED, b)
        self.gen[b] += 1
        self.num_cached -= 1
        if self.events_enabled:
            self.push_event(EV_REMOVED, self.block_hash[b], self.parent_hash[b], self.block_ns[b], b)

    cdef void clear(self) noexcept nogil:
        # Called by the pool before it clears every cached bit.
        cdef block_id_t b
        for b in range(self.num_blocks):
            if self.is_live(b):
                self.gen[b] += 1
        hm_clear(&self.map)
        self.num_cached = 0
        if self.events_enabled:
            self.push_event(EV_CLEARED, 0, 0, 0, -1)

    cdef int32_t lookup(self, const token_t* toks, int64_t ntok, int32_t ns, uint64_t ns_hash,
                        block_id_t* out_blocks, PrefixCursor* cur, int32_t max_blocks) noexcept nogil:
        # The longest verified chain of full blocks; cur (when not NULL) is left pointing
        # past it: its last hash, canonical block and generation, and the block count.
        cdef int64_t nfull = ntok // self.block_size
        cdef int32_t i, n = 0
        cdef hash_t parent_h = self.first_parent(ns_hash), h
        cdef block_id_t parent_b = -1, b
        cdef uint32_t pgen = 0
        if nfull > max_blocks:
            nfull = max_blocks
        for i in range(<int32_t>nfull):
            h = self.hash_block(toks + <int64_t>i * self.block_size, parent_h, ns_hash)
            b = self.find(h)
            if b < 0 or not self.matches(b, toks + <int64_t>i * self.block_size, ns, parent_b, pgen):
                break
            out_blocks[n] = b
            n += 1
            parent_b = b
            pgen = self.gen[b]
            parent_h = h
        if cur != NULL:
            cur.last_hash = parent_h
            cur.canon_block = parent_b
            cur.canon_gen = pgen
            cur.num_hashed = n
        return n

    cdef void push_event(self, uint8_t kind, uint64_t h, uint64_t parent, int32_t ns,
                         block_id_t b) noexcept nogil:
        # Never fails: an event that cannot be kept (too many undrained, or no memory)
        # is counted, and drain_events() reports the count so a consumer can resync.
        cdef EventBuf* e = &self.ev
        cdef int64_t cap
        if e.n == e.cap:
            cap = 64 if e.cap == 0 else 2 * e.cap
            if cap > self.max_events:
                cap = self.max_events
            if cap <= e.cap or not (
                    _grow(<void**>&e.kind, cap, sizeof(uint8_t)) and _grow(<void**>&e.hash, cap, sizeof(uint64_t))
                    and _grow(<void**>&e.parent, cap, sizeof(uint64_t)) and _grow(<void**>&e.ns, cap, sizeof(int32_t))
                    and _grow(<void**>&e.block, cap, sizeof(int32_t))
                    and _grow(<void**>&e.tokens, cap, <size_t>self.block_size * sizeof(token_t))):
                e.lost += 1
                return
            e.cap = cap
        e.kind[e.n] = kind
        e.hash[e.n] = h
        e.parent[e.n] = parent
        e.ns[e.n] = ns
        e.block[e.n] = b
        # a stored block's tokens travel with its event (a router may rebuild its own
        # hashes from them): the block is reused later, its tokens with it
        if kind == EV_STORED:
            memcpy(e.tokens + <size_t>e.n * self.block_size, self.block_tokens + <size_t>b * self.block_size,
                   self.block_size * sizeof(token_t))
        else:
            memset(e.tokens + <size_t>e.n * self.block_size, 0, self.block_size * sizeof(token_t))
        e.n += 1

    cdef void log_tier(self, uint8_t kind, block_id_t b) noexcept nogil:
        # Never fails: a record that cannot be stored is counted in `lost`, which costs
        # the tiers a miss (the block is not copied down), never wrong KV.
        cdef TierLog* t = &self.tl
        cdef int64_t cap, i
        cdef size_t bs = <size_t>self.block_size
        if t.n == t.cap:
            cap = 64 if t.cap == 0 else 2 * t.cap
            if not (_grow(<void**>&t.kind, cap, 1) and _grow(<void**>&t.block, cap, 4)
                    and _grow(<void**>&t.gen, cap, 4) and _grow(<void**>&t.hash, cap, 8)
                    and _grow(<void**>&t.parent_hash, cap, 8) and _grow(<void**>&t.parent_block, cap, 4)
                    and _grow(<void**>&t.parent_gen, cap, 4) and _grow(<void**>&t.ns, cap, 4)
                    and _grow(<void**>&t.tokens, cap, bs * sizeof(token_t))):
                t.lost += 1
                return
            t.cap = cap
        i = t.n
        t.kind[i] = kind
        t.block[i] = b
        t.gen[i] = self.gen[b]
        t.hash[i] = self.block_hash[b]
        t.parent_hash[i] = self.parent_hash[b]
        t.parent_block[i] = self.parent_block[b]
        t.parent_gen[i] = self.parent_gen[b]
        t.ns[i] = self.block_ns[b]
        memcpy(t.tokens + <size_t>i * bs, self.block_tokens + <size_t>b * bs, bs * sizeof(token_t))
        t.n = i + 1

    # ---- Python API ----------------------------------------------------------------
    def hash_tokens(self, tokens, ns_hash=0):
        """Chained hashes of every full block of ``tokens`` (uint64 array)."""
        cdef uint64_t nh = check_u64(ns_hash, "ns_hash")
        cdef int64_t n = load_ints(tokens, "tokens", cnp.NPY_INT32, &self.arg)
        cdef const token_t* tp = <const token_t*>self.arg.data
        cdef int64_t nfull = n // self.block_size, i
        cdef cnp.ndarray out = new_u64(nfull)
        cdef uint64_t* op = <uint64_t*>cnp.PyArray_DATA(out)
        cdef hash_t parent = self.first_parent(nh)
        with nogil:
            for i in range(nfull):
                parent = self.hash_block(tp + i * self.block_size, parent, nh)
                op[i] = parent
        return out

    def match(self, tokens, ns=0, ns_hash=0):
        """Blocks of the longest verified cached prefix of ``tokens`` (int32 array).

        Pure query: ref counts and the eviction order are not touched.
        """
        cdef int32_t ns_id = <int32_t>check_int(ns, "ns", 0, 2**31 - 1)
        cdef uint64_t nh = check_u64(ns_hash, "ns_hash")
        cdef int64_t n = load_ints(tokens, "tokens", cnp.NPY_INT32, &self.arg)
        cdef cnp.ndarray out = new_i32(n // self.block_size)
        cdef int32_t k = self.lookup(<const token_t*>self.arg.data, n, ns_id, nh,
                                     <block_id_t*>cnp.PyArray_DATA(out), NULL, self.num_blocks)
        return out[:k].copy()

    def match_from(self, tokens, start, parent_hash, parent_block, parent_generation, ns=0, ns_hash=0):
        """Blocks that continue a verified chain past its first ``start`` full blocks of
        ``tokens``: the longest run whose first block was registered under the
        incarnation ``(parent_block, parent_generation)`` of its parent, which may have
        been evicted since (its generation says which registration is meant).

        The caller vouches that this incarnation held ``tokens[:start * block_size]``
        (a prefix tier's copy of it was verified); each block found is then verified
        exactly as :meth:`match` verifies, by its tokens, namespace and parent.
        ``parent_hash`` is the chained hash of those ``start`` blocks (from
        :meth:`hash_tokens`): a wrong one costs a miss, never a wrong block. Pure query.
        """
        cdef int32_t ns_id = <int32_t>check_int(ns, "ns", 0, 2**31 - 1)
        cdef uint64_t nh = check_u64(ns_hash, "ns_hash")
        cdef uint64_t parent_h = check_u64(parent_hash, "parent_hash")
        cdef block_id_t parent_b = <block_id_t>check_int(parent_block, "parent_block", 0, self.num_blocks - 1)
        cdef uint32_t pgen = <uint32_t>check_int(parent_generation, "parent_generation", 0, 2**32 - 1)
        cdef int64_t n = load_ints(tokens, "tokens", cnp.NPY_INT32, &self.arg)
        cdef int64_t nfull = n // self.block_size
        cdef int64_t first = check_int(start, "start", 1, 2**31 - 1)
        cdef cnp.ndarray out = new_i32(nfull - first if nfull > first else 0)
        cdef int32_t* op = <int32_t*>cnp.PyArray_DATA(out)
        cdef const token_t* tp = <const token_t*>self.arg.data
        cdef int64_t i, k = 0
        cdef hash_t h
        cdef block_id_t b
        with nogil:
            for i in range(first, nfull):
                h = self.hash_block(tp + i * self.block_size, parent_h, nh)
                b = self.find(h)
                if b < 0 or not self.matches(b, tp + i * self.block_size, ns_id, parent_b, pgen):
                    break
                op[k] = b
                k += 1
                parent_b = b
                pgen = self.gen[b]
                parent_h = h
        return out[:k].copy()

    def is_cached(self, block_id):
        cdef block_id_t b = self._check_block(block_id)
        return bool(self.is_live(b))

    def block_info(self, block_id):
        """Registration record of a block: hash, parent hash, tokens, namespace, parent
        block and the parent's generation when this block was registered (None when the
        block is not registered)."""
        cdef block_id_t b = self._check_block(block_id)
        if not self.is_live(b):
            return None
        tokens = [self.block_tokens[<size_t>b * self.block_size + i] for i in range(self.block_size)]
        return {"hash": self.block_hash[b], "parent_hash": self.parent_hash[b],
                "tokens": tokens, "namespace": self.block_ns[b],
                "parent_block": self.parent_block[b], "parent_generation": self.parent_gen[b],
                "generation": self.gen[b]}

    def generation(self, block_id):
        """The block's registration generation (bumped whenever a registration ends)."""
        return self.gen[self._check_block(block_id)]

    def cached_blocks(self):
        """Ids of all registered blocks, ascending (int32 array)."""
        cdef cnp.ndarray out = new_i32(self.num_cached)
        cdef int32_t* op = <int32_t*>cnp.PyArray_DATA(out)
        cdef int32_t b, n = 0
        for b in range(self.num_blocks):
            if self.is_live(b) and n < self.num_cached:
                op[n] = b
                n += 1
        return out

    def drain_events(self, bint tokens=False):
        """Pending events as arrays ``(kind, hash, parent_hash, ns, block)``, oldest first,
        and the number of events lost since the last drain (the buffer holds at most
        ``max_events``; a consumer that lost events must resync). Clears them.
        ``tokens``: a seventh item, the int32 token ids ``[n, block_size]`` of each stored
        block (zeros for other events)."""
        cdef EventBuf* e = &self.ev
        cdef int64_t n = e.n
        cdef cnp.ndarray kind = new_u8(n), h = new_u64(n), p = new_u64(n), ns = new_i32(n), b = new_i32(n)
        cdef cnp.ndarray toks = new_i32(n * self.block_size if tokens else 0)
        if n:
            memcpy(cnp.PyArray_DATA(kind), e.kind, n * sizeof(uint8_t))
            memcpy(cnp.PyArray_DATA(h), e.hash, n * sizeof(uint64_t))
            memcpy(cnp.PyArray_DATA(p), e.parent, n * sizeof(uint64_t))
            memcpy(cnp.PyArray_DATA(ns), e.ns, n * sizeof(int32_t))
            memcpy(cnp.PyArray_DATA(b), e.block, n * sizeof(int32_t))
            if tokens:
                memcpy(cnp.PyArray_DATA(toks), e.tokens, n * self.block_size * sizeof(token_t))
        lost = e.lost
        e.n = 0
        e.lost = 0
        if tokens:
            return kind, h, p, ns, b, lost, toks.reshape(n, self.block_size)
        return kind, h, p, ns, b, lost

    def drain_tier_log(self):
        """Registration records since the last drain, oldest first; clears them.

        Returns a dict of arrays: ``kind`` (uint8: 1 stored, 2 removed), ``block``,
        ``gen`` (the block's generation during that registration), ``hash``,
        ``parent_hash``, ``parent_block`` (-1 for a first block), ``parent_gen``, ``ns``
        and ``tokens`` (int32 ``[n, block_size]``), plus ``lost``: records dropped since
        the last drain because memory ran out (each costs a lower tier a miss).
        Needs ``tier_log=True``. A removed block's KV is intact until the caller writes
        into the slots of the call that evicted it. A reset (``reset_cache``) logs
        nothing: lower tiers keep their copies.
        """
        if not self.tier_log_enabled:
            raise InvalidArgumentError(expected("tier_log", "True to drain the tier log", False))
        cdef TierLog* t = &self.tl
        cdef int64_t n = t.n
        cdef cnp.ndarray kind = new_u8(n), blk = new_i32(n), gen = new_u32(n), h = new_u64(n)
        cdef cnp.ndarray ph = new_u64(n), pb = new_i32(n), pg = new_u32(n), ns = new_i32(n)
        cdef cnp.ndarray toks = new_i32(n * self.block_size)
        if n:
            memcpy(cnp.PyArray_DATA(kind), t.kind, n * sizeof(uint8_t))
            memcpy(cnp.PyArray_DATA(blk), t.block, n * sizeof(int32_t))
            memcpy(cnp.PyArray_DATA(gen), t.gen, n * sizeof(uint32_t))
            memcpy(cnp.PyArray_DATA(h), t.hash, n * sizeof(uint64_t))
            memcpy(cnp.PyArray_DATA(ph), t.parent_hash, n * sizeof(uint64_t))
            memcpy(cnp.PyArray_DATA(pb), t.parent_block, n * sizeof(int32_t))
            memcpy(cnp.PyArray_DATA(pg), t.parent_gen, n * sizeof(uint32_t))
            memcpy(cnp.PyArray_DATA(ns), t.ns, n * sizeof(int32_t))
            memcpy(cnp.PyArray_DATA(toks), t.tokens, n * self.block_size * sizeof(token_t))
        lost = t.lost
        t.n = 0
        t.lost = 0
        return {"kind": kind, "block": blk, "gen": gen, "hash": h, "parent_hash": ph,
                "parent_block": pb, "parent_gen": pg, "ns": ns,
                "tokens": toks.reshape(n, self.block_size), "lost": lost}

    def check_invariants(self):
        """Every live record is mapped under its hash, and nothing else is mapped."""
        from pagedkv.errors import InternalError
        cdef block_id_t b
        cdef int32_t live = 0
        for b in range(self.num_blocks):
            if self.is_live(b):
                live += 1
                if self.find(self.block_hash[b]) != b:
                    raise InternalError(f"prefix index: live block {b} is not mapped under its hash")
        if live != self.num_cached or self.map.size != live:
            raise InternalError(f"prefix index: {live} live records, num_cached {self.num_cached}, "
                                f"{self.map.size} mapped")

    cdef block_id_t _check_block(self, object block_id) except? -1:
        return <block_id_t>check_int(block_id, "block_id", 0, self.num_blocks - 1)
