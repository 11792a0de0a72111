"""Paged attention: its checks and its float64 definition.

:func:`paged_attention` here is the semantic definition that every backend of
:func:`pagedkv.ops.paged_attention` is compared with. It reads K/V through the exact
gather (:func:`pagedkv.ops.reference.gather_kv`, dequantized to float32 and unrotated),
overlays the model-precision rows of ``exact_rows`` as the store's window does, then runs
a masked softmax in float64. It is slow and plain torch.

Semantics (shapes: ``B`` sequences, ``Hq`` query heads, ``Hkv`` KV heads, ``D`` head_dim):

- sequence ``b`` has ``L = seq_lens[b]`` keys at positions ``0 .. L-1`` (its pages:
  ``indices[indptr[b]:indptr[b+1]]``, as :func:`pagedkv.ops.gather_kv` reads them);
- its queries are ``q[q_indptr[b]:q_indptr[b+1]]`` (``n_b <= L`` of them), at positions
  ``L - n_b .. L - 1``: a decode step has ``n_b = 1``, a prefill chunk or a speculative
  verification more; attention is causal within the chunk;
- query head ``h`` reads KV head ``h // (Hq // Hkv)`` (GQA/MQA);
- a query at position ``p`` sees key ``j`` when ``j <= p`` and, with ``window=W``,
  ``j > p - W`` or ``j < sink_tokens``;
- logits are ``sm_scale * (q . k)`` (default ``1 / sqrt(D)``), then
  ``soft_cap * tanh(logits / soft_cap)`` when ``soft_cap`` is given;
- ``out[t, h] = sum_j softmax(logits)_j v_j``, returned in ``q.dtype``.

``exact_rows`` (:class:`ExactRows`) makes the op read what ``PagedKVCache.gather_pages``
reads from a store with ``kv_window``/``kv_sink_tokens``: for sequence ``b`` with
``lo = max(0, L - recent)`` and ``head = min(sink, lo)``, a key at position ``p`` with
``p < head`` or ``p >= lo`` whose page ``blk`` has a slot ``s = slot_of[blk] >= 0`` and
``valid[s, p % bs]`` is read from ``data[s, :, p % bs]`` (model precision, unrotated)
instead of from the (quantized) arena. This is :meth:`pagedkv.store.window.RecentWindow.overlay`
with no pending tokens.

Rotation (``rotation_signs`` of a rotated arena): the definition is in the unrotated
domain (the gather unrotates every row). A fast backend instead rotates ``q`` once and
unrotates the output once: the rotation is orthonormal, so scores and output are the
same up to rounding.
"""
from __future__ import annotations

from typing import NamedTuple, cast

import numpy as np
import torch

from pagedkv.errors import (
    DeviceError,
    DTypeError,
    InvalidArgumentError,
    ShapeError,
    expected,
)
from pagedkv.format import op_checks
from pagedkv.format.attention_checks import check_attention_args, index_array, opt_int
from pagedkv.format.quant import MODEL_DTYPES

# index_array: re-exported (it was first published here)
__all__ = ["ExactRows", "AttentionPlan", "check_attention", "paged_attention", "index_array"]


class ExactRows(NamedTuple):
    """Model-precision rows read instead of the arena's (a store's recent window).

    - ``data``: ``[capacity, 2, block_size, Hkv, D]`` (NHD whatever the arena's layout)
      in a model dtype: ``RecentWindow.data[layer]``;
    - ``slot_of``: int64 ``[num_blocks]`` (NumPy or a CPU tensor), a block's slot in
      ``data`` or -1;
    - ``valid``: bool ``[capacity, block_size]``: which rows of a slot are held;
    - ``recent``: the last ``recent`` positions of each sequence are read from here;
    - ``sink``: and its first ``sink`` positions (those before the recent ones).
    """

    data: torch.Tensor
    slot_of: object
    valid: torch.Tensor
    recent: int
    sink: int = 0


class AttentionPlan(NamedTuple):
    """What :func:`check_attention` established (every later step trusts it)."""

    geo: op_checks.LayerGeometry
    batch: int
    num_q_heads: int
    group: int                  # query heads per KV head
    sm_scale: float
    soft_cap: float | None
    window: int | None
    sink_tokens: int
    num_splits: int | None
    indptr: torch.Tensor        # int32, CPU snapshots (read once), values checked
    indices: torch.Tensor
    seq_lens: torch.Tensor
    q_indptr: torch.Tensor
    exact: ExactRows | None  # with slot_of as a contiguous int64 CPU tensor


def _check_exact(exact: object, geo: op_checks.LayerGeometry, device: torch.device) -> ExactRows | None:
    if exact is None:
        return None
    if not isinstance(exact, ExactRows):
        raise InvalidArgumentError(expected("exact_rows", "None or an ExactRows", type(exact).__name__))
    data = op_checks.check_tensor("exact_rows.data", exact.data)
    if data.dim() != 5 or tuple(data.shape[1:]) != (2, geo.block_size, geo.num_heads, geo.head_dim):
        raise ShapeError(expected("exact_rows.data", f"[capacity, 2, {geo.block_size}, {geo.num_heads}, "
                                  f"{geo.head_dim}]", tuple(data.shape)))
    if data.dtype not in MODEL_DTYPES:
        raise DTypeError(expected("exact_rows.data", "a model dtype (float32, float16, bfloat16)", data.dtype))
    if data.device != device:
        raise DeviceError(expected("exact_rows.data", f"device {device}", data.device))
    valid = op_checks.check_tensor("exact_rows.valid", exact.valid)
    if valid.dtype != torch.bool or tuple(valid.shape) != (data.shape[0], geo.block_size):
        raise ShapeError(expected("exact_rows.valid", f"bool [{data.shape[0]}, {geo.block_size}]",
                                  f"{valid.dtype} {tuple(valid.shape)}"))
    if valid.device != device:
        raise DeviceError(expected("exact_rows.valid", f"device {device}", valid.device))
    slot_of = exact.slot_of
    if isinstance(slot_of, np.ndarray):
        slot_of = torch.from_numpy(np.ascontiguousarray(slot_of))
    slot_of = op_checks.check_tensor("exact_rows.slot_of", slot_of)
    if slot_of.dtype != torch.int64 or tuple(slot_of.shape) != (geo.num_blocks,):
        raise ShapeError(expected("exact_rows.slot_of", f"int64 [{geo.num_blocks}] (num_blocks)",
                                  f"{slot_of.dtype} {tuple(slot_of.shape)}"))
    slot_of = slot_of.cpu().clone()           # read once
    if slot_of.numel() and int(slot_of.max()) >= data.shape[0]:
        raise InvalidArgumentError(expected("exact_rows.slot_of", f"slots < {data.shape[0]} (capacity) or -1",
                                            int(slot_of.max())))
    recent = opt_int("exact_rows.recent", exact.recent, 0, allow_none=False)
    sink = opt_int("exact_rows.sink", exact.sink, 0, allow_none=False)
    return ExactRows(data, slot_of, valid, cast(int, recent), cast(int, sink))


def check_attention(q, kv_layer, indptr, indices, seq_lens, q_indptr, *, layout="NHD", kv_scale=None,
                    kv_zero=None, key_scale=None, key_zero=None, rotation_signs=None, sm_scale=None,
                    soft_cap=None, window=None, sink_tokens=0, num_splits=None, out=None,
                    exact_rows=None, layer_format=None) -> AttentionPlan:
    """Every check of :func:`pagedkv.ops.paged_attention`, before any tensor is written.

    The index arrays are read once: the plan holds CPU int32 snapshots whose values
    were checked (the tables as :func:`pagedkv.ops.gather_kv` checks them, plus
    ``q_indptr``)."""
    a = check_attention_args(q, kv_layer, indptr, indices, seq_lens, q_indptr, layout=layout, kv_scale=kv_scale,
                             kv_zero=kv_zero, key_scale=key_scale, key_zero=key_zero,
                             rotation_signs=rotation_signs, sm_scale=sm_scale, soft_cap=soft_cap, window=window,
                             sink_tokens=sink_tokens, num_splits=num_splits, out=out, layer_format=layer_format)
    exact = _check_exact(exact_rows, a.geo, kv_layer.device)
    return AttentionPlan(a.geo, a.batch, a.num_q_heads, a.num_q_heads // a.geo.num_heads, a.sm_scale, a.soft_cap,
                         a.window, a.sink_tokens, a.num_splits, a.indptr, a.indices, a.seq_lens, a.q_indptr, exact)


# ----------------------------------------------------------------------------------
# the definition


def _exact_overlay(k, v, plan: AttentionPlan, b: int, n: int) -> None:
    ex = plan.exact
    if ex is None:
        return
    lo = max(0, n - ex.recent)
    head = min(ex.sink, lo)
    pos = torch.cat([torch.arange(head), torch.arange(lo, n)]).long()
    if not pos.numel():
        return
    bs = plan.geo.block_size
    first = int(plan.indptr[b])
    blk = plan.indices[first + pos // bs].long()
    slot = cast(torch.Tensor, ex.slot_of)[blk]
    off = pos % bs
    held = slot >= 0
    pos, slot, off = pos[held], slot[held], off[held]
    ok = ex.valid.cpu()[slot, off]
    pos, slot, off = pos[ok], slot[ok], off[ok]
    data = ex.data.cpu()
    k[pos] = data[slot, 0, off].to(k.dtype)
    v[pos] = data[slot, 1, off].to(v.dtype)


def paged_attention(q, kv_layer, indptr, indices, seq_lens, q_indptr, *, layout="NHD", kv_scale=None,
                    kv_zero=None, key_scale=None, key_zero=None, rotation_signs=None, sm_scale=None,
                    soft_cap=None, window=None, sink_tokens=0, num_splits=None, out=None,
                    exact_rows=None) -> torch.Tensor:
    """The float64 definition of :func:`pagedkv.ops.paged_attention` (see the module)."""
    plan = check_attention(q, kv_layer, indptr, indices, seq_lens, q_indptr, layout=layout, kv_scale=kv_scale,
                           kv_zero=kv_zero, key_scale=key_scale, key_zero=key_zero, rotation_signs=rotation_signs,
                           sm_scale=sm_scale, soft_cap=soft_cap, window=window, sink_tokens=sink_tokens,
                           num_splits=num_splits, out=out, exact_rows=exact_rows)
    return attend_reference(plan, q, kv_layer, layout, kv_scale, kv_zero, key_scale, key_zero, rotation_signs, out)


def attend_reference(plan: AttentionPlan, q, kv_layer, layout, kv_scale, kv_zero, key_scale, key_zero,
                     rotation_signs, out):
    """The float64 attention of a checked call (``plan`` from :func:`check_attention`)."""
    from pagedkv.ops import reference as _ref

    geo = plan.geo
    dev = kv_layer.device
    out_dtype = torch.float32 if geo.quantized else None
    k_all, v_all = _ref.gather_kv(kv_layer, plan.indptr.to(dev), plan.indices.to(dev), plan.seq_lens.to(dev),
                                  layout=layout, out_dtype=out_dtype, kv_scale=kv_scale, kv_zero=kv_zero,
                                  rotation_signs=rotation_signs, key_scale=key_scale, key_zero=key_zero)
    k_all, v_all = k_all.cpu().double(), v_all.cpu().double()
    qd = q.detach().cpu().double()
    res = torch.zeros(q.shape, dtype=torch.float64)
    lens, qp = plan.seq_lens.tolist(), plan.q_indptr.tolist()
    base = 0
    for b, n in enumerate(lens):
        k, v = k_all[base:base + n].clone(), v_all[base:base + n].clone()
        base += n
        nq = qp[b + 1] - qp[b]
        if nq == 0:
            continue
        if plan.exact is not None:
            _exact_overlay(k, v, plan, b, n)
        # [nq, Hq, D] x [n, Hkv, D] -> [Hq, nq, n], each query head against its KV head
        kh = k.repeat_interleave(plan.group, dim=1).transpose(0, 1)        # [Hq, n, D]
        vh = v.repeat_interleave(plan.group, dim=1).transpose(0, 1)
        qh = qd[qp[b]:qp[b + 1]].transpose(0, 1)                             # [Hq, nq, D]
        s = (qh @ kh.transpose(1, 2)) * plan.sm_scale
        if plan.soft_cap is not None:
            s = plan.soft_cap * torch.tanh(s / plan.soft_cap)
        p = torch.arange(n - nq, n).unsqueeze(1)                            # query positions
        j = torch.arange(n).unsqueeze(0)
        seen = j <= p
        if plan.window is not None:
            seen &= (j > p - plan.window) | (j < plan.sink_tokens)
        s = s.masked_fill(~seen, float("-inf"))
        res[qp[b]:qp[b + 1]] = torch.softmax(s, dim=-1).matmul(vh).transpose(0, 1)
    res = res.to(device=q.device, dtype=q.dtype)
    if out is not None:
        out.copy_(res)
        return out
    return res
