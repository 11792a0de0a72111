"""Torch reference ops: the semantic definition of every KV data op.

The fast CPU path (:mod:`pagedkv.ops.cpu`) and the CUDA kernels
(:mod:`pagedkv.kernels.ops`) must produce exactly what these functions produce,
element for element. They are plain torch and run on any device, slowly.

Shapes (``NB`` blocks, ``bs`` tokens per block, ``H`` kv heads, ``D`` head dim):

- per-layer data view: NHD ``[NB, 2, bs, H, D]``, HND ``[NB, 2, H, bs, D]``
  (index 0 of dim 1 is K, 1 is V);
- per-layer scale/zero view (quantized storage only, float32): NHD
  ``[NB, 2, bs, H]``, HND ``[NB, 2, H, bs]``;
- whole arenas add a leading ``num_layers`` dim.

``slot = block_id * bs + offset`` (int64); a negative slot is skipped.

Every function validates all its inputs before touching any tensor, so a call that
raises leaves every arena unchanged. Nothing is cast silently: a dtype mismatch is a
:class:`~pagedkv.errors.DTypeError`. The structural checks (``check_*``) are public
so the other backends share them and raise the same messages.

Duplicate non-negative slots in one :func:`write_kv` call are the caller's bug:
which of the tokens lands is unspecified (as in every GPU implementation).
"""
from __future__ import annotations

from typing import List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from pagedkv.errors import (
    DeviceError,
    DTypeError,
    InvalidArgumentError,
    InvalidBlockError,
    ShapeError,
    expected,
)
from pagedkv.quant import MODEL_DTYPES, dequantize, is_quantized, quantize

__all__ = [
    "LAYOUTS",
    "LayerGeometry",
    "write_kv",
    "gather_kv",
    "gather_kv_padded",
    "copy_blocks",
    "swap_blocks",
    "convert_layout",
    "check_layout",
    "check_layer",
    "check_write_kv",
    "check_gather",
    "check_csr",
    "check_padded",
    "check_out",
    "check_pairs",
    "check_arenas",
    "check_block_ids",
    "validate_copy_blocks",
    "validate_swap_blocks",
    "slot_error",
    "indptr_error",
    "seq_len_error",
    "block_id_error",
]

LAYOUTS = ("NHD", "HND")

Arenas = Union[torch.Tensor, Sequence[torch.Tensor]]


class LayerGeometry(NamedTuple):
    """Sizes of a per-layer view, whatever its layout."""

    num_blocks: int
    block_size: int
    num_heads: int
    head_dim: int
    quantized: bool


# ----------------------------------------------------------------------------------
# structural checks (shared by every backend)


def _tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise DTypeError(expected(name, "a torch.Tensor", type(t).__name__))
    if t.layout != torch.strided:   # sparse/compressed tensors have no slots to index
        raise InvalidArgumentError(expected(name, "a dense (strided) tensor", f"a {t.layout} tensor"))
    return t


def _same_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise DeviceError(expected(name, f"device {device}", t.device))


def _index_vector(name: str, t: object, dtypes: Tuple[torch.dtype, ...], device) -> torch.Tensor:
    t = _tensor(name, t)
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
    return layout  # type: ignore[return-value]


def check_layer(
    kv_layer: object,
    layout: str,
    kv_scale: object = None,
    kv_zero: object = None,
    name: str = "kv_layer",
) -> LayerGeometry:
    """Validate a per-layer view (and its scale/zero views when quantized)."""
    layout = check_layout(layout)
    kv_layer = _tensor(name, kv_layer)
    if kv_layer.dim() != 5 or kv_layer.shape[1] != 2:
        want = "[num_blocks, 2, block_size, H, D]" if layout == "NHD" else "[num_blocks, 2, H, block_size, D]"
        raise ShapeError(expected(name, f"a {layout} layer view {want}", tuple(kv_layer.shape)))
    quantized = is_quantized(kv_layer.dtype)
    if not quantized and kv_layer.dtype not in MODEL_DTYPES:
        raise DTypeError(
            expected(name, "dtype float32, float16, bfloat16, float8_e4m3fn, float8_e5m2, int8 or uint8 (int4)",
                     kv_layer.dtype)
        )
    nb = kv_layer.shape[0]
    if layout == "NHD":
        bs, h = kv_layer.shape[2], kv_layer.shape[3]
    else:
        h, bs = kv_layer.shape[2], kv_layer.shape[3]
    int4 = kv_layer.dtype == torch.uint8  # packed int4: two codes per byte
    geo = LayerGeometry(nb, bs, h, kv_layer.shape[4] * (2 if int4 else 1), quantized)
    want_shape = tuple(kv_layer.shape[:-1])
    if int4:
        want_shape += (_int4_groups(kv_scale, want_shape, geo.head_dim),)
    if quantized:
        _check_param_view("kv_scale", kv_scale, want_shape, kv_layer.device)
        if kv_layer.dtype in (torch.int8, torch.uint8):
            _check_param_view("kv_zero", kv_zero, want_shape, kv_layer.device)
        elif kv_zero is not None:
            raise InvalidArgumentError(expected("kv_zero", "None for an fp8 kv_layer", "a tensor"))
    else:
        for pname, p in (("kv_scale", kv_scale), ("kv_zero", kv_zero)):
            if p is not None:
                raise InvalidArgumentError(
                    expected(pname, f"None for an unquantized {kv_layer.dtype} kv_layer", "a tensor")
                )
    return geo


def _int4_groups(kv_scale: object, lead: tuple, head_dim: int) -> int:
    """Groups per head of an int4 layer, read from its scale view ``lead + (groups,)``."""
    if isinstance(kv_scale, torch.Tensor) and kv_scale.dim() == len(lead) + 1:
        ng = kv_scale.shape[-1]
        if ng >= 1 and head_dim % ng == 0:
            return ng
    raise ShapeError(expected("kv_scale", f"shape {lead} + (groups,), groups dividing head_dim {head_dim}, "
                              "for an int4 (uint8) kv_layer",
                              tuple(kv_scale.shape) if isinstance(kv_scale, torch.Tensor) else None))


def _check_param_view(name: str, t: object, shape: tuple, device: torch.device) -> None:
    if t is None:
        raise InvalidArgumentError(expected(name, f"a float32 tensor of shape {shape} for a quantized kv_layer", None))
    t = _tensor(name, t)
    if t.dtype != torch.float32:
        raise DTypeError(expected(name, "dtype float32", t.dtype))
    if tuple(t.shape) != shape:
        raise ShapeError(expected(name, f"shape {shape}", tuple(t.shape)))
    _same_device(name, t, device)


def check_write_kv(kv_layer, slot_mapping, key, value, layout, kv_scale, kv_zero) -> LayerGeometry:
    """Structural checks of :func:`write_kv` (not the slot values)."""
    geo = check_layer(kv_layer, layout, kv_scale, kv_zero)
    device = kv_layer.device
    key = _tensor("key", key)
    value = _tensor("value", value)
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
            raise DTypeError(expected(name, "dtype float32, float16 or bfloat16", t.dtype))
        _same_device(name, t, device)
    if value.dtype != key.dtype:
        raise DTypeError(expected("value", f"dtype {key.dtype} (as key)", value.dtype))
    _index_vector("slot_mapping", slot_mapping, (torch.int64,), device)
    if slot_mapping.shape[0] != key.shape[0]:
        raise ShapeError(expected("slot_mapping", f"[{key.shape[0]}] (one slot per token)", tuple(slot_mapping.shape)))
    return geo


def check_gather(kv_layer, layout, out_dtype, kv_scale, kv_zero) -> Tuple[LayerGeometry, torch.dtype]:
    """Structural checks of a gather's arena side; returns the resolved out dtype."""
    geo = check_layer(kv_layer, layout, kv_scale, kv_zero)
    if geo.quantized:
        if out_dtype is None:
            raise DTypeError(
                expected("out_dtype", f"float32, float16 or bfloat16 for a quantized {kv_layer.dtype} kv_layer", None)
            )
        if out_dtype not in MODEL_DTYPES:
            raise DTypeError(expected("out_dtype", "float32, float16 or bfloat16", out_dtype))
        return geo, out_dtype
    if out_dtype is not None and out_dtype != kv_layer.dtype:
        raise DTypeError(expected("out_dtype", f"None or {kv_layer.dtype} (the kv_layer dtype)", out_dtype))
    return geo, kv_layer.dtype


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
    block_table = _tensor("block_table", block_table)
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
        t = _tensor(name, t)
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


def check_arenas(name: str, arenas: object) -> List[torch.Tensor]:
    """Normalize a tensor or a sequence of tensors to a non-empty list of all-layer arenas
    ``[num_layers, num_blocks, ...]`` that agree on ``num_layers``, ``num_blocks`` and device."""
    if isinstance(arenas, torch.Tensor):
        arenas = [arenas]
    if not isinstance(arenas, (list, tuple)) or len(arenas) == 0:
        raise InvalidArgumentError(expected(name, "a tensor or a non-empty list of tensors", type(arenas).__name__))
    out = []
    for i, a in enumerate(arenas):
        a = _tensor(f"{name}[{i}]", a)
        if a.dim() < 2:
            raise ShapeError(expected(f"{name}[{i}]", "[num_layers, num_blocks, ...]", tuple(a.shape)))
        if i:
            if tuple(a.shape[:2]) != tuple(out[0].shape[:2]):
                raise ShapeError(
                    expected(f"{name}[{i}]", f"leading dims {tuple(out[0].shape[:2])} (as {name}[0])", tuple(a.shape[:2]))
                )
            _same_device(f"{name}[{i}]", a, out[0].device)
        out.append(a)
    return out


def check_pairs(pairs: object, *devices: torch.device) -> torch.Tensor:
    """Structural checks of a ``[P, 2]`` (src, dst) block-id tensor.

    ``pairs`` may live on the CPU or on one of the arenas' ``devices``.
    """
    pairs = _tensor("pairs", pairs)
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


def _check_slots(slot_mapping: torch.Tensor, num_slots: int) -> None:
    bad = (slot_mapping >= num_slots).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise slot_error(int(slot_mapping[i]), i, num_slots)


def check_block_ids(name: str, ids: Sequence[int], num_blocks: int, where=lambda i: f"row {i}") -> None:
    """Raise InvalidBlockError naming the first id outside ``[0, num_blocks)``."""
    for i, b in enumerate(ids):
        if b < 0 or b >= num_blocks:
            raise block_id_error(name, b, num_blocks, where(i))


def _csr_token_index(indptr, indices, seq_lens, bs: int, nb: int):
    """Per-token (block_id, offset) tensors of CSR tables, after checking their values."""
    ptr = indptr.tolist()
    idx = indices.tolist()
    lens = seq_lens.tolist()
    nnz = len(idx)
    blocks: List[List[int]] = []
    for b, n in enumerate(lens):
        lo, hi = ptr[b], ptr[b + 1]
        if not 0 <= lo <= hi <= nnz:
            raise indptr_error(b, lo, hi, nnz)
        if n < 0 or n > (hi - lo) * bs:
            raise seq_len_error(b, n, hi - lo, bs, padded=False)
        need = idx[lo : lo + -(-n // bs)]
        check_block_ids("indices", need, nb, where=lambda j, b=b: csr_block_where(b, j))
        blocks.append(need)
    return _token_index(blocks, lens, bs)


def _padded_token_index(block_table, seq_lens, bs: int, nb: int):
    rows = block_table.tolist()
    lens = seq_lens.tolist()
    width = block_table.shape[1]
    blocks: List[List[int]] = []
    for b, n in enumerate(lens):
        if n < 0 or n > width * bs:
            raise seq_len_error(b, n, width, bs, padded=True)
        need = rows[b][: -(-n // bs)]
        check_block_ids("block_table", need, nb, where=lambda j, b=b: padded_block_where(b, j))
        blocks.append(need)
    return _token_index(blocks, lens, bs)


def _token_index(blocks: List[List[int]], lens: List[int], bs: int):
    blk, off = [], []
    for need, n in zip(blocks, lens):
        blk.append(torch.tensor(need, dtype=torch.int64).repeat_interleave(bs)[:n])
        off.append(torch.arange(n, dtype=torch.int64) % bs)
    if not blk:
        empty = torch.zeros(0, dtype=torch.int64)
        return empty, empty
    return torch.cat(blk), torch.cat(off)


# ----------------------------------------------------------------------------------
# ops


def _plane(t: torch.Tensor, layout: str, kv: int, blk: torch.Tensor, off: torch.Tensor):
    """Index ``[n, H, ...]`` tokens of plane ``kv`` (0 = K, 1 = V) of a layer view."""
    if layout == "NHD":
        return t[blk, kv, off]
    return t[blk, kv, :, off]


def _assign(t: torch.Tensor, layout: str, kv: int, blk, off, src: torch.Tensor) -> None:
    if layout == "NHD":
        t[blk, kv, off] = src
    else:
        t[blk, kv, :, off] = src


def write_kv(
    kv_layer: torch.Tensor,
    slot_mapping: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    layout: str = "NHD",
    kv_scale: Optional[torch.Tensor] = None,
    kv_zero: Optional[torch.Tensor] = None,
) -> None:
    """Store one layer's new K/V tokens into their slots.

    Args:
        kv_layer: per-layer view, NHD ``[NB, 2, bs, H, D]`` or HND ``[NB, 2, H, bs, D]``,
            in the model dtype or a quantized storage dtype.
        slot_mapping: ``[num_tokens]`` int64; negative slots are skipped.
        key, value: ``[num_tokens, H, D]`` in the model dtype (float32/float16/bfloat16;
            equal to ``kv_layer.dtype`` when it is not quantized).
        kv_scale: quantized only: float32 NHD ``[NB, 2, bs, H]`` / HND ``[NB, 2, H, bs]``.
        kv_zero: int8 only: float32, shaped like ``kv_scale``.

    Raises:
        InvalidArgumentError: a slot is ``>= NB * bs`` (checked before any write).
    """
    geo = check_write_kv(kv_layer, slot_mapping, key, value, layout, kv_scale, kv_zero)
    _check_slots(slot_mapping, geo.num_blocks * geo.block_size)
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    blk = torch.div(slots, geo.block_size, rounding_mode="floor")
    off = slots - blk * geo.block_size
    for kv, src in ((0, key[valid]), (1, value[valid])):
        if geo.quantized:
            group = geo.head_dim // kv_scale.shape[-1] if kv_layer.dtype == torch.uint8 else None
            q, s, z = quantize(src, kv_layer.dtype, group_size=group)
            _assign(kv_layer, layout, kv, blk, off, q)
            _assign(kv_scale, layout, kv, blk, off, s)
            if z is not None:
                _assign(kv_zero, layout, kv, blk, off, z)
        else:
            _assign(kv_layer, layout, kv, blk, off, src)


def _gather_tokens(kv_layer, layout, blk, off, out_dtype, kv_scale, kv_zero, out_key, out_value):
    result = []
    for kv, out in ((0, out_key), (1, out_value)):
        x = _plane(kv_layer, layout, kv, blk, off)
        if is_quantized(kv_layer.dtype):
            s = _plane(kv_scale, layout, kv, blk, off)
            z = _plane(kv_zero, layout, kv, blk, off) if kv_zero is not None else None
            x = dequantize(x, s, z, out_dtype)
        if out is not None:
            out.copy_(x)
            x = out
        result.append(x.contiguous())
    return result[0], result[1]


def gather_kv(
    kv_layer: torch.Tensor,
    indptr: torch.Tensor,
    indices: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    layout: str = "NHD",
    out_dtype: Optional[torch.dtype] = None,
    kv_scale: Optional[torch.Tensor] = None,
    kv_zero: Optional[torch.Tensor] = None,
    out_key: Optional[torch.Tensor] = None,
    out_value: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Read K/V of a batch of sequences into contiguous tensors, in token order.

    Args:
        kv_layer: per-layer view (see :func:`write_kv`).
        indptr: ``[B + 1]`` int32; sequence ``b`` owns ``indices[indptr[b]:indptr[b+1]]``.
        indices: ``[nnz]`` int32 block ids. Only the first ``ceil(seq_lens[b] / bs)``
            blocks of each sequence are read (and checked).
        seq_lens: ``[B]`` int32 tokens per sequence, ``<= blocks * bs``.
        out_dtype: required for a quantized arena; else ``None`` or the arena dtype.
        kv_scale, kv_zero: quantized only (see :func:`write_kv`).
        out_key, out_value: optional contiguous ``[sum(seq_lens), H, D]`` outputs.

    Returns:
        ``(key, value)``, each ``[sum(seq_lens), H, D]`` in ``out_dtype``: sequence 0's
        tokens first, then sequence 1's, and so on.
    """
    geo, out_dtype = check_gather(kv_layer, layout, out_dtype, kv_scale, kv_zero)
    check_csr(indptr, indices, seq_lens, kv_layer.device)
    blk, off = _csr_token_index(indptr, indices, seq_lens, geo.block_size, geo.num_blocks)
    check_out(out_key, out_value, blk.numel(), geo, out_dtype, kv_layer.device)
    blk, off = blk.to(kv_layer.device), off.to(kv_layer.device)
    return _gather_tokens(kv_layer, layout, blk, off, out_dtype, kv_scale, kv_zero, out_key, out_value)


def gather_kv_padded(
    kv_layer: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    layout: str = "NHD",
    out_dtype: Optional[torch.dtype] = None,
    kv_scale: Optional[torch.Tensor] = None,
    kv_zero: Optional[torch.Tensor] = None,
    out_key: Optional[torch.Tensor] = None,
    out_value: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`gather_kv` with a padded ``[B, max_blocks]`` int32 block table.

    Row ``b`` lists sequence ``b``'s blocks; entries past ``ceil(seq_lens[b] / bs)``
    are padding (conventionally -1) and are neither read nor checked.
    """
    geo, out_dtype = check_gather(kv_layer, layout, out_dtype, kv_scale, kv_zero)
    check_padded(block_table, seq_lens, kv_layer.device)
    blk, off = _padded_token_index(block_table, seq_lens, geo.block_size, geo.num_blocks)
    check_out(out_key, out_value, blk.numel(), geo, out_dtype, kv_layer.device)
    blk, off = blk.to(kv_layer.device), off.to(kv_layer.device)
    return _gather_tokens(kv_layer, layout, blk, off, out_dtype, kv_scale, kv_zero, out_key, out_value)


def _pair_lists(pairs: torch.Tensor) -> Tuple[List[int], List[int]]:
    rows = pairs.tolist()
    return [r[0] for r in rows], [r[1] for r in rows]


def _check_distinct_dst(dst: List[int]) -> None:
    seen = set()
    for i, d in enumerate(dst):
        if d in seen:
            raise InvalidBlockError(expected("pairs", "distinct dst block ids", f"{d} twice (row {i})"))
        seen.add(d)


def _check_dst_not_src(src: List[int], dst: List[int]) -> None:
    srcs = set(src)
    for i, d in enumerate(dst):
        if d in srcs:
            raise InvalidBlockError(expected("pairs", "dst ids that are not also src ids", f"{d} (row {i})"))


def validate_copy_blocks(arenas: Arenas, pairs: torch.Tensor) -> Tuple[List[torch.Tensor], List[int], List[int]]:
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


def copy_blocks(arenas: Arenas, pairs: torch.Tensor) -> None:
    """Copy whole blocks inside arenas, across all layers (copy-on-write, fork).

    Args:
        arenas: a tensor or list of all-layer tensors ``[num_layers, num_blocks, ...]``
            (the data arena and, when quantized, its scale and zero arenas).
        pairs: ``[P, 2]`` int64 or int32 (src, dst) block ids. dst ids are distinct and
            no dst is also a src in the same call, so the copies are order-free.
    """
    arenas, src, dst = validate_copy_blocks(arenas, pairs)
    if not src:
        return
    device = arenas[0].device
    s = torch.tensor(src, dtype=torch.int64, device=device)
    d = torch.tensor(dst, dtype=torch.int64, device=device)
    for a in arenas:
        a = _copyable(a)
        a.index_copy_(1, d, a.index_select(1, s))


def validate_swap_blocks(
    src_arenas: Arenas, dst_arenas: Arenas, pairs: torch.Tensor
) -> Tuple[List[torch.Tensor], List[torch.Tensor], List[int], List[int]]:
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


def swap_blocks(src_arenas: Arenas, dst_arenas: Arenas, pairs: torch.Tensor) -> None:
    """Copy blocks from one set of arenas to another (device <-> host offload).

    Args:
        src_arenas, dst_arenas: matching lists of all-layer tensors; ``src_arenas[i]`` and
            ``dst_arenas[i]`` agree in dtype and in every dim but ``num_blocks`` (dim 1).
            The two sides may live on different devices.
        pairs: ``[P, 2]`` int64 or int32 (src block in ``src_arenas``, dst block in
            ``dst_arenas``); dst ids are distinct.
    """
    srcs, dsts, src, dst = validate_swap_blocks(src_arenas, dst_arenas, pairs)
    if not src:
        return
    si = torch.tensor(src, dtype=torch.int64, device=srcs[0].device)
    di = torch.tensor(dst, dtype=torch.int64, device=dsts[0].device)
    for s, d in zip(srcs, dsts):
        s, d = _copyable(s), _copyable(d)
        d.index_copy_(1, di, s.index_select(1, si).to(d.device))


def _copyable(t: torch.Tensor) -> torch.Tensor:
    # index_copy_ has no fp8 kernel; a same-size integer view moves the same bytes.
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return t.view(torch.uint8)
    return t


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def convert_layout(arena: torch.Tensor, src_layout: str, dst_layout: str, *, scale: bool = False) -> torch.Tensor:
    """Return a contiguous copy of ``arena`` in ``dst_layout``.

    Data: whole ``[L, NB, 2, bs, H, D]`` (NHD) <-> ``[L, NB, 2, H, bs, D]`` (HND), or a
    per-layer view without the leading ``L`` (told apart by ``ndim``).
    With ``scale=True``, a scale/zero arena ``[L, NB, 2, bs, H]`` <-> ``[L, NB, 2, H, bs]``
    (or per layer without ``L``).
    """
    check_layout(src_layout, "src_layout")
    check_layout(dst_layout, "dst_layout")
    arena = _tensor("arena", arena)
    ndims = (4, 5) if scale else (5, 6)
    kv_dim = arena.dim() - (3 if scale else 4)
    if arena.dim() not in ndims or arena.shape[kv_dim] != 2:
        what = "scale arena [L, NB, 2, a, b] or layer [NB, 2, a, b]" if scale else (
            "arena [L, NB, 2, a, b, D] or layer [NB, 2, a, b, D]"
        )
        raise ShapeError(expected("arena", what, tuple(arena.shape)))
    if src_layout == dst_layout:
        return arena.clone(memory_format=torch.contiguous_format)
    dims = (-2, -1) if scale else (-3, -2)
    return arena.transpose(*dims).contiguous()
