"""A forward pass's own K/V, read at model precision: the checks every attention backend shares.

One definition of what a read returns (DESIGN.md): during a forward pass, the rows that
pass wrote are read at model precision; older rows are read from their stored format,
except the window and sink rows kept exact. A reader that writes the pass's K/V before
it attends (paged attention) therefore hands the attention those K/V as computed
(``k_new``, ``v_new``: query token ``t``'s own key and value in row ``t``) and says how
many of each sequence's last positions they cover (``pending``); a reader that attends
before it writes (a gather) overwrites the same positions itself
(``gather_pages(pending=)``). Either way the window of exact rows is the ``kv_window``
tokens *before* the pending ones.
"""
from __future__ import annotations

import torch

from pagedkv.errors import DeviceError, DTypeError, InvalidArgumentError, ShapeError, expected
from pagedkv.format.op_checks import LayerGeometry, check_tensor
from pagedkv.format.quant import MODEL_DTYPES

__all__ = ["check_new_rows", "check_pending_values"]


def check_new_rows(k_new: object, v_new: object, pending: object, q: torch.Tensor, geo: LayerGeometry,
                   device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(k_new, v_new)`` checked against ``q`` ``[num_q_tokens, Hq, D]`` and the layer:
    both or neither, each ``[num_q_tokens, num_kv_heads, head_dim]`` in ``q``'s dtype on
    the arena's device. ``pending`` (its values are checked by
    :func:`check_pending_values`) needs them."""
    if k_new is None and v_new is None:
        if pending is not None:
            raise InvalidArgumentError(expected("pending", "None without k_new and v_new (the rows it names are "
                                                "read from them)", "counts"))
        return None, None
    if k_new is None or v_new is None:
        missing = "v_new" if v_new is None else "k_new"
        raise InvalidArgumentError(expected(missing, "a tensor (k_new and v_new go together)", None))
    want = (q.shape[0], geo.num_heads, geo.head_dim)
    out = []
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        t = check_tensor(name, t)
        if t.dtype not in MODEL_DTYPES or t.dtype != q.dtype:
            raise DTypeError(expected(name, f"dtype {q.dtype} (q's: the model's K/V as computed)", t.dtype))
        if tuple(t.shape) != want:
            raise ShapeError(expected(name, f"[num_q_tokens, num_kv_heads, head_dim] = {list(want)}",
                                      tuple(t.shape)))
        if t.device != device:
            raise DeviceError(expected(name, f"device {device} (the kv_layer's)", t.device))
        out.append(t)
    return out[0], out[1]


def check_pending_values(pending: list[int], q_indptr: list[int]) -> None:
    """Each sequence's pending rows are some of its queries' own: ``0 <= pending[b] <= n_b``."""
    if len(pending) != len(q_indptr) - 1:
        raise ShapeError(expected("pending", f"[{len(q_indptr) - 1}] (one count per sequence)", (len(pending),)))
    for b, p in enumerate(pending):
        nq = q_indptr[b + 1] - q_indptr[b]
        if not 0 <= p <= nq:
            raise InvalidArgumentError(expected(
                "pending", f"0 <= pending[{b}] <= {nq} (the sequence's queries: the pass's rows are its last "
                "tokens)", p))
