# cython: language_level=3
"""Block-table exports: what an attention kernel or the KV store needs from the tables.

- ``padded_table``: ``[B, width]`` int32 block ids, padded (vLLM's block_tables); a
  sliding-window row's released blocks read as the pad value, so column j is still
  logical block j (positions stay absolute);
- ``csr_table``: FlashInfer's page table ``(indptr, indices, last_page_len)``; a
  sliding-window row lists only the blocks it holds (sink blocks, then the window);
- ``slots_of``: int64 slots of token ranges (``block * block_size + offset``); a range
  that touches a released block is refused;
- ``lengths``: reserved or committed tokens per sequence.

All are pure reads of the rows resolved by the caller; none touches a device.
"""
cimport numpy as cnp
from libc.string cimport memcpy
from pagedkv._core._types cimport block_id_t
from pagedkv._core._arrays cimport check_int, new_i32, new_i64
from pagedkv._core.rows cimport blk_of, off_of

from pagedkv.errors import InvalidArgumentError, expected

cnp.import_array()


cdef object padded_table(const SeqRow* rows, const int32_t* rp, int64_t m, int32_t pad, object width,
                         int32_t sink_blocks):
    cdef int64_t i, w = 0
    cdef const SeqRow* row
    for i in range(m):
        if rows[rp[i]].num_blocks > w:
            w = rows[rp[i]].num_blocks
    if width is not None:
        w = check_int(width, "width", w, 2**31 - 1)
    cdef cnp.npy_intp dims[2]
    dims[0] = m
    dims[1] = w
    cdef cnp.ndarray out = cnp.PyArray_EMPTY(2, dims, cnp.NPY_INT32, 0)
    cdef int32_t* op = <int32_t*>cnp.PyArray_DATA(out)
    cdef int64_t j
    with nogil:
        for i in range(m):
            row = &rows[rp[i]]
            memcpy(op + i * w, row.blocks, row.num_blocks * sizeof(block_id_t))
            for j in range(sink_blocks, sink_blocks + row.num_dropped):
                op[i * w + j] = pad
            for j in range(row.num_blocks, w):
                op[i * w + j] = pad
    return out


cdef tuple csr_table(const SeqRow* rows, const int32_t* rp, int64_t m, int32_t block_size, int32_t sink_blocks):
    cdef int64_t i, nnz = 0, head
    cdef const SeqRow* row
    for i in range(m):
        nnz += rows[rp[i]].num_blocks - rows[rp[i]].num_dropped
    if nnz > 2**31 - 1:
        raise InvalidArgumentError(expected("seq_ids", "sequences holding fewer than 2**31 blocks in all "
                                            "(int32 CSR indices)", f"{nnz} blocks"))
    cdef cnp.ndarray indptr = new_i32(m + 1), indices = new_i32(nnz), last = new_i32(m)
    cdef int32_t* ip = <int32_t*>cnp.PyArray_DATA(indptr)
    cdef int32_t* xp = <int32_t*>cnp.PyArray_DATA(indices)
    cdef int32_t* lp = <int32_t*>cnp.PyArray_DATA(last)
    with nogil:
        ip[0] = 0
        for i in range(m):
            row = &rows[rp[i]]
            if row.num_dropped:     # sinks, then the window: the released run is skipped
                memcpy(xp + ip[i], row.blocks, sink_blocks * sizeof(block_id_t))
                head = sink_blocks + row.num_dropped
                memcpy(xp + ip[i] + sink_blocks, row.blocks + head, (row.num_blocks - head) * sizeof(block_id_t))
            else:
                memcpy(xp + ip[i], row.blocks, row.num_blocks * sizeof(block_id_t))
            ip[i + 1] = ip[i] + row.num_blocks - row.num_dropped
            lp[i] = <int32_t>(row.num_reserved - <int64_t>(row.num_blocks - 1) * block_size) if row.num_blocks else 0
    return indptr, indices, last


cdef cnp.ndarray slots_of(const SeqRow* rows, const int32_t* rp, int64_t m, const int64_t* starts,
                          const int64_t* counts, int32_t block_size, int32_t shift, object name_of,
                          int32_t sink_blocks):
    # starts/counts are the caller's private snapshot; validated here before any read.
    cdef int64_t i, p, s, c, total = 0, gone_lo, gone_hi
    cdef const SeqRow* row
    for i in range(m):
        row = &rows[rp[i]]
        s = starts[i]
        c = counts[i]
        if s < 0 or c < 0 or s > row.num_reserved or c > row.num_reserved - s:
            raise InvalidArgumentError(expected(
                "starts, counts", f"a range inside the {row.num_reserved} reserved tokens of sequence "
                f"{name_of(row.key)!r}", f"[{s}, {s} + {c}) at index {i}"))
        if row.num_dropped and c:
            gone_lo = <int64_t>sink_blocks * block_size
            gone_hi = <int64_t>(sink_blocks + row.num_dropped) * block_size
            if s < gone_hi and s + c > gone_lo:
                raise InvalidArgumentError(expected(
                    "starts, counts", f"a range of kept tokens of sequence {name_of(row.key)!r} (positions "
                    f"[{gone_lo}, {gone_hi}) left the sliding window)", f"[{s}, {s} + {c}) at index {i}"))
        total += c
    cdef cnp.ndarray out = new_i64(total)
    cdef int64_t* op = <int64_t*>cnp.PyArray_DATA(out)
    with nogil:
        for i in range(m):
            row = &rows[rp[i]]
            for p in range(starts[i], starts[i] + counts[i]):
                op[0] = <int64_t>row.blocks[blk_of(p, block_size, shift)] * block_size + off_of(p, block_size, shift)
                op += 1
    return out


cdef cnp.ndarray lengths(const SeqRow* rows, const int32_t* rp, int64_t m, bint computed):
    cdef cnp.ndarray out = new_i64(m)
    cdef int64_t* op = <int64_t*>cnp.PyArray_DATA(out)
    cdef int64_t i
    for i in range(m):
        op[i] = rows[rp[i]].num_computed if computed else rows[rp[i]].num_reserved
    return out
