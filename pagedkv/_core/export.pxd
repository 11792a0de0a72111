# Exports of block tables for attention kernels and the KV store: padded tables, CSR
# page tables (FlashInfer's layout), slot mappings and lengths. Read-only over rows.
cimport numpy as cnp
from pagedkv._core._types cimport int32_t, int64_t
from pagedkv._core.rows cimport SeqRow

# sink_blocks: leading blocks a sliding-window table never releases (0 for full
# attention); a row's released blocks are the num_dropped entries after them.
cdef object padded_table(const SeqRow* rows, const int32_t* rp, int64_t m, int32_t pad, object width,
                         int32_t sink_blocks)
cdef tuple csr_table(const SeqRow* rows, const int32_t* rp, int64_t m, int32_t block_size, int32_t sink_blocks)
cdef cnp.ndarray slots_of(const SeqRow* rows, const int32_t* rp, int64_t m, const int64_t* starts,
                          const int64_t* counts, int32_t block_size, int32_t shift, object name_of,
                          int32_t sink_blocks)
cdef cnp.ndarray lengths(const SeqRow* rows, const int32_t* rp, int64_t m, bint computed)
