"""Bookkeeping microbenchmarks: W1 allocate/free, W2 decode churn, W3 shared-prompt
admission, and block hashing. Prints one JSON object per line and figure.

Every figure is the median of ``--repeats`` runs after a warm-up run, and each is
compared with a baseline measured in the same process:

- W1: a plain-Python ``deque`` allocator, and the pure-Python model of the core
  (:mod:`pagedkv.testing.core_model`), driven by the same loop;
- W2/W3: the pure-Python model (pool + tables + content-keyed prefix index) on the
  same operation trace (at a reduced size, reported per op);
- hashing: Python's ``hashlib.sha256`` over the same token bytes (what vLLM's
  default prefix hash does).

- exports: CSR/padded block tables of 256 sequences against the same CSR built in
  numpy from Python lists;
- eviction: allocation from a pool of cached blocks against one of clean blocks.

Usage: ``python benchmarks/core.py [--smoke] [--repeats N] [--only W1,W2,W3,export,evict,hash]``.
"""
from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # idle BLAS threads spin and skew timings

import argparse
import hashlib
import json
import statistics
import time
from collections import deque

import numpy as np

from pagedkv import CacheConfig, PagedKVCache
from pagedkv._core.pool import BlockPool
from pagedkv._core.prefix import PrefixIndex
from pagedkv.testing.core_model import PyBlockPool, PyTables


def emit(**fields):
    print(json.dumps(fields), flush=True)


def median_of(fn, repeats):
    fn()  # warm-up
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        fn()
        runs.append(time.perf_counter_ns() - t0)
    return statistics.median(runs)


# ---- W1 ---------------------------------------------------------------------------------
class DequeAllocator:
    """The plain-Python baseline: a deque of free ids and a ref-count list."""

    def __init__(self, n):
        self.free_ids = deque(range(n))
        self.ref = [0] * n

    def allocate(self, n):
        if n > len(self.free_ids):
            raise MemoryError
        out = [self.free_ids.popleft() for _ in range(n)]
        for b in out:
            self.ref[b] = 1
        return out

    def free(self, ids):
        for b in ids:
            self.ref[b] -= 1
            if not self.ref[b]:
                self.free_ids.appendleft(b)


def w1_loop(pool, seqs, per_seq, tail_first=False):
    def run():
        alloc, free = pool.allocate, pool.free
        for _ in range(seqs):
            free(alloc(per_seq))

    def run_tail_first():
        # vLLM frees a sequence's blocks tail first, so the shared head blocks stay
        # cached longest: a reversed (negative-stride) view of the allocation.
        alloc, free = pool.allocate, pool.free
        for _ in range(seqs):
            free(alloc(per_seq)[::-1])
    return run_tail_first if tail_first else run


def w1(args):
    blocks, per_seq = 65536, 32
    seqs = 2000 if args.smoke else 200_000
    ns = median_of(w1_loop(BlockPool(blocks), seqs, per_seq), args.repeats)
    per_block = ns / (seqs * per_seq)
    base = median_of(w1_loop(DequeAllocator(blocks), seqs, per_seq), args.repeats)
    emit(bench="W1", impl="pagedkv.BlockPool", api="allocate(32)+free per sequence", blocks=blocks,
         sequences=seqs, ns_per_block=round(per_block, 2), bar_ns=10.0, **{"pass": per_block <= 10.0})
    emit(bench="W1", impl="python-deque", sequences=seqs, ns_per_block=round(base / (seqs * per_seq), 2),
         ratio_vs_pagedkv=round(base / ns, 1))

    nst = median_of(w1_loop(BlockPool(blocks), seqs, per_seq, tail_first=True), args.repeats)
    pt = nst / (seqs * per_seq)
    baset = median_of(w1_loop(DequeAllocator(blocks), seqs, per_seq, tail_first=True), args.repeats)
    emit(bench="W1", impl="pagedkv.BlockPool", api="allocate(32)+free(ids[::-1]) per sequence (tail first)",
         blocks=blocks, sequences=seqs, ns_per_block=round(pt, 2), bar_ns=10.0, **{"pass": pt <= 10.0},
         deque_ns_per_block=round(baset / (seqs * per_seq), 2), ratio_vs_deque=round(baset / nst, 1))

    # The engine's shape: one crossing per scheduler step for 256 sequences.
    batch = 256
    steps = max(1, seqs // batch)
    pool = BlockPool(blocks)
    counts = np.full(batch, per_seq, dtype=np.int32)

    def batched():
        alloc, free = pool.allocate_many, pool.free
        for _ in range(steps):
            free(alloc(counts)[1])
    nsb = median_of(batched, args.repeats)
    pb = nsb / (steps * batch * per_seq)
    emit(bench="W1", impl="pagedkv.BlockPool", api="allocate_many(256 x 32)+free per step", blocks=blocks,
         sequences=steps * batch, ns_per_block=round(pb, 2), bar_ns=10.0, **{"pass": pb <= 10.0})


# ---- W2 ---------------------------------------------------------------------------------
def w2_trace(seed, live, steps):
    """The request stream: (prompt tokens, output length) drawn up front, so that the
    timed loop measures bookkeeping, not the random number generator."""
    rng = np.random.default_rng(seed)
    n = live + live * steps // 256 + 64        # mean output 512: ~live/512 finish per step
    lens = rng.integers(64, 2049, n)
    outs = rng.geometric(1 / 512, n)
    # prompts are windows of one long random stream at distinct-ish offsets, so they
    # share no prefix (no accidental cache hits), without drawing n fresh prompts
    pool = rng.integers(0, 32000, 1 << 22, dtype=np.int32)
    starts = rng.integers(0, (1 << 22) - 2048, n)
    state = {"i": 0}

    def new_request():
        i = state["i"] % n
        state["i"] += 1
        return pool[starts[i]:starts[i] + lens[i]], int(outs[i])
    return rng, new_request


def w2_schedule(live, steps, seed):
    """The whole W2 trace, drawn before timing: the requests (prompt, output length) and,
    per step, which live slots finish. The timed loop then only calls pagedkv."""
    _, new_request = w2_trace(seed, live, steps)
    requests, finishing = [], []
    remaining = np.zeros(live, dtype=np.int64)
    for s in range(live):
        requests.append(new_request())
        remaining[s] = requests[-1][1]
    for _ in range(steps):
        remaining -= 1
        done = np.flatnonzero(remaining <= 0)
        finishing.append(done)
        for slot in done.tolist():
            requests.append(new_request())
            remaining[slot] = requests[-1][1]
    return requests, finishing


def w2_workload(live, steps, seed=0):
    """The W2 schedule plus the decode tokens: ``tokens[step, slot]`` is the token whose KV
    the sequence in ``slot`` appends at ``step``. benchmarks/vs_vllm.py feeds the same
    workload to vLLM."""
    requests, finishing = w2_schedule(live, steps, seed)
    tokens = np.random.default_rng(seed + 1).integers(0, 32000, (steps, live), dtype=np.int32)
    return requests, finishing, tokens


def w2_run_pagedkv(prefix, live, steps, seed=0, fused=True, workload=None, keep=False):
    """ns per token-step and the stats; with ``keep``, also the cache and the live ids
    (the caller frees them)."""
    cfg = CacheConfig(num_layers=1, num_kv_heads=1, head_dim=8, block_size=16, num_blocks=65536,
                      enable_prefix_caching=prefix)
    cache = PagedKVCache(cfg, allocate_store=False)
    requests, finishing, tokens = workload if workload is not None else w2_workload(live, steps, seed)
    ids = np.arange(live, dtype=np.int64)
    nxt = iter(range(len(requests)))

    def admit(slot):
        r = next(nxt)
        prompt = requests[r][0]
        cached = cache.add_sequence(r, prompt)
        cache.reserve(r, len(prompt) - cached)
        cache.commit(r, len(prompt) - cached)
        ids[slot] = r

    for s in range(live):
        admit(s)
    t0 = time.perf_counter_ns()
    for step in range(steps):
        if fused:
            cache.advance(ids, tokens[step])
        else:
            cache.reserve(ids, 1)
            cache.commit(ids, 1, tokens[step])
        done = finishing[step]
        if done.size:
            cache.free(ids[done])
            for slot in done.tolist():
                admit(slot)
    dt = time.perf_counter_ns() - t0
    cache.check_invariants()
    if keep:
        return dt / (steps * live), cache.stats(), cache, ids
    return dt / (steps * live), cache.stats()


def w2_run_model(prefix, live, steps, seed=0):
    pool = PyBlockPool(65536)
    tables = PyTables(pool, 16, prefix=prefix)
    rng, new_request = w2_trace(seed, live, steps)
    ids = list(range(live))
    remaining = [0] * live
    next_id = [live]

    def admit(slot):
        prompt, out = new_request()
        prompt = prompt.tolist()
        plen = len(prompt)
        sid = next_id[0]
        next_id[0] += 1
        cached = tables.add(sid, prompt)
        tables.reserve([sid], plen - cached)
        tables.commit([sid], plen - cached)
        ids[slot] = sid
        remaining[slot] = out

    for s in range(live):
        admit(s)
    tokens = rng.integers(0, 32000, (steps, live)).tolist()
    t0 = time.perf_counter_ns()
    for step in range(steps):
        tables.reserve(ids, 1)
        tables.commit(ids, 1, tokens[step])
        for slot in range(live):
            remaining[slot] -= 1
            if remaining[slot] <= 0:
                tables.remove([ids[slot]])
                admit(slot)
    return (time.perf_counter_ns() - t0) / (steps * live)


def w2(args):
    live = 256
    steps = 200 if args.smoke else 20_000
    for (prefix, bar), fused in [((False, 20.0), True), ((False, 20.0), False), ((True, 60.0), True), ((True, 60.0), False)]:
        runs = [w2_run_pagedkv(prefix, live, steps, seed=0, fused=fused) for _ in range(max(1, args.repeats // 2))]
        ns = statistics.median(r[0] for r in runs)
        st = runs[-1][1]
        model_steps = max(20, steps // 100)
        model = w2_run_model(prefix, live, model_steps)
        emit(bench="W2", api="advance(ids, tokens)" if fused else "reserve(ids, 1) + commit(ids, 1, tokens)",
             prefix_caching=prefix, live_sequences=live, steps=steps,
             ns_per_token_step=round(ns, 2), bar_ns=bar, **{"pass": ns <= bar},
             model_ns_per_token_step=round(model, 1), ratio_vs_model=round(model / ns, 1),
             evictions=st.eviction_count, allocations=st.allocation_count)


# ---- W3 ---------------------------------------------------------------------------------
def w3_prompts(requests):
    """A 1,024-token system prompt shared by every request, then 256 unique tokens."""
    system = np.arange(1024, dtype=np.int32) + 5
    rng = np.random.default_rng(3)
    uniques = [rng.integers(2000, 30000, 256, dtype=np.int32) for _ in range(requests)]
    return [np.concatenate([system, u]) for u in uniques]


def w3_run_pagedkv(prompts, num_blocks=8192):
    """Admit each prompt (prefix lookup, reserve, commit) and free it; (ns, stats)."""
    cfg = CacheConfig(num_layers=1, num_kv_heads=1, head_dim=8, block_size=16, num_blocks=num_blocks)
    cache = PagedKVCache(cfg, allocate_store=False)
    t0 = time.perf_counter_ns()
    for i, p in enumerate(prompts):
        cached = cache.add_sequence(i, p)
        cache.reserve(i, len(p) - cached)
        cache.commit(i, len(p) - cached)
        cache.free(i)
    return time.perf_counter_ns() - t0, cache.stats()


def w3(args):
    requests = 50 if args.smoke else 1000
    prompts = w3_prompts(requests)

    def run_pagedkv():
        return w3_run_pagedkv(prompts)

    run_pagedkv()
    runs = [run_pagedkv() for _ in range(args.repeats)]
    ns = statistics.median(r[0] for r in runs)
    st = runs[-1][1]
    us = ns / requests / 1000

    def run_model():
        tables = PyTables(PyBlockPool(8192), 16)
        lists = [p.tolist() for p in prompts]
        t0 = time.perf_counter_ns()
        for i, p in enumerate(lists):
            cached = tables.add(i, p)
            tables.reserve([i], len(p) - cached)
            tables.commit([i], len(p) - cached)
            tables.remove([i])
        return time.perf_counter_ns() - t0
    model_us = run_model() / requests / 1000
    emit(bench="W3", requests=requests, prompt_tokens=1280, shared_prefix=1024, us_per_request=round(us, 2),
         hit_rate=round(st.hit_rate, 4), bar_us=10.0, **{"pass": us <= 10.0},
         model_us_per_request=round(model_us, 1), ratio_vs_model=round(model_us / us, 1))


# ---- exports ----------------------------------------------------------------------------
def exports(args):
    """Block-table exports an attention kernel plans from, for a decode batch of 256
    sequences (the size FlashInfer's ``plan()`` figure is quoted at). Host-only numpy
    output: nothing waits on a device."""
    batch, blocks_per_seq = 256, (8 if args.smoke else 64)
    cfg = CacheConfig(num_layers=1, num_kv_heads=1, head_dim=8, block_size=16,
                      num_blocks=batch * blocks_per_seq + 16)
    cache = PagedKVCache(cfg, allocate_store=False)
    ids = list(range(batch))
    for i in ids:
        cache.add_sequence(i)
    lens = np.random.default_rng(5).integers(16 * (blocks_per_seq - 1), 16 * blocks_per_seq, batch)
    cache.reserve(ids, lens)
    cache.commit(ids, lens)
    reps = 20 if args.smoke else 2000
    arr = np.arange(batch, dtype=np.int64)

    def timed(fn):
        def run():
            for _ in range(reps):
                fn()
        return median_of(run, args.repeats) / reps / 1000

    csr = timed(lambda: cache.page_table_csr(arr))
    padded = timed(lambda: cache.block_tables(arr))
    lens_us = timed(lambda: cache.seq_lens(arr))
    # Baseline in the same process: the same CSR built in numpy from per-sequence tables
    # an engine keeps as Python lists (what a Python block manager would hand over).
    tables = [cache.block_table(i).tolist() for i in ids]

    def py_csr():
        indptr = np.zeros(batch + 1, np.int32)
        np.cumsum([len(t) for t in tables], out=indptr[1:])
        indices = np.fromiter((b for t in tables for b in t), np.int32, int(indptr[-1]))
        return indptr, indices
    base = timed(py_csr)
    cache.free(ids)
    for api, us in (("page_table_csr", csr), ("block_tables (padded)", padded), ("seq_lens", lens_us)):
        emit(bench="export", api=api, sequences=batch, blocks_per_sequence=blocks_per_seq,
             us_per_call=round(us, 2), bar_us=20.0, **{"pass": us <= 20.0},
             python_csr_us=round(base, 1), ratio_vs_python=round(base / us, 1),
             flashinfer_plan_us_quoted=87.0)


# ---- eviction -----------------------------------------------------------------------------
def eviction(args):
    """Cost of reclaiming a cached (evictable) block: allocating from a pool whose free
    blocks all hold registered prefixes, minus allocating from a pool of clean blocks."""
    blocks, per_seq = (4096 if args.smoke else 65536), 32
    prompts = blocks // per_seq

    def filled(prefix):
        cfg = CacheConfig(num_layers=1, num_kv_heads=1, head_dim=8, block_size=16, num_blocks=blocks,
                          enable_prefix_caching=prefix)
        cache = PagedKVCache(cfg, allocate_store=False)
        base = np.arange(per_seq * 16, dtype=np.int32)
        for i in range(prompts):   # distinct full prompts, freed: every block cached and evictable
            cache.add_sequence(i, base + i * 100_000)
            cache.reserve(i, per_seq * 16)
            cache.commit(i, per_seq * 16)
            cache.free(i)
        return cache

    def reclaim(prefix):
        runs = []
        for _ in range(args.repeats + 1):
            cache = filled(prefix)
            pool = cache.tables.pool   # the core pool itself: this measures the core, not the manager
            t0 = time.perf_counter_ns()
            got = [pool.allocate(per_seq) for _ in range(prompts)]
            runs.append(time.perf_counter_ns() - t0)
            for g in got:
                pool.free(g)
            evicted = cache.stats().eviction_count
        return statistics.median(runs[1:]) / blocks, evicted

    with_ns, evicted = reclaim(True)
    clean_ns, _ = reclaim(False)
    per_block = max(with_ns - clean_ns, 0.0)
    emit(bench="eviction", blocks=blocks, evicted=evicted, ns_per_block_allocate_evicting=round(with_ns, 2),
         ns_per_block_allocate_clean=round(clean_ns, 2), eviction_ns_per_block=round(per_block, 2),
         bar_ns=1000.0, **{"pass": per_block <= 1000.0})


# ---- hashing ----------------------------------------------------------------------------
def hashing(args):
    n_tokens = 1 << (16 if args.smoke else 22)
    tokens = np.random.default_rng(0).integers(0, 150000, n_tokens, dtype=np.int32)
    index = PrefixIndex(16, 1, hash_seed=1)
    ns = median_of(lambda: index.hash_tokens(tokens), args.repeats)
    rate = n_tokens / (ns / 1e9)
    raw = tokens.tobytes()
    sub = raw[: len(raw) // 16]

    def sha():
        parent = b""
        for i in range(0, len(sub), 64):
            parent = hashlib.sha256(parent + sub[i:i + 64]).digest()
    ns_sha = median_of(sha, max(1, args.repeats // 2))
    sha_rate = (len(sub) // 4) / (ns_sha / 1e9)
    emit(bench="hash", impl="pagedkv chained block hash (16-token blocks)", tokens=n_tokens,
         tokens_per_s=round(rate), bar_tokens_per_s=300e6, **{"pass": rate >= 300e6})
    emit(bench="hash", impl="hashlib.sha256 chained (same blocks)", tokens=len(sub) // 4,
         tokens_per_s=round(sha_rate), ratio_vs_pagedkv=round(rate / sha_rate, 1))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CI)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--only", default="W1,W2,W3,export,evict,hash")
    args = ap.parse_args(argv)
    if args.smoke:
        args.repeats = min(args.repeats, 2)
    todo = {"W1": w1, "W2": w2, "W3": w3, "export": exports, "evict": eviction, "hash": hashing}
    for name in args.only.split(","):
        todo[name](args)


if __name__ == "__main__":
    main()
