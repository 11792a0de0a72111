"""KV data ops, dispatched to a backend.

Every function has the signature of its :mod:`pagedkv.ops.reference` twin plus a
keyword ``backend`` (see :mod:`pagedkv.ops.backends` for the protocol and the
dispatcher):

- ``"auto"`` (default): the CUDA kernels (:mod:`pagedkv.kernels.ops`) when the
  arena is on a CUDA device (for :func:`swap_blocks`, when either side is); the fast
  CPU ops (:mod:`pagedkv.ops.cpu`) for CPU tensors; the torch reference otherwise
  (or, with a warning, when the CPU ops are not built);
- ``"cuda"``, ``"cpu"``, ``"reference"``: force one.

A CUDA path that cannot run raises :class:`~pagedkv.errors.KernelUnavailableError`;
there is no silent fallback from a GPU tensor to the slow reference.
"""
from __future__ import annotations

import torch

from pagedkv.format.layer_format import LayerFormat
from pagedkv.ops import backends
from pagedkv.ops.backends import BACKENDS, resolve_backend
from pagedkv.ops.latent import LatentView, gather_latent, mla_attention, write_latent
from pagedkv.ops.paged_attention import ExactRows, paged_attention
from pagedkv.ops.views import KVLayerView, unpack

__all__ = [
    "BACKENDS",
    "write_kv",
    "seal_key_blocks",
    "unseal_key_blocks",
    "gather_kv",
    "gather_kv_padded",
    "copy_blocks",
    "swap_blocks",
    "convert_layout",
    "resolve_backend",
    "paged_attention",
    "ExactRows",
    "LatentView",
    "KVLayerView",
    "write_latent",
    "gather_latent",
    "mla_attention",
]

# The fast CPU module when its loops are built: the per-call fast path skips the
# dispatcher for the common case (CPU tensor, backend="auto").
_CPU: backends.DataOpsBackend | None = backends.load("cpu") if backends.cpu_ops_built() else None
_Tensor = torch.Tensor
_impl = backends.implementation

_NOT_A_TENSOR = torch.device("meta")


def _device(t: object) -> torch.device:
    # a non-tensor goes to the reference, whose checks name the problem
    return t.device if isinstance(t, torch.Tensor) else _NOT_A_TENSOR


def _first_device(arenas: object) -> torch.device:
    if isinstance(arenas, (list, tuple)) and arenas:
        return _device(arenas[0])
    return _device(arenas)


def _cpu_fast(backend: str, t: object) -> backends.DataOpsBackend | None:
    """The fast CPU module when it serves this call (built, CPU tensor, backend="auto"), else None."""
    return _CPU if backend == "auto" and type(t) is _Tensor and t.is_cpu else None


def write_kv(
    kv_layer: torch.Tensor | KVLayerView,
    slot_mapping: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    layout: str = "NHD",
    kv_scale: torch.Tensor | None = None,
    kv_zero: torch.Tensor | None = None,
    rotation_signs: torch.Tensor | None = None,
    layer_format: LayerFormat | None = None,
    backend: str = "auto",
) -> None:
    """Store new K/V tokens at their slots; see :func:`pagedkv.ops.reference.write_kv`.
    ``kv_layer`` may be a :class:`~pagedkv.ops.views.KVLayerView` (then no layer keywords)."""
    if type(kv_layer) is KVLayerView:
        kv_layer, kw = unpack("write_kv", kv_layer, dict(layout=layout, kv_scale=kv_scale, kv_zero=kv_zero,
                                                         rotation_signs=rotation_signs, layer_format=layer_format),
                              write=True)
        write_kv(kv_layer, slot_mapping, key, value, backend=backend, **kw)
        return
    cpu = _cpu_fast(backend, kv_layer)
    if cpu is not None:
        cpu.write_kv(kv_layer, slot_mapping, key, value, layout=layout, kv_scale=kv_scale, kv_zero=kv_zero,
                     rotation_signs=rotation_signs, layer_format=layer_format)
        return
    fn = _impl("write_kv", backend, _device(kv_layer))
    fn(kv_layer, slot_mapping, key, value, layout=layout, kv_scale=kv_scale, kv_zero=kv_zero,
       rotation_signs=rotation_signs, layer_format=layer_format)


def seal_key_blocks(kv_layer, blocks, keys, key_scale, key_zero, *, layout: str = "NHD",
                    layer_format: LayerFormat | None = None, backend: str = "auto") -> None:
    """Requantize whole blocks' keys per channel; see :func:`pagedkv.ops.reference.seal_key_blocks`."""
    fn = _impl("seal_key_blocks", backend, _device(kv_layer))
    fn(kv_layer, blocks, keys, key_scale, key_zero, layout=layout, layer_format=layer_format)


def unseal_key_blocks(kv_layer, blocks, live, kv_scale, kv_zero, key_scale, key_zero, *, exact=None,
                      exact_valid=None, layout: str = "NHD", rotation_signs=None,
                      layer_format: LayerFormat | None = None) -> None:
    """Put sealed blocks' live keys back per token; see :func:`pagedkv.ops.reference.unseal_key_blocks`
    (the torch definition on every device: a rare path, no backend of its own)."""
    from pagedkv.ops import reference

    reference.unseal_key_blocks(kv_layer, blocks, live, kv_scale, kv_zero, key_scale, key_zero, exact=exact,
                                exact_valid=exact_valid, layout=layout, rotation_signs=rotation_signs,
                                layer_format=layer_format)


def gather_kv(
    kv_layer: torch.Tensor | KVLayerView,
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
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read K/V of a batch (CSR block tables); see :func:`pagedkv.ops.reference.gather_kv`.
    ``kv_layer`` may be a :class:`~pagedkv.ops.views.KVLayerView` (then no layer keywords;
    the view's exact rows are not overlaid: the store's gather does that)."""
    if type(kv_layer) is KVLayerView:
        kv_layer, kw = unpack("gather_kv", kv_layer, dict(
            layout=layout, kv_scale=kv_scale, kv_zero=kv_zero, rotation_signs=rotation_signs, key_scale=key_scale,
            key_zero=key_zero, layer_format=layer_format))
        return gather_kv(kv_layer, indptr, indices, seq_lens, out_dtype=out_dtype, out_key=out_key,
                         out_value=out_value, backend=backend, **kw)
    cpu = _cpu_fast(backend, kv_layer)
    fn = cpu.gather_kv if cpu is not None else _impl("gather_kv", backend, _device(kv_layer))
    return fn(kv_layer, indptr, indices, seq_lens, layout=layout, out_dtype=out_dtype, kv_scale=kv_scale,
              kv_zero=kv_zero, out_key=out_key, out_value=out_value, rotation_signs=rotation_signs,
              key_scale=key_scale, key_zero=key_zero, layer_format=layer_format)


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
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read K/V of a batch (padded block table); see :func:`pagedkv.ops.reference.gather_kv_padded`."""
    cpu = _cpu_fast(backend, kv_layer)
    if cpu is not None:
        fn = cpu.gather_kv_padded
    else:
        fn = _impl("gather_kv_padded", backend, _device(kv_layer))
    return fn(kv_layer, block_table, seq_lens, layout=layout, out_dtype=out_dtype, kv_scale=kv_scale,
              kv_zero=kv_zero, out_key=out_key, out_value=out_value, rotation_signs=rotation_signs,
              key_scale=key_scale, key_zero=key_zero, layer_format=layer_format)


def _as_list(arenas: object) -> object:
    return [arenas] if isinstance(arenas, torch.Tensor) else arenas


def copy_blocks(arenas, pairs: torch.Tensor, *, backend: str = "auto") -> None:
    """Copy whole blocks across all layers; see :func:`pagedkv.ops.reference.copy_blocks`."""
    arenas = _as_list(arenas)
    fn = _impl("copy_blocks", backend, _first_device(arenas))
    fn(arenas, pairs)


def swap_blocks(src_arenas, dst_arenas, pairs: torch.Tensor, *, backend: str = "auto") -> None:
    """Copy blocks between two sets of arenas; see :func:`pagedkv.ops.reference.swap_blocks`."""
    src_arenas, dst_arenas = _as_list(src_arenas), _as_list(dst_arenas)
    fn = _impl("swap_blocks", backend, _first_device(src_arenas), _first_device(dst_arenas))
    fn(src_arenas, dst_arenas, pairs)


def convert_layout(
    arena: torch.Tensor, src_layout: str, dst_layout: str, *, scale: bool = False, backend: str = "auto"
) -> torch.Tensor:
    """A contiguous copy in the other layout; see :func:`pagedkv.ops.reference.convert_layout`."""
    fn = _impl("convert_layout", backend, _device(arena))
    return fn(arena, src_layout, dst_layout, scale=scale)
