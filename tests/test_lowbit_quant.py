"""int4 (packed groups, scale + zero point) and the randomized Hadamard rotation:
exact arithmetic against independent numpy formulas, error bounds, typed errors."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.errors import DTypeError, InvalidArgumentError, ShapeError
from pagedkv.format.quant import dequantize, is_quantized, quantize, storage_dtype, unpack_int4
from pagedkv.format.rotation import hadamard_blocks, rotate, rotation_signs, unrotate


def _data(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * torch.rand(shape[:-1] + (1,), generator=g) * 50


def _numpy_int4(x: np.ndarray, g: int):
    """The int4 contract, written independently in numpy float32 (unpacked codes)."""
    xg = x.reshape(x.shape[:-1] + (x.shape[-1] // g, g))
    mn = xg.min(-1)
    s = (xg.max(-1) - mn) / np.float32(15)
    s = np.where((s == 0) | ~np.isfinite(s), np.float32(1), s).astype(np.float32)
    c = np.clip(np.rint((xg - mn[..., None]) / s[..., None]), 0, 15).astype(np.uint8)
    y = ((c.astype(np.float32) * s[..., None]) + mn[..., None]).reshape(x.shape)
    return c.reshape(x.shape), s, mn, y


@pytest.mark.parametrize("group", [8, 16, 32, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_int4_matches_the_contract_formula_bit_for_bit(group, dtype):
    x = _data((40, 3, 64), seed=group).to(dtype)
    q, s, z = quantize(x, "int4", group_size=group)
    c, sn, mn, yn = _numpy_int4(x.float().numpy(), group)
    assert q.dtype == torch.uint8 and q.shape == (40, 3, 32)
    assert s.shape == z.shape == (40, 3, 64 // group)
    np.testing.assert_array_equal(unpack_int4(q).numpy(), c)
    np.testing.assert_array_equal(s.numpy(), sn)
    np.testing.assert_array_equal(z.numpy(), mn)
    assert torch.equal(dequantize(q, s, z, dtype), torch.from_numpy(yn).to(dtype))


def test_int4_packs_element_2i_in_the_low_nibble():
    x = torch.tensor([[0.0, 15.0, 1.0, 2.0, 14.0, 3.0, 0.0, 15.0]])
    q, s, z = quantize(x, "int4", group_size=8)
    assert (s.item(), z.item()) == (1.0, 0.0)
    assert q.tolist() == [[0xF0, 0x21, 0x3E, 0xF0]]
    assert dequantize(q, s, z, torch.float32).tolist() == x.tolist()


def test_int4_default_group_is_64_capped_at_head_dim():
    assert quantize(torch.randn(2, 128), "int4")[1].shape == (2, 2)
    assert quantize(torch.randn(2, 16), "int4")[1].shape == (2, 1)


def test_int4_error_is_half_a_step_per_group():
    x = _data((256, 4, 64), seed=3)
    q, s, z = quantize(x, "int4", group_size=32)
    y = dequantize(q, s, z, torch.float32)
    step = s.repeat_interleave(32, dim=-1)
    assert bool(((y - x).abs() <= step * 0.5 + x.abs() * 1e-6 + 1e-6).all())


def test_int4_constant_zero_and_nan_rows_are_defined():
    x = torch.tensor([[2.5] * 4 + [0.0] * 4, [float("nan"), 1.0, 2.0, 3.0] + [1.0] * 4])
    q, s, z = quantize(x, "int4", group_size=4)
    assert s[0].tolist() == [1.0, 1.0] and z[0].tolist() == [2.5, 0.0]
    assert torch.equal(dequantize(q[:1], s[:1], z[:1], torch.float32), x[:1])
    assert s[1, 0].item() == 1.0 and torch.isnan(z[1, 0]).item()
    assert unpack_int4(q)[1, :4].tolist() == [0, 0, 0, 0]


@settings(max_examples=50, deadline=None)
@given(rows=st.integers(1, 5), groups=st.integers(1, 4), g=st.sampled_from([2, 4, 8, 16]),
       scale=st.floats(1e-3, 1e4), seed=st.integers(0, 2**31 - 1))
def test_int4_round_trip_property(rows, groups, g, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, groups * g, generator=gen) * scale).half()
    q, s, z = quantize(x, "int4", group_size=g)
    y = dequantize(q, s, z, torch.float32)
    tol = s.repeat_interleave(g, dim=-1) * 0.5 + x.float().abs() * 1e-5 + 1e-5
    assert bool(((y - x.float()).abs() <= tol).all())


def test_int4_names_and_typed_errors():
    assert storage_dtype("int4") is torch.uint8 and is_quantized(torch.uint8)
    with pytest.raises(ShapeError, match=r"^x: expected an even last dimension for int4"):
        quantize(torch.ones(2, 7), "int4")
    with pytest.raises(InvalidArgumentError, match=r"^group_size: expected an int >= 1 that divides head_dim \(64\), got 24$"):
        quantize(torch.ones(2, 64), "int4", group_size=24)
    with pytest.raises(InvalidArgumentError, match=r"^group_size: expected None for a per-head kv_dtype, got 8$"):
        quantize(torch.ones(2, 64), "int8", group_size=8)
    q, s, z = quantize(torch.randn(3, 8), "int4", group_size=4)
    with pytest.raises(ShapeError, match=r"^scale: expected shape \(3,\) \+ \(groups,\), groups dividing 8"):
        dequantize(q, s[:, :1].expand(3, 3).contiguous(), z, torch.float32)
    with pytest.raises(InvalidArgumentError, match=r"^zero: expected a float32 tensor for int4, got None$"):
        dequantize(q, s, None, torch.float32)
    with pytest.raises(ShapeError, match=r"^zero: expected shape \(3, 2\), got \(3, 1\)$"):
        dequantize(q, s, z[:, :1], torch.float32)


# -- rotation ------------------------------------------------------------------------


def _sylvester(n: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


@pytest.mark.parametrize("d", [1, 8, 64, 96, 128, 67])
def test_rotation_is_the_signed_block_hadamard_matrix(d):
    signs = rotation_signs(d, seed=5)
    blocks = hadamard_blocks(d)
    assert sum(blocks) == d and all(b & (b - 1) == 0 for b in blocks) and blocks == sorted(blocks, reverse=True)
    mat = np.zeros((d, d))
    at = 0
    for n in blocks:
        mat[at:at + n, at:at + n] = _sylvester(n)
        at += n
    x = _data((50, d), seed=d)
    want = (x.double().numpy() * signs.double().numpy()) @ mat.T
    np.testing.assert_allclose(rotate(x, signs).double().numpy(), want, rtol=1e-5, atol=1e-4)
    # orthonormal: the inverse undoes it and norms are kept
    assert torch.allclose(unrotate(rotate(x, signs), signs), x, rtol=1e-5, atol=1e-4)
    assert torch.allclose(rotate(x, signs).norm(dim=-1), x.norm(dim=-1), rtol=1e-5)


def test_rotation_signs_are_fixed_by_the_seed():
    a, b = rotation_signs(64, 1), rotation_signs(64, 2)
    assert torch.equal(a, rotation_signs(64, 1)) and not torch.equal(a, b)
    assert set(a.tolist()) == {-1.0, 1.0} and a.dtype == torch.float32


def test_rotation_shrinks_int4_error_on_an_outlier_channel():
    # K of real models has a few large channels; rotation spreads them over the group
    g = torch.Generator().manual_seed(7)
    x = torch.randn(512, 64, generator=g)
    x[:, 3] *= 30.0
    signs = rotation_signs(64, 0)
    plain = dequantize(*quantize(x, "int4"), torch.float32)
    rot = unrotate(dequantize(*quantize(rotate(x, signs), "int4"), torch.float32), signs)
    assert (rot - x).norm() < 0.5 * (plain - x).norm()


def test_rotation_typed_errors():
    s = rotation_signs(8, 0)
    with pytest.raises(DTypeError, match=r"^x: expected a float32 tensor, got torch.float16$"):
        rotate(torch.ones(2, 8, dtype=torch.float16), s)
    with pytest.raises(ShapeError, match=r"^x: expected \[\.\.\., 8\] \(head_dim\), got \(2, 4\)$"):
        unrotate(torch.ones(2, 4), s)
    with pytest.raises(InvalidArgumentError, match=r"^head_dim: expected an int >= 1, got 0$"):
        rotation_signs(0, 0)
    with pytest.raises(InvalidArgumentError, match=r"^seed: expected an int in \[0, 2\*\*63\), got -1$"):
        rotation_signs(8, -1)
