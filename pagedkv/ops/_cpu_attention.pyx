# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
# distutils: extra_compile_args = -fopenmp -ffp-contract=off -fno-fast-math -fno-trapping-math
# distutils: extra_link_args = -fopenmp
"""Paged attention loops of the CPU backend (``attention_rows.h``), on raw tensor pointers.

:mod:`pagedkv.ops.attention_cpu` has checked every shape, dtype and device and every
table value (:func:`pagedkv.ops.attention_reference.check_attention`, on private
snapshots), and hands over addresses and counts. Work items are (sequence, KV heads,
split): a decode sequence (at most 16 queries) takes all its KV heads in one item, so
an NHD page is streamed once rather than once per head; a prefill chunk takes one head
per item (its rows are parallelism enough, and its reads are shared by many queries).
One OpenMP loop runs the items (``schedule(static)``), then a second merges each
sequence's splits exactly. Threads: the CPU loops' one policy (``_threads.pxd``, set by
``pagedkv.set_num_threads``), with ``_PARALLEL_WORK`` multiply-adds as the piece of work
one thread must have; the splits follow the thread setting, never the machine's load, so
a call's result does not depend on how many threads were idle.
"""
from libc.stdint cimport INT64_MAX, int32_t, int64_t, uint8_t, uint16_t, uintptr_t
from libc.stdlib cimport free, malloc
from libc.math cimport expf, INFINITY
from cython.parallel cimport prange
cimport openmp

from pagedkv.errors import InvalidArgumentError, expected
from pagedkv.ops._threads cimport configured_threads, threads_for

cdef extern from "attention_rows.h" nogil:
    int PKV_F32, PKV_INT4, PKV_INT3, PKV_INT8, PKV_E4M3
    int PKV_ROW_I8, PKV_ROW_I4, PKV_ROW_I3, PKV_ROW_E4M3, PKV_ROW_E5M2
    int PKV_ATTN_TILE, PKV_ATTN_MAX_TILE_ROWS
    int64_t pkv_attn_scratch_floats(int64_t tile, int64_t heads, int64_t head_dim)
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
        int64_t tile
        int kind
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
        int prefetch
        int key_cache
        int fused
    int PKV_ATTN_PREFETCH_NONE, PKV_ATTN_PREFETCH_ALL, PKV_ATTN_PREFETCH_BLOCKS
    ctypedef void (*pkv_attn_item_fn)(const pkv_attn_args*, int64_t, int64_t, int64_t, int64_t, int64_t, float*,
                                      float*, float*, float*) noexcept
    pkv_attn_item_fn pkv_pick_attn_item()

cdef pkv_attn_item_fn attn_item = pkv_pick_attn_item()
cdef pkv_dequantize_row_fn dequantize_row = pkv_pick_dequantize_row()
cdef pkv_key_row_fn key_row = pkv_pick_key_row()

#: which build of the loops runs: "avx2" or "baseline"
ROW_ISA = "avx2" if pkv_use_avx2() else "baseline"

# below this many multiply-adds (keys x query rows x head_dim), one thread; a thread per
# this much work at most
cdef int64_t _PARALLEL_WORK = 1 << 18
# a tile's K (and V) floats at most (K and V: 256 KiB, in L2): per-tile work per row (the
# softmax's rescale, exp, the accumulators' loads) is paid per tile, and was measured to
# cost more than L1 misses (1 thread, 32q/8kv/128 int8: 8 tokens 24.3 ms, 32 tokens 23.9,
# 2 tokens 41.5)
cdef int64_t _TILE_FLOATS = 32768
# a decode item's KV heads at most (its tile rows are tile x heads)
cdef int64_t _ITEM_HEADS = 256
# what an item prefetches of its next tile (attention_rows.h's PKV_ATTN_PREFETCH_), -1:
# every line of float rows, each block's first lines of code rows (the measured best)
cdef int _PREFETCH = -1
# sealed block keys: widen each block's parameters once per item (else per row)
cdef int _KEY_CACHE = 1
# code rows decoded in registers where used, not widened into float tiles; -1: for int4 and
# int3 only (measured, 1 thread, batch 8 x 4096: int4 block keys and int3 2-7% faster fused,
# int8 5-10% slower, within this loaded machine's noise)
cdef int _FUSED = -1

#: the prefetch modes :func:`tune` takes
PREFETCH_MODES = {"auto": -1, "none": PKV_ATTN_PREFETCH_NONE, "all": PKV_ATTN_PREFETCH_ALL,
                  "blocks": PKV_ATTN_PREFETCH_BLOCKS}


cdef extern from "quant_rows.h" nogil:
    void pkv_rotate_row(float* y, int64_t d, const float* signs)
    void pkv_unrotate_row(float* y, int64_t d, const float* signs)


def hadamard_rows(uintptr_t y_ptr, int64_t rows, int64_t head_dim, uintptr_t signs_ptr, bint inverse):
    """In place over ``rows`` contiguous float32 rows of ``head_dim``: rotate (``inverse``
    False) or unrotate them, bit for bit as pagedkv.format.rotation defines it (the same row
    function the quantized writes and gathers use). The caller checks the sizes."""
    cdef float* y = <float*>y_ptr
    cdef const float* signs = <const float*>signs_ptr
    cdef int64_t r
    with nogil:
        for r in range(rows):
            if inverse:
                pkv_unrotate_row(y + r * head_dim, head_dim, signs)
            else:
                pkv_rotate_row(y + r * head_dim, head_dim, signs)


def planned_threads(int64_t work):
    """Threads a call of ``work`` multiply-adds (keys x query rows x head_dim, summed over
    the sequences) would take now: the CPU loops' policy (pagedkv.set_num_threads)."""
    return threads_for(work // _PARALLEL_WORK)


def tune(prefetch=None, key_cache=None, fused=None):
    """Set the loops' tuning knobs (benchmarks compare them); returns the previous
    ``(prefetch, key_cache, fused)``. ``prefetch``: a :data:`PREFETCH_MODES` name;
    ``fused``: code rows decoded in registers (else widened into float tiles; the
    fused path widens sealed block keys' parameters once per tile and ignores
    ``key_cache``), or ``"auto"``: for int4 and int3."""
    global _PREFETCH, _KEY_CACHE, _FUSED
    names = {v: k for k, v in PREFETCH_MODES.items()}
    old = (names[_PREFETCH], bool(_KEY_CACHE), "auto" if _FUSED == -1 else bool(_FUSED))
    if prefetch is not None:
        if prefetch not in PREFETCH_MODES:
            raise InvalidArgumentError(expected("prefetch", f"one of {sorted(PREFETCH_MODES)}", prefetch))
        _PREFETCH = PREFETCH_MODES[prefetch]
    if key_cache is not None:
        _KEY_CACHE = 1 if key_cache else 0
    if fused is not None:
        _FUSED = -1 if isinstance(fused, str) and fused == "auto" else 1 if fused else 0
    return old


def attend(
    uintptr_t q_ptr, uintptr_t qrot_ptr, uintptr_t out_ptr, int64_t num_q, int64_t num_q_heads,
    uintptr_t layer_ptr, uintptr_t scale_ptr, uintptr_t zero_ptr, uintptr_t key_scale_ptr, uintptr_t key_zero_ptr,
    bint quantized, int kv_type, int64_t elem_bytes,
    uintptr_t indptr_ptr, uintptr_t indices_ptr, uintptr_t seq_lens_ptr, uintptr_t q_indptr_ptr, int64_t batch,
    int64_t block_size, int64_t num_heads, int64_t head_dim, int64_t groups, bint hnd,
    float sm_scale, float soft_cap, int64_t window, int64_t sink_tokens, int64_t num_splits, int64_t split_tokens,
    uintptr_t exact_data_ptr=0, int exact_type=0, uintptr_t exact_slot_ptr=0, uintptr_t exact_valid_ptr=0,
    int64_t exact_recent=0, int64_t exact_sink=0, uintptr_t signs_ptr=0, int64_t tile_floats=0,
):
    """``out`` (float32 ``[num_q, Hq, D]``, rotated domain when ``qrot_ptr``) of checked tables.

    ``num_splits`` > 0 forces that many splits per sequence; else one per
    ``split_tokens`` keys for sequences of at most 16 queries (a prefill chunk has
    parallelism enough across its rows' heads and would need a partial result per split
    and row). ``tile_floats`` > 0 overrides the tile budget (benchmarks)."""
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
    a.prefetch = _PREFETCH
    if _PREFETCH == -1:
        a.prefetch = PKV_ATTN_PREFETCH_BLOCKS if quantized else PKV_ATTN_PREFETCH_ALL
    a.key_cache = _KEY_CACHE
    if kv_type == PKV_INT4 and quantized:
        a.row_bytes = head_dim // 2
    elif kv_type == PKV_INT3 and quantized:
        a.row_bytes = head_dim // 8 * 3
    else:
        a.row_bytes = head_dim
    a.param_row = groups * (2 if (quantized and kv_type == PKV_INT3) else 4)
    # per-token code rows widened by attention_rows.h's own loops where each group is whole
    # 8-lane chunks (else quant_rows.h's row function)
    a.kind = -1
    if quantized and head_dim % 8 == 0 and groups <= 64 and (head_dim // groups) % 8 == 0:
        a.kind = (PKV_ROW_I8 if kv_type == PKV_INT8 else PKV_ROW_I4 if kv_type == PKV_INT4
                  else PKV_ROW_I3 if kv_type == PKV_INT3 else PKV_ROW_E4M3 if kv_type == PKV_E4M3
                  else PKV_ROW_E5M2)
    a.fused = _FUSED if _FUSED >= 0 else (a.kind == PKV_ROW_I4 or a.kind == PKV_ROW_I3)
    cdef int64_t G = a.group, D = head_dim, Hq = num_q_heads
    cdef int64_t b, h, s, n, nq, ns, per, i, r, it, d, hc, hc_max = 1, work = 0
    cdef int64_t num_items = 0, part_rows = 0
    for b in range(batch):
        n = a.seq_lens[b]
        nq = a.q_indptr[b + 1] - a.q_indptr[b]
        if nq > 0 and n > 0:
            work += n * nq * G * D * num_heads
    # the splits are planned for the thread setting (a result must not depend on the load);
    # the loops run on the threads the policy gives now (never more)
    cdef int want = 1 if work < _PARALLEL_WORK else configured_threads()
    cdef int nth = threads_for(work // _PARALLEL_WORK)
    # per sequence: splits, heads per item, first item, first partial row
    cdef int64_t* seq_info = <int64_t*> malloc(<size_t> (4 * batch + 1) * 8)
    if seq_info == NULL:
        raise MemoryError("attend: cannot plan the items")
    for b in range(batch):
        n = a.seq_lens[b]
        nq = a.q_indptr[b + 1] - a.q_indptr[b]
        ns = 0
        hc = 1
        if nq > 0 and n > 0:
            if num_splits > 0:
                ns = num_splits if num_splits < n else n
            elif nq <= 16:
                ns = (n + split_tokens - 1) // split_tokens
                if batch * ns < want:  # all heads in one item: split for the threads instead
                    ns = (want + batch - 1) // batch
                    if ns > (n + 255) // 256:
                        ns = (n + 255) // 256
            else:
                ns = 1
            if nq <= 16:
                hc = num_heads if num_heads < _ITEM_HEADS else _ITEM_HEADS
        if hc > hc_max:
            hc_max = hc
        seq_info[4 * b] = ns
        seq_info[4 * b + 1] = hc
        seq_info[4 * b + 2] = num_items
        seq_info[4 * b + 3] = part_rows
        num_items += ns * ((num_heads + hc - 1) // hc)
        part_rows += ns * nq * Hq
    cdef int64_t tile = (tile_floats if tile_floats > 0 else _TILE_FLOATS) // (hc_max * D)
    if tile > PKV_ATTN_TILE:
        tile = PKV_ATTN_TILE
    if tile * hc_max > PKV_ATTN_MAX_TILE_ROWS:
        tile = PKV_ATTN_MAX_TILE_ROWS // hc_max
    if tile < 1:
        tile = 1
    a.tile = tile
    # item -> (b, h0, h1, t0, t1, split)
    cdef int64_t* items = <int64_t*> malloc(<size_t> (6 * num_items + 1) * 8)
    cdef float* part = <float*> malloc(<size_t> (part_rows * (D + 2) + 1) * 4)
    cdef int64_t share = pkv_attn_scratch_floats(tile, hc_max, D)
    cdef float* scratch = <float*> malloc(<size_t> (nth * share + 1) * 4)
    if items == NULL or part == NULL or scratch == NULL:
        free(seq_info); free(items); free(part); free(scratch)
        raise MemoryError("attend: cannot allocate the partial results")
    it = 0
    for b in range(batch):
        ns = seq_info[4 * b]
        hc = seq_info[4 * b + 1]
        n = a.seq_lens[b]
        if ns == 0:
            continue
        per = (n + ns - 1) // ns
        for h in range(0, num_heads, hc):
            for s in range(ns):
                items[6 * it] = b
                items[6 * it + 1] = h
                items[6 * it + 2] = h + hc if h + hc < num_heads else num_heads
                items[6 * it + 3] = s * per
                items[6 * it + 4] = (s + 1) * per if (s + 1) * per < n else n
                items[6 * it + 5] = s
                it += 1
    cdef float* out = <float*> out_ptr
    cdef float* pm
    cdef float* pacc
    cdef float mx, c, lsum
    cdef int64_t base, rows, q0, row_off, hq
    with nogil:
        for it in prange(num_items, num_threads=nth, schedule="static"):
            b = items[6 * it]
            rows = (a.q_indptr[b + 1] - a.q_indptr[b]) * Hq
            # the split's partials: m [rows], l [rows], acc [rows, D], rows in query order
            base = seq_info[4 * b + 3] + items[6 * it + 5] * rows
            attn_item(&a, b, items[6 * it + 1], items[6 * it + 2], items[6 * it + 3], items[6 * it + 4],
                      part + base * (D + 2), part + base * (D + 2) + rows, part + base * (D + 2) + 2 * rows,
                      scratch + openmp.omp_get_thread_num() * share)
        # merge: each (sequence, query head)'s splits, query by query
        for it in prange(batch * Hq, num_threads=nth, schedule="static"):
            b = it // Hq
            hq = it % Hq
            ns = seq_info[4 * b]
            q0 = a.q_indptr[b]
            nq = a.q_indptr[b + 1] - q0
            rows = nq * Hq
            for i in range(nq):
                r = i * Hq + hq
                row_off = (q0 * Hq + r) * D
                mx = -INFINITY
                for s in range(ns):
                    pm = part + (seq_info[4 * b + 3] + s * rows) * (D + 2)
                    if pm[r] > mx:
                        mx = pm[r]
                for d in range(D):
                    out[row_off + d] = 0.0
                lsum = 0.0
                for s in range(ns):
                    pm = part + (seq_info[4 * b + 3] + s * rows) * (D + 2)
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
