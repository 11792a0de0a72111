"""The format of one layer's stored K/V: what the data ops need to know about its bytes.

A :class:`LayerFormat` names the storage dtype, the scale group size, the parameter
(scale/zero) layout that follows from them, the key quantization mode and whether rows
are stored rotated. The store builds one per kind of layer it holds
(:meth:`LayerFormat.of_config`: its quantized layers, and its model-precision layers)
and passes it to every data op (``layer_format=``). The ops read the format from it
and only *verify* the tensors against it (typed errors naming the tensor), instead of
rediscovering the format from tensor dtypes and shapes (int4 and int3 share the uint8
data dtype; the group size is not in the data tensor at all).

A caller that passes no format gets the format its tensors imply, read off them by
:func:`pagedkv.format.op_checks.check_layer` (the one place that does): the
compatibility path of the public ops.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

from pagedkv.errors import DTypeError, InvalidArgumentError, ShapeError, expected
from pagedkv.format import dtypes

__all__ = ["LayerFormat", "KEY_QUANT_MODES", "PARAM_LAYOUTS", "BLOCK_KEY_DTYPES", "key_spare_bits"]

#: ``key_quant`` values: keys per token (as values), or per channel over each full block.
KEY_QUANT_MODES = ("token", "block")
#: storage formats whose keys may go per channel over each block (``key_quant="block"``)
BLOCK_KEY_DTYPES = ("int4", "int2")
#: :attr:`LayerFormat.param_layout` values.
PARAM_LAYOUTS = ("none", "row", "group")


def key_spare_bits(group_size: int) -> int:
    """Extra code bits per channel that a sealed block's per-token parameter bytes hold
    for int4 groups of ``group_size`` (a float32 scale and zero point per group: ``64 /
    group_size`` bits per channel), rounded down to 4, 2, 1 or 0 so that no channel's bits
    cross a byte (4 at most: codes of 8 bits)."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise InvalidArgumentError(expected("group_size", "an int >= 1", repr(group_size)))
    room = 64 // group_size
    return next(e for e in (4, 2, 1, 0) if e <= room)


@dataclass(frozen=True)
class LayerFormat:
    """The stored format of a layer.

    Attributes:
        kv_dtype: canonical dtype name (:mod:`pagedkv.format.dtypes`): a model dtype
            (``"float16"``: stored as is) or a storage format (``"int4"``).
        group_size: elements of ``head_dim`` per scale/zero group for the grouped
            formats (int4, int3, int2); None for every other format.
        key_quant: ``"token"``, or ``"block"`` (int4, int2): full blocks' keys are
            requantized per channel (:mod:`pagedkv.store.block_keys`).
        rotation: rows are stored rotated (:mod:`pagedkv.format.rotation`; quantized only).
        key_bits: bits of an int4 sealed block key's code (4; 5, 6 or 8 with int4 block
            keys, the high bits kept in the K row's per-token parameter bytes, which a sealed
            row no longer needs: at most ``4 + key_spare_bits(group_size)``; see
            :mod:`pagedkv.format.quant`, "wider block keys"). 4, meaning no widening, for
            every other format (int2's sealed keys are 2-bit: :attr:`key_code_bits`).
    """

    kv_dtype: str
    group_size: int | None = None
    key_quant: str = "token"
    rotation: bool = False
    key_bits: int = 4

    def __post_init__(self) -> None:
        row = dtypes.BY_NAME.get(self.kv_dtype) if isinstance(self.kv_dtype, str) else None
        if row is None:
            names = ", ".join(repr(d.name) for d in dtypes.ALL)
            raise InvalidArgumentError(expected("kv_dtype", f"one of {names}", repr(self.kv_dtype)))
        if row.grouped:
            g = self.group_size
            if isinstance(g, bool) or not isinstance(g, int) or g < 1 or g % row.group_multiple:
                what = f"a positive multiple of {row.group_multiple}" if row.group_multiple > 1 else "a positive int"
                raise InvalidArgumentError(expected("group_size", f"{what} for {row.name}", repr(g)))
        elif self.group_size is not None:
            raise InvalidArgumentError(expected("group_size", f"None for {row.name} (not grouped)",
                                                repr(self.group_size)))
        if self.key_quant not in KEY_QUANT_MODES:
            raise InvalidArgumentError(expected("key_quant", "'token' or 'block'", repr(self.key_quant)))
        if self.key_quant == "block" and row.name not in BLOCK_KEY_DTYPES:
            raise InvalidArgumentError(expected("key_quant", f"'token' for {row.name} ('block' is int4 and int2 "
                                                "only)", repr(self.key_quant)))
        if not isinstance(self.rotation, bool):
            raise InvalidArgumentError(expected("rotation", "a bool", repr(self.rotation)))
        kb = self.key_bits
        if isinstance(kb, bool) or not isinstance(kb, int) or kb not in (4, 5, 6, 8):
            raise InvalidArgumentError(expected("key_bits", "4, 5, 6 or 8", repr(kb)))
        if kb != 4:
            if self.key_quant != "block":
                raise InvalidArgumentError(expected("key_bits", "4 unless key_quant is 'block'", kb))
            if row.name != "int4":    # int2's sealed codes fill their bytes: no room for high bits
                raise InvalidArgumentError(expected("key_bits", f"4 for {row.name} (wider block keys are int4 only)",
                                                    kb))
            room = 4 + key_spare_bits(self.group_size)    # type: ignore[arg-type]  # int4: grouped
            if kb > room:
                raise InvalidArgumentError(expected("key_bits", f"at most {room} for group_size {self.group_size} "
                                                    "(the per-token parameter bytes hold the high bits)", kb))
        if self.rotation and not row.quantized:
            raise InvalidArgumentError(expected("rotation", f"False for unquantized {row.name}", True))

    # -- construction ------------------------------------------------------------------

    @classmethod
    def of_config(cls, config, quantized: bool = True) -> LayerFormat:
        """The format of ``config``'s quantized layers (``quantized``; the model dtype
        when the cache is not quantized), or of its model-precision layers."""
        if not (quantized and config.quantized):
            return cls(config.dtype)
        return cls(config.kv_dtype, config.kv_group_size if dtypes.info(config.kv_dtype).grouped else None,
                   config.kv_key_quant or "token", bool(config.kv_rotation), config.kv_key_bits or 4)

    # -- what the format implies ------------------------------------------------------------

    @property
    def key_extra_bits(self) -> int:
        """High bits of a sealed block key's code kept in its row's parameter bytes (0: 4-bit)."""
        return self.key_bits - 4

    @property
    def row(self) -> dtypes.DTypeInfo:
        """The dtype table's row of :attr:`kv_dtype`."""
        return dtypes.BY_NAME[self.kv_dtype]

    @property
    def quantized(self) -> bool:
        return self.row.quantized

    @property
    def zero_point(self) -> bool:
        """Whether a zero-point arena goes with the scale arena."""
        return self.row.zero_point

    @property
    def key_code_bits(self) -> int:
        """Bits of one per-channel key code of a sealed block: :attr:`key_bits` for int4,
        the format's code width otherwise (2 for int2)."""
        return self.key_bits if self.kv_dtype == "int4" else self.row.code_bits

    @property
    def param_layout(self) -> str:
        """``"none"`` (unquantized), ``"row"`` (one scale per (token, head)) or
        ``"group"`` (a trailing groups dim: ``head_dim / group_size`` per (token, head))."""
        if not self.quantized:
            return "none"
        return "group" if self.row.grouped else "row"

    @cached_property
    def data_dtype(self) -> Any:
        """The torch dtype of the data arena (imports torch; cached: the ops compare it per call)."""
        return self.row.torch_dtype

    @property
    def param_dtype(self) -> Any:
        """The torch dtype of the scale/zero arenas, None unquantized (imports torch)."""
        return self.row.param_dtype if self.quantized else None

    def groups(self, head_dim: int) -> int:
        """Scale groups per (token, head) row (1 unless grouped)."""
        return head_dim // self.group_size if self.group_size else 1

    def stored_dim(self, head_dim: int) -> int:
        """Storage elements of one ``head_dim`` row."""
        return self.row.stored_dim(head_dim)

    def head_dim_of(self, stored: int) -> int:
        return self.row.head_dim_of(stored)

    def param_shape(self, lead: tuple, head_dim: int) -> tuple:
        """The scale (and zero) view's shape for data rows ``lead`` (the data view's shape
        without its last dim)."""
        return tuple(lead) + ((self.groups(head_dim),) if self.param_layout == "group" else ())

    # -- verification -------------------------------------------------------------------

    def check_data(self, name: str, t: Any) -> None:
        """``t`` (a data view) is stored in this format's dtype."""
        if t.dtype != self.data_dtype:
            raise DTypeError(expected(name, f"dtype {self.row.torch_name} (layer_format {self.kv_dtype})", t.dtype))

    def check_head_dim(self, name: str, head_dim: int, shape: tuple) -> None:
        """``head_dim`` suits this format: whole packs, whole groups."""
        if self.group_size and head_dim % self.group_size:
            raise ShapeError(expected(name, f"a head_dim that is a multiple of group_size {self.group_size} "
                                      f"(layer_format {self.kv_dtype})", shape))

    def describe(self) -> str:
        parts = [self.kv_dtype]
        if self.group_size:
            parts.append(f"group_size={self.group_size}")
        if self.key_quant != "token":
            parts.append(f"key_quant={self.key_quant}")
        if self.key_bits != 4:
            parts.append(f"key_bits={self.key_bits}")
        if self.rotation:
            parts.append("rotated")
        return ", ".join(parts)
