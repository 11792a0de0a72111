"""Bookkeeping overhead of chunked prefill: a 200k-token prompt, Qwen3-0.6B shape.

The cache is bookkeeping-only (``allocate_store=False``: no arena) and the forward
step does nothing, so the figures are the driver's and the manager's own cost per
chunk and per token (policy, reserve, slot mapping, commit with prefix-block
hashing, progress snapshot). Prints one JSON object per line:

- ``prefill_bookkeeping``: one figure per chunk policy (fixed 512, the default
  512-2048, a memory-aware policy with a probe) and prefix caching on/off. Median
  of ``--repeats`` runs on a fresh cache: ``ns_per_chunk``, ``ns_per_token``, and the
  blocks and KV bytes the sequence ends with next to what the planner reports.
- ``manager_floor``: the same reserve / slot_mapping / commit calls made directly on
  the cache, without the driver (``driver_overhead_ns_per_chunk`` is the difference).
- ``kv_plan``: the planner's bytes for the full context in bf16 and fp8.

Usage: ``python benchmarks/prefill.py [--smoke] [--tokens N] [--repeats N]``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable, Dict, List

import numpy as np

from pagedkv import CacheConfig, PagedKVCache
from pagedkv.sched.chunking import ChunkPolicy
from pagedkv.config.planner import plan_config
from pagedkv.sched.prefill import ChunkedPrefill

# Qwen3-0.6B (seed 004's example): 28 layers, 8 KV heads, head_dim 128.
SHAPE = dict(num_layers=28, num_kv_heads=8, head_dim=128, dtype="bfloat16")


def make_cache(tokens: int, prefix_caching: bool) -> PagedKVCache:
    blocks = CacheConfig(num_blocks=1, **SHAPE).blocks_for_tokens(tokens) + 64
    cfg = CacheConfig(num_blocks=blocks, enable_prefix_caching=prefix_caching, **SHAPE)
    return PagedKVCache(cfg, allocate_store=False)


def policies() -> Dict[str, Callable[[], ChunkPolicy]]:
    return {
        "fixed512": lambda: ChunkPolicy.fixed(512),
        "default": ChunkPolicy,
        # headroom for ~1.5k tokens: a memory-aware run with a probe call per chunk
        "memory_aware": lambda: ChunkPolicy(memory_probe=lambda: 1536 * 100_000, activation_bytes_per_token=100_000),
    }


def run_driver(prompt: np.ndarray, make_policy, prefix_caching: bool) -> Dict[str, object]:
    cache = make_cache(len(prompt), prefix_caching)
    prefill = ChunkedPrefill(cache, 0, prompt, lambda chunk: None, policy=make_policy())
    t0 = time.perf_counter_ns()
    result = prefill.run()
    ns = time.perf_counter_ns() - t0
    return dict(ns=ns, result=result, cache=cache)


def run_floor(prompt: np.ndarray, chunk_sizes, prefix_caching: bool) -> int:
    """The manager calls of the same chunks, with no driver around them."""
    cache = make_cache(len(prompt), prefix_caching)
    cache.add_sequence(0, prompt)
    pos = 0
    t0 = time.perf_counter_ns()
    for n in chunk_sizes:
        cache.reserve(0, n)
        cache.slot_mapping(0, pos, n)
        cache.commit(0, n, token_ids=prompt[pos:pos + n])
        pos += n
    return time.perf_counter_ns() - t0


def main(argv: List[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="20k tokens, one run (CI)")
    parser.add_argument("--tokens", type=int, default=None, help="prompt length (default 200000)")
    parser.add_argument("--repeats", type=int, default=None, help="runs per figure (median; default 7)")
    args = parser.parse_args(argv)
    tokens = args.tokens or (20_000 if args.smoke else 200_000)
    repeats = args.repeats or (1 if args.smoke else 7)
    prompt = ((np.arange(tokens, dtype=np.int64) * 7919) % 151_000).astype(np.int32)

    for prefix_caching in (True, False):
        for name, make_policy in policies().items():
            runs = [run_driver(prompt, make_policy, prefix_caching) for _ in range(repeats)]
            ns = statistics.median(r["ns"] for r in runs)
            result, cache = runs[0]["result"], runs[0]["cache"]
            chunks = result.num_chunks
            planned = plan_config(cache.config, max_seq_len=tokens)
            floor = statistics.median(run_floor(prompt, result.chunk_sizes, prefix_caching) for _ in range(repeats))
            print(json.dumps({
                "figure": "prefill_bookkeeping", "policy": name, "prefix_caching": prefix_caching,
                "tokens": tokens, "chunks": chunks,
                "chunk_min": min(result.chunk_sizes), "chunk_max": max(result.chunk_sizes),
                "total_ms": round(ns / 1e6, 3), "ns_per_chunk": round(ns / chunks), "ns_per_token": round(ns / tokens, 1),
                "first_chunk_blocks": result.blocks_after_chunk[0], "final_blocks": result.kv_blocks,
                "kv_bytes": result.kv_bytes, "planner_kv_bytes": planned.bytes_per_sequence,
                "repeats": repeats,
            }))
            print(json.dumps({
                "figure": "manager_floor", "policy": name, "prefix_caching": prefix_caching, "chunks": chunks,
                "ns_per_chunk": round(floor / chunks), "ns_per_token": round(floor / tokens, 1),
                "driver_overhead_ns_per_chunk": round((ns - floor) / chunks),
            }))

    for kv_dtype in (None, "fp8"):
        cfg = CacheConfig(num_blocks=1, kv_dtype=kv_dtype, **SHAPE)
        p = plan_config(cfg, max_seq_len=tokens)
        print(json.dumps({
            "figure": "kv_plan", "kv_dtype": p.kv_dtype, "tokens": tokens, "bytes_per_token": p.bytes_per_token,
            "blocks": p.blocks_per_sequence, "kv_bytes": p.bytes_per_sequence,
            "kv_gib": round(p.bytes_per_sequence / 2**30, 3),
        }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
