"""The CUDA kernels, run on the CPU through the host emulation, match the torch
reference bit for bit.

The emulation compiles the unchanged .cu sources with g++ (see
pagedkv/kernels/emulation.py) and runs the launch plans the CUDA launchers would
run, over the whole grid: once with the planned dims and once with a grid far
smaller than the work, so every grid-stride loop takes several turns. Outputs are
compared as raw bytes (NaN outputs, whose payload bits are not part of the
contract, are compared as "both NaN").
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedkv.errors import (
    DeviceError,
    DTypeError,
    InvalidArgumentError,
    InvalidBlockError,
    ShapeError,
)
from pagedkv.kernels import emulation as emu
from pagedkv.kernels import plans
from pagedkv.ops import reference as ref

pytestmark = pytest.mark.skipif(shutil.which(emu.CXX) is None, reason=f"the host emulation needs {emu.CXX}")

MODEL = (torch.float32, torch.float16, torch.bfloat16)
QUANT = (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)
LAYOUTS = ("NHD", "HND")
SMALL_GRID = dict(grid=(2, 3, 1), block=(4, 2, 1))  # 48 threads for hundreds of items
ONE_THREAD = dict(grid=(1, 1, 1), block=(1, 1, 1))
NB, BS, H = 7, 5, 3  # odd sizes: partial blocks everywhere
FMAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def name(x) -> str:
    return str(x).replace("torch.", "")


# ----------------------------------------------------------------------------------
# helpers


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Byte-for-byte equal; NaNs of float tensors only need to be NaN on both sides."""
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    if got.dtype.is_floating_point and got.element_size() > 1:
        gn, wn = torch.isnan(got.float()), torch.isnan(want.float())
        assert torch.equal(gn, wn), "NaN positions differ"
        got, want = got.masked_fill(gn, 0), want.masked_fill(wn, 0)
    same = raw(got) == raw(want)
    assert bool(same.all()), f"{int((~same).sum())} of {same.numel()} bytes differ"


def layer_shape(layout: str, nb: int, bs: int, h: int, d: int):
    return (nb, 2, bs, h, d) if layout == "NHD" else (nb, 2, h, bs, d)


def offset_view(t: torch.Tensor, offset: int) -> torch.Tensor:
    """A copy of ``t`` whose data starts ``offset`` elements into its storage, so the
    pointer is not 16-byte aligned for offset 1."""
    buf = torch.empty(t.numel() + offset, dtype=t.dtype)
    view = buf[offset:].view(t.shape)
    view.copy_(t)
    return view


def random_layer(layout, dtype, d, *, nb=NB, bs=BS, h=H, offset=0, gen=None):
    shape = layer_shape(layout, nb, bs, h, d)
    if dtype in MODEL:
        t = torch.randn(shape, generator=gen).to(dtype)
    else:
        t = torch.randint(0, 256, shape, dtype=torch.int32, generator=gen).to(torch.uint8).view(dtype)
    return offset_view(t, offset) if offset else t


def quantized_layer(layout, qdtype, d, *, gen, nb=NB, bs=BS, h=H):
    """A quantized layer whose every slot holds reference-quantized data."""
    shape = layer_shape(layout, nb, bs, h, d)
    kv = torch.zeros(shape, dtype=qdtype)
    scale = torch.zeros(shape[:-1])
    zero = torch.zeros(shape[:-1]) if qdtype == torch.int8 else None
    slots = torch.arange(nb * bs)
    k = torch.randn(nb * bs, h, d, generator=gen) * 4
    v = torch.randn(nb * bs, h, d, generator=gen)
    ref.write_kv(kv, slots, k, v, layout=layout, kv_scale=scale, kv_zero=zero)
    return kv, scale, zero


def clones(*ts):
    return [None if t is None else t.clone() for t in ts]


def tokens(n, d, dtype, kind, gen):
    """key/value inputs [n, H, d]: contiguous, a slice of a fused qkv row (token
    stride 3*H*d), or an element-offset copy (pointer misaligned for vectors)."""
    if kind == "qkv":
        qkv = torch.randn(n, 3 * H * d, generator=gen).to(dtype)
        return qkv[:, H * d : 2 * H * d].view(n, H, d), qkv[:, 2 * H * d :].view(n, H, d)
    k = torch.randn(n, H, d, generator=gen).to(dtype)
    v = torch.randn(n, H, d, generator=gen).to(dtype)
    if kind == "misaligned":
        return offset_view(k, 1), offset_view(v, 1)
    return k, v


def slot_mapping(n, gen, nb=NB, bs=BS):
    """n distinct slots, every fourth one padding (-1)."""
    slots = torch.randperm(nb * bs, generator=gen)[:n].to(torch.int64)
    slots[::4] = -1
    return slots


# ----------------------------------------------------------------------------------
# number conversions (common.cuh) against torch's casts


def _structured_floats() -> torch.Tensor:
    """Every sign/exponent/top-11-mantissa pattern (bits 12..31) with the low 12 bits
    0, 1, 0x7ff, 0x800, 0x801, 0xfff: all round-down/tie/round-up cases of a cast to
    any format that keeps at most 11 mantissa bits (fp8, fp16, bf16)."""
    high = torch.arange(1 << 20, dtype=torch.int64) << 12
    low = torch.tensor([0, 1, 0x7FF, 0x800, 0x801, 0xFFF], dtype=torch.int64)
    bits = (high[:, None] | low[None, :]).view(-1)
    return bits.to(torch.int32).view(torch.float32)  # int64 -> int32 keeps the low 32 bits


@pytest.fixture(scope="module")
def floats():
    return _structured_floats()


@pytest.mark.parametrize("qdtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=name)
def test_float_to_fp8_equals_torch_cast_of_clamped_value(floats, qdtype):
    conv = "f32_to_e4m3" if qdtype == torch.float8_e4m3fn else "f32_to_e5m2"
    want = torch.clamp(floats, -FMAX[qdtype], FMAX[qdtype]).to(qdtype).view(torch.uint8)
    assert torch.equal(emu.conversion(conv, floats, torch.uint8), want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=name)
def test_float_to_half_types_equals_torch_cast(floats, dtype):
    conv = "f32_to_f16" if dtype == torch.float16 else "f32_to_bf16"
    got = emu.conversion(conv, floats, torch.int16).view(dtype)
    assert_same(got, floats.to(dtype))


@pytest.mark.parametrize("qdtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=name)
def test_every_fp8_code_decodes_like_torch(qdtype):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    conv = "e4m3_to_f32" if qdtype == torch.float8_e4m3fn else "e5m2_to_f32"
    got = emu.conversion(conv, codes, torch.float32)
    assert torch.equal(got.view(torch.int32), codes.view(qdtype).to(torch.float32).view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=name)
def test_every_half_pattern_widens_like_torch(dtype):
    bits = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
    conv = "f16_to_f32" if dtype == torch.float16 else "bf16_to_f32"
    got = emu.conversion(conv, bits, torch.float32)
    assert torch.equal(got.view(torch.int32), bits.view(dtype).to(torch.float32).view(torch.int32))


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("PAGEDKV_EXHAUSTIVE") != "1", reason="all 2**32 floats: set PAGEDKV_EXHAUSTIVE=1")
@pytest.mark.parametrize("qdtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=name)
def test_float_to_fp8_over_every_float32(qdtype):
    conv = "f32_to_e4m3" if qdtype == torch.float8_e4m3fn else "f32_to_e5m2"
    chunk = 1 << 26
    base = torch.arange(chunk, dtype=torch.int32)
    for start in range(-(1 << 31), 1 << 31, chunk):  # no int32 overflow: start + base < 2**31
        x = (base + start).view(torch.float32)
        want = torch.clamp(x, -FMAX[qdtype], FMAX[qdtype]).to(qdtype).view(torch.uint8)
        got = emu.conversion(conv, x, torch.uint8)
        assert torch.equal(got, want), f"mismatch in chunk starting at bits {start & 0xFFFFFFFF:#010x}"


# ----------------------------------------------------------------------------------
# write_kv


@pytest.mark.parametrize("kind", ["contiguous", "qkv", "misaligned"])
@pytest.mark.parametrize("d", [3, 17, 80])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", MODEL, ids=name)
def test_write_kv_copies_like_the_reference(dtype, layout, d, kind):
    gen = torch.Generator().manual_seed(d * 7 + len(kind))
    layer = random_layer(layout, dtype, d, gen=gen, offset=1 if kind == "misaligned" else 0)
    key, value = tokens(23, d, dtype, kind, gen)
    slots = slot_mapping(23, gen)
    want = layer.clone()
    ref.write_kv(want, slots, key, value, layout=layout)

    vector = kind != "misaligned" and (d * key.element_size()) % 16 == 0
    launch = plans.plan_write_kv(layer, slots, key, value, layout=layout)[0]
    assert launch.kernel.endswith("_v16" if vector else f"_e{key.element_size()}")
    for dims in ({}, SMALL_GRID, ONE_THREAD):
        got = layer.clone()
        emu.write_kv(got, slots, key, value, layout=layout, **dims)
        assert_same(got, want)


def _special_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows the quantizer must handle: zeros (scale 0 -> 1), a constant, +-inf, NaN
    of both signs, huge and tiny magnitudes."""
    x = x.clone()
    x[0, 0] = 0.0
    x[1, 0] = 2.5
    x[2, 0, 0] = float("inf")
    x[2, 1, 1 % x.shape[2]] = float("-inf")
    x[3, 0, 0] = float("nan")
    x[3, 1, 0] = -float("nan")
    x[4, 0] = x[4, 0] * 1e30
    x[4, 1] = x[4, 1] * 1e-30
    return x


@pytest.mark.parametrize("d", [3, 17, 80])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("qdtype", QUANT, ids=name)
@pytest.mark.parametrize("dtype", MODEL, ids=name)
def test_write_kv_quantizes_like_the_reference(dtype, qdtype, layout, d):
    gen = torch.Generator().manual_seed(d + 100 * QUANT.index(qdtype))
    shape = layer_shape(layout, NB, BS, H, d)
    layer = torch.zeros(shape, dtype=qdtype)
    scale = torch.full(shape[:-1], -7.0)
    zero = torch.full(shape[:-1], -9.0) if qdtype == torch.int8 else None
    key = _special_rows(torch.randn(23, H, d, generator=gen) * 3).to(dtype)
    value = (torch.randn(23, H, d, generator=gen) * 1e3).to(dtype)
    slots = torch.randperm(NB * BS, generator=gen)[:23]
    slots[6::4] = -1  # padding, but never one of the special rows 0..4
    want = clones(layer, scale, zero)
    ref.write_kv(want[0], slots, key, value, layout=layout, kv_scale=want[1], kv_zero=want[2])
    for dims in ({}, SMALL_GRID):
        got = clones(layer, scale, zero)
        emu.write_kv(got[0], slots, key, value, layout=layout, kv_scale=got[1], kv_zero=got[2], **dims)
        for g, w in zip(got, want):
            if w is not None:
                assert_same(g, w)


def test_write_kv_skips_slots_past_the_end_instead_of_writing_them():
    # The reference raises; on a GPU the slots are not read on the host, so the
    # kernel's own guard must keep the write inside the layer.
    gen = torch.Generator().manual_seed(5)
    layer = random_layer("NHD", torch.float32, 16, gen=gen)
    key, value = tokens(6, 16, torch.float32, "contiguous", gen)
    slots = torch.tensor([0, NB * BS, 7, NB * BS + 100, 2**40, 9])
    with pytest.raises(InvalidArgumentError, match=r"slot_mapping: expected slots < 35"):
        ref.write_kv(layer.clone(), slots, key, value)
    want = layer.clone()
    ref.write_kv(want, torch.where(slots >= NB * BS, -1, slots), key, value)
    got = layer.clone()
    emu.write_kv(got, slots, key, value)
    assert_same(got, want)


# ----------------------------------------------------------------------------------
# gather_kv / gather_kv_padded


def _tables(gen, bs=BS, nb=NB):
    """Sequences of 0, 1, bs (one full block) and 2*bs+3 tokens over distinct blocks.
    CSR rows list one spare block past what each sequence needs and the padded table
    pads with -1: neither may be read."""
    lens = [0, 1, bs, 2 * bs + 3]
    blocks = torch.randperm(nb, generator=gen).tolist()
    need = [-(-n // bs) for n in lens]
    rows, k = [], 0
    for n in need:
        rows.append(blocks[k : k + n])
        k += n
    spare = [999, -3, 12345, -1]  # out of range on purpose: never read
    indices, indptr = [], [0]
    for row, extra in zip(rows, spare):
        indices += row + [extra]
        indptr.append(len(indices))
    width = max(need) + 1
    table = torch.full((len(lens), width), -1, dtype=torch.int32)
    for b, row in enumerate(rows):
        table[b, : len(row)] = torch.tensor(row, dtype=torch.int32)
    as32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    return as32(indptr), as32(indices), table, as32(lens)


def _gather_both(fn_ref, fn_emu, layer, table_args, **kw):
    want = fn_ref(layer, *table_args, **kw)
    for dims in ({}, SMALL_GRID, ONE_THREAD):
        got = fn_emu(layer, *table_args, **kw, **dims)
        for g, w in zip(got, want):
            assert_same(g, w)
    return want


@pytest.mark.parametrize("out", ["fresh", "given", "misaligned"])
@pytest.mark.parametrize("table", ["csr", "padded"])
@pytest.mark.parametrize("d", [3, 17, 80])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", MODEL, ids=name)
def test_gather_copies_like_the_reference(dtype, layout, d, table, out):
    gen = torch.Generator().manual_seed(d * 3 + len(out))
    layer = random_layer(layout, dtype, d, gen=gen)
    indptr, indices, block_table, lens = _tables(gen)
    kw = {"layout": layout}
    total = int(lens.sum())
    if out != "fresh":
        offset = 1 if out == "misaligned" else 0
        kw["out_key"] = offset_view(torch.zeros(total, H, d, dtype=dtype), offset)
        kw["out_value"] = offset_view(torch.zeros(total, H, d, dtype=dtype), offset)
    if table == "csr":
        args, fns = (indptr, indices, lens), (ref.gather_kv, emu.gather_kv)
        launch = plans.plan_gather(layer, lens, indptr=indptr, indices=indices, **kw)[0][0]
    else:
        args, fns = (block_table, lens), (ref.gather_kv_padded, emu.gather_kv_padded)
        launch = plans.plan_gather(layer, lens, block_table=block_table, **kw)[0][0]
    vector = out != "misaligned" and (d * layer.element_size()) % 16 == 0
    assert launch.kernel.endswith("_v16" if vector else f"_e{layer.element_size()}")
    if out != "fresh":  # reference and emulation each get their own outputs
        kw_ref = dict(kw, out_key=kw["out_key"].clone(), out_value=kw["out_value"].clone())
        want = fns[0](layer, *args, **kw_ref)
        got = fns[1](layer, *args, **kw)
        assert got[0] is kw["out_key"] and got[1] is kw["out_value"]
        for g, w in zip(got, want):
            assert_same(g, w)
    else:
        _gather_both(fns[0], fns[1], layer, args, **kw)


@pytest.mark.parametrize("table", ["csr", "padded"])
@pytest.mark.parametrize("d", [3, 80])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("out_dtype", MODEL, ids=name)
@pytest.mark.parametrize("qdtype", QUANT, ids=name)
def test_gather_dequantizes_like_the_reference(qdtype, out_dtype, layout, d, table):
    gen = torch.Generator().manual_seed(d + 11 * MODEL.index(out_dtype))
    layer, scale, zero = quantized_layer(layout, qdtype, d, gen=gen)
    indptr, indices, block_table, lens = _tables(gen)
    args = (indptr, indices, lens) if table == "csr" else (block_table, lens)
    fns = (ref.gather_kv, emu.gather_kv) if table == "csr" else (ref.gather_kv_padded, emu.gather_kv_padded)
    _gather_both(*fns, layer, args, layout=layout, out_dtype=out_dtype, kv_scale=scale, kv_zero=zero)


def test_gather_reads_zeros_for_a_bad_block_id_instead_of_other_memory():
    gen = torch.Generator().manual_seed(9)
    layer = random_layer("HND", torch.float16, 8, gen=gen)
    indptr, indices, _, lens = _tables(gen)
    bad = indices.clone()
    bad[int(indptr[3])] = NB + 4  # the first block of the last sequence
    with pytest.raises(InvalidBlockError, match=r"indices: expected block ids in \[0, 7\)"):
        ref.gather_kv(layer, indptr, bad, lens, layout="HND")
    want_k, want_v = ref.gather_kv(layer, indptr, indices, lens, layout="HND")
    first = int(lens[:3].sum())
    want_k[first : first + BS] = 0
    want_v[first : first + BS] = 0
    got = emu.gather_kv(layer, indptr, bad, lens, layout="HND")
    assert_same(got[0], want_k)
    assert_same(got[1], want_v)


# ----------------------------------------------------------------------------------
# copy_blocks / swap_blocks


def _arenas(kind: str, d: int, gen, nb=NB, layers=3):
    """All-layer arenas: [data] or [data, scale] or [data, scale, zero]."""
    if kind == "f16":
        return [torch.randn(layers, nb, 2, BS, H, d, generator=gen).to(torch.float16)]
    qdtype = torch.float8_e5m2 if kind == "fp8" else torch.int8
    data = torch.randint(0, 256, (layers, nb, 2, BS, H, d), dtype=torch.int32, generator=gen)
    out = [data.to(torch.uint8).view(qdtype), torch.randn(layers, nb, 2, BS, H, generator=gen)]
    if kind == "int8":
        out.append(torch.randn(layers, nb, 2, BS, H, generator=gen))
    return out


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=name)
@pytest.mark.parametrize("d", [3, 16])
@pytest.mark.parametrize("kind", ["f16", "fp8", "int8"])
def test_copy_blocks_like_the_reference(kind, d, index_dtype):
    gen = torch.Generator().manual_seed(d + len(kind))
    arenas = _arenas(kind, d, gen)
    pairs = torch.tensor([[0, 3], [5, 1], [2, 6]], dtype=index_dtype)
    want = clones(*arenas)
    ref.copy_blocks(want, pairs)
    for dims in ({}, SMALL_GRID):
        got = clones(*arenas)
        emu.copy_blocks(got, pairs, **dims)
        for g, w in zip(got, want):
            assert_same(g, w)


def test_copy_blocks_rejects_host_pairs_like_the_reference():
    arenas = _arenas("f16", 4, torch.Generator().manual_seed(0))
    for pairs, message in (
        (torch.tensor([[0, 3], [1, 3]]), r"pairs: expected distinct dst block ids, got 3 twice \(row 1\)"),
        (torch.tensor([[0, 3], [3, 1]]), r"pairs: expected dst ids that are not also src ids, got 3 \(row 0\)"),
        (torch.tensor([[0, NB]]), r"pairs: expected block ids in \[0, 7\), got 7 at dst row 0"),
    ):
        for fn in (ref.copy_blocks, emu.copy_blocks):
            before = clones(*arenas)
            with pytest.raises(InvalidBlockError, match=message):
                fn(arenas, pairs)
            assert_same(arenas[0], before[0])  # nothing was written


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=name)
@pytest.mark.parametrize("kind", ["f16", "fp8", "int8"])
def test_swap_blocks_between_arenas_of_different_sizes(kind, index_dtype):
    gen = torch.Generator().manual_seed(len(kind))
    src = _arenas(kind, 5, gen, nb=6)
    dst = _arenas(kind, 5, gen, nb=9)
    pairs = torch.tensor([[5, 8], [0, 0], [3, 4]], dtype=index_dtype)
    want = clones(*dst)
    ref.swap_blocks(src, want, pairs)
    got = clones(*dst)
    emu.swap_blocks(src, got, pairs, **SMALL_GRID)
    for g, w in zip(got, want):
        assert_same(g, w)


# ----------------------------------------------------------------------------------
# convert_layout


@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("whole", [True, False], ids=["arena", "layer"])
@pytest.mark.parametrize("d", [3, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn], ids=name)
def test_convert_layout_like_the_reference(dtype, d, whole, offset):
    gen = torch.Generator().manual_seed(d)
    data = random_layer("NHD", dtype, d, gen=gen)
    if whole:
        data = torch.stack([data, random_layer("NHD", dtype, d, gen=gen)])
    data = offset_view(data, offset) if offset else data
    scale = offset_view(torch.randn(data.shape[:-1], generator=gen), offset)
    for src, dst in (("NHD", "HND"), ("HND", "NHD"), ("NHD", "NHD")):
        for t, is_scale in ((data, False), (scale, True)):
            want = ref.convert_layout(t, src, dst, scale=is_scale)
            for dims in ({}, SMALL_GRID):
                assert_same(emu.convert_layout(t, src, dst, scale=is_scale, **dims), want)


def test_convert_layout_round_trip_restores_the_arena():
    data = random_layer("HND", torch.float16, 8, gen=torch.Generator().manual_seed(1))
    assert_same(emu.convert_layout(emu.convert_layout(data, "HND", "NHD"), "NHD", "HND"), data)


# ----------------------------------------------------------------------------------
# 64-bit offsets


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn], ids=name)
def test_offsets_beyond_the_int32_range(dtype, layout):
    # A layer of more than 2**31 elements (byte offsets past 2**32). torch.empty
    # only reserves it: pages are committed where the kernels actually touch.
    nb, bs, h, d = 66_000, 16, 8, 128
    layer = torch.empty(layer_shape(layout, nb, bs, h, d), dtype=dtype)
    assert layer.numel() > 2**31
    scale = torch.zeros(layer.shape[:-1]) if dtype != torch.float16 else None
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(3, h, d, generator=gen).half()
    value = torch.randn(3, h, d, generator=gen).half()
    slots = torch.tensor([(nb - 1) * bs + 15, (nb - 2) * bs, 5])
    emu.write_kv(layer, slots, key, value, layout=layout, kv_scale=scale)
    table = torch.tensor([[nb - 1], [nb - 2], [0]], dtype=torch.int32)
    lens = torch.tensor([16, 1, 6], dtype=torch.int32)
    out = {"out_dtype": torch.float16} if scale is not None else {}
    got = emu.gather_kv_padded(layer, table, lens, layout=layout, kv_scale=scale, **out)
    want = ref.gather_kv_padded(layer, table, lens, layout=layout, kv_scale=scale, **out)
    for g, w in zip(got, want):
        assert_same(g, w)
    if scale is None:  # the written rows read back exactly where torch indexing finds them
        assert_same(got[0][15], key[0])
        assert_same(got[1][16], value[1])
        assert_same(got[0][22], key[2])


# ----------------------------------------------------------------------------------
# validation: the kernels' own checks, and the reference's passed through


def test_non_contiguous_layer_is_rejected():
    layer = random_layer("NHD", torch.float32, 8).transpose(2, 3)
    k, v = tokens(2, 8, torch.float32, "contiguous", None)
    with pytest.raises(InvalidArgumentError, match=r"kv_layer: expected a contiguous tensor, got strides"):
        plans.plan_write_kv(layer, torch.tensor([0, 1]), k[:, :BS], v[:, :BS], layout="HND")


def test_strided_head_dim_is_rejected():
    layer = random_layer("NHD", torch.float32, 4)
    k = torch.randn(2, H, 8)[:, :, ::2]
    with pytest.raises(InvalidArgumentError, match=r"key: expected unit stride in the last dim \(head_dim\), got strides \(24, 8, 2\)"):
        plans.plan_write_kv(layer, torch.tensor([0, 1]), k, k.contiguous())


def test_reference_checks_come_first_with_their_messages():
    layer = random_layer("NHD", torch.float16, 4)
    k = torch.randn(2, H, 4)
    with pytest.raises(DTypeError, match=r"key: expected dtype torch.float16 \(the kv_layer dtype\), got torch.float32"):
        emu.write_kv(layer, torch.tensor([0, 1]), k, k)
    with pytest.raises(ShapeError, match=r"slot_mapping: expected \[2\] \(one slot per token\), got \(3,\)"):
        emu.write_kv(layer, torch.tensor([0, 1, 2]), k.half(), k.half())


def test_quantized_write_needs_a_head_dim():
    layer = torch.zeros(NB, 2, BS, H, 0, dtype=torch.int8)
    scale, zero = torch.zeros(NB, 2, BS, H), torch.zeros(NB, 2, BS, H)
    k = torch.zeros(1, H, 0)
    with pytest.raises(ShapeError, match=r"key: expected a non-empty head_dim for a quantized kv_layer"):
        plans.plan_write_kv(layer, torch.tensor([0]), k, k, kv_scale=scale, kv_zero=zero)


def test_emulation_refuses_non_host_tensors():
    layer = torch.empty(layer_shape("NHD", NB, BS, H, 4), device="meta")
    with pytest.raises(DeviceError, match=r"kv_layer: expected a CPU tensor \(the emulation runs on the host\), got meta"):
        emu.write_kv(layer, torch.tensor([0]), torch.empty(1, H, 4, device="meta"), torch.empty(1, H, 4, device="meta"))


def test_launch_dims_beyond_the_hardware_are_rejected():
    layer = random_layer("NHD", torch.float32, 4)
    k, v = tokens(2, 4, torch.float32, "contiguous", None)
    with pytest.raises(InvalidArgumentError, match=r"block: expected at most 1024 threads"):
        emu.write_kv(layer, torch.tensor([0, 1]), k, v, grid=(1, 1, 1), block=(64, 32, 1))
    with pytest.raises(InvalidArgumentError, match=r"grid: expected 1 <= x"):
        emu.write_kv(layer, torch.tensor([0, 1]), k, v, grid=(1, 70000, 1), block=(1, 1, 1))


@pytest.mark.parametrize("rows,cols", [(1, 1), (5, 3), (10**6, 16), (3, 10**5), (10**9, 10**9)])
def test_planned_dims_are_valid_and_cover_a_row(rows, cols):
    grid, block = plans.launch_dims(rows, cols)
    plans.check_dims(grid, block)
    assert block[0] * block[1] <= plans.THREADS
    assert block[0] >= min(cols, plans.THREADS) or block[0] == plans.THREADS


def test_empty_work_plans_no_launch():
    layer = random_layer("NHD", torch.float32, 4)
    k = torch.zeros(0, H, 4)
    assert plans.plan_write_kv(layer, torch.zeros(0, dtype=torch.int64), k, k) == []
    assert plans.plan_copy_blocks([layer[None]], torch.zeros(0, 2, dtype=torch.int64)) == []


# ----------------------------------------------------------------------------------
# the CUDA launchers' first checks run (and must refuse) without a GPU


class _HostDLPack:
    """A foreign host tensor that only speaks DLPack."""

    def __init__(self, t):
        self._t = t

    def __dlpack__(self, **kw):
        return self._t.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._t.__dlpack_device__()


@pytest.mark.parametrize("wrap", [lambda t: t, _HostDLPack], ids=["torch", "dlpack"])
def test_cuda_launchers_refuse_host_tensors_before_any_gpu_work(wrap):
    from pagedkv.kernels import ops

    layer = wrap(torch.zeros(layer_shape("NHD", NB, BS, H, 4)))
    x = torch.zeros(1, H, 4)
    calls = [
        (lambda: ops.write_kv(layer, torch.tensor([0]), x, x), "kv_layer"),
        (lambda: ops.gather_kv(layer, torch.zeros(1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32),
                               torch.zeros(0, dtype=torch.int32)), "kv_layer"),
        (lambda: ops.gather_kv_padded(layer, torch.zeros(0, 1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32)),
         "kv_layer"),
        (lambda: ops.copy_blocks([layer], torch.zeros(0, 2, dtype=torch.int64)), r"arenas\[0\]"),
        (lambda: ops.convert_layout(layer, "NHD", "HND"), "arena"),
    ]
    for call, arg in calls:
        with pytest.raises(DeviceError, match=rf"^{arg}: expected a CUDA tensor, got cpu$"):
            call()
    with pytest.raises(DeviceError, match=r"src_arenas: expected a CUDA tensor on one side of the swap, got cpu"):
        ops.swap_blocks([layer], [layer], torch.zeros(0, 2, dtype=torch.int64))


def test_cuda_launchers_refuse_non_tensors():
    from pagedkv.kernels import ops

    with pytest.raises(DTypeError, match=r"kv_layer: expected a torch.Tensor or a DLPack tensor, got list"):
        ops.write_kv([1.0], torch.tensor([0]), None, None)
    with pytest.raises(InvalidArgumentError, match=r"arenas: expected a tensor or a non-empty list of tensors"):
        ops.copy_blocks([], torch.zeros(0, 2, dtype=torch.int64))


# ----------------------------------------------------------------------------------
# AddressSanitizer: the emulation library rebuilt with -fsanitize=address, loaded
# into a child Python with libasan preloaded, runs one case of every kernel family
# (vector and scalar paths, guards); torch's CPU tensors come from the intercepted
# allocator, so every out-of-bounds kernel access would be reported. Result so far:
# clean, and the negative control below is reported as a heap-buffer-overflow.


_ASAN_DRIVER = r"""
import dataclasses, sys, torch
sys.path[:0] = [sys.argv[1]]
import test_kernels_emulated as t
from pagedkv.kernels import emulation as emu, plans

if sys.argv[2:] == ["overflow"]:  # negative control: one token more than key/value hold
    layer = t.random_layer("NHD", torch.float32, 4)
    k, v = t.tokens(2, 4, torch.float32, "contiguous", None)
    ln = plans.plan_write_kv(layer, torch.tensor([0, 1]), k, v)[0]
    args = list(ln.args)
    args[4] = ("i64", 3)
    emu.run([dataclasses.replace(ln, args=tuple(args))])
    print("NOT-CAUGHT", flush=True)
    sys.exit(0)
# one small case of every kernel family, incl. vector and scalar paths and the guards
for layout in t.LAYOUTS:
    for d, kind in ((16, "contiguous"), (3, "misaligned")):
        t.test_write_kv_copies_like_the_reference(torch.float16, layout, d, kind)
        t.test_gather_copies_like_the_reference(torch.float32, layout, d, "csr", "fresh")
        t.test_gather_copies_like_the_reference(torch.bfloat16, layout, d, "padded", "misaligned")
    for q in t.QUANT:
        t.test_write_kv_quantizes_like_the_reference(torch.bfloat16, q, layout, 17)
        t.test_gather_dequantizes_like_the_reference(q, torch.float16, layout, 3, "padded")
        t.test_gather_dequantizes_like_the_reference(q, torch.float32, layout, 17, "csr")
t.test_write_kv_skips_slots_past_the_end_instead_of_writing_them()
t.test_gather_reads_zeros_for_a_bad_block_id_instead_of_other_memory()
for kind in ("f16", "fp8", "int8"):
    t.test_copy_blocks_like_the_reference(kind, 3, torch.int32)
    t.test_swap_blocks_between_arenas_of_different_sizes(kind, torch.int64)
for dtype in (torch.float32, torch.float8_e4m3fn):
    t.test_convert_layout_like_the_reference(dtype, 3, True, 1)
print("ASAN-CLEAN", flush=True)
"""


def _run_under_asan(tmp_path, *extra):
    libasan = subprocess.run([emu.CXX, "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    if not libasan or not Path(libasan).is_file():
        pytest.skip(f"{emu.CXX} has no libasan.so")
    env = dict(os.environ, LD_PRELOAD=libasan, ASAN_OPTIONS="detect_leaks=0:abort_on_error=0",
               PAGEDKV_EMULATION_SANITIZE="address")
    package_root = str(Path(emu.__file__).resolve().parents[2])  # the pagedkv under test
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    root = str(Path(__file__).resolve().parent)
    script = tmp_path / "asan_driver.py"
    script.write_text(_ASAN_DRIVER)
    return subprocess.run([sys.executable, str(script), root, *extra], env=env, capture_output=True, text=True,
                          timeout=600)


def test_emulation_is_clean_under_address_sanitizer(tmp_path):
    proc = _run_under_asan(tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "ASAN-CLEAN" in proc.stdout
    assert "AddressSanitizer" not in proc.stderr


def test_address_sanitizer_catches_an_out_of_bounds_launch(tmp_path):
    # Proves the ASan run above could fail: a launch told of one token more than
    # the inputs hold must be reported, not pass silently.
    proc = _run_under_asan(tmp_path, "overflow")
    assert "NOT-CAUGHT" not in proc.stdout
    assert "ERROR: AddressSanitizer: heap-buffer-overflow" in proc.stderr
    assert proc.returncode != 0
