# cython: language_level=3
"""CRC-32C (Castagnoli) of buffers, with the GIL released: the checksum a remote tier's
values carry. The CPU's crc32 instruction where it has one (SSE4.2), else tables; both
give the same value (``portable=True`` forces the tables, for tests)."""
from libc.stdint cimport uint32_t

cdef extern from "pkv_crc32c.h":
    void pkv_crc32c_init() nogil
    uint32_t pkv_crc32c(uint32_t crc, const unsigned char* p, size_t n, int portable) nogil
    int pkv_crc32c_hardware() nogil

pkv_crc32c_init()

#: whether this CPU computes it with the crc32 instruction
HARDWARE = bool(pkv_crc32c_hardware())


def crc32c(data, crc=0, *, bint portable=False):
    """CRC-32C of ``data`` (any contiguous buffer: bytes, memoryview, numpy array),
    continuing ``crc`` (the value of the bytes before it; 0 to start)."""
    cdef const unsigned char[::1] view
    if isinstance(crc, bool) or not isinstance(crc, int) or not 0 <= crc < 2**32:
        from pagedkv.errors import InvalidArgumentError, expected
        raise InvalidArgumentError(expected("crc", "an int in [0, 2**32)", repr(crc)))
    cdef uint32_t c = <uint32_t>crc
    mv = memoryview(data)
    if not mv.c_contiguous:
        from pagedkv.errors import InvalidArgumentError, expected
        raise InvalidArgumentError(expected("data", "a contiguous buffer", "a strided one"))
    if mv.nbytes == 0:
        return c
    view = mv.cast("B")
    with nogil:
        c = pkv_crc32c(c, &view[0], <size_t>view.shape[0], portable)
    return c
