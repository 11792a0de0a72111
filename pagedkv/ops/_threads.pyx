# cython: language_level=3
# distutils: extra_compile_args = -fopenmp
# distutils: extra_link_args = -fopenmp
"""The thread policy of pagedkv's CPU loops (docs/threads.md; the decision is omp_policy.h's).

The copy, quantization and attention loops (``_cpu_copy``, ``_cpu_quant``,
``_cpu_attention``) cimport :func:`threads_for` from here (``_threads.pxd``): one setting,
one policy, one cached reading of the machine's load. ``pagedkv.set_num_threads`` sets it.
"""
cimport openmp

cdef extern from "omp_policy.h":
    int pkv_threads(long long parts, int setting, int omp_max) noexcept nogil
    long pkv_runnable_override

# pagedkv's own thread count (pagedkv.set_num_threads / PAGEDKV_NUM_THREADS); 0: follow
# OpenMP's max (torch.set_num_threads, OMP_NUM_THREADS), capped by the idle cores
cdef int _setting = 0


cdef int threads_for(long long parts) noexcept nogil:
    return pkv_threads(parts, _setting, openmp.omp_get_max_threads())


cdef int configured_threads() noexcept nogil:
    return _setting if _setting > 0 else openmp.omp_get_max_threads()


def set_num_threads(int n):
    """pagedkv's thread count for every CPU loop (0: follow OpenMP's max, i.e. torch's)."""
    global _setting
    _setting = n if n > 0 else 0


def get_num_threads():
    """pagedkv's own setting (0: following OpenMP's max)."""
    return _setting


def max_threads():
    """Threads a large call plans for (the setting, else OpenMP's max, which torch.set_num_threads sets)."""
    return configured_threads()


def planned_threads(long long parts):
    """Threads a call of ``parts`` threshold-sized pieces would take now."""
    return threads_for(parts)


def _pretend_runnable(long n):
    """Tests: pretend the kernel reports ``n`` runnable tasks (-1: read /proc/loadavg)."""
    global pkv_runnable_override
    pkv_runnable_override = n
