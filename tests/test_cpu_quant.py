"""The compiled quantizing write and dequantizing gather of the 'cpu' backend
(pagedkv/ops/_cpu_quant.pyx + quant_rows.h) against the torch reference, bit for bit,
over inputs chosen to hit every branch of the arithmetic: random float32 bit patterns
(NaN of both signs, infinities, subnormals, every exponent), rows scaled across the
whole float32 range, and calls large enough to take the parallel path.

Equality over the layouts and table kinds runs for every backend in test_backends.py.
"""

import pytest
import torch
from backend_cases import (
    QUANT,
    assert_same,
    assert_same_views,
    calls_while_flipping,
    csr,
    padded,
    params,
    quant_name,
    quant_views,
    storage,
)

from pagedkv.errors import InvalidBlockError
from pagedkv.format import dtypes
from pagedkv.ops import cpu as cpu_ops
from pagedkv.ops import reference as ref

pytestmark = pytest.mark.skipif(not cpu_ops.AVAILABLE, reason="pagedkv.ops._cpu_quant is not built")

MODEL = (torch.float32, torch.float16, torch.bfloat16)


def hostile_rows(n, h, d, gen):
    """[n, h, d] float32: half the rows random bit patterns, half randn scaled by 10^k
    for k across float32's range (tiny rows quantize through subnormal scales)."""
    bits = torch.randint(-(2**31), 2**31, (n, h, d), generator=gen, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32).clone()
    exps = torch.randint(-44, 38, (n, 1, 1), generator=gen).to(torch.float32)
    scaled = torch.randn(n, h, d, generator=gen) * torch.pow(10.0, exps)
    x[n // 2 :] = scaled[n // 2 :]
    return x


def fresh(layout, qdtype, d, nb, bs, h):
    shape, sshape, zero_point = quant_views(layout, qdtype, d, nb=nb, bs=bs, h=h)
    p = params(qdtype)
    return [torch.zeros(shape, dtype=torch.uint8).view(storage(qdtype)), torch.full(sshape, -3.0, dtype=p),
            torch.full(sshape, -5.0, dtype=p) if zero_point else None]


@pytest.mark.parametrize("in_dtype", MODEL, ids=str)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("qdtype", QUANT, ids=quant_name)
def test_hostile_values_quantize_and_dequantize_like_the_reference(qdtype, layout, in_dtype):
    gen = torch.Generator().manual_seed(QUANT.index(qdtype) * 10 + MODEL.index(in_dtype))
    nb, bs, h, d = 9, 4, 3, 32
    n = nb * bs
    x = hostile_rows(2 * n, h, d, gen).to(in_dtype)
    slots = torch.randperm(n, generator=gen)
    want, got = fresh(layout, qdtype, d, nb, bs, h), fresh(layout, qdtype, d, nb, bs, h)
    ref.write_kv(want[0], slots, x[:n], x[n:], layout=layout, kv_scale=want[1], kv_zero=want[2])
    cpu_ops.write_kv(got[0], slots, x[:n], x[n:], layout=layout, kv_scale=got[1], kv_zero=got[2])
    assert_same_views(got, want)
    tables = [list(range(0, nb, 2)), list(range(1, nb, 2))]
    lens = [len(tables[0]) * bs - 1, len(tables[1]) * bs]
    for out_dtype in MODEL:
        kw = dict(layout=layout, out_dtype=out_dtype, kv_scale=want[1], kv_zero=want[2])
        for g, w in zip(cpu_ops.gather_kv(want[0], *csr(tables, lens), **kw), ref.gather_kv(want[0], *csr(tables, lens), **kw)):
            assert_same(g, w)
        for g, w in zip(cpu_ops.gather_kv_padded(want[0], *padded(tables, lens), **kw),
                        ref.gather_kv_padded(want[0], *padded(tables, lens), **kw)):
            assert_same(g, w)


@pytest.mark.parametrize("qdtype", [q for q in QUANT if dtypes.info(q).compiled], ids=quant_name)
def test_large_calls_take_the_parallel_path_and_still_match(qdtype, monkeypatch):
    # Quantized arenas never fall back to the torch reference any more (int2 has no C
    # loops yet: it runs the torch definition by design).
    for fn in ("write_kv", "gather_kv", "gather_kv_padded"):
        monkeypatch.setattr(ref, fn, lambda *a, **k: pytest.fail("the cpu backend fell back to the reference"))
    gen = torch.Generator().manual_seed(3)
    nb, bs, h, d = 40, 16, 4, 64
    n = nb * bs  # 2 * 640 * 4 * 64 elements: far past the one-thread threshold
    k, v = torch.randn(n, h, d, generator=gen) * 3, torch.randn(n, h, d, generator=gen)
    slots = torch.randperm(n, generator=gen)
    got = fresh("NHD", qdtype, d, nb, bs, h)
    cpu_ops.write_kv(got[0], slots, k, v, kv_scale=got[1], kv_zero=got[2])
    monkeypatch.undo()
    want = fresh("NHD", qdtype, d, nb, bs, h)
    ref.write_kv(want[0], slots, k, v, kv_scale=want[1], kv_zero=want[2])
    assert_same_views(got, want)
    tables, lens = [list(range(nb))[::-1]], [n - 5]
    kw = dict(out_dtype=torch.bfloat16, kv_scale=want[1], kv_zero=want[2])
    for g, w in zip(cpu_ops.gather_kv(want[0], *csr(tables, lens), **kw), ref.gather_kv(want[0], *csr(tables, lens), **kw)):
        assert_same(g, w)


def test_block_ids_rewritten_by_another_thread_are_read_once():
    # The tables are snapshotted before validation: a block id flipped out of range
    # meanwhile is either refused by name or never seen; the gather never reads past
    # the arena (it is a view of a larger buffer whose tail would show up as NaN rows).
    nb, bs, h, d = 4, 4, 2, 8
    shape, sshape, _ = quant_views("NHD", "int8", d, nb=nb + 4, bs=bs, h=h)
    whole = [torch.zeros(shape, dtype=torch.int8), torch.ones(sshape), torch.zeros(sshape)]
    whole[2][nb:] = float("nan")
    layer = [t[:nb] for t in whole]
    indptr, indices, lens = csr([[0, 1, 2, 3]], [16])

    def no_nan(kv):
        assert not torch.isnan(kv[0]).any() and not torch.isnan(kv[1]).any()

    calls_while_flipping(
        indices, 2, nb + 1, 2,
        lambda: cpu_ops.gather_kv(layer[0], indptr, indices, lens, out_dtype=torch.float32, kv_scale=layer[1],
                                  kv_zero=layer[2]),
        2000, InvalidBlockError, "got 5", no_nan)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3", "int4", "int3"])
def test_slots_rewritten_by_another_thread_never_store_past_a_quantized_arena(kv_dtype):
    # The quantizing write snapshots the slots before it checks them: a slot flipped out
    # of range meanwhile is refused by the value the loop saw, or never seen. The arena
    # and its scale/zero views are views of larger buffers whose tails must stay zero.
    from pagedkv.errors import InvalidArgumentError

    nb, bs, h, d = 4, 4, 2, 8
    row = dtypes.info(kv_dtype)
    groups = (d // 8,) if row.grouped else ()
    data = torch.zeros((nb + 4, 2, bs, h, row.stored_dim(d)), dtype=row.torch_dtype)
    params = [torch.zeros((nb + 4, 2, bs, h) + groups, dtype=row.param_dtype) for _ in range(1 + row.zero_point)]
    views = [data[:nb]] + [p[:nb] for p in params]
    k, v = (torch.randn(8, h, d, generator=torch.Generator().manual_seed(i)) * 3 + 1 for i in (1, 2))
    slots = torch.arange(8, dtype=torch.int64)
    zero = views[2] if row.zero_point else None
    calls_while_flipping(slots, 5, nb * bs + 3, 5,
                         lambda: cpu_ops.write_kv(views[0], slots, k, v, kv_scale=views[1], kv_zero=zero),
                         2000, InvalidArgumentError, "got 19 at index 5")
    for whole in [data] + params:
        assert not bool(whole[nb:].view(torch.uint8).any()), kv_dtype
    assert bool(views[0].view(torch.uint8).any())  # the in-range rows were written


def test_every_quantized_format_has_a_compiled_loop():
    from pagedkv.ops import _cpu_quant

    assert sorted(_cpu_quant.QUANT_CODES) == sorted(d.name for d in dtypes.QUANTIZED if d.compiled)
    assert sorted(_cpu_quant.MODEL_CODES) == sorted(d.name for d in dtypes.MODEL)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("qdtype", QUANT, ids=quant_name)
def test_every_code_dequantizes_like_the_reference(qdtype, layout):
    # every byte value (fp8: NaN, subnormal and largest codes of both signs), under
    # scales and zero points of every magnitude
    gen = torch.Generator().manual_seed(QUANT.index(qdtype))
    nb, bs, h, d = 4, 4, 2, 32
    shape, sshape, zero_point = quant_views(layout, qdtype, d, nb=nb, bs=bs, h=h)
    data = (torch.arange(shape[0] * shape[1] * shape[2] * shape[3] * shape[4]) % 256).to(torch.uint8)
    data = data[torch.randperm(data.numel(), generator=gen)].view(shape).view(storage(qdtype))
    scale = hostile_rows(1, 1, sshape[0] * sshape[1] * sshape[2] * sshape[3] * (sshape[4] if len(sshape) > 4 else 1),
                         gen).view(sshape).to(params(qdtype))
    zero = (torch.randn(sshape, generator=gen) * 100).to(params(qdtype)) if zero_point else None
    tables, lens = [[3, 1], [0, 2]], [8, 7]
    for out_dtype in MODEL:
        kw = dict(layout=layout, out_dtype=out_dtype, kv_scale=scale, kv_zero=zero)
        for g, w in zip(cpu_ops.gather_kv(data, *csr(tables, lens), **kw), ref.gather_kv(data, *csr(tables, lens), **kw)):
            assert_same(g, w)


@pytest.mark.parametrize("qdtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_codes_decode_the_same_with_denormals_flushed(qdtype):
    # The AVX2 loops decode fp8 through float16 (F16C); fp8 subnormals must not meet a
    # float32 subnormal that a thread with flush-to-zero / denormals-are-zero would read
    # as 0. Scale 1 keeps every result a normal float32.
    data = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(1, 2, 4, 1, 32).view(storage(qdtype))
    scale = torch.ones(1, 2, 4, 1)
    args = csr([[0]], [4])
    want = ref.gather_kv(data, *args, out_dtype=torch.float32, kv_scale=scale)
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        got = cpu_ops.gather_kv(data, *args, out_dtype=torch.float32, kv_scale=scale)
    finally:
        torch.set_flush_denormal(False)
    assert bool((want[0][want[0] != 0].abs() < 2.0 ** -6).any())  # subnormal codes are in the sweep
    for g, w in zip(got, want):
        assert_same(g, w)


def _structured_floats() -> torch.Tensor:
    """Every sign/exponent/top-11-mantissa float32 pattern with the low 12 bits 0, 1,
    0x7ff, 0x800, 0x801, 0xfff: each round-down, tie and round-up case of a cast to
    fp8, float16 or bfloat16 (as tests/test_kernels_emulated.py proves the kernels')."""
    high = torch.arange(1 << 20, dtype=torch.int64) << 12
    low = torch.tensor([0, 1, 0x7FF, 0x800, 0x801, 0xFFF], dtype=torch.int64)
    return (high[:, None] | low[None, :]).view(-1).to(torch.int32).view(torch.float32)


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("qdtype", ["fp8_e4m3", "fp8_e5m2"], ids=quant_name)
def test_every_float_rounds_to_fp8_like_the_reference(qdtype, in_dtype):
    # A NaN in every row makes the scale 1, so each other element's code is the
    # saturating cast itself: the structured floats (float32 input) or every float16
    # pattern (float16 input, through the widening) reach the encoder unscaled.
    d = 64
    if in_dtype == torch.float32:
        x = _structured_floats()
    else:
        x = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16)
    rows = -(-x.numel() // (d - 1))
    x = torch.cat([x, torch.zeros(rows * (d - 1) - x.numel(), dtype=in_dtype)]).view(rows, 1, d - 1)
    x = torch.cat([torch.full((rows, 1, 1), float("nan"), dtype=in_dtype), x], dim=2)
    bs = 64
    nb = -(-rows // bs)
    slots = torch.arange(rows)
    want, got = fresh("NHD", qdtype, d, nb, bs, 1), fresh("NHD", qdtype, d, nb, bs, 1)
    half = rows // 2
    for w, fn in ((want, ref.write_kv), (got, cpu_ops.write_kv)):
        fn(w[0], slots[:half], x[:half], x[half:2 * half], kv_scale=w[1], kv_zero=w[2])
    assert bool((got[1][got[1] != -3.0] == 1.0).all())
    assert_same_views(got, want)


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16], ids=str)
def test_every_float_narrows_like_the_reference(out_dtype):
    # Code 1.0 under scale s dequantizes to s exactly: the structured floats as scales
    # reach the float32 -> float16/bfloat16 narrowing unchanged.
    s = _structured_floats()
    bs, d = 64, 2
    nb = -(-s.numel() // (2 * bs))
    scale = torch.cat([s, torch.ones(nb * 2 * bs - s.numel())]).view(nb, 2, bs, 1)
    data = torch.full((nb, 2, bs, 1, d), 0x38, dtype=torch.uint8).view(torch.float8_e4m3fn)  # e4m3 1.0
    tables, lens = [list(range(nb))], [nb * bs]
    kw = dict(out_dtype=out_dtype, kv_scale=scale)
    for g, w in zip(cpu_ops.gather_kv(data, *csr(tables, lens), **kw), ref.gather_kv(data, *csr(tables, lens), **kw)):
        assert_same(g, w)


_BASELINE_SCRIPT = r"""
import torch
from pagedkv.ops import _cpu_quant, cpu, reference as ref
from pagedkv.format.rotation import rotation_signs
from pagedkv.format.quant import storage_dtype
assert _cpu_quant.ROW_ISA == "baseline", _cpu_quant.ROW_ISA
gen = torch.Generator().manual_seed(0)
cases = 0
for kv, d, g in [("fp8_e4m3", 7, 1), ("fp8_e5m2", 80, 1), ("int8", 14, 1), ("int8", 128, 1), ("int4", 96, 32),
                 ("int4", 64, 16), ("int4", 2046, 1023)]:
    q = storage_dtype(kv)
    shape = (4, 2, 3, 2, d // 2 if kv == "int4" else d)
    sshape = shape[:-1] + ((d // g,) if kv == "int4" else ())
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for signs in (None, rotation_signs(d, d)):
            x = (torch.randn(2, 9, 2, d, generator=gen) * 5).to(dtype)
            x[:, :, 0, 1] = 300.0
            slots = torch.randperm(12, generator=gen)[:9]
            views = []
            for fn in (ref.write_kv, cpu.write_kv):
                v = [torch.zeros(shape, dtype=torch.uint8).view(q), torch.zeros(sshape),
                     None if kv.startswith("fp8") else torch.zeros(sshape)]
                fn(v[0], slots, x[0], x[1], kv_scale=v[1], kv_zero=v[2], rotation_signs=signs)
                views.append(v)
            for a, b in zip(*views):
                assert a is None or torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (kv, d, dtype, signs is None)
            tables = (torch.tensor([0, 4], dtype=torch.int32), torch.tensor([2, 0, 3, 1], dtype=torch.int32),
                      torch.tensor([12], dtype=torch.int32))
            v = views[0]
            outs = [fn(v[0], *tables, out_dtype=dtype, kv_scale=v[1], kv_zero=v[2], rotation_signs=signs)
                    for fn in (ref.gather_kv, cpu.gather_kv)]
            for a, b in zip(*outs):
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (kv, d, dtype, signs is None)
            cases += 1
print(cases)
"""


def test_baseline_row_build_matches_the_reference_too():
    # This machine may pick the AVX2 build: PAGEDKV_CPU_BASELINE makes a fresh process
    # run the baseline (SSE) one, rotated and not, against the reference.
    from backend_cases import run_on_baseline_build

    assert run_on_baseline_build(_BASELINE_SCRIPT) == str(7 * 3 * 2)
