"""MLA latent ops: the checks every backend makes, and the float64 definition.

:func:`check_write`, :func:`check_gather` and :func:`check_attention` run before any
work, with the same typed errors whatever the backend (the CUDA plans call them
too). The index arrays are read once, into CPU snapshots whose values are checked,
except the CUDA path's device tables, which the kernels guard instead (no sync).

The reference (:func:`write`, :func:`gather`, :func:`attention`) is the definition
the CPU ops and the kernels are tested against: rows encode and decode through
:class:`~pagedkv.store.latent.LatentFormat`, and attention runs in float64 over the
decoded rows: for query token i of sequence b at position p and query head h,
``o = softmax_t((q_nope . c_kv[t] + q_pe . k_pe[t]) * sm_scale) @ c_kv`` over keys
``t <= p`` (the queries of a sequence are its last tokens, causal).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from pagedkv.errors import DeviceError, DTypeError, InvalidArgumentError, ShapeError, expected
from pagedkv.ops.attention_reference import index_array
from pagedkv.ops.views import LatentView
from pagedkv.store import dtypes, op_checks

__all__ = ["Tables", "check_write", "check_gather", "check_attention", "write", "gather", "attention",
           "token_slots"]

MODEL_DTYPES = tuple(d.torch_dtype for d in dtypes.MODEL)


@dataclass(frozen=True)
class Tables:
    """Checked CSR tables: device tensors (what the kernels read) and, when their
    values were read, CPU snapshots."""

    indptr: torch.Tensor
    indices: torch.Tensor
    seq_lens: torch.Tensor
    batch: int
    host: tuple[np.ndarray, np.ndarray, np.ndarray] | None   # (indptr, indices, seq_lens), checked
    total: int | None                                        # sum(seq_lens) when read


def _view(view: object) -> LatentView:
    if not isinstance(view, LatentView):
        raise InvalidArgumentError(expected("view", "a LatentView (a latent layer of an MLA store)",
                                            type(view).__name__))
    view.check()
    return view


def _model_tensor(name: str, t: object, shape: tuple, device: torch.device) -> torch.Tensor:
    t = op_checks.check_tensor(name, t)
    if t.dtype not in MODEL_DTYPES:
        raise DTypeError(expected(name, f"dtype {dtypes.torch_names(dtypes.MODEL)}", t.dtype))
    if tuple(t.shape) != shape:
        want = ", ".join("N" if s is None else str(s) for s in shape)
        raise ShapeError(expected(name, f"shape [{want}]", tuple(t.shape)))
    if t.device != device:
        raise DeviceError(expected(name, f"device {device} (the arena's)", t.device))
    if t.numel() and t.stride(-1) != 1:
        raise InvalidArgumentError(expected(name, "a unit stride in the last dim", tuple(t.stride())))
    return t


def check_write(view, slot_mapping, kv_c, k_pe, *, read_values: bool) -> LatentView:
    """Checks of :func:`write`: ``kv_c`` ``[N, R]`` and ``k_pe`` ``[N, P]`` of one model
    dtype, ``slot_mapping`` ``[N]`` int64 (negative = skip; with ``read_values``, a slot
    past the arena is refused)."""
    view = _view(view)
    f, device = view.format, view.data.device
    slots = op_checks.check_tensor("slot_mapping", slot_mapping)
    if slots.dtype != torch.int64 or slots.dim() != 1:
        raise DTypeError(expected("slot_mapping", "a 1-D int64 tensor", f"{slots.dtype} {tuple(slots.shape)}"))
    if slots.device != device:
        raise DeviceError(expected("slot_mapping", f"device {device}", slots.device))
    n = slots.shape[0]
    kv_c = _model_tensor("kv_c", kv_c, (n, f.kv_lora_rank), device)
    k_pe = _model_tensor("k_pe", k_pe, (n, f.rope_dim), device)
    if k_pe.dtype != kv_c.dtype:
        raise DTypeError(expected("k_pe", f"dtype {kv_c.dtype} (as kv_c)", k_pe.dtype))
    if read_values and n:
        op_checks.check_slot_values(slots, view.num_slots)
    return view


def _tables(indptr, indices, seq_lens, device, block_size: int, num_blocks: int, read_values: bool) -> Tables:
    indptr = index_array("indptr", indptr, device)
    indices = index_array("indices", indices, device)
    seq_lens = index_array("seq_lens", seq_lens, device)
    batch = op_checks.check_csr(indptr, indices, seq_lens, device)
    if not read_values:
        return Tables(indptr, indices, seq_lens, batch, None, None)
    ptr, idx, lens = (t.cpu().numpy().astype(np.int64) for t in (indptr, indices, seq_lens))
    nnz = len(idx)
    for b, n in enumerate(lens.tolist()):
        lo, hi = int(ptr[b]), int(ptr[b + 1])
        if not 0 <= lo <= hi <= nnz:
            raise op_checks.indptr_error(b, lo, hi, nnz)
        if n < 0 or n > (hi - lo) * block_size:
            raise op_checks.seq_len_error(b, n, hi - lo, block_size, padded=False)
        need = idx[lo:lo + -(-n // block_size)].tolist()
        op_checks.check_block_ids("indices", need, num_blocks, where=lambda j, b=b: op_checks.csr_block_where(b, j))
    return Tables(indptr, indices, seq_lens, batch, (ptr, idx, lens), int(lens.sum()))


def check_gather(view, indptr, indices, seq_lens, out_dtype, *, read_values: bool):
    """Checks of :func:`gather`; returns ``(view, tables, out_dtype)``."""
    view = _view(view)
    out_dtype = view.format_dtype() if out_dtype is None else out_dtype
    if out_dtype not in MODEL_DTYPES:
        raise DTypeError(expected("out_dtype", f"None or {dtypes.torch_names(dtypes.MODEL)}", out_dtype))
    tables = _tables(indptr, indices, seq_lens, view.data.device, view.block_size, view.num_blocks, read_values)
    return view, tables, out_dtype


@dataclass(frozen=True)
class AttentionArgs:
    view: LatentView
    tables: Tables
    q_indptr: torch.Tensor
    host_q_indptr: np.ndarray | None
    num_q: int
    heads: int
    sm_scale: float
    num_splits: int | None
    out: torch.Tensor | None


def check_attention(view, q_nope, q_pe, indptr, indices, seq_lens, q_indptr, sm_scale, num_splits, out, *,
                    read_values: bool) -> AttentionArgs:
    """Checks of :func:`attention` (queries ``[Nq, Hq, R]`` and ``[Nq, Hq, P]`` of one
    model dtype; ``sm_scale`` required: MLA's scale is the query-key head's, not the latent's)."""
    view = _view(view)
    f, device = view.format, view.data.device
    q_nope = op_checks.check_tensor("q_nope", q_nope)
    if q_nope.dim() != 3:
        raise ShapeError(expected("q_nope", f"[num_q_tokens, num_q_heads, {f.kv_lora_rank}]", tuple(q_nope.shape)))
    nq, hq = q_nope.shape[0], q_nope.shape[1]
    q_nope = _model_tensor("q_nope", q_nope, (nq, hq, f.kv_lora_rank), device)
    q_pe = _model_tensor("q_pe", q_pe, (nq, hq, f.rope_dim), device)
    if q_pe.dtype != q_nope.dtype:
        raise DTypeError(expected("q_pe", f"dtype {q_nope.dtype} (as q_nope)", q_pe.dtype))
    if hq == 0:
        raise ShapeError(expected("q_nope", "at least one query head", tuple(q_nope.shape)))
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)) or not math.isfinite(sm_scale) \
            or sm_scale <= 0:
        raise InvalidArgumentError(expected("sm_scale", "a finite float > 0 (MLA: 1 / sqrt(qk_nope_head_dim + "
                                            "qk_rope_head_dim), times any YaRN mscale)", repr(sm_scale)))
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)
                                   or num_splits < 1):
        raise InvalidArgumentError(expected("num_splits", "None or an int >= 1", repr(num_splits)))
    tables = _tables(indptr, indices, seq_lens, device, view.block_size, view.num_blocks, read_values)
    qp = index_array("q_indptr", q_indptr, device)
    if qp.shape[0] != tables.batch + 1:
        raise ShapeError(expected("q_indptr", f"[{tables.batch + 1}] (len(indptr))", tuple(qp.shape)))
    host_qp = None
    if read_values:
        host_qp = qp.cpu().numpy().astype(np.int64)
        lens = tables.host[2]   # type: ignore[index]  # read with the tables
        if host_qp[0] != 0 or host_qp[-1] != nq:
            raise InvalidArgumentError(expected("q_indptr", f"offsets from 0 to {nq} (num_q_tokens)",
                                                f"[{host_qp[0]}, ..., {host_qp[-1]}]"))
        for b in range(tables.batch):
            k = int(host_qp[b + 1] - host_qp[b])
            if k < 0 or k > lens[b]:
                raise InvalidArgumentError(expected(
                    "q_indptr", f"0 <= q_indptr[{b + 1}] - q_indptr[{b}] <= seq_lens[{b}] = {lens[b]} (queries "
                    "are the sequence's last tokens)", f"{k} queries"))
    if out is not None:
        out = op_checks.check_tensor("out", out)
        want = (nq, hq, f.kv_lora_rank)
        if tuple(out.shape) != want or out.dtype != q_nope.dtype:
            raise ShapeError(expected("out", f"{q_nope.dtype} {want} (the latent output)",
                                      f"{out.dtype} {tuple(out.shape)}"))
        if out.device != device:
            raise DeviceError(expected("out", f"device {device}", out.device))
        if not out.is_contiguous():
            raise InvalidArgumentError(expected("out", "a contiguous tensor", f"strides {out.stride()}"))
    return AttentionArgs(view, tables, qp, host_qp, nq, hq, float(sm_scale), num_splits, out)


def token_slots(tables: Tables, block_size: int) -> np.ndarray:
    """int64 arena rows of every gathered token, sequence by sequence (checked tables)."""
    ptr, idx, lens = tables.host  # type: ignore[misc]  # read_values=True
    if not len(lens) or int(lens.sum()) == 0:
        return np.empty(0, dtype=np.int64)
    seq = np.repeat(np.arange(len(lens)), lens)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    pos = np.arange(int(lens.sum()), dtype=np.int64) - starts[seq]
    block = idx[ptr[seq] + pos // block_size]
    return block * block_size + pos % block_size


# ---- the definition ------------------------------------------------------------------------


def write(view: LatentView, slot_mapping: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor) -> None:
    """Encode ``[kv_c | k_pe]`` rows and store them at their slots (negative: skipped)."""
    view = check_write(view, slot_mapping, kv_c, k_pe, read_values=True)
    keep = slot_mapping >= 0
    if not bool(keep.any()):
        return
    rows = view.format.encode(kv_c[keep], k_pe[keep])
    view.rows().index_copy_(0, slot_mapping[keep], rows)


def gather(view: LatentView, indptr, indices, seq_lens, out_dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(kv_c [T, R], k_pe [T, P])`` of every sequence's first ``seq_lens[b]`` tokens,
    decoded into ``out_dtype`` (default: the model dtype)."""
    view, tables, out_dtype = check_gather(view, indptr, indices, seq_lens, out_dtype, read_values=True)
    slots = torch.from_numpy(token_slots(tables, view.block_size)).to(view.data.device)
    return view.format.decode(view.rows().index_select(0, slots), out_dtype)


def attention(view: LatentView, q_nope, q_pe, indptr, indices, seq_lens, q_indptr, *, sm_scale: float,
              num_splits: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Absorbed-weight MLA attention in float64 (see the module docstring); returns
    ``[Nq, Hq, R]`` in ``q_nope.dtype`` (``out`` when given)."""
    a = check_attention(view, q_nope, q_pe, indptr, indices, seq_lens, q_indptr, sm_scale, num_splits, out,
                        read_values=True)
    return attend(a, q_nope, q_pe, torch.float64)


def attend(a: AttentionArgs, q_nope: torch.Tensor, q_pe: torch.Tensor, compute: torch.dtype) -> torch.Tensor:
    """The attention of checked arguments, in ``compute`` precision (float64: the
    reference; float32: the CPU backend), sequence by sequence."""
    view, f = a.view, a.view.format
    r = f.kv_lora_rank
    slots = torch.from_numpy(token_slots(a.tables, view.block_size)).to(view.data.device)
    kv_c, k_pe = f.decode(view.rows().index_select(0, slots), compute)
    res = torch.zeros(a.num_q, a.heads, r, dtype=compute, device=view.data.device)
    lens = a.tables.host[2]  # type: ignore[index]
    qp = a.host_q_indptr
    start = 0
    for b in range(a.tables.batch):
        n, q0, q1 = int(lens[b]), int(qp[b]), int(qp[b + 1])   # type: ignore[index]
        if q1 > q0 and n:
            c, pe = kv_c[start:start + n], k_pe[start:start + n]
            qn, qr = q_nope[q0:q1].to(compute), q_pe[q0:q1].to(compute)
            logits = (torch.einsum("qhr,tr->qht", qn, c) + torch.einsum("qhp,tp->qht", qr, pe)) * a.sm_scale
            pos = n - (q1 - q0) + torch.arange(q1 - q0, device=logits.device)
            seen = torch.arange(n, device=logits.device)[None, :] <= pos[:, None]
            logits = logits.masked_fill(~seen[:, None, :], float("-inf"))
            res[q0:q1] = torch.einsum("qht,tr->qhr", torch.softmax(logits, dim=-1), c)
        start += n
    if a.out is not None:
        a.out.copy_(res)
        return a.out
    return res.to(q_nope.dtype)
