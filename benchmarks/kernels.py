"""Bandwidth of the KV kernels against a plain device copy of the same bytes.

For write_kv, gather_kv, copy_blocks (and, reported without a bar, the fp8 write,
the dequantizing gathers (fp8; int4 with per-token keys and with block keys, plain
and rotated), a decode step of paged attention (fp16, int8, rotated int4 with block
keys), the int4 block-key seal (with the torch definition's time on the same
GPU as its second baseline) and a swap to pinned host memory) this prints one JSON line
per figure: bytes moved (read + written), GPU time per call, GB/s, the GB/s of
torch ``copy_`` (cudaMemcpy) moving the same bytes, and the fraction of it. The bar
for the three main kernels is 80% of memcpy.

Timing: a spin kernel (``torch.cuda._sleep``) holds the stream while the host
queues all iterations, so CUDA events bracket GPU work only, not Python launch
overhead. Without a GPU it prints one JSON line saying so and exits 0.

    python benchmarks/kernels.py [--smoke] [--iters N]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Callable

import torch

BAR = 0.8


def emit(**fields) -> None:
    print(json.dumps({"benchmark": "kernels", **fields}), flush=True)


def gpu_time_us(fn: Callable[[], object], iters: int, repeats: int = 5) -> float:
    """Median over ``repeats`` of the mean GPU time of ``iters`` back-to-back calls."""
    fn()  # compile, load, warm caches
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if hasattr(torch.cuda, "_sleep"):
            torch.cuda._sleep(50_000_000)  # keep the GPU busy while the host queues the calls
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / iters)
    return statistics.median(times)


def memcpy_gbps(nbytes_read: int, iters: int) -> float:
    """GB/s (read + written) of a device-to-device copy_ reading ``nbytes_read``."""
    src = torch.empty(nbytes_read, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = gpu_time_us(lambda: dst.copy_(src), iters)
    return 2 * nbytes_read / us / 1e3


def report(op: str, variant: str, moved: int, us: float, baseline: float, bar: bool) -> None:
    gbps = moved / us / 1e3
    fields = dict(op=op, variant=variant, bytes_moved=moved, us_per_call=round(us, 2), GBps=round(gbps, 1),
                  memcpy_GBps=round(baseline, 1), fraction_of_memcpy=round(gbps / baseline, 3))
    if bar:
        fields.update(bar=BAR, meets_bar=gbps / baseline >= BAR)
    emit(**fields)


def int4_gather_cases(dev, NB: int, BS: int, H: int, D: int, T: int):
    """``(variant, bytes moved, gather kwargs)`` of the int4 gathers (group 32) of T
    tokens: per-token keys, then every block's keys sealed (block keys: per-channel
    bfloat16 parameters per (block, head), the K rows never unrotated), each plain and
    rotated."""
    from pagedkv.format.rotation import rotation_signs

    G = min(32, D)
    codes = torch.randint(0, 256, (NB, 2, BS, H, D // 2), dtype=torch.int32, device=dev).to(torch.uint8)
    scale = torch.rand(NB, 2, BS, H, D // G, device=dev)
    layer = dict(kv_layer=codes, kv_scale=scale, kv_zero=torch.rand_like(scale))
    keys = dict(key_scale=(torch.rand(NB, H, D, device=dev) + 0.5).to(torch.bfloat16),  # nonzero: sealed
                key_zero=torch.rand(NB, H, D, device=dev).to(torch.bfloat16))
    row = D // 2 + 8 * (D // G) + 2 * D  # codes, per-token scale/zero, the fp16 row written
    key_row = D // 2 + 4 * D // BS + 2 * D  # codes, the block's channel parameters per token, the row
    signs = dict(rotation_signs=rotation_signs(D, 0).to(dev))
    cases = []
    for rot, extra in (("", {}), (" rotated", signs)):
        cases.append((f"int4 -> fp16 NHD csr{rot}", 2 * T * H * row, dict(layer, **extra)))
        cases.append((f"int4 block keys -> fp16 NHD csr{rot}", T * H * (row + key_row), dict(layer, **keys, **extra)))
    return cases


def seal_case(dev, NB: int, BS: int, H: int, D: int, T: int):
    """``(bytes moved, seal arguments)`` of sealing the T // BS blocks that T fp16 keys
    fill, in shuffled order: read the keys, write the K codes and each block's
    per-channel bfloat16 scale and zero point."""
    m = T // BS
    layer = torch.zeros(NB, 2, BS, H, D // 2, dtype=torch.uint8, device=dev)
    keys = torch.randn(m, BS, H, D, device=dev).to(torch.float16)
    blocks = torch.randperm(NB, device=dev)[:m]
    params = [torch.zeros(NB, H, D, dtype=torch.bfloat16, device=dev) for _ in range(2)]
    moved = m * BS * H * (2 * D + D // 2) + m * H * D * 2 * 2
    return moved, (layer, blocks, keys, *params)


def attention_cases(dev, smoke: bool):
    """``(variant, bytes read, call)`` of one decode step of paged attention: batch 8 x
    4,096 tokens of context (smoke: 2 x 256), 32 query heads on 8 KV heads, head_dim
    128, block size 16, over shuffled blocks; fp16 K/V, then int8 and rotated int4
    (group 32) with block keys. Bytes read: the K/V rows (codes and their parameters)
    and the queries, written: the output; the same bytes a memcpy moves is the bar."""
    from pagedkv.format.rotation import rotation_signs
    from pagedkv.kernels import ops

    B, N, HQ, H, D, BS = (2, 256, 32, 8, 128, 16) if smoke else (8, 4096, 32, 8, 128, 16)
    nb = B * N // BS
    indptr = torch.arange(0, nb + 1, N // BS, dtype=torch.int32, device=dev)
    indices = torch.randperm(nb, device=dev).to(torch.int32)
    lens = torch.full((B,), N, dtype=torch.int32, device=dev)
    q_indptr = torch.arange(B + 1, dtype=torch.int32, device=dev)
    q = torch.randn(B, HQ, D, device=dev, dtype=torch.float16)
    out = torch.empty_like(q)
    tables = (indptr, indices, lens, q_indptr)
    fp16 = torch.randn(nb, 2, BS, H, D, device=dev).to(torch.float16)
    int8 = torch.randint(-128, 128, (nb, 2, BS, H, D), dtype=torch.int32, device=dev).to(torch.int8)
    s8 = torch.rand(nb, 2, BS, H, device=dev) * 0.01
    codes = torch.randint(0, 256, (nb, 2, BS, H, D // 2), dtype=torch.int32, device=dev).to(torch.uint8)
    s4 = torch.rand(nb, 2, BS, H, D // 32, device=dev) * 0.1
    keys = dict(key_scale=(torch.rand(nb, H, D, device=dev) + 0.5).to(torch.bfloat16),
                key_zero=torch.rand(nb, H, D, device=dev).to(torch.bfloat16))
    signs = rotation_signs(D, 0).to(dev)
    tokens = B * N * H  # (token, KV head) rows of K and of V
    qo = 2 * B * HQ * D * 2
    return [
        ("fp16 NHD", 2 * tokens * D * 2 + qo, lambda: ops.paged_attention(q, fp16, *tables, out=out)),
        ("int8 NHD", 2 * tokens * (D + 8) + qo,
         lambda: ops.paged_attention(q, int8, *tables, kv_scale=s8, kv_zero=s8, out=out)),
        ("int4 block keys rotated NHD", tokens * (D + 8 * (D // 32)) + tokens * (D // 2 + 4 * D // BS) + qo,
         lambda: ops.paged_attention(q, codes, *tables, kv_scale=s4, kv_zero=s4, rotation_signs=signs, out=out,
                                     **keys)),
    ]


def run(smoke: bool, iters: int) -> int:
    from pagedkv.kernels import ops

    dev = torch.device("cuda")
    L, H, D, BS = (2, 2, 64, 16) if smoke else (32, 8, 128, 16)
    T = 256 if smoke else 32768  # tokens per write / gather
    NB = max(2 * T // BS, 64)
    elt = 2
    emit(event="device", name=torch.cuda.get_device_name(dev), smoke=smoke)

    # write_kv: T tokens of K and V into random slots of one layer
    layer = torch.zeros(NB, 2, BS, H, D, dtype=torch.float16, device=dev)
    key = torch.randn(T, H, D, device=dev, dtype=torch.float16)
    value = torch.randn_like(key)
    slots = torch.randperm(NB * BS, device=dev)[:T]
    moved = 4 * T * H * D * elt  # read K and V, write K and V
    base = memcpy_gbps(moved // 2, iters)
    report("write_kv", "fp16 NHD", moved, gpu_time_us(lambda: ops.write_kv(layer, slots, key, value), iters), base, True)

    q = torch.zeros(NB, 2, BS, H, D, dtype=torch.float8_e4m3fn, device=dev)
    s = torch.zeros(NB, 2, BS, H, device=dev)
    us = gpu_time_us(lambda: ops.write_kv(q, slots, key, value, kv_scale=s), iters)
    report("write_kv", "fp16 -> fp8_e4m3 NHD", 2 * T * H * (D * elt + D + 4), us, base, False)

    # gather_kv: sequences of 512 tokens over shuffled blocks, outputs preallocated (no sync)
    seq = 64 if smoke else 512
    batch = T // seq
    lens = torch.full((batch,), seq, dtype=torch.int32, device=dev)
    indptr = torch.arange(0, batch * seq // BS + 1, seq // BS, dtype=torch.int32, device=dev)
    indices = torch.randperm(NB, device=dev)[: batch * seq // BS].to(torch.int32)
    out_k, out_v = torch.empty_like(key), torch.empty_like(value)
    fn = lambda: ops.gather_kv(layer, indptr, indices, lens, out_key=out_k, out_value=out_v)  # noqa: E731
    report("gather_kv", "fp16 NHD csr", moved, gpu_time_us(fn, iters), base, True)
    fn = lambda: ops.gather_kv(q, indptr, indices, lens, out_dtype=torch.float16, kv_scale=s,  # noqa: E731
                               out_key=out_k, out_value=out_v)
    report("gather_kv", "fp8_e4m3 -> fp16 NHD csr", 2 * T * H * (D + 4 + D * elt), gpu_time_us(fn, iters), base, False)
    for variant, moved_q, kw in int4_gather_cases(dev, NB, BS, H, D, T):
        fn = lambda kw=kw: ops.gather_kv(indptr=indptr, indices=indices, seq_lens=lens, out_dtype=torch.float16,  # noqa: E731
                                         out_key=out_k, out_value=out_v, **kw)
        report("gather_kv", variant, moved_q, gpu_time_us(fn, iters), base, False)

    # seal_key_blocks: the blocks T keys fill, against memcpy and the torch definition
    from pagedkv.ops import reference

    moved_s, seal_args = seal_case(dev, NB, BS, H, D, T)
    us = gpu_time_us(lambda: ops.seal_key_blocks(*seal_args), iters)
    report("seal_key_blocks", "int4 block keys fp16 NHD", moved_s, us, memcpy_gbps(moved_s // 2, iters), False)
    us_ref = gpu_time_us(lambda: reference.seal_key_blocks(*seal_args), iters)
    emit(op="seal_key_blocks", variant="int4 block keys fp16 NHD", us_per_call=round(us, 2),
         torch_reference_us_per_call=round(us_ref, 2), speedup_vs_torch_reference=round(us_ref / us, 2))

    # copy_blocks: P (src, dst) pairs across every layer of a whole arena
    P = 16 if smoke else 256
    arena = torch.zeros(L, 2 * P, 2, BS, H, D, dtype=torch.float16, device=dev)
    pairs = torch.stack([torch.arange(P), torch.arange(P, 2 * P)], dim=1).to(dev)
    block = 2 * BS * H * D * elt
    moved = 2 * P * L * block
    base = memcpy_gbps(moved // 2, iters)
    report("copy_blocks", "fp16 NHD", moved, gpu_time_us(lambda: ops.copy_blocks([arena], pairs), iters), base, True)

    # swap_blocks to pinned host memory, against a pinned D2H copy_ of the same bytes
    host = torch.zeros(L, P, 2, BS, H, D, dtype=torch.float16).pin_memory()
    out_pairs = torch.stack([torch.arange(P), torch.arange(P)], dim=1).to(dev)
    staging = torch.empty(moved // 2, dtype=torch.uint8).pin_memory()
    src = torch.empty(moved // 2, dtype=torch.uint8, device=dev)
    d2h = 2 * (moved // 2) / gpu_time_us(lambda: staging.copy_(src, non_blocking=True), iters) / 1e3
    us = gpu_time_us(lambda: ops.swap_blocks([arena], [host], out_pairs), iters)
    report("swap_blocks", "fp16 device -> pinned host", moved, us, d2h, False)

    # paged attention, one decode step (split-K), against a memcpy of the bytes it reads
    for variant, moved_a, fn in attention_cases(dev, smoke):
        report("paged_attention", f"decode {variant}", moved_a, gpu_time_us(fn, iters),
               memcpy_gbps(moved_a // 2, iters), False)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, few iterations (CI)")
    parser.add_argument("--iters", type=int, default=None, help="calls per timed run")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        emit(status="skipped", reason="no CUDA GPU present (torch.cuda.is_available() is False)", smoke=args.smoke)
        return 0
    return run(args.smoke, args.iters or (2 if args.smoke else 20))


if __name__ == "__main__":
    sys.exit(main())
