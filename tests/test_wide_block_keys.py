"""Wider block keys (``kv_key_bits`` 5, 6 or 8; pagedkv/store/quant.py, "wider block keys"):
a sealed block's K rows keep their codes' high bits in the per-token parameter bytes they
no longer need. Every backend (the Cython loops, their baseline build, the CUDA kernels on
the host emulation and, marked ``cuda``, on a GPU) must seal and gather bit for bit as
the torch reference does and attend within float32 rounding of the float64 definition;
the format, the config and the store say what they hold, and bad input is a typed error.
"""
from __future__ import annotations

import functools

import pytest
import torch

from backend_cases import ONE_THREAD, SMALL_GRID, make_backend, run_on_baseline_build
from pagedkv import CacheConfig, PagedKVCache
from pagedkv.errors import ArgumentTypeError, InvalidArgumentError, ShapeError
from pagedkv.ops import attention_reference as aref
from pagedkv.ops import reference as ref
from pagedkv.format import quant
from pagedkv.format.fingerprint import kv_format
from pagedkv.format.layer_format import LayerFormat, key_spare_bits
from pagedkv.format.rotation import rotation_signs

CUDA = pytest.param("cuda", marks=pytest.mark.cuda)
LAYOUTS = ("NHD", "HND")
# (head_dim, group size, key bits): the most each group size allows, fewer than that,
# a head_dim whose high bits end inside a byte (40 x 1 bit: 5 bytes), and 4-bit keys
CASES = [(64, 64, 5), (64, 32, 6), (64, 32, 5), (16, 16, 8), (40, 40, 5), (128, 64, 5), (48, 16, 6), (64, 64, 4)]
NB, BS, H = 7, 16, 2


def _case_id(c):
    return f"d{c[0]}-g{c[1]}-k{c[2]}"


@pytest.fixture(scope="module", params=["cpu", "emulated", CUDA])
def backend(request):
    return make_backend(request.param)


def arena(layout, d, g, gen):
    """An int4 layer with garbage codes and per-token parameters, and zeroed block-key
    parameters (every block starts unsealed)."""
    shape = (NB, 2, BS, H, d // 2) if layout == "NHD" else (NB, 2, H, BS, d // 2)
    kv = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    scale = torch.rand(shape[:-1] + (d // g,), generator=gen) + 0.01
    zero = torch.randn(shape[:-1] + (d // g,), generator=gen)
    ks = torch.zeros(NB, H, d, dtype=torch.bfloat16)
    return [kv, scale, zero, ks, torch.zeros_like(ks)]


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.uint8)


def seal(ops, state, blocks, keys, layout, fmt, **dims):
    wide = dict(kv_scale=state[1], kv_zero=state[2]) if fmt.key_extra_bits else {}
    ops.seal_key_blocks(state[0], blocks, keys, state[3], state[4], layout=layout, layer_format=fmt, **wide, **dims)


def test_the_spare_bits_are_what_a_group_s_float32_parameters_hold():
    # 64 bits of scale and zero per group, over the group's channels, as whole bit fields
    assert [key_spare_bits(g) for g in (8, 16, 20, 32, 40, 64, 96, 128)] == [4, 4, 2, 2, 1, 1, 0, 0]
    assert LayerFormat("int4", 64, "block", False, 5).key_extra_bits == 1
    for bad, match in ((dict(key_bits=6), r"key_bits: expected at most 5 for group_size 64"),
                       (dict(key_bits=7), r"key_bits: expected 4, 5, 6 or 8, got 7"),
                       (dict(key_bits=True), r"key_bits: expected 4, 5, 6 or 8, got True"),
                       (dict(key_bits=5, key_quant="token"), r"key_bits: expected 4 unless key_quant is 'block'")):
        kw = dict(dict(key_quant="block"), **bad)
        with pytest.raises(InvalidArgumentError, match=match):
            LayerFormat("int4", 64, kw.pop("key_quant"), False, kw.pop("key_bits"))


@pytest.mark.parametrize("d, extra", [(64, 1), (64, 2), (40, 1), (36, 2), (16, 4), (10, 4)])
def test_high_bits_round_trip_through_the_parameter_bytes(d, extra):
    gen = torch.Generator().manual_seed(d + extra)
    codes = torch.randint(0, 2 ** (4 + extra), (3, 5, d), generator=gen).to(torch.uint8)
    row_bytes = -(-d * extra // 8) + 3
    packed, high = quant.split_key_codes(codes, extra, row_bytes)
    lo = codes & 15
    assert torch.equal(packed, lo[..., 0::2] | (lo[..., 1::2] << 4))     # the int4 packing of the nibbles
    assert torch.equal(quant.join_key_codes(packed, high, extra), codes)
    assert not high[..., -(-d * extra // 8):].any()     # bytes past the high bits stay zero
    # channel d's bits at bit (d * extra) % 8 of byte (d * extra) // 8
    for c in (0, d - 1, d // 2 + 1):
        byte, bit = divmod(c * extra, 8)
        assert int(high[1, 2, byte] >> bit) & (2 ** extra - 1) == int(codes[1, 2, c]) >> 4
    with pytest.raises(ShapeError, match=r"row_bytes: expected at least"):
        quant.split_key_codes(codes, extra, -(-d * extra // 8) - 1)


@pytest.mark.parametrize("bits", [5, 6, 8])
def test_each_more_bit_halves_the_step_and_reads_back_within_half_of_it(bits):
    gen = torch.Generator().manual_seed(bits)
    k = torch.randn(4, BS, H, 32, generator=gen) * 3
    c4, s4, _ = quant.quantize_key_channels(k, 4)
    c, s, z = quant.quantize_key_channels(k, bits)
    assert int(c.max()) == 2 ** bits - 1 and int(c4.max()) == 15
    # the step shrinks by the ratio of the code ranges (up to bfloat16's outward rounding)
    assert float((s.float() / s4.float()).max()) <= 15 / (2 ** bits - 1) * 1.01
    y = c.float() * s.float().unsqueeze(1) + z.float().unsqueeze(1)
    assert bool(((y - k).abs() <= s.float().unsqueeze(1) / 2 * 1.0001 + 1e-6).all())


@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_seal_equals_the_reference_byte_for_byte(backend, case, layout, dtype):
    d, g, kb = case
    fmt = LayerFormat("int4", g, "block", False, kb)
    gen = torch.Generator().manual_seed(d * 31 + g + kb)
    before = arena(layout, d, g, gen)
    blocks = torch.tensor([5, 0, 3])
    keys = (torch.randn(3, BS, H, d, generator=gen) * torch.exp(torch.randn(3, 1, H, d, generator=gen))).to(dtype)
    want = [t.clone() for t in before]
    seal(ref, want, blocks, keys, layout, fmt)
    for dims in backend.dims + ((dict(grid=(2, 1, 1), block=(3, 2, 1)),) if backend.name == "emulated" else ()):
        got = [backend.copy(t) for t in before]
        seal(backend.ops, got, backend.copy(blocks), backend.copy(keys), layout, fmt, **dims)
        backend.sync()
        for w, x in zip(want, got):
            assert torch.equal(raw(x), raw(w))
    # only the sealed blocks' K rows changed: their codes and, with wider keys, their parameters
    keep = torch.ones(NB, dtype=torch.bool)
    keep[blocks] = False
    for w, b in zip(want[:3], before[:3]):
        assert torch.equal(raw(w[keep]), raw(b[keep])) and torch.equal(raw(w[:, 1]), raw(b[:, 1]))
    assert torch.equal(raw(want[1][blocks, 0]), raw(before[1][blocks, 0])) == (kb == 4)


def _sealed_state(layout, d, g, kb, gen):
    """A layer with three blocks sealed by the reference and the rest per token (garbage)."""
    fmt = LayerFormat("int4", g, "block", False, kb)
    state = arena(layout, d, g, gen)
    seal(ref, state, torch.tensor([1, 4, 6]), torch.randn(3, BS, H, d, generator=gen) * 2, layout, fmt)
    return state


def _tables():
    indptr = torch.tensor([0, 3, 7], dtype=torch.int32)
    indices = torch.tensor([1, 2, 4, 6, 0, 3, 1], dtype=torch.int32)
    return indptr, indices, torch.tensor([40, 4 * BS - 5], dtype=torch.int32)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rotated", [False, True], ids=["plain", "rotated"])
def test_gather_equals_the_reference_bit_for_bit(backend, case, layout, rotated):
    d, g, kb = case
    gen = torch.Generator().manual_seed(d + 7 * kb + rotated)
    state = _sealed_state(layout, d, g, kb, gen)
    fmt = LayerFormat("int4", g, "block", rotated, kb)
    signs = rotation_signs(d, 4) if rotated else None
    indptr, indices, lens = _tables()
    for out_dtype in (torch.float32, torch.bfloat16):
        kw = dict(layout=layout, out_dtype=out_dtype, layer_format=fmt)
        want = ref.gather_kv(state[0], indptr, indices, lens, kv_scale=state[1], kv_zero=state[2],
                             key_scale=state[3], key_zero=state[4], rotation_signs=signs, **kw)
        dev = [backend.copy(t) for t in state]
        for dims in backend.dims:
            got = backend.ops.gather_kv(dev[0], backend.copy(indptr), backend.copy(indices), backend.copy(lens),
                                        kv_scale=dev[1], kv_zero=dev[2], key_scale=dev[3], key_zero=dev[4],
                                        rotation_signs=backend.copy(signs), **kw, **dims)
            backend.sync()
            for w, x in zip(want, got):
                assert torch.equal(raw(x), raw(w))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_high_bits_are_read_where_the_seal_put_them(layout):
    # what the comparison with the reference cannot say alone: a 5-bit gather reads
    # each sealed key within half its (halved) step, and the 4-bit reading of the same
    # bytes is off by the dropped high bit
    d, g = 64, 64
    gen = torch.Generator().manual_seed(9)
    state = arena(layout, d, g, gen)
    keys = torch.randn(2, BS, H, d, generator=gen) * 2
    seal(ref, state, torch.tensor([2, 5]), keys, layout, LayerFormat("int4", g, "block", False, 5))
    indptr, indices, lens = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([2, 5], dtype=torch.int32), \
        torch.tensor([2 * BS], dtype=torch.int32)
    kw = dict(layout=layout, out_dtype=torch.float32, kv_scale=state[1], kv_zero=state[2], key_scale=state[3],
              key_zero=state[4])
    k5, _ = ref.gather_kv(state[0], indptr, indices, lens, layer_format=LayerFormat("int4", g, "block", False, 5), **kw)
    step = torch.cat([state[3][2].float().expand(BS, H, d), state[3][5].float().expand(BS, H, d)])
    want = keys.reshape(2 * BS, H, d)
    assert bool(((k5 - want).abs() <= step / 2 * 1.0001 + 1e-6).all())
    k4, _ = ref.gather_kv(state[0], indptr, indices, lens, **kw)      # no format: 4-bit
    assert float((k4 - want).abs().max()) > 4 * float(step.max())


@pytest.mark.parametrize("case", [c for c in CASES if c[0] % 8 == 0], ids=_case_id)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_attention_reads_wider_keys_as_the_float64_definition(backend, case, layout):
    from pagedkv.ops import _cpu_attention

    d, g, kb = case
    gen = torch.Generator().manual_seed(d + kb + 100)
    state = _sealed_state(layout, d, g, kb, gen)
    fmt = LayerFormat("int4", g, "block", False, kb)
    indptr, indices, lens = _tables()
    q_indptr = torch.tensor([0, 1, 4], dtype=torch.int32)
    q = torch.randn(4, 2 * H, d, generator=gen)
    kw = dict(layout=layout, kv_scale=state[1], kv_zero=state[2], key_scale=state[3], key_zero=state[4],
              layer_format=fmt)
    want = aref.paged_attention(q, state[0], indptr, indices, lens, q_indptr, **kw).double()
    # every CPU path (widened tiles or fused decoding; block parameters cached or not)
    tunings = [dict(fused=f, key_cache=c) for f in (False, True) for c in (False, True)] \
        if backend.name == "cpu" else [{}]
    saved = _cpu_attention.tune()
    try:
        for tuning in tunings:
            if tuning:
                _cpu_attention.tune(**tuning)
            dev = dict(kw, **{k: backend.copy(v) for k, v in kw.items() if isinstance(v, torch.Tensor)})
            if backend.name == "cpu":
                from pagedkv.ops.paged_attention import paged_attention

                attend = functools.partial(paged_attention, backend="cpu")
            else:
                attend = backend.ops.paged_attention
            for dims in backend.dims:
                got = attend(backend.copy(q), backend.copy(state[0]), backend.copy(indptr), backend.copy(indices),
                             backend.copy(lens), backend.copy(q_indptr), **dev, **dims)
                backend.sync()
                assert float((got.cpu().double() - want).abs().max()) < 2e-5 * (1 + float(want.abs().max()))
    finally:
        _cpu_attention.tune(prefetch=saved[0], key_cache=saved[1], fused=saved[2])


def test_the_baseline_build_seals_and_gathers_as_the_reference():
    script = """
import torch
from pagedkv.ops import cpu, reference as ref, _cpu_quant
from pagedkv.format.layer_format import LayerFormat
assert _cpu_quant.ROW_ISA == "baseline"
for d, g, kb in ((64, 64, 5), (64, 32, 6), (40, 40, 5), (16, 16, 8)):
    for layout in ("NHD", "HND"):
        fmt = LayerFormat("int4", g, "block", False, kb)
        gen = torch.Generator().manual_seed(d + kb)
        shape = (5, 2, 16, 2, d // 2) if layout == "NHD" else (5, 2, 2, 16, d // 2)
        base = [torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen),
                torch.rand(shape[:-1] + (d // g,), generator=gen), torch.randn(shape[:-1] + (d // g,), generator=gen),
                torch.zeros(5, 2, d, dtype=torch.bfloat16), torch.zeros(5, 2, d, dtype=torch.bfloat16)]
        keys = torch.randn(2, 16, 2, d, generator=gen) * 3
        out = []
        for mod in (ref, cpu):
            st = [t.clone() for t in base]
            mod.seal_key_blocks(st[0], torch.tensor([3, 1]), keys, st[3], st[4], layout=layout, layer_format=fmt,
                                kv_scale=st[1], kv_zero=st[2])
            k, v = mod.gather_kv(st[0], torch.tensor([0, 3], dtype=torch.int32),
                                 torch.tensor([3, 0, 1], dtype=torch.int32), torch.tensor([40], dtype=torch.int32),
                                 layout=layout, out_dtype=torch.float16, kv_scale=st[1], kv_zero=st[2],
                                 key_scale=st[3], key_zero=st[4], layer_format=fmt)
            out.append([t.view(torch.uint8) for t in st] + [k.view(torch.uint8), v.view(torch.uint8)])
        assert all(torch.equal(a, b) for a, b in zip(*out)), (d, g, kb, layout)
print("ok")
"""
    assert run_on_baseline_build(script) == "ok"


def test_a_wider_format_s_seal_needs_the_parameter_views_and_a_4_bit_one_refuses_them():
    gen = torch.Generator().manual_seed(1)
    st = arena("NHD", 64, 64, gen)
    keys = torch.randn(1, BS, H, 64, generator=gen)
    wide, narrow = LayerFormat("int4", 64, "block", False, 5), LayerFormat("int4", 64, "block", False, 4)
    before = [raw(t).clone() for t in st]
    with pytest.raises(InvalidArgumentError, match=r"^kv_scale: expected the layer's per-token parameter view for "
                                                   r"layer_format int4, group_size=64, key_quant=block, key_bits=5 "
                                                   r"\(it holds the keys' high bits\), got None$"):
        ref.seal_key_blocks(st[0], torch.tensor([0]), keys, st[3], st[4], layer_format=wide)
    with pytest.raises(InvalidArgumentError, match=r"^kv_zero: expected the layer's per-token parameter view"):
        ref.seal_key_blocks(st[0], torch.tensor([0]), keys, st[3], st[4], layer_format=wide, kv_scale=st[1])
    with pytest.raises(InvalidArgumentError, match=r"^kv_scale: expected None for layer_format int4, group_size=64, "
                                                   r"key_quant=block \(4-bit block keys keep no bits"):
        ref.seal_key_blocks(st[0], torch.tensor([0]), keys, st[3], st[4], layer_format=narrow, kv_scale=st[1],
                            kv_zero=st[2])
    with pytest.raises(ShapeError):    # the views must be the layer's
        ref.seal_key_blocks(st[0], torch.tensor([0]), keys, st[3], st[4], layer_format=wide, kv_scale=st[1][:3],
                            kv_zero=st[2][:3])
    assert all(torch.equal(raw(t), b) for t, b in zip(st, before))   # nothing written


SHAPE = dict(num_layers=2, num_kv_heads=2, head_dim=64, num_blocks=16, block_size=BS, dtype="float32")


def test_the_config_defaults_to_the_most_bits_the_parameters_hold():
    assert CacheConfig(**SHAPE, kv_dtype="int4", kv_key_quant="block").kv_key_bits == 5
    assert CacheConfig(**SHAPE, kv_dtype="int4", kv_key_quant="block", kv_group_size=32).kv_key_bits == 6
    assert CacheConfig(**SHAPE, kv_dtype="int4", kv_key_quant="block", kv_key_bits=4).kv_key_bits == 4
    assert CacheConfig(**SHAPE, kv_dtype="int4").kv_key_bits == 4
    assert CacheConfig(**SHAPE).kv_key_bits == 4
    # the same bytes: the high bits live where the per-token parameters were
    wide, narrow = (CacheConfig(**SHAPE, kv_dtype="int4", kv_key_quant="block", kv_key_bits=b) for b in (5, 4))
    assert wide.bytes_per_block == narrow.bytes_per_block and wide.bits_per_element == narrow.bits_per_element == 6
    # but what a block's bytes mean differs: a tier or a transfer tells them apart
    assert kv_format(PagedKVCache(wide).store) != kv_format(PagedKVCache(narrow).store)


@pytest.mark.parametrize("kw, err, match", [
    (dict(kv_dtype="int4", kv_key_quant="block", kv_key_bits=6), InvalidArgumentError,
     r"^kv_key_bits: expected 4, or up to 5 for kv_group_size 64 \(its parameters hold the high bits\), got 6$"),
    (dict(kv_dtype="int4", kv_key_bits=5), InvalidArgumentError, r"^kv_key_bits: expected 4 \(token keys\), got 5$"),
    (dict(kv_dtype="int4", kv_key_quant="block", kv_key_bits=5.0), ArgumentTypeError,
     r"^kv_key_bits: expected an int \(4, 5, 6 or 8\), got 5.0$"),
    (dict(kv_dtype="int4", kv_key_quant="block", kv_key_bits="5"), ArgumentTypeError, r"^kv_key_bits: expected an int"),
    (dict(kv_key_bits=5), InvalidArgumentError, r"^kv_key_bits: expected its default for an unquantized cache"),
])
def test_the_config_refuses_key_bits_it_cannot_store(kw, err, match):
    with pytest.raises(err, match=match):
        CacheConfig(**SHAPE, **kw)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_cache_reads_5_bit_keys_several_times_closer_than_4_bit_ones(layout):
    # through the store (seal on write) and the manager's gather; rollbacks into sealed
    # blocks, which read the high bits back before rewriting the parameters, are
    # tests/test_block_keys_store.py's (run with the default, 5-bit keys)
    from test_lowbit_store import config, fill, kv_data

    k, v = kv_data(32, seed=3)
    errs = {}
    for bits in (4, 5):
        cache = PagedKVCache(config(kv_dtype="int4", kv_key_quant="block", kv_key_bits=bits, kv_window=0,
                                    kv_sink_tokens=0, layout=layout))
        fill(cache, "a", k, v)
        errs[bits] = float((cache.gather("a", 0)[0] - k).pow(2).mean())
        cache.free("a")
    # half the step: a quarter of the squared error, up to the bfloat16 outward rounding
    assert errs[5] < 0.35 * errs[4]
