"""The byte layout of one MLA latent row, per storage format, and its definition in torch.

A Multi-head Latent Attention layer (DeepSeek V2/V3, Kimi K2, GLM-4-MoE-Lite) caches one
row per token: the compressed ``c_kv`` (``kv_lora_rank`` = R elements, after the
``kv_a_layernorm``) and the shared positional key ``k_pe`` (``rope_dim`` = P elements,
RoPE applied). Attention reads both as the key and the first R elements as the value.

Formats (bytes per token per layer, ``b`` the model dtype's bytes):

- a model dtype (float32, float16, bfloat16): the R + P elements as they are,
  ``(R + P) * b`` bytes (bfloat16, R = 512, P = 64: 1,152);
- ``fp8_e4m3``, vLLM's ``fp8_ds_mla`` layout: R e4m3 codes, one float32 scale per 128
  elements (symmetric, as :mod:`pagedkv.format.quant`'s fp8 over each 128), then the P
  positional values in bfloat16: ``R + 4 R / 128 + 2 P`` bytes (656);
- ``int8``: R codes in groups of G (default R: one group), a float32 scale and zero
  point per group (:mod:`pagedkv.format.quant`'s int8 over each group), then P values in
  the model dtype: ``R + 8 R / G + P b`` (648 in bfloat16 at G = R);
- ``int4``: R / 2 bytes of codes (two per byte, low nibble first) in groups of G
  (default 64), a float32 scale and zero point per group, then P values in the model
  dtype: ``R / 2 + 8 R / G + P b`` (448 in bfloat16 at G = 64).

A quantized row is one uint8 row of :attr:`LatentFormat.row_bytes`, in that order:
codes, scales, zero points, positional values. The positional slice is never
quantized: RoPE dimensions carry the position, and their error costs the most. A
model-dtype row is an R + P row of that dtype. The kernels and the CPU ops reproduce
:meth:`LatentFormat.encode` / :meth:`LatentFormat.decode` bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedkv.errors import InvalidArgumentError, expected
from pagedkv.format import dtypes

__all__ = ["LatentFormat", "FP8_TILE", "LATENT_KV_DTYPES", "DEFAULT_INT4_GROUP"]

#: elements per fp8 scale (vLLM's fp8_ds_mla layout)
FP8_TILE = 128
#: int4 group size when none is given (as for K/V rows)
DEFAULT_INT4_GROUP = 64
#: storage formats a latent row can take besides the model dtypes
LATENT_KV_DTYPES = ("fp8_e4m3", "int8", "int4")


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(expected(name, "an int >= 1", repr(value)))
    return value


@dataclass(frozen=True)
class LatentFormat:
    """One latent row's layout.

    Attributes:
        kv_dtype: the stored format: a model dtype name, ``"fp8_e4m3"``, ``"int8"`` or ``"int4"``.
        model_dtype: the model's dtype (the positional slice of int8/int4 rows, and
            what a read returns by default).
        kv_lora_rank: R, elements of ``c_kv`` (the value is these).
        rope_dim: P, elements of ``k_pe``.
        group_size: int8/int4 elements per scale group (None: the default); fp8's is
            fixed at :data:`FP8_TILE`.
    """

    kv_dtype: str
    model_dtype: str
    kv_lora_rank: int
    rope_dim: int
    group_size: int | None = None

    def __post_init__(self) -> None:
        model = dtypes.BY_NAME.get(self.model_dtype) if isinstance(self.model_dtype, str) else None
        if model is None or model.quantized:
            raise InvalidArgumentError(expected("dtype", dtypes.torch_names(dtypes.MODEL), repr(self.model_dtype)))
        row = dtypes.BY_NAME.get(self.kv_dtype) if isinstance(self.kv_dtype, str) else None
        if row is None or (row.quantized and row.name not in LATENT_KV_DTYPES):
            allowed = ", ".join(dtypes.model_names() + LATENT_KV_DTYPES)
            raise InvalidArgumentError(expected("kv_dtype", f"one of {allowed} for MLA latent KV",
                                                repr(self.kv_dtype)))
        r = _positive("kv_lora_rank", self.kv_lora_rank)
        p = _positive("qk_rope_head_dim", self.rope_dim)
        name = row.name
        if not row.quantized:
            if self.group_size is not None:
                raise InvalidArgumentError(expected("kv_group_size", f"None for {name} latent rows",
                                                    repr(self.group_size)))
            return
        if p % 2:
            raise InvalidArgumentError(expected("qk_rope_head_dim", f"an even size for {name} latent rows "
                                                "(rows stay 4-byte aligned)", p))
        if name == "fp8_e4m3":
            if self.group_size not in (None, FP8_TILE):
                raise InvalidArgumentError(expected("kv_group_size", f"None or {FP8_TILE} for fp8_e4m3 latent rows "
                                                    "(one scale per 128, vLLM's fp8_ds_mla)", repr(self.group_size)))
            if r % FP8_TILE:
                raise InvalidArgumentError(expected("kv_lora_rank", f"a multiple of {FP8_TILE} for fp8_e4m3 "
                                                    "latent rows (one scale per 128 elements)", r))
            object.__setattr__(self, "group_size", FP8_TILE)
            return
        default = r if name == "int8" else min(DEFAULT_INT4_GROUP, r)
        g = default if self.group_size is None else self.group_size
        if isinstance(g, bool) or not isinstance(g, int) or g < 1 or r % g:
            raise InvalidArgumentError(expected("kv_group_size", f"an int >= 1 that divides kv_lora_rank ({r})",
                                                repr(g)))
        align = 8 if name == "int4" else 4
        if r % align or (name == "int4" and g % 2):
            what = "a multiple of 8 (two codes per byte, 4-byte aligned scales)" if name == "int4" else \
                "a multiple of 4 (4-byte aligned scales)"
            raise InvalidArgumentError(expected("kv_lora_rank" if r % align else "kv_group_size",
                                                f"{what} for {name} latent rows", r if r % align else g))
        object.__setattr__(self, "group_size", g)

    # -- layout ------------------------------------------------------------------------
    @property
    def row(self) -> dtypes.DTypeInfo:
        return dtypes.BY_NAME[self.kv_dtype]

    @property
    def quantized(self) -> bool:
        return self.row.quantized

    @property
    def width(self) -> int:
        """Elements of a decoded row: R + P."""
        return self.kv_lora_rank + self.rope_dim

    @property
    def groups(self) -> int:
        """Scale groups per row (0 unquantized)."""
        return self.kv_lora_rank // self.group_size if self.group_size else 0

    @property
    def zero_point(self) -> bool:
        return self.row.zero_point

    @property
    def code_bytes(self) -> int:
        if not self.quantized:
            return self.kv_lora_rank * self.row.itemsize
        return self.kv_lora_rank // 2 if self.kv_dtype == "int4" else self.kv_lora_rank

    @property
    def scale_offset(self) -> int:
        return self.code_bytes

    @property
    def zero_offset(self) -> int:
        return self.scale_offset + 4 * self.groups

    @property
    def rope_offset(self) -> int:
        return self.zero_offset + (4 * self.groups if self.zero_point else 0)

    @property
    def rope_dtype(self) -> str:
        """The positional slice's dtype: bfloat16 in the fp8 layout, else the model's."""
        return "bfloat16" if self.kv_dtype == "fp8_e4m3" else self.model_dtype

    @property
    def row_bytes(self) -> int:
        """Bytes per token per layer (see the module docstring's formulas)."""
        if not self.quantized:
            return self.width * self.row.itemsize
        return self.rope_offset + self.rope_dim * dtypes.info(self.rope_dtype).itemsize

    @property
    def row_elems(self) -> int:
        """Elements of a stored row in :attr:`storage_dtype`."""
        return self.width if not self.quantized else self.row_bytes

    @property
    def storage_dtype(self) -> Any:
        """The arena's torch dtype: the model dtype's, or uint8 for a quantized row."""
        import torch

        return self.row.torch_dtype if not self.quantized else torch.uint8

    def describe(self) -> str:
        g = f", group_size={self.group_size}" if self.quantized and self.kv_dtype != "fp8_e4m3" else ""
        return f"{self.kv_dtype} latent (kv_lora_rank={self.kv_lora_rank}, rope_dim={self.rope_dim}{g})"

    # -- the definition ----------------------------------------------------------------------
    def encode(self, kv_c: Any, k_pe: Any) -> Any:
        """Rows ``[N, row_elems]`` (storage dtype) of ``kv_c`` ``[N, R]`` and ``k_pe`` ``[N, P]``
        (float32, float16 or bfloat16)."""
        import torch

        from pagedkv.format import quant

        n = kv_c.shape[0]
        if not self.quantized:
            return torch.cat([kv_c.to(self.storage_dtype), k_pe.to(self.storage_dtype)], dim=-1)
        out = torch.empty(n, self.row_bytes, dtype=torch.uint8, device=kv_c.device)
        if self.kv_dtype == "int4":
            codes, scale, zero = quant.quantize(kv_c, "int4", group_size=self.group_size)
        else:
            q, scale, zero = quant.quantize(kv_c.reshape(n, self.groups, self.group_size), self.kv_dtype)
            codes = q.reshape(n, self.kv_lora_rank)
        out[:, :self.code_bytes] = codes.contiguous().view(torch.uint8)
        out[:, self.scale_offset:self.zero_offset] = scale.reshape(n, self.groups).contiguous().view(torch.uint8)
        if zero is not None:
            out[:, self.zero_offset:self.rope_offset] = zero.reshape(n, self.groups).contiguous().view(torch.uint8)
        rope = k_pe.to(dtypes.info(self.rope_dtype).torch_dtype).contiguous()
        out[:, self.rope_offset:] = rope.view(torch.uint8)
        return out

    def decode(self, rows: Any, out_dtype: Any = None) -> tuple[Any, Any]:
        """``(kv_c [N, R], k_pe [N, P])`` of stored rows ``[N, row_elems]``, in
        ``out_dtype`` (default the model dtype; float64 for a reference: the decoded
        float32 values, widened exactly)."""
        import torch

        from pagedkv.format import quant

        out_dtype = dtypes.info(self.model_dtype).torch_dtype if out_dtype is None else out_dtype
        r = self.kv_lora_rank
        if not self.quantized:
            return rows[:, :r].to(out_dtype), rows[:, r:].to(out_dtype)
        n = rows.shape[0]
        rows = rows.contiguous()
        scale = rows[:, self.scale_offset:self.zero_offset].contiguous().view(torch.float32)
        zero = rows[:, self.zero_offset:self.rope_offset].contiguous().view(torch.float32) if self.zero_point else None
        mid = torch.float32 if out_dtype == torch.float64 else out_dtype
        codes = rows[:, :self.code_bytes].contiguous()
        if self.kv_dtype == "int4":
            kv_c = quant.dequantize(codes, scale, zero, mid)
        else:
            q = codes.view(self.row.torch_dtype).reshape(n, self.groups, self.group_size)
            kv_c = quant.dequantize(q, scale, zero.reshape(n, self.groups) if zero is not None else None,
                                    mid).reshape(n, r)
        rope = rows[:, self.rope_offset:].contiguous().view(dtypes.info(self.rope_dtype).torch_dtype)
        return kv_c.to(out_dtype), rope.to(out_dtype)
