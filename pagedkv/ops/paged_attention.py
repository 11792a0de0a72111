"""Attention straight from the paged arena: :func:`paged_attention`.

Reads each sequence's K/V through its CSR page table, in place, in any storage format
(the model dtypes, fp8 e4m3/e5m2, int8, int4 groups, int3, int4 block keys), with no
intermediate K/V tensor. The semantics, the shapes and the exact-rows overlay are
defined by :mod:`pagedkv.ops.attention_reference` (float64); the backends:

- ``"cpu"``: C loops (``attention_rows.h`` through :mod:`pagedkv.ops._cpu_attention`):
  rows dequantized into float32 tiles, float32 scores and an online softmax; every
  sequence's keys are cut into splits of at most :data:`SPLIT_TOKENS` tokens
  (flash-decoding) whose partial results are merged exactly (log-sum-exp), and the
  (sequence, KV head, split) items run in one OpenMP loop (serially below a size
  threshold; threads as :func:`pagedkv.set_num_threads` says). The split points follow
  the thread setting, not the cores idle at the time, so a call's result does not
  change with the machine's load;
- ``"reference"``: the float64 definition;
- ``"cuda"``: the ``paged_attention`` function of the CUDA backend module
  (:data:`pagedkv.ops.backends.MODULES`), with this function's signature less
  ``backend``; :class:`~pagedkv.errors.KernelUnavailableError` while it has none;
- ``"auto"``: ``"cuda"`` for CUDA tensors, ``"cpu"`` for CPU tensors when the loops are
  built, the reference otherwise.

A rotated arena (``rotation_signs``): the CPU backend rotates ``q`` once, scores the
rotated rows as stored, and unrotates each output row once; never a cached row (the
block keys, stored unrotated, are scored against the unrotated ``q``; the few
model-precision ``exact_rows`` values are rotated as they are read).

Every check runs before any work, with the same errors whatever the backend
(:func:`pagedkv.ops.attention_reference.check_attention`).
"""
from __future__ import annotations

import torch

from pagedkv.errors import DeviceError, KernelUnavailableError, expected
from pagedkv.format.layer_format import LayerFormat
from pagedkv.ops import backends
from pagedkv.ops.attention_reference import ExactRows, attend_reference, check_attention
from pagedkv.ops.views import KVLayerView, unpack

try:
    from pagedkv.ops import _cpu_attention as _ca
except ImportError:  # not built
    _ca = None  # type: ignore[assignment]

__all__ = ["paged_attention", "ExactRows", "SPLIT_TOKENS", "CPU_AVAILABLE"]

#: True when the C loops of the CPU backend are built.
CPU_AVAILABLE = _ca is not None
#: auto split length (tokens) of the CPU backend's flash-decoding
SPLIT_TOKENS = 1024


def paged_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor | KVLayerView,
    indptr,
    indices,
    seq_lens,
    q_indptr,
    *,
    layout: str = "NHD",
    kv_scale: torch.Tensor | None = None,
    kv_zero: torch.Tensor | None = None,
    key_scale: torch.Tensor | None = None,
    key_zero: torch.Tensor | None = None,
    rotation_signs: torch.Tensor | None = None,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    window: int | None = None,
    sink_tokens: int = 0,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    exact_rows: ExactRows | None = None,
    layer_format: LayerFormat | None = None,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    pending=None,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention of ``q`` ``[num_q_tokens, num_q_heads, head_dim]`` over paged K/V.

    Args:
        q: the queries, in the model dtype (the arena's dtype when it is not quantized).
        kv_layer: one layer's arena, exactly as :func:`pagedkv.ops.gather_kv` takes it.
        indptr: the CSR page table's offsets (an int32 tensor on the arena's device, or a
            NumPy integer array), as :func:`pagedkv.ops.gather_kv` takes them.
        indices: the CSR page table's block ids (likewise).
        seq_lens: each sequence's length in tokens (likewise).
        q_indptr: ``[batch + 1]``: sequence ``b``'s queries are
            ``q[q_indptr[b]:q_indptr[b+1]]``, its last tokens (causal within the chunk).
        sm_scale: logit scale (default ``1 / sqrt(head_dim)``).
        soft_cap: optional logit soft-cap ``cap * tanh(logits / cap)``.
        layout: ``"NHD"`` or ``"HND"``, the arena's layout.
        kv_scale: the quantized arena's scale view (as :func:`pagedkv.ops.gather_kv`).
        kv_zero: its zero-point view (int8, int4, int3).
        key_scale: the per-channel key scales of int4 block keys.
        key_zero: their zero points.
        rotation_signs: the signs of a rotated arena (float32 ``[head_dim]``).
        window: a query at position ``p`` sees keys ``> p - window`` (None: all earlier keys)...
        sink_tokens: ... and the first ``sink_tokens`` positions.
        num_splits: CPU: splits per sequence (default: one per :data:`SPLIT_TOKENS` keys).
        out: optional contiguous output shaped and typed as ``q``.
        exact_rows: model-precision rows read instead of the arena's
            (:class:`~pagedkv.ops.attention_reference.ExactRows`, a store's window); its
            recent rows are those before the pending ones.
        k_new: ``[num_q_tokens, num_kv_heads, head_dim]`` in ``q``'s dtype: the K/V
            the forward pass computed for each query token (row ``t``: query token ``t``'s
            own). The pass's rows are read from here, at model precision, instead of
            from the arena it has just written them to (one definition of what a read
            returns; see :mod:`pagedkv.format.new_rows`).
        v_new: the values to match ``k_new``, same shape and dtype.
        pending: ints ``[batch]`` (an int32 tensor or a NumPy array): sequence ``b``'s last
            ``pending[b]`` positions (``<= `` its query count) are the pass's rows read
            from ``k_new``/``v_new``. Default with ``k_new``: every query's own position;
            a query that re-reads a committed token (a recomputed prefix hit) is given
            fewer.
        layer_format: the layer's :class:`~pagedkv.format.layer_format.LayerFormat` (the
            store passes its own); the tensors are verified against it. None: the format
            the tensors imply (the group size read off ``kv_scale``'s trailing dim).
        backend: ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"reference"``.

    Returns:
        ``[num_q_tokens, num_q_heads, head_dim]`` in ``q.dtype`` (``out`` when given).

    ``kv_layer`` may be a :class:`~pagedkv.ops.views.KVLayerView` (a store's layer: its
    format, views and exact rows), standing for the layer keywords, which are then not
    given.
    """
    if type(kv_layer) is KVLayerView:
        kv_layer, layer = unpack("paged_attention", kv_layer, dict(
            layout=layout, kv_scale=kv_scale, kv_zero=kv_zero, key_scale=key_scale, key_zero=key_zero,
            rotation_signs=rotation_signs, exact_rows=exact_rows, layer_format=layer_format), attention=True)
        return paged_attention(q, kv_layer, indptr, indices, seq_lens, q_indptr, sm_scale=sm_scale,
                               soft_cap=soft_cap, window=window, sink_tokens=sink_tokens, num_splits=num_splits,
                               out=out, backend=backend, k_new=k_new, v_new=v_new, pending=pending, **layer)
    kwargs = dict(layout=layout, kv_scale=kv_scale, kv_zero=kv_zero, key_scale=key_scale, key_zero=key_zero,
                  rotation_signs=rotation_signs, sm_scale=sm_scale, soft_cap=soft_cap, window=window,
                  sink_tokens=sink_tokens, num_splits=num_splits, out=out, exact_rows=exact_rows,
                  layer_format=layer_format, k_new=k_new, v_new=v_new, pending=pending)
    device = kv_layer.device if isinstance(kv_layer, torch.Tensor) else torch.device("meta")
    if backend == "auto" and device.type == "cpu" and _ca is None:
        name = "reference"
    else:
        name = backends.resolve_backend(backend, device)
    if name == "cuda":
        fn = getattr(backends.load("cuda"), "paged_attention", None)
        if fn is None:
            raise KernelUnavailableError("the CUDA backend (pagedkv.kernels.ops) has no paged_attention yet; "
                                         "use backend='reference' or CPU tensors")
        return fn(q, kv_layer, indptr, indices, seq_lens, q_indptr, **kwargs)
    plan = check_attention(q, kv_layer, indptr, indices, seq_lens, q_indptr, **kwargs)
    if name == "reference":
        return attend_reference(plan, q, kv_layer, layout, kv_scale, kv_zero, key_scale, key_zero,
                                rotation_signs, out)
    if device.type != "cpu":
        raise DeviceError(expected("kv_layer", "a CPU tensor for the 'cpu' backend", device))
    if _ca is None:
        raise KernelUnavailableError("the CPU attention loops (pagedkv.ops._cpu_attention) are not built; "
                                     "build the package or use backend='reference'")
    from pagedkv.ops import attention_cpu

    return attention_cpu.attend(plan, q, kv_layer, layout, kv_scale, kv_zero, key_scale, key_zero,
                                rotation_signs, out, SPLIT_TOKENS)
