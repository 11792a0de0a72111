# Array plumbing shared by the core: validated zero-copy views of inputs and fast
# creation of outputs through the NumPy C API (a typed-memoryview acquisition costs
# more than a whole decode step's bookkeeping for a small batch).
cimport numpy as cnp
from pagedkv._core._types cimport int32_t, int64_t

cdef inline str _describe(object obj):
    if isinstance(obj, cnp.ndarray):
        return f"{obj.dtype} array of shape {obj.shape}"
    return type(obj).__name__


cdef inline cnp.ndarray _coerce(object obj, str name, int typenum, str kind):
    # Slow path: lists, tuples, scalars, non-contiguous or foreign arrays.
    import numpy as np
    from pagedkv.errors import DTypeError, ShapeError, InvalidArgumentError, expected
    cdef cnp.ndarray a
    if isinstance(obj, cnp.ndarray):
        a = <cnp.ndarray>obj
        if cnp.PyArray_TYPE(a) != typenum:
            raise DTypeError(expected(name, f"a 1-D {kind} array", _describe(obj)))
    elif isinstance(obj, (list, tuple, range)):
        try:
            a = np.asarray(obj)
        except (ValueError, TypeError):
            raise ShapeError(expected(name, "a flat sequence of ints", "a ragged sequence"))
        if a.size == 0:
            a = np.empty(0, dtype=np.int32 if typenum == cnp.NPY_INT32 else np.int64)
        elif a.dtype.kind not in "iu":
            raise DTypeError(expected(name, f"a sequence of ints fitting {kind}", f"{a.dtype} values"))
        if cnp.PyArray_NDIM(a) != 1:
            raise ShapeError(expected(name, "a flat sequence of ints", f"nested sequence of shape {np.shape(a)}"))
        lo, hi = (-2**31, 2**31 - 1) if typenum == cnp.NPY_INT32 else (-2**63, 2**63 - 1)
        if a.size and (int(a.min()) < lo or int(a.max()) > hi):
            raise InvalidArgumentError(expected(name, f"ints fitting {kind}", "an out-of-range int"))
        a = a.astype(np.int32 if typenum == cnp.NPY_INT32 else np.int64)
    else:
        try:
            a = np.asarray(obj)
        except Exception:
            raise DTypeError(expected(name, f"a 1-D {kind} array or a list of ints", _describe(obj)))
        if cnp.PyArray_TYPE(a) != typenum:
            raise DTypeError(expected(name, f"a 1-D {kind} array", _describe(obj)))
    if cnp.PyArray_NDIM(a) != 1:
        raise ShapeError(expected(name, f"a 1-D {kind} array", _describe(a)))
    if not cnp.PyArray_IS_C_CONTIGUOUS(a):
        a = np.ascontiguousarray(a)
    return a


cdef inline cnp.ndarray as_i32(object obj, str name):
    """A C-contiguous 1-D int32 view of obj; int32 arrays pass through without a copy."""
    cdef cnp.ndarray a
    if type(obj) is cnp.ndarray:
        a = <cnp.ndarray>obj
        if (cnp.PyArray_TYPE(a) == cnp.NPY_INT32 and cnp.PyArray_NDIM(a) == 1
                and cnp.PyArray_IS_C_CONTIGUOUS(a)):
            return a
    return _coerce(obj, name, cnp.NPY_INT32, "int32")


cdef inline cnp.ndarray as_i64(object obj, str name):
    """A C-contiguous 1-D int64 view of obj; int64 arrays pass through without a copy."""
    cdef cnp.ndarray a
    if type(obj) is cnp.ndarray:
        a = <cnp.ndarray>obj
        if (cnp.PyArray_TYPE(a) == cnp.NPY_INT64 and cnp.PyArray_NDIM(a) == 1
                and cnp.PyArray_IS_C_CONTIGUOUS(a)):
            return a
    return _coerce(obj, name, cnp.NPY_INT64, "int64")


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
