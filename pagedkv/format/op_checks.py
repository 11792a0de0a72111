"""Argument checks of the KV data ops, shared by every backend.

The torch reference (:mod:`pagedkv.ops.reference`), the fast CPU ops
(:mod:`pagedkv.ops.cpu`) and the kernel plans (:mod:`pagedkv.kernels.plans`) all
validate through these functions, so a bad call raises the same typed error with the
same message whichever backend runs it, before any tensor is touched. This module
sits below both ``pagedkv.ops`` and ``pagedkv.kernels``: neither package imports the
other through it.

Shapes: see :mod:`pagedkv.ops.reference`.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from pagedkv.errors import (
    DeviceError,
    DTypeError,
    InvalidArgumentError,
    InvalidBlockError,
    ShapeError,
    expected,
)
from pagedkv.format import dtypes
from pagedkv.format.layer_format import BLOCK_KEY_DTYPES, LayerFormat
from pagedkv.format.quant import MODEL_DTYPES

__all__ = [
    "LAYOUTS",
    "Arenas",
    "LayerGeometry",
    "LayerFormat",
    "check_format",
    "check_tensor",
    "check_layout",
    "check_layer",
    "check_write_kv",
    "check_gather",
    "check_csr",
    "check_padded",
    "check_out",
    "check_rotation",
    "check_key_channels",
    "check_seal_key_blocks",
    "check_key_high_bits",
    "key_extra_bits",
    "check_pairs",
    "check_arenas",
    "check_block_ids",
    "check_slot_values",
    "contiguous_overlap",
    "validate_copy_blocks",
    "validate_swap_blocks",
    "slot_error",
    "indptr_error",
    "seq_len_error",
    "block_id_error",
    "csr_block_where",
    "padded_block_where",
]

LAYOUTS = ("NHD", "HND")

Arenas = torch.Tensor | Sequence[torch.Tensor]


class LayerGeometry(NamedTuple):
    """Sizes of a per-layer view, whatever its layout."""

    num_blocks: int
    block_size: int
    num_heads: int
    head_dim: int
    quantized: bool
    #: the storage format's name (``"int4"``, ``"int3"``...; None unquantized)
    kv_dtype: str | None = None
    #: scale groups per (token, head) row (1 unless the format is grouped)
    groups: int = 1
    #: the layer's format: the caller's ``layer_format``, or the one its tensors imply
    format: LayerFormat | None = None


# ----------------------------------------------------------------------------------
# structural checks (shared by every backend)


def check_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise DTypeError(expected(name, "a torch.Tensor", type(t).__name__))
    if t.layout != torch.strided:   # sparse/compressed tensors have no slots to index
        raise InvalidArgumentError(expected(name, "a dense (strided) tensor", f"a {t.layout} tensor"))
    return t


def _same_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise DeviceError(expected(name, f"device {device}", t.device))


def _index_vector(name: str, t: object, dtypes: tuple[torch.dtype, ...], device) -> torch.Tensor:
    t = check_tensor(name, t)
    if t.dtype not in dtypes:
        want = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise DTypeError(expected(name, f"dtype {want}", t.dtype))
    if t.dim() != 1:
        raise ShapeError(expected(name, "a 1-D tensor", tuple(t.shape)))
    _same_device(name, t, device)
    return t


def check_layout(layout: object, name: str = "layout") -> str:
    """Return ``layout`` if it is ``"NHD"`` or ``"HND"``."""
    if layout not in LAYOUTS:
        raise InvalidArgumentError(expected(name, "'NHD' or 'HND'", repr(layout)))
    return layout


def check_format(layer_format: object) -> LayerFormat | None:
    """``layer_format`` if it is None or a :class:`LayerFormat`."""
    if layer_format is not None and not isinstance(layer_format, LayerFormat):
        raise InvalidArgumentError(expected("layer_format", "None or a pagedkv.format.layer_format.LayerFormat",
                                            type(layer_format).__name__))
    return layer_format


def check_layer(
    kv_layer: object,
    layout: str,
    kv_scale: object = None,
    kv_zero: object = None,
    name: str = "kv_layer",
    layer_format: LayerFormat | None = None,
) -> LayerGeometry:
    """Validate a per-layer view (and its scale/zero views when quantized).

    ``layer_format``: the layer's format; the tensors are verified against it. None (the
    compatibility path): the format the tensors imply, read off them here and nowhere else
    (the data dtype; for the packed formats that share uint8 the scale's dtype, bfloat16
    for int3; the group size from the scale view's trailing dim)."""
    layout = check_layout(layout)
    fmt = check_format(layer_format)
    kv_layer = check_tensor(name, kv_layer)
    if kv_layer.dim() != 5 or kv_layer.shape[1] != 2:
        want = "[num_blocks, 2, block_size, H, D]" if layout == "NHD" else "[num_blocks, 2, H, block_size, D]"
        raise ShapeError(expected(name, f"a {layout} layer view {want}", tuple(kv_layer.shape)))
    if fmt is not None:
        fmt.check_data(name, kv_layer)
        row = fmt.row
    else:
        found = dtypes.layer_row(kv_layer.dtype, kv_scale.dtype if isinstance(kv_scale, torch.Tensor) else None)
        if found is None or (not found.quantized and kv_layer.dtype not in MODEL_DTYPES):
            raise DTypeError(
                expected(name, f"dtype {dtypes.torch_names(dtypes.ALL)}", kv_layer.dtype)
            )
        row = found
    quantized = row.quantized
    nb = kv_layer.shape[0]
    if layout == "NHD":
        bs, h = kv_layer.shape[2], kv_layer.shape[3]
    else:
        h, bs = kv_layer.shape[2], kv_layer.shape[3]
    if kv_layer.shape[4] % row.stored_dim(row.pack):
        raise ShapeError(expected(name, f"a last dim that is a multiple of {row.stored_dim(row.pack)} for "
                                  f"{row.name} ({row.pack} codes per {row.stored_dim(row.pack)} bytes)",
                                  tuple(kv_layer.shape)))
    head_dim = row.head_dim_of(kv_layer.shape[4])
    want_shape = tuple(kv_layer.shape[:-1])
    groups = 1
    if quantized and row.grouped:
        if fmt is not None:
            fmt.check_head_dim(name, head_dim, tuple(kv_layer.shape))
            groups = fmt.groups(head_dim)
        else:
            groups = _groups(kv_scale, want_shape, head_dim, row)
        want_shape += (groups,)
    if quantized:
        _check_param_view("kv_scale", kv_scale, want_shape, kv_layer.device, row)
        if row.zero_point:
            _check_param_view("kv_zero", kv_zero, want_shape, kv_layer.device, row)
        elif kv_zero is not None:
            raise InvalidArgumentError(expected("kv_zero", "None for an fp8 kv_layer", "a tensor"))
    else:
        for pname, p in (("kv_scale", kv_scale), ("kv_zero", kv_zero)):
            if p is not None:
                raise InvalidArgumentError(
                    expected(pname, f"None for an unquantized {kv_layer.dtype} kv_layer", "a tensor")
                )
    if fmt is None:
        group_size = (head_dim // groups if head_dim else row.group_multiple) if row.grouped else None
        fmt = LayerFormat(row.name, group_size)
    return LayerGeometry(nb, bs, h, head_dim, quantized, row.name if quantized else None, groups, fmt)


def _groups(kv_scale: object, lead: tuple, head_dim: int, row: dtypes.DTypeInfo) -> int:
    """Scale groups per head of a grouped (int4, int3) layer whose caller gave no format,
    read from its scale view ``lead + (groups,)`` (int3: groups of a multiple of 8 elements)."""
    if isinstance(kv_scale, torch.Tensor) and kv_scale.dim() == len(lead) + 1:
        ng = kv_scale.shape[-1]
        if ng >= 1 and head_dim % ng == 0 and (head_dim // ng) % row.group_multiple == 0:
            return ng
    what = f"groups of a multiple of {row.group_multiple} elements" if row.group_multiple > 1 else "groups"
    raise ShapeError(expected("kv_scale", f"shape {lead} + (groups,), {what} dividing head_dim {head_dim}, "
                              f"for a {row.name} ({row.torch_name}) kv_layer",
                              tuple(kv_scale.shape) if isinstance(kv_scale, torch.Tensor) else None))


def _check_param_view(name: str, t: object, shape: tuple, device: torch.device, row: dtypes.DTypeInfo) -> None:
    if t is None:
        raise InvalidArgumentError(expected(name, f"a {row.param_torch_name} tensor of shape {shape} for a "
                                            "quantized kv_layer", None))
    t = check_tensor(name, t)
    if t.dtype != row.param_dtype:
        raise DTypeError(expected(name, f"dtype {row.param_torch_name}", t.dtype))
    if tuple(t.shape) != shape:
        raise ShapeError(expected(name, f"shape {shape}", tuple(t.shape)))
    _same_device(name, t, device)


def check_write_kv(kv_layer, slot_mapping, key, value, layout, kv_scale, kv_zero,
                   layer_format: LayerFormat | None = None) -> LayerGeometry:
    """Structural checks of :func:`write_kv` (not the slot values)."""
    geo = check_layer(kv_layer, layout, kv_scale, kv_zero, layer_format=layer_format)
    device = kv_layer.device
    key = check_tensor("key", key)
    value = check_tensor("value", value)
    if key.dim() != 3 or tuple(key.shape[1:]) != (geo.num_heads, geo.head_dim):
        raise ShapeError(
            expected("key", f"[num_tokens, {geo.num_heads}, {geo.head_dim}]", tuple(key.shape))
        )
    if tuple(value.shape) != tuple(key.shape):
        raise ShapeError(expected("value", f"shape {tuple(key.shape)} (as key)", tuple(value.shape)))
    want = kv_layer.dtype if not geo.quantized else None
    for name, t in (("key", key), ("value", value)):
        if want is not None and t.dtype != want:
            raise DTypeError(expected(name, f"dtype {want} (the kv_layer dtype)", t.dtype))
        if t.dtype not in MODEL_DTYPES:
            raise DTypeError(expected(name, f"dtype {dtypes.torch_names(dtypes.MODEL)}", t.dtype))
        _same_device(name, t, device)
    if value.dtype != key.dtype:
        raise DTypeError(expected("value", f"dtype {key.dtype} (as key)", value.dtype))
    _index_vector("slot_mapping", slot_mapping, (torch.int64,), device)
    if slot_mapping.shape[0] != key.shape[0]:
        raise ShapeError(expected("slot_mapping", f"[{key.shape[0]}] (one slot per token)", tuple(slot_mapping.shape)))
    return geo


def check_gather(kv_layer, layout, out_dtype, kv_scale, kv_zero,
                 layer_format: LayerFormat | None = None) -> tuple[LayerGeometry, torch.dtype]:
    """Structural checks of a gather's arena side; returns the resolved out dtype."""
    geo = check_layer(kv_layer, layout, kv_scale, kv_zero, layer_format=layer_format)
    if geo.quantized:
        if out_dtype is None:
            raise DTypeError(
                expected("out_dtype", f"{dtypes.torch_names(dtypes.MODEL)} for a quantized {kv_layer.dtype} kv_layer", None)
            )
        if out_dtype not in MODEL_DTYPES:
            raise DTypeError(expected("out_dtype", dtypes.torch_names(dtypes.MODEL), out_dtype))
        return geo, out_dtype
    if out_dtype is not None and out_dtype != kv_layer.dtype:
        raise DTypeError(expected("out_dtype", f"None or {kv_layer.dtype} (the kv_layer dtype)", out_dtype))
    return geo, kv_layer.dtype


def check_rotation(rotation_signs: object, geo: LayerGeometry, device: torch.device, write: bool = False,
                   explicit: bool = False) -> None:
    """Structural checks of a write's or a gather's ``rotation_signs``: None, or the
    float32 ``[head_dim]`` sign vector of a quantized layer, on its device. The values
    are not read (on a GPU that would sync); every backend applies them alike.

    ``explicit`` (the caller passed a ``layer_format``): the signs must agree with its
    ``rotation``: none for an unrotated format, and a write to a rotated one needs them
    (a gather without them reads the rotated domain, as stored)."""
    fmt = geo.format
    if explicit and fmt is not None:
        if rotation_signs is not None and not fmt.rotation:
            raise InvalidArgumentError(expected("rotation_signs", f"None for layer_format {fmt.describe()} "
                                                "(not rotated)", "a tensor"))
        if rotation_signs is None and fmt.rotation and write:
            raise InvalidArgumentError(expected("rotation_signs", f"the float32 [{geo.head_dim}] signs for a write "
                                                f"to layer_format {fmt.describe()}", None))
    if rotation_signs is None:
        return
    if not isinstance(rotation_signs, torch.Tensor):
        raise DTypeError(expected("rotation_signs", "None or a torch.Tensor", type(rotation_signs).__name__))
    if not geo.quantized:
        raise InvalidArgumentError(expected("rotation_signs", "None for an unquantized kv_layer", "a tensor"))
    if rotation_signs.layout != torch.strided:
        raise InvalidArgumentError(
            expected("rotation_signs", "a dense (strided) tensor", f"a {rotation_signs.layout} tensor"))
    if rotation_signs.dtype != torch.float32:
        raise DTypeError(expected("rotation_signs", "dtype float32", rotation_signs.dtype))
    if tuple(rotation_signs.shape) != (geo.head_dim,):
        raise ShapeError(expected("rotation_signs", f"shape ({geo.head_dim},) (head_dim)", tuple(rotation_signs.shape)))
    _same_device("rotation_signs", rotation_signs, device)


def check_key_channels(key_scale: object, key_zero: object, geo: LayerGeometry, device: torch.device,
                       explicit: bool = False) -> bool:
    """Structural checks of a gather's per-channel key parameters (int4 block keys,
    :func:`pagedkv.format.quant.quantize_key_block`): both None, or both contiguous bfloat16
    ``[num_blocks, H, head_dim]`` on the arena's device, for an int4 layer. Returns
    whether they were given. The values are not read (a zero scale is data: that
    (block, head) still holds per-token keys). ``explicit`` (the caller passed a
    ``layer_format``): they are given exactly when its ``key_quant`` is ``"block"``."""
    fmt = geo.format
    if explicit and fmt is not None:
        given = key_scale is not None or key_zero is not None
        if fmt.key_quant == "block" and not given:
            raise InvalidArgumentError(expected("key_scale", f"the block-key parameters for layer_format "
                                                f"{fmt.describe()}", None))
        if fmt.key_quant != "block" and given:
            raise InvalidArgumentError(expected("key_scale", f"None for layer_format {fmt.describe()} "
                                                "(keys per token)", "a tensor"))
    if key_scale is None and key_zero is None:
        return False
    if key_scale is None or key_zero is None:
        missing = "key_scale" if key_scale is None else "key_zero"
        raise InvalidArgumentError(expected(missing, "a tensor when the other block-key parameter is given", None))
    if geo.kv_dtype not in BLOCK_KEY_DTYPES:
        raise InvalidArgumentError(expected("key_scale", "None unless the kv_layer is int4 or int2 (block keys)",
                                            f"a tensor for a {geo.kv_dtype or 'model-dtype'} kv_layer"))
    shape = (geo.num_blocks, geo.num_heads, geo.head_dim)
    for name, t in (("key_scale", key_scale), ("key_zero", key_zero)):
        t = check_tensor(name, t)
        if t.dtype != torch.bfloat16:
            raise DTypeError(expected(name, "dtype bfloat16", t.dtype))
        if tuple(t.shape) != shape:
            raise ShapeError(expected(name, f"shape {shape} [num_blocks, H, head_dim]", tuple(t.shape)))
        _same_device(name, t, device)
        if not t.is_contiguous():
            raise InvalidArgumentError(expected(name, "a contiguous tensor", f"strides {t.stride()}"))
    return True


def check_seal_key_blocks(kv_layer, blocks, keys, key_scale, key_zero, layout,
                          layer_format: LayerFormat | None = None, kv_scale=None, kv_zero=None) -> LayerGeometry:
    """Structural checks of :func:`pagedkv.ops.reference.seal_key_blocks` (the block ids'
    values are checked by the caller, from one read of them). ``layer_format``, when
    given, must be an int4 or int2 format with block keys (None: int4, the compatibility
    path, whose codes are the only ones a uint8 view implies); ``kv_scale``/``kv_zero``
    (the layer's per-token parameter views) are given exactly when its ``key_bits`` exceed
    4, which only int4 formats' do."""
    layout = check_layout(layout)
    fmt = check_format(layer_format)
    if fmt is not None and fmt.key_quant != "block":
        raise InvalidArgumentError(expected("layer_format", "an int4 or int2 format with key_quant='block'",
                                            fmt.describe()))
    kind = fmt.kv_dtype if fmt is not None else "int4"
    kv_layer = check_tensor("kv_layer", kv_layer)
    if kv_layer.dtype != torch.uint8 or kv_layer.dim() != 5 or kv_layer.shape[1] != 2:
        per = 8 // dtypes.info(kind).code_bits
        want = (f"[num_blocks, 2, block_size, H, D / {per}]" if layout == "NHD"
                else f"[num_blocks, 2, H, block_size, D / {per}]")
        raise ShapeError(expected("kv_layer", f"an {kind} (uint8) {layout} layer view {want}",
                                  f"{kv_layer.dtype} {tuple(kv_layer.shape)}"))
    nb = kv_layer.shape[0]
    bs, h = (kv_layer.shape[2], kv_layer.shape[3]) if layout == "NHD" else (kv_layer.shape[3], kv_layer.shape[2])
    if 0 in (bs, h, kv_layer.shape[4]):
        raise ShapeError(expected("kv_layer", "a non-empty block_size, H and head_dim",
                                  f"{layout} {tuple(kv_layer.shape)}"))
    head_dim = dtypes.info(kind).head_dim_of(kv_layer.shape[4])
    if fmt is None:     # the compatibility path: int4 in groups of the whole row
        fmt = LayerFormat("int4", head_dim, "block")
    fmt.check_head_dim("kv_layer", head_dim, tuple(kv_layer.shape))
    geo = LayerGeometry(nb, bs, h, head_dim, True, kind, fmt.groups(head_dim), fmt)
    device = kv_layer.device
    _index_vector("blocks", blocks, (torch.int64,), device)
    keys = check_tensor("keys", keys)
    keys_shape = (blocks.shape[0], bs, h, geo.head_dim)
    if tuple(keys.shape) != keys_shape:
        raise ShapeError(expected("keys", f"shape {keys_shape} [len(blocks), block_size, H, head_dim]",
                                  tuple(keys.shape)))
    if keys.dtype not in MODEL_DTYPES:
        raise DTypeError(expected("keys", f"dtype {dtypes.torch_names(dtypes.MODEL)}", keys.dtype))
    _same_device("keys", keys, device)
    if not check_key_channels(key_scale, key_zero, geo, device):
        raise InvalidArgumentError(expected("key_scale", "a bfloat16 [num_blocks, H, head_dim] tensor", None))
    check_key_high_bits(kv_layer, layout, kv_scale, kv_zero, fmt)
    return geo


def key_extra_bits(geo: LayerGeometry, key_scale: object) -> int:
    """High bits of a layer's sealed block keys kept in their rows' parameters (0: 4-bit
    keys, or no block keys given). Only a caller's format has them (an inferred one is 4-bit)."""
    return geo.format.key_extra_bits if key_scale is not None and geo.format is not None else 0


def check_key_high_bits(kv_layer, layout, kv_scale, kv_zero, fmt: LayerFormat) -> None:
    """Wider block keys keep their high bits in the K rows' per-token parameters: a seal
    needs the layer's scale and zero views exactly when ``fmt.key_bits`` exceeds 4."""
    wide = fmt.key_extra_bits > 0
    if not wide:
        if kv_scale is not None or kv_zero is not None:
            raise InvalidArgumentError(expected("kv_scale", f"None for layer_format {fmt.describe()} ("
                                                f"{fmt.key_code_bits}-bit block keys keep no bits in the "
                                                "per-token parameters)", "a tensor"))
        return
    if kv_scale is None or kv_zero is None:
        raise InvalidArgumentError(expected("kv_scale" if kv_scale is None else "kv_zero",
                                            f"the layer's per-token parameter view for layer_format "
                                            f"{fmt.describe()} (it holds the keys' high bits)", None))
    check_layer(kv_layer, layout, kv_scale, kv_zero, layer_format=fmt)


def check_csr(indptr, indices, seq_lens, device) -> int:
    """Structural checks of CSR block tables; returns the batch size."""
    _index_vector("indptr", indptr, (torch.int32,), device)
    _index_vector("indices", indices, (torch.int32,), device)
    _index_vector("seq_lens", seq_lens, (torch.int32,), device)
    if indptr.shape[0] < 1:
        raise ShapeError(expected("indptr", "[batch_size + 1]", tuple(indptr.shape)))
    batch = indptr.shape[0] - 1
    if seq_lens.shape[0] != batch:
        raise ShapeError(expected("seq_lens", f"[{batch}] (len(indptr) - 1)", tuple(seq_lens.shape)))
    return batch


def check_padded(block_table, seq_lens, device) -> int:
    """Structural checks of a padded block table; returns the batch size."""
    block_table = check_tensor("block_table", block_table)
    if block_table.dtype != torch.int32:
        raise DTypeError(expected("block_table", "dtype int32", block_table.dtype))
    if block_table.dim() != 2:
        raise ShapeError(expected("block_table", "[batch_size, max_blocks]", tuple(block_table.shape)))
    _same_device("block_table", block_table, device)
    _index_vector("seq_lens", seq_lens, (torch.int32,), device)
    if seq_lens.shape[0] != block_table.shape[0]:
        raise ShapeError(
            expected("seq_lens", f"[{block_table.shape[0]}] (block_table rows)", tuple(seq_lens.shape))
        )
    return block_table.shape[0]


def check_out(out_key, out_value, total: int, geo: LayerGeometry, out_dtype, device) -> bool:
    """Validate optional gather outputs; returns True when they were given."""
    if out_key is None and out_value is None:
        return False
    if out_key is None or out_value is None:
        missing = "out_key" if out_key is None else "out_value"
        raise InvalidArgumentError(expected(missing, "a tensor when the other output is given", None))
    shape = (total, geo.num_heads, geo.head_dim)
    for name, t in (("out_key", out_key), ("out_value", out_value)):
        t = check_tensor(name, t)
        if tuple(t.shape) != shape:
            raise ShapeError(expected(name, f"shape {shape}", tuple(t.shape)))
        if t.dtype != out_dtype:
            raise DTypeError(expected(name, f"dtype {out_dtype}", t.dtype))
        _same_device(name, t, device)
        if not t.is_contiguous():
            raise InvalidArgumentError(expected(name, "a contiguous tensor", f"strides {t.stride()}"))
    if total > 0 and contiguous_overlap(out_key, out_value):
        raise InvalidArgumentError(expected(
            "out_value", "memory disjoint from out_key",
            f"bytes [{out_value.data_ptr():#x}, +{_nbytes(out_value)}) overlapping "
            f"[{out_key.data_ptr():#x}, +{_nbytes(out_key)})"))
    return True


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def contiguous_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors share any byte (a partial overlap included:
    writing one would silently change the other)."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + _nbytes(b) and b0 < a0 + _nbytes(a)


def check_arenas(name: str, arenas: object) -> list[torch.Tensor]:
    """Normalize a tensor or a sequence of tensors to a non-empty list of all-layer arenas
    ``[num_layers, num_blocks, ...]`` that agree on ``num_blocks`` and device. Their
    layer counts may differ (a store keeps its model-precision layers in an arena of their
    own): every op moves blocks arena by arena."""
    if isinstance(arenas, torch.Tensor):
        arenas = [arenas]
    if not isinstance(arenas, (list, tuple)) or len(arenas) == 0:
        raise InvalidArgumentError(expected(name, "a tensor or a non-empty list of tensors", type(arenas).__name__))
    out: list[torch.Tensor] = []
    for i, a in enumerate(arenas):
        a = check_tensor(f"{name}[{i}]", a)
        if a.dim() < 2:
            raise ShapeError(expected(f"{name}[{i}]", "[num_layers, num_blocks, ...]", tuple(a.shape)))
        if i:
            if a.shape[1] != out[0].shape[1]:
                raise ShapeError(expected(f"{name}[{i}]", f"{out[0].shape[1]} blocks in dim 1 (as {name}[0])",
                                          tuple(a.shape[:2])))
            _same_device(f"{name}[{i}]", a, out[0].device)
        out.append(a)
    return out


def check_pairs(pairs: object, *devices: torch.device) -> torch.Tensor:
    """Structural checks of a ``[P, 2]`` (src, dst) block-id tensor.

    ``pairs`` may live on the CPU or on one of the arenas' ``devices``.
    """
    pairs = check_tensor("pairs", pairs)
    if pairs.dtype not in (torch.int64, torch.int32):
        raise DTypeError(expected("pairs", "dtype int64 or int32", pairs.dtype))
    if pairs.dim() != 2 or pairs.shape[1] != 2:
        raise ShapeError(expected("pairs", "[num_pairs, 2] (src, dst)", tuple(pairs.shape)))
    if pairs.device.type != "cpu" and pairs.device not in devices:
        allowed = ", ".join(["cpu"] + sorted({str(d) for d in devices if d.type != "cpu"}))
        raise DeviceError(expected("pairs", f"device {allowed}", pairs.device))
    return pairs


# ----------------------------------------------------------------------------------
# value checks (reference implementation reads the index tensors)


def slot_error(value: int, index: int, num_slots: int) -> InvalidArgumentError:
    """The error for an out-of-range slot (shared so every backend says the same)."""
    return InvalidArgumentError(
        expected(
            "slot_mapping",
            f"slots < {num_slots} (num_blocks * block_size), or negative to skip",
            f"{value} at index {index}",
        )
    )


def indptr_error(b: int, lo: int, hi: int, nnz: int) -> InvalidArgumentError:
    return InvalidArgumentError(
        expected("indptr", f"non-decreasing offsets in [0, {nnz}]", f"indptr[{b}:{b + 2}] = [{lo}, {hi}]")
    )


def seq_len_error(b: int, n: int, num_blocks: int, bs: int, padded: bool) -> InvalidArgumentError:
    what = "(max_blocks * block_size)" if padded else f"({num_blocks} blocks)"
    return InvalidArgumentError(expected("seq_lens", f"0 <= seq_lens[{b}] <= {num_blocks * bs} {what}", n))


def block_id_error(name: str, value: int, num_blocks: int, where: str) -> InvalidBlockError:
    return InvalidBlockError(expected(name, f"block ids in [0, {num_blocks})", f"{value} at {where}"))


def csr_block_where(b: int, j: int) -> str:
    return f"sequence {b}, block {j}"


def padded_block_where(b: int, j: int) -> str:
    return f"row {b}, column {j}"


def check_slot_values(slot_mapping: torch.Tensor, num_slots: int) -> None:
    bad = (slot_mapping >= num_slots).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise slot_error(int(slot_mapping[i]), i, num_slots)


def check_block_ids(name: str, ids: Sequence[int], num_blocks: int, where=lambda i: f"row {i}") -> None:
    """Raise InvalidBlockError naming the first id outside ``[0, num_blocks)``."""
    for i, b in enumerate(ids):
        if b < 0 or b >= num_blocks:
            raise block_id_error(name, b, num_blocks, where(i))


def _pair_lists(pairs: torch.Tensor) -> tuple[list[int], list[int]]:
    rows = pairs.tolist()
    return [r[0] for r in rows], [r[1] for r in rows]


def _check_distinct_dst(dst: list[int]) -> None:
    seen = set()
    for i, d in enumerate(dst):
        if d in seen:
            raise InvalidBlockError(expected("pairs", "distinct dst block ids", f"{d} twice (row {i})"))
        seen.add(d)


def _check_dst_not_src(src: list[int], dst: list[int]) -> None:
    srcs = set(src)
    for i, d in enumerate(dst):
        if d in srcs:
            raise InvalidBlockError(expected("pairs", "dst ids that are not also src ids", f"{d} (row {i})"))


def validate_copy_blocks(arenas: Arenas, pairs: torch.Tensor) -> tuple[list[torch.Tensor], list[int], list[int]]:
    """All checks of :func:`copy_blocks`; returns (arenas as a list, src ids, dst ids)."""
    arenas = check_arenas("arenas", arenas)
    pairs = check_pairs(pairs, arenas[0].device)
    nb = arenas[0].shape[1]
    src, dst = _pair_lists(pairs)
    check_block_ids("pairs", src, nb, where=lambda i: f"src row {i}")
    check_block_ids("pairs", dst, nb, where=lambda i: f"dst row {i}")
    _check_distinct_dst(dst)
    _check_dst_not_src(src, dst)
    return arenas, src, dst


def validate_swap_blocks(
    src_arenas: Arenas, dst_arenas: Arenas, pairs: torch.Tensor
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int], list[int]]:
    """All checks of :func:`swap_blocks`; returns (src list, dst list, src ids, dst ids)."""
    srcs = check_arenas("src_arenas", src_arenas)
    dsts = check_arenas("dst_arenas", dst_arenas)
    if len(srcs) != len(dsts):
        raise InvalidArgumentError(expected("dst_arenas", f"{len(srcs)} tensors (as src_arenas)", len(dsts)))
    for i, (s, d) in enumerate(zip(srcs, dsts)):
        if s.dtype != d.dtype:
            raise DTypeError(expected(f"dst_arenas[{i}]", f"dtype {s.dtype} (as src_arenas[{i}])", d.dtype))
        if s.dim() != d.dim() or s.shape[0] != d.shape[0] or s.shape[2:] != d.shape[2:]:
            want = (s.shape[0], "num_blocks") + tuple(s.shape[2:])
            raise ShapeError(expected(f"dst_arenas[{i}]", f"shape {want} (as src_arenas[{i}])", tuple(d.shape)))
    pairs = check_pairs(pairs, srcs[0].device, dsts[0].device)
    src, dst = _pair_lists(pairs)
    check_block_ids("pairs", src, srcs[0].shape[1], where=lambda i: f"src row {i}")
    check_block_ids("pairs", dst, dsts[0].shape[1], where=lambda i: f"dst row {i}")
    _check_distinct_dst(dst)
    if any(_overlaps(s, d) for s, d in zip(srcs, dsts)):
        _check_dst_not_src(src, dst)
    return srcs, dsts, src, dst


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
