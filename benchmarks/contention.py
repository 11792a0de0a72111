"""The OpenMP-parallel CPU ops under CPU contention, against their serial versions.

Each parallel loop of ``pagedkv/ops`` (decode-step write, 4,096-token gather, their int4
versions, int4 block-key sealing, block copy) is timed three ways in the same process,
interleaved call by call:

- ``serial``: pagedkv's loops on one thread (``pagedkv.set_num_threads(1)``);
- ``t1`` / ``t2``: the default (automatic) policy with ``torch.set_num_threads(1)`` / ``(2)``:
  parallel only over idle cores (docs/threads.md);
- ``p2``: two threads forced (``pagedkv.set_num_threads(2)``), whatever the load: what a
  plain OpenMP loop does.

and under two loads: ``quiet`` (whatever else the machine runs: see ``loadavg``) and
``hogs`` (two busy-looping Python processes started by this script, killed after). One
JSON line per op and load: median ns per call of each mode, each mode's ratio to
``serial`` (``> 1`` is slower than serial), and ``os.getloadavg()`` before and after.

Usage: ``python benchmarks/contention.py [--smoke] [--repeats N] [--iters N] [--hogs N]``
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

import pagedkv
import pagedkv.ops as ops

BS = 16


def cases(smoke: bool):
    """``{name: (fn(i), bytes_moved)}`` of the parallel ops, at sizes above the serial threshold."""
    h, d = (2, 64) if smoke else (8, 128)
    num_seqs, seq_tokens = (16, 256) if smoke else (256, 4096)
    out = {}
    nb = num_seqs * 16
    layer = torch.ones(nb, 2, BS, h, d, dtype=torch.float16)
    owner = torch.randperm(nb).view(num_seqs, 16)
    steps = [(owner[:, s // BS] * BS + s % BS).to(torch.int64).contiguous() for s in range(32)]
    key = torch.randn(num_seqs, h, d, dtype=torch.float16)
    out["write_kv_fp16"] = (lambda i: ops.write_kv(layer, steps[i % 32], key, key), 2 * key.numel() * 2)

    blocks = seq_tokens // BS
    glayer = torch.randn(blocks * 4, 2, BS, h, d).to(torch.float16)
    perm = torch.randperm(blocks * 4).to(torch.int32)
    tables = [perm[t * blocks:(t + 1) * blocks].contiguous() for t in range(4)]
    indptr = torch.tensor([0, blocks], dtype=torch.int32)
    lens = torch.tensor([seq_tokens], dtype=torch.int32)
    ok = torch.empty(seq_tokens, h, d, dtype=torch.float16)
    ov = torch.empty_like(ok)
    out["gather_kv_fp16"] = (lambda i: ops.gather_kv(glayer, indptr, tables[i % 4], lens, out_key=ok, out_value=ov),
                             2 * ok.numel() * 2)

    # int4 (groups of 64): codes [.., d/2] uint8 with float32 scale and zero per group
    g = min(64, d)
    q = torch.zeros(blocks * 4, 2, BS, h, d // 2, dtype=torch.uint8)
    qs = torch.ones(blocks * 4, 2, BS, h, d // g)
    qz = torch.zeros(blocks * 4, 2, BS, h, d // g)
    qkw = dict(kv_scale=qs, kv_zero=qz)
    qsteps = [(torch.randperm(blocks * 4 * BS)[:num_seqs]).to(torch.int64) for _ in range(8)]
    qkey = torch.randn(num_seqs, h, d)
    out["write_kv_int4"] = (lambda i: ops.write_kv(q, qsteps[i % 8], qkey, qkey, **qkw), 2 * qkey.numel() * 4)
    qk = torch.empty(seq_tokens, h, d)
    qv = torch.empty_like(qk)
    out["gather_kv_int4_f32"] = (lambda i: ops.gather_kv(q, indptr, tables[i % 4], lens, out_key=qk, out_value=qv, out_dtype=torch.float32,
                                                         **qkw), 2 * qk.numel() * 4)

    seal_n = 16 if smoke else 64
    ks = torch.zeros(blocks * 4, h, d, dtype=torch.bfloat16)
    kz = torch.zeros_like(ks)
    seal_sets = [perm[c * seal_n:(c + 1) * seal_n].to(torch.int64) for c in range(4)]
    skeys = torch.randn(seal_n, BS, h, d)
    out["seal_key_blocks_int4"] = (lambda i: ops.seal_key_blocks(q, seal_sets[i % 4], skeys, ks, kz),
                                   skeys.numel() * 4)

    cl = torch.zeros(4, blocks * 4, 2, BS, h, d, dtype=torch.float16)   # 4 layers, one allocation
    pairs = [perm[c * 64:(c + 1) * 64].view(-1, 2).to(torch.int64) for c in range(4)] if blocks * 4 >= 256 else \
        [perm[:16].view(-1, 2).to(torch.int64)]
    out["copy_blocks_fp16"] = (lambda i: ops.copy_blocks(cl, pairs[i % len(pairs)]),
                               4 * pairs[0].shape[0] * 2 * BS * h * d * 2)
    return out


def set_mode(mode: str) -> None:
    if mode == "serial":
        pagedkv.set_num_threads(1)
        torch.set_num_threads(1)
    elif mode == "p2":
        pagedkv.set_num_threads(2)
        torch.set_num_threads(2)
    else:
        pagedkv.set_num_threads(0)           # follow torch
        torch.set_num_threads(int(mode[1:]))


def measure(fns, modes, iters: int, repeats: int):
    samples = {(name, m): [] for name in fns for m in modes}
    for r in range(repeats):
        order = modes[r % len(modes):] + modes[:r % len(modes)]   # no mode always follows another
        for name, (fn, _) in fns.items():
            for m in order:
                set_mode(m)
                fn(0)
                t0 = time.perf_counter_ns()
                for i in range(iters):
                    fn(i)
                samples[(name, m)].append((time.perf_counter_ns() - t0) / iters)
    return {k: statistics.median(v) for k, v in samples.items()}


def start_hogs(n: int):
    return [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(n)]


def stop_hogs(procs) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, a few iterations (CI)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--hogs", type=int, default=2, help="busy-looping processes for the loaded phase")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    fns = cases(args.smoke)
    repeats = args.repeats or (2 if args.smoke else 5)
    iters = args.iters or (3 if args.smoke else 10)
    modes = ("serial", "t1", "t2", "p2")
    old_torch, old_pkv = torch.get_num_threads(), pagedkv.get_num_threads()
    try:
        for load in ("quiet", "hogs"):
            procs = start_hogs(args.hogs) if load == "hogs" else []
            try:
                if procs:
                    time.sleep(0.5)
                before = os.getloadavg()
                t = measure(fns, modes, iters, repeats)
                after = os.getloadavg()
            finally:
                stop_hogs(procs)
            for name, (_, nbytes) in fns.items():
                serial = t[(name, "serial")]
                print(json.dumps({
                    "figure": "contention", "op": name, "load": load, "hogs": len(procs),
                    "bytes": nbytes, "cpus": os.cpu_count(),
                    **{f"{m}_ns": round(t[(name, m)]) for m in modes},
                    **{f"{m}_vs_serial": round(t[(name, m)] / serial, 2) for m in modes if m != "serial"},
                    "loadavg_before": [round(x, 2) for x in before], "loadavg_after": [round(x, 2) for x in after],
                }), flush=True)
    finally:
        torch.set_num_threads(old_torch)
        pagedkv.set_num_threads(old_pkv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
