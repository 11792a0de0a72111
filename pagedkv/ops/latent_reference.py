"""MLA latent ops: the float64 definition (the checks are :mod:`pagedkv.format.latent_checks`).

The reference (:func:`write`, :func:`gather`, :func:`attention`) is the definition
the CPU ops and the kernels are tested against: rows encode and decode through
:class:`~pagedkv.format.latent.LatentFormat`, and attention runs in float64 over the
decoded rows: for query token i of sequence b at position p and query head h,
``o = softmax_t((q_nope . c_kv[t] + q_pe . k_pe[t]) * sm_scale) @ c_kv`` over keys
``t <= p`` (the queries of a sequence are its last tokens, causal).
"""
from __future__ import annotations

import torch

from pagedkv.format.latent_checks import (  # noqa: F401  (the checks, as the ops' callers name them)
    AttentionArgs,
    LatentView,
    Tables,
    _tables,
    check_attention,
    check_gather,
    check_write,
    token_slots,
)

__all__ = ["check_write", "check_gather", "check_attention", "write", "gather", "attention", "attend",
           "token_slots"]


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
