/* How many threads a parallel loop may take (docs/threads.md).
 *
 * A fork-join loop is only as fast as its slowest thread: on a machine with no idle core
 * a woken worker waits for a time slice (milliseconds) while the caller waits for it at
 * the loop's closing barrier, so a 20 us gather took 30-80 ms with 2 threads at a load
 * of 8 on 2 cores (benchmarks/contention.py). Under the automatic setting a loop therefore
 * takes extra threads only for cores that are idle now: the kernel's count of runnable
 * tasks (the 4th field of /proc/loadavg, this thread included), read at most every 10 ms.
 * Where that count cannot be read, loops stay serial.
 *
 * Included by _threads.pyx alone: the other extensions cimport its decision (_threads.pxd),
 * so the setting and the cached reading below exist once per process. */
#ifndef PAGEDKV_OMP_POLICY_H
#define PAGEDKV_OMP_POLICY_H
#include <stdio.h>
#include <time.h>
#include <unistd.h>

static long long pkv_runnable_at_ns = -1;   /* when pkv_runnable was read (CLOCK_MONOTONIC) */
static long pkv_runnable = 1 << 30;          /* runnable tasks then (huge: unknown) */
static long pkv_runnable_override = -1;      /* tests: >= 0 replaces the reading */
static long pkv_online_cpus = 0;

static inline long pkv_runnable_tasks(void) {
    long forced = __atomic_load_n(&pkv_runnable_override, __ATOMIC_RELAXED);
    if (forced >= 0) return forced;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    long long now = (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
    long long at = __atomic_load_n(&pkv_runnable_at_ns, __ATOMIC_RELAXED);
    if (at >= 0 && now - at < 10000000LL) return __atomic_load_n(&pkv_runnable, __ATOMIC_RELAXED);
    long running = 1 << 30;
    FILE* f = fopen("/proc/loadavg", "r");
    if (f != NULL) {
        double a, b, c;
        long r, total;
        if (fscanf(f, "%lf %lf %lf %ld/%ld", &a, &b, &c, &r, &total) == 5 && r > 0) running = r;
        fclose(f);
    }
    __atomic_store_n(&pkv_runnable, running, __ATOMIC_RELAXED);
    __atomic_store_n(&pkv_runnable_at_ns, now, __ATOMIC_RELAXED);
    return running;
}

/* threads for `parts` threshold-sized pieces of work: `setting` > 0 is the caller's
   explicit count; 0 follows `omp_max` (torch's count), capped by the idle cores */
static inline int pkv_threads(long long parts, int setting, int omp_max) {
    if (parts < 2) return 1;
    long n = setting > 0 ? setting : omp_max;
    if (n > parts) n = (long)parts;
    if (n < 2) return 1;
    if (setting > 0) return (int)n;
    if (pkv_online_cpus <= 0) pkv_online_cpus = sysconf(_SC_NPROCESSORS_ONLN);
    long idle = pkv_online_cpus - (pkv_runnable_tasks() - 1);   /* cores besides this thread's */
    if (n > idle) n = idle;
    return n < 2 ? 1 : (int)n;
}
#endif
