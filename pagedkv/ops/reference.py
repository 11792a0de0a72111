"""Torch reference ops: the semantic definition of every KV data op.

The fast CPU path (:mod:`pagedkv.ops.cpu`) and the CUDA kernels
(:mod:`pagedkv.kernels.ops`) must produce exactly what these functions produce,
element for element. They are plain torch and run on any device, slowly.

Shapes (``NB`` blocks, ``bs`` tokens per block, ``H`` kv heads, ``D`` head dim):

- per-layer data view: NHD ``[NB, 2, bs, H, D]``, HND ``[NB, 2, H, bs, D]``
  (index 0 of dim 1 is K, 1 is V);
- per-layer scale/zero view (quantized storage only, float32): NHD
  ``[NB, 2, bs, H]``, HND ``[NB, 2, H, bs]``; int4/int3 add a trailing groups dim,
  and int3's are bfloat16 (which tells it from int4: both store uint8 codes, int3
  ``3 D / 8`` of them per row, int4 ``D / 2``);
- whole arenas add a leading ``num_layers`` dim.

``slot = block_id * bs + offset`` (int64); a negative slot is skipped.

Every function validates all its inputs before touching any tensor, so a call that
raises leaves every arena unchanged. Nothing is cast silently: a dtype mismatch is a
:class:`~pagedkv.errors.DTypeError`. The checks (``check_*``) live in
:mod:`pagedkv.format.op_checks`, shared by every backend (and re-exported here).

Duplicate non-negative slots in one :func:`write_kv` call are the caller's bug:
which of the tokens lands is unspecified (as in every GPU implementation).
"""
from __future__ import annotations

import torch

from pagedkv.errors import InvalidArgumentError, ShapeError, expected
from pagedkv.format import dtypes
from pagedkv.format import op_checks as _op_checks
from pagedkv.format.op_checks import (  # re-exported: the checks were first published here
    LAYOUTS,
    Arenas,
    LayerFormat,
    LayerGeometry,
    block_id_error,
    check_arenas,
    check_block_ids,
    check_csr,
    check_format,
    check_gather,
    check_key_channels,
    check_key_high_bits,
    check_layer,
    check_layout,
    check_out,
    check_padded,
    check_pairs,
    check_rotation,
    check_seal_key_blocks,
    check_slot_values,
    check_tensor,
    check_write_kv,
    contiguous_overlap,
    csr_block_where,
    indptr_error,
    key_extra_bits,
    padded_block_where,
    seq_len_error,
    slot_error,
    validate_copy_blocks,
    validate_swap_blocks,
)
from pagedkv.format.quant import (
    dequantize,
    dequantize_key_channels,
    is_quantized,
    quantize,
    quantize_key_block,
    quantize_key_channels,
    split_key_codes,
)
from pagedkv.format.rotation import rotate, unrotate

__all__ = [
    "write_kv",
    "seal_key_blocks",
    "gather_kv",
    "gather_kv_padded",
    "copy_blocks",
    "swap_blocks",
    "convert_layout",
    "unseal_key_blocks",
] + _op_checks.__all__     # the shared checks, re-exported

def _csr_token_index(indptr, indices, seq_lens, bs: int, nb: int):
    """Per-token (block_id, offset) tensors of CSR tables, after checking their values."""
    ptr = indptr.tolist()
    idx = indices.tolist()
    lens = seq_lens.tolist()
    nnz = len(idx)
    blocks: list[list[int]] = []
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
    blocks: list[list[int]] = []
    for b, n in enumerate(lens):
        if n < 0 or n > width * bs:
            raise seq_len_error(b, n, width, bs, padded=True)
        need = rows[b][: -(-n // bs)]
        check_block_ids("block_table", need, nb, where=lambda j, b=b: padded_block_where(b, j))
        blocks.append(need)
    return _token_index(blocks, lens, bs)


def _token_index(blocks: list[list[int]], lens: list[int], bs: int):
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
    kv_scale: torch.Tensor | None = None,
    kv_zero: torch.Tensor | None = None,
    rotation_signs: torch.Tensor | None = None,
    layer_format: LayerFormat | None = None,
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
        rotation_signs: quantized only: float32 ``[D]`` signs; the rows stored are
            :func:`pagedkv.format.rotation.rotate` of the float32 K/V (then quantized).
        layer_format: the layer's :class:`~pagedkv.format.layer_format.LayerFormat`; the
            tensors are verified against it (a rotated format's write needs its signs).
            None: the format the tensors imply (the compatibility path).

    Raises:
        InvalidArgumentError: a slot is ``>= NB * bs`` (checked before any write).
    """
    geo = check_write_kv(kv_layer, slot_mapping, key, value, layout, kv_scale, kv_zero, layer_format)
    check_rotation(rotation_signs, geo, kv_layer.device, write=True, explicit=layer_format is not None)
    check_slot_values(slot_mapping, geo.num_blocks * geo.block_size)
    if rotation_signs is not None:
        key, value = rotate(key.float(), rotation_signs), rotate(value.float(), rotation_signs)
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    blk = torch.div(slots, geo.block_size, rounding_mode="floor")
    off = slots - blk * geo.block_size
    for kv, src in ((0, key[valid]), (1, value[valid])):
        if geo.quantized:   # check_write_kv has required kv_scale, and kv_zero where the format has one
            fmt = geo.format    # check_layer returns the format (the caller's, or the one implied)
            q, s, z = quantize(src, fmt.kv_dtype, group_size=fmt.group_size)  # type: ignore[union-attr]
            _assign(kv_layer, layout, kv, blk, off, q)
            _assign(kv_scale, layout, kv, blk, off, s)  # type: ignore[arg-type]
            if z is not None:
                _assign(kv_zero, layout, kv, blk, off, z)  # type: ignore[arg-type]
        else:
            _assign(kv_layer, layout, kv, blk, off, src)


def seal_key_blocks(
    kv_layer: torch.Tensor,
    blocks: torch.Tensor,
    keys: torch.Tensor,
    key_scale: torch.Tensor,
    key_zero: torch.Tensor,
    *,
    layout: str = "NHD",
    layer_format: LayerFormat | None = None,
    kv_scale: torch.Tensor | None = None,
    kv_zero: torch.Tensor | None = None,
) -> None:
    """Requantize whole blocks' keys per channel (int4 or int2 block keys).

    Args:
        kv_layer: an int4 (or, with ``layer_format``, int2) uint8 per-layer view (see :func:`write_kv`).
        blocks: ``[M]`` int64 distinct block ids (duplicates: which lands is unspecified).
        keys: ``[M, bs, H, D]`` the blocks' exact keys, float32/float16/bfloat16.
        key_scale, key_zero: bfloat16 ``[NB, H, D]`` (see :func:`gather_kv`).
        layer_format: its ``kv_dtype`` (int4 or int2) and, for int4, ``key_bits`` give the
            codes' width (None: int4, 4 bits).
        kv_scale, kv_zero: the layer's per-token parameter views, given exactly when
            ``key_bits`` exceeds 4: the K rows' parameters of the sealed blocks then hold
            the codes' high bits (:func:`pagedkv.format.quant.split_key_codes`).

    Block ``blocks[i]`` gets :func:`pagedkv.format.quant.quantize_key_channels` of ``keys[i]``:
    its K plane's codes (and high bits), and its rows of ``key_scale``/``key_zero``.
    Nothing else changes.

    Raises:
        InvalidBlockError: a block id outside ``[0, NB)`` (checked before any write).
    """
    geo = check_seal_key_blocks(kv_layer, blocks, keys, key_scale, key_zero, layout, layer_format, kv_scale,
                                kv_zero)
    check_block_ids("blocks", blocks.tolist(), geo.num_blocks)
    if not blocks.numel():
        return
    fmt = geo.format     # the check returns the format
    extra = fmt.key_extra_bits    # type: ignore[union-attr]  # 0 unless int4 with wider keys
    high = None
    if geo.kv_dtype == "int4":
        codes, s, z = quantize_key_channels(keys, 4 + extra)
        packed, high = split_key_codes(codes, extra, 8 * geo.groups)
    else:       # int2: 2-bit codes fill their bytes; nothing goes to the row's parameters
        packed, s, z = quantize_key_block(keys, bits=fmt.key_code_bits)  # type: ignore[union-attr]
    kv_layer[blocks, 0] = packed.transpose(1, 2) if layout == "HND" else packed
    if extra and high is not None:
        high = high.transpose(1, 2) if layout == "HND" else high
        half = 4 * geo.groups       # the scale groups' bytes, then the zero points'
        kv_scale.view(torch.uint8)[blocks, 0] = high[..., :half]    # type: ignore[union-attr]  # checked
        kv_zero.view(torch.uint8)[blocks, 0] = high[..., half:]     # type: ignore[union-attr]
    key_scale[blocks] = s
    key_zero[blocks] = z


def _high_bytes(kv_scale, kv_zero, layout, blk, off) -> torch.Tensor:
    """The K rows' parameter bytes ``[n, H, 8 * groups]``: scale groups, then zero points."""
    return torch.cat((_plane(kv_scale.view(torch.uint8), layout, 0, blk, off),
                      _plane(kv_zero.view(torch.uint8), layout, 0, blk, off)), dim=-1)


def _gather_tokens(kv_layer, layout, blk, off, out_dtype, kv_scale, kv_zero, out_key, out_value, signs,
                   key_scale=None, key_zero=None, extra=0):
    result = []
    for kv, out in ((0, out_key), (1, out_value)):
        x = q = _plane(kv_layer, layout, kv, blk, off)
        if is_quantized(kv_layer.dtype):
            s = _plane(kv_scale, layout, kv, blk, off)
            z = _plane(kv_zero, layout, kv, blk, off) if kv_zero is not None else None
            if signs is None:
                x = dequantize(q, s, z, out_dtype)
            else:  # unrotated in float32, then narrowed once
                x = unrotate(dequantize(q, s, z, torch.float32), signs).to(out_dtype)
            if kv == 0 and key_scale is not None:   # sealed blocks' keys: per channel, never rotated
                ks, kz = key_scale[blk], key_zero[blk]          # [n, H, D]
                sealed = ks[..., 0] != 0                        # [n, H]
                high = _high_bytes(kv_scale, kv_zero, layout, blk, off) if extra else None
                x = torch.where(sealed.unsqueeze(-1), dequantize_key_channels(q, ks, kz, out_dtype, high, extra), x)
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
        rotation_signs: quantized only: float32 ``[D]`` signs of a rotated arena; each
            row is dequantized to float32, :func:`pagedkv.format.rotation.unrotate`-d, then
            converted to ``out_dtype``.
        key_scale, key_zero: int4 only: bfloat16 ``[NB, H, D]`` per-channel parameters
            of block keys (:func:`pagedkv.format.quant.quantize_key_channels`). A K row whose
            ``key_scale[block, head, 0]`` is nonzero is dequantized from them
            (:func:`pagedkv.format.quant.dequantize_key_channels`, with the row's parameter
            bytes as its high bits when ``layer_format.key_bits`` exceeds 4; no
            unrotation), every other K row from ``kv_scale``/``kv_zero`` as usual. V rows
            are unaffected.
        layer_format: see :func:`write_kv` (a ``key_quant="block"`` format needs
            ``key_scale``/``key_zero``, any other refuses them).

    Returns:
        ``(key, value)``, each ``[sum(seq_lens), H, D]`` in ``out_dtype``: sequence 0's
        tokens first, then sequence 1's, and so on.
    """
    geo, out_dtype = check_gather(kv_layer, layout, out_dtype, kv_scale, kv_zero, layer_format)
    check_rotation(rotation_signs, geo, kv_layer.device, explicit=layer_format is not None)
    check_key_channels(key_scale, key_zero, geo, kv_layer.device, explicit=layer_format is not None)
    check_csr(indptr, indices, seq_lens, kv_layer.device)
    blk, off = _csr_token_index(indptr, indices, seq_lens, geo.block_size, geo.num_blocks)
    check_out(out_key, out_value, blk.numel(), geo, out_dtype, kv_layer.device)
    blk, off = blk.to(kv_layer.device), off.to(kv_layer.device)
    return _gather_tokens(kv_layer, layout, blk, off, out_dtype, kv_scale, kv_zero, out_key, out_value,
                          rotation_signs, key_scale, key_zero, _op_checks.key_extra_bits(geo, key_scale))


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
    """:func:`gather_kv` with a padded ``[B, max_blocks]`` int32 block table.

    Row ``b`` lists sequence ``b``'s blocks; entries past ``ceil(seq_lens[b] / bs)``
    are padding (conventionally -1) and are neither read nor checked.
    """
    geo, out_dtype = check_gather(kv_layer, layout, out_dtype, kv_scale, kv_zero, layer_format)
    check_rotation(rotation_signs, geo, kv_layer.device, explicit=layer_format is not None)
    check_key_channels(key_scale, key_zero, geo, kv_layer.device, explicit=layer_format is not None)
    check_padded(block_table, seq_lens, kv_layer.device)
    blk, off = _padded_token_index(block_table, seq_lens, geo.block_size, geo.num_blocks)
    check_out(out_key, out_value, blk.numel(), geo, out_dtype, kv_layer.device)
    blk, off = blk.to(kv_layer.device), off.to(kv_layer.device)
    return _gather_tokens(kv_layer, layout, blk, off, out_dtype, kv_scale, kv_zero, out_key, out_value,
                          rotation_signs, key_scale, key_zero, _op_checks.key_extra_bits(geo, key_scale))


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


_FP8 = frozenset(d.torch_dtype for d in dtypes.QUANTIZED if d.float8)


def _copyable(t: torch.Tensor) -> torch.Tensor:
    # index_copy_ has no fp8 kernel; a same-size integer view moves the same bytes.
    if t.dtype in _FP8:
        return t.view(torch.uint8)
    return t


def convert_layout(arena: torch.Tensor, src_layout: str, dst_layout: str, *, scale: bool = False) -> torch.Tensor:
    """Return a contiguous copy of ``arena`` in ``dst_layout``.

    Data: whole ``[L, NB, 2, bs, H, D]`` (NHD) <-> ``[L, NB, 2, H, bs, D]`` (HND), or a
    per-layer view without the leading ``L`` (told apart by ``ndim``).
    With ``scale=True``, a scale/zero arena ``[L, NB, 2, bs, H]`` <-> ``[L, NB, 2, H, bs]``
    (or per layer without ``L``).
    """
    check_layout(src_layout, "src_layout")
    check_layout(dst_layout, "dst_layout")
    arena = check_tensor("arena", arena)
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


def unseal_key_blocks(
    kv_layer: torch.Tensor,
    blocks: torch.Tensor,
    live: torch.Tensor,
    kv_scale: torch.Tensor,
    kv_zero: torch.Tensor,
    key_scale: torch.Tensor,
    key_zero: torch.Tensor,
    *,
    exact: torch.Tensor | None = None,
    exact_valid: torch.Tensor | None = None,
    layout: str = "NHD",
    rotation_signs: torch.Tensor | None = None,
    layer_format: LayerFormat | None = None,
) -> None:
    """Undo :func:`seal_key_blocks` (int4 block keys): block ``blocks[i]``'s first
    ``live[i]`` K rows go back to per-token codes, and its seal is cleared.

    Each live row is the block's per-channel key (:func:`pagedkv.format.quant.dequantize_key_channels`),
    or ``exact[i, row]`` where ``exact_valid[i, row]`` (the model-precision copy, when the
    caller holds one: the row then gets exactly what a per-token write stored), rotated
    by ``rotation_signs`` when given, then quantized per token in ``layer_format``'s groups
    (:func:`write_kv`'s arithmetic). Rows from ``live[i]`` on are left as they are (a
    write is about to replace them); ``live[i] == 0`` only clears the seal.

    Args:
        kv_layer, kv_scale, kv_zero: an int4 layer and its per-token parameter views.
        blocks: ``[M]`` int64 distinct block ids.
        live: ``[M]`` int64 rows to requantize per block, in ``[0, block_size]``.
        key_scale, key_zero: bfloat16 ``[NB, H, D]`` (see :func:`gather_kv`).
        exact, exact_valid: None, or ``[M, bs, H, D]`` model-dtype keys and a
            ``[M, bs]`` bool mask of the rows they hold.
        layer_format: an int4 ``key_quant="block"`` format (None: int4 in the groups the
            scale view implies).

    This op runs the torch definition on every device: it serves a write into a block
    that is already sealed (a rollback, or a freed block reused), never a step's hot path.
    """
    fmt = check_format(layer_format)
    if fmt is not None and fmt.key_quant != "block":
        raise InvalidArgumentError(expected("layer_format", "an int4 or int2 format with key_quant='block'",
                                            fmt.describe()))
    geo = check_layer(kv_layer, layout, kv_scale, kv_zero, layer_format=fmt)
    if geo.kv_dtype not in ("int4", "int2"):
        raise InvalidArgumentError(expected("kv_layer", "an int4 or int2 layer (block keys)",
                                            geo.kv_dtype or kv_layer.dtype))
    device = kv_layer.device
    check_rotation(rotation_signs, geo, device)
    if not check_key_channels(key_scale, key_zero, geo, device):
        raise InvalidArgumentError(expected("key_scale", "a bfloat16 [num_blocks, H, head_dim] tensor", None))
    for name, t in (("blocks", blocks), ("live", live)):
        t = check_tensor(name, t)
        if t.dtype != torch.int64 or t.dim() != 1:
            raise ShapeError(expected(name, "a 1-D int64 tensor", f"{t.dtype} {tuple(t.shape)}"))
    if live.shape != blocks.shape:
        raise ShapeError(expected("live", f"shape {tuple(blocks.shape)} (as blocks)", tuple(live.shape)))
    ids, counts = blocks.tolist(), live.tolist()
    check_block_ids("blocks", ids, geo.num_blocks)
    for i, n in enumerate(counts):
        if not 0 <= n <= geo.block_size:
            raise InvalidArgumentError(expected("live", f"row counts in [0, {geo.block_size}] (block_size)",
                                                f"{n} at row {i}"))
    shape = (len(ids), geo.block_size, geo.num_heads, geo.head_dim)
    if (exact is None) != (exact_valid is None):
        raise InvalidArgumentError(expected("exact_valid" if exact_valid is None else "exact",
                                            "a tensor when the other is given", None))
    if exact is not None:
        exact, exact_valid = check_tensor("exact", exact), check_tensor("exact_valid", exact_valid)
        if tuple(exact.shape) != shape:
            raise ShapeError(expected("exact", f"shape {shape} [len(blocks), block_size, H, head_dim]",
                                      tuple(exact.shape)))
        if exact_valid.dtype != torch.bool or tuple(exact_valid.shape) != shape[:2]:
            raise ShapeError(expected("exact_valid", f"bool {shape[:2]}", f"{exact_valid.dtype} "
                                      f"{tuple(exact_valid.shape)}"))
    group = geo.format.group_size   # type: ignore[union-attr]  # check_layer returns the format
    for i, (block, n) in enumerate(zip(ids, counts)):
        if n:
            blk = torch.full((n,), block, dtype=torch.int64, device=device)
            off = torch.arange(n, device=device)
            extra = geo.format.key_extra_bits  # type: ignore[union-attr]
            high = _high_bytes(kv_scale, kv_zero, layout, blk, off) if extra else None
            keys = dequantize_key_channels(_plane(kv_layer, layout, 0, blk, off), key_scale[block],
                                           key_zero[block], torch.float32, high, extra)
            if exact is not None:
                ok = exact_valid[i, :n].to(device)     # type: ignore[index]
                keys[ok] = exact[i, :n].to(device=device, dtype=torch.float32)[ok]
            if rotation_signs is not None:
                keys = rotate(keys, rotation_signs)
            q, s, z = quantize(keys, geo.kv_dtype, group_size=group)
            _assign(kv_layer, layout, 0, blk, off, q)
            _assign(kv_scale, layout, 0, blk, off, s)
            _assign(kv_zero, layout, 0, blk, off, z)  # type: ignore[arg-type]  # int4 has a zero point
    if ids:
        idx = torch.tensor(ids, dtype=torch.int64, device=key_scale.device)
        key_scale[idx] = 0
        key_zero[idx] = 0
