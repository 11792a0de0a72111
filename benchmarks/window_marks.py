"""What keeping up to ``kv_window_sequences`` windows exact costs the per-step calls
(issue 32): a reservation tells the window arena which blocks a read will want exact
(``Lifecycle.window_marks``), a commit marks the blocks that left a window
(``Lifecycle.left_window``), and a write claims slots only for the warm blocks.

Figures, ns per step, each against a same-process baseline with the marks stubbed out
(the claims of the previous design: every written block takes a slot):

- ``decode``: B int4 sequences (``kv_window=128``, 4 sink tokens, blocks of 16) reserve
  one token each and commit it (the bookkeeping the marks add to; the write, whose
  window claims are unchanged for a decode token, is left out: it costs ~1.5 ms for 4
  layers here and would hide the difference in this machine's noise);
- ``prefill``: one sequence reserves, writes and commits a 512-token prompt (the path
  that marks cold blocks and the blocks leaving the previous window).

Prints one JSON object per figure. Usage: ``python benchmarks/window_marks.py [--smoke]
[--repeats N] [--batch B]``.
"""
from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # idle BLAS threads spin and skew timings

import argparse
import warnings

import torch

from pagedkv import CacheConfig, PagedKVCache
from pagedkv.manager.lifecycle import Lifecycle

from core import emit, median_of  # benchmarks/core.py: one JSON line, median after a warm-up

L, H, D, BS = 4, 2, 64, 16


def make(batch: int, blocks: int) -> PagedKVCache:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return PagedKVCache(CacheConfig(num_layers=L, num_kv_heads=H, head_dim=D, block_size=BS, num_blocks=blocks,
                                        dtype="float32", kv_dtype="int4", kv_window=128, kv_sink_tokens=4,
                                        kv_window_sequences=max(batch, 1)))


def decode_step(cache, ids):
    cache.reserve(ids, 1)
    cache.commit(ids, 1)


def run_decode(batch: int, steps: int, repeats: int) -> float:
    cache = make(batch, batch * (steps // BS + 4) + 64)
    ids = list(range(batch))

    def run():
        for i in ids:
            cache.add_sequence(i, None)
        for _ in range(steps):
            decode_step(cache, ids)
        cache.free(ids)                        # every repeat does the same work

    return median_of(run, repeats) / steps


def run_prefill(tokens: int, repeats: int) -> float:
    cache = make(1, tokens // BS * 2 + 64)
    kv = (torch.randn(tokens, H, D), torch.randn(tokens, H, D))

    def run():
        cache.add_sequence(0, None)
        slots = cache.reserve(0, tokens)
        for layer in range(L):
            cache.write(layer, slots, *kv)
        cache.commit(0, tokens)
        cache.free(0)

    return median_of(run, repeats)


def stubbed(fn, *args):
    """``fn(*args)`` with the window marks turned off (the baseline)."""
    saved = Lifecycle.window_marks, Lifecycle.left_window
    Lifecycle.window_marks = Lifecycle.left_window = lambda self, *a: None
    try:
        return fn(*args)
    finally:
        Lifecycle.window_marks, Lifecycle.left_window = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(1)
    steps, tokens, repeats = (32, 128, 1) if args.smoke else (1024, 512, args.repeats)
    for name, fn, a in (("decode", run_decode, (args.batch, steps, repeats)), ("prefill", run_prefill, (tokens, repeats))):
        base = stubbed(fn, *a)
        marked = fn(*a)
        emit(benchmark="window_marks", case=name, batch=args.batch if name == "decode" else 1,
             ns_per_step=round(marked), baseline_ns_per_step=round(base), ratio=round(marked / base, 3))


if __name__ == "__main__":
    main()
