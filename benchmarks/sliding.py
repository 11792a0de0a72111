"""Sliding-window bookkeeping: a long token stream through a sliding layer group
(window 4,096 tokens, 4 sink tokens, blocks of 16) holds constant blocks. Prints one
JSON object per line and figure: ns per token and peak blocks held.

Baselines, in the same process and on the same stream:

- the same core (``BlockTables``) as a full-attention group, which keeps every block
  (its pool is sized for the whole stream);
- the pure-Python model of the core (:mod:`pagedkv.testing.core_model`) with the same
  window, on a shorter stream (reported per token);
- the manager (``PagedKVCache``, bookkeeping only) with 4 layers alternating sliding
  and full attention (two layer groups: the full group still grows with the stream, but
  a block holds 2 layers instead of 4) against the same model with full attention
  everywhere (one group).

Every timing is the median of ``--repeats`` runs after a warm-up run. Peak blocks come
from a separate run that reads the pool after every step.

Usage: ``python benchmarks/sliding.py [--smoke] [--tokens N] [--repeats N]``.
"""
from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # idle BLAS threads spin and skew timings

import argparse

import numpy as np

from pagedkv import CacheConfig, PagedKVCache
from pagedkv._core.pool import BlockPool
from pagedkv._core.prefix import PrefixIndex
from pagedkv._core.tables import BlockTables
from pagedkv.testing.core_model import PyBlockPool, PyTables

from core import emit, median_of as median_ns  # benchmarks/core.py: one JSON line, median after a warm-up

BS, WINDOW, SINKS = 16, 4096, 4


def core_tables(tokens, window, sinks):
    # a full-attention group keeps every block: size its pool for the stream
    blocks = 1024 if window else tokens // BS + 64
    index = PrefixIndex(BS, blocks)
    pool = BlockPool(blocks, "lru", index=index)
    return pool, BlockTables(pool, BS, index, window=window, sinks=sinks)


def stream_core(tokens, window, sinks, watch=False):
    """Decode ``tokens`` steps of one sequence (``advance``: commit the previous token,
    reserve the next); returns the peak blocks in use when ``watch``."""
    pool, t = core_tables(tokens, window, sinks)
    ids = np.array([7], np.int32)
    t.add(1)
    peak = 0
    advance = t.advance
    if watch:
        for _ in range(tokens):
            advance(1, ids)
            peak = max(peak, pool.num_in_use_blocks)
    else:
        for _ in range(tokens):
            advance(1, ids)
    t.remove(1)
    return peak


def stream_model(tokens, window, sinks):
    pool = PyBlockPool(1024)
    t = PyTables(pool, BS, window=window, sinks=sinks)
    t.add(1)
    for _ in range(tokens):
        t.advance([1], [7])
    t.remove([1])


def stream_manager(tokens, windows, watch=False):
    cfg = CacheConfig(num_layers=4, num_kv_heads=8, head_dim=128, block_size=BS, dtype="float16",
                      num_blocks=tokens // BS + 64 + (2 * WINDOW // BS if any(windows) else 0),
                      layer_windows=tuple(windows) if any(windows) else None)
    kv = PagedKVCache(cfg, allocate_store=False)
    ids = np.array([7], np.int32)
    key = np.array([1], np.int64)
    kv.add_sequence(1)
    peak = 0
    for _ in range(tokens):
        kv.advance(key, ids)
        if watch:
            peak = max(peak, kv.pool.num_in_use_blocks)
    kv.free(1)
    return peak, cfg


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CI)")
    ap.add_argument("--tokens", type=int, default=1_000_000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    if args.smoke:
        args.tokens, args.repeats = 20_000, 1
    n = args.tokens

    for window, sinks, label in ((WINDOW, SINKS, "sliding"), (0, 0, "full-attention baseline")):
        ns = median_ns(lambda: stream_core(n, window, sinks), args.repeats)
        peak = stream_core(n, window, sinks, watch=True)
        emit(bench="sliding-stream", impl="pagedkv.BlockTables", group=label, window=window, sinks=sinks,
             block_size=BS, tokens=n, ns_per_token=round(ns / n, 2), peak_blocks=peak)

    m = max(n // 20, 1000)
    ns = median_ns(lambda: stream_model(m, WINDOW, SINKS), 1)
    emit(bench="sliding-stream", impl="pure-Python model (core_model.PyTables)", group="sliding", window=WINDOW,
         sinks=SINKS, block_size=BS, tokens=m, ns_per_token=round(ns / m, 2))

    for windows, label in (((WINDOW, 0, WINDOW, 0), "2 groups: sliding + full"), ((0, 0, 0, 0), "1 group: full")):
        ns = median_ns(lambda: stream_manager(n, windows), args.repeats)
        peak, cfg = stream_manager(n, windows, watch=True)
        emit(bench="sliding-manager", impl="pagedkv.PagedKVCache (bookkeeping only)", layers=label,
             tokens=n, ns_per_token=round(ns / n, 2), peak_blocks=peak, bytes_per_block=cfg.bytes_per_block,
             peak_bytes=peak * cfg.bytes_per_block)


if __name__ == "__main__":
    main()
