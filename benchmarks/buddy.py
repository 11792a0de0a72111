"""Contiguous mode: allocate+free of one run on a fragmented pool, buddy vs first fit.

Both allocators start from the same fragmented state: runs of 1-64 blocks fill the
pool, then every other run is freed. Each op allocates a run of ``--run`` blocks and
frees it again. The baseline, run in the same process, is seed 002's first-fit bitmap
(:class:`pagedkv.compat.cortex.KVBlockAllocator`, a scan of the whole bitmap per
allocation); the buddy allocator is :class:`pagedkv.manager.buddy.BuddyAllocator` over a
:class:`~pagedkv._core.pool.BlockPool` (the pool's reference counts included).

Prints one JSON line per figure (ns per allocate+free, median of ``--repeats``).
Usage: ``python benchmarks/buddy.py [--smoke] [--blocks N] [--run N] [--ops N]``.
"""
from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import json
import statistics
import time

import numpy as np

from pagedkv._core.pool import BlockPool
from pagedkv.manager.buddy import BuddyAllocator
from pagedkv.compat.cortex import KVBlockAllocator


def emit(**fields):
    print(json.dumps(fields), flush=True)


def fragment(alloc, free, total, rng):
    """Fill with runs of 1-64 blocks until one no longer fits, then free every other."""
    held = []
    used = 0
    while True:
        n = int(rng.integers(1, 65))
        if used + 2 * n > total:
            break
        try:
            held.append(alloc(n))
        except MemoryError:
            break
        used += n
    for h in held[::2]:
        free(h)
    return held[1::2]


def per_op(alloc, free, run, ops, repeats):
    def once():
        for _ in range(ops):
            free(alloc(run))
    once()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        once()
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / ops


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, seconds")
    ap.add_argument("--blocks", type=int, default=262_144)
    ap.add_argument("--run", type=int, default=16, help="blocks per allocation")
    ap.add_argument("--ops", type=int, default=2000)
    ap.add_argument("--baseline-ops", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    if a.smoke:
        a.blocks, a.ops, a.baseline_ops, a.repeats = 4096, 200, 20, 2

    pool = BlockPool(a.blocks)
    buddy = BuddyAllocator(pool)
    kept = fragment(buddy.allocate, buddy.free, a.blocks, np.random.default_rng(0))
    ns = per_op(buddy.allocate, buddy.free, a.run, a.ops, a.repeats)
    emit(bench="buddy_allocate_free", impl="BuddyAllocator", blocks=a.blocks, run_blocks=a.run,
         live_runs=len(kept), ns_per_op=round(ns, 1))

    ff = KVBlockAllocator(a.blocks)

    def ff_alloc(n):
        h = ff.allocate(n)
        if not h.is_valid:
            raise MemoryError
        return h
    kept_ff = fragment(ff_alloc, ff.free, a.blocks, np.random.default_rng(0))
    base = per_op(ff_alloc, ff.free, a.run, a.baseline_ops, a.repeats)
    emit(bench="buddy_allocate_free", impl="first_fit_bitmap (seed 002, baseline)", blocks=a.blocks,
         run_blocks=a.run, live_runs=len(kept_ff), ns_per_op=round(base, 1), speedup=round(base / ns, 1))
    for s in kept:
        buddy.free(s)
    if pool.num_free_blocks != a.blocks:
        raise SystemExit(f"buddy leaked {a.blocks - pool.num_free_blocks} blocks")


if __name__ == "__main__":
    main()
