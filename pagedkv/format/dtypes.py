"""The one table of dtypes pagedkv knows: model dtypes and quantized storage dtypes.

Every module that names, sizes or maps a dtype reads it from here: the config's
canonical names and aliases, the quantizer's storage dtypes and fp8 maxima, the
kernels' variant spellings (``f16``, ``e4m3``...) and the ops' dtype checks. A new
storage format is one more :class:`DTypeInfo` row.

torch stays optional (the bookkeeping core needs only numpy): rows hold the torch
dtype's attribute name, and :attr:`DTypeInfo.torch_dtype` imports torch on first use.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import gcd as _gcd
from typing import Any

__all__ = [
    "default_int4_group",
    "DTypeInfo",
    "MODEL",
    "QUANTIZED",
    "ALL",
    "BY_NAME",
    "info",
    "layer_row",
    "lookup",
    "model_names",
    "quantized_names",
    "torch_names",
]


@dataclass(frozen=True)
class DTypeInfo:
    """One dtype.

    Attributes:
        name: canonical name (``"float16"``, ``"fp8_e4m3"``), as stored in a config.
        aliases: other accepted spellings, lower case (the torch name is always one).
        torch_name: attribute of the ``torch`` module (``"float8_e4m3fn"``).
        kernel_name: spelling in kernel entry points and C type macros (``"e4m3"``).
        itemsize: bytes per element of the torch storage dtype.
        max_finite: largest finite value the dtype holds (the fp8 clamp bound; the top
            code for integer formats).
        quantized: True for storage formats that need a scale per (token, head).
        zero_point: True when quantization also stores a zero point (asymmetric).
        code_bits: bits of one packed code (4 for int4: two codes per uint8; 3 for int3:
            eight codes per three uint8), or 0 when each element is one storage element.
            The stored last dim is ``head_dim * code_bits / 8`` (:meth:`stored_dim`).
        grouped: True when scales (and zero points) are kept per group of
            ``kv_group_size`` elements along ``head_dim`` instead of per (token, head).
        group_multiple: a scale group's length must be a multiple of this (8 for int3:
            whole 3-byte packs per group).
        param_torch_name: torch dtype of the scale and zero-point arenas. It tells the
            packed formats that share a storage dtype apart: a uint8 arena with
            bfloat16 params is int3, float16 int2, float32 int4 (:func:`layer_row`).
        compiled: whether the CUDA kernels and the CPU C loops decode this format; a
            format without them (int2) runs the torch definition on the CPU and is
            refused by the CUDA path with a typed error.
    """

    name: str
    aliases: tuple[str, ...]
    torch_name: str
    kernel_name: str
    itemsize: int
    max_finite: float
    quantized: bool
    zero_point: bool = False
    code_bits: int = 0
    grouped: bool = False
    group_multiple: int = 1
    param_torch_name: str = "float32"
    compiled: bool = True

    @property
    def torch_dtype(self) -> Any:
        """The torch dtype (imports torch)."""
        import torch

        return getattr(torch, self.torch_name)

    @property
    def element_bytes(self) -> float:
        """Bytes per logical K/V element, scales excluded (0.5 for int4, 0.375 for int3, 0.25 for int2)."""
        return self.code_bits / 8 if self.code_bits else float(self.itemsize)

    @property
    def param_dtype(self) -> Any:
        """The torch dtype of the scale and zero-point arenas (imports torch)."""
        import torch

        return getattr(torch, self.param_torch_name)

    @property
    def param_bytes(self) -> int:
        """Bytes of one stored scale (or zero point)."""
        return 2 if self.param_torch_name in ("bfloat16", "float16") else 4

    @property
    def pack(self) -> int:
        """Elements of ``head_dim`` that fill a whole number of storage bytes (8 for int3,
        2 for int4, 1 unpacked): ``head_dim`` must be a multiple of it."""
        return 8 // _gcd(8, self.code_bits) if self.code_bits else 1

    def stored_dim(self, head_dim: int) -> int:
        """Storage elements of one ``head_dim`` row (``head_dim`` a multiple of :attr:`pack`)."""
        return head_dim * self.code_bits // 8 if self.code_bits else head_dim

    def head_dim_of(self, stored: int) -> int:
        """The ``head_dim`` whose row is ``stored`` storage elements (inverse of :meth:`stored_dim`;
        ``stored`` a multiple of ``stored_dim(pack)``)."""
        return stored * 8 // self.code_bits if self.code_bits else stored

    @property
    def float8(self) -> bool:
        """True for the fp8 storage formats (symmetric, clamped to ``max_finite``)."""
        return self.torch_name.startswith("float8")

    @property
    def spellings(self) -> tuple[str, ...]:
        """Every accepted name: canonical, torch name, aliases (no duplicates)."""
        out = [self.name]
        for s in (self.torch_name,) + self.aliases:
            if s not in out:
                out.append(s)
        return tuple(out)


MODEL: tuple[DTypeInfo, ...] = (
    DTypeInfo("float32", ("fp32", "float"), "float32", "f32", 4, 3.4028234663852886e38, False),
    DTypeInfo("float16", ("fp16", "half"), "float16", "f16", 2, 65504.0, False),
    DTypeInfo("bfloat16", ("bf16",), "bfloat16", "bf16", 2, 3.3895313892515355e38, False),
)

QUANTIZED: tuple[DTypeInfo, ...] = (
    DTypeInfo("fp8_e4m3", ("fp8", "fp8_e4m3fn"), "float8_e4m3fn", "e4m3", 1, 448.0, True),
    DTypeInfo("fp8_e5m2", (), "float8_e5m2", "e5m2", 1, 57344.0, True),
    DTypeInfo("int8", (), "int8", "int8", 1, 127.0, True, zero_point=True),
    # Unsigned 4-bit codes 0..15, two per byte (low nibble first), with a float32 scale
    # and zero point per group along head_dim.
    DTypeInfo("int4", ("uint4",), "uint8", "int4", 1, 15.0, True, zero_point=True, code_bits=4, grouped=True),
    # Unsigned 3-bit codes 0..7, eight per three bytes (24 bits, little-endian), with a
    # bfloat16 scale and zero point per group along head_dim: 4 bits per element at G=32.
    DTypeInfo("int3", ("uint3",), "uint8", "int3", 1, 7.0, True, zero_point=True, code_bits=3, grouped=True,
              group_multiple=8, param_torch_name="bfloat16"),
    # Unsigned 2-bit codes 0..3, four per byte (element 4i + j in bits 2j..2j+1), with a
    # float16 scale and zero point per group along head_dim (KIVI-2's values; its keys
    # go per channel over each full block: key_quant="block"). float16 params tell it
    # from int4 and int3, which share the uint8 storage.
    DTypeInfo("int2", ("uint2",), "uint8", "int2", 1, 3.0, True, zero_point=True, code_bits=2, grouped=True,
              group_multiple=4, param_torch_name="float16", compiled=False),
)

ALL: tuple[DTypeInfo, ...] = MODEL + QUANTIZED
BY_NAME: dict[str, DTypeInfo] = {d.name: d for d in ALL}
_BY_SPELLING: dict[str, DTypeInfo] = {}
for _row in ALL:
    for _s in _row.spellings:
        # torch.uint8 spells int4 (the first row stored as uint8); int3 is told apart by
        # its bfloat16 params (layer_row)
        _BY_SPELLING.setdefault(_s, _row)
del _row, _s


def _spelling(value: Any) -> str | None:
    """Lower-case spelling of a name, or the torch name of a torch dtype."""
    if isinstance(value, str):
        return value.lower()
    if type(value).__name__ == "dtype" and type(value).__module__ == "torch":
        return str(value).replace("torch.", "")
    return None


def lookup(value: Any) -> DTypeInfo | None:
    """The row for a name, alias or torch dtype; None when pagedkv does not know it."""
    spelling = _spelling(value)
    return _BY_SPELLING.get(spelling) if spelling is not None else None


def layer_row(data_dtype: Any, param_dtype: Any = None) -> DTypeInfo | None:
    """The row of a stored arena from its data dtype and, for the packed formats that
    share one (uint8), its scale arena's dtype: bfloat16 params mean int3, float16 int2,
    anything else int4 (the caller then checks the params against the row's ``param_torch_name``)."""
    row = lookup(data_dtype)
    if row is not None and row.code_bits and param_dtype is not None:
        for other in QUANTIZED:
            if other.torch_name == row.torch_name and _spelling(param_dtype) == other.param_torch_name:
                return other
    return row


def info(name: str) -> DTypeInfo:
    """The row of a canonical name (a KeyError for an unknown one: callers validate first)."""
    return BY_NAME[name]


def model_names() -> tuple[str, ...]:
    return tuple(d.name for d in MODEL)


def quantized_names() -> tuple[str, ...]:
    return tuple(d.name for d in QUANTIZED)


def torch_names(rows: tuple[DTypeInfo, ...]) -> str:
    """``"float32, float16 or bfloat16"``: the rows' torch names, for error messages."""
    names = list(dict.fromkeys(d.torch_name for d in rows))
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def default_int4_group(head_dim: int) -> int:
    """The int4 group size when none is given: the largest divisor of ``head_dim`` that
    is at most 64 and a multiple of 8 (the CPU and CUDA loops read 8 elements at a
    time), or, for a ``head_dim`` no multiple of 8, the largest even divisor at most 64.
    So every even ``head_dim`` has one: 128 and 256 get 64, 72 gets 24, 80 gets 40, 96
    gets 48, 112 gets 56, and a ``head_dim`` of 64 or less is its own group."""
    step = 8 if head_dim % 8 == 0 else 2
    for g in range(min(64, head_dim) // step * step, 0, -step):
        if head_dim % g == 0:
            return g
    return head_dim
