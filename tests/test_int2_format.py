"""int2 (KIVI-2: four 2-bit codes per byte, float16 scale and zero point per group along
head_dim rounded outward; keys per channel over each full block): exact arithmetic
against an independent numpy formula, the packing, the error bound, special values,
the per-channel key blocks on every backend, the config's defaults and typed errors."""
import numpy as np
import pytest
import torch
from backend_cases import make_backend

from pagedkv.config.options import CacheConfig
from pagedkv.config.support import UnsupportedCombinationError
from pagedkv.errors import DTypeError, InvalidArgumentError, ShapeError
from pagedkv.format import dtypes
from pagedkv.format.layer_format import LayerFormat
from pagedkv.format.quant import (bf16_down, bf16_up, dequantize, dequantize_key_channels, f16_down, f16_up, quantize,
                                  quantize_key_block, unpack_int2)

INF, NAN = float("inf"), float("nan")


def _data(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * torch.rand(shape[:-1] + (1,), generator=g) * 50


def _f16_values():
    """Every finite float16 value, ascending, as float64 (for the directed roundings)."""
    v = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float64)
    return np.unique(v[np.isfinite(v)])


_F16 = _f16_values()


def _np_down(x):
    """Largest float16 value <= x (-inf below the range), by search: independent of bit tricks."""
    i = np.searchsorted(_F16, x.astype(np.float64), side="right") - 1
    return np.where(np.isinf(x), x, np.where(i >= 0, _F16[np.clip(i, 0, None)], -np.inf)).astype(np.float32)


def _np_up(x):
    i = np.searchsorted(_F16, x.astype(np.float64), side="left")
    return np.where(np.isinf(x), x, np.where(i < len(_F16), _F16[np.clip(i, None, len(_F16) - 1)],
                                             np.inf)).astype(np.float32)


def _numpy_int2(x: np.ndarray, g: int):
    """The int2 contract in numpy float32 for finite x (unpacked codes)."""
    xg = x.reshape(x.shape[:-1] + (x.shape[-1] // g, g))
    z = _np_down(xg.min(-1))
    s = _np_up(np.float32(xg.max(-1) - z) / np.float32(3))
    s = np.where((s == 0) | ~np.isfinite(s), np.float32(1), s).astype(np.float32)
    c = np.clip(np.rint(np.float32(xg - z[..., None]) / s[..., None]), 0, 3).astype(np.uint8)
    y = ((c.astype(np.float32) * s[..., None]) + z[..., None]).reshape(x.shape)
    return c.reshape(x.shape), s, z, y


@pytest.mark.parametrize("group", [4, 16, 32, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_int2_matches_the_contract_formula_bit_for_bit(group, dtype):
    x = _data((40, 3, 64), seed=group).to(dtype)
    q, s, z = quantize(x, "int2", group_size=group)
    c, sn, zn, yn = _numpy_int2(x.float().numpy(), group)
    assert q.dtype == torch.uint8 and q.shape == (40, 3, 16)
    assert s.dtype == z.dtype == torch.float16 and s.shape == z.shape == (40, 3, 64 // group)
    np.testing.assert_array_equal(unpack_int2(q).numpy(), c)
    np.testing.assert_array_equal(s.float().numpy(), sn)
    np.testing.assert_array_equal(z.float().numpy(), zn)
    assert torch.equal(dequantize(q, s, z, dtype), torch.from_numpy(yn).to(dtype))


def test_int2_packs_four_codes_per_byte_lowest_bits_first():
    x = torch.tensor([[0.0, 3.0, 1.0, 2.0, 2.0, 2.0, 0.0, 1.0]])
    q, s, z = quantize(x, "int2", group_size=8)
    assert (s.item(), z.item()) == (1.0, 0.0)
    assert q.tolist() == [[0 | 3 << 2 | 1 << 4 | 2 << 6, 2 | 2 << 2 | 0 << 4 | 1 << 6]]
    assert dequantize(q, s, z, torch.float32).tolist() == x.tolist()


def test_int2_default_group_is_int4s():
    for d, groups in ((128, 2), (64, 1), (32, 1), (96, 2), (80, 2), (4, 1)):
        assert quantize(torch.randn(2, d), "int2")[1].shape == (2, groups)


def test_f16_directed_roundings_bracket_the_value():
    x = torch.cat([_data((4096,), seed=1), torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-9, -1e-9, 6e-8, -6e-8, 65504.0,
                                                         -65504.0, 65519.0, 1e5, -1e5, INF, -INF])])
    lo, hi = f16_down(x), f16_up(x)
    assert torch.equal(lo.to(torch.float16).float(), lo) and torch.equal(hi.to(torch.float16).float(), hi)
    assert bool((lo <= x).all()) and bool((hi >= x).all())
    np.testing.assert_array_equal(lo.numpy(), _np_down(x.numpy()))
    np.testing.assert_array_equal(hi.numpy(), _np_up(x.numpy()))
    assert bool(torch.isnan(f16_down(torch.tensor([NAN]))).all() and torch.isnan(f16_up(torch.tensor([NAN]))).all())


def test_int2_error_is_half_a_step_per_group_and_every_value_is_inside_the_range():
    x = _data((256, 4, 64), seed=3)
    q, s, z = quantize(x, "int2", group_size=32)
    y = dequantize(q, s, z, torch.float32)
    step = s.float().repeat_interleave(32, dim=-1)
    lo = z.float().repeat_interleave(32, dim=-1)
    assert bool(((y - x).abs() <= step * 0.5 + x.abs() * 1e-6 + 1e-6).all())
    assert bool((x >= lo).all()) and bool((x <= lo + 3 * step).all())


def test_int2_special_values_are_defined():
    x = torch.tensor([
        [2.5] * 4 + [0.0] * 4,                 # constant groups: s = 1, exact
        [NAN, 1.0, 2.0, 3.0] + [1.0] * 4,      # NaN: z = NaN, s = 1, all NaN back
        [-INF] + [1.0] * 3 + [1e6] + [1.0] * 3,  # -inf min: all -inf; past float16: s = inf -> 1
    ])
    q, s, z = quantize(x, "int2", group_size=4)
    y = dequantize(q, s, z, torch.float32)
    assert s[0].tolist() == [1.0, 1.0] and z[0].tolist() == [2.5, 0.0] and torch.equal(y[0], x[0])
    assert s[1, 0].item() == 1.0 and torch.isnan(z[1, 0]) and bool(torch.isnan(y[1, :4]).all())
    assert z[2, 0].item() == -INF and bool((y[2, :4] == -INF).all())
    assert (s[2, 1].item(), z[2, 1].item()) == (1.0, 1.0) and y[2, 4:].tolist() == [4.0, 1.0, 1.0, 1.0]


def test_int2_typed_errors():
    with pytest.raises(ShapeError, match="multiple of 4"):
        quantize(torch.randn(2, 6), "int2")
    with pytest.raises(InvalidArgumentError, match="group_size"):
        quantize(torch.randn(2, 16), "int2", group_size=6)
    q, s, z = quantize(torch.randn(2, 16), "int2", group_size=8)
    with pytest.raises(InvalidArgumentError, match="zero"):
        dequantize(q, s, None, torch.float32)
    with pytest.raises(DTypeError, match="zero"):
        dequantize(q, s, z.float(), torch.float32)
    with pytest.raises(ShapeError, match="scale"):
        dequantize(q, s[:, :1].repeat(1, 3), z[:, :1].repeat(1, 3), torch.float32)


def test_uint8_with_float16_params_is_int2():
    assert dtypes.layer_row(torch.uint8, torch.float16).name == "int2"
    assert dtypes.layer_row(torch.uint8, torch.bfloat16).name == "int3"
    assert dtypes.layer_row(torch.uint8, torch.float32).name == "int4"
    assert dtypes.info("int2").stored_dim(128) == 32 and dtypes.info("int2").element_bytes == 0.25


# -- block keys: per channel over a full block ---------------------------------------------

NB, BS, H, D = 6, 4, 2, 16


def _keys(m, seed=1):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(m, BS, H, D, generator=g)
    k[..., 3] *= 30.0      # an outlier channel: per-channel ranges keep it off the others
    return k


def test_key_block_codes_follow_the_per_channel_formula():
    k = _keys(3)
    c, s, z = quantize_key_block(k, bits=2)
    assert c.shape == (3, BS, H, D // 4) and s.shape == z.shape == (3, H, D) and s.dtype == torch.bfloat16
    assert torch.equal(z.float(), bf16_down(k.amin(1)))    # bf16_down: checked in test_int3_quant
    assert torch.equal(s.float(), bf16_up((k.amax(1) - z.float()) / 3))
    assert bool((unpack_int2(c) <= 3).all())
    y = dequantize_key_channels(c, s.unsqueeze(1), z.unsqueeze(1), torch.float32)
    step = s.float().unsqueeze(1)
    assert bool(((y - k).abs() <= step * 0.5 * (1 + 1e-6)).all())
    # the outlier channel leaves the others' steps small (per-token groups would not)
    assert bool((s.float()[..., 0] < s.float()[..., 3] / 5).all())


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_sealed_int2_blocks_hold_the_per_channel_codes_and_nothing_else_changes(backend, layout):
    from pagedkv import ops

    shape = (NB, 2, BS, H, D // 4) if layout == "NHD" else (NB, 2, H, BS, D // 4)
    g = torch.Generator().manual_seed(0)
    kv = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    ks = torch.randn(NB, H, D, generator=g).to(torch.bfloat16)
    kz = torch.randn(NB, H, D, generator=g).to(torch.bfloat16)
    before = [t.clone() for t in (kv, ks, kz)]
    fmt = LayerFormat("int2", 8, "block")
    k, blocks = _keys(2), torch.tensor([4, 1])
    be = make_backend(backend)
    be.ops.seal_key_blocks(kv, blocks, k, ks, kz, layout=layout, layer_format=fmt)
    codes, s, z = quantize_key_block(k, bits=2)
    if layout == "HND":
        codes = codes.transpose(1, 2)
    assert torch.equal(kv[blocks, 0], codes)
    assert torch.equal(ks[blocks], s) and torch.equal(kz[blocks], z)
    untouched = torch.tensor([0, 2, 3, 5])
    assert torch.equal(kv[untouched], before[0][untouched]) and torch.equal(kv[blocks, 1], before[0][blocks, 1])
    assert torch.equal(ks[untouched], before[1][untouched])
    # a gather reads sealed keys per channel, values per token
    scale = torch.rand(shape[:-1] + (2,), generator=g).half() + 0.1
    zero = torch.randn(shape[:-1] + (2,), generator=g).half()
    indptr, indices = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([4, 1], dtype=torch.int32)
    lens = torch.tensor([2 * BS], dtype=torch.int32)
    ok, ov = ops.gather_kv(kv, indptr, indices, lens, layout=layout, out_dtype=torch.float32, kv_scale=scale,
                           kv_zero=zero, key_scale=ks, key_zero=kz, layer_format=fmt, backend=backend)
    want_k = dequantize_key_channels(quantize_key_block(k, bits=2)[0], s.unsqueeze(1), z.unsqueeze(1), torch.float32)
    assert torch.equal(ok, want_k.reshape(2 * BS, H, D))
    vq = kv[blocks, 1] if layout == "NHD" else kv[blocks, 1].transpose(1, 2)
    vs = scale[blocks, 1] if layout == "NHD" else scale[blocks, 1].transpose(1, 2)
    vz = zero[blocks, 1] if layout == "NHD" else zero[blocks, 1].transpose(1, 2)
    assert torch.equal(ov, dequantize(vq, vs, vz, torch.float32).reshape(2 * BS, H, D))


def test_seal_refuses_a_token_format_and_a_wrong_row_length():
    from pagedkv import ops

    kv = torch.zeros(NB, 2, BS, H, D // 4, dtype=torch.uint8)
    ks = torch.zeros(NB, H, D, dtype=torch.bfloat16)
    kz = ks.clone()
    with pytest.raises(InvalidArgumentError, match="key_quant='block'"):
        ops.seal_key_blocks(kv, torch.tensor([0]), _keys(1), ks, kz, layer_format=LayerFormat("int2", 8))
    with pytest.raises(ShapeError, match="keys"):   # int4 would read these rows as head_dim 8
        ops.seal_key_blocks(kv, torch.tensor([0]), _keys(1), ks, kz)
    assert not kv.any() and not ks.any()


# -- configuration ---------------------------------------------------------------------------

def _config(**kw):
    base = dict(num_layers=2, num_kv_heads=2, head_dim=128, block_size=16, num_blocks=8, dtype="float16")
    base.update(kw)
    return CacheConfig(**base)


def test_int2_defaults_are_kivi_2_with_window_and_sinks():
    c = _config(kv_dtype="int2")
    assert (c.kv_key_quant, c.kv_window, c.kv_sink_tokens, c.kv_group_size, c.kv_rotation) == \
        ("block", 128, 4, 64, False)
    assert c.torch_scale_dtype == torch.float16
    # bits: 2 code bits + float16 scale and zero per 64 + bfloat16 key params per block (16 tokens)
    assert c.bits_per_element == 2 + 32 / 64 + 16 / 16
    assert LayerFormat.of_config(c) == LayerFormat("int2", 64, "block", False)


def test_int2_bad_combinations_are_typed_errors():
    with pytest.raises(InvalidArgumentError, match="kv_group_size"):
        _config(kv_dtype="int2", kv_group_size=6)
    with pytest.raises(InvalidArgumentError, match="head_dim"):
        _config(kv_dtype="int2", head_dim=6)
    with pytest.raises(UnsupportedCombinationError, match="kv_key_quant"):
        _config(kv_dtype="int3", kv_key_quant="block")
    with pytest.raises(InvalidArgumentError, match="group_size"):
        LayerFormat("int2", 6)
    with pytest.raises(InvalidArgumentError, match="key_quant"):
        LayerFormat("int3", 8, "block")


def test_kv_key_bits_is_int4s_widening_int2_keeps_2_bit_keys():
    """``kv_key_bits`` widens int4's sealed keys into the K rows' parameter bytes; int2's
    sealed keys are 2-bit codes whatever the option, so it is normalized to 4 (no
    widening), and any other value is refused naming int4, by the config and the format."""
    c = _config(kv_dtype="int2")
    assert c.kv_key_bits == 4 and _config(kv_dtype="int2", kv_key_bits=4).kv_key_bits == 4
    fmt = LayerFormat.of_config(c)
    assert (fmt.key_bits, fmt.key_extra_bits, fmt.key_code_bits) == (4, 0, 2)
    assert "key_bits" not in fmt.describe()
    # int4's block keys: the widening is the code width
    wide = LayerFormat.of_config(_config(kv_dtype="int4", kv_key_quant="block"))
    assert (wide.key_bits, wide.key_code_bits) == (5, 5)
    for bits in (5, 6, 8):
        with pytest.raises(InvalidArgumentError,
                           match=rf"^kv_key_bits: expected 4 for kv_dtype 'int2' \(wider block keys are int4 "
                                 rf"only\), got {bits}$"):
            _config(kv_dtype="int2", kv_key_bits=bits)
        with pytest.raises(InvalidArgumentError,
                           match=rf"^key_bits: expected 4 for int2 \(wider block keys are int4 only\), got {bits}$"):
            LayerFormat("int2", 64, "block", key_bits=bits)
    with pytest.raises(InvalidArgumentError, match=r"^kv_key_bits: expected 4 \(token keys\), got 5$"):
        _config(kv_dtype="int2", kv_key_quant="token", kv_key_bits=5)


def test_an_int2_seal_takes_no_per_token_parameter_views():
    """Only wider int4 keys keep bits in the K rows' parameters: an int2 seal given the
    layer's scale/zero views is refused before any write, on every CPU backend."""
    from pagedkv import ops

    kv = torch.zeros(NB, 2, BS, H, D // 4, dtype=torch.uint8)
    ks = torch.zeros(NB, H, D, dtype=torch.bfloat16)
    kz = ks.clone()
    scale = torch.ones(NB, 2, BS, H, D // 8, dtype=torch.float16)
    for backend in ("reference", "cpu"):
        with pytest.raises(InvalidArgumentError, match=r"^kv_scale: expected None for layer_format int2, "
                                                       r"group_size=8, key_quant=block \(2-bit block keys"):
            ops.seal_key_blocks(kv, torch.tensor([0]), _keys(1), ks, kz, layer_format=LayerFormat("int2", 8, "block"),
                                kv_scale=scale, kv_zero=scale.clone(), backend=backend)
    assert not kv.any() and not ks.any()


def test_the_kernels_refuse_int2_by_type_and_write_nothing():
    """No CUDA kernel decodes int2 yet: the kernel path (host emulation here) refuses the
    arena with a DTypeError before any launch, never falling back silently."""
    from pagedkv.ops import backends

    em = backends.load("emulated")
    kv = torch.zeros(4, 2, 4, 2, 4, dtype=torch.uint8)
    s = torch.zeros(4, 2, 4, 2, 1, dtype=torch.float16)
    z = s.clone()
    k = torch.randn(3, 2, 16)
    with pytest.raises(DTypeError, match=r"kv_layer: expected a kv dtype with a CUDA kernel .*got int2 \(uint8\)"):
        em.write_kv(kv, torch.tensor([0, 1, 2]), k, k, kv_scale=s, kv_zero=z, layer_format=LayerFormat("int2", 16))
    assert not kv.any() and not s.any()
