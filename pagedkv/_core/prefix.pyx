# cython: language_level=3
"""Prefix index: maps chained block hashes to cached blocks, and verifies every hit.

A full block's key is ``hash(parent_hash, tokens, namespace)``. The index keeps, for
each registered block, its exact tokens, its namespace id and the registered block that
holds its parent (plus that parent's generation). A lookup walks the query block by
block and accepts a candidate only when all of these match, so by induction a hit
block's whole prefix equals the query's: a hash collision costs a miss, never wrong KV.
A block's generation is bumped whenever its registration ends, so a child registered
under an older incarnation of its parent can never be matched again.
"""
import os

cimport numpy as cnp
from libc.stdlib cimport calloc, malloc, realloc, free as c_free
from libc.string cimport memcmp, memcpy, memset

from pagedkv._core._arrays cimport as_i32, new_u64, new_i32, new_u8, new_u32
from pagedkv.errors import InvalidArgumentError, InvalidBlockError, expected

cnp.import_array()


cdef bint _grow(void** p, int64_t cap, size_t item) noexcept nogil:
    cdef void* q = realloc(p[0], <size_t>cap * item)
    if q == NULL:
        return False
    p[0] = q
    return True


def hash_bytes(bytes data, uint64_t seed=0):
    """64-bit hash of ``data`` (used to key namespaces: salts and adapter ids)."""
    cdef const unsigned char* p = data
    return pkv_hash_bytes(p, len(data), seed)


cdef class PrefixIndex:
    def __cinit__(self, int32_t block_size, int32_t num_blocks, hash_seed=None,
                  bint weak_hash=False, bint events=False, bint tier_log=False):
        cdef uint64_t cap = 16
        cdef bytes secret
        if block_size < 1:
            raise InvalidArgumentError(expected("block_size", "an int >= 1", block_size))
        if num_blocks < 1:
            raise InvalidArgumentError(expected("num_blocks", "an int >= 1", num_blocks))
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.weak_hash = weak_hash
        self.events_enabled = events
        self.tier_log_enabled = tier_log
        if hash_seed is None:
            secret = os.urandom(8)
            self.root = pkv_hash_bytes(<const unsigned char*>secret, 8, 0x7061676564)
        else:
            if not isinstance(hash_seed, int) or not 0 <= hash_seed < 2 ** 64:
                raise InvalidArgumentError(expected("hash_seed", "None or an int in [0, 2**64)", repr(hash_seed)))
            secret = b"pagedkv-root-v1"
            self.root = pkv_hash_bytes(<const unsigned char*>secret, len(secret), <uint64_t>hash_seed)
        while cap < 2 * <uint64_t>num_blocks:
            cap <<= 1
        self.mask = cap - 1
        self.keys = <uint64_t*>calloc(cap, sizeof(uint64_t))
        self.vals = <int32_t*>malloc(cap * sizeof(int32_t))
        self.registered = <uint8_t*>calloc(num_blocks, sizeof(uint8_t))
        self.block_hash = <uint64_t*>calloc(num_blocks, sizeof(uint64_t))
        self.parent_hash = <uint64_t*>calloc(num_blocks, sizeof(uint64_t))
        self.block_tokens = <token_t*>calloc(<size_t>num_blocks * block_size, sizeof(token_t))
        self.block_ns = <int32_t*>calloc(num_blocks, sizeof(int32_t))
        self.parent_block = <block_id_t*>calloc(num_blocks, sizeof(block_id_t))
        self.parent_gen = <uint32_t*>calloc(num_blocks, sizeof(uint32_t))
        self.gen = <uint32_t*>calloc(num_blocks, sizeof(uint32_t))
        if not (self.keys and self.vals and self.registered and self.block_hash and self.parent_hash
                and self.block_tokens and self.block_ns and self.parent_block and self.parent_gen
                and self.gen):
            raise MemoryError(f"cannot allocate a prefix index for {num_blocks} blocks")
        memset(self.vals, 0xff, cap * sizeof(int32_t))

    def __dealloc__(self):
        c_free(self.keys)
        c_free(self.vals)
        c_free(self.registered)
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
        c_free(self.tl.kind)
        c_free(self.tl.block)
        c_free(self.tl.gen)
        c_free(self.tl.hash)
        c_free(self.tl.parent_hash)
        c_free(self.tl.parent_block)
        c_free(self.tl.parent_gen)
        c_free(self.tl.ns)
        c_free(self.tl.tokens)

    # ---- hashing -------------------------------------------------------------------
    cdef hash_t hash_block(self, const token_t* toks, hash_t parent, uint64_t ns_hash) noexcept nogil:
        if self.weak_hash:
            return pkv_hash_block_weak(toks, self.block_size, parent, ns_hash)
        return pkv_hash_block(toks, self.block_size, parent, ns_hash)

    cdef hash_t first_parent(self, uint64_t ns_hash) noexcept nogil:
        return 0 if self.weak_hash else self.root

    # ---- the hash table ------------------------------------------------------------
    cdef block_id_t find(self, hash_t h) noexcept nogil:
        cdef uint64_t i = (h ^ (h >> 31)) & self.mask
        cdef int32_t v
        while True:
            v = self.vals[i]
            if v < 0:
                return -1
            if self.keys[i] == h:
                return v
            i = (i + 1) & self.mask

    cdef bint matches(self, block_id_t b, const token_t* toks, int32_t ns,
                      block_id_t parent, uint32_t pgen) noexcept nogil:
        if not self.registered[b] or self.block_ns[b] != ns or self.parent_block[b] != parent:
            return False
        if parent >= 0 and self.parent_gen[b] != pgen:
            return False
        return memcmp(self.block_tokens + <size_t>b * self.block_size, toks,
                      self.block_size * sizeof(token_t)) == 0

    cdef bint is_orphan(self, block_id_t b) noexcept nogil:
        # Registered, but its parent's registration ended since: unreachable by lookups.
        return self.parent_block[b] >= 0 and not self.canon_valid(self.parent_block[b], self.parent_gen[b])

    cdef bint canon_valid(self, block_id_t b, uint32_t g) noexcept nogil:
        return b >= 0 and self.registered[b] and self.gen[b] == g

    cdef int insert(self, block_id_t b, hash_t h, hash_t parent_h, const token_t* toks,
                    int32_t ns, block_id_t parent, uint32_t pgen) except -1 nogil:
        # The caller has checked that h is absent and b is unregistered.
        cdef uint64_t i = (h ^ (h >> 31)) & self.mask
        while self.vals[i] >= 0:
            i = (i + 1) & self.mask
        self.keys[i] = h
        self.vals[i] = b
        self.registered[b] = 1
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
        return 0

    cdef void remove_block(self, block_id_t b) noexcept nogil:
        cdef hash_t h
        cdef uint64_t i, j, k
        if not self.registered[b]:
            return
        h = self.block_hash[b]
        i = (h ^ (h >> 31)) & self.mask
        while self.vals[i] != b:
            i = (i + 1) & self.mask
        # Backward-shift deletion keeps probe chains intact without tombstones.
        j = i
        while True:
            j = (j + 1) & self.mask
            if self.vals[j] < 0:
                break
            k = (self.keys[j] ^ (self.keys[j] >> 31)) & self.mask
            # move j back to i when its home k is not cyclically inside (i, j]
            if (i <= j and (k <= i or k > j)) or (i > j and (k <= i and k > j)):
                self.keys[i] = self.keys[j]
                self.vals[i] = self.vals[j]
                i = j
        self.vals[i] = -1
        if self.tier_log_enabled:
            self.log_tier(TIER_REMOVED, b)
        self.registered[b] = 0
        self.gen[b] += 1
        self.num_cached -= 1
        if self.events_enabled:
            self.push_event(EV_REMOVED, h, self.parent_hash[b], self.block_ns[b], b)

    cdef int32_t lookup(self, const token_t* toks, int64_t ntok, int32_t ns, uint64_t ns_hash,
                        block_id_t* out_blocks, hash_t* out_last_hash, int32_t max_blocks) noexcept nogil:
        cdef int64_t nfull = ntok // self.block_size
        cdef int32_t i, n = 0
        cdef hash_t parent_h = self.first_parent(ns_hash), h
        cdef block_id_t parent_b = -1, b
        cdef uint32_t pgen = 0
        if nfull > max_blocks:
            nfull = max_blocks
        for i in range(nfull):
            h = self.hash_block(toks + <int64_t>i * self.block_size, parent_h, ns_hash)
            b = self.find(h)
            if b < 0 or not self.matches(b, toks + <int64_t>i * self.block_size, ns, parent_b, pgen):
                break
            out_blocks[n] = b
            n += 1
            parent_b = b
            pgen = self.gen[b]
            parent_h = h
        out_last_hash[0] = parent_h
        return n

    cdef int clear(self) except -1 nogil:
        cdef block_id_t b
        for b in range(self.num_blocks):
            if self.registered[b]:
                self.registered[b] = 0
                self.gen[b] += 1
        memset(self.vals, 0xff, (self.mask + 1) * sizeof(int32_t))
        self.num_cached = 0
        if self.events_enabled:
            self.push_event(EV_CLEARED, 0, 0, 0, -1)
        return 0

    cdef int push_event(self, uint8_t kind, uint64_t h, uint64_t parent, int32_t ns,
                        block_id_t b) except -1 nogil:
        cdef int64_t cap
        if self.ev.n == self.ev.cap:
            cap = 64 if self.ev.cap == 0 else 2 * self.ev.cap
            self.ev.kind = <uint8_t*>realloc(self.ev.kind, cap * sizeof(uint8_t))
            self.ev.hash = <uint64_t*>realloc(self.ev.hash, cap * sizeof(uint64_t))
            self.ev.parent = <uint64_t*>realloc(self.ev.parent, cap * sizeof(uint64_t))
            self.ev.ns = <int32_t*>realloc(self.ev.ns, cap * sizeof(int32_t))
            self.ev.block = <int32_t*>realloc(self.ev.block, cap * sizeof(int32_t))
            if not (self.ev.kind and self.ev.hash and self.ev.parent and self.ev.ns and self.ev.block):
                with gil:
                    raise MemoryError("cannot grow the KV event buffer")
            self.ev.cap = cap
        self.ev.kind[self.ev.n] = kind
        self.ev.hash[self.ev.n] = h
        self.ev.parent[self.ev.n] = parent
        self.ev.ns[self.ev.n] = ns
        self.ev.block[self.ev.n] = b
        self.ev.n += 1
        return 0

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
    def hash_tokens(self, tokens, uint64_t ns_hash=0):
        """Chained hashes of every full block of ``tokens`` (uint64 array)."""
        cdef cnp.ndarray t = as_i32(tokens, "tokens")
        cdef const token_t* tp = <const token_t*>cnp.PyArray_DATA(t)
        cdef int64_t nfull = cnp.PyArray_DIM(t, 0) // self.block_size, i
        cdef cnp.ndarray out = new_u64(nfull)
        cdef uint64_t* op = <uint64_t*>cnp.PyArray_DATA(out)
        cdef hash_t parent = self.first_parent(ns_hash)
        with nogil:
            for i in range(nfull):
                parent = self.hash_block(tp + i * self.block_size, parent, ns_hash)
                op[i] = parent
        return out

    def match(self, tokens, int32_t ns=0, uint64_t ns_hash=0):
        """Blocks of the longest verified cached prefix of ``tokens`` (int32 array).

        Pure query: ref counts and the eviction order are not touched.
        """
        cdef cnp.ndarray t = as_i32(tokens, "tokens")
        cdef int64_t ntok = cnp.PyArray_DIM(t, 0)
        cdef cnp.ndarray out = new_i32(ntok // self.block_size)
        cdef hash_t last
        cdef int32_t n = self.lookup(<const token_t*>cnp.PyArray_DATA(t), ntok, ns, ns_hash,
                                     <block_id_t*>cnp.PyArray_DATA(out), &last, self.num_blocks)
        return out[:n].copy()

    def is_cached(self, int32_t block_id):
        self._check_block(block_id)
        return bool(self.registered[block_id])

    def block_info(self, int32_t block_id):
        """Registration record of a block: hash, parent hash, tokens, namespace, parent
        block and the parent's generation when this block was registered (None when the
        block is not registered)."""
        self._check_block(block_id)
        if not self.registered[block_id]:
            return None
        tokens = [self.block_tokens[<size_t>block_id * self.block_size + i] for i in range(self.block_size)]
        return {"hash": self.block_hash[block_id], "parent_hash": self.parent_hash[block_id],
                "tokens": tokens, "namespace": self.block_ns[block_id],
                "parent_block": self.parent_block[block_id], "parent_generation": self.parent_gen[block_id],
                "generation": self.gen[block_id]}

    def cached_blocks(self):
        """Ids of all registered blocks, ascending (int32 array)."""
        cdef cnp.ndarray out = new_i32(self.num_cached)
        cdef int32_t* op = <int32_t*>cnp.PyArray_DATA(out)
        cdef int32_t b, n = 0
        for b in range(self.num_blocks):
            if self.registered[b]:
                op[n] = b
                n += 1
        return out

    def drain_events(self):
        """Pending events as arrays ``(kind, hash, parent_hash, ns, block)``; clears them."""
        cdef int64_t n = self.ev.n
        cdef cnp.ndarray kind = new_u8(n), h = new_u64(n), p = new_u64(n), ns = new_i32(n), b = new_i32(n)
        if n:
            memcpy(cnp.PyArray_DATA(kind), self.ev.kind, n * sizeof(uint8_t))
            memcpy(cnp.PyArray_DATA(h), self.ev.hash, n * sizeof(uint64_t))
            memcpy(cnp.PyArray_DATA(p), self.ev.parent, n * sizeof(uint64_t))
            memcpy(cnp.PyArray_DATA(ns), self.ev.ns, n * sizeof(int32_t))
            memcpy(cnp.PyArray_DATA(b), self.ev.block, n * sizeof(int32_t))
        self.ev.n = 0
        return kind, h, p, ns, b

    def drain_tier_log(self):
        """Registration records since the last drain, oldest first; clears them.

        Returns a dict of arrays: ``kind`` (uint8: 1 stored, 2 removed), ``block``,
        ``gen`` (the block's generation during that registration), ``hash``,
        ``parent_hash``, ``parent_block`` (-1 for a first block), ``parent_gen``, ``ns``
        and ``tokens`` (int32 ``[n, block_size]``), plus ``lost``: records dropped since
        the last drain because memory ran out (each costs a lower tier a miss).
        Needs ``tier_log=True``. A removed block's KV is intact until the caller writes
        into the slots of the call that evicted it.
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

    def generation(self, int32_t block_id):
        """The block's registration generation (bumped whenever a registration ends)."""
        self._check_block(block_id)
        return self.gen[block_id]

    def _check_block(self, int32_t block_id):
        if not 0 <= block_id < self.num_blocks:
            raise InvalidBlockError(expected("block_id", f"an id in [0, {self.num_blocks})", block_id))
