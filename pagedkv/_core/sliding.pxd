# Sliding-window block tables (with optional sink tokens): the tables of one attention
# type, over TablesBase (tables.pxd). Only the steps marked "per attention type" there
# are overridden; the rest is shared.
cimport cython
from pagedkv._core._types cimport token_t, int32_t, int64_t
from pagedkv._core.rows cimport SeqRow
from pagedkv._core.tables cimport TablesBase


# final (declared in sliding.pyx: Cython refuses overrides under a final class declared here)
cdef class SlidingWindowTables(TablesBase):
    cdef readonly int64_t window           # tokens a query sees: (p - window, p], >= 1
    cdef readonly int64_t sinks            # leading tokens never released, in [0, window)

    cdef void slide_row(self, SeqRow* row) noexcept nogil
    cdef void commit_rows(self, SeqRow* rows, const int32_t* rp, int64_t m, const int64_t* cp,
                          const token_t* tp) noexcept nogil
    cdef void advance_rows(self, SeqRow* rows, const int32_t* rp, int64_t m, const token_t* tp,
                           int64_t* op) noexcept nogil
    cdef void settle_row(self, SeqRow* row) noexcept nogil
    cdef void release_row(self, SeqRow* row) noexcept nogil
    cdef int check_truncate(self, SeqRow* row, int64_t n, int64_t i) except -1
    cdef int check_row(self, SeqRow* row) except -1
