# The thread policy of pagedkv's CPU loops (docs/threads.md, omp_policy.h), declared once:
# every extension of pagedkv.ops cimports these, so pagedkv.set_num_threads reaches them all
# and the policy's state (the setting, the cached load reading) exists once per process.

# Threads for `parts` pieces of work, each piece the caller's serial threshold: 1 below two
# pieces; else at most one per piece, up to pagedkv's setting (> 0) or OpenMP's max
# (setting 0, torch's count), which the automatic setting caps by the cores idle now.
cdef int threads_for(long long parts) noexcept nogil

# The thread count a large call plans for: the setting when > 0, else OpenMP's max;
# never capped by the load (what a result may depend on; threads_for is what runs).
cdef int configured_threads() noexcept nogil
