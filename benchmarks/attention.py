"""Decode attention of one layer: paged attention vs gather + SDPA, same process (JSON).

    OMP_NUM_THREADS=1 python benchmarks/attention.py            # batch 8 x 4096 context
    python benchmarks/attention.py --smoke                      # tiny, for CI
    python benchmarks/attention.py --device cuda                # the GPU kernels' time (below)

With ``--device cuda`` every K/V format (the model dtypes, fp8, int8, int4 with groups
and with block keys, int3) is timed as the decode kernel (cuda/decode_attention.cu) and
as the tiled kernel (paged_attention.cu): GPU time per call from CUDA events around each
call, with the L2 cache flushed before it (a write over twice its size), so the bytes
come from memory once. ``bytes`` counts what attention must read (the sequences' K/V rows
and their parameters, once); ``limit_us`` is those bytes at the device's peak memory
bandwidth (from its memory clock and bus width), ``read_us`` the GPU time of a
same-size read (a float32 sum over as many bytes), and ``over_fp16`` a format's decode
time against fp16's. ``host_us`` is the Python side of one call (plan, checks, launch)
without a synchronize. On the CPU, ``plan_host_us`` is the same plan (the decode path's,
on CPU tensors) without running it.

For each shape (query heads / KV heads / head_dim) and KV format (fp32, int8, int4 with
block keys, int3), one decode step (one query per sequence) is timed as
``pagedkv.ops.paged_attention`` and as ``gather_kv`` (to float32) followed by
``torch.nn.functional.scaled_dot_product_attention`` (GQA): the median ns per call.
``paged_cpu_ns`` is the same call's median thread CPU time (``time.thread_time_ns``: on
one thread it stays meaningful when other processes load the machine, which ``load``,
``os.getloadavg()`` before and after the run, records). ``bytes`` is what paged attention reads (the K/V rows and their parameters); ``GBps``
that over its time, next to a same-size ``memcpy`` (``torch.Tensor.copy_``) in the same
process. Threads: whatever ``OMP_NUM_THREADS`` / ``torch.get_num_threads()`` say (printed).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

from pagedkv.format import dtypes
from pagedkv.ops import gather_kv, paged_attention
from pagedkv.ops import reference as ref

SHAPES = [(9, 3, 64), (32, 8, 128)]
FORMATS = ["float32", "int8", "int4_block_keys", "int3"]


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _median_ns(fn, reps: int) -> float:
    fn()
    _sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        fn()
        _sync()
        times.append(time.perf_counter_ns() - t0)
    times.sort()
    return float(times[len(times) // 2])


def _arena(fmt: str, nb: int, bs: int, h: int, d: int, gen):
    k = torch.randn(nb * bs, h, d, generator=gen)
    v = torch.randn(nb * bs, h, d, generator=gen)
    if fmt == "float32":
        kv = torch.empty(nb, 2, bs, h, d)
        kv[:, 0] = k.view(nb, bs, h, d)
        kv[:, 1] = v.view(nb, bs, h, d)
        return dict(kv_layer=kv)
    name = "int4" if fmt.startswith("int4") else fmt
    row = dtypes.info(name)
    groups = 1
    if name == "int4":
        groups = d // 32
    elif name == "int3":
        groups = d // 32
    shape = (nb, 2, bs, h, row.stored_dim(d))
    sshape = shape[:-1] + ((groups,) if row.grouped else ())
    kv = torch.zeros(shape, dtype=row.torch_dtype)
    scale = torch.zeros(sshape, dtype=row.param_dtype)
    zero = torch.zeros(sshape, dtype=row.param_dtype) if row.zero_point else None
    ref.write_kv(kv, torch.arange(nb * bs), k, v, kv_scale=scale, kv_zero=zero)
    out = dict(kv_layer=kv, kv_scale=scale, kv_zero=zero)
    if fmt == "int4_block_keys":
        ks = torch.zeros(nb, h, d, dtype=torch.bfloat16)
        kz = torch.zeros(nb, h, d, dtype=torch.bfloat16)
        ref.seal_key_blocks(kv, torch.arange(nb), k.view(nb, bs, h, d), ks, kz)
        out.update(key_scale=ks, key_zero=kz)
    return out


def _bytes_read(arena: dict, total_tokens: int, nb: int) -> int:
    per_block = sum(t.numel() * t.element_size() for k, t in arena.items() if t is not None) / nb
    bs = arena["kv_layer"].shape[2]
    return int(per_block * total_tokens / bs)


def _median_cpu_ns(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.thread_time_ns()
        fn()
        times.append(time.thread_time_ns() - t0)
    times.sort()
    return float(times[len(times) // 2])


def _plan_host_us(q, kv, indptr, indices, seq_lens, q_indptr, opts, reps: int) -> float:
    from pagedkv.kernels import attention_plans

    def plan():
        attention_plans.plan_paged_attention(q, kv, indptr, indices, seq_lens, q_indptr, **opts)

    return _median_cpu_ns(plan, reps) / 1e3


def run(batch: int, context: int, bs: int, reps: int, device: str = "cpu"):
    gen = torch.Generator().manual_seed(0)
    dev = torch.device(device)
    results = []
    for hq, hkv, d in SHAPES:
        per_seq = -(-context // bs)
        nb = batch * per_seq
        indptr = torch.arange(0, nb + 1, per_seq, dtype=torch.int32).to(dev)
        indices = torch.randperm(nb, generator=gen).to(torch.int32).to(dev)
        seq_lens = torch.full((batch,), context, dtype=torch.int32).to(dev)
        q_indptr = torch.arange(batch + 1, dtype=torch.int32).to(dev)
        q = torch.randn(batch, hq, d, generator=gen).to(dev)
        src = None
        for fmt in FORMATS:
            arena = {k: (t.to(dev) if t is not None else None) for k, t in _arena(fmt, nb, bs, hkv, d, gen).items()}
            opts = {k: v for k, v in arena.items() if k != "kv_layer"}
            kv = arena["kv_layer"]
            out_dtype = None if fmt == "float32" else torch.float32

            def paged():
                paged_attention(q, kv, indptr, indices, seq_lens, q_indptr, **opts)

            def gathered():
                k, v = gather_kv(kv, indptr, indices, seq_lens, out_dtype=out_dtype, **opts)
                kk = k.view(batch, context, hkv, d).transpose(1, 2)
                vv = v.view(batch, context, hkv, d).transpose(1, 2)
                F.scaled_dot_product_attention(q.unsqueeze(2), kk, vv, enable_gqa=True)

            nbytes = _bytes_read(arena, batch * context, nb)
            src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
            dst = torch.empty_like(src)
            t_paged = _median_ns(paged, reps)
            c_paged = _median_cpu_ns(paged, reps) if dev.type == "cpu" else None
            t_gather = _median_ns(gathered, reps)
            t_copy = _median_ns(lambda: dst.copy_(src), reps)
            results.append(dict(shape=f"{hq}q/{hkv}kv/{d}", format=fmt, device=str(dev), batch=batch, context=context,
                                paged_ns=t_paged, paged_cpu_ns=c_paged, gather_sdpa_ns=t_gather, paged_over_gather=t_paged / t_gather,
                                bytes=nbytes, paged_GBps=nbytes / t_paged, memcpy_GBps=nbytes / t_copy,
                                paged_over_memcpy_bw=(nbytes / t_paged) / (nbytes / t_copy),
                                plan_host_us=_plan_host_us(q, kv, indptr, indices, seq_lens, q_indptr, opts, reps)))
        fp32 = next(r for r in results if r["shape"] == f"{hq}q/{hkv}kv/{d}" and r["format"] == "float32")
        for r in results:
            if r["shape"] == fp32["shape"]:
                r["paged_over_paged_fp32"] = r["paged_ns"] / fp32["paged_ns"]
    return results


CUDA_FORMATS = ["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2", "int8", "int4", "int4_block_keys", "int3"]


def _peak_gbps() -> float | None:
    """The device's peak memory bandwidth, GB/s: 2 transfers a clock over the bus."""
    try:
        from cuda.bindings import driver as drv

        drv.cuInit(0)
        _, dev = drv.cuDeviceGet(torch.cuda.current_device())
        attr = drv.CUdevice_attribute
        _, khz = drv.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE, dev)
        _, bits = drv.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH, dev)
        return 2 * khz * 1e3 * bits / 8 / 1e9 if khz and bits else None
    except Exception:  # an old driver without the attributes: no limit column
        return None


def _gpu_us(fn, reps: int, flush: torch.Tensor) -> float:
    """Median GPU time of fn over reps calls, each after an L2 flush, from CUDA events."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    times.sort()
    return times[len(times) // 2]


def _host_us(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - t0) / 1e3)
        torch.cuda.synchronize()
    times.sort()
    return times[len(times) // 2]


def _cuda_arena(fmt: str, nb: int, bs: int, h: int, d: int) -> dict:
    """One layer's arena in ``fmt`` on the GPU, written by the CUDA kernels."""
    from pagedkv.kernels import ops

    dev = torch.device("cuda")
    k = torch.randn(nb * bs, h, d, device=dev)
    v = torch.randn(nb * bs, h, d, device=dev)
    if fmt in ("float32", "float16", "bfloat16"):
        kv = torch.empty(nb, 2, bs, h, d, dtype=getattr(torch, fmt), device=dev)
        kv[:, 0] = k.view(nb, bs, h, d)
        kv[:, 1] = v.view(nb, bs, h, d)
        return dict(kv_layer=kv)
    name = "int4" if fmt.startswith("int4") else fmt
    row = dtypes.info(name)
    shape = (nb, 2, bs, h, row.stored_dim(d))
    sshape = shape[:-1] + ((d // 32,) if row.grouped else ())
    kv = torch.zeros(shape, dtype=row.torch_dtype, device=dev)
    scale = torch.zeros(sshape, dtype=row.param_dtype, device=dev)
    zero = torch.zeros(sshape, dtype=row.param_dtype, device=dev) if row.zero_point else None
    ops.write_kv(kv, torch.arange(nb * bs, device=dev), k, v, kv_scale=scale, kv_zero=zero)
    out = dict(kv_layer=kv, kv_scale=scale, kv_zero=zero)
    if fmt == "int4_block_keys":
        ks = torch.zeros(nb, h, d, dtype=torch.bfloat16, device=dev)
        kz = torch.zeros(nb, h, d, dtype=torch.bfloat16, device=dev)
        ops.seal_key_blocks(kv, torch.arange(nb, device=dev), k.view(nb, bs, h, d), ks, kz)
        out.update(key_scale=ks, key_zero=kz)
    return out


def run_cuda(batch: int, context: int, bs: int, reps: int, formats: list[str]):
    from pagedkv.kernels import ops

    gen = torch.Generator().manual_seed(0)
    dev = torch.device("cuda")
    l2 = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 64 << 20) or (64 << 20)
    flush = torch.empty(2 * l2, dtype=torch.uint8, device=dev)
    peak = _peak_gbps()
    results = []
    for hq, hkv, d in SHAPES:
        per_seq = -(-context // bs)
        nb = batch * per_seq
        indptr = torch.arange(0, nb + 1, per_seq, dtype=torch.int32).to(dev)
        indices = torch.randperm(nb, generator=gen).to(torch.int32).to(dev)
        seq_lens = torch.full((batch,), context, dtype=torch.int32).to(dev)
        q_indptr = torch.arange(batch + 1, dtype=torch.int32).to(dev)
        shape_rows = []
        for fmt in formats:
            arena = _cuda_arena(fmt, nb, bs, hkv, d)
            kv = arena["kv_layer"]
            opts = {k: v for k, v in arena.items() if k != "kv_layer"}
            q_dtype = kv.dtype if fmt in ("float32", "float16", "bfloat16") else torch.float16
            q = torch.randn(batch, hq, d, generator=gen).to(q_dtype).to(dev)
            out = torch.empty_like(q)
            nbytes = _bytes_read(arena, batch * context, nb)
            src = torch.empty(nbytes // 4, dtype=torch.float32, device=dev)
            row = dict(shape=f"{hq}q/{hkv}kv/{d}", format=fmt, batch=batch, context=context, bytes=nbytes,
                       read_us=_gpu_us(lambda: src.sum(), reps, flush))
            for kernel in ("decode", "tiled"):
                def call(kernel=kernel):
                    ops.paged_attention(q, kv, indptr, indices, seq_lens, q_indptr, out=out, kernel=kernel, **opts)
                try:
                    row[f"{kernel}_us"] = _gpu_us(call, reps, flush)
                    row[f"{kernel}_host_us"] = _host_us(call, reps)
                except Exception as exc:  # not covered (int4 block keys: decode) -> say so
                    row[f"{kernel}_us"] = None
                    row[f"{kernel}_error"] = type(exc).__name__
            if peak:
                row["limit_us"] = nbytes / peak / 1e3
                if row.get("decode_us"):
                    row["decode_peak_fraction"] = row["limit_us"] / row["decode_us"]
            if row.get("decode_us") and row.get("tiled_us"):
                row["decode_over_tiled"] = row["decode_us"] / row["tiled_us"]
            shape_rows.append(row)
        f16 = next((r for r in shape_rows if r["format"] == "float16" and r.get("decode_us")), None)
        for r in shape_rows:
            if f16 and r.get("decode_us"):
                r["over_fp16"] = r["decode_us"] / f16["decode_us"]
        results += shape_rows
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes (CI)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--device", default="cpu", help="cpu, or cuda (the kernels' GPU time, see above)")
    p.add_argument("--formats", default=",".join(CUDA_FORMATS), help="cuda: the K/V formats, comma-separated")
    a = p.parse_args(argv)
    if a.smoke:
        a.batch, a.context, a.reps = 2, 100, 2
    load_before = os.getloadavg()
    if a.device == "cuda":
        if not torch.cuda.is_available():
            print(json.dumps(dict(benchmark="attention", device="cuda", skipped="no CUDA GPU here")))
            return 0
        res = run_cuda(a.batch, a.context, a.block_size, max(a.reps, 5), a.formats.split(","))
    else:
        res = run(a.batch, a.context, a.block_size, a.reps, a.device)
    json.dump(dict(benchmark="attention", threads=torch.get_num_threads(), load=[load_before, os.getloadavg()],
                   results=res), sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
