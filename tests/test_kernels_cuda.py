"""The CUDA launchers on a real GPU match the torch reference (run on the CPU) bit
for bit. Marked ``cuda``; skipped with the reason where no GPU exists. On such
machines the same kernels are compiled by NVRTC (test_kernels_compile.py) and run
through the host emulation (test_kernels_emulated.py).
"""
from __future__ import annotations

import pytest
import torch

from pagedkv.errors import DeviceError, InvalidArgumentError
from pagedkv.ops import reference as ref

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="no CUDA GPU here (torch.cuda.is_available() is False); the kernels are compiled by "
        "test_kernels_compile.py and run on the CPU by test_kernels_emulated.py",
    ),
]

MODEL = (torch.float32, torch.float16, torch.bfloat16)
QUANT = (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)
LAYOUTS = ("NHD", "HND")
NB, BS, H = 13, 16, 4


@pytest.fixture(scope="module")
def ops():
    from pagedkv.kernels import ops as kernel_ops

    return kernel_ops


def name(x) -> str:
    return str(x).replace("torch.", "")


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    got, want = got.cpu(), want.cpu()
    assert got.shape == want.shape and got.dtype == want.dtype
    if got.dtype.is_floating_point and got.element_size() > 1:
        gn, wn = torch.isnan(got.float()), torch.isnan(want.float())
        assert torch.equal(gn, wn)
        got, want = got.masked_fill(gn, 0), want.masked_fill(wn, 0)
    assert torch.equal(got.contiguous().view(-1).view(torch.uint8), want.contiguous().view(-1).view(torch.uint8))


def shape_of(layout, d):
    return (NB, 2, BS, H, d) if layout == "NHD" else (NB, 2, H, BS, d)


def offset_copy(t: torch.Tensor, offset: int) -> torch.Tensor:
    buf = torch.empty(t.numel() + offset, dtype=t.dtype, device=t.device)
    view = buf[offset:].view(t.shape)
    view.copy_(t)
    return view


def inputs(n, d, dtype, kind, gen):
    k = (torch.randn(n, H, d, generator=gen) * 3).to(dtype)
    v = torch.randn(n, H, d, generator=gen).to(dtype)
    if kind == "qkv":
        fused = torch.cat([k.reshape(n, -1), v.reshape(n, -1)], dim=1).cuda()
        return k, v, fused[:, : H * d].view(n, H, d), fused[:, H * d :].view(n, H, d)
    dk, dv = k.cuda(), v.cuda()
    if kind == "misaligned":
        dk, dv = offset_copy(dk, 1), offset_copy(dv, 1)
    return k, v, dk, dv


def slots_for(n, gen):
    s = torch.randperm(NB * BS, generator=gen)[:n]
    s[::5] = -1
    return s


@pytest.mark.parametrize("kind", ["contiguous", "qkv", "misaligned"])
@pytest.mark.parametrize("d", [3, 80, 128])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", MODEL, ids=name)
def test_write_kv(ops, dtype, layout, d, kind):
    gen = torch.Generator().manual_seed(d)
    layer = torch.randn(shape_of(layout, d), generator=gen).to(dtype)
    k, v, dk, dv = inputs(57, d, dtype, kind, gen)
    slots = slots_for(57, gen)
    want = layer.clone()
    ref.write_kv(want, slots, k, v, layout=layout)
    got = layer.cuda()
    ops.write_kv(got, slots.cuda(), dk, dv, layout=layout)
    assert_same(got, want)


@pytest.mark.parametrize("d", [17, 128])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("qdtype", QUANT, ids=name)
@pytest.mark.parametrize("dtype", MODEL, ids=name)
def test_write_kv_quantized(ops, dtype, qdtype, layout, d):
    gen = torch.Generator().manual_seed(d + 1)
    shape = shape_of(layout, d)
    bufs = [torch.zeros(shape, dtype=qdtype), torch.zeros(shape[:-1])]
    bufs.append(torch.zeros(shape[:-1]) if qdtype == torch.int8 else None)
    k, v, dk, dv = inputs(57, d, dtype, "contiguous", gen)
    k[1, 0] = 0  # scale 0 -> 1 (row 0 is padding: slots_for pads every fifth token)
    k[2, 1, 0] = float("inf")
    dk = k.cuda()
    slots = slots_for(57, gen)
    want = [b.clone() if b is not None else None for b in bufs]
    ref.write_kv(want[0], slots, k, v, layout=layout, kv_scale=want[1], kv_zero=want[2])
    got = [b.cuda() if b is not None else None for b in bufs]
    ops.write_kv(got[0], slots.cuda(), dk, dv, layout=layout, kv_scale=got[1], kv_zero=got[2])
    for g, w in zip(got, want):
        if w is not None:
            assert_same(g, w)


def tables(gen):
    lens = [0, 1, BS, 3 * BS + 5, 40]
    blocks = torch.randperm(NB, generator=gen).tolist()
    rows, k = [], 0
    for n in lens:
        rows.append(blocks[k : k + -(-n // BS)])
        k += len(rows[-1])
    indptr = torch.tensor([0] + [sum(len(r) for r in rows[: i + 1]) for i in range(len(rows))], dtype=torch.int32)
    indices = torch.tensor(sum(rows, []), dtype=torch.int32)
    table = torch.full((len(lens), max(len(r) for r in rows) + 1), -1, dtype=torch.int32)
    for b, r in enumerate(rows):
        table[b, : len(r)] = torch.tensor(r, dtype=torch.int32)
    return indptr, indices, table, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("given_out", [False, True])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", MODEL + QUANT, ids=name)
def test_gather(ops, dtype, layout, padded, given_out):
    gen = torch.Generator().manual_seed(7)
    d = 64
    shape = shape_of(layout, d)
    kw = {"layout": layout}
    if dtype in QUANT:
        layer, scale = torch.zeros(shape, dtype=dtype), torch.zeros(shape[:-1])
        zero = torch.zeros(shape[:-1]) if dtype == torch.int8 else None
        src = torch.randn(NB * BS, H, d, generator=gen)
        ref.write_kv(layer, torch.arange(NB * BS), src, src * 2, layout=layout, kv_scale=scale, kv_zero=zero)
        kw.update(out_dtype=torch.bfloat16, kv_scale=scale, kv_zero=zero)
    else:
        layer = torch.randn(shape, generator=gen).to(dtype)
    indptr, indices, table, lens = tables(gen)
    cpu_args = (table, lens) if padded else (indptr, indices, lens)
    fn_ref = ref.gather_kv_padded if padded else ref.gather_kv
    want = fn_ref(layer, *cpu_args, **kw)
    dkw = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    if given_out:
        dkw["out_key"] = torch.empty_like(want[0], device="cuda")
        dkw["out_value"] = torch.empty_like(want[1], device="cuda")
    fn = ops.gather_kv_padded if padded else ops.gather_kv
    got = fn(layer.cuda(), *[a.cuda() for a in cpu_args], **dkw)
    assert_same(got[0], want[0])
    assert_same(got[1], want[1])


@pytest.mark.parametrize("pairs_on", ["cpu", "cuda"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=name)
@pytest.mark.parametrize("qdtype", [torch.float16, torch.float8_e4m3fn, torch.int8], ids=name)
def test_copy_blocks(ops, qdtype, index_dtype, pairs_on):
    gen = torch.Generator().manual_seed(3)
    shape = (3, NB, 2, BS, H, 24)
    if qdtype == torch.float16:
        data = torch.randn(shape, generator=gen).half()
    else:  # raw codes below 0x78: no fp8 NaN
        data = torch.randint(0, 120, shape, dtype=torch.int32, generator=gen).to(torch.uint8).view(qdtype)
    arenas = [data, torch.randn(3, NB, 2, BS, H, generator=gen)]
    pairs = torch.tensor([[0, 5], [7, 1], [2, 12]], dtype=index_dtype)
    want = [a.clone() for a in arenas]
    ref.copy_blocks(want, pairs)
    got = [a.cuda() for a in arenas]
    ops.copy_blocks(got, pairs.to(pairs_on))
    for g, w in zip(got, want):
        assert_same(g, w)


def test_swap_blocks_out_to_pinned_host_and_back(ops):
    gen = torch.Generator().manual_seed(4)
    dev = [torch.randn(2, NB, 2, BS, H, 32, generator=gen).cuda()]
    host = [torch.zeros(2, 30, 2, BS, H, 32).pin_memory()]
    out_pairs = torch.tensor([[3, 29], [9, 0]])
    ops.swap_blocks(dev, host, out_pairs)
    torch.cuda.synchronize()
    want = torch.zeros(2, 30, 2, BS, H, 32)
    ref.swap_blocks([dev[0].cpu()], [want], out_pairs)
    assert_same(host[0], want)
    back = [torch.zeros_like(dev[0])]
    ops.swap_blocks(host, back, torch.tensor([[29, 1]]))
    assert_same(back[0][:, 1], dev[0][:, 3])


def test_swap_blocks_refuses_pageable_host_memory(ops):
    dev = [torch.zeros(1, 4, 2, BS, H, 8, device="cuda")]
    host = [torch.zeros(1, 4, 2, BS, H, 8)]
    with pytest.raises(DeviceError, match=r"dst_arenas\[0\]: expected pinned host memory \(tensor.pin_memory\(\)\), got pageable host memory"):
        ops.swap_blocks(dev, host, torch.tensor([[0, 1]]))


@pytest.mark.parametrize("scale", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e5m2], ids=name)
def test_convert_layout(ops, dtype, scale):
    gen = torch.Generator().manual_seed(5)
    t = torch.randn(2, NB, 2, BS, H, generator=gen) if scale else torch.randn(2, NB, 2, BS, H, 40, generator=gen).to(dtype)
    for src, dst in (("NHD", "HND"), ("HND", "NHD"), ("NHD", "NHD")):
        assert_same(ops.convert_layout(t.cuda(), src, dst, scale=scale), ref.convert_layout(t, src, dst, scale=scale))


class _DLPackOnly:
    """A foreign tensor: only the DLPack protocol."""

    def __init__(self, t):
        self._t = t

    def __dlpack__(self, **kw):
        return self._t.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._t.__dlpack_device__()


class _Stream:
    def __init__(self, s):
        self._s = s

    def __cuda_stream__(self):
        return (0, self._s.cuda_stream)


@pytest.mark.parametrize("how", ["torch", "int", "protocol"])
def test_launches_go_to_the_callers_stream_and_accept_dlpack(ops, how):
    gen = torch.Generator().manual_seed(6)
    layer = torch.zeros(shape_of("NHD", 128), dtype=torch.float16, device="cuda")
    k, v, dk, dv = inputs(200, 128, torch.float16, "contiguous", gen)
    slots = torch.arange(200)
    dslots = slots.cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # the inputs above are ready
    stream = {"torch": side, "int": side.cuda_stream, "protocol": _Stream(side)}[how]
    ops.write_kv(_DLPackOnly(layer), _DLPackOnly(dslots), _DLPackOnly(dk), _DLPackOnly(dv), stream=stream)
    side.synchronize()
    want = torch.zeros(shape_of("NHD", 128), dtype=torch.float16)
    ref.write_kv(want, slots, k, v)
    assert_same(layer, want)


def test_bad_stream_is_refused(ops):
    layer = torch.zeros(shape_of("NHD", 8), device="cuda")
    x = torch.zeros(1, H, 8, device="cuda")
    with pytest.raises(InvalidArgumentError, match=r"stream: expected None, a torch.cuda.Stream, an int handle"):
        ops.write_kv(layer, torch.tensor([0], device="cuda"), x, x, stream="default")


def test_module_loads_as_cubin_for_this_device():
    from pagedkv.kernels import build, driver

    major, minor = driver.compute_capability(torch.cuda.current_device())
    module = build.build_and_load("copy_blocks.cu", torch.cuda.current_device())
    assert module.function("pkv_copy_blocks_v16_i64") is not None
    assert (major, minor) >= (8, 0)
