# Input and output plumbing shared by the core.
#
# Inputs: every batch argument is read exactly once, into a private buffer (a
# snapshot), before anything is validated or applied. Another thread may rewrite the
# caller's array while a call runs; validating one read and applying another would let
# it smuggle an unchecked value into a C loop. The snapshot is also the one fast path
# for every layout: C-contiguous, strided, reversed and non-native byte order arrays
# are all read by the same loop (a stride and a byte swap), with no NumPy temporary.
#
# Scalars: ints are ints (``__index__``), never bools, floats or strings, and are
# range-checked before any C conversion, so no argument is silently truncated.
#
# Outputs: fresh arrays through the NumPy C API (a typed-memoryview acquisition costs
# more than a whole decode step's bookkeeping for a small batch).
cimport numpy as cnp
from libc.stdlib cimport realloc
from libc.string cimport memcpy
from pagedkv._core._types cimport int32_t, int64_t, uint32_t, uint64_t

cdef extern from *:
    """
    static inline uint32_t pkv_bswap32(uint32_t x) { return __builtin_bswap32(x); }
    static inline uint64_t pkv_bswap64(uint64_t x) { return __builtin_bswap64(x); }
    """
    uint32_t pkv_bswap32(uint32_t x) nogil
    uint64_t pkv_bswap64(uint64_t x) nogil

cdef struct IntBuf:
    char* data          # owned; grows, never shrinks
    int64_t nbytes      # bytes allocated


cdef inline int buf_reserve(IntBuf* b, int64_t nbytes) except -1:
    cdef char* grown
    if nbytes <= b.nbytes:
        return 0
    if nbytes < 256:
        nbytes = 256
    grown = <char*>realloc(b.data, <size_t>nbytes)
    if grown == NULL:
        from pagedkv.errors import HostMemoryError
        raise HostMemoryError(f"cannot allocate a {nbytes}-byte argument buffer")
    b.data = grown
    b.nbytes = nbytes
    return 0


cdef inline str describe(object obj):
    if isinstance(obj, cnp.ndarray):
        return f"{obj.dtype} array of shape {obj.shape}"
    return type(obj).__name__


cdef inline void copy_items(char* dst, const char* src, int64_t n, Py_ssize_t stride,
                            int itemsize, bint swap) noexcept:
    # One read of each element. Contiguous native arrays take memcpy.
    cdef int64_t i
    cdef uint64_t v8
    cdef uint32_t v4
    if stride == itemsize and not swap:
        memcpy(dst, src, <size_t>(n * itemsize))
    elif itemsize == 8:
        for i in range(n):
            v8 = (<const uint64_t*>(src + i * stride))[0]
            (<uint64_t*>dst)[i] = pkv_bswap64(v8) if swap else v8
    else:
        for i in range(n):
            v4 = (<const uint32_t*>(src + i * stride))[0]
            (<uint32_t*>dst)[i] = pkv_bswap32(v4) if swap else v4


cdef inline cnp.ndarray _from_sequence(object obj, str name, int typenum, str kind):
    # Slow path: lists, tuples, ranges and other non-ndarray inputs.
    import numpy as np
    from pagedkv.errors import ArgumentTypeError, DTypeError, InvalidArgumentError, ShapeError, expected
    cdef cnp.ndarray a
    if isinstance(obj, (str, bytes, bool)) or obj is None:
        raise ArgumentTypeError(expected(name, f"a 1-D {kind} array or a list of ints", describe(obj)))
    if isinstance(obj, (list, tuple, range)):
        try:
            a = np.asarray(obj)
        except (ValueError, TypeError, OverflowError):
            raise ShapeError(expected(name, "a flat sequence of ints", "a ragged or non-numeric sequence")) from None
        if a.size == 0:
            return np.empty(0, dtype=np.int32 if typenum == cnp.NPY_INT32 else np.int64)
        if a.dtype.kind not in "iu":
            raise DTypeError(expected(name, f"a sequence of ints fitting {kind}", f"{a.dtype} values"))
        if cnp.PyArray_NDIM(a) != 1:
            raise ShapeError(expected(name, "a flat sequence of ints", f"nested sequence of shape {np.shape(obj)}"))
        lo, hi = (-2**31, 2**31 - 1) if typenum == cnp.NPY_INT32 else (-2**63, 2**63 - 1)
        if int(a.min()) < lo or int(a.max()) > hi:
            raise InvalidArgumentError(expected(name, f"ints fitting {kind}", "an out-of-range int"))
        return a.astype(np.int32 if typenum == cnp.NPY_INT32 else np.int64)
    try:
        a = np.asarray(obj)
    except Exception:
        raise ArgumentTypeError(expected(name, f"a 1-D {kind} array or a list of ints", describe(obj))) from None
    if cnp.PyArray_TYPE(a) != typenum or cnp.PyArray_NDIM(a) != 1:
        raise DTypeError(expected(name, f"a 1-D {kind} array", describe(obj)))
    return a


cdef inline int64_t load_ints(object obj, str name, int typenum, IntBuf* buf) except -1:
    """Snapshot a 1-D int32 (typenum NPY_INT32) or int64 (NPY_INT64) array, or a list of
    ints, into buf; returns the element count. Any stride and byte order."""
    cdef cnp.ndarray a
    cdef int itemsize = 4 if typenum == cnp.NPY_INT32 else 8
    cdef int64_t n
    if type(obj) is cnp.ndarray:
        a = <cnp.ndarray>obj
    else:
        a = _from_sequence(obj, name, typenum, "int32" if itemsize == 4 else "int64")
    if cnp.PyArray_TYPE(a) != typenum or cnp.PyArray_NDIM(a) != 1:
        from pagedkv.errors import DTypeError, ShapeError, expected
        if cnp.PyArray_TYPE(a) != typenum:
            raise DTypeError(expected(name, f"a 1-D {'int32' if itemsize == 4 else 'int64'} array", describe(obj)))
        raise ShapeError(expected(name, f"a 1-D {'int32' if itemsize == 4 else 'int64'} array", describe(obj)))
    n = cnp.PyArray_DIM(a, 0)
    buf_reserve(buf, n * itemsize)
    if n:
        copy_items(buf.data, <const char*>cnp.PyArray_DATA(a), n, cnp.PyArray_STRIDE(a, 0), itemsize,
                   not cnp.PyArray_ISNOTSWAPPED(a))
    return n


cdef inline int64_t check_int(object value, str name, int64_t lo, int64_t hi, str what=None) except? -1:
    """An int (``__index__``, not bool) in [lo, hi]; typed errors otherwise. ``what``
    replaces the default "an int in [lo, hi]" in messages."""
    if type(value) is int and lo <= value <= hi:
        return value
    return _check_int_slow(value, name, lo, hi, what)


cdef inline int64_t _check_int_slow(object value, str name, int64_t lo, int64_t hi, str what) except? -1:
    from pagedkv.errors import ArgumentTypeError, InvalidArgumentError, expected
    if what is None:
        what = f"an int in [{lo}, {hi}]"
    if type(value) is not int:
        if isinstance(value, bool) or not hasattr(type(value), "__index__"):
            raise ArgumentTypeError(expected(name, what, repr(value)))
        value = value.__index__()
    if not lo <= value <= hi:
        raise InvalidArgumentError(expected(name, what, repr(value)))
    return value


cdef inline object check_count(object value, str name):
    """A count: an int (``__index__``, not bool) >= 0, returned as an unbounded Python int
    so that a caller can compare it with capacity before narrowing it."""
    if type(value) is int and value >= 0:
        return value
    from pagedkv.errors import ArgumentTypeError, InvalidArgumentError, expected
    if type(value) is not int:
        if isinstance(value, bool) or not hasattr(type(value), "__index__"):
            raise ArgumentTypeError(expected(name, "an int >= 0", repr(value)))
        value = value.__index__()
    if value < 0:
        raise InvalidArgumentError(expected(name, "an int >= 0", repr(value)))
    return value


cdef inline uint64_t check_u64(object value, str name) except? 0:
    """An int in [0, 2**64) (a hash)."""
    if type(value) is int and 0 <= value < 2**64:
        return <uint64_t>value
    from pagedkv.errors import ArgumentTypeError, InvalidArgumentError, expected
    if type(value) is not int:
        if isinstance(value, bool) or not hasattr(type(value), "__index__"):
            raise ArgumentTypeError(expected(name, "an int in [0, 2**64)", repr(value)))
        value = value.__index__()
    if not 0 <= value < 2**64:
        raise InvalidArgumentError(expected(name, "an int in [0, 2**64)", repr(value)))
    return <uint64_t>value


cdef inline double check_fraction(object value, str name) except? -1.0:
    """A real number in [0, 1]."""
    from pagedkv.errors import ArgumentTypeError, InvalidArgumentError, expected
    import numbers
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(expected(name, "a fraction in [0, 1]", repr(value)))
    if not 0.0 <= float(value) <= 1.0:
        raise InvalidArgumentError(expected(name, "a fraction in [0, 1]", repr(value)))
    return float(value)


cdef inline cnp.ndarray new_i32(cnp.npy_intp n):
    return cnp.PyArray_EMPTY(1, &n, cnp.NPY_INT32, 0)


cdef inline cnp.ndarray new_i64(cnp.npy_intp n):
    return cnp.PyArray_EMPTY(1, &n, cnp.NPY_INT64, 0)


cdef inline cnp.ndarray new_u64(cnp.npy_intp n):
    return cnp.PyArray_EMPTY(1, &n, cnp.NPY_UINT64, 0)


cdef inline cnp.ndarray new_u32(cnp.npy_intp n):
    return cnp.PyArray_EMPTY(1, &n, cnp.NPY_UINT32, 0)


cdef inline cnp.ndarray new_u8(cnp.npy_intp n):
    return cnp.PyArray_EMPTY(1, &n, cnp.NPY_UINT8, 0)
