"""int2 (KIVI-2's per-token values): the torch definition of its codes and parameters.

The contract is written in :mod:`pagedkv.format.quant` (which re-exports these names and
dispatches to them); this module holds the arithmetic: the float16 directed roundings,
the four-per-byte packing, and the per-group quantizer and dequantizer.
"""
from __future__ import annotations

import torch

from pagedkv.errors import InvalidArgumentError, ShapeError, expected
from pagedkv.format import dtypes

__all__ = ["int2_group", "f16_down", "f16_up", "pack_int2", "unpack_int2", "quantize_int2", "dequantize_int2"]


def _fix_scale(s: torch.Tensor) -> torch.Tensor:
    bad = (s == 0) | ~torch.isfinite(s)
    return torch.where(bad, torch.ones_like(s), s)


def int2_group(head_dim: int, group_size: int | None) -> int:
    """The validated int2 group size for ``head_dim`` (a multiple of 4; ``group_size`` a
    multiple of 4 that divides it; default the int4 default, when it is a multiple of 4,
    else ``head_dim``)."""
    if head_dim % 4:
        raise ShapeError(expected("x", "a last dimension that is a multiple of 4 for int2 (4 codes per byte)",
                                  head_dim))
    if group_size is None:
        g = dtypes.default_int4_group(head_dim)
        group_size = g if g % 4 == 0 else head_dim
    g = group_size
    if isinstance(g, bool) or not isinstance(g, int) or g < 4 or g % 4 or head_dim % g:
        raise InvalidArgumentError(expected("group_size", f"a multiple of 4 that divides head_dim ({head_dim})",
                                            repr(g)))
    return g


def _f16_directed(x: torch.Tensor, up: bool) -> torch.Tensor:
    """float32 ``x`` rounded to float16 toward +inf (``up``) or -inf, as float32 values."""
    h = x.to(torch.float16)
    back = h.to(torch.float32)
    wrong = back < x if up else back > x            # False for NaN: it stays NaN
    b = h.view(torch.int16).to(torch.int32)
    neg = b < 0
    mag = b & 0x7FFF
    # one ulp toward the wanted infinity: a larger magnitude when that is away from zero
    grow = neg != up
    stepped = torch.where(grow, mag + 1, mag - 1)
    # a zero stepped down (up) becomes the smallest negative (positive) subnormal
    zero = mag == 0
    stepped = torch.where(zero, torch.ones_like(mag), stepped)
    sign = torch.where(zero, torch.full_like(neg, not up), neg)
    bits = torch.where(sign, stepped | 0x8000, stepped)
    bits = torch.where(wrong, bits, b)
    return bits.to(torch.int16).view(torch.float16).to(torch.float32)


def f16_down(x: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` rounded toward -inf to a float16 value (returned as float32)."""
    return _f16_directed(x, False)


def f16_up(x: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` rounded toward +inf to a float16 value (returned as float32)."""
    return _f16_directed(x, True)


def pack_int2(c: torch.Tensor) -> torch.Tensor:
    c = c.reshape(c.shape[:-1] + (c.shape[-1] // 4, 4))
    return c[..., 0] | (c[..., 1] << 2) | (c[..., 2] << 4) | (c[..., 3] << 6)


def quantize_int2(xf: torch.Tensor, g: int):
    lead, d = xf.shape[:-1], xf.shape[-1]
    xg = xf.reshape(lead + (d // g, g))
    z = f16_down(xg.amin(dim=-1))
    mx = xg.amax(dim=-1)
    s = _fix_scale(f16_up((mx - z) / torch.tensor(3.0, dtype=torch.float32)))
    v = (xg - z.unsqueeze(-1)) / s.unsqueeze(-1)
    v = torch.where(torch.isnan(v), torch.zeros_like(v), v)
    c = torch.clamp(torch.round(v), 0.0, 3.0).to(torch.uint8).reshape(lead + (d,))
    return pack_int2(c), s.to(torch.float16), z.to(torch.float16)


def unpack_int2(q: torch.Tensor) -> torch.Tensor:
    """The uint8 codes ``[..., 4 n]`` (0..3) of packed ``q`` ``[..., n]``."""
    c = torch.stack([(q >> (2 * i)) & 3 for i in range(4)], dim=-1)
    return c.reshape(q.shape[:-1] + (4 * q.shape[-1],))


def dequantize_int2(q, scale, zero, out_dtype):
    c = unpack_int2(q).to(torch.float32)
    lead, d, ng = q.shape[:-1], c.shape[-1], scale.shape[-1]
    y = c.reshape(lead + (ng, d // ng)) * scale.to(torch.float32).unsqueeze(-1)
    y = y + zero.to(torch.float32).unsqueeze(-1)
    return y.reshape(lead + (d,)).to(out_dtype)
