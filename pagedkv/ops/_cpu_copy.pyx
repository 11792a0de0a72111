# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
# distutils: extra_compile_args = -fopenmp
# distutils: extra_link_args = -fopenmp
"""Byte-moving loops of the fast CPU ops, on raw tensor pointers.

The Python side (:mod:`pagedkv.ops.cpu`) has already checked every shape, dtype,
device and contiguity, so these functions see only addresses, byte strides and
counts. Index values (slots, block ids, offsets) are checked here, in a serial first
pass, before the first byte moves: a call that reports an error has written nothing.
Every copy is a memcpy of a contiguous run:

- NHD write: a token's ``[H, D]`` row (one copy per token and K/V when the source
  row is contiguous, else one per head), with streaming stores (see below);
- HND write: a ``[D]`` row per (token, head), likewise;
- NHD gather: a block's ``[n, H, D]`` run of ``n <= block_size`` tokens;
- HND gather: a ``[D]`` row per (token, head);
- block copy/swap: a whole block (``[2, bs, H, D]``, or a scale block) per layer.

Work of at least ``2 * PARALLEL_BYTES`` is split over OpenMP threads (the runtime torch
itself loads, so ``torch.set_num_threads`` applies, unless ``pagedkv.set_num_threads``
overrides it), each thread getting at least ``PARALLEL_BYTES``. Smaller calls stay serial:
waking threads costs more than it saves. See docs/threads.md.
"""
from libc.stdint cimport INT64_MAX, int32_t, int64_t, uintptr_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy
from cython.parallel cimport parallel, prange

cdef extern from *:
    """
    /* Streaming (non-temporal) row stores for the write path. A decode step writes
       one row into each of many cold blocks; with ordinary stores every destination
       line is first read from DRAM (read-for-ownership), which made a scattered
       write 5x slower than memcpy. Streaming stores skip that read. They are used
       only for whole, 64-byte aligned cache lines; anything else is memcpy. */
    #include <stdint.h>
    #include <string.h>
    #if defined(__SSE2__)
    #include <emmintrin.h>
    static inline void pkv_row_store(char* dst, const char* src, Py_ssize_t n) {
        if ((((uintptr_t)dst) & 63) == 0 && (n & 63) == 0) {
            for (Py_ssize_t i = 0; i < n; i += 64) {
                __m128i a = _mm_loadu_si128((const __m128i*)(src + i));
                __m128i b = _mm_loadu_si128((const __m128i*)(src + i + 16));
                __m128i c = _mm_loadu_si128((const __m128i*)(src + i + 32));
                __m128i d = _mm_loadu_si128((const __m128i*)(src + i + 48));
                _mm_stream_si128((__m128i*)(dst + i), a);
                _mm_stream_si128((__m128i*)(dst + i + 16), b);
                _mm_stream_si128((__m128i*)(dst + i + 32), c);
                _mm_stream_si128((__m128i*)(dst + i + 48), d);
            }
        } else {
            memcpy(dst, src, (size_t)n);
        }
    }
    /* streaming stores are weakly ordered: fence them before anyone reads the rows */
    static inline void pkv_store_fence(void) { _mm_sfence(); }
    #else
    static inline void pkv_row_store(char* dst, const char* src, Py_ssize_t n) { memcpy(dst, src, (size_t)n); }
    static inline void pkv_store_fence(void) {}
    #endif
    """
    void pkv_row_store(char* dst, const char* src, Py_ssize_t n) nogil
    void pkv_store_fence() nogil

# error codes of the validation passes (mirrored in pagedkv/ops/cpu.py)
cdef enum:
    OK = 0
    BAD_INDPTR = 1
    BAD_SEQ_LEN = 2
    BAD_BLOCK = 3

# below this many bytes moved, a call runs on one thread
cdef Py_ssize_t _PARALLEL_BYTES = 65536
PARALLEL_BYTES = _PARALLEL_BYTES



# Thread policy (docs/threads.md): one setting and one decision for every loop
# (_threads.pxd). A call splits its work into pieces of the serial threshold and takes
# at most one thread per piece (waking a thread for less costs more than it saves); the
# automatic setting also runs serially while the machine has no idle core. Loops are
# scheduled dynamically, about 8 chunks per thread: a worker preempted mid-loop holds
# back one chunk, not its half.
from pagedkv.ops._threads cimport configured_threads, threads_for as policy_threads
# the setting's Python side, kept here for the callers and tests that ask this module
from pagedkv.ops._threads import _pretend_runnable, get_num_threads, set_num_threads


cdef inline Py_ssize_t chunk_for(Py_ssize_t n, int nth) noexcept nogil:
    cdef Py_ssize_t c = n // (8 * nth)
    return c if c > 1 else 1


cdef inline int threads_for(Py_ssize_t nbytes) noexcept nogil:
    return policy_threads(nbytes // _PARALLEL_BYTES)


def planned_threads(Py_ssize_t nbytes):
    """Threads a call moving ``nbytes`` would take now (the policy above)."""
    return threads_for(nbytes)


def max_threads():
    """Threads a large call uses (pagedkv's setting, else OpenMP's max, which torch.set_num_threads sets)."""
    return configured_threads()


# ------------------------------------------------------------------------------------
# write


cdef inline void write_token(
    char* layer,
    const char* src,
    Py_ssize_t head_stride,
    int64_t slot,
    int kv,
    Py_ssize_t block_size,
    Py_ssize_t num_heads,
    Py_ssize_t row_bytes,
    bint hnd,
) noexcept nogil:
    cdef Py_ssize_t token_bytes = num_heads * row_bytes  # NHD: one token's [H, D]
    cdef Py_ssize_t blk = slot // block_size
    cdef Py_ssize_t off = slot - blk * block_size
    cdef char* base = layer + (blk * 2 + kv) * block_size * token_bytes  # K or V plane of the block
    cdef Py_ssize_t h
    if hnd:
        # plane is [H, bs, D]: head h of token off is row h * bs + off
        for h in range(num_heads):
            pkv_row_store(base + (h * block_size + off) * row_bytes, src + h * head_stride, row_bytes)
    elif head_stride == row_bytes:
        pkv_row_store(base + off * token_bytes, src, token_bytes)
    else:
        for h in range(num_heads):
            pkv_row_store(base + off * token_bytes + h * row_bytes, src + h * head_stride, row_bytes)


def write_rows(
    uintptr_t layer_ptr,
    uintptr_t key_ptr,
    uintptr_t value_ptr,
    uintptr_t slots_ptr,
    Py_ssize_t num_tokens,
    Py_ssize_t key_tok_stride,
    Py_ssize_t key_head_stride,
    Py_ssize_t value_tok_stride,
    Py_ssize_t value_head_stride,
    Py_ssize_t num_blocks,
    Py_ssize_t block_size,
    Py_ssize_t num_heads,
    Py_ssize_t row_bytes,
    bint hnd,
):
    """Store K/V token rows at their slots in a contiguous per-layer view.

    Strides are in bytes; ``row_bytes`` is ``head_dim * element_size``.
    Returns ``(-1, 0)``, or the index and value of the first slot
    ``>= num_blocks * block_size`` (then nothing was written). Negative slots are skipped.

    The slots are copied once into a private buffer and validated and used from it: a
    thread rewriting the caller's tensor meanwhile cannot turn a checked slot into an
    out-of-range store.
    """
    if num_tokens < 0 or num_tokens > INT64_MAX // 8:
        raise OverflowError("write_rows: num_tokens out of range")
    cdef int64_t* slots = <int64_t*> malloc(<size_t> (num_tokens if num_tokens else 1) * 8)
    if slots == NULL:
        raise MemoryError("write_rows: cannot snapshot the slot mapping")
    memcpy(slots, <const void*> slots_ptr, <size_t> num_tokens * 8)
    cdef char* layer = <char*> layer_ptr
    cdef const char* key = <const char*> key_ptr
    cdef const char* value = <const char*> value_ptr
    cdef int64_t num_slots = <int64_t> num_blocks * block_size
    cdef Py_ssize_t t, bad = -1
    cdef int nth = threads_for(2 * num_tokens * num_heads * row_bytes)
    with nogil:
        for t in range(num_tokens):
            if slots[t] >= num_slots:
                bad = t
                break
        if bad < 0:
            with parallel(num_threads=nth):
                for t in prange(num_tokens, schedule="dynamic", chunksize=chunk_for(num_tokens, nth)):
                    if slots[t] >= 0:
                        write_token(layer, key + t * key_tok_stride, key_head_stride, slots[t], 0,
                                    block_size, num_heads, row_bytes, hnd)
                        write_token(layer, value + t * value_tok_stride, value_head_stride, slots[t], 1,
                                    block_size, num_heads, row_bytes, hnd)
                pkv_store_fence()  # each thread fences its own streaming stores
    cdef int64_t bad_value = slots[bad] if bad >= 0 else 0
    free(slots)
    return bad, bad_value


# ------------------------------------------------------------------------------------
# gather


cdef inline int check_blocks(
    const int32_t* blocks, Py_ssize_t n, Py_ssize_t num_blocks, Py_ssize_t* where, int64_t* value
) noexcept nogil:
    cdef Py_ssize_t j
    for j in range(n):
        if blocks[j] < 0 or blocks[j] >= num_blocks:
            where[0] = j
            value[0] = blocks[j]
            return BAD_BLOCK
    return OK


def validate_csr(
    uintptr_t indptr_ptr,
    uintptr_t indices_ptr,
    uintptr_t seq_lens_ptr,
    Py_ssize_t batch,
    Py_ssize_t nnz,
    Py_ssize_t block_size,
    Py_ssize_t num_blocks,
):
    """Check CSR tables in the reference's order (per sequence: indptr, seq_len, blocks).

    Returns ``(code, b, a, c)``: ``(OK, batch, total_tokens, 0)``, ``(BAD_INDPTR, b, lo, hi)``,
    ``(BAD_SEQ_LEN, b, n, blocks)`` or ``(BAD_BLOCK, b, j, block_id)``.
    """
    cdef const int32_t* indptr = <const int32_t*> indptr_ptr
    cdef const int32_t* indices = <const int32_t*> indices_ptr
    cdef const int32_t* seq_lens = <const int32_t*> seq_lens_ptr
    cdef Py_ssize_t b = 0, lo = 0, hi = 0, n = 0, need, where = 0
    cdef int64_t total = 0, value = 0
    cdef int code = OK
    with nogil:
        for b in range(batch):
            lo = indptr[b]
            hi = indptr[b + 1]
            n = seq_lens[b]
            if not (0 <= lo <= hi <= nnz):
                code = BAD_INDPTR
                break
            if n < 0 or n > (hi - lo) * block_size:
                code = BAD_SEQ_LEN
                break
            need = (n + block_size - 1) // block_size
            code = check_blocks(indices + lo, need, num_blocks, &where, &value)
            if code != OK:
                break
            total += n
    if code == BAD_INDPTR:
        return (code, b, lo, hi)
    if code == BAD_SEQ_LEN:
        return (code, b, n, hi - lo)
    if code == BAD_BLOCK:
        return (code, b, where, value)
    return (OK, batch, total, 0)


def validate_padded(
    uintptr_t table_ptr,
    uintptr_t seq_lens_ptr,
    Py_ssize_t batch,
    Py_ssize_t width,
    Py_ssize_t block_size,
    Py_ssize_t num_blocks,
):
    """Check a padded table: per row, seq_len then the blocks it needs.

    Returns ``(code, b, a, c)`` as :func:`validate_csr` (BAD_SEQ_LEN carries ``width``).
    """
    cdef const int32_t* table = <const int32_t*> table_ptr
    cdef const int32_t* seq_lens = <const int32_t*> seq_lens_ptr
    cdef Py_ssize_t b = 0, n = 0, need, where = 0
    cdef int64_t total = 0, value = 0
    cdef int code = OK
    with nogil:
        for b in range(batch):
            n = seq_lens[b]
            if n < 0 or n > width * block_size:
                code = BAD_SEQ_LEN
                break
            need = (n + block_size - 1) // block_size
            code = check_blocks(table + b * width, need, num_blocks, &where, &value)
            if code != OK:
                break
            total += n
    if code == BAD_SEQ_LEN:
        return (code, b, n, width)
    if code == BAD_BLOCK:
        return (code, b, where, value)
    return (OK, batch, total, 0)


cdef inline void gather_block(
    const char* layer,
    int32_t block_id,
    Py_ssize_t m,
    char* out_k,
    char* out_v,
    Py_ssize_t block_size,
    Py_ssize_t num_heads,
    Py_ssize_t row_bytes,
    bint hnd,
) noexcept nogil:
    """Copy the first ``m`` tokens of one block's K and V to ``out_k``/``out_v`` ``[m, H, D]``."""
    cdef Py_ssize_t token_bytes = num_heads * row_bytes
    cdef Py_ssize_t plane_bytes = block_size * token_bytes
    cdef const char* k = layer + (<Py_ssize_t> block_id * 2) * plane_bytes
    cdef const char* v = k + plane_bytes
    cdef Py_ssize_t o, h
    if hnd:
        for o in range(m):
            for h in range(num_heads):
                memcpy(out_k + o * token_bytes + h * row_bytes, k + (h * block_size + o) * row_bytes, row_bytes)
                memcpy(out_v + o * token_bytes + h * row_bytes, v + (h * block_size + o) * row_bytes, row_bytes)
    else:
        memcpy(out_k, k, m * token_bytes)
        memcpy(out_v, v, m * token_bytes)


cdef void gather_tables(
    const char* layer,
    const int32_t* starts,
    Py_ssize_t start_stride,
    const int32_t* blocks,
    const int32_t* seq_lens,
    Py_ssize_t batch,
    Py_ssize_t total,
    char* out_k,
    char* out_v,
    Py_ssize_t block_size,
    Py_ssize_t num_heads,
    Py_ssize_t row_bytes,
    bint hnd,
) noexcept nogil:
    """Gather sequence b's blocks ``blocks[first(b):]`` where first(b) is ``starts[b]``
    (CSR indptr, ``start_stride == 0``) or ``b * start_stride`` (padded rows).

    Work is split over the (sequence, block) units of the whole batch, so one long
    sequence and many short ones parallelize alike.
    """
    cdef Py_ssize_t token_bytes = num_heads * row_bytes
    cdef Py_ssize_t b, j, u, m, first, units = 0
    cdef int64_t* unit_start  # prefix sum of blocks per sequence
    cdef int64_t* token_start  # prefix sum of tokens per sequence
    cdef int nth = threads_for(2 * total * token_bytes)
    if batch == 0 or total == 0:
        return
    unit_start = <int64_t*> malloc((batch + 1) * 2 * sizeof(int64_t))
    if unit_start == NULL:
        # out of memory for 16 bytes per sequence: copy serially without the index
        nth = 0
    else:
        token_start = unit_start + batch + 1
        unit_start[0] = 0
        token_start[0] = 0
        for b in range(batch):
            unit_start[b + 1] = unit_start[b] + (seq_lens[b] + block_size - 1) // block_size
            token_start[b + 1] = token_start[b] + seq_lens[b]
        units = unit_start[batch]
    if nth > 1:
        for u in prange(units, num_threads=nth, schedule="dynamic", chunksize=chunk_for(units, nth)):
            b = find_sequence(unit_start, batch, u)
            j = u - unit_start[b]
            m = seq_lens[b] - j * block_size
            if m > block_size:
                m = block_size
            first = starts[b] if start_stride == 0 else b * start_stride
            gather_block(layer, blocks[first + j], m,
                         out_k + (token_start[b] + j * block_size) * token_bytes,
                         out_v + (token_start[b] + j * block_size) * token_bytes,
                         block_size, num_heads, row_bytes, hnd)
    else:
        u = 0  # token position
        for b in range(batch):
            first = starts[b] if start_stride == 0 else b * start_stride
            j = 0
            while j * block_size < seq_lens[b]:
                m = seq_lens[b] - j * block_size
                if m > block_size:
                    m = block_size
                gather_block(layer, blocks[first + j], m, out_k + u * token_bytes, out_v + u * token_bytes,
                             block_size, num_heads, row_bytes, hnd)
                u += m
                j += 1
    free(unit_start)


cdef inline Py_ssize_t find_sequence(const int64_t* unit_start, Py_ssize_t batch, Py_ssize_t u) noexcept nogil:
    """The b with ``unit_start[b] <= u < unit_start[b + 1]`` (binary search)."""
    cdef Py_ssize_t lo = 0, hi = batch, mid
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if unit_start[mid] <= u:
            lo = mid
        else:
            hi = mid
    return lo


def gather_csr(
    uintptr_t layer_ptr,
    uintptr_t indptr_ptr,
    uintptr_t indices_ptr,
    uintptr_t seq_lens_ptr,
    Py_ssize_t batch,
    Py_ssize_t total,
    uintptr_t out_k_ptr,
    uintptr_t out_v_ptr,
    Py_ssize_t block_size,
    Py_ssize_t num_heads,
    Py_ssize_t row_bytes,
    bint hnd,
):
    """Gather validated CSR tables into contiguous ``[total, H, D]`` outputs."""
    with nogil:
        gather_tables(<const char*> layer_ptr, <const int32_t*> indptr_ptr, 0, <const int32_t*> indices_ptr,
                      <const int32_t*> seq_lens_ptr, batch, total, <char*> out_k_ptr, <char*> out_v_ptr,
                      block_size, num_heads, row_bytes, hnd)


def gather_padded(
    uintptr_t layer_ptr,
    uintptr_t table_ptr,
    uintptr_t seq_lens_ptr,
    Py_ssize_t batch,
    Py_ssize_t width,
    Py_ssize_t total,
    uintptr_t out_k_ptr,
    uintptr_t out_v_ptr,
    Py_ssize_t block_size,
    Py_ssize_t num_heads,
    Py_ssize_t row_bytes,
    bint hnd,
):
    """Gather a validated padded ``[batch, width]`` table into contiguous ``[total, H, D]`` outputs."""
    if width == 0:
        return
    with nogil:
        gather_tables(<const char*> layer_ptr, NULL, width, <const int32_t*> table_ptr,
                      <const int32_t*> seq_lens_ptr, batch, total, <char*> out_k_ptr, <char*> out_v_ptr,
                      block_size, num_heads, row_bytes, hnd)


# ------------------------------------------------------------------------------------
# block copies


def copy_block_pairs(
    uintptr_t src_ptr,
    uintptr_t dst_ptr,
    Py_ssize_t num_layers,
    Py_ssize_t src_layer_bytes,
    Py_ssize_t dst_layer_bytes,
    Py_ssize_t block_bytes,
    uintptr_t pairs_ptr,
    Py_ssize_t num_pairs,
    bint pairs_int32,
):
    """Copy block ``pairs[p, 0]`` of ``src`` to block ``pairs[p, 1]`` of ``dst``, every layer.

    ``src``/``dst`` are contiguous ``[num_layers, num_blocks, ...]`` arenas (possibly the
    same one); the caller validated the ids (in range, dst distinct, no dst also a src),
    so the copies do not overlap and may run in any order.
    """
    cdef const int64_t* p64 = <const int64_t*> pairs_ptr
    cdef const int32_t* p32 = <const int32_t*> pairs_ptr
    cdef const char* src = <const char*> src_ptr
    cdef char* dst = <char*> dst_ptr
    cdef Py_ssize_t u, layer, p, s, d
    cdef int nth = threads_for(num_layers * num_pairs * block_bytes)
    with nogil:
        for u in prange(num_layers * num_pairs, num_threads=nth, schedule="dynamic",
                        chunksize=chunk_for(num_layers * num_pairs, nth)):
            layer = u // num_pairs
            p = u - layer * num_pairs
            if pairs_int32:
                s = p32[2 * p]
                d = p32[2 * p + 1]
            else:
                s = p64[2 * p]
                d = p64[2 * p + 1]
            memcpy(dst + layer * dst_layer_bytes + d * block_bytes,
                   src + layer * src_layer_bytes + s * block_bytes, block_bytes)
