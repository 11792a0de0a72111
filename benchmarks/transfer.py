"""KV transfer between two processes (gloo on 127.0.0.1) against a raw gloo send of
the same bytes, in the same run.

Rank 0 holds a sequence of ``--tokens`` tokens in a cache of SmolLM2's KV shape (30
layers, 3 KV heads, head dim 64, 16-token blocks); rank 1 receives it into an empty
cache. Figures (one JSON line each, median of ``--repeats``, from rank 0):

- ``send_sequence``: ``send_sequence`` -> ``recv_sequence`` end to end (header,
  allocation handshake, every layer's blocks with scales, commit and registration on
  the receiver, the final acknowledgement); the receiver frees it after each run;
- ``send_prefix``: the same prompt's full blocks offered to a peer that lacks them;
- ``raw_gloo``: one ``dist.send`` of a tensor of the same byte count, answered by a
  one-element acknowledgement (the bar: the transport alone).

``ratio`` is ``raw_gloo_ns / pagedkv_ns`` (1.0 = as fast as the bare transport).
Usage: ``python benchmarks/transfer.py [--smoke] [--tokens N] [--repeats N]``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import time

SHAPE = dict(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16)


def rank_main(rank: int, port: int, tokens: int, repeats: int, smoke: bool) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    import pagedkv.transfer.distributed as pd
    from pagedkv import CacheConfig, PagedKVCache

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    shape = dict(SHAPE, num_layers=2) if smoke else SHAPE
    for kv_dtype in (None, "int8"):
        cfg = CacheConfig(**shape, num_blocks=2 * (tokens // shape["block_size"]) + 4, dtype="float16",
                          kv_dtype=kv_dtype)
        cache = PagedKVCache(cfg)
        prompt = np.arange(tokens, dtype=np.int32) + 7
        nbytes = cfg.bytes_per_token * tokens
        seq, pre, raw = [], [], []
        if rank == 0:
            cache.add_sequence("req", prompt)
            slots = cache.reserve("req", tokens)
            k = torch.randn(tokens, shape["num_kv_heads"], shape["head_dim"]).half()
            for layer in range(cfg.num_layers):
                cache.write(layer, slots, k, k)
            cache.commit("req", tokens)
        payload = torch.empty(nbytes, dtype=torch.uint8)
        ack = torch.zeros(1, dtype=torch.int64)
        full = tokens // shape["block_size"] * shape["block_size"]
        for _ in range(repeats + 1):                         # the first round warms up
            dist.barrier()
            t0 = time.perf_counter_ns()
            if rank == 0:
                pd.send_sequence(cache, "req", 1)
            else:
                got = pd.recv_sequence(cache, 0)
                cache.free(got.seq_id)
                cache.reset_prefix_cache()                  # the next round finds nothing cached
            seq.append(time.perf_counter_ns() - t0)
            dist.barrier()
            t0 = time.perf_counter_ns()
            if rank == 0:
                pd.send_prefix(cache, prompt[:full], 1)
            else:
                pd.recv_prefix(cache, 0)
                cache.reset_prefix_cache()
            pre.append(time.perf_counter_ns() - t0)
            dist.barrier()
            t0 = time.perf_counter_ns()
            if rank == 0:
                dist.send(payload, 1)
                dist.recv(ack, 1)
            else:
                dist.recv(payload, 0)
                dist.send(ack, 0)
            raw.append(time.perf_counter_ns() - t0)
        if rank == 0:
            raw_ns = statistics.median(raw[1:])
            for name, times, moved in (("send_sequence", seq, nbytes),
                                       ("send_prefix", pre, cfg.bytes_per_token * full)):
                ns = statistics.median(times[1:])
                print(json.dumps({"figure": name, "kv_dtype": kv_dtype or "float16", "tokens": tokens,
                                  "bytes": moved, "ms": round(ns / 1e6, 3), "gb_per_s": round(moved / ns, 3),
                                  "raw_gloo_ms": round(raw_ns / 1e6, 3), "raw_gloo_gb_per_s": round(nbytes / raw_ns, 3),
                                  "ratio": round(raw_ns / ns, 3)}), flush=True)
            cache.free("req")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, seconds")
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    tokens = args.tokens or (64 if args.smoke else 2048)
    repeats = args.repeats or (2 if args.smoke else 7)
    if args.rank is not None:
        rank_main(args.rank, args.port, tokens, repeats, args.smoke)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, os.path.abspath(__file__), "--port", str(port), "--tokens", str(tokens),
           "--repeats", str(repeats)] + (["--smoke"] if args.smoke else [])
    procs = [subprocess.Popen(cmd + ["--rank", str(r)]) for r in range(2)]
    try:
        codes = [p.wait(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(codes):
        sys.exit(f"transfer benchmark: ranks exited with {codes}")


if __name__ == "__main__":
    main()
