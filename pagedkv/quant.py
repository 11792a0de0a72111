"""Quantization schemes of the KV store (torch reference).

This module is the semantic definition of quantized KV storage: the CUDA kernels and
the fast CPU path must reproduce it bit for bit. All arithmetic is float32, each
step rounds once (no fused multiply-add, no reordering), and the reduction is over
the last dimension (``head_dim``), so there is one scale per (token, head).

fp8 (``fp8_e4m3`` -> ``torch.float8_e4m3fn``, ``fp8_e5m2`` -> ``torch.float8_e5m2``),
symmetric::

    amax = max(|x|)                 # NaN propagates: any NaN element makes amax NaN
    s    = amax / FMAX              # FMAX = 448 (e4m3) or 57344 (e5m2)
    s    = 1 if s == 0 or not finite(s)
    q    = fp8_rne(clamp(x / s, -FMAX, FMAX))      # NaN stays NaN
    y    = out_dtype(float(q) * s)

int8, asymmetric with a zero point (the minimum)::

    mn, mx = min(x), max(x)         # NaN propagates
    s    = (mx - mn) / 255
    s    = 1 if s == 0 or not finite(s)
    v    = (x - mn) / s
    v    = 0 where v is NaN         # defined result for NaN input: q = -128
    q    = int8(clamp(rint(v), 0, 255) - 128)      # rint: round half to even
    y    = out_dtype(((float(q) + 128) * s) + mn)  # two separate roundings

The scale (and for int8 the zero point ``mn``) are stored float32, shaped like the
input without its last dimension.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from pagedkv import dtypes
from pagedkv.errors import DeviceError, DTypeError, InvalidArgumentError, ShapeError, expected

__all__ = [
    "FP8_E4M3_MAX",
    "FP8_E5M2_MAX",
    "MODEL_DTYPES",
    "QUANT_STORAGE_DTYPES",
    "storage_dtype",
    "is_quantized",
    "fp8_max",
    "quantize",
    "dequantize",
]

FP8_E4M3_MAX = dtypes.info("fp8_e4m3").max_finite
FP8_E5M2_MAX = dtypes.info("fp8_e5m2").max_finite

#: dtypes a model computes K/V in (and the dtypes a gather may return).
MODEL_DTYPES = tuple(d.torch_dtype for d in dtypes.MODEL)

#: storage dtype of each quantized kv_dtype name.
QUANT_STORAGE_DTYPES = {d.name: d.torch_dtype for d in dtypes.QUANTIZED}

_FP8_MAX = {d.torch_dtype: d.max_finite for d in dtypes.QUANTIZED if d.float8}

_QUANTIZED = frozenset(QUANT_STORAGE_DTYPES.values())

KVDType = Union[str, torch.dtype]


def storage_dtype(kv_dtype: KVDType) -> torch.dtype:
    """The torch storage dtype of a quantized ``kv_dtype`` (name or torch dtype)."""
    row = dtypes.lookup(kv_dtype) if isinstance(kv_dtype, (str, torch.dtype)) else None
    if row is not None and row.quantized:
        return row.torch_dtype
    raise DTypeError(
        expected("kv_dtype", f"one of {', '.join(dtypes.quantized_names())} (or their torch dtypes)", kv_dtype)
    )


def is_quantized(dtype: torch.dtype) -> bool:
    """True when ``dtype`` is a quantized storage dtype (fp8 or int8)."""
    return dtype in _QUANTIZED


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite magnitude of an fp8 storage dtype."""
    try:
        return _FP8_MAX[dtype]
    except KeyError:
        raise DTypeError(expected("dtype", "torch.float8_e4m3fn or torch.float8_e5m2", dtype)) from None


def quantize(
    x: torch.Tensor, kv_dtype: KVDType
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Quantize ``x`` over its last dimension.

    Args:
        x: ``[..., D]`` float32, float16 or bfloat16.
        kv_dtype: ``"fp8_e4m3"`` (alias ``"fp8"``), ``"fp8_e5m2"``, ``"int8"`` or the
            matching torch dtype.

    Returns:
        ``(q, scale, zero)``: ``q`` ``[..., D]`` in the storage dtype; ``scale``
        ``[...]`` float32; ``zero`` ``[...]`` float32 for int8, else ``None``.
    """
    if not isinstance(x, torch.Tensor):
        raise DTypeError(expected("x", "a torch.Tensor", type(x).__name__))
    if x.dtype not in MODEL_DTYPES:
        raise DTypeError(expected("x", "dtype float32, float16 or bfloat16", x.dtype))
    if x.dim() < 1:
        raise ShapeError(expected("x", "at least 1 dimension [..., head_dim]", tuple(x.shape)))
    if x.shape[-1] == 0:
        raise ShapeError(expected("x", "a non-empty last dimension", tuple(x.shape)))
    qdtype = storage_dtype(kv_dtype)
    xf = x.to(torch.float32)  # exact widening: every model dtype fits in float32
    if qdtype == torch.int8:
        return _quantize_int8(xf)
    return _quantize_fp8(xf, qdtype)


def _fix_scale(s: torch.Tensor) -> torch.Tensor:
    bad = (s == 0) | ~torch.isfinite(s)
    return torch.where(bad, torch.ones_like(s), s)


def _quantize_fp8(xf: torch.Tensor, qdtype: torch.dtype):
    fmax = _FP8_MAX[qdtype]
    amax = xf.abs().amax(dim=-1)
    s = _fix_scale(amax / torch.tensor(fmax, dtype=torch.float32))
    v = torch.clamp(xf / s.unsqueeze(-1), -fmax, fmax)
    return v.to(qdtype), s, None


def _quantize_int8(xf: torch.Tensor):
    mn = xf.amin(dim=-1)
    mx = xf.amax(dim=-1)
    s = _fix_scale((mx - mn) / torch.tensor(255.0, dtype=torch.float32))
    v = (xf - mn.unsqueeze(-1)) / s.unsqueeze(-1)
    v = torch.where(torch.isnan(v), torch.zeros_like(v), v)
    v = torch.clamp(torch.round(v), 0.0, 255.0) - 128.0  # exact: integers below 2**24
    return v.to(torch.int8), s, mn


def dequantize(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero: Optional[torch.Tensor],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Invert :func:`quantize` (up to the quantization error).

    Args:
        q: ``[..., D]`` float8_e4m3fn, float8_e5m2 or int8.
        scale: ``[...]`` float32.
        zero: ``[...]`` float32 for int8; ``None`` for fp8.
        out_dtype: float32, float16 or bfloat16.

    Returns:
        ``[..., D]`` in ``out_dtype``.
    """
    if not isinstance(q, torch.Tensor) or not is_quantized(q.dtype):
        got = q.dtype if isinstance(q, torch.Tensor) else type(q).__name__
        raise DTypeError(expected("q", "dtype float8_e4m3fn, float8_e5m2 or int8", got))
    if out_dtype not in MODEL_DTYPES:
        raise DTypeError(expected("out_dtype", "float32, float16 or bfloat16", out_dtype))
    _check_param("scale", scale, q)
    if q.dtype == torch.int8:
        if zero is None:
            raise InvalidArgumentError(expected("zero", "a float32 tensor for int8", None))
        _check_param("zero", zero, q)
        y = (q.to(torch.float32) + 128.0) * scale.unsqueeze(-1)
        y = y + zero.unsqueeze(-1)
    else:
        if zero is not None:
            raise InvalidArgumentError(expected("zero", "None for fp8", "a tensor"))
        y = q.to(torch.float32) * scale.unsqueeze(-1)
    return y.to(out_dtype)


def _check_param(name: str, t: object, q: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise DTypeError(expected(name, "a torch.Tensor", type(t).__name__))
    if t.dtype != torch.float32:
        raise DTypeError(expected(name, "dtype float32", t.dtype))
    if tuple(t.shape) != tuple(q.shape[:-1]):
        raise ShapeError(expected(name, f"shape {tuple(q.shape[:-1])}", tuple(t.shape)))
    if t.device != q.device:
        raise DeviceError(expected(name, f"device {q.device}", t.device))
