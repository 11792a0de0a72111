"""The data calls of :class:`~pagedkv.manager.cache.PagedKVCache`: writes, gathers,
attention and block copies (the work is :class:`~pagedkv.manager.data.DataPath`'s).

A mixin of the facade, so that the class stays one API while each file stays one
concept: the sequences' bookkeeping there, the bytes here.
"""
from __future__ import annotations

from typing import Any

from pagedkv.manager.arguments import check_attention_call

__all__ = ["KVDataCalls"]

SeqId = Any


class KVDataCalls:
    """The KV data calls of a :class:`~pagedkv.manager.cache.PagedKVCache` (see there)."""

    _data: Any
    store: Any
    config: Any

    def _require_store(self):
        return self._data.require_store()

    @property
    def device(self):
        """The ``torch.device`` of the KV arena (None for a bookkeeping-only cache)."""
        return None if self.store is None else self.store.device

    def write(self, layer: int, slot_mapping, key, value) -> None:
        """Store new K/V ``[num_tokens, num_kv_heads, head_dim]`` at ``slot_mapping``
        (from :meth:`reserve`; negative slots are skipped). An MLA cache stores one
        latent row per token: ``key`` is ``c_kv`` ``[num_tokens, kv_lora_rank]`` and
        ``value`` is ``k_pe`` ``[num_tokens, qk_rope_head_dim]`` (a unit head dim,
        ``[num_tokens, 1, ...]`` as transformers holds them, is accepted too), and the
        gathers return them the same way."""
        self._data.write(layer, slot_mapping, key, value)

    def gather(self, seq_id: SeqId, layer: int, num_tokens: int | None = None):
        """Contiguous K and V ``[n, num_kv_heads, head_dim]`` in token order: the first
        ``num_tokens`` tokens, by default every token holding a slot (committed plus
        reserved this step)."""
        k, v, _ = self.gather_batch([seq_id], layer, None if num_tokens is None else [num_tokens])
        return k, v

    def gather_batch(self, seq_ids, layer: int, num_tokens=None):
        """K, V ``[sum(lens), H, D]`` of many sequences, and ``cu_seqlens`` (int64 ``[B+1]``).

        ``num_tokens`` (optional, one per sequence) gathers only each sequence's first
        tokens; by default all reserved tokens. A sliding-window layer returns the
        tokens its group holds (sinks, then the window; :meth:`gather_window` adds
        their positions)."""
        return self._data.gather(seq_ids, layer, num_tokens, False)

    def gather_window(self, seq_ids, layer: int, num_tokens=None):
        """:meth:`gather_batch` plus the int64 absolute position of every gathered token
        (concatenated per sequence): all of them for a full-attention layer; for a
        sliding one the sinks, then the window."""
        return self._data.gather(seq_ids, layer, num_tokens, True)

    def gather_pages(self, layer: int, indptr, indices, seq_lens, *, pending=None, rotated=False):
        """K, V ``[sum(seq_lens), H, D]`` of ``layer`` read through a CSR page table
        (``indptr``, ``indices``: int32 tensors on :attr:`device`, or the NumPy arrays
        :meth:`page_table_csr` returns; ``seq_lens``: int32 tokens per row, a tensor or
        a NumPy integer array such as :meth:`seq_lens` returns). NumPy integer arrays are
        moved to :attr:`device` as int32; values outside int32 are refused.

        For a caller that plans a step once and gathers every layer with the same table
        (no bookkeeping lookup per layer). The table must come from this cache and be
        current: the store checks shapes, dtypes and block ranges, not ownership. With
        layer groups the table must be the layer's group's (``page_table_csr(ids,
        group=...)``).

        ``pending``: for a caller that reads before it writes the pass's own tokens
        (it attends to their K/V as computed): ints ``[B]``, each row's trailing tokens
        not written yet. Their rows hold stale bytes for the caller to overwrite, and
        ``kv_window`` then keeps the ``kv_window`` tokens *before* them in model
        precision, so every query of the pass sees at least that many exact tokens.

        ``rotated=True`` (a cache with ``kv_rotation``): K/V in the rotated domain, as
        stored, without the per-row unrotation, which costs more than the dequantization.
        The rotation is orthonormal, so an attention that rotates its queries
        (``pagedkv.format.rotation.rotate(q, cache.rotation_signs)``) gets the same scores, and
        its output is unrotated once per query (``unrotate(out, signs)``) instead of once
        per cached token."""
        return self._data.gather_pages(layer, indptr, indices, seq_lens, pending=pending, rotated=rotated)

    def attention(self, layer: int, q, indptr, indices, seq_lens, q_indptr, **options):
        """:func:`pagedkv.ops.paged_attention` of ``q`` over ``layer``'s pages, reading
        exactly what :meth:`gather_pages` (no ``pending``) reads: the quantized rows in
        place, the window and sink rows in model precision from the window arena, the
        rotation folded into ``q`` and the output. The table is as for :meth:`gather_pages`
        (with layer groups, the layer's group's). ``options``: the op's keywords
        (``sm_scale``, ``soft_cap``, ``window``, ``sink_tokens``, ``num_splits``, ``out``,
        ``backend``; :func:`~.arguments.check_attention_call`)."""
        check_attention_call(options, q, self.config.torch_dtype)
        return self._data.attention(layer, q, indptr, indices, seq_lens, q_indptr, **options)

    def plan_attention(self, indptr, indices, seq_lens, q_indptr, **options):
        """Plan one forward step's paged attention, then run it per layer
        (FlashInfer's ``plan()``/``run()``): the page table (as for :meth:`gather_pages`;
        NumPy tables are moved to :attr:`device` here, once) and ``q_indptr`` with the
        step's options (``sm_scale``, ``soft_cap``, ``window``, ``sink_tokens``,
        ``num_splits``, ``backend``). ``plan_attention(...).run(layer, q)`` is
        :meth:`attention` of that layer (``q``: ``(q_nope, q_pe)`` for an MLA cache, as
        :meth:`mla_attention` takes them). With layer groups, one plan per group's table."""
        return self._data.plan_attention(indptr, indices, seq_lens, q_indptr, **options)

    def mla_attention(self, layer: int, q_nope, q_pe, indptr, indices, seq_lens, q_indptr, *, sm_scale: float,
                      num_splits: int | None = None, out=None):
        """An MLA cache's attention (:func:`pagedkv.ops.mla_attention`): the absorbed
        queries ``q_nope`` ``[Nq, Hq, kv_lora_rank]`` (each head's query times its
        ``W_UK``) and ``q_pe`` ``[Nq, Hq, qk_rope_head_dim]`` over ``layer``'s latent rows,
        read in place through the page table (as for :meth:`gather_pages`; NumPy tables
        are moved to :attr:`device`). Returns ``[Nq, Hq, kv_lora_rank]`` (multiply by
        ``W_UV`` per head for the value output)."""
        return self._data.mla_attention(layer, q_nope, q_pe, indptr, indices, seq_lens, q_indptr, sm_scale=sm_scale,
                                        num_splits=num_splits, out=out)

    @property
    def rotation_signs(self):
        """The float32 ``[head_dim]`` signs of the cache's rotation (a copy), or None
        without ``kv_rotation``: what :func:`pagedkv.format.rotation.rotate` takes."""
        return self._data.rotation_signs()

    def copy_blocks(self, pairs) -> None:
        """Copy (src, dst) block pairs ``[P, 2]`` across all layers."""
        self._data.copy_blocks(pairs)

