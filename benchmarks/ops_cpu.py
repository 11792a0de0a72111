"""Microbenchmark of the fast CPU ops against memcpy and torch advanced indexing.

Prints one JSON object per line and figure:

- ``write_kv``: one decode step of 256 sequences (one new token each) into a per-layer
  arena where every sequence owns its own scattered blocks; each timed call is the
  next decode step, so it writes fresh rows as an engine would.
- ``gather_kv``: one 4,096-token sequence whose 256 blocks are scattered over the
  arena, into preallocated outputs (the engine path); ``gather_kv_alloc`` lets the op
  allocate its outputs.

Each figure carries the op's median ns per call and GB/s (bytes of K and V moved),
and two torch memcpy baselines of the same bytes (``dst.copy_(src)``, same process,
same thread settings):

- ``memcpy``: the copy's destination (write) or source (gather) walks a buffer as
  large as the arena, so it is as cache-cold as the op's own arena side;
- ``memcpy_hot``: the same two buffers every call (they stay in cache; a bound no
  op that touches an arena larger than the cache can reach).

``ratio`` is ``memcpy_ns / op_ns`` (1.0 = memcpy speed) and ``ratio_hot`` likewise;
``pass`` is ``ratio >= 0.5``. ``index_ns`` is the torch advanced-indexing version
(what the reference does) and ``speedup_vs_index`` the op's gain over it.

Quantized arenas (``kv_dtype`` fp8_e4m3, int8, int4 with groups of 64, int3 with groups
of 32 and bfloat16 scales):

- ``quant_write_kv``: the decode-step write above, quantizing ``dtype`` K/V on the way;
- ``quant_gather_kv``: the 4,096-token gather above, dequantizing into ``dtype`` outputs.

Each is timed interleaved with the same op on an unquantized arena of ``dtype``
(``plain_ns``, same shapes, tables and outputs) and with the torch reference
(``reference_ns``); ``vs_plain`` is ``op_ns / plain_ns``, and ``pass`` for a gather is
the issue's goal ``vs_plain <= 2``. ``ns_per_token`` is ``op_ns`` over the tokens moved.

``quant_write_kv_rot`` / ``quant_gather_kv_rot``: the same ops on a rotated cache
(``rotation_signs``: the Hadamard rotation fused into the per-row loop), timed in the
same interleaved run; ``unrotated_ns`` is the quantized op above, ``vs_unrotated`` the
rotation's cost, ``reference_ns`` the torch reference with the same rotation.

``block_key_gather_kv`` / ``block_key_gather_kv_rot``: the int4 gather above with every
block's keys sealed (``key_scale``/``key_zero``: per-channel bfloat16 block keys, rotated
cache or not; sealed K rows are never unrotated, V rows are), timed interleaved with the
float32 gather of the same tables (``f32_ns``: a float32 arena into float32 outputs; ``vs_f32``
is ``op_ns / f32_ns``), the per-token int4 gather (``per_token_ns``, same rotation) and the
torch reference (``reference_ns``).

``seal_key_blocks``: int4 block keys' sealing (the per-channel requantization of whole
blocks: one per sequence and layer every ``block_size`` decode steps, every whole block
of a prefill) of ``blocks`` blocks of float32 keys ``[16, H, D]`` per call into scattered
blocks of an int4 arena, on one thread, timed interleaved with the torch reference
(``reference_ns``); ``ns_per_block`` is ``op_ns`` over the blocks sealed.

Usage: ``python benchmarks/ops_cpu.py [--smoke] [--repeats N] [--threads N] [--kv-dtypes int3,int4]``
(``--kv-dtypes``: only the quantized figures of those formats).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable, Dict, List

import torch

import pagedkv.ops as ops
from pagedkv.format.rotation import rotation_signs
from pagedkv.ops import cpu as cpu_ops

SHAPES = [("smollm2", 3, 64), ("8x128", 8, 128)]
DTYPES = [torch.float16, torch.float32]
BLOCK_SIZE = 16


def median_ns(fns: Dict[str, Callable[[int], object]], iters: Dict[str, int], repeats: int) -> Dict[str, float]:
    """Median over ``repeats`` runs of the mean ns per call of each ``fns[name](i)``.

    The runs of the functions interleave (op, memcpy, hot memcpy, op, ...), so load
    from other processes on a shared machine hits them alike.
    """
    step = dict.fromkeys(fns, 0)
    for name, fn in fns.items():  # warm-up
        for i in range(max(3, iters[name] // 4)):
            fn(i)
    runs: Dict[str, List[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            n = iters[name]
            t0 = time.perf_counter_ns()
            for _ in range(n):
                fn(step[name])
                step[name] += 1
            runs[name].append((time.perf_counter_ns() - t0) / n)
    return {name: statistics.median(r) for name, r in runs.items()}


class ChunkPool:
    """An arena-sized byte buffer cut into chunks of ``nbytes``, walked in a scattered order."""

    def __init__(self, total_bytes: int, nbytes: int, dtype: torch.dtype):
        elems = nbytes // torch.empty((), dtype=dtype).element_size()
        self.count = max(2, total_bytes // nbytes)
        self.buf = torch.ones(self.count, elems, dtype=dtype)
        self.order = torch.randperm(self.count).tolist()

    def chunk(self, i: int) -> torch.Tensor:
        return self.buf[self.order[i % self.count]]


def figure(kind: str, label: str, dtype: torch.dtype, nbytes: int, op_ns: float, copy_ns: float,
           hot_ns: float, index_ns: float, **extra) -> Dict[str, object]:
    return {
        "figure": kind,
        "shape": label,
        "dtype": str(dtype).replace("torch.", ""),
        **extra,
        "bytes": nbytes,
        "op_ns": round(op_ns),
        "op_gbps": round(nbytes / op_ns, 2),
        "memcpy_ns": round(copy_ns),
        "memcpy_gbps": round(nbytes / copy_ns, 2),
        "ratio": round(copy_ns / op_ns, 3),
        "memcpy_hot_ns": round(hot_ns),
        "ratio_hot": round(hot_ns / op_ns, 3),
        "index_ns": round(index_ns),
        "speedup_vs_index": round(index_ns / op_ns, 2),
        "pass": copy_ns / op_ns >= 0.5,
        "threads": torch.get_num_threads(),
    }


def bench_write(label, h, d, dtype, num_seqs, blocks_per_seq, steps, iters, repeats) -> Dict[str, object]:
    nb = num_seqs * blocks_per_seq
    layer = torch.ones(nb, 2, BLOCK_SIZE, h, d, dtype=dtype)  # touched: no first-write page faults
    owner = torch.randperm(nb).view(num_seqs, blocks_per_seq)  # sequence b's blocks, scattered
    # decode step s writes token s of every sequence
    slot_steps = [
        (owner[:, s // BLOCK_SIZE] * BLOCK_SIZE + s % BLOCK_SIZE).to(torch.int64).contiguous()
        for s in range(steps)
    ]
    key = torch.randn(num_seqs, h, d).to(dtype)
    value = torch.randn(num_seqs, h, d).to(dtype)
    nbytes = 2 * key.numel() * key.element_size()

    src = torch.cat([key, value]).view(-1)
    pool = ChunkPool(layer.numel() * layer.element_size(), nbytes, dtype)
    hot = torch.empty_like(src)
    idx = [(s // BLOCK_SIZE, s % BLOCK_SIZE) for s in slot_steps]

    def index_write(i):
        blk, off = idx[i % steps]
        layer[blk, 0, off] = key
        layer[blk, 1, off] = value

    t = median_ns(
        {
            "op": lambda i: ops.write_kv(layer, slot_steps[i % steps], key, value),
            "memcpy": lambda i: pool.chunk(i).copy_(src),
            "hot": lambda i: hot.copy_(src),
            "index": index_write,
        },
        {"op": iters, "memcpy": iters, "hot": iters, "index": max(1, iters // 4)},
        repeats,
    )
    return figure("write_kv", label, dtype, nbytes, t["op"], t["memcpy"], t["hot"], t["index"],
                  tokens=num_seqs, arena_bytes=layer.numel() * layer.element_size())


def bench_gather(label, h, d, dtype, seq_tokens, num_tables, iters, repeats, alloc) -> Dict[str, object]:
    blocks = seq_tokens // BLOCK_SIZE
    nb = blocks * num_tables
    layer = torch.randn(nb, 2, BLOCK_SIZE, h, d).to(dtype)
    perm = torch.randperm(nb).to(torch.int32)
    tables = [perm[t * blocks:(t + 1) * blocks].contiguous() for t in range(num_tables)]  # disjoint, scattered
    indptr = torch.tensor([0, blocks], dtype=torch.int32)
    seq_lens = torch.tensor([seq_tokens], dtype=torch.int32)
    out_k = torch.empty(seq_tokens, h, d, dtype=dtype)
    out_v = torch.empty(seq_tokens, h, d, dtype=dtype)
    nbytes = 2 * out_k.numel() * out_k.element_size()

    if alloc:
        def op(i):
            ops.gather_kv(layer, indptr, tables[i % num_tables], seq_lens)
    else:
        def op(i):
            ops.gather_kv(layer, indptr, tables[i % num_tables], seq_lens, out_key=out_k, out_value=out_v)

    dst = torch.cat([out_k, out_v]).view(-1)
    pool = ChunkPool(layer.numel() * layer.element_size(), nbytes, dtype)
    src = torch.empty_like(dst)
    tok = torch.arange(seq_tokens)
    idx = [(t.to(torch.int64).repeat_interleave(BLOCK_SIZE), tok % BLOCK_SIZE) for t in tables]

    def index_gather(i):
        blk, off = idx[i % num_tables]
        return layer[blk, 0, off], layer[blk, 1, off]

    t = median_ns(
        {"op": op, "memcpy": lambda i: dst.copy_(pool.chunk(i)), "hot": lambda i: dst.copy_(src),
         "index": index_gather},
        {"op": iters, "memcpy": iters, "hot": iters, "index": max(1, iters // 4)},
        repeats,
    )
    return figure("gather_kv_alloc" if alloc else "gather_kv", label, dtype, nbytes, t["op"], t["memcpy"],
                  t["hot"], t["index"], tokens=seq_tokens, arena_bytes=layer.numel() * layer.element_size())


QUANT_KV = ("fp8_e4m3", "int8", "int4", "int3")


def quant_arena(shape, kv_dtype: str, d: int):
    """``(data, scale, zero)`` views of a quantized layer holding reference-quantized random K/V."""
    from pagedkv.format import dtypes
    from pagedkv.format.quant import DEFAULT_INT4_GROUP, int3_group

    row = dtypes.info(kv_dtype)
    group = {"int4": min(DEFAULT_INT4_GROUP, d), "int3": int3_group(d, None)}.get(kv_dtype, d)
    data = torch.zeros(shape[:-1] + (row.stored_dim(d),), dtype=torch.uint8).view(row.torch_dtype)
    sshape = shape[:-1] + ((d // group,) if row.grouped else ())
    scale = torch.ones(sshape, dtype=row.param_dtype)
    zero = torch.zeros(sshape, dtype=row.param_dtype) if row.zero_point else None
    nb, bs = shape[0], shape[2]
    slots = torch.arange(nb * bs)
    for lo in range(0, nb * bs, 4096):  # quantize in chunks: bounded temporaries
        s = slots[lo:lo + 4096]
        kv = torch.randn(2, s.numel(), shape[3], d)
        ops.write_kv(data, s, kv[0], kv[1], kv_scale=scale, kv_zero=zero, backend="reference")
    return data, scale, zero


def quant_figure(kind, label, dtype, kv_dtype, t, nbytes, tokens, **extra) -> Dict[str, object]:
    ratio = t["op"] / t["plain"]
    out = {
        "figure": kind,
        "shape": label,
        "dtype": str(dtype).replace("torch.", ""),
        "kv_dtype": kv_dtype,
        "tokens": tokens,
        **extra,
        "bytes": nbytes,
        "op_ns": round(t["op"]),
        "ns_per_token": round(t["op"] / tokens, 1),
        "plain_ns": round(t["plain"]),
        "vs_plain": round(ratio, 3),
        "reference_ns": round(t["reference"]),
        "speedup_vs_reference": round(t["reference"] / t["op"], 2),
        "threads": torch.get_num_threads(),
    }
    if kind.startswith("quant_gather_kv"):
        out["pass"] = ratio <= 2.0
    return out


def quant_figures(kind, label, dtype, kv_dtype, t, nbytes, tokens) -> List[Dict[str, object]]:
    """The unrotated figure and the rotated one (``t``: op, rot, plain, reference, rot_reference)."""
    rot = dict(op=t["rot"], plain=t["plain"], reference=t["rot_reference"])
    extra = {}
    if kind.startswith("quant_gather_kv"):
        # gather_pages(rotated=True) on a rotated cache runs the unrotated op on the
        # rotated codes: the attention rotates its queries instead
        extra = dict(rotated_domain_ns=round(t["op"]), rotated_domain_vs_plain=round(t["op"] / t["plain"], 3),
                     rotated_domain_pass=t["op"] / t["plain"] <= 2.0)
    return [
        quant_figure(kind, label, dtype, kv_dtype, t, nbytes, tokens),
        quant_figure(kind + "_rot", label, dtype, kv_dtype, rot, nbytes, tokens, unrotated_ns=round(t["op"]),
                     vs_unrotated=round(t["rot"] / t["op"], 3), **extra),
    ]


def bench_quant_write(label, h, d, dtype, kv_dtype, num_seqs, blocks_per_seq, steps, iters, repeats):
    nb = num_seqs * blocks_per_seq
    shape = (nb, 2, BLOCK_SIZE, h, d)
    plain = torch.ones(shape, dtype=dtype)
    data, scale, zero = quant_arena(shape, kv_dtype, d)
    owner = torch.randperm(nb).view(num_seqs, blocks_per_seq)
    slot_steps = [
        (owner[:, s // BLOCK_SIZE] * BLOCK_SIZE + s % BLOCK_SIZE).to(torch.int64).contiguous()
        for s in range(steps)
    ]
    key = torch.randn(num_seqs, h, d).to(dtype)
    value = torch.randn(num_seqs, h, d).to(dtype)
    qkw = dict(kv_scale=scale, kv_zero=zero)
    rkw = dict(qkw, rotation_signs=rotation_signs(d, 0))
    t = median_ns(
        {
            "op": lambda i: ops.write_kv(data, slot_steps[i % steps], key, value, **qkw),
            "rot": lambda i: ops.write_kv(data, slot_steps[i % steps], key, value, **rkw),
            "plain": lambda i: ops.write_kv(plain, slot_steps[i % steps], key, value),
            "reference": lambda i: ops.write_kv(data, slot_steps[i % steps], key, value, backend="reference", **qkw),
            "rot_reference": lambda i: ops.write_kv(data, slot_steps[i % steps], key, value, backend="reference",
                                                    **rkw),
        },
        {"op": iters, "rot": iters, "plain": iters, "reference": max(1, iters // 4),
         "rot_reference": max(1, iters // 4)},
        repeats,
    )
    return quant_figures("quant_write_kv", label, dtype, kv_dtype, t, 2 * key.numel() * key.element_size(), num_seqs)


def bench_quant_gather(label, h, d, dtype, kv_dtype, seq_tokens, num_tables, iters, repeats):
    blocks = seq_tokens // BLOCK_SIZE
    nb = blocks * num_tables
    shape = (nb, 2, BLOCK_SIZE, h, d)
    plain = torch.randn(shape).to(dtype)
    data, scale, zero = quant_arena(shape, kv_dtype, d)
    perm = torch.randperm(nb).to(torch.int32)
    tables = [perm[t * blocks:(t + 1) * blocks].contiguous() for t in range(num_tables)]
    indptr = torch.tensor([0, blocks], dtype=torch.int32)
    seq_lens = torch.tensor([seq_tokens], dtype=torch.int32)
    out = dict(out_key=torch.empty(seq_tokens, h, d, dtype=dtype), out_value=torch.empty(seq_tokens, h, d, dtype=dtype))
    qkw = dict(out_dtype=dtype, kv_scale=scale, kv_zero=zero, **out)
    rkw = dict(qkw, rotation_signs=rotation_signs(d, 0))
    t = median_ns(
        {
            "op": lambda i: ops.gather_kv(data, indptr, tables[i % num_tables], seq_lens, **qkw),
            "rot": lambda i: ops.gather_kv(data, indptr, tables[i % num_tables], seq_lens, **rkw),
            "plain": lambda i: ops.gather_kv(plain, indptr, tables[i % num_tables], seq_lens, **out),
            "reference": lambda i: ops.gather_kv(data, indptr, tables[i % num_tables], seq_lens,
                                                 backend="reference", **qkw),
            "rot_reference": lambda i: ops.gather_kv(data, indptr, tables[i % num_tables], seq_lens,
                                                     backend="reference", **rkw),
        },
        {"op": iters, "rot": iters, "plain": iters, "reference": max(1, iters // 4),
         "rot_reference": max(1, iters // 4)},
        repeats,
    )
    nbytes = 2 * out["out_key"].numel() * out["out_key"].element_size()
    return quant_figures("quant_gather_kv", label, dtype, kv_dtype, t, nbytes, seq_tokens)


def bench_block_key_gather(label, h, d, dtype, seq_tokens, num_tables, iters, repeats) -> List[Dict[str, object]]:
    blocks = seq_tokens // BLOCK_SIZE
    nb = blocks * num_tables
    shape = (nb, 2, BLOCK_SIZE, h, d)
    f32 = torch.randn(shape)
    data, scale, zero = quant_arena(shape, "int4", d)
    # every block sealed: a nonzero first scale per (block, head); values do not change the work
    key_scale = (torch.rand(nb, h, d) + 0.01).to(torch.bfloat16)
    key_zero = torch.randn(nb, h, d).to(torch.bfloat16)
    perm = torch.randperm(nb).to(torch.int32)
    tables = [perm[t * blocks:(t + 1) * blocks].contiguous() for t in range(num_tables)]
    indptr = torch.tensor([0, blocks], dtype=torch.int32)
    seq_lens = torch.tensor([seq_tokens], dtype=torch.int32)
    out = dict(out_key=torch.empty(seq_tokens, h, d, dtype=dtype), out_value=torch.empty(seq_tokens, h, d, dtype=dtype))
    out32 = dict(out_key=torch.empty(seq_tokens, h, d), out_value=torch.empty(seq_tokens, h, d))
    figs = []
    for signs in (None, rotation_signs(d, 0)):
        tkw = dict(out_dtype=dtype, kv_scale=scale, kv_zero=zero, rotation_signs=signs, **out)
        bkw = dict(tkw, key_scale=key_scale, key_zero=key_zero)
        t = median_ns(
            {
                "op": lambda i: ops.gather_kv(data, indptr, tables[i % num_tables], seq_lens, **bkw),
                "f32": lambda i: ops.gather_kv(f32, indptr, tables[i % num_tables], seq_lens, **out32),
                "per_token": lambda i: ops.gather_kv(data, indptr, tables[i % num_tables], seq_lens, **tkw),
                "reference": lambda i: ops.gather_kv(data, indptr, tables[i % num_tables], seq_lens,
                                                     backend="reference", **bkw),
            },
            {"op": iters, "f32": iters, "per_token": iters, "reference": max(1, iters // 4)},
            repeats,
        )
        figs.append({
            "figure": "block_key_gather_kv" + ("" if signs is None else "_rot"),
            "shape": label,
            "dtype": str(dtype).replace("torch.", ""),
            "kv_dtype": "int4",
            "tokens": seq_tokens,
            "bytes": 2 * out["out_key"].numel() * out["out_key"].element_size(),
            "op_ns": round(t["op"]),
            "ns_per_token": round(t["op"] / seq_tokens, 1),
            "f32_ns": round(t["f32"]),
            "vs_f32": round(t["op"] / t["f32"], 3),
            "per_token_ns": round(t["per_token"]),
            "vs_per_token": round(t["op"] / t["per_token"], 3),
            "reference_ns": round(t["reference"]),
            "speedup_vs_reference": round(t["reference"] / t["op"], 2),
            "threads": torch.get_num_threads(),
        })
    return figs


def bench_seal(label, h, d, num_blocks, arena_blocks, iters, repeats) -> Dict[str, object]:
    nb = max(arena_blocks, num_blocks)
    data = torch.zeros(nb, 2, BLOCK_SIZE, h, d // 2, dtype=torch.uint8)
    key_scale = torch.zeros(nb, h, d, dtype=torch.bfloat16)
    key_zero = torch.zeros(nb, h, d, dtype=torch.bfloat16)
    perm = torch.randperm(nb)
    calls = max(1, nb // num_blocks)
    # call i seals the next num_blocks of a scattered order, as successive decode steps would
    block_sets = [perm[c * num_blocks:(c + 1) * num_blocks].contiguous() for c in range(calls)]
    keys = torch.randn(num_blocks, BLOCK_SIZE, h, d) * 2
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t = median_ns(
            {
                "op": lambda i: ops.seal_key_blocks(data, block_sets[i % calls], keys, key_scale, key_zero),
                "reference": lambda i: ops.seal_key_blocks(data, block_sets[i % calls], keys, key_scale, key_zero,
                                                           backend="reference"),
            },
            {"op": iters, "reference": max(1, iters // 10)},
            repeats,
        )
        used = torch.get_num_threads()
    finally:
        torch.set_num_threads(threads)
    return {
        "figure": "seal_key_blocks",
        "shape": label,
        "dtype": "float32",
        "kv_dtype": "int4",
        "blocks": num_blocks,
        "block": [BLOCK_SIZE, h, d],
        "op_ns": round(t["op"]),
        "ns_per_block": round(t["op"] / num_blocks),
        "reference_ns": round(t["reference"]),
        "reference_ns_per_block": round(t["reference"] / num_blocks),
        "speedup_vs_reference": round(t["reference"] / t["op"], 2),
        "threads": used,
    }


def main(argv: List[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, a few iterations (CI)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per figure (median)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (ops and memcpy alike)")
    parser.add_argument("--kv-dtypes", default=None,
                        help=f"comma-separated subset of {','.join(QUANT_KV)}: only their quantized figures")
    args = parser.parse_args(argv)
    quant_kv = QUANT_KV
    if args.kv_dtypes is not None:
        quant_kv = tuple(args.kv_dtypes.split(","))
        unknown = [q for q in quant_kv if q not in QUANT_KV]
        if unknown:
            parser.error(f"--kv-dtypes: expected names from {', '.join(QUANT_KV)}, got {', '.join(unknown)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    if not cpu_ops.AVAILABLE:
        print(json.dumps({"error": "pagedkv.ops._cpu_copy is not built; timing the reference instead"}))
    torch.manual_seed(0)
    if args.smoke:
        sizes = dict(num_seqs=8, blocks_per_seq=2, steps=4, seq_tokens=64, num_tables=2, iters=5, repeats=3,
                     seal_arena=128)
        shapes, dtypes = SHAPES[:1], DTYPES[:1]
    else:
        sizes = dict(num_seqs=256, blocks_per_seq=16, steps=256, seq_tokens=4096, num_tables=16, iters=200,
                     repeats=7, seal_arena=4096)
        shapes, dtypes = SHAPES, DTYPES
    repeats = args.repeats or sizes["repeats"]
    for label, h, d in shapes if args.kv_dtypes is None else ():
        for dtype in dtypes:
            print(json.dumps(bench_write(label, h, d, dtype, sizes["num_seqs"], sizes["blocks_per_seq"],
                                         sizes["steps"], sizes["iters"], repeats)), flush=True)
            for alloc in (False, True):
                print(json.dumps(bench_gather(label, h, d, dtype, sizes["seq_tokens"], sizes["num_tables"],
                                              max(1, sizes["iters"] // 10), repeats, alloc)), flush=True)
    for label, h, d in shapes:
        for dtype in dtypes:
            for kv_dtype in quant_kv:
                figs = bench_quant_write(label, h, d, dtype, kv_dtype, sizes["num_seqs"], sizes["blocks_per_seq"],
                                         sizes["steps"], sizes["iters"], repeats)
                figs += bench_quant_gather(label, h, d, dtype, kv_dtype, sizes["seq_tokens"], sizes["num_tables"],
                                           max(1, sizes["iters"] // 10), repeats)
                if kv_dtype == "int4":
                    figs += bench_block_key_gather(label, h, d, dtype, sizes["seq_tokens"], sizes["num_tables"],
                                                   max(1, sizes["iters"] // 10), repeats)
                for fig in figs:
                    print(json.dumps(fig), flush=True)
    if "int4" in quant_kv:
        for label, h, d in shapes:
            for num_blocks in (1, 64):
                print(json.dumps(bench_seal(label, h, d, num_blocks, sizes["seal_arena"],
                                            max(1, sizes["iters"] // max(1, num_blocks // 8)), repeats)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
