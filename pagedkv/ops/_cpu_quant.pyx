# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
# distutils: extra_compile_args = -fopenmp -ffp-contract=off -fno-fast-math -fno-trapping-math
# distutils: extra_link_args = -fopenmp
"""Quantizing write and dequantizing gather of the fast CPU ops, on raw tensor pointers.

The row arithmetic is ``quant_rows.h`` and, for int4 block keys, ``key_rows.h`` (gather)
and ``key_seal.h`` (``seal_key_blocks``) (pagedkv/format/quant.py's, bit for bit). As in :mod:`pagedkv.ops._cpu_copy`, the Python side
(:mod:`pagedkv.ops.cpu`) has checked every shape, dtype, device and contiguity, and
hands over addresses, byte strides and counts; slot values are checked here, from a
private snapshot, before the first byte moves. Block tables arrive already snapshotted and validated (``validate_csr`` /
``validate_padded`` of ``_cpu_copy`` ran on the same copy).

A "row" is one (token, head) of one plane (K or V): ``head_dim`` codes (int4:
``head_dim / 2`` bytes; int3: ``3 * head_dim / 8``) and ``groups`` scales (1 except for
int4/int3), plus as many zero points for int8/int4/int3. Row ``r`` of a layer starts at
byte ``r * row_bytes`` of the data and at element ``r * groups`` of the scale/zero views
(float32; bfloat16 for int3: the row functions read them as such).

An int4 gather may pass ``key_scale_ptr``/``key_zero_ptr``: the bfloat16
``[num_blocks, H, head_dim]`` per-channel parameters of block keys (pagedkv/format/quant.py).
A K row whose (block, head) has a nonzero first key scale is dequantized from them
(never unrotated); every other row as above.

A rotated cache passes ``signs_ptr``, the address of its float32 ``[head_dim]`` signs
(0: no rotation): a write rotates each widened row before quantizing it, a gather
unrotates each dequantized float32 row before converting it (quant_rows.h). The signs
are copied once, before the loops, like the slots.
"""
from libc.stdint cimport INT64_MAX, int32_t, int64_t, uint8_t, uint16_t, uintptr_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memcpy
from cython.parallel cimport parallel, prange
cimport openmp

cdef extern from "quant_rows.h" nogil:
    int PKV_F32, PKV_F16, PKV_BF16, PKV_E4M3, PKV_E5M2, PKV_INT8, PKV_INT4, PKV_INT3
    ctypedef void (*pkv_quantize_row_fn)(const char* x, int in_type, int64_t head_dim, int qtype, int64_t groups,
                                         uint8_t* q, float* scale, float* zero, float* tmp, uint8_t* codes,
                                         const float* signs)
    pkv_quantize_row_fn pkv_pick_quantize_row()
    ctypedef void (*pkv_dequantize_row_fn)(const uint8_t* q, int qtype, int64_t head_dim, int64_t groups,
                                           const float* scale, const float* zero, int out_type, char* out,
                                           float* tmp, const float* signs)
    pkv_dequantize_row_fn pkv_pick_dequantize_row()
    pkv_dequantize_row_fn pkv_pick_unrotating_row(const float* signs, int64_t head_dim, float* cpost)
    int pkv_use_avx2()

cdef extern from "key_rows.h" nogil:
    ctypedef void (*pkv_key_row_fn)(const uint8_t* q, int64_t head_dim, const uint16_t* scale,
                                    const uint16_t* zero, int out_type, char* out, float* tmp)
    pkv_key_row_fn pkv_pick_key_row()
    int pkv_key_sealed(const uint16_t* scale)

cdef extern from "key_seal.h" nogil:
    ctypedef void (*pkv_seal_head_fn)(const char* x, int in_type, int64_t x_tok, int64_t bs, int64_t head_dim,
                                      uint8_t* q, int64_t q_tok, uint16_t* scale, uint16_t* zero)
    pkv_seal_head_fn pkv_pick_seal_head()

#: codes of the model dtypes (write input, gather output) and of the storage formats
MODEL_CODES = {"float32": PKV_F32, "float16": PKV_F16, "bfloat16": PKV_BF16}
QUANT_CODES = {"fp8_e4m3": PKV_E4M3, "fp8_e5m2": PKV_E5M2, "int8": PKV_INT8, "int4": PKV_INT4, "int3": PKV_INT3}

# the row functions for this CPU (256-bit vectors and F16C where the CPU has them)
cdef pkv_quantize_row_fn quantize_row = pkv_pick_quantize_row()
cdef pkv_dequantize_row_fn dequantize_row = pkv_pick_dequantize_row()
cdef pkv_key_row_fn key_row = pkv_pick_key_row()
cdef pkv_seal_head_fn seal_head = pkv_pick_seal_head()

#: which build of the row functions runs: "avx2" (256-bit vectors, F16C) or "baseline"
ROW_ISA = "avx2" if pkv_use_avx2() else "baseline"

# below this many elements moved, a call runs on one thread
cdef int64_t _PARALLEL_ELEMENTS = 16384



# Thread policy (docs/threads.md): one setting and one decision for every loop
# (_threads.pxd). A call splits its work into pieces of the serial threshold and takes
# at most one thread per piece (waking a thread for less costs more than it saves); the
# automatic setting also runs serially while the machine has no idle core. Loops are
# scheduled dynamically, about 8 chunks per thread: a worker preempted mid-loop holds
# back one chunk, not its half.
from pagedkv.ops._threads cimport threads_for as policy_threads
# the setting's Python side, kept here for the callers and tests that ask this module
from pagedkv.ops._threads import _pretend_runnable, get_num_threads, set_num_threads


cdef inline int64_t chunk_for(int64_t n, int nth) noexcept nogil:
    cdef int64_t c = n // (8 * nth)
    return c if c > 1 else 1


cdef inline int threads_for(int64_t elements) noexcept nogil:
    return policy_threads(elements // _PARALLEL_ELEMENTS)


def planned_threads(int64_t elements):
    """Threads a call moving ``elements`` would take now (the policy above)."""
    return threads_for(elements)


cdef inline int64_t row_of(int64_t blk, int kv, int64_t off, int64_t h, int64_t block_size,
                           int64_t num_heads, bint hnd) noexcept nogil:
    if hnd:
        return ((blk * 2 + kv) * num_heads + h) * block_size + off
    return ((blk * 2 + kv) * block_size + off) * num_heads + h


cdef void check_sizes(int64_t head_dim, int64_t groups, int qtype) except *:
    if head_dim < 1 or groups < 1 or head_dim % groups:
        raise ValueError("quant rows: head_dim must be a positive multiple of groups")
    if qtype == PKV_INT4 and head_dim % 2:
        raise ValueError("quant rows: int4 needs an even head_dim")
    if qtype == PKV_INT3 and (head_dim // groups) % 8:
        raise ValueError("quant rows: int3 needs groups of a multiple of 8 elements")
    if qtype != PKV_INT4 and qtype != PKV_INT3 and groups != 1:
        raise ValueError("quant rows: only int4 and int3 have scale groups")


cdef inline int64_t row_bytes_of(int qtype, int64_t head_dim) noexcept nogil:
    if qtype == PKV_INT4:
        return head_dim // 2
    if qtype == PKV_INT3:
        return head_dim // 8 * 3
    return head_dim


cdef inline int64_t param_bytes_of(int qtype) noexcept nogil:
    return 2 if qtype == PKV_INT3 else 4


cdef float* snapshot_signs(uintptr_t signs_ptr, int64_t head_dim) except? NULL:
    """A private copy of the rotation signs (NULL for none); the caller frees it."""
    if signs_ptr == 0:
        return NULL
    cdef float* signs = <float*> malloc(<size_t> head_dim * 4)
    if signs == NULL:
        raise MemoryError("quant rows: cannot snapshot the rotation signs")
    memcpy(signs, <const void*> signs_ptr, <size_t> head_dim * 4)
    return signs


def write_quant(
    uintptr_t layer_ptr,
    uintptr_t scale_ptr,
    uintptr_t zero_ptr,
    uintptr_t key_ptr,
    uintptr_t value_ptr,
    uintptr_t slots_ptr,
    int64_t num_tokens,
    int64_t key_tok_stride,
    int64_t key_head_stride,
    int64_t value_tok_stride,
    int64_t value_head_stride,
    int in_type,
    int qtype,
    int64_t num_blocks,
    int64_t block_size,
    int64_t num_heads,
    int64_t head_dim,
    int64_t groups,
    bint hnd,
    uintptr_t signs_ptr=0,
):
    """Quantize K/V token rows (input strides in bytes, unit stride along head_dim) into
    their slots of a contiguous quantized layer and its scale (and zero) views.

    Returns ``(-1, 0)``, or the index and value of the first slot
    ``>= num_blocks * block_size`` (then nothing was written). Negative slots are skipped.
    The slots are read once, into a private buffer, and used from there.
    """
    check_sizes(head_dim, groups, qtype)
    if num_tokens < 0 or num_tokens > INT64_MAX // 8:
        raise OverflowError("write_quant: num_tokens out of range")
    if num_blocks < 0 or block_size < 0 or (block_size and num_blocks > INT64_MAX // block_size):
        raise OverflowError("write_quant: num_blocks * block_size out of range")
    cdef float* signs = snapshot_signs(signs_ptr, head_dim)
    cdef int64_t* slots = <int64_t*> malloc(<size_t> (num_tokens if num_tokens else 1) * 8)
    if slots == NULL:
        free(signs)
        raise MemoryError("write_quant: cannot snapshot the slot mapping")
    memcpy(slots, <const void*> slots_ptr, <size_t> num_tokens * 8)
    cdef uint8_t* layer = <uint8_t*> layer_ptr
    cdef char* scale = <char*> scale_ptr
    cdef char* zero = <char*> zero_ptr  # NULL for fp8
    cdef int64_t param_row = groups * param_bytes_of(qtype)
    cdef const char* key = <const char*> key_ptr
    cdef const char* value = <const char*> value_ptr
    cdef int64_t num_slots = num_blocks * block_size
    cdef int64_t row_bytes = row_bytes_of(qtype, head_dim)
    cdef int64_t t, h, blk, off, row, bad = -1
    cdef int kv
    cdef const char* src
    cdef int nth = threads_for(2 * num_tokens * num_heads * head_dim)
    # per thread: a row widened to float32 (head_dim floats) and its codes (head_dim bytes),
    # each thread's share a whole number of cache lines (so the floats stay aligned)
    cdef int64_t share = (head_dim * 5 + 63) // 64 * 64
    cdef char* scratch = <char*> malloc(<size_t> (nth * share))
    if scratch == NULL:
        free(slots)
        free(signs)
        raise MemoryError("write_quant: cannot allocate the row buffers")
    cdef int tid
    with nogil:
        for t in range(num_tokens):
            if slots[t] >= num_slots:
                bad = t
                break
        if bad < 0:
            for t in prange(num_tokens, num_threads=nth, schedule="dynamic", chunksize=chunk_for(num_tokens, nth)):
                if slots[t] < 0:
                    continue
                tid = openmp.omp_get_thread_num()
                blk = slots[t] // block_size
                off = slots[t] - blk * block_size
                for kv in range(2):
                    for h in range(num_heads):
                        if kv == 0:
                            src = key + t * key_tok_stride + h * key_head_stride
                        else:
                            src = value + t * value_tok_stride + h * value_head_stride
                        row = row_of(blk, kv, off, h, block_size, num_heads, hnd)
                        quantize_row(src, in_type, head_dim, qtype, groups, layer + row * row_bytes,
                                     <float*> (scale + row * param_row),
                                     <float*> (zero + row * param_row) if zero != NULL else NULL,
                                     <float*> (scratch + tid * share),
                                     <uint8_t*> (scratch + tid * share + head_dim * 4), signs)
    free(scratch)
    free(signs)
    cdef int64_t bad_value = slots[bad] if bad >= 0 else 0
    free(slots)
    return bad, bad_value


def gather_quant(
    uintptr_t layer_ptr,
    uintptr_t scale_ptr,
    uintptr_t zero_ptr,
    uintptr_t starts_ptr,
    int64_t start_stride,
    uintptr_t blocks_ptr,
    uintptr_t seq_lens_ptr,
    int64_t batch,
    int64_t total,
    uintptr_t out_k_ptr,
    uintptr_t out_v_ptr,
    int qtype,
    int out_type,
    int64_t block_size,
    int64_t num_heads,
    int64_t head_dim,
    int64_t groups,
    bint hnd,
    uintptr_t signs_ptr=0,
    uintptr_t key_scale_ptr=0,
    uintptr_t key_zero_ptr=0,
):
    """Dequantize validated tables into contiguous ``[total, H, D]`` outputs of ``out_type``.

    Sequence ``b``'s blocks are ``blocks[first(b):]``, ``first(b)`` being ``starts[b]``
    (CSR indptr, ``start_stride == 0``) or ``b * start_stride`` (padded rows).
    ``key_scale_ptr``/``key_zero_ptr``: both 0, or both set for an int4 layer.
    """
    check_sizes(head_dim, groups, qtype)
    if (key_scale_ptr == 0) != (key_zero_ptr == 0) or (key_scale_ptr != 0 and qtype != PKV_INT4):
        raise ValueError("gather_quant: block keys need both key_scale and key_zero, on an int4 layer")
    if num_heads < 0 or head_dim > INT64_MAX // 2 or (num_heads and head_dim * 2 > INT64_MAX // num_heads):
        raise OverflowError("gather_quant: num_heads * head_dim out of range")
    if batch < 0 or total < 0 or total > INT64_MAX // 16:
        raise OverflowError("gather_quant: total out of range")
    if batch == 0 or total == 0:
        return
    cdef float* signs = snapshot_signs(signs_ptr, head_dim)
    cdef pkv_dequantize_row_fn row_fn = dequantize_row
    cdef pkv_dequantize_row_fn regs_fn
    if signs != NULL:
        # the row held in registers when head_dim and the signs allow it: the snapshot is
        # replaced by the scaled signs that path multiplies by (pkv_pick_unrotating_row)
        regs_fn = pkv_pick_unrotating_row(signs, head_dim, signs)
        if regs_fn != NULL:
            row_fn = regs_fn
    cdef int64_t* token_row = <int64_t*> malloc(<size_t> total * 2 * 8)  # (block, offset) per token
    if token_row == NULL:
        free(signs)
        raise MemoryError("gather_quant: cannot index the tokens")
    cdef const int32_t* starts = <const int32_t*> starts_ptr
    cdef const int32_t* blocks = <const int32_t*> blocks_ptr
    cdef const int32_t* seq_lens = <const int32_t*> seq_lens_ptr
    cdef const uint8_t* layer = <const uint8_t*> layer_ptr
    cdef const char* scale = <const char*> scale_ptr
    cdef const char* zero = <const char*> zero_ptr
    cdef int64_t param_row = groups * param_bytes_of(qtype)
    cdef char* out_k = <char*> out_k_ptr
    cdef char* out_v = <char*> out_v_ptr
    cdef int64_t row_bytes = row_bytes_of(qtype, head_dim)
    cdef int64_t out_row = head_dim * (4 if out_type == PKV_F32 else 2)
    cdef const uint16_t* key_scale = <const uint16_t*> key_scale_ptr  # NULL: no block keys
    cdef const uint16_t* key_zero = <const uint16_t*> key_zero_ptr
    cdef int64_t b, j, n, first, u = 0, t, h, row, kp
    cdef char* dst
    cdef float* row_tmp
    cdef int kv
    cdef int nth = threads_for(2 * total * num_heads * head_dim)
    # one scratch row per thread, for narrowing to float16/bfloat16
    cdef float* tmp = <float*> malloc(<size_t> (nth * head_dim) * 4)
    if tmp == NULL:
        free(token_row)
        free(signs)
        raise MemoryError("gather_quant: cannot allocate the row buffers")
    with nogil:
        for b in range(batch):
            first = starts[b] if start_stride == 0 else b * start_stride
            n = seq_lens[b]
            for j in range(n):
                token_row[2 * u] = blocks[first + j // block_size]
                token_row[2 * u + 1] = j % block_size
                u += 1
        for t in prange(total, num_threads=nth, schedule="dynamic", chunksize=chunk_for(total, nth)):
            for kv in range(2):
                for h in range(num_heads):
                    row = row_of(token_row[2 * t], kv, token_row[2 * t + 1], h, block_size, num_heads, hnd)
                    dst = (out_k if kv == 0 else out_v) + (t * num_heads + h) * out_row
                    row_tmp = tmp + openmp.omp_get_thread_num() * head_dim
                    kp = (token_row[2 * t] * num_heads + h) * head_dim  # the (block, head)'s key channels
                    if kv == 0 and key_scale != NULL and pkv_key_sealed(key_scale + kp):
                        key_row(layer + row * row_bytes, head_dim, key_scale + kp, key_zero + kp, out_type, dst,
                                row_tmp)
                    else:
                        row_fn(layer + row * row_bytes, qtype, head_dim, groups,
                               <const float*> (scale + row * param_row),
                               <const float*> (zero + row * param_row) if zero != NULL else NULL, out_type,
                               dst, row_tmp, signs)
    free(tmp)
    free(signs)
    free(token_row)


def seal_key_blocks(
    uintptr_t layer_ptr,
    int64_t layer_block_stride,
    int64_t layer_tok_stride,
    int64_t layer_head_stride,
    uintptr_t key_scale_ptr,
    uintptr_t key_zero_ptr,
    uintptr_t blocks_ptr,
    int64_t num_seal,
    uintptr_t keys_ptr,
    int64_t keys_block_stride,
    int64_t keys_tok_stride,
    int64_t keys_head_stride,
    int in_type,
    int64_t num_blocks,
    int64_t block_size,
    int64_t num_heads,
    int64_t head_dim,
):
    """Requantize whole blocks' keys per channel (pagedkv.format.quant.quantize_key_block) into
    their K planes of an int4 layer and their rows of the contiguous bfloat16
    ``[num_blocks, num_heads, head_dim]`` key scale and zero views.

    ``layer_ptr`` is block 0's K plane; the layer's strides (bytes) step blocks, tokens
    and heads of it, each K row's ``head_dim / 2`` bytes being dense. ``keys`` is
    ``[num_seal, block_size, num_heads, head_dim]`` of ``in_type`` with the given byte
    strides and dense rows. The int64 block ids are read once, into a private buffer;
    returns ``(-1, 0)``, or the index and value of the first id outside
    ``[0, num_blocks)`` (then nothing was written). An id given twice is sealed whole from
    its last row (the reference leaves which row lands unspecified).
    """
    if head_dim < 2 or head_dim % 2 or block_size < 1 or num_heads < 1:
        raise ValueError("seal_key_blocks: needs an even head_dim >= 2, block_size >= 1 and num_heads >= 1")
    if num_seal < 0 or num_blocks < 0 or num_seal > INT64_MAX // 8:
        raise OverflowError("seal_key_blocks: num_seal or num_blocks out of range")
    if (head_dim > INT64_MAX // num_heads or block_size > INT64_MAX // (num_heads * head_dim)
            or (num_seal and num_seal > INT64_MAX // (block_size * num_heads * head_dim))
            or num_blocks > INT64_MAX // (num_heads * head_dim)):
        raise OverflowError("seal_key_blocks: the key or parameter element count is out of range")
    cdef int64_t* ids = <int64_t*> malloc(<size_t> (num_seal if num_seal else 1) * 8)
    if ids == NULL:
        raise MemoryError("seal_key_blocks: cannot snapshot the block ids")
    memcpy(ids, <const void*> blocks_ptr, <size_t> num_seal * 8)
    cdef int nth = threads_for(num_seal * block_size * num_heads * head_dim)
    cdef uint8_t* seen = NULL
    if nth > 1 and num_seal > 1:
        # parallel seals of one id would interleave: keep only its last row, as a serial loop would
        seen = <uint8_t*> calloc(<size_t> (num_blocks if num_blocks else 1), 1)
        if seen == NULL:
            free(ids)
            raise MemoryError("seal_key_blocks: cannot mark the block ids")
    cdef uint8_t* layer = <uint8_t*> layer_ptr
    cdef uint16_t* key_scale = <uint16_t*> key_scale_ptr
    cdef uint16_t* key_zero = <uint16_t*> key_zero_ptr
    cdef const char* keys = <const char*> keys_ptr
    cdef int64_t i, h, blk, kp, bad = -1
    with nogil:
        for i in range(num_seal):
            if ids[i] < 0 or ids[i] >= num_blocks:
                bad = i
                break
        if bad < 0:
            if seen != NULL:
                for i in range(num_seal - 1, -1, -1):
                    if seen[ids[i]]:
                        ids[i] = -1
                    else:
                        seen[ids[i]] = 1
            for i in prange(num_seal, num_threads=nth, schedule="dynamic", chunksize=chunk_for(num_seal, nth)):
                blk = ids[i]
                if blk < 0:
                    continue
                for h in range(num_heads):
                    kp = (blk * num_heads + h) * head_dim
                    seal_head(keys + i * keys_block_stride + h * keys_head_stride, in_type, keys_tok_stride,
                              block_size, head_dim, layer + blk * layer_block_stride + h * layer_head_stride,
                              layer_tok_stride, key_scale + kp, key_zero + kp)
    free(seen)
    cdef int64_t bad_value = ids[bad] if bad >= 0 else 0
    free(ids)
    return bad, bad_value
