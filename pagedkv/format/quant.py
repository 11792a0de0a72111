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

int4, asymmetric, in groups of ``G`` consecutive elements along ``head_dim`` (``G``
divides ``D``; ``D`` even), two codes per byte::

    mn, mx = min(g), max(g)         # per group g; NaN propagates
    s    = (mx - mn) / 15
    s    = 1 if s == 0 or not finite(s)
    v    = (g - mn) / s
    v    = 0 where v is NaN
    c    = clamp(rint(v), 0, 15)    # unsigned code
    byte = c[2i] | (c[2i + 1] << 4) # element 2i in the low nibble
    y    = out_dtype((float(c) * s) + mn)              # two separate roundings

int3, asymmetric, in groups of ``G`` consecutive elements along ``head_dim`` (``G`` a
multiple of 8 that divides ``D``; default the largest of 32, 24, 16, 8 that does), with
a **bfloat16** zero point and scale rounded outward, so every finite value of the group
lies inside ``[z, z + 7 s]`` (3 + 2 * 16 / 32 = 4.0 bits per element at G = 32)::

    mn, mx = min(g), max(g)         # per group g, float32; NaN propagates
    z    = bf16_down(mn)            # bfloat16 rounded toward -inf (below)
    s    = bf16_up((mx - z) / 7)    # bfloat16 rounded toward +inf; float32 steps
    s    = 1 if s == 0 or not finite(s)
    v    = (g - z) / s
    v    = 0 where v is NaN
    c    = clamp(rint(v), 0, 7)     # unsigned code
    bits = sum(c[8j + i] << 3 i for i in 0..7)     # 24 bits per 8 codes
    bytes 3j, 3j + 1, 3j + 2 = bits & 0xff, (bits >> 8) & 0xff, bits >> 16
    y    = out_dtype((float(c) * s) + z)           # two separate roundings

``bf16_down``/``bf16_up`` act on the float32 bits ``u``: the magnitude ``u & 0x7fffffff``
is truncated to its top 16 bits when that moves toward the wanted infinity (a
positive value rounded down, a negative one up), else rounded away from zero
(``(mag + 0xffff) & 0xffff0000``, which reaches infinity past the bfloat16 range:
``bf16_down(-3.39e38) = -inf``); the sign is kept (``-0`` stays ``-0``) and a NaN
becomes the quiet NaN ``0x7fc0``. So a group holding a NaN has ``z = NaN``, ``s = 1``,
``c = 0`` and reads back all NaN; a group whose minimum is ``-inf`` reads back all
``-inf``; one whose maximum is ``+inf`` (and minimum finite) gets ``s = 1``, so it
reads back ``z + 7`` for ``+inf`` and ``z + rint(g - z)`` (capped at 7) elsewhere, as
int4 reads back ``mn + 15``.

int2, asymmetric, in groups of ``G`` consecutive elements along ``head_dim`` (``G`` a
multiple of 4 that divides ``D``; default as int4's), four codes per byte, with a
**float16** zero point and scale rounded outward (KIVI-2's per-token values; 2 + 32 / G
bits per element)::

    mn, mx = min(g), max(g)         # per group g, float32; NaN propagates
    z    = f16_down(mn)             # float16 rounded toward -inf
    s    = f16_up((mx - z) / 3)     # float16 rounded toward +inf; float32 steps
    s    = 1 if s == 0 or not finite(s)
    c    = clamp(rint(v), 0, 3), v = (g - z) / s, 0 where NaN
    byte = c[4i] | c[4i + 1] << 2 | c[4i + 2] << 4 | c[4i + 3] << 6
    y    = out_dtype((float(c) * s) + z)           # two separate roundings

``f16_down``/``f16_up`` round the float32 value to float16 to nearest even, then step
one float16 ulp toward the wanted infinity where that moved it the wrong way (so
``f16_down(1e5) = 65504`` and ``f16_up(1e5) = inf``); NaN stays NaN.

int4 **block keys** (``kv_key_quant="block"``): a full block's keys are quantized per
channel, over the block's ``bs`` tokens, with a bfloat16 zero point and scale per
(head, channel) rounded outward as int3's (KIVI's per-channel keys, aligned to blocks;
the keys are not rotated). For ``x`` ``[bs, H, D]``, per ``(h, d)``::

    mn, mx = min(x[:, h, d]), max(x[:, h, d])    # over the block's tokens
    z    = bf16_down(mn)
    s    = bf16_up((mx - z) / 15)
    s    = 1 if s == 0 or not finite(s)
    c    = clamp(rint(v), 0, 15), v = (x - z) / s, 0 where NaN
    (packed two per byte along D, as int4)
    y    = out_dtype((float(c) * s) + z)              # two separate roundings

so a sealed block's scale is never 0, and a zero scale marks a (block, head) whose
keys are still stored per token. int2 block keys are the same with 2-bit codes (``/ 3``,
``clamp(.., 0, 3)``, packed four per byte as int2): KIVI-2's per-channel keys.

**Wider block keys** (``key_bits`` 5 to 8): a sealed block's K rows no longer need their
per-token parameters (a float32 scale and zero point per group), so those bytes carry
the codes' high bits. With ``e = key_bits - 4`` extra bits (at most
:func:`key_spare_bits` of the group size: 1 for groups of 64, 2 for 32), the block is
quantized as above with ``2**key_bits - 1`` in place of 15 (``c`` up to 31 for 5 bits),
``c & 15`` goes to the packed nibble as before and ``c >> 4`` to the row's *high bits*:
channel ``d``'s ``e`` bits at bit ``(d * e) % 8`` of byte ``(d * e) // 8`` of the row's
parameter bytes, read as the bytes of its scale groups followed by those of its zero
groups (:func:`split_key_codes`; the bytes past ``D * e / 8`` are 0). Reading back:
``y = out_dtype((float((hi << 4) | lo) * s) + z)``. One more bit halves the step, for
no byte more.

The scale (and for int8/int4 the zero point ``mn``) are stored float32, shaped like
the input without its last dimension (int4/int3: plus a trailing ``D / G`` groups dim;
int3's scale and zero are bfloat16).
"""
from __future__ import annotations

import torch

from pagedkv.errors import DeviceError, DTypeError, InvalidArgumentError, ShapeError, expected
from pagedkv.format import dtypes
from pagedkv.format.int2 import dequantize_int2 as _dequantize_int2
from pagedkv.format.int2 import f16_down, f16_up, int2_group, unpack_int2
from pagedkv.format.int2 import pack_int2 as _pack_int2
from pagedkv.format.int2 import quantize_int2 as _quantize_int2
from pagedkv.format.layer_format import key_spare_bits

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
    "int4_group",
    "unpack_int4",
    "DEFAULT_INT4_GROUP",
    "int3_group",
    "unpack_int3",
    "bf16_down",
    "bf16_up",
    "quantize_key_block",
    "quantize_key_channels",
    "dequantize_key_channels",
    "key_spare_bits",
    "split_key_codes",
    "join_key_codes",
    "int2_group",
    "unpack_int2",
    "f16_down",
    "f16_up",
]

FP8_E4M3_MAX = dtypes.info("fp8_e4m3").max_finite
FP8_E5M2_MAX = dtypes.info("fp8_e5m2").max_finite

#: dtypes a model computes K/V in (and the dtypes a gather may return).
MODEL_DTYPES = tuple(d.torch_dtype for d in dtypes.MODEL)

#: storage dtype of each quantized kv_dtype name.
QUANT_STORAGE_DTYPES = {d.name: d.torch_dtype for d in dtypes.QUANTIZED}

_FP8_MAX = {d.torch_dtype: d.max_finite for d in dtypes.QUANTIZED if d.float8}

_QUANTIZED = frozenset(QUANT_STORAGE_DTYPES.values())

#: int4 group size used when none is given (measured: see README, "Low-bit KV").
DEFAULT_INT4_GROUP = 64
#: int3 group size used when none is given and it divides head_dim (README, "Low-bit KV").
DEFAULT_INT3_GROUP = 32

KVDType = str | torch.dtype


def storage_dtype(kv_dtype: KVDType) -> torch.dtype:
    """The torch storage dtype of a quantized ``kv_dtype`` (name or torch dtype)."""
    row = dtypes.lookup(kv_dtype) if isinstance(kv_dtype, (str, torch.dtype)) else None
    if row is not None and row.quantized:
        return row.torch_dtype
    raise DTypeError(
        expected("kv_dtype", f"one of {', '.join(dtypes.quantized_names())} (or their torch dtypes)", kv_dtype)
    )


def is_quantized(dtype: torch.dtype) -> bool:
    """True when ``dtype`` is a quantized storage dtype (fp8, int8, or uint8 = packed int4/int3)."""
    return dtype in _QUANTIZED


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite magnitude of an fp8 storage dtype."""
    try:
        return _FP8_MAX[dtype]
    except KeyError:
        raise DTypeError(expected("dtype", "torch.float8_e4m3fn or torch.float8_e5m2", dtype)) from None


def quantize(
    x: torch.Tensor, kv_dtype: KVDType, *, group_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Quantize ``x`` over its last dimension.

    Args:
        x: ``[..., D]`` float32, float16 or bfloat16.
        kv_dtype: ``"fp8_e4m3"`` (alias ``"fp8"``), ``"fp8_e5m2"``, ``"int8"`` or the
            matching torch dtype; ``"int4"`` (storage ``torch.uint8``, which also names
            it); ``"int3"``, ``"int2"`` (by name only: their storage dtype is uint8 too).
        group_size: int4/int3 only: elements per scale group (divides ``D``; int4
            default :func:`~pagedkv.format.dtypes.default_int4_group`; int3: a multiple of 8,
            default :data:`DEFAULT_INT3_GROUP` or the largest multiple of 8 below it
            that divides ``D``).

    Returns:
        ``(q, scale, zero)``: ``q`` ``[..., D]`` in the storage dtype (int4:
        ``[..., D / 2]`` uint8; int3: ``[..., 3 D / 8]`` uint8); ``scale`` ``[...]``
        float32 (int4: ``[..., D / G]``; int3: ``[..., D / G]`` bfloat16); ``zero``
        like ``scale`` for int8/int4/int3, else ``None``.
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
    name = dtypes.lookup(kv_dtype).name if isinstance(kv_dtype, str) else None  # type: ignore[union-attr]  # known
    if name == "int3":
        return _quantize_int3(xf, int3_group(x.shape[-1], group_size))
    if name == "int2":
        return _quantize_int2(xf, int2_group(x.shape[-1], group_size))
    if qdtype == torch.uint8:
        return _quantize_int4(xf, int4_group(x.shape[-1], group_size))
    if group_size is not None:
        raise InvalidArgumentError(expected("group_size", "None for a per-head kv_dtype", repr(group_size)))
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


def int4_group(head_dim: int, group_size: int | None) -> int:
    """The validated int4 group size for ``head_dim`` (even; ``group_size`` divides it)."""
    if head_dim % 2:
        raise ShapeError(expected("x", "an even last dimension for int4 (two codes per byte)", head_dim))
    g = dtypes.default_int4_group(head_dim) if group_size is None else group_size
    if isinstance(g, bool) or not isinstance(g, int) or g < 1 or head_dim % g:
        raise InvalidArgumentError(expected("group_size", f"an int >= 1 that divides head_dim ({head_dim})", repr(g)))
    return g


def _quantize_int4(xf: torch.Tensor, g: int):
    lead, d = xf.shape[:-1], xf.shape[-1]
    xg = xf.reshape(lead + (d // g, g))
    mn = xg.amin(dim=-1)
    mx = xg.amax(dim=-1)
    s = _fix_scale((mx - mn) / torch.tensor(15.0, dtype=torch.float32))
    v = (xg - mn.unsqueeze(-1)) / s.unsqueeze(-1)
    v = torch.where(torch.isnan(v), torch.zeros_like(v), v)
    c = torch.clamp(torch.round(v), 0.0, 15.0).to(torch.uint8).reshape(lead + (d // 2, 2))
    return c[..., 0] | (c[..., 1] << 4), s, mn


def unpack_int4(q: torch.Tensor) -> torch.Tensor:
    """The uint8 codes ``[..., 2 * n]`` (0..15) of packed ``q`` ``[..., n]``."""
    return torch.stack((q & 15, q >> 4), dim=-1).reshape(q.shape[:-1] + (2 * q.shape[-1],))


def _dequantize_int4(q, scale, zero, out_dtype):
    c = unpack_int4(q).to(torch.float32)
    lead, d, ng = q.shape[:-1], 2 * q.shape[-1], scale.shape[-1]
    y = c.reshape(lead + (ng, d // ng)) * scale.unsqueeze(-1)
    y = y + zero.unsqueeze(-1)
    return y.reshape(lead + (d,)).to(out_dtype)


def int3_group(head_dim: int, group_size: int | None) -> int:
    """The validated int3 group size for ``head_dim`` (a multiple of 8; ``group_size`` a
    multiple of 8 that divides it; default :data:`DEFAULT_INT3_GROUP` or the largest
    multiple of 8 below it that divides ``head_dim``)."""
    if head_dim % 8:
        raise ShapeError(expected("x", "a last dimension that is a multiple of 8 for int3 (8 codes per 3 bytes)",
                                  head_dim))
    g = max(k for k in range(8, DEFAULT_INT3_GROUP + 1, 8) if head_dim % k == 0) if group_size is None else group_size
    if isinstance(g, bool) or not isinstance(g, int) or g < 8 or g % 8 or head_dim % g:
        raise InvalidArgumentError(expected("group_size", f"a multiple of 8 that divides head_dim ({head_dim})",
                                            repr(g)))
    return g


_I32_SIGN = -(2**31)


def _bf16_directed(x: torch.Tensor, up: bool) -> torch.Tensor:
    """float32 ``x`` rounded to bfloat16 toward +inf (``up``) or -inf, as float32 values
    (exactly representable in bfloat16); NaN becomes the quiet NaN 0x7fc0."""
    b = x.contiguous().view(torch.int32)
    mag = b & 0x7FFFFFFF
    neg = b < 0
    away = (mag + 0xFFFF) & -65536        # <= 0x7f80ffff + ...: no int32 overflow for non-NaN
    trunc = mag & -65536
    mag = torch.where(neg != up, away, trunc)
    bits = torch.where(neg, mag | _I32_SIGN, mag)
    bits = torch.where((b & 0x7FFFFFFF) > 0x7F800000, torch.full_like(b, 0x7FC00000), bits)
    return bits.view(torch.float32)


def bf16_down(x: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` rounded toward -inf to a bfloat16 value (returned as float32)."""
    return _bf16_directed(x, False)


def bf16_up(x: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` rounded toward +inf to a bfloat16 value (returned as float32)."""
    return _bf16_directed(x, True)


def _quantize_int3(xf: torch.Tensor, g: int):
    lead, d = xf.shape[:-1], xf.shape[-1]
    xg = xf.reshape(lead + (d // g, g))
    z = bf16_down(xg.amin(dim=-1))
    mx = xg.amax(dim=-1)
    s = _fix_scale(bf16_up((mx - z) / torch.tensor(7.0, dtype=torch.float32)))
    v = (xg - z.unsqueeze(-1)) / s.unsqueeze(-1)
    v = torch.where(torch.isnan(v), torch.zeros_like(v), v)
    c = torch.clamp(torch.round(v), 0.0, 7.0).to(torch.int32).reshape(lead + (d // 8, 8))
    bits = c[..., 0]
    for i in range(1, 8):
        bits = bits | (c[..., i] << (3 * i))
    packed = torch.stack((bits & 0xFF, (bits >> 8) & 0xFF, bits >> 16), dim=-1).to(torch.uint8)
    return packed.reshape(lead + (3 * d // 8,)), s.to(torch.bfloat16), z.to(torch.bfloat16)


def _key_checked(k: object, bits: int) -> torch.Tensor:
    per = 4 if bits == 2 else 2     # codes per byte of the packed rows (int2: 4; int4 and wider: 2)
    if not isinstance(k, torch.Tensor) or k.dtype not in MODEL_DTYPES:
        got = k.dtype if isinstance(k, torch.Tensor) else type(k).__name__
        raise DTypeError(expected("k", "a float32, float16 or bfloat16 tensor", got))
    if k.dim() < 3 or k.shape[-1] % per or 0 in k.shape[-3:]:
        raise ShapeError(expected("k", f"[..., block_size, H, D] with D a multiple of {per} and no empty dim",
                                  tuple(k.shape)))
    return k


def _check_key_bits(bits: object) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in (2, 4, 5, 6, 8):
        raise InvalidArgumentError(expected("bits", "2 (int2), or 4, 5, 6 or 8 (int4)", repr(bits)))
    return bits


def quantize_key_channels(k: torch.Tensor, bits: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-channel codes of whole blocks of keys, ``bits`` wide (see "block keys" and
    "wider block keys" above).

    Args:
        k: ``[..., bs, H, D]`` float32, float16 or bfloat16 (``D`` even; a multiple of 4
            for 2 bits): each leading index is one block's keys.
        bits: 2 (int2), or 4, 5, 6 or 8 (int4 and its wider block keys).

    Returns:
        ``(codes, scale, zero)``: ``codes`` ``[..., bs, H, D]`` uint8 in ``[0, 2**bits - 1]``
        (unpacked); ``scale``, ``zero`` ``[..., H, D]`` bfloat16.
    """
    bits = _check_key_bits(bits)
    xf = _key_checked(k, bits).to(torch.float32)
    top = float(2**bits - 1)
    z = bf16_down(xf.amin(dim=-3))
    mx = xf.amax(dim=-3)
    s = _fix_scale(bf16_up((mx - z) / torch.tensor(top, dtype=torch.float32)))
    v = (xf - z.unsqueeze(-3)) / s.unsqueeze(-3)
    v = torch.where(torch.isnan(v), torch.zeros_like(v), v)
    return torch.clamp(torch.round(v), 0.0, top).to(torch.uint8), s.to(torch.bfloat16), z.to(torch.bfloat16)


def quantize_key_block(k: torch.Tensor, bits: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-channel codes of whole blocks of keys (see "block keys" above), packed.

    Args:
        k: ``[..., bs, H, D]`` float32, float16 or bfloat16 (``D`` a multiple of
            ``8 / bits``): each leading index is one block's keys.
        bits: 4 (int4 block keys, packed as int4) or 2 (int2, packed as int2); wider
            int4 keys are :func:`quantize_key_channels` then :func:`split_key_codes`.

    Returns:
        ``(codes, scale, zero)``: ``codes`` ``[..., bs, H, D * bits / 8]`` uint8;
        ``scale``, ``zero`` ``[..., H, D]`` bfloat16.
    """
    if isinstance(bits, bool) or bits not in (2, 4):
        raise InvalidArgumentError(expected("bits", "4 (int4) or 2 (int2)", repr(bits)))
    c, s, z = quantize_key_channels(k, bits)
    return (_pack_int4(c) if bits == 4 else _pack_int2(c)), s, z


def _pack_int4(c: torch.Tensor) -> torch.Tensor:
    c = c.reshape(c.shape[:-1] + (c.shape[-1] // 2, 2))
    return c[..., 0] | (c[..., 1] << 4)


def split_key_codes(codes: torch.Tensor, extra_bits: int, row_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``codes`` ``[..., D]`` (uint8, ``4 + extra_bits`` wide) -> ``(packed, high)``: the
    low nibbles packed two per byte ``[..., D / 2]``, and the high bits laid out in a
    row's ``row_bytes`` parameter bytes ``[..., row_bytes]`` (zero past ``D * e / 8``)."""
    d = codes.shape[-1]
    need = -(-d * extra_bits // 8)
    if need > row_bytes:
        raise ShapeError(expected("row_bytes", f"at least {need} ({d} channels x {extra_bits} bits)", row_bytes))
    packed = _pack_int4(codes & 15)
    high = torch.zeros(codes.shape[:-1] + (row_bytes,), dtype=torch.uint8, device=codes.device)
    if extra_bits:
        per = 8 // extra_bits   # channels per byte (the last byte may hold fewer)
        hi = torch.zeros(codes.shape[:-1] + (need * per,), dtype=torch.int32, device=codes.device)
        hi[..., :d] = (codes >> 4).to(torch.int32)
        shifts = torch.arange(per, device=codes.device, dtype=torch.int32) * extra_bits
        high[..., :need] = (hi.reshape(codes.shape[:-1] + (need, per)) << shifts).sum(-1).to(torch.uint8)
    return packed, high


def join_key_codes(packed: torch.Tensor, high: torch.Tensor | None, extra_bits: int) -> torch.Tensor:
    """The inverse of :func:`split_key_codes`: codes ``[..., D]`` (uint8) of packed
    nibbles ``[..., D / 2]`` and, with ``extra_bits``, the rows' parameter bytes."""
    c = unpack_int4(packed)
    if extra_bits and high is not None:
        per = 8 // extra_bits
        d = c.shape[-1]
        need = -(-d * extra_bits // 8)
        shifts = torch.arange(per, device=c.device, dtype=torch.int32) * extra_bits
        hi = (high[..., :need].to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << extra_bits) - 1)
        c = c | (hi.reshape(c.shape[:-1] + (need * per,))[..., :d].to(torch.uint8) << 4)
    return c


def dequantize_key_channels(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                            out_dtype: torch.dtype, high: torch.Tensor | None = None,
                            extra_bits: int = 0) -> torch.Tensor:
    """Rows ``q`` ``[..., D * bits / 8]`` of block keys with their block's per-channel
    ``scale``/``zero`` ``[..., D]`` (bfloat16, broadcast to the rows) -> ``[..., D]``.
    The code width follows from the two last dims (int4: ``D / 2`` bytes, int2: ``D / 4``);
    wider int4 keys also take the rows' parameter bytes ``high`` (:func:`join_key_codes`).
    int2 keys have no high bits (``high`` is ignored)."""
    if 4 * q.shape[-1] == scale.shape[-1]:
        c = unpack_int2(q).to(torch.float32)
    else:
        c = join_key_codes(q, high, extra_bits).to(torch.float32)
    y = c * scale.to(torch.float32)
    y = y + zero.to(torch.float32)
    return y.to(out_dtype)


def unpack_int3(q: torch.Tensor) -> torch.Tensor:
    """The uint8 codes ``[..., 8 n / 3]`` (0..7) of packed ``q`` ``[..., n]`` (``n`` a multiple of 3)."""
    b = q.reshape(q.shape[:-1] + (q.shape[-1] // 3, 3)).to(torch.int32)
    bits = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
    c = torch.stack([(bits >> (3 * i)) & 7 for i in range(8)], dim=-1)
    return c.to(torch.uint8).reshape(q.shape[:-1] + (8 * (q.shape[-1] // 3),))


def _dequantize_int3(q, scale, zero, out_dtype):
    c = unpack_int3(q).to(torch.float32)
    lead, d, ng = q.shape[:-1], c.shape[-1], scale.shape[-1]
    y = c.reshape(lead + (ng, d // ng)) * scale.to(torch.float32).unsqueeze(-1)
    y = y + zero.to(torch.float32).unsqueeze(-1)
    return y.reshape(lead + (d,)).to(out_dtype)


def dequantize(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Invert :func:`quantize` (up to the quantization error).

    Args:
        q: ``[..., D]`` float8_e4m3fn, float8_e5m2 or int8; uint8 packed int4
            (float32 params), int3 (bfloat16) or int2 (float16).
        scale: ``[...]`` float32.
        zero: ``[...]`` float32 for int8; ``None`` for fp8.
        out_dtype: float32, float16 or bfloat16.

    Returns:
        ``[..., D]`` in ``out_dtype``.
    """
    if not isinstance(q, torch.Tensor) or not is_quantized(q.dtype):
        got = q.dtype if isinstance(q, torch.Tensor) else type(q).__name__
        raise DTypeError(expected("q", "dtype float8_e4m3fn, float8_e5m2, int8 or uint8 (int4, int3, int2)", got))
    if out_dtype not in MODEL_DTYPES:
        raise DTypeError(expected("out_dtype", "float32, float16 or bfloat16", out_dtype))
    if q.dtype == torch.uint8 and isinstance(scale, torch.Tensor) and scale.dtype == torch.float16:
        _check_groups(scale, q, pack=4)
        if zero is None:
            raise InvalidArgumentError(expected("zero", "a float16 tensor for int2", None))
        _check_param("zero", zero, q, tuple(scale.shape), torch.float16)
        _check_param("scale", scale, q, tuple(scale.shape), torch.float16)
        return _dequantize_int2(q, scale, zero, out_dtype)
    if q.dtype == torch.uint8 and isinstance(scale, torch.Tensor) and scale.dtype == torch.bfloat16:
        _check_groups(scale, q, int3=True)
        if zero is None:
            raise InvalidArgumentError(expected("zero", "a bfloat16 tensor for int3", None))
        _check_param("zero", zero, q, tuple(scale.shape), torch.bfloat16)
        _check_param("scale", scale, q, tuple(scale.shape), torch.bfloat16)
        return _dequantize_int3(q, scale, zero, out_dtype)
    if q.dtype == torch.uint8:
        _check_groups(scale, q)
        if zero is None:
            raise InvalidArgumentError(expected("zero", "a float32 tensor for int4", None))
        _check_param("zero", zero, q, tuple(scale.shape))
        _check_param("scale", scale, q, tuple(scale.shape))
        return _dequantize_int4(q, scale, zero, out_dtype)
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


def _check_groups(scale: object, q: torch.Tensor, int3: bool = False, pack: int = 2) -> None:
    if not isinstance(scale, torch.Tensor):
        raise DTypeError(expected("scale", "a torch.Tensor", type(scale).__name__))
    if pack == 4:   # int2: four codes per byte, groups of a multiple of 4
        d = 4 * q.shape[-1] if q.dim() else 0
        ok = scale.dim() == q.dim() and tuple(scale.shape[:-1]) == tuple(q.shape[:-1])
        if not ok or scale.shape[-1] < 1 or d % scale.shape[-1] or (d // scale.shape[-1]) % 4:
            raise ShapeError(expected("scale", f"shape {tuple(q.shape[:-1])} + (groups,), groups of a multiple "
                                      f"of 4 elements dividing {d}", tuple(scale.shape)))
        return
    if int3 and (q.dim() == 0 or q.shape[-1] % 3):
        raise ShapeError(expected("q", "a last dimension that is a multiple of 3 for int3 (8 codes per 3 bytes)",
                                  tuple(q.shape)))
    d = (8 * q.shape[-1] // 3 if int3 else 2 * q.shape[-1]) if q.dim() else 0
    ok = scale.dim() == q.dim() and tuple(scale.shape[:-1]) == tuple(q.shape[:-1])
    if not ok or scale.shape[-1] < 1 or d % scale.shape[-1] or (int3 and (d // scale.shape[-1]) % 8):
        what = "groups of a multiple of 8 elements" if int3 else "groups"
        want = f"shape {tuple(q.shape[:-1])} + (groups,), {what} dividing {d}"
        raise ShapeError(expected("scale", want, tuple(scale.shape)))


def _check_param(name: str, t: object, q: torch.Tensor, shape: tuple | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
    if not isinstance(t, torch.Tensor):
        raise DTypeError(expected(name, "a torch.Tensor", type(t).__name__))
    if t.dtype != dtype:
        raise DTypeError(expected(name, f"dtype {str(dtype).replace('torch.', '')}", t.dtype))
    shape = tuple(q.shape[:-1]) if shape is None else shape
    if tuple(t.shape) != shape:
        raise ShapeError(expected(name, f"shape {shape}", tuple(t.shape)))
    if t.device != q.device:
        raise DeviceError(expected(name, f"device {q.device}", t.device))
