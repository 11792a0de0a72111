"""int3 (eight 3-bit codes per three bytes, bfloat16 scale and zero point per group,
rounded outward): exact arithmetic against an independent numpy formula, the packing,
the error bound, special values, typed errors."""
import numpy as np
import pytest
import torch
from backend_cases import make_backend
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.errors import DTypeError, InvalidArgumentError, ShapeError
from pagedkv.format.quant import bf16_down, bf16_up, dequantize, quantize, unpack_int3
from pagedkv.ops import reference

INF, NAN = float("inf"), float("nan")


def _data(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * torch.rand(shape[:-1] + (1,), generator=g) * 50


def _bf16_values():
    """Every finite bfloat16 value, ascending, as float64 (for the directed roundings)."""
    bits = np.arange(1 << 16, dtype=np.uint32) << 16
    v = bits.view(np.float32).astype(np.float64)
    return np.unique(v[np.isfinite(v)])


_BF16 = _bf16_values()


def _np_down(x):
    """Largest bfloat16 value <= x (-inf below the range), by search: independent of bit tricks."""
    i = np.searchsorted(_BF16, x.astype(np.float64), side="right") - 1
    return np.where(np.isinf(x), x, np.where(i >= 0, _BF16[np.clip(i, 0, None)], -np.inf)).astype(np.float32)


def _np_up(x):
    i = np.searchsorted(_BF16, x.astype(np.float64), side="left")
    return np.where(np.isinf(x), x, np.where(i < len(_BF16), _BF16[np.clip(i, None, len(_BF16) - 1)],
                                             np.inf)).astype(np.float32)


def _numpy_int3(x: np.ndarray, g: int):
    """The int3 contract in numpy float32 for finite x (unpacked codes)."""
    xg = x.reshape(x.shape[:-1] + (x.shape[-1] // g, g))
    z = _np_down(xg.min(-1))
    s = _np_up(np.float32(xg.max(-1) - z) / np.float32(7))
    s = np.where((s == 0) | ~np.isfinite(s), np.float32(1), s).astype(np.float32)
    c = np.clip(np.rint(np.float32(xg - z[..., None]) / s[..., None]), 0, 7).astype(np.uint8)
    y = ((c.astype(np.float32) * s[..., None]) + z[..., None]).reshape(x.shape)
    return c.reshape(x.shape), s, z, y


@pytest.mark.parametrize("group", [8, 16, 32, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_int3_matches_the_contract_formula_bit_for_bit(group, dtype):
    x = _data((40, 3, 64), seed=group).to(dtype)
    q, s, z = quantize(x, "int3", group_size=group)
    c, sn, zn, yn = _numpy_int3(x.float().numpy(), group)
    assert q.dtype == torch.uint8 and q.shape == (40, 3, 24)
    assert s.dtype == z.dtype == torch.bfloat16 and s.shape == z.shape == (40, 3, 64 // group)
    np.testing.assert_array_equal(unpack_int3(q).numpy(), c)
    np.testing.assert_array_equal(s.float().numpy(), sn)
    np.testing.assert_array_equal(z.float().numpy(), zn)
    assert torch.equal(dequantize(q, s, z, dtype), torch.from_numpy(yn).to(dtype))


def test_int3_packs_eight_codes_little_endian_in_three_bytes():
    x = torch.tensor([[0.0, 7.0, 1.0, 2.0, 6.0, 3.0, 5.0, 4.0]])
    q, s, z = quantize(x, "int3", group_size=8)
    assert (s.item(), z.item()) == (1.0, 0.0)
    bits = sum(int(c) << (3 * i) for i, c in enumerate([0, 7, 1, 2, 6, 3, 5, 4]))
    assert q.tolist() == [[bits & 0xFF, (bits >> 8) & 0xFF, bits >> 16]]
    assert dequantize(q, s, z, torch.float32).tolist() == x.tolist()


def test_int3_default_group_is_32_or_the_largest_multiple_of_8_below_that_divides():
    for d, groups in ((128, 4), (32, 1), (8, 1), (40, 5), (48, 2)):
        assert quantize(torch.randn(2, d), "int3")[1].shape == (2, groups)


def test_directed_roundings_bracket_the_value():
    x = torch.cat([_data((4096,), seed=1), torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-40, -1e-40, 3.39e38, -3.39e38,
                                                         3.4e38, -3.4e38, INF, -INF])])
    lo, hi = bf16_down(x), bf16_up(x)
    assert torch.equal(lo.to(torch.bfloat16).float(), lo) and torch.equal(hi.to(torch.bfloat16).float(), hi)
    assert bool((lo <= x).all()) and bool((hi >= x).all())
    np.testing.assert_array_equal(lo.numpy(), _np_down(x.numpy()))
    np.testing.assert_array_equal(hi.numpy(), _np_up(x.numpy()))
    assert torch.signbit(bf16_down(torch.tensor([-0.0]))).item()  # -0 keeps its sign
    n = bf16_down(torch.tensor([NAN, -NAN]))
    assert n.view(torch.int32).tolist() == [0x7FC00000] * 2  # the quiet NaN 0x7fc0


def test_int3_error_is_half_a_step_per_group_and_no_code_clamps():
    x = _data((256, 4, 64), seed=3)
    q, s, z = quantize(x, "int3", group_size=32)
    y = dequantize(q, s, z, torch.float32)
    step = s.float().repeat_interleave(32, dim=-1)
    lo = z.float().repeat_interleave(32, dim=-1)
    assert bool(((y - x).abs() <= step * 0.5 + x.abs() * 1e-6 + 1e-6).all())
    assert bool((x >= lo).all()) and bool((x <= lo + 7 * step).all())  # [z, z + 7 s] holds every value


def test_int3_special_values_are_defined():
    x = torch.tensor([
        [2.5] * 8 + [0.0] * 8,                         # constant groups: s = 1, exact
        [NAN, 1.0, 2.0, 3.0] + [1.0] * 4 + [-NAN] + [0.5] * 7,  # NaN: z = NaN, s = 1, all NaN back
        [-INF] + [1.0] * 7 + [INF] + [1.0] * 7,       # -inf min: all -inf; +inf max: s = 1, z + 7
        [1e30] + [-1e30] * 7 + [1e-30] * 4 + [-1e-30] * 4,
        [1e-40] * 4 + [-3e-39] * 4 + [1.5e-45] * 8,   # subnormals
    ])
    q, s, z = quantize(x, "int3", group_size=8)
    y = dequantize(q, s, z, torch.float32)
    assert s[0].tolist() == [1.0, 1.0] and z[0].tolist() == [2.5, 0.0] and torch.equal(y[0], x[0])
    assert s[1].tolist() == [1.0, 1.0] and bool(torch.isnan(z[1]).all()) and bool(torch.isnan(y[1]).all())
    assert unpack_int3(q)[1].tolist() == [0] * 16
    assert z[2, 0].item() == -INF and bool((y[2, :8] == -INF).all())
    assert (s[2, 1].item(), z[2, 1].item()) == (1.0, 1.0) and y[2, 8:].tolist() == [8.0] + [1.0] * 7
    for row in (3, 4):  # finite rows: within half a step of the bfloat16 params
        step = s[row].float().repeat_interleave(8)
        assert bool(((y[row] - x[row]).abs() <= step * 0.5 * (1 + 1e-6)).all())
        assert bool((x[row] >= z[row].float().repeat_interleave(8)).all())


@settings(max_examples=50, deadline=None)
@given(rows=st.integers(1, 5), groups=st.integers(1, 4), g=st.sampled_from([8, 16, 32]),
       scale=st.floats(1e-3, 1e4), seed=st.integers(0, 2**31 - 1))
def test_int3_round_trip_property(rows, groups, g, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, groups * g, generator=gen) * scale).half()
    q, s, z = quantize(x, "int3", group_size=g)
    y = dequantize(q, s, z, torch.float32)
    tol = s.float().repeat_interleave(g, dim=-1) * 0.5 + x.float().abs() * 1e-5 + 1e-5
    assert bool(((y - x.float()).abs() <= tol).all())


def test_int3_typed_errors():
    with pytest.raises(ShapeError, match=r"^x: expected a last dimension that is a multiple of 8 for int3 "
                                         r"\(8 codes per 3 bytes\), got 12$"):
        quantize(torch.ones(2, 12), "int3")
    for bad in (12, 4, 48, 0, True):
        with pytest.raises(InvalidArgumentError, match=r"^group_size: expected a multiple of 8 that divides "
                                                       r"head_dim \(32\), got "):
            quantize(torch.ones(2, 32), "int3", group_size=bad)
    q, s, z = quantize(torch.randn(3, 16), "int3", group_size=8)
    with pytest.raises(InvalidArgumentError, match=r"^zero: expected a bfloat16 tensor for int3, got None$"):
        dequantize(q, s, None, torch.float32)
    with pytest.raises(DTypeError, match=r"^zero: expected dtype bfloat16, got torch.float32$"):
        dequantize(q, s, z.float(), torch.float32)
    with pytest.raises(ShapeError, match=r"^scale: expected shape \(3,\) \+ \(groups,\), groups of a multiple of 8 "
                                         r"elements dividing 16, got \(3, 4\)$"):
        dequantize(q, torch.ones(3, 4, dtype=torch.bfloat16), z, torch.float32)
    with pytest.raises(ShapeError, match=r"^q: expected a last dimension that is a multiple of 3 for int3"):
        dequantize(q[:, :4], s, z, torch.float32)
    # float32 params mean int4: the same bytes read as int4 (two codes per byte)
    assert dequantize(q, s.float()[:, :1].expand(3, 2).contiguous(), z.float(), torch.float32).shape == (3, 12)


def _int3_layer(stored, groups, zero_dtype=torch.bfloat16):
    kv = torch.randint(0, 256, (4, 2, 2, 1, stored), dtype=torch.int32).to(torch.uint8)
    scale = torch.ones(4, 2, 2, 1, groups, dtype=torch.bfloat16)
    return kv, scale, torch.zeros(4, 2, 2, 1, groups, dtype=zero_dtype)


@pytest.mark.parametrize("backend", ["reference", "cpu", "emulated"])
@pytest.mark.parametrize("stored, groups, zero_dtype, error, match", [
    (10, 1, torch.bfloat16, ShapeError,
     r"^kv_layer: expected a last dim that is a multiple of 3 for int3 \(8 codes per 3 bytes\), got \(4, 2, 2, 1, 10\)$"),
    (6, 4, torch.bfloat16, ShapeError,
     r"^kv_scale: expected shape \(4, 2, 2, 1\) \+ \(groups,\), groups of a multiple of 8 elements dividing head_dim "
     r"16, for a int3 \(uint8\) kv_layer, got \(4, 2, 2, 1, 4\)$"),
    (6, 2, torch.float32, DTypeError, r"^kv_zero: expected dtype bfloat16, got torch.float32$"),
])
def test_bad_int3_layers_are_refused_before_anything_moves(backend, stored, groups, zero_dtype, error, match):
    ops = reference if backend == "reference" else make_backend(backend).ops
    kv, scale, zero = _int3_layer(stored, groups, zero_dtype)
    before = [t.clone() for t in (kv, scale, zero)]
    d = 8 * stored // 3 if stored % 3 == 0 else 8
    key = torch.randn(3, 1, d)
    with pytest.raises(error, match=match):
        ops.write_kv(kv, torch.tensor([0, 5, 7]), key, key, kv_scale=scale, kv_zero=zero)
    as32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    with pytest.raises(error, match=match):
        ops.gather_kv(kv, as32([0, 2]), as32([1, 3]), as32([4]), out_dtype=torch.float32, kv_scale=scale,
                      kv_zero=zero)
    assert all(torch.equal(a, b) for a, b in zip((kv, scale, zero), before))
