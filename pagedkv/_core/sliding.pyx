# cython: language_level=3
"""SlidingWindowTables: block tables for sliding-window attention, with optional sinks.

A query at position p attends to positions (p - W, p], plus the first S positions
(``window=W``, ``sinks=S``). Every call that advances the committed tokens (commit,
advance, a prefix hit at add; a fork inherits its source's state) then releases the
leading blocks whose tokens are all outside the window of the next query, except the
blocks holding the sinks, through the pool's normal release (a shared block loses one
reference; a registered one becomes cached-free). Their table entries read -1 and
``num_dropped`` counts them, so positions stay absolute: position p is still in entry
p // block_size. A sequence of any length then holds at most
ceil(S / bs) + ceil((W - 1) / bs) + 1 blocks plus its reserved tail, so its length is
bounded by the table's int32 block index, not by the pool.

While a sequence is held (``hold_window``), commits release nothing, so ``truncate``
can roll back speculative tokens past the window; ``slide`` releases what left the
window meanwhile, and ending the hold does too.

Everything else (rows, reserve, copy-on-write, prefix registration, fork, exports) is
:class:`pagedkv._core.tables.TablesBase`'s.
"""
cimport cython
from pagedkv._core.rows cimport blk_of, nblocks_for
from pagedkv._core.tables cimport commit_row, advance_one, release_blocks

from pagedkv._core._arrays cimport check_int
from pagedkv.errors import InternalError, InvalidArgumentError, expected


@cython.final
cdef class SlidingWindowTables(TablesBase):
    """Sliding-window attention (``window`` tokens, the first ``sinks`` always seen)."""

    def __cinit__(self, pool, block_size, index=None, recent_blocks=4, window=None, sinks=0):
        self.window = check_int(window, "window", 1, 2**62,
                                "an int >= 1 (tokens) for a sliding window (full attention: FullAttentionTables)")
        self.sinks = check_int(sinks, "sinks", 0, 2**62, "an int >= 0")
        if not self.sinks < self.window:
            raise InvalidArgumentError(expected("sinks", f"fewer sink tokens than the window ({self.window})",
                                                self.sinks))
        self.sink_blocks = <int32_t>min(nblocks_for(self.sinks, self.block_size, self.bs_shift), 2**31 - 1)
        # A sliding sequence holds O(window) blocks, so its length is bounded by the
        # table's int32 block index, not by the pool.
        self.max_tokens = <int64_t>(2**31 - 1) * self.block_size

    cdef void slide_row(self, SeqRow* row) noexcept nogil:
        # Release the blocks wholly before the next query's window (position
        # num_computed - window + 1 is the first it sees), oldest first, sinks kept.
        cdef int64_t first = <int64_t>self.sink_blocks + row.num_dropped, upto, i
        cdef int64_t keep_from = row.num_computed - self.window + 1
        if keep_from <= 0:
            return
        upto = blk_of(keep_from, self.block_size, self.bs_shift)
        if upto <= first:
            return
        self.pool.release_batch(row.blocks + first, upto - first, NULL, 0)
        for i in range(first, upto):
            row.blocks[i] = -1
        row.num_dropped = <int32_t>(upto - self.sink_blocks)

    # ---- the steps that differ from full attention ---------------------------------
    cdef void commit_rows(self, SeqRow* rows, const int32_t* rp, int64_t m, const int64_t* cp,
                          const token_t* tp) noexcept nogil:
        cdef int64_t i, off = 0
        cdef SeqRow* row
        for i in range(m):
            row = &rows[rp[i]]
            commit_row(self, row, cp[i], tp + off if tp != NULL else NULL)
            if not row.hold:     # after registration: a released block is already in the index
                self.slide_row(row)
            off += cp[i]

    cdef void advance_rows(self, SeqRow* rows, const int32_t* rp, int64_t m, const token_t* tp,
                           int64_t* op) noexcept nogil:
        cdef int64_t i
        cdef SeqRow* row
        for i in range(m):
            row = &rows[rp[i]]
            if row.num_computed < row.num_reserved:
                commit_row(self, row, row.num_reserved - row.num_computed, NULL)
                if not row.hold:
                    self.slide_row(row)
            advance_one(self, row, tp[i], op + i)

    cdef void settle_row(self, SeqRow* row) noexcept nogil:
        self.slide_row(row)

    cdef void release_row(self, SeqRow* row) noexcept nogil:
        # The released run is skipped: the kept blocks close up first.
        if row.num_dropped == 0:
            release_blocks(self, row, row.num_blocks, row.num_blocks)
        else:
            release_blocks(self, row, self.sink_blocks, self.sink_blocks + row.num_dropped)

    cdef int check_truncate(self, SeqRow* row, int64_t n, int64_t i) except -1:
        TablesBase.check_truncate(self, row, n, i)
        cdef int64_t bs = self.block_size
        if row.num_dropped and row.num_computed - n - self.window + 1 < \
                <int64_t>(self.sink_blocks + row.num_dropped) * bs:
            raise InvalidArgumentError(expected(
                "num_tokens", f"at most {row.num_computed - self.window + 1 - (self.sink_blocks + row.num_dropped) * bs} "
                f"for sequence {self.namer(row.key)!r} (the window of the tokens left must still be held; "
                f"{row.num_dropped} blocks left it already)", f"{n} at index {i}"))
        return 0

    cdef int check_row(self, SeqRow* row) except -1:
        due = max(0, blk_of(max(row.num_computed - self.window + 1, 0), self.block_size, self.bs_shift)
                  - self.sink_blocks)
        if row.num_dropped > due or (row.num_dropped < due and not row.hold):
            raise InternalError(f"sequence {row.key}: {row.num_dropped} blocks released for {row.num_computed} "
                                f"committed tokens (window {self.window}, {self.sinks} sinks)")
        return 0

    # ---- Python API: the window --------------------------------------------------------
    def hold_window(self, keys, bint hold=True, bint internal=False):
        """Hold (or stop holding) blocks that leave the window, per sequence.

        While held, commits release nothing, so ``truncate`` can roll back speculative
        tokens past the window; ``slide`` releases what left the window meanwhile, and
        ending the hold does too. A fork inherits the hold."""
        cdef int64_t m = self.load_keys(keys), i
        cdef int32_t* rp = self.rows_for(m, internal)
        cdef SeqRow* row
        for i in range(m):
            row = &self.store.rows[rp[i]]
            row.hold = hold
            if not hold:
                self.slide_row(row)

    def slide(self, keys, bint internal=False):
        """Release the blocks that left each sequence's window now (held or not)."""
        cdef int64_t m = self.load_keys(keys), i
        cdef int32_t* rp = self.rows_for(m, internal)
        for i in range(m):
            self.slide_row(&self.store.rows[rp[i]])
