"""CUDA launchers of the KV data ops, with the signatures of
:mod:`pagedkv.ops.reference` plus a keyword-only ``stream``.

Each launcher validates first (device, dtype, shape, strides, alignment: typed
errors, never a silent cast; see :mod:`pagedkv.kernels.plans`), then launches on
the caller's stream: ``stream=None`` means torch's current stream on the tensors'
device; else a ``torch.cuda.Stream``, a raw ``cudaStream_t`` handle (int) or any
object with ``__cuda_stream__`` (e.g. a ``cuda.core`` Stream). Helper tensors
(outputs, uploaded pairs, prefix sums) are made on that stream too, so the caching
allocator orders their reuse after the kernels. Inputs may be any DLPack tensor;
they are viewed as torch tensors without a copy, on the launch stream (so a
producer's pending work is ordered before the kernels).

Values of index tensors that live on the GPU are not checked (that would sync);
the kernels skip or zero-fill out-of-range ids instead of touching other memory.
"""
from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator

import numpy as np
import torch

from pagedkv.errors import DeviceError, DTypeError, InvalidArgumentError, expected
from pagedkv.format import op_checks as checks
from pagedkv.kernels import attention_plans, build, driver, latent_plans, plans
from pagedkv.kernels.plans import as_tensor

__all__ = ["write_kv", "seal_key_blocks", "gather_kv", "gather_kv_padded", "copy_blocks", "swap_blocks", "convert_layout",
           "paged_attention", "write_latent", "gather_latent", "mla_attention"]


_DL_CUDA, _DL_CUDA_MANAGED = 2, 13  # DLPack device types that are GPU memory


def _device_of(name: str, t: object) -> torch.device:
    """The device of a torch tensor or of any DLPack tensor, without converting it
    (the conversion must happen on the launch stream, see _on_stream)."""
    if isinstance(t, torch.Tensor):
        return t.device
    if hasattr(t, "__dlpack_device__"):
        kind, index = t.__dlpack_device__()
        return torch.device("cuda", int(index)) if int(kind) in (_DL_CUDA, _DL_CUDA_MANAGED) else torch.device("cpu")
    raise DTypeError(expected(name, "a torch.Tensor or a DLPack tensor", type(t).__name__))


def _cuda_device(name: str, t: object) -> torch.device:
    device = _device_of(name, t)
    if device.type != "cuda":
        raise DeviceError(expected(name, "a CUDA tensor", device))
    return device


def _torch_stream(stream: object, device: torch.device) -> torch.cuda.Stream:
    if stream is None:
        return torch.cuda.current_stream(device)
    if isinstance(stream, torch.cuda.Stream):
        if stream.device != device:
            raise DeviceError(expected("stream", f"a stream of {device}", stream.device))
        return stream
    if isinstance(stream, int) and not isinstance(stream, bool):
        return torch.cuda.ExternalStream(stream, device=device)
    if hasattr(stream, "__cuda_stream__"):
        _, handle = stream.__cuda_stream__()
        return torch.cuda.ExternalStream(int(handle), device=device)
    raise InvalidArgumentError(
        expected("stream", "None, a torch.cuda.Stream, an int handle or an object with __cuda_stream__",
                 type(stream).__name__)
    )


@contextlib.contextmanager
def _on_stream(device: torch.device, stream: object) -> Iterator[torch.cuda.Stream]:
    ts = _torch_stream(stream, device)
    with torch.cuda.device(device), torch.cuda.stream(ts):
        yield ts


def _run(launches: list[plans.Launch], ts: torch.cuda.Stream, device: torch.device) -> None:
    index = device.index if device.index is not None else torch.cuda.current_device()
    for ln in launches:
        plans.check_dims(ln.grid, ln.block)
        module = build.build_and_load(ln.source, index, defines=ln.defines)
        driver.make_current(index)
        argv, values = ln.pack_args()
        driver.launch(module.function(ln.kernel), ln.grid, ln.block, ts.cuda_stream, ctypes.addressof(argv))
        del values  # cuLaunchKernel has copied the parameters


def write_kv(
    kv_layer,
    slot_mapping,
    key,
    value,
    *,
    layout: str = "NHD",
    kv_scale=None,
    kv_zero=None,
    rotation_signs=None,
    layer_format=None,
    stream=None,
) -> None:
    """Store one layer's new K/V tokens into their slots (reshape-and-cache).

    Args:
        kv_layer: contiguous per-layer view, NHD ``[NB, 2, bs, H, D]`` or HND
            ``[NB, 2, H, bs, D]``, model dtype or fp8/int8 storage.
        slot_mapping: ``[num_tokens]`` int64 on the same device; negative = skip.
        key, value: ``[num_tokens, H, D]``, any token/head strides, dense head_dim.
        kv_scale, kv_zero: quantized storage only, contiguous float32 views.
        rotation_signs: quantized storage only: float32 ``[D]`` signs; each row is
            rotated (:mod:`pagedkv.format.rotation`) in the kernel before it is quantized.
        layer_format: the layer's :class:`~pagedkv.format.layer_format.LayerFormat`
            (None: the one the tensors imply); see :func:`pagedkv.ops.reference.write_kv`.
        stream: see the module docstring.
    """
    device = _cuda_device("kv_layer", kv_layer)
    with _on_stream(device, stream) as ts:
        kv_layer, slot_mapping, key, value, kv_scale, kv_zero, rotation_signs = map(
            as_tensor, (kv_layer, slot_mapping, key, value, kv_scale, kv_zero, rotation_signs)
        )
        launches = plans.plan_write_kv(
            kv_layer, slot_mapping, key, value, layout=layout, kv_scale=kv_scale, kv_zero=kv_zero,
            rotation_signs=rotation_signs, layer_format=layer_format,
        )
        _run(launches, ts, device)


def _gather(kv_layer, seq_lens, stream, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    device = _cuda_device("kv_layer", kv_layer)
    with _on_stream(device, stream) as ts:
        kw = {k: v if k in ("layout", "out_dtype", "layer_format") else as_tensor(v) for k, v in kw.items()}
        launches, out_key, out_value = plans.plan_gather(as_tensor(kv_layer), as_tensor(seq_lens), **kw)
        _run(launches, ts, device)
    return out_key, out_value


def gather_kv(
    kv_layer,
    indptr,
    indices,
    seq_lens,
    *,
    layout: str = "NHD",
    out_dtype: torch.dtype | None = None,
    kv_scale=None,
    kv_zero=None,
    out_key=None,
    out_value=None,
    rotation_signs=None,
    key_scale=None,
    key_zero=None,
    layer_format=None,
    stream=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of a batch of sequences as contiguous ``[sum(seq_lens), H, D]`` tensors in
    token order, from CSR block tables (int32 ``indptr [B + 1]``, ``indices [nnz]``,
    ``seq_lens [B]``, all on the arena's device). Dequantizes fp8/int8 storage into
    ``out_dtype``. Without ``out_key``/``out_value`` the output size is read from
    ``seq_lens`` (a device sync); pass them to stay sync-free. ``rotation_signs``
    (float32 ``[D]``) unrotates each dequantized row in the kernel. ``key_scale``/
    ``key_zero`` (int4 only, contiguous bfloat16 ``[NB, H, D]``): int4 block keys, read
    per channel where ``key_scale[block, head, 0]`` is nonzero and never unrotated
    (:func:`pagedkv.ops.reference.gather_kv`).
    """
    return _gather(kv_layer, seq_lens, stream, indptr=indptr, indices=indices, layout=layout, out_dtype=out_dtype,
                   kv_scale=kv_scale, kv_zero=kv_zero, out_key=out_key, out_value=out_value,
                   rotation_signs=rotation_signs, key_scale=key_scale, key_zero=key_zero,
                   layer_format=layer_format)


def gather_kv_padded(
    kv_layer,
    block_table,
    seq_lens,
    *,
    layout: str = "NHD",
    out_dtype: torch.dtype | None = None,
    kv_scale=None,
    kv_zero=None,
    out_key=None,
    out_value=None,
    rotation_signs=None,
    key_scale=None,
    key_zero=None,
    layer_format=None,
    stream=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gather_kv` with a padded ``[B, max_blocks]`` int32 block table."""
    return _gather(kv_layer, seq_lens, stream, block_table=block_table, layout=layout, out_dtype=out_dtype,
                   kv_scale=kv_scale, kv_zero=kv_zero, out_key=out_key, out_value=out_value,
                   rotation_signs=rotation_signs, key_scale=key_scale, key_zero=key_zero,
                   layer_format=layer_format)


def _listed(arenas) -> list:
    return list(arenas) if isinstance(arenas, (list, tuple)) else [arenas]


def copy_blocks(arenas, pairs, *, stream=None) -> None:
    """Copy whole blocks of every layer inside each arena (data, scale, zero): one
    launch per arena. ``pairs [P, 2]`` (src, dst) int32/int64 on the CPU (checked
    like the reference, then uploaded) or on the arenas' device (not read)."""
    arenas = _listed(arenas)
    if not arenas:
        checks.check_arenas("arenas", arenas)  # raises the reference's error
    device = _cuda_device("arenas[0]", arenas[0])
    with _on_stream(device, stream) as ts:
        launches = plans.plan_copy_blocks([as_tensor(a) for a in arenas], as_tensor(pairs))
        _run(launches, ts, device)


def swap_blocks(src_arenas, dst_arenas, pairs, *, stream=None) -> None:
    """Copy blocks between a device arena set and a pinned host arena set (either
    direction) with one kernel per arena that reads/writes the pinned memory in
    place: no per-block memcpy calls, and ordered on ``stream`` (synchronize it
    before reading a host destination)."""
    srcs, dsts = _listed(src_arenas), _listed(dst_arenas)
    for label, group in (("src_arenas", srcs), ("dst_arenas", dsts)):
        if not group:
            checks.check_arenas(label, group)  # raises the reference's error
    sides = [_device_of("src_arenas[0]", srcs[0]), _device_of("dst_arenas[0]", dsts[0])]
    device = next((d for d in sides if d.type == "cuda"), None)
    if device is None:
        raise DeviceError(expected("src_arenas", "a CUDA tensor on one side of the swap", sides[0]))
    with _on_stream(device, stream) as ts:
        launches = plans.plan_swap_blocks([as_tensor(a) for a in srcs], [as_tensor(a) for a in dsts],
                                          as_tensor(pairs), launch_device=device)
        _run(launches, ts, device)


def convert_layout(arena, src_layout: str, dst_layout: str, *, scale: bool = False, stream=None) -> torch.Tensor:
    """A new contiguous tensor holding ``arena`` in ``dst_layout`` (see the reference)."""
    device = _cuda_device("arena", arena)
    with _on_stream(device, stream) as ts:
        launches, out = plans.plan_convert_layout(as_tensor(arena), src_layout, dst_layout, scale=scale)
        _run(launches, ts, device)
    return out


def seal_key_blocks(kv_layer, blocks, keys, key_scale, key_zero, *, layout: str = "NHD", layer_format=None,
                    stream=None) -> None:
    """Requantize whole blocks' keys per channel (int4 block keys): block ``blocks[i]``
    gets :func:`pagedkv.format.quant.quantize_key_block` of ``keys[i]`` in its K plane's codes
    and its rows of ``key_scale``/``key_zero``; nothing else changes.

    Args:
        kv_layer: contiguous int4 (uint8) per-layer view, NHD ``[NB, 2, bs, H, D / 2]``
            or HND ``[NB, 2, H, bs, D / 2]``.
        blocks: ``[M]`` int64 distinct block ids on the same device; not read here (that
            would sync): an id outside ``[0, NB)`` is skipped by the kernel.
        keys: ``[M, bs, H, D]`` float32/float16/bfloat16, any M/token/head strides,
            dense head_dim.
        key_scale, key_zero: contiguous bfloat16 ``[NB, H, D]``.
        stream: see the module docstring.
    """
    device = _cuda_device("kv_layer", kv_layer)
    with _on_stream(device, stream) as ts:
        kv_layer, blocks, keys, key_scale, key_zero = map(as_tensor, (kv_layer, blocks, keys, key_scale, key_zero))
        launches = plans.plan_seal_key_blocks(kv_layer, blocks, keys, key_scale, key_zero, layout=layout,
                                              layer_format=layer_format)
        _run(launches, ts, device)


def paged_attention(q, kv_layer, indptr, indices, seq_lens, q_indptr, *, layout: str = "NHD", kv_scale=None,
                    kv_zero=None, key_scale=None, key_zero=None, rotation_signs=None, sm_scale=None, soft_cap=None,
                    window=None, sink_tokens: int = 0, num_splits=None, out=None, exact_rows=None,
                    layer_format=None, stream=None, kernel: str = "auto", workspace=None) -> torch.Tensor:
    """Attention of ``q`` ``[num_q_tokens, num_q_heads, head_dim]`` over the paged K/V of
    ``kv_layer``, read in place (:func:`pagedkv.ops.paged_attention`; the float64
    definition is :mod:`pagedkv.ops.attention_reference`).

    Every tensor lives on one CUDA device; the int32 tables (``indptr``, ``indices``,
    ``seq_lens``, ``q_indptr``) are not read on the host (no sync): a bad entry reads as
    zeros instead of touching other memory. ``num_splits=None`` picks the flash-decoding
    splits from the device's SM count and the tables' sizes. ``exact_rows`` must be
    None (the window overlay has no kernel). Returns ``out`` (allocated when None),
    ``q.dtype``, contiguous.

    One query per sequence takes the decode kernel (cuda/decode_attention.cu) where it
    covers the call (:mod:`pagedkv.kernels.decode_plans`), else the tiled kernel;
    ``kernel="decode"`` / ``"tiled"`` insists on one. ``workspace``: a float32 tensor of at
    least ``decode_plans.workspace_floats(num_splits, num_q_tokens, num_q_heads, head_dim)``
    elements for the decode kernel's split results (allocated per call when None). Nothing
    is read back or copied on the host, so the call can be captured in a CUDA graph.
    """
    device = _cuda_device("kv_layer", kv_layer)
    index = device.index if device.index is not None else torch.cuda.current_device()
    num_sms = torch.cuda.get_device_properties(index).multi_processor_count
    with _on_stream(device, stream) as ts:
        q, kv_layer, kv_scale, kv_zero, key_scale, key_zero, rotation_signs, out = map(
            as_tensor, (q, kv_layer, kv_scale, kv_zero, key_scale, key_zero, rotation_signs, out))
        # NumPy tables are uploaded by the plan (as the public op takes them)
        indptr, indices, seq_lens, q_indptr = (x if isinstance(x, np.ndarray) else as_tensor(x)
                                               for x in (indptr, indices, seq_lens, q_indptr))
        launches, out = attention_plans.plan_paged_attention(
            q, kv_layer, indptr, indices, seq_lens, q_indptr, layout=layout, kv_scale=kv_scale, kv_zero=kv_zero,
            key_scale=key_scale, key_zero=key_zero, rotation_signs=rotation_signs, sm_scale=sm_scale,
            soft_cap=soft_cap, window=window, sink_tokens=sink_tokens, num_splits=num_splits, out=out,
            exact_rows=exact_rows, layer_format=layer_format, num_sms=num_sms, kernel=kernel, workspace=workspace)
        _run(launches, ts, device)
    return out


def _latent_device(view) -> torch.device:
    return _cuda_device("view.data", getattr(view, "data", None))


def write_latent(view, slot_mapping, kv_c, k_pe, *, stream=None) -> None:
    """:func:`pagedkv.ops.latent.write_latent` on the GPU (a slot past the arena is skipped)."""
    device = _latent_device(view)
    with _on_stream(device, stream) as ts:
        _run(latent_plans.plan_write_latent(view, as_tensor(slot_mapping), as_tensor(kv_c), as_tensor(k_pe)), ts,
             device)


def gather_latent(view, indptr, indices, seq_lens, *, out_dtype=None, stream=None):
    """:func:`pagedkv.ops.latent.gather_latent` on the GPU (sizing the output reads
    ``seq_lens.sum()``: a sync)."""
    device = _latent_device(view)
    with _on_stream(device, stream) as ts:
        tables = (x if isinstance(x, np.ndarray) else as_tensor(x) for x in (indptr, indices, seq_lens))
        launches, kv_c, k_pe = latent_plans.plan_gather_latent(view, *tables, out_dtype=out_dtype)
        _run(launches, ts, device)
    return kv_c, k_pe


def mla_attention(view, q_nope, q_pe, indptr, indices, seq_lens, q_indptr, *, sm_scale, num_splits=None, out=None,
                  stream=None):
    """:func:`pagedkv.ops.latent.mla_attention` on the GPU; the tables are not read on the
    host (a bad entry reads as zeros)."""
    device = _latent_device(view)
    index = device.index if device.index is not None else torch.cuda.current_device()
    num_sms = torch.cuda.get_device_properties(index).multi_processor_count
    with _on_stream(device, stream) as ts:
        tables = (x if isinstance(x, np.ndarray) else as_tensor(x) for x in (indptr, indices, seq_lens, q_indptr))
        launches, out = latent_plans.plan_mla_attention(view, as_tensor(q_nope), as_tensor(q_pe), *tables,
                                                        sm_scale=sm_scale, num_splits=num_splits,
                                                        out=as_tensor(out), num_sms=num_sms)
        _run(launches, ts, device)
    return out
