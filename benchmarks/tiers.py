"""Prefix tiers: promote-from-host and promote-from-disk time per block, and write-back.

A cache of SmolLM2's KV shape (30 layers, 3 KV heads, head dim 64, 16-token blocks)
holds prompts of ``--blocks`` full blocks. Each timed admission finds nothing on the
device and the whole prompt in one tier, so ``add_sequence`` promotes it: chain lookup
with token verification, device allocation (write-back of what that evicts), the copy
(the disk tier checks each block's CRC-32 first), commit and registration.

One JSON line per figure, ns per promoted block (median of ``--repeats`` runs):

- ``promote_host`` / ``promote_disk``: the whole admission, per block;
- ``copy_only``: the bare copy of the same blocks from the same tier into the same
  device blocks (the tier's own ``read``, as the promotion uses it; same process,
  interleaved): the floor;
- ``crc_only`` (disk): CRC-32 of the same records;
- ``baseline``: the same bytes moved the plainest way (host: one contiguous tensor
  copy; disk: ``readinto`` of the same records from the block file);
- ``write_back``: one reserve that evicts prompts of the same size from the device,
  per block written down (the disk figure is the page-cache write, not an fsync).

The disk file is read through the page cache (it was just written): a cold read adds
the device's read time. A last figure per tier setup, ``hit_rate``, replays a multi-turn
chat workload larger than the device and reports which medium served the hits. Usage: ``python benchmarks/tiers.py [--smoke] [--repeats N]``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import zlib

import numpy as np
import torch

from pagedkv import CacheConfig, PagedKVCache
from pagedkv.manager.namespaces import namespace_key

SHAPE = dict(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16)


def fill(cache, sid, tokens):
    hit = cache.add_sequence(sid, tokens)
    n = len(tokens) - hit
    slots = cache.reserve(sid, n)
    k = torch.randn(n, SHAPE["num_kv_heads"], SHAPE["head_dim"]).to(cache.config.torch_dtype)
    for layer in range(cache.config.num_layers):
        cache.write(layer, slots, k, k)
    cache.commit(sid, n)
    return hit


def flush(cache):
    """Evict every cached block from the device (a sequence of unknown tokens)."""
    cache.add_sequence("flush")
    t0 = time.perf_counter_ns()
    cache.reserve("flush", cache.pool.num_free_blocks * cache.config.block_size)
    dt = time.perf_counter_ns() - t0
    cache.free("flush")
    return dt


def baseline(medium, tier, slots, staging, bpb):
    """The same bytes moved the plainest way, ns for all ``slots``: host, one contiguous
    ``Tensor.copy_`` of ``len(slots)`` blocks; disk, ``readinto`` of the same records
    from the block file (page cache), one read per record."""
    n = len(slots)
    if medium == "host":
        src = torch.empty(n * bpb, dtype=torch.uint8)
        t0 = time.perf_counter_ns()
        staging[:n * bpb].copy_(src)
        return time.perf_counter_ns() - t0
    rb = tier.record_bytes
    view = memoryview(staging.numpy())
    with open(os.path.join(tier.path, "blocks.bin"), "rb", buffering=0) as f:
        t0 = time.perf_counter_ns()
        for i, s in enumerate(slots):
            f.seek(s * rb)
            f.readinto(view[i * rb:(i + 1) * rb])
        return time.perf_counter_ns() - t0


def hit_rates(shape, smoke):
    """Multi-turn chat: ``conversations`` chats share a system prompt; each turn
    re-sends the chat's whole history plus a new user message. The device holds a few
    chats; the figure is the prefix hit rate (hit / prompt tokens, all turns) with no
    tier, a host tier, and host + disk, and the device blocks recomputed per turn."""
    bs = shape["block_size"]
    chats, turns = (6, 3) if smoke else (24, 6)
    system, msg = 4 * bs, 2 * bs
    rng = np.random.default_rng(0)
    history = {c: np.concatenate([np.arange(system, dtype=np.int32),
                                  rng.integers(1000, 50_000, msg, dtype=np.int32)]) for c in range(chats)}
    device_blocks = (system + turns * msg) // bs * 2 + 4
    for name, extra in (("none", {}), ("host", {"prefix_host_blocks": device_blocks * 4}),
                        ("host+disk", {"prefix_host_blocks": device_blocks // 2, "prefix_disk_blocks": device_blocks * 8})):
        with tempfile.TemporaryDirectory() as d:
            if "prefix_disk_blocks" in extra:
                extra = dict(extra, prefix_disk_dir=d)
            cache = PagedKVCache(CacheConfig(**shape, num_blocks=device_blocks, dtype="float16", **extra))
            hist = dict(history)
            query = hit = 0
            t0 = time.perf_counter_ns()
            for turn in range(turns):
                for c in range(chats):
                    prompt = hist[c]
                    query += len(prompt)
                    hit += fill(cache, c, prompt)
                    cache.free(c)
                    hist[c] = np.concatenate([prompt, rng.integers(1000, 50_000, msg, dtype=np.int32)])
            dt = time.perf_counter_ns() - t0
            st = cache.stats()
            cache.close()
        print(json.dumps({"figure": "hit_rate", "tiers": name, "chats": chats, "turns": turns,
                          "device_blocks": device_blocks, "hit_rate": round(hit / query, 3),
                          "device_hit_tokens": st.device_hit_tokens, "host_hit_tokens": st.host_hit_tokens,
                          "disk_hit_tokens": st.disk_hit_tokens, "prompt_tokens": query,
                          "ns_per_prompt_token": round(dt / query)}))


def bench(medium, kv_dtype, blocks, prompts, repeats, shape):
    bs = shape["block_size"]
    cap = blocks * prompts + 1
    opts = dict(shape, num_blocks=blocks * 2 + 2, dtype="float16", kv_dtype=kv_dtype)
    with tempfile.TemporaryDirectory() as d:
        if medium == "host":
            opts.update(prefix_host_blocks=cap)
        else:
            opts.update(prefix_disk_dir=d, prefix_disk_blocks=cap)
        cache = PagedKVCache(CacheConfig(**opts))
        tier = cache._tiers.tiers[0]
        toks = [np.arange(p * 100_000, p * 100_000 + blocks * bs + 1, dtype=np.int32) for p in range(prompts)]
        wb = []
        for p, t in enumerate(toks):
            fill(cache, p, t)
            cache.free(p)
            before = tier.num_written
            ns = flush(cache)
            wb.append(ns / max(1, tier.num_written - before))
        promote, copy, crc, base = [], [], [], []
        bpb = cache.config.bytes_per_block
        staging = torch.empty(blocks * max(bpb, tier.record_bytes if medium == "disk" else 0), dtype=torch.uint8)
        for r in range(repeats):
            t = toks[r % prompts]
            flush(cache)
            t0 = time.perf_counter_ns()
            hit = cache.add_sequence("q", t)
            promote.append((time.perf_counter_ns() - t0) / (hit // bs))
            if hit != blocks * bs:
                raise SystemExit(f"tiers benchmark: {medium} served {hit} tokens, not {blocks * bs}")
            dev = cache.block_table("q")[:blocks]
            slots = tier.index.lookup(t, tier.namespace(namespace_key(None, None), False), tier.ns_hashes[0], blocks)
            t0 = time.perf_counter_ns()
            tier.read(slots, cache.store.arenas, dev.tolist())
            copy.append((time.perf_counter_ns() - t0) / blocks)
            base.append(baseline(medium, tier, slots, staging, bpb) / blocks)
            if medium == "disk":
                t0 = time.perf_counter_ns()
                for s in slots:
                    zlib.crc32(tier.blocks[s * tier.record_bytes:(s + 1) * tier.record_bytes])
                crc.append((time.perf_counter_ns() - t0) / blocks)
            cache.free("q")
        cache.close()
    med = statistics.median(promote)
    out = {"figure": f"promote_{medium}", "kv_dtype": kv_dtype or "float16", "blocks": blocks,
           "bytes_per_block": bpb, "ns_per_block": round(med), "gb_per_s": round(bpb / med, 3),
           "copy_only_ns_per_block": round(statistics.median(copy)),
           "overhead_vs_copy": round(med / statistics.median(copy), 2),
           "baseline": "tensor_copy" if medium == "host" else "file_read",
           "baseline_ns_per_block": round(statistics.median(base)),
           "overhead_vs_baseline": round(med / statistics.median(base), 2)}
    if crc:
        out["crc_only_ns_per_block"] = round(statistics.median(crc))
    print(json.dumps(out))
    print(json.dumps({"figure": f"write_back_{medium}", "kv_dtype": kv_dtype or "float16",
                      "ns_per_block": round(statistics.median(wb)), "gb_per_s": round(bpb / statistics.median(wb), 3)}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, seconds")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--blocks", type=int, default=None, help="full blocks per prompt")
    args = ap.parse_args()
    shape = dict(SHAPE, num_layers=2) if args.smoke else SHAPE
    blocks = args.blocks or (4 if args.smoke else 64)
    repeats = args.repeats or (3 if args.smoke else 9)
    torch.set_num_threads(1)
    for kv_dtype in (None, "int8"):
        for medium in ("host", "disk"):
            bench(medium, kv_dtype, blocks, 3, repeats, shape)
    hit_rates(shape, args.smoke)


if __name__ == "__main__":
    main()
