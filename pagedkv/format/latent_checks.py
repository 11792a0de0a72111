"""MLA latent ops' checks, shared by every backend (:mod:`pagedkv.ops.latent`, the
CPU ops and the float64 reference in :mod:`pagedkv.ops.latent_reference`, the CUDA
launch plans in :mod:`pagedkv.kernels.latent_plans`), and :class:`LatentView`, the
layer they take. Below the ops (as :mod:`pagedkv.format.op_checks` is), so the kernels
never import the ops package.

:func:`check_write`, :func:`check_gather` and :func:`check_attention` run before any
work, with the same typed errors whatever the backend. The index arrays are read once,
into CPU snapshots whose values are checked, except a GPU's device tables, which the
kernels guard instead (no sync).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from pagedkv.errors import DeviceError, DTypeError, InvalidArgumentError, ShapeError, expected
from pagedkv.format import dtypes, op_checks
from pagedkv.format.attention_checks import index_array  # the paged attention's tables' rule
from pagedkv.format.latent import LatentFormat

__all__ = ["LatentView", "Tables", "AttentionArgs", "check_write", "check_gather", "check_attention",
           "token_slots", "index_array"]


@dataclass(frozen=True)
class LatentView:
    """One MLA layer: its row ``format`` and ``data`` ``[num_blocks, block_size, row_elems]``
    (contiguous; the model dtype's elements, or uint8 bytes of a quantized row)."""

    format: LatentFormat
    data: torch.Tensor

    def check(self) -> None:
        """``data`` holds ``format``'s rows (typed errors naming what differs)."""
        f, t = self.format, self.data
        if not isinstance(f, LatentFormat):
            raise InvalidArgumentError(expected("view.format", "a LatentFormat", type(f).__name__))
        if not isinstance(t, torch.Tensor):
            raise DTypeError(expected("view.data", "a torch.Tensor", type(t).__name__))
        if t.dtype != f.storage_dtype:
            raise DTypeError(expected("view.data", f"dtype {f.storage_dtype} ({f.describe()})", t.dtype))
        if t.dim() != 3 or t.shape[2] != f.row_elems or 0 in tuple(t.shape[:2]):
            raise ShapeError(expected("view.data", f"[num_blocks, block_size, {f.row_elems}] ({f.describe()})",
                                      tuple(t.shape)))
        if not t.is_contiguous():
            raise InvalidArgumentError(expected("view.data", "a contiguous tensor", f"strides {t.stride()}"))

    @property
    def num_blocks(self) -> int:
        return int(self.data.shape[0])

    @property
    def block_size(self) -> int:
        return int(self.data.shape[1])

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def rows(self) -> torch.Tensor:
        """The arena as ``[num_slots, row_elems]`` (slot s is row s; no copy)."""
        return self.data.view(self.num_slots, self.format.row_elems)

    def format_dtype(self) -> torch.dtype:
        """The model dtype (what a read returns by default)."""
        return dtypes.info(self.format.model_dtype).torch_dtype


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
