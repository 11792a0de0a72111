# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
# distutils: extra_compile_args = -fopenmp -ffp-contract=off -fno-fast-math -fno-trapping-math
# distutils: extra_link_args = -fopenmp
"""Paged attention loops of the CPU backend (``attention_rows.h``), on raw tensor pointers.

:mod:`pagedkv.ops.attention_cpu` has checked every shape, dtype and device and every
table value (:func:`pagedkv.ops.attention_reference.check_attention`, on private
snapshots), and hands over addresses and counts. Work items are (sequence, KV head,
split); one OpenMP loop runs them (``schedule(static)``; one thread below
``_PARALLEL_WORK``), then a second merges each sequence's splits exactly.
"""
from libc.stdint cimport INT64_MAX, int32_t, int64_t, uint8_t, uint16_t, uintptr_t
from libc.stdlib cimport free, malloc
from libc.math cimport expf, INFINITY
from cython.parallel cimport prange
cimport openmp

cdef extern from "attention_rows.h" nogil:
    int PKV_F32, PKV_INT4, PKV_INT3
    int PKV_ATTN_TILE
    ctypedef void (*pkv_dequantize_row_fn)(const uint8_t* q, int qtype, int64_t head_dim, int64_t groups,
                                           const float* scale, const float* zero, int out_type, char* out,
                                           float* tmp, const float* signs)
    ctypedef void (*pkv_key_row_fn)(const uint8_t* q, int64_t head_dim, const uint16_t* scale,
                                    const uint16_t* zero, int out_type, char* out, float* tmp)
    pkv_dequantize_row_fn pkv_pick_dequantize_row()
    pkv_key_row_fn pkv_pick_key_row()
    int pkv_use_avx2()
    ctypedef struct pkv_attn_args:
        const float* q
        const float* qrot
        const uint8_t* layer
        const char* scale
        const char* zero
        const uint16_t* key_scale
        const uint16_t* key_zero
        int quantized
        int kv_type
        const int32_t* indptr
        const int32_t* indices
        const int32_t* seq_lens
        const int32_t* q_indptr
        int64_t block_size, num_heads, head_dim, groups, group, num_q_heads
        int hnd
        float sm_scale, soft_cap
        int64_t window, sink_tokens
        const char* exact_data
        int exact_type
        const int64_t* exact_slot
        const uint8_t* exact_valid
        int64_t exact_recent, exact_sink
        const float* signs
        pkv_dequantize_row_fn deq
        pkv_key_row_fn key_row
        int64_t row_bytes, param_row, elem_bytes
    ctypedef void (*pkv_attn_item_fn)(const pkv_attn_args*, int64_t, int64_t, int64_t, int64_t, float*, float*,
                                      float*, float*) noexcept
    pkv_attn_item_fn pkv_pick_attn_item()

cdef pkv_attn_item_fn attn_item = pkv_pick_attn_item()
cdef pkv_dequantize_row_fn dequantize_row = pkv_pick_dequantize_row()
cdef pkv_key_row_fn key_row = pkv_pick_key_row()

#: which build of the loops runs: "avx2" or "baseline"
ROW_ISA = "avx2" if pkv_use_avx2() else "baseline"

# below this many multiply-adds (keys x query rows x head_dim), one thread
cdef int64_t _PARALLEL_WORK = 1 << 18


def attend(
    uintptr_t q_ptr, uintptr_t qrot_ptr, uintptr_t out_ptr, int64_t num_q, int64_t num_q_heads,
    uintptr_t layer_ptr, uintptr_t scale_ptr, uintptr_t zero_ptr, uintptr_t key_scale_ptr, uintptr_t key_zero_ptr,
    bint quantized, int kv_type, int64_t elem_bytes,
    uintptr_t indptr_ptr, uintptr_t indices_ptr, uintptr_t seq_lens_ptr, uintptr_t q_indptr_ptr, int64_t batch,
    int64_t block_size, int64_t num_heads, int64_t head_dim, int64_t groups, bint hnd,
    float sm_scale, float soft_cap, int64_t window, int64_t sink_tokens, int64_t num_splits, int64_t split_tokens,
    uintptr_t exact_data_ptr=0, int exact_type=0, uintptr_t exact_slot_ptr=0, uintptr_t exact_valid_ptr=0,
    int64_t exact_recent=0, int64_t exact_sink=0, uintptr_t signs_ptr=0,
):
    """``out`` (float32 ``[num_q, Hq, D]``, rotated domain when ``qrot_ptr``) of checked tables.

    ``num_splits`` > 0 forces that many splits per sequence; else one per
    ``split_tokens`` keys for sequences of at most 16 queries (a prefill chunk has
    parallelism enough across its rows' heads and would need a partial result per split
    and row)."""
    if head_dim < 1 or num_heads < 1 or num_q_heads % num_heads or batch < 0 or split_tokens < 1:
        raise ValueError("attend: bad sizes")
    if num_q > INT64_MAX // (num_q_heads * head_dim * 8):
        raise OverflowError("attend: num_q * num_q_heads * head_dim out of range")
    cdef pkv_attn_args a
    a.q = <const float*> q_ptr
    a.qrot = <const float*> qrot_ptr
    a.layer = <const uint8_t*> layer_ptr
    a.scale = <const char*> scale_ptr
    a.zero = <const char*> zero_ptr
    a.key_scale = <const uint16_t*> key_scale_ptr
    a.key_zero = <const uint16_t*> key_zero_ptr
    a.quantized = quantized
    a.kv_type = kv_type
    a.indptr = <const int32_t*> indptr_ptr
    a.indices = <const int32_t*> indices_ptr
    a.seq_lens = <const int32_t*> seq_lens_ptr
    a.q_indptr = <const int32_t*> q_indptr_ptr
    a.block_size = block_size
    a.num_heads = num_heads
    a.head_dim = head_dim
    a.groups = groups
    a.group = num_q_heads // num_heads
    a.num_q_heads = num_q_heads
    a.hnd = hnd
    a.sm_scale = sm_scale
    a.soft_cap = soft_cap
    a.window = window
    a.sink_tokens = sink_tokens
    a.exact_data = <const char*> exact_data_ptr
    a.exact_type = exact_type
    a.exact_slot = <const int64_t*> exact_slot_ptr
    a.exact_valid = <const uint8_t*> exact_valid_ptr
    a.exact_recent = exact_recent
    a.exact_sink = exact_sink
    a.signs = <const float*> signs_ptr
    a.deq = dequantize_row
    a.key_row = key_row
    a.elem_bytes = elem_bytes
    if kv_type == PKV_INT4 and quantized:
        a.row_bytes = head_dim // 2
    elif kv_type == PKV_INT3 and quantized:
        a.row_bytes = head_dim // 8 * 3
    else:
        a.row_bytes = head_dim
    a.param_row = groups * (2 if (quantized and kv_type == PKV_INT3) else 4)
    cdef int64_t G = a.group, D = head_dim
    cdef int64_t b, h, s, n, nq, ns, per, i, r, it, d, rows_max = 0, work = 0
    cdef int64_t num_items = 0, part_rows = 0
    # per sequence: splits and the first item / first partial row
    cdef int64_t* seq_info = <int64_t*> malloc(<size_t> (3 * batch + 1) * 8)
    if seq_info == NULL:
        raise MemoryError("attend: cannot plan the items")
    for b in range(batch):
        n = a.seq_lens[b]
        nq = a.q_indptr[b + 1] - a.q_indptr[b]
        ns = 0
        if nq > 0 and n > 0:
            if num_splits > 0:
                ns = num_splits if num_splits < n else n
            elif nq <= 16:
                ns = (n + split_tokens - 1) // split_tokens
            else:
                ns = 1
        seq_info[3 * b] = ns
        seq_info[3 * b + 1] = num_items
        seq_info[3 * b + 2] = part_rows
        num_items += ns * num_heads
        part_rows += ns * num_heads * nq * G
        if nq * G > rows_max:
            rows_max = nq * G
        work += n * nq * G * D * num_heads
    # item -> (b, h, s): decoded from seq_info by a per-item table
    cdef int64_t* items = <int64_t*> malloc(<size_t> (4 * num_items + 1) * 8)
    cdef float* part = <float*> malloc(<size_t> (part_rows * (D + 2) + 1) * 4)
    cdef int nth = 1 if work < _PARALLEL_WORK else openmp.omp_get_max_threads()
    cdef int64_t share = (2 * PKV_ATTN_TILE + 1) * D + rows_max * PKV_ATTN_TILE
    cdef float* scratch = <float*> malloc(<size_t> (nth * share + 1) * 4)
    if items == NULL or part == NULL or scratch == NULL:
        free(seq_info); free(items); free(part); free(scratch)
        raise MemoryError("attend: cannot allocate the partial results")
    it = 0
    for b in range(batch):
        ns = seq_info[3 * b]
        n = a.seq_lens[b]
        nq = a.q_indptr[b + 1] - a.q_indptr[b]
        if ns == 0:
            continue
        per = (n + ns - 1) // ns
        for h in range(num_heads):
            for s in range(ns):
                items[4 * it] = b
                items[4 * it + 1] = h
                items[4 * it + 2] = s * per
                items[4 * it + 3] = (s + 1) * per if (s + 1) * per < n else n
                it += 1
    cdef float* out = <float*> out_ptr
    cdef float* pm
    cdef float* pacc
    cdef float mx, c, lsum
    cdef int64_t base, rows, q0, row_off
    with nogil:
        for it in prange(num_items, num_threads=nth, schedule="static"):
            b = items[4 * it]
            h = items[4 * it + 1]
            nq = a.q_indptr[b + 1] - a.q_indptr[b]
            rows = nq * G
            # the item's partials: m [rows], l [rows], acc [rows, D], after the earlier items of b
            base = seq_info[3 * b + 2] + (it - seq_info[3 * b + 1]) * rows
            attn_item(&a, b, h, items[4 * it + 2], items[4 * it + 3], part + base * (D + 2),
                      part + base * (D + 2) + rows, part + base * (D + 2) + 2 * rows,
                      scratch + openmp.omp_get_thread_num() * share)
        # merge: each (sequence, KV head)'s splits, row by row
        for it in prange(batch * num_heads, num_threads=nth, schedule="static"):
            b = it // num_heads
            h = it % num_heads
            ns = seq_info[3 * b]
            nq = a.q_indptr[b + 1] - a.q_indptr[b]
            q0 = a.q_indptr[b]
            rows = nq * G
            for r in range(rows):
                row_off = ((q0 + r // G) * num_q_heads + h * G + r % G) * D
                mx = -INFINITY
                for s in range(ns):
                    base = seq_info[3 * b + 2] + (h * ns + s) * rows
                    pm = part + base * (D + 2)
                    if pm[r] > mx:
                        mx = pm[r]
                for d in range(D):
                    out[row_off + d] = 0.0
                lsum = 0.0
                for s in range(ns):
                    base = seq_info[3 * b + 2] + (h * ns + s) * rows
                    pm = part + base * (D + 2)
                    if pm[r] == -INFINITY:
                        continue
                    c = expf(pm[r] - mx)
                    lsum = lsum + pm[rows + r] * c
                    pacc = pm + 2 * rows + r * D
                    for d in range(D):
                        out[row_off + d] += pacc[d] * c
                if lsum > 0:
                    for d in range(D):
                        out[row_off + d] /= lsum
    free(seq_info)
    free(items)
    free(part)
    free(scratch)
