# Exports of block tables for attention kernels and the KV store: padded tables, CSR
# page tables (FlashInfer's layout), slot mappings and lengths. Read-only over rows.
cimport numpy as cnp
from pagedkv._core._types cimport int32_t, int64_t
from pagedkv._core.rows cimport SeqRow

cdef object padded_table(const SeqRow* rows, const int32_t* rp, int64_t m, int32_t pad, object width)
cdef tuple csr_table(const SeqRow* rows, const int32_t* rp, int64_t m, int32_t block_size)
cdef cnp.ndarray slots_of(const SeqRow* rows, const int32_t* rp, int64_t m, const int64_t* starts,
                          const int64_t* counts, int32_t block_size, int32_t shift, object name_of)
cdef cnp.ndarray lengths(const SeqRow* rows, const int32_t* rp, int64_t m, bint computed)
