"""Fast CPU ops: the reference's semantics, moved by memcpy on raw pointers.

Each function runs the reference's structural checks (same errors, same messages),
then hands pointers, byte strides and counts to the Cython loops in
:mod:`pagedkv.ops._cpu_copy` (byte moves) and :mod:`pagedkv.ops._cpu_quant`
(quantizing writes, dequantizing gathers of fp8, int8, int4 and int3 arenas, int4 block
keys included, and the sealing of block keys), which check index values before the first byte moves. Cases the loops
do not cover go to the reference after the same checks: non-contiguous arenas (or
scale/zero views), a zero-length ``head_dim`` of a quantized arena (the reference names
the error).
Results equal the reference element for element.
"""
from __future__ import annotations

import torch

from pagedkv.errors import DeviceError, KernelUnavailableError, expected
from pagedkv.format import dtypes
from pagedkv.format.layer_format import LayerFormat
from pagedkv.ops import reference as _ref

try:
    from pagedkv.ops import _cpu_copy as _c
    from pagedkv.ops import _cpu_quant as _q
except ImportError:  # not built (source checkout without build_ext)
    _c = _q = None  # type: ignore[assignment]

__all__ = [
    "AVAILABLE",
    "write_kv",
    "gather_kv",
    "gather_kv_padded",
    "copy_blocks",
    "swap_blocks",
    "convert_layout",
    "seal_key_blocks",
]

#: True when the compiled loops are importable.
AVAILABLE = _c is not None

# error codes of _cpu_copy.validate_csr / validate_padded
_OK, _BAD_INDPTR, _BAD_SEQ_LEN, _BAD_BLOCK = 0, 1, 2, 3


def _loops():
    if _c is None:
        raise KernelUnavailableError(
            "the fast CPU ops (pagedkv.ops._cpu_copy) are not built; build the package "
            "(pip install . or python setup.py build_ext --inplace) or use backend='reference'"
        )
    return _c


def _require_cpu(name: str, t: torch.Tensor) -> None:
    if t.device.type != "cpu":
        raise DeviceError(expected(name, "a CPU tensor for the 'cpu' backend", t.device))


def write_kv(
    kv_layer: torch.Tensor,
    slot_mapping: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    layout: str = "NHD",
    kv_scale: torch.Tensor | None = None,
    kv_zero: torch.Tensor | None = None,
    rotation_signs: torch.Tensor | None = None,
    layer_format: LayerFormat | None = None,
) -> None:
    """:func:`pagedkv.ops.reference.write_kv` on CPU tensors."""
    if (_c is not None and kv_scale is None and kv_zero is None and rotation_signs is None
            and (layer_format is None or _plain_format(layer_format, kv_layer))
            and _sparse_safe(_fast_write, kv_layer, slot_mapping, key, value, layout)):
        return
    c = _loops()
    geo = _ref.check_write_kv(kv_layer, slot_mapping, key, value, layout, kv_scale, kv_zero, layer_format)
    _ref.check_rotation(rotation_signs, geo, kv_layer.device, write=True, explicit=layer_format is not None)
    _require_cpu("kv_layer", kv_layer)
    if _quant_ok(geo, kv_layer, kv_scale, kv_zero):
        _write_quant(kv_layer, _c_contig(slot_mapping), key, value, kv_scale, kv_zero, geo, layout == "HND",
                     rotation_signs)
        return
    if geo.quantized or not kv_layer.is_contiguous() or key.stride(2) != 1 or value.stride(2) != 1:
        _ref.write_kv(kv_layer, slot_mapping, key, value, layout=layout, kv_scale=kv_scale, kv_zero=kv_zero,
                      rotation_signs=rotation_signs, layer_format=layer_format)
        return
    _write_rows(c, kv_layer, _c_contig(slot_mapping), key, value, geo.num_blocks, geo.block_size,
                geo.num_heads, geo.head_dim, layout == "HND")


# Tensor attribute reads cost ~0.1-0.2 us each, which is a large share of a decode
# step's write. The fast path reads each attribute once and accepts only inputs that
# plainly satisfy every check; anything else takes the full checks (same messages).
_T = torch.Tensor
_FAST_DTYPES = frozenset((torch.float32, torch.float16, torch.bfloat16))
_I64 = torch.int64
_I32 = torch.int32


def _sparse_safe(fast, *args):
    # The fast paths read strides, which sparse tensors lack (torch raises RuntimeError
    # before any byte moves); the checked path then refuses them by name.
    try:
        return fast(*args)
    except RuntimeError:
        return None


# where a layer view keeps (block_size, H), by layout
_LAYOUT_DIMS = {"NHD": (2, 3), "HND": (3, 2)}


def _fast_write(kv_layer, slot_mapping, key, value, layout) -> bool:
    if not (type(kv_layer) is _T and type(key) is _T and type(value) is _T and type(slot_mapping) is _T):
        return False
    ls, ks, ss = kv_layer.shape, key.shape, slot_mapping.shape
    dt = kv_layer.dtype
    if not (
        len(ls) == 5 and ls[1] == 2 and len(ks) == 3 and value.shape == ks and len(ss) == 1 and ss[0] == ks[0]
        and dt in _FAST_DTYPES and key.dtype == dt and value.dtype == dt and slot_mapping.dtype == _I64
        and kv_layer.is_cpu and key.is_cpu and value.is_cpu and slot_mapping.is_cpu
        and kv_layer.is_contiguous() and slot_mapping.is_contiguous()
    ):
        return False
    dims = _LAYOUT_DIMS.get(layout)
    if dims is None:
        return False
    bs, h = ls[dims[0]], ls[dims[1]]
    kst, vst = key.stride(), value.stride()
    if ks[1] != h or ks[2] != ls[4] or kst[2] != 1 or vst[2] != 1:
        return False
    es = kv_layer.element_size()
    bad, bad_slot = _c.write_rows(
        kv_layer.data_ptr(), key.data_ptr(), value.data_ptr(), slot_mapping.data_ptr(), ks[0],
        kst[0] * es, kst[1] * es, vst[0] * es, vst[1] * es, ls[0], bs, h, ls[4] * es, layout == "HND",
    )
    if bad >= 0:   # the value the kernel saw: the caller's tensor may have changed since
        raise _ref.slot_error(bad_slot, bad, ls[0] * bs)
    return True


def _write_rows(c, kv_layer, slots, key, value, nb, bs, h, d, hnd) -> None:
    es = kv_layer.element_size()
    ks, vs = key.stride(), value.stride()
    bad, bad_slot = c.write_rows(
        kv_layer.data_ptr(), key.data_ptr(), value.data_ptr(), slots.data_ptr(), key.shape[0],
        ks[0] * es, ks[1] * es, vs[0] * es, vs[1] * es, nb, bs, h, d * es, hnd,
    )
    if bad >= 0:
        raise _ref.slot_error(bad_slot, bad, nb * bs)


# ----------------------------------------------------------------------------------
# quantized arenas (fp8, int8, int4, int3): the loops of _cpu_quant


def _quant_ok(geo, kv_layer, kv_scale, kv_zero) -> bool:
    """A quantized layer the loops take: a format they know, contiguous data, scale and zero views."""
    return (geo.quantized and geo.kv_dtype in _q.QUANT_CODES and geo.head_dim > 0 and kv_layer.is_contiguous()
            and kv_scale.is_contiguous() and (kv_zero is None or kv_zero.is_contiguous()))


def _plain_format(layer_format, kv_layer) -> bool:
    """Whether an unquantized fast path may serve ``layer_format``: the arena is in its
    dtype (anything else goes through the checks, which name the mismatch)."""
    return type(layer_format) is LayerFormat and layer_format.data_dtype == kv_layer.dtype


def _quant_code(geo) -> int:
    return _q.QUANT_CODES[geo.kv_dtype]


def _model_code(dtype) -> int:
    return _q.MODEL_CODES[dtypes.lookup(dtype).name]  # type: ignore[union-attr]  # a checked model dtype


def _signs_ptr(rotation_signs: torch.Tensor | None) -> tuple[int, torch.Tensor | None]:
    """``(address, tensor to keep alive)`` of contiguous rotation signs (0: none)."""
    if rotation_signs is None:
        return 0, None
    signs = _c_contig(rotation_signs)
    return signs.data_ptr(), signs


def _write_quant(kv_layer, slots, key, value, kv_scale, kv_zero, geo, hnd: bool, rotation_signs=None) -> None:
    # a strided head_dim is made dense: the row loops read it as one run
    key = key if key.stride(2) == 1 or geo.head_dim == 1 else key.contiguous()
    value = value if value.stride(2) == 1 or geo.head_dim == 1 else value.contiguous()
    es = key.element_size()
    ks, vs = key.stride(), value.stride()
    signs_ptr, _keep = _signs_ptr(rotation_signs)
    bad, bad_slot = _q.write_quant(
        kv_layer.data_ptr(), kv_scale.data_ptr(), 0 if kv_zero is None else kv_zero.data_ptr(), key.data_ptr(),
        value.data_ptr(), slots.data_ptr(), key.shape[0], ks[0] * es, ks[1] * es, vs[0] * es, vs[1] * es,
        _model_code(key.dtype), _quant_code(geo), geo.num_blocks, geo.block_size, geo.num_heads, geo.head_dim,
        geo.groups, hnd, signs_ptr,
    )
    if bad >= 0:
        raise _ref.slot_error(bad_slot, bad, geo.num_blocks * geo.block_size)


def _gather_quant(kv_layer, kv_scale, kv_zero, indptr, width, table, seq_lens, batch, total, geo, out_dtype,
                  out_key, out_value, hnd: bool, rotation_signs=None, key_scale=None, key_zero=None):
    ok, ov = _outputs(out_key, out_value, total, geo, out_dtype, kv_layer.device)
    signs_ptr, _keep = _signs_ptr(rotation_signs)
    # block keys: contiguous bfloat16 [num_blocks, H, head_dim] (check_key_channels passed)
    ks_ptr = 0 if key_scale is None else key_scale.data_ptr()
    kz_ptr = 0 if key_zero is None else key_zero.data_ptr()
    _q.gather_quant(
        kv_layer.data_ptr(), kv_scale.data_ptr(), 0 if kv_zero is None else kv_zero.data_ptr(),
        0 if indptr is None else indptr.data_ptr(), width, table.data_ptr(), seq_lens.data_ptr(), batch, total,
        ok.data_ptr(), ov.data_ptr(), _quant_code(geo), _model_code(out_dtype), geo.block_size,
        geo.num_heads, geo.head_dim, geo.groups, hnd, signs_ptr, ks_ptr, kz_ptr,
        _ref.key_extra_bits(geo, key_scale),
    )
    return ok, ov


def _raise_table_error(code: int, b: int, a: int, c: int, padded: bool, bs: int, nb: int, nnz: int = 0):
    if code == _BAD_INDPTR:
        raise _ref.indptr_error(b, a, c, nnz)
    if code == _BAD_SEQ_LEN:
        raise _ref.seq_len_error(b, a, c, bs, padded=padded)
    if padded:
        raise _ref.block_id_error("block_table", c, nb, _ref.padded_block_where(b, a))
    raise _ref.block_id_error("indices", c, nb, _ref.csr_block_where(b, a))


def _outputs(out_key, out_value, total, geo, out_dtype, device):
    if _ref.check_out(out_key, out_value, total, geo, out_dtype, device):
        return out_key, out_value
    shape = (total, geo.num_heads, geo.head_dim)
    return torch.empty(shape, dtype=out_dtype), torch.empty(shape, dtype=out_dtype)


def _c_contig(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _fast_layer(kv_layer, layout, out_dtype, kv_scale, kv_zero):
    """``(nb, bs, h, d, dtype)`` when the arena side plainly passes every check, else None."""
    if type(kv_layer) is not _T or kv_scale is not None or kv_zero is not None:
        return None
    ls = kv_layer.shape
    dt = kv_layer.dtype
    if not (len(ls) == 5 and ls[1] == 2 and dt in _FAST_DTYPES and (out_dtype is None or out_dtype == dt)
            and kv_layer.is_cpu and kv_layer.is_contiguous()):
        return None
    if layout == "NHD":
        return ls[0], ls[2], ls[3], ls[4], dt
    if layout == "HND":
        return ls[0], ls[3], ls[2], ls[4], dt
    return None


def _fast_index(t) -> bool:
    return type(t) is _T and t.dtype == _I32 and t.is_cpu and t.dim() == 1 and t.is_contiguous()


def _fast_outputs(out_key, out_value, total, h, d, dt):
    """Outputs to fill: new ones, or the given ones when they plainly pass; else None."""
    if out_key is None and out_value is None:
        return torch.empty((total, h, d), dtype=dt), torch.empty((total, h, d), dtype=dt)
    if type(out_key) is not _T or type(out_value) is not _T:
        return None
    shape = (total, h, d)
    for t in (out_key, out_value):
        if not (t.shape == shape and t.dtype == dt and t.is_cpu and t.is_contiguous()):
            return None
    if total and _ref.contiguous_overlap(out_key, out_value):
        return None                      # the checked path names the overlap
    return out_key, out_value


def _fast_gather_csr(kv_layer, indptr, indices, seq_lens, layout, out_dtype, kv_scale, kv_zero, out_key, out_value):
    geo = _fast_layer(kv_layer, layout, out_dtype, kv_scale, kv_zero)
    if geo is None or not (_fast_index(indptr) and _fast_index(indices) and _fast_index(seq_lens)):
        return None
    batch = seq_lens.shape[0]
    if indptr.shape[0] != batch + 1:
        return None
    nb, bs, h, d, dt = geo
    nnz = indices.shape[0]
    code, b, a, z = _c.validate_csr(indptr.data_ptr(), indices.data_ptr(), seq_lens.data_ptr(), batch, nnz, bs, nb)
    if code != _OK:
        _raise_table_error(code, b, a, z, False, bs, nb, nnz)
    outs = _fast_outputs(out_key, out_value, a, h, d, dt)
    if outs is None:
        return None
    es = kv_layer.element_size()
    _c.gather_csr(kv_layer.data_ptr(), indptr.data_ptr(), indices.data_ptr(), seq_lens.data_ptr(), batch, a,
                  outs[0].data_ptr(), outs[1].data_ptr(), bs, h, d * es, layout == "HND")
    return outs


def _fast_gather_padded(kv_layer, block_table, seq_lens, layout, out_dtype, kv_scale, kv_zero, out_key, out_value):
    geo = _fast_layer(kv_layer, layout, out_dtype, kv_scale, kv_zero)
    if geo is None or not _fast_index(seq_lens) or type(block_table) is not _T:
        return None
    ts = block_table.shape
    batch = seq_lens.shape[0]
    if not (len(ts) == 2 and ts[0] == batch and block_table.dtype == _I32 and block_table.is_cpu
            and block_table.is_contiguous()):
        return None
    nb, bs, h, d, dt = geo
    code, b, a, z = _c.validate_padded(block_table.data_ptr(), seq_lens.data_ptr(), batch, ts[1], bs, nb)
    if code != _OK:
        _raise_table_error(code, b, a, z, True, bs, nb)
    outs = _fast_outputs(out_key, out_value, a, h, d, dt)
    if outs is None:
        return None
    es = kv_layer.element_size()
    _c.gather_padded(kv_layer.data_ptr(), block_table.data_ptr(), seq_lens.data_ptr(), batch, ts[1], a,
                     outs[0].data_ptr(), outs[1].data_ptr(), bs, h, d * es, layout == "HND")
    return outs


def gather_kv(
    kv_layer: torch.Tensor,
    indptr: torch.Tensor,
    indices: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    layout: str = "NHD",
    out_dtype: torch.dtype | None = None,
    kv_scale: torch.Tensor | None = None,
    kv_zero: torch.Tensor | None = None,
    out_key: torch.Tensor | None = None,
    out_value: torch.Tensor | None = None,
    rotation_signs: torch.Tensor | None = None,
    key_scale: torch.Tensor | None = None,
    key_zero: torch.Tensor | None = None,
    layer_format: LayerFormat | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`pagedkv.ops.reference.gather_kv` on CPU tensors."""
    if (_c is not None and rotation_signs is None and key_scale is None and key_zero is None
            and (layer_format is None or _plain_format(layer_format, kv_layer))):
        outs = _sparse_safe(_fast_gather_csr, kv_layer, indptr, indices, seq_lens, layout, out_dtype, kv_scale, kv_zero,
                                out_key, out_value)
        if outs is not None:
            return outs
    c = _loops()
    geo, out_dtype = _ref.check_gather(kv_layer, layout, out_dtype, kv_scale, kv_zero, layer_format)
    _ref.check_rotation(rotation_signs, geo, kv_layer.device, explicit=layer_format is not None)
    _ref.check_key_channels(key_scale, key_zero, geo, kv_layer.device, explicit=layer_format is not None)
    batch = _ref.check_csr(indptr, indices, seq_lens, kv_layer.device)
    _require_cpu("kv_layer", kv_layer)
    if _quant_ok(geo, kv_layer, kv_scale, kv_zero):
        indptr, indices, seq_lens = indptr.clone(), indices.clone(), seq_lens.clone()  # read once
        nnz = indices.shape[0]
        code, b, a, z = c.validate_csr(indptr.data_ptr(), indices.data_ptr(), seq_lens.data_ptr(), batch, nnz,
                                       geo.block_size, geo.num_blocks)
        if code != _OK:
            _raise_table_error(code, b, a, z, False, geo.block_size, geo.num_blocks, nnz)
        return _gather_quant(kv_layer, kv_scale, kv_zero, indptr, 0, indices, seq_lens, batch, a, geo, out_dtype,
                             out_key, out_value, layout == "HND", rotation_signs, key_scale,
                             key_zero)
    if geo.quantized or not kv_layer.is_contiguous():
        return _ref.gather_kv(kv_layer, indptr, indices, seq_lens, layout=layout, out_dtype=out_dtype,
                              kv_scale=kv_scale, kv_zero=kv_zero, out_key=out_key, out_value=out_value,
                              rotation_signs=rotation_signs, key_scale=key_scale, key_zero=key_zero,
                              layer_format=layer_format)
    indptr, indices, seq_lens = _c_contig(indptr), _c_contig(indices), _c_contig(seq_lens)
    nnz = indices.shape[0]
    code, b, a, z = c.validate_csr(indptr.data_ptr(), indices.data_ptr(), seq_lens.data_ptr(), batch, nnz,
                                   geo.block_size, geo.num_blocks)
    if code != _OK:
        _raise_table_error(code, b, a, z, False, geo.block_size, geo.num_blocks, nnz)
    ok, ov = _outputs(out_key, out_value, a, geo, out_dtype, kv_layer.device)
    es = kv_layer.element_size()
    c.gather_csr(kv_layer.data_ptr(), indptr.data_ptr(), indices.data_ptr(), seq_lens.data_ptr(), batch, a,
                 ok.data_ptr(), ov.data_ptr(), geo.block_size, geo.num_heads, geo.head_dim * es, layout == "HND")
    return ok, ov


def gather_kv_padded(
    kv_layer: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    layout: str = "NHD",
    out_dtype: torch.dtype | None = None,
    kv_scale: torch.Tensor | None = None,
    kv_zero: torch.Tensor | None = None,
    out_key: torch.Tensor | None = None,
    out_value: torch.Tensor | None = None,
    rotation_signs: torch.Tensor | None = None,
    key_scale: torch.Tensor | None = None,
    key_zero: torch.Tensor | None = None,
    layer_format: LayerFormat | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`pagedkv.ops.reference.gather_kv_padded` on CPU tensors."""
    if (_c is not None and rotation_signs is None and key_scale is None and key_zero is None
            and (layer_format is None or _plain_format(layer_format, kv_layer))):
        outs = _sparse_safe(_fast_gather_padded, kv_layer, block_table, seq_lens, layout, out_dtype, kv_scale, kv_zero,
                                   out_key, out_value)
        if outs is not None:
            return outs
    c = _loops()
    geo, out_dtype = _ref.check_gather(kv_layer, layout, out_dtype, kv_scale, kv_zero, layer_format)
    _ref.check_rotation(rotation_signs, geo, kv_layer.device, explicit=layer_format is not None)
    _ref.check_key_channels(key_scale, key_zero, geo, kv_layer.device, explicit=layer_format is not None)
    batch = _ref.check_padded(block_table, seq_lens, kv_layer.device)
    _require_cpu("kv_layer", kv_layer)
    if _quant_ok(geo, kv_layer, kv_scale, kv_zero):
        block_table, seq_lens = block_table.clone(), seq_lens.clone()  # read once
        width = block_table.shape[1]
        code, b, a, z = c.validate_padded(block_table.data_ptr(), seq_lens.data_ptr(), batch, width,
                                          geo.block_size, geo.num_blocks)
        if code != _OK:
            _raise_table_error(code, b, a, z, True, geo.block_size, geo.num_blocks)
        return _gather_quant(kv_layer, kv_scale, kv_zero, None, width, block_table, seq_lens, batch, a, geo,
                             out_dtype, out_key, out_value, layout == "HND", rotation_signs, key_scale,
                             key_zero)
    if geo.quantized or not kv_layer.is_contiguous():
        return _ref.gather_kv_padded(kv_layer, block_table, seq_lens, layout=layout, out_dtype=out_dtype,
                                     kv_scale=kv_scale, kv_zero=kv_zero, out_key=out_key, out_value=out_value,
                                     rotation_signs=rotation_signs, key_scale=key_scale, key_zero=key_zero,
                                     layer_format=layer_format)
    block_table, seq_lens = _c_contig(block_table), _c_contig(seq_lens)
    width = block_table.shape[1]
    code, b, a, z = c.validate_padded(block_table.data_ptr(), seq_lens.data_ptr(), batch, width,
                                      geo.block_size, geo.num_blocks)
    if code != _OK:
        _raise_table_error(code, b, a, z, True, geo.block_size, geo.num_blocks)
    ok, ov = _outputs(out_key, out_value, a, geo, out_dtype, kv_layer.device)
    es = kv_layer.element_size()
    c.gather_padded(kv_layer.data_ptr(), block_table.data_ptr(), seq_lens.data_ptr(), batch, width, a,
                    ok.data_ptr(), ov.data_ptr(), geo.block_size, geo.num_heads, geo.head_dim * es,
                    layout == "HND")
    return ok, ov


def _copy_pairs(c, srcs, dsts, pairs: torch.Tensor, num_pairs: int) -> None:
    pairs = _c_contig(pairs)
    is32 = pairs.dtype == torch.int32
    for s, d in zip(srcs, dsts):
        es = s.element_size()
        c.copy_block_pairs(s.data_ptr(), d.data_ptr(), s.shape[0], s.stride(0) * es, d.stride(0) * es,
                           s.stride(1) * es, pairs.data_ptr(), num_pairs, is32)


def copy_blocks(arenas, pairs: torch.Tensor) -> None:
    """:func:`pagedkv.ops.reference.copy_blocks` on CPU arenas."""
    c = _loops()
    arenas, src, _ = _ref.validate_copy_blocks(arenas, pairs)
    _require_cpu("arenas[0]", arenas[0])
    if not src:
        return
    if not all(a.is_contiguous() for a in arenas):
        _ref.copy_blocks(arenas, pairs)
        return
    _copy_pairs(c, arenas, arenas, pairs, len(src))


def swap_blocks(src_arenas, dst_arenas, pairs: torch.Tensor) -> None:
    """:func:`pagedkv.ops.reference.swap_blocks` between CPU arenas."""
    c = _loops()
    srcs, dsts, src, _ = _ref.validate_swap_blocks(src_arenas, dst_arenas, pairs)
    _require_cpu("src_arenas[0]", srcs[0])
    _require_cpu("dst_arenas[0]", dsts[0])
    if not src:
        return
    if not all(a.is_contiguous() for a in srcs + dsts):
        _ref.swap_blocks(srcs, dsts, pairs)
        return
    _copy_pairs(c, srcs, dsts, pairs, len(src))


def convert_layout(arena: torch.Tensor, src_layout: str, dst_layout: str, *, scale: bool = False) -> torch.Tensor:
    """:func:`pagedkv.ops.reference.convert_layout` (torch's strided copy is already memcpy-bound)."""
    return _ref.convert_layout(arena, src_layout, dst_layout, scale=scale)


_U8, _BF16 = torch.uint8, torch.bfloat16
# the loops' code of each key dtype the fast path takes
_SEAL_IN = {} if _q is None else {
    torch.float32: _q.MODEL_CODES["float32"], torch.float16: _q.MODEL_CODES["float16"],
    torch.bfloat16: _q.MODEL_CODES["bfloat16"],
}


def _block_keys_format(layer_format) -> bool:
    """An int4 block-keys format: the one the seal loop serves (int2 takes the torch definition)."""
    return type(layer_format) is LayerFormat and layer_format.key_quant == "block" and layer_format.kv_dtype == "int4"


def _fast_seal(kv_layer, blocks, keys, key_scale, key_zero, layout) -> bool:
    """Seal inputs that plainly pass every check (each attribute read once; a decode step
    seals one block per sequence and layer); False hands them to the checked path."""
    if not (type(kv_layer) is _T and type(blocks) is _T and type(keys) is _T and type(key_scale) is _T
            and type(key_zero) is _T):
        return False
    ls, bsh = kv_layer.shape, blocks.shape
    if not (len(ls) == 5 and ls[1] == 2 and len(bsh) == 1 and kv_layer.dtype == _U8 and blocks.dtype == _I64):
        return False
    dims = _LAYOUT_DIMS.get(layout)
    if dims is None:
        return False
    bs, h = ls[dims[0]], ls[dims[1]]
    nb, d2, m = ls[0], ls[4], bsh[0]
    d = 2 * d2
    pshape = (nb, h, d)
    kdt = keys.dtype
    if not (bs and h and d2 and keys.shape == (m, bs, h, d) and kdt in _SEAL_IN and key_scale.dtype == _BF16
            and key_zero.dtype == _BF16 and key_scale.shape == pshape and key_zero.shape == pshape
            and kv_layer.is_cpu and blocks.is_cpu and keys.is_cpu and key_scale.is_cpu and key_zero.is_cpu):
        return False
    lst, kst, dense = kv_layer.stride(), keys.stride(), (h * d, d, 1)
    if not ((lst[4] == 1 or d2 == 1) and kst[3] == 1 and key_scale.stride() == dense
            and key_zero.stride() == dense and (blocks.stride()[0] == 1 or m < 2)):
        return False
    _seal(kv_layer, lst, blocks, m, keys, kst, key_scale, key_zero, _SEAL_IN[kdt], nb, bs, h, d,
          layout == "HND")
    return True


def _seal(kv_layer, lst, blocks, m, keys, kst, key_scale, key_zero, in_code, nb, bs, h, d, hnd,
          extra=0, kv_scale=None, kv_zero=None) -> None:
    es = keys.element_size()
    tok, head = (lst[3], lst[2]) if hnd else (lst[2], lst[3])
    params: tuple = ()
    if extra:   # the K plane's per-token parameter rows (float32, a dense groups dim), byte strides
        pst = kv_scale.stride()
        ptok, phead = (pst[3], pst[2]) if hnd else (pst[2], pst[3])
        params = (extra, kv_scale.data_ptr(), kv_zero.data_ptr(), pst[0] * 4, ptok * 4, phead * 4,
                  kv_scale.shape[4] * 4)
    bad, value = _q.seal_key_blocks(
        kv_layer.data_ptr(), lst[0], tok, head, key_scale.data_ptr(), key_zero.data_ptr(), blocks.data_ptr(), m,
        keys.data_ptr(), kst[0] * es, kst[1] * es, kst[2] * es, in_code, nb, bs, h, d, *params,
    )
    if bad >= 0:   # the value the loop saw: the caller's tensor may have changed since
        raise _ref.block_id_error("blocks", value, nb, f"row {bad}")


def seal_key_blocks(kv_layer, blocks, keys, key_scale, key_zero, *, layout="NHD",
                    layer_format: LayerFormat | None = None, kv_scale=None, kv_zero=None) -> None:
    """:func:`pagedkv.ops.reference.seal_key_blocks` on CPU tensors: the reference's checks,
    then one C loop over the blocks (``key_seal.h``); the block ids are read once, by the
    loop, which refuses a bad one before any write."""
    if (_q is not None and kv_scale is None and kv_zero is None
            and (layer_format is None or (_block_keys_format(layer_format) and layer_format.key_bits == 4))
            and _sparse_safe(_fast_seal, kv_layer, blocks, keys, key_scale, key_zero, layout)):
        return
    geo = _ref.check_seal_key_blocks(kv_layer, blocks, keys, key_scale, key_zero, layout, layer_format, kv_scale,
                                     kv_zero)
    _require_cpu("kv_layer", kv_layer)
    extra = geo.format.key_extra_bits   # type: ignore[union-attr]  # the check returns the format
    # strided code bytes or parameter groups, or int2 codes: the torch definition (the
    # check refused empty dims)
    if _q is None or (kv_layer.stride(4) != 1 and kv_layer.shape[4] > 1) or geo.kv_dtype != "int4" or (
            extra and not (kv_scale.stride(4) == 1 and kv_zero.stride() == kv_scale.stride())):
        _ref.seal_key_blocks(kv_layer, blocks, keys, key_scale, key_zero, layout=layout, layer_format=layer_format,
                             kv_scale=kv_scale, kv_zero=kv_zero)
        return
    blocks = _c_contig(blocks)
    keys = keys if keys.stride(3) == 1 else keys.contiguous()   # each (token, head) row read as one run
    _seal(kv_layer, kv_layer.stride(), blocks, blocks.shape[0], keys, keys.stride(), key_scale, key_zero,
          _model_code(keys.dtype), geo.num_blocks, geo.block_size, geo.num_heads, geo.head_dim, layout == "HND",
          extra, kv_scale, kv_zero)
