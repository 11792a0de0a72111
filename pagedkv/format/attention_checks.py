"""The argument checks of paged attention, shared by every backend.

:func:`pagedkv.ops.paged_attention`'s reference and CPU backends
(:func:`pagedkv.ops.attention_reference.check_attention`) and the CUDA launch plan
(:func:`pagedkv.kernels.attention_plans.plan_paged_attention`) validate a call through
:func:`check_attention_args`, so a bad call raises the same typed error with the same
message whichever backend runs it, before any tensor is written. What only one backend
adds (the reference's model-precision ``exact_rows``, the kernels' alignment and grid
limits) it checks after these.

The index tables are read once: the checks return private snapshots, and every later step
works from them.
"""
from __future__ import annotations

import math
from typing import NamedTuple, cast

import numpy as np
import torch

from pagedkv.errors import DeviceError, DTypeError, InvalidArgumentError, ShapeError, expected
from pagedkv.format import op_checks
from pagedkv.format.quant import MODEL_DTYPES

__all__ = ["AttentionArgs", "check_attention_args", "index_array", "check_table_values"]


class AttentionArgs(NamedTuple):
    """A checked call of paged attention."""

    geo: op_checks.LayerGeometry
    q: torch.Tensor
    batch: int
    num_q_heads: int
    sm_scale: float
    soft_cap: float | None
    window: int | None
    sink_tokens: int
    num_splits: int | None
    indptr: torch.Tensor        # int32 snapshots (read once)
    indices: torch.Tensor
    seq_lens: torch.Tensor
    q_indptr: torch.Tensor
    out: torch.Tensor | None
    key_channels: bool          # the call passed block-key parameters


def index_array(name: str, x: object, device: torch.device) -> torch.Tensor:
    """An int32 1-D index tensor on ``device`` from an int32 tensor or a NumPy integer array.

    A tensor must already be int32 (as :func:`pagedkv.ops.gather_kv` takes it: nothing is
    cast silently); a NumPy array of any integer dtype is converted when its values fit."""
    if isinstance(x, np.ndarray):
        if x.dtype.kind not in "iu":
            raise DTypeError(expected(name, "an integer NumPy array or an int32 tensor", f"NumPy {x.dtype}"))
        if x.ndim != 1:
            raise ShapeError(expected(name, "a 1-D array", x.shape))
        if x.size and (int(x.min()) < -2**31 or int(x.max()) >= 2**31):
            raise InvalidArgumentError(expected(name, "values that fit int32", f"range [{x.min()}, {x.max()}]"))
        return torch.from_numpy(np.ascontiguousarray(x, dtype=np.int32)).to(device)
    t = op_checks.check_tensor(name, x)
    if t.dtype != torch.int32:
        raise DTypeError(expected(name, "dtype int32 (or a NumPy integer array)", t.dtype))
    if t.dim() != 1:
        raise ShapeError(expected(name, "a 1-D tensor", tuple(t.shape)))
    if t.device != device:
        raise DeviceError(expected(name, f"device {device}", t.device))
    return t


def opt_number(name: str, x: object, what: str, ok) -> float | None:
    if x is None:
        return None
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not ok(float(x)):
        raise InvalidArgumentError(expected(name, what, repr(x)))
    return float(x)


def opt_int(name: str, x: object, lo: int, allow_none: bool = True) -> int | None:
    if x is None and allow_none:
        return None
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or int(x) < lo:
        raise InvalidArgumentError(expected(name, f"{'None or ' if allow_none else ''}an int >= {lo}", repr(x)))
    if int(x) > 2**62:   # the loops add and subtract positions in int64: a larger value would overflow
        raise InvalidArgumentError(expected(name, f"an int in [{lo}, 2**62]", repr(x)))
    return int(x)


def check_table_values(indptr, indices, seq_lens, q_indptr, geo: op_checks.LayerGeometry, num_q: int) -> None:
    """The values of CPU-resident tables: the pages as :func:`pagedkv.ops.gather_kv` checks
    them, and ``q_indptr`` (each sequence's queries are its last tokens)."""
    ptr, idx, lens, qp = indptr.tolist(), indices.tolist(), seq_lens.tolist(), q_indptr.tolist()
    nnz, bs = len(idx), geo.block_size
    for b, n in enumerate(lens):
        lo, hi = ptr[b], ptr[b + 1]
        if not 0 <= lo <= hi <= nnz:
            raise op_checks.indptr_error(b, lo, hi, nnz)
        if n < 0 or n > (hi - lo) * bs:
            raise op_checks.seq_len_error(b, n, hi - lo, bs, padded=False)
        op_checks.check_block_ids("indices", idx[lo:lo + -(-n // bs)], geo.num_blocks,
                                  where=lambda j, b=b: op_checks.csr_block_where(b, j))
    if qp[0] != 0 or qp[-1] != num_q:
        raise InvalidArgumentError(expected("q_indptr", f"offsets from 0 to {num_q} (num_q_tokens)",
                                            f"[{qp[0]}, ..., {qp[-1]}]"))
    for b, n in enumerate(lens):
        nq = qp[b + 1] - qp[b]
        if nq < 0 or nq > n:
            raise InvalidArgumentError(expected(
                "q_indptr", f"0 <= q_indptr[{b + 1}] - q_indptr[{b}] <= seq_lens[{b}] = {n} (queries are the "
                "sequence's last tokens)", f"{nq} queries"))


def check_attention_args(q, kv_layer, indptr, indices, seq_lens, q_indptr, *, layout="NHD", kv_scale=None,
                         kv_zero=None, key_scale=None, key_zero=None, rotation_signs=None, sm_scale=None,
                         soft_cap=None, window=None, sink_tokens=0, num_splits=None, out=None,
                         layer_format=None, snapshot_on_cpu: bool = True) -> AttentionArgs:
    """Every check of paged attention that all backends make (see the module).

    ``snapshot_on_cpu``: the tables are snapshot to the CPU and their values checked (the
    CPU and reference backends); else (the kernels) CPU tables are snapshot and checked
    there, and a GPU's are neither read (that would sync) nor copied."""
    geo = op_checks.check_layer(kv_layer, layout, kv_scale, kv_zero, layer_format=layer_format)
    device = kv_layer.device
    explicit = layer_format is not None
    op_checks.check_rotation(rotation_signs, geo, device, explicit=explicit)
    key_channels = op_checks.check_key_channels(key_scale, key_zero, geo, device, explicit=explicit)
    q = op_checks.check_tensor("q", q)
    if q.dtype not in MODEL_DTYPES:
        raise DTypeError(expected("q", "dtype float32, float16 or bfloat16", q.dtype))
    if q.dim() != 3 or q.shape[2] != geo.head_dim:
        raise ShapeError(expected("q", f"[num_q_tokens, num_q_heads, {geo.head_dim}]", tuple(q.shape)))
    if q.device != device:
        raise DeviceError(expected("q", f"device {device} (the kv_layer's)", q.device))
    if not geo.quantized and q.dtype != kv_layer.dtype:
        raise DTypeError(expected("q", f"dtype {kv_layer.dtype} (the kv_layer dtype)", q.dtype))
    hq = q.shape[1]
    if geo.num_heads == 0 or hq == 0 or hq % geo.num_heads:
        raise ShapeError(expected("q", f"num_q_heads a positive multiple of {geo.num_heads} (the KV heads)",
                                  tuple(q.shape)))
    if geo.head_dim == 0:
        raise ShapeError(expected("kv_layer", "a head_dim >= 1", tuple(kv_layer.shape)))
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(geo.head_dim)
    scale = cast(float, opt_number("sm_scale", sm_scale, "None or a finite float", math.isfinite))
    soft_cap = opt_number("soft_cap", soft_cap, "None or a float > 0", lambda v: math.isfinite(v) and v > 0)
    window = opt_int("window", window, 1)
    sinks = cast(int, opt_int("sink_tokens", sink_tokens, 0, allow_none=False))
    num_splits = opt_int("num_splits", num_splits, 1)
    indptr = index_array("indptr", indptr, device)
    indices = index_array("indices", indices, device)
    seq_lens = index_array("seq_lens", seq_lens, device)
    q_indptr = index_array("q_indptr", q_indptr, device)
    batch = op_checks.check_csr(indptr, indices, seq_lens, device)
    if q_indptr.shape[0] != batch + 1:
        raise ShapeError(expected("q_indptr", f"[{batch + 1}] (len(indptr))", tuple(q_indptr.shape)))
    # read once: the checks and every later step see the same values
    if snapshot_on_cpu:
        indptr, indices = indptr.cpu().clone(), indices.cpu().clone()
        seq_lens, q_indptr = seq_lens.cpu().clone(), q_indptr.cpu().clone()
    else:   # a GPU's values are not read here, so they are not copied either (no clone on the launch path)
        copy = device.type == "cpu"
        indptr, indices, seq_lens, q_indptr = (t.contiguous().clone() if copy else t.contiguous()
                                               for t in (indptr, indices, seq_lens, q_indptr))
    if indptr.device.type == "cpu":
        check_table_values(indptr, indices, seq_lens, q_indptr, geo, q.shape[0])
    if out is not None:
        out = op_checks.check_tensor("out", out)
        if tuple(out.shape) != tuple(q.shape) or out.dtype != q.dtype:
            raise ShapeError(expected("out", f"{q.dtype} {tuple(q.shape)} (as q)", f"{out.dtype} {tuple(out.shape)}"))
        if out.device != device:
            raise DeviceError(expected("out", f"device {device}", out.device))
        if not out.is_contiguous():
            raise InvalidArgumentError(expected("out", "a contiguous tensor", f"strides {out.stride()}"))
    return AttentionArgs(geo, q, batch, hq, scale, soft_cap, window, sinks, num_splits, indptr, indices, seq_lens,
                         q_indptr, out, bool(key_channels))
