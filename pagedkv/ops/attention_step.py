"""Paged attention split as FlashInfer splits it: a plan per step, a run per layer.

:class:`AttentionStep` takes what every layer of a forward step shares once (the page
table, the query offsets, the logit options) and moves NumPy tables to the device
once; :meth:`AttentionStep.run` then takes only the layer: its view (a
:class:`~pagedkv.ops.views.KVLayerView` of K/V rows, or a
:class:`~pagedkv.ops.views.LatentView` of MLA latent rows) and the queries. The run
dispatches on the view's type, so a new attention type is a new view and a new branch
here, and a caller's step loop does not change.
"""
from __future__ import annotations

from typing import Any

import torch

from pagedkv import ops
from pagedkv.errors import InvalidArgumentError, expected
from pagedkv.ops.attention_reference import index_array
from pagedkv.ops.views import KVLayerView, LatentView

__all__ = ["AttentionStep"]


class AttentionStep:
    """One step's paged attention over any layer of one set of tables.

    Args:
        indptr: the CSR page table's row offsets (as :func:`pagedkv.ops.paged_attention`
            takes them: int32 tensors on ``device`` or NumPy integer arrays, converted
            here once); ``indices``, ``seq_lens`` and ``q_indptr`` likewise.
        indices: the table's block ids.
        seq_lens: each sequence's token count.
        q_indptr: the query offsets.
        device: where the layers' arenas live.
        sm_scale: the logit scale of every layer (MLA: required).
        soft_cap: the logit soft cap (MLA: leave unset).
        window: the sliding window (MLA: leave unset).
        sink_tokens: the sink positions (MLA: leave unset).
        num_splits: key splits per sequence (as the ops take it).
        backend: as the ops take it.
        pending: ints ``[B]``, each row's last positions a layer's ``k_new``/``v_new``
            cover (:func:`pagedkv.ops.paged_attention`), the same for every layer.
    """

    def __init__(self, indptr, indices, seq_lens, q_indptr, *, device, sm_scale: float | None = None,
                 soft_cap: float | None = None, window: int | None = None, sink_tokens: int = 0,
                 num_splits: int | None = None, backend: str = "auto", pending=None):
        device = torch.device(device)
        self.indptr = index_array("indptr", indptr, device)
        self.indices = index_array("indices", indices, device)
        self.seq_lens = index_array("seq_lens", seq_lens, device)
        self.q_indptr = index_array("q_indptr", q_indptr, device)
        self.options: dict[str, Any] = dict(sm_scale=sm_scale, soft_cap=soft_cap, window=window,
                                            sink_tokens=sink_tokens, num_splits=num_splits)
        self.backend = backend
        self.pending = pending      # each row's trailing positions the layers' k_new/v_new cover (checked by the op)

    def tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(indptr, indices, seq_lens, q_indptr)`` on the device."""
        return self.indptr, self.indices, self.seq_lens, self.q_indptr

    def run(self, q, view, *, out: torch.Tensor | None = None, **pass_rows: Any) -> torch.Tensor:
        """The attention of ``q`` over one layer: ``[Nq, Hq, D]`` queries for a
        :class:`KVLayerView`; ``(q_nope, q_pe)`` for a :class:`LatentView` (absorbed
        queries, see :func:`pagedkv.ops.mla_attention`). ``pass_rows``: ``k_new``, ``v_new``,
        ``pending`` as :func:`pagedkv.ops.paged_attention` takes them (K/V rows only)."""
        o = self.options
        if isinstance(view, LatentView):
            unset = [k for k in ("soft_cap", "window") if o[k] is not None] + (["sink_tokens"] if o["sink_tokens"]
                                                                                 else [])
            if unset:
                raise InvalidArgumentError(expected(unset[0], "unset for MLA latent rows", repr(o[unset[0]])))
            if not isinstance(q, tuple) or len(q) != 2:
                raise InvalidArgumentError(expected("q", "(q_nope, q_pe) for MLA latent rows", type(q).__name__))
            return ops.mla_attention(view, q[0], q[1], *self.tables(), sm_scale=o["sm_scale"],
                                 num_splits=o["num_splits"], out=out, backend=self.backend)
        if isinstance(view, KVLayerView):
            # looked up on the package at each run: the public op, as a caller (or a test's spy) sees it
            ip, ix, lens, qi = self.tables()
            return ops.paged_attention(q, view, ip, ix, lens, qi, out=out, backend=self.backend,
                                       k_new=pass_rows.get("k_new"), v_new=pass_rows.get("v_new"),
                                       pending=pass_rows.get("pending"), **o)
        raise InvalidArgumentError(expected("view", "a KVLayerView or a LatentView (a store's view(layer))",
                                            type(view).__name__))
