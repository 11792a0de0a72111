"""A transformers ``Cache`` whose keys and values live in a :class:`~pagedkv.manager.cache.PagedKVCache`.

Usage with ``generate``::

    kv = PagedKVCache(CacheConfig.from_hf_config(model.config, num_blocks=512, dtype=torch.float32))
    with PagedCache(kv) as cache:
        cache.admit(input_ids, attention_mask)          # optional: prefix hits, padding
        out = model.generate(input_ids, attention_mask=attention_mask, past_key_values=cache)

How it maps the batch onto the paged cache
------------------------------------------
Each batch row is one sequence of the ``PagedKVCache``. transformers works on a
rectangle of *columns*: a row with ``p`` left-padding columns holds its sequence's
token ``j`` in column ``p + j``. The cache keeps that picture: ``get_seq_length()`` is
the number of columns already cached, and :meth:`PagedCache.update` returns K/V
shaped ``[batch, kv_heads, columns, head_dim]``, with zeros in padding columns (the
attention mask hides them; zeros rather than garbage, because ``0 * NaN`` would leak
through the softmax).

Per forward pass, layer 0 plans the step once: one ``reserve`` for all rows gives the
slots of the new tokens (padding columns and tokens whose KV a prefix hit already
provides get slot ``-1``, which the store skips), and the CSR page table of every row
is taken for the gathers. Every layer then writes only its new K/V and gathers the
history from the blocks; the last layer commits the step. Nothing is concatenated:
the history is read from the paged arena, never re-copied into a growing tensor.

Prefix sharing: :meth:`PagedCache.admit` registers the prompts before ``generate``
runs. When the ``PagedKVCache`` already holds a prompt's leading full blocks (from an
earlier request with the same prefix and ``cache_salt``), ``get_seq_length()`` reports
them as cached and ``generate`` feeds only the remaining columns to the model.

Versions: tested with transformers 5.23.0 and 4.57.1. The 4.56/4.57 cache protocol
differs in signatures only (``update(k, v, layer_idx, cache_kwargs)``,
``get_mask_sizes(cache_position, layer_idx)``, ``get_max_cache_shape``, absolute
``crop``, no ``get_query_offset``); both spellings are accepted. Before 4.56 (no
``CacheLayerMixin``) the import fails with a clear error.
"""
from __future__ import annotations

import itertools
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from transformers.cache_utils import Cache

from pagedkv.config.support import require
from pagedkv.errors import ArgumentTypeError, InternalError, InvalidArgumentError, ShapeError, expected
from pagedkv.integrations import hf_attention, hf_windows
from pagedkv.integrations.hf_layers import PagedLayer, model_layers
from pagedkv.integrations.hf_state_calls import StateCalls
from pagedkv.integrations.hf_step import StepCalls, StepPlan
from pagedkv.manager.arguments import as_row_counts
from pagedkv.manager.cache import PagedKVCache

__all__ = ["PagedCache", "PagedLayer"]

_serial = itertools.count()


class PagedCache(StepCalls, StateCalls, Cache):
    """A transformers ``Cache`` backed by a :class:`PagedKVCache`.

    Args:
        kv: the paged cache. Several ``PagedCache`` objects may share one (e.g. one
            per ``generate`` call), which is what makes prefix sharing work.
        cache_salt: the prefix-cache namespace of the sequences this object admits.

    Rows are admitted by :meth:`admit` (prompt ids known: prefix hits, left padding),
    chosen by :meth:`select` (an engine's continuous batching), or created on the
    first forward pass (prompt ids unknown: no prefix reuse, no padding skipped).
    :meth:`release` (or leaving a ``with`` block) frees the sequences; their full
    blocks stay in the prefix cache. A ``PagedCache`` that is dropped without either
    (``generate(..., past_key_values=PagedCache(kv))``) frees them when it is
    garbage-collected: the sequences are queued with :meth:`PagedKVCache.free_deferred`
    and freed at ``kv``'s next call. A forward pass that fails gives back the slots it
    reserved, and the rows it created.
    """

    def __init__(self, kv: PagedKVCache, *, cache_salt: str | None = None, paged_attention: bool = False):
        if not isinstance(kv, PagedKVCache):
            raise InvalidArgumentError(expected("kv", "a PagedKVCache", type(kv).__name__))
        if kv.device is None:
            raise InvalidArgumentError(expected("kv", "a PagedKVCache with a KV store (allocate_store=True)",
                                                "a bookkeeping-only cache"))
        if kv.config.attention_sinks:
            raise InvalidArgumentError(expected("kv", "a PagedKVCache without attention sinks (transformers' "
                                                "sliding layers have none)", f"{kv.config.attention_sinks} sinks"))
        if paged_attention is not True and paged_attention is not False:
            raise InvalidArgumentError(expected("paged_attention", "True or False", repr(paged_attention)))
        self._latent = None     # MLA: (kv_lora_rank, qk_rope_head_dim) of the latent update(kv_nope, k_rot)
        if kv.config.kv_lora_rank is not None:
            if paged_attention:     # transformers' attention sees the expanded heads, not the latent
                require("paged attention (attention)", kv.config)
            self._latent = (kv.config.kv_lora_rank, kv.config.qk_rope_head_dim)
        self.kv = kv
        self.cache_salt = cache_salt
        # update() only writes; the "pagedkv" attention reads the pages (hf_attention)
        self.paged_attention = paged_attention
        self._ticket: hf_attention.Ticket | None = None
        self.num_layers = kv.config.num_layers
        self._windows = hf_windows.layer_windows(kv)     # None: every layer is full attention (per KV layer)
        windows = self._windows or [0] * self.num_layers
        self._states = None     # recurrent-state layers: the pass's working states (hf_states)
        if kv.config.state_spec is not None:
            from pagedkv.integrations import hf_states

            hf_states.state_names(kv.config.state_spec)
            self._states = hf_states.StatePass(kv, kv.config.layer_kinds, kv.config.torch_dtype)
            layers = model_layers(self, kv.config.layer_kinds, windows)
            self.num_layers = len(layers)
            super().__init__(layers=layers)
        else:
            super().__init__(layers=[PagedLayer(self, i, windows[i]) for i in range(self.num_layers)])
        self._owned: set = set()   # rows this object frees; the same set lives in the finalizer
        self._clear_rows()
        weakref.finalize(self, _free_on_collection, kv, self._owned)
        self.forward_tokens = 0   # new tokens written, all forwards (prefix hits excluded)

    # ---- rows ------------------------------------------------------------------
    def _clear_rows(self) -> None:
        self.seq_ids: list = []
        self._owned.clear()
        self._implicit = False  # rows created by the pass in progress (freed if it fails)
        self._pads = np.zeros(0, dtype=np.int64)
        self._columns = 0
        self._plan: StepPlan | None = None
        self._reserved: np.ndarray | None = None   # tokens this pass reserved, not yet committed
        self._input_ids: torch.Tensor | None = None
        self._fresh = False  # admitted, no forward pass yet
        self._holding = False   # recording the past: sliding groups keep blocks until crop
        if self._states is not None:
            self._states.clear()

    def _new_id(self):
        return ("pagedkv.hf", next(_serial))

    def admit(self, input_ids, attention_mask=None, *, seq_ids: Sequence[Any] | None = None,
              cache_salt: str | None = None, adapter_id: Any = None) -> np.ndarray:
        """Admit a batch of left-padded prompts ``[B, T]``; returns the cached tokens per row.

        Call it before ``generate`` with the same ``input_ids``/``attention_mask``.
        The cached (prefix-hit) tokens are skipped by ``generate`` where every row has
        them; a row's hit tokens beyond that common point are recomputed by the model
        but not written again.
        """
        self._sync()
        if self.seq_ids:
            raise InvalidArgumentError(expected("admit", "a PagedCache without rows (call release() first)",
                                                f"{len(self.seq_ids)} rows"))
        ids = torch.as_tensor(input_ids)
        if ids.ndim == 1:
            ids = ids[None]
        if ids.ndim != 2:
            raise ShapeError(expected("input_ids", "a [batch, tokens] tensor", tuple(ids.shape)))
        mask = torch.ones_like(ids) if attention_mask is None else torch.as_tensor(attention_mask)
        if tuple(mask.shape) != tuple(ids.shape):
            raise ShapeError(expected("attention_mask", f"shape {tuple(ids.shape)}", tuple(mask.shape)))
        mask = mask.to("cpu", torch.bool)
        pads = (~mask).long().cumprod(dim=1).sum(dim=1)  # leading padding columns
        real = mask.sum(dim=1)
        for b in range(ids.shape[0]):
            if int(pads[b]) + int(real[b]) != ids.shape[1]:
                raise InvalidArgumentError(expected("attention_mask", "left padding (every row: zeros, then ones)",
                                                    f"row {b}: {mask[b].int().tolist()}"))
            if int(real[b]) == 0:
                raise InvalidArgumentError(expected("attention_mask", "at least one real token per row",
                                                    f"row {b} empty"))
        if seq_ids is None:
            seq_ids = [self._new_id() for _ in range(ids.shape[0])]
        elif len(seq_ids) != ids.shape[0]:
            raise ShapeError(expected("seq_ids", f"{ids.shape[0]} ids (one per row)", len(seq_ids)))
        salt = self.cache_salt if cache_salt is None else cache_salt
        hits = np.zeros(ids.shape[0], dtype=np.int64)
        caps = [None] * ids.shape[0]
        if self._states is not None:       # every row resumes at one column, where its state is kept
            caps = self._state_caps(ids, pads.numpy().astype(np.int64), salt, adapter_id).tolist()
        elif self._windows is not None and any(self._windows):
            caps = self._sliding_caps(ids, pads.numpy().astype(np.int64), salt, adapter_id).tolist()
        added = []
        try:
            for b, sid in enumerate(seq_ids):
                tokens = ids[b, int(pads[b]):].to("cpu")
                hits[b] = self.kv.add_sequence(sid, tokens, cache_salt=salt, adapter_id=adapter_id,
                                               max_cached_tokens=caps[b])
                if self._states is not None and hits[b] != caps[b]:
                    raise InternalError(f"row {b} reused {hits[b]} tokens where its state resumes at {caps[b]} (a bug)")
                added.append(sid)
        except BaseException:
            if added:
                self.kv.free(added)  # all or nothing
            raise
        self.seq_ids = list(seq_ids)
        self._owned.update(self.seq_ids)
        self._pads = pads.numpy().astype(np.int64)
        # Skip the columns that are cached (or padding) in every row.
        self._columns = int((self._pads + hits).min())
        self._fresh = True
        return hits

    def _sliding_caps(self, ids, pads: np.ndarray, salt, adapter_id) -> np.ndarray:
        """Per row, the prefix-hit tokens a sliding-window cache lets it reuse
        (see :func:`hf_windows.admit_caps`)."""
        bs = self.kv.config.block_size
        hits = np.zeros(ids.shape[0], dtype=np.int64)
        for b in range(ids.shape[0]):
            tokens = ids[b, int(pads[b]):].to("cpu")
            whole = (len(tokens) - 1) // bs * bs
            hits[b] = min(self.kv.match_prefix(tokens, cache_salt=salt, adapter_id=adapter_id), whole)
        window = min(w for w in self._windows or () if w)
        return hf_windows.admit_caps(hits, pads, bs, window)

    def select(self, seq_ids: Sequence[Any], num_new_tokens: int | Sequence[int] = 1):
        """Make the next forward pass run over ``seq_ids`` (live sequences of ``kv``).

        For an engine that batches its own running sequences (continuous batching):
        rows are right-aligned on their committed plus new tokens. ``num_new_tokens``
        is one count for every row, or one per row (a batched prefill of prompts of
        different lengths). The forward then takes ``q = max(num_new_tokens)`` columns
        per row: row ``b``'s last ``num_new_tokens[b]`` are its new tokens, and the
        columns before them are its last committed tokens (or padding where it has
        fewer): their K/V is not written and their outputs are not meaningful. Returns
        ``(attention_mask, position_ids)`` for that forward (a padding column gets
        position 0). The sequences stay owned by the caller.
        """
        self._sync()
        if self._plan is not None:
            raise InvalidArgumentError(expected("select", "no forward pass in progress", "a pending step"))
        if self._owned:  # they would be orphaned: nothing would free them
            raise InvalidArgumentError(expected("select", "a PagedCache without admitted rows (call release() first)",
                                                f"{len(self._owned)} admitted rows"))
        # "ab" is not two ids, and a set or a dict has no row order
        if isinstance(seq_ids, (str, bytes, Mapping, set, frozenset)) or not hasattr(seq_ids, "__iter__"):
            raise ArgumentTypeError(expected("seq_ids", "a sequence of sequence ids", type(seq_ids).__name__))
        seq_ids = list(seq_ids)
        if not seq_ids:
            raise InvalidArgumentError(expected("seq_ids", "at least one sequence", "none"))
        # Checked whole before anything is sized from it: a step takes at most what the
        # cache's blocks can hold (10**9 would build a [B, 10**9] mask first).
        most = self.kv.config.resolved_num_blocks * self.kv.config.block_size
        new = as_row_counts(num_new_tokens, len(seq_ids), "num_new_tokens", 1, most)
        n = self.kv.seq_lens(seq_ids, computed=True).astype(np.int64)     # live and distinct, or typed
        reserved = self.kv.seq_lens(seq_ids).astype(np.int64)
        if (n != reserved).any():
            raise InvalidArgumentError(expected("seq_ids", "sequences with no reserved, uncommitted tokens",
                                                f"{int((reserved - n).sum())} pending"))
        q = int(new.max())
        width = int((n + new).max())
        self.seq_ids = seq_ids
        self._owned.clear()
        self._pads = width - n - new
        self._columns = width - q
        cols = torch.arange(width)
        pads = torch.from_numpy(self._pads)
        attention_mask = (cols[None, :] >= pads[:, None]).long()
        position_ids = (torch.from_numpy(n + new - q)[:, None] + torch.arange(q)[None, :]).clamp_(min=0)
        return attention_mask, position_ids

    def set_input_ids(self, input_ids) -> None:
        """Token ids ``[B, q]`` of the next forward pass, so that the committed tokens
        are known and their full blocks become reusable prefixes. Optional."""
        self._input_ids = torch.as_tensor(input_ids)

    def release(self) -> None:
        """Free the sequences this object admitted (their full blocks stay cached), and
        give back what a forward pass that stopped early had reserved in the others."""
        self._sync()
        self._abort_step()
        owned = [s for s in self.seq_ids if s in self._owned]
        self._clear_rows()
        if owned:
            self.kv.free(owned)

    def _abort_step(self) -> None:
        """Undo the forward pass in progress: its reserved slots go back, and rows it
        created itself are freed."""
        reserved, self._reserved = self._reserved, None
        self._plan = self._input_ids = self._ticket = None
        if self._states is not None:
            self._states.clear()
        if reserved is not None and reserved.any():
            self.kv.unreserve(self.seq_ids, reserved)
        if self._implicit:
            owned = list(self.seq_ids)
            self._clear_rows()
            self.kv.free(owned)

    def activate_past_recording(self) -> None:
        """Keep what sliding-window layers would drop until the next :meth:`crop`, so a
        rejected speculative step can be rolled back (transformers calls this for
        assisted generation). A no-op without sliding layers."""
        self._sync()
        if not self._windows:
            return
        self._holding = True
        if self.seq_ids:
            self.kv.hold_window(self.seq_ids, True)

    def _stop_holding(self) -> None:
        if self._holding:
            self._holding = False
            if self.seq_ids:
                self.kv.hold_window(self.seq_ids, False)

    def _slide(self) -> None:
        if self._holding and self.seq_ids:
            self.kv.slide_window(self.seq_ids)

    def __enter__(self) -> PagedCache:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    # ---- the transformers Cache protocol ------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        self._sync()
        return self._columns

    def get_query_offset(self, layer_idx: int = 0) -> int:
        self._sync()
        return self._columns

    def get_mask_sizes(self, query_length, layer_idx: int = 0) -> tuple:
        # 5.x passes the query length; 4.56/4.57 pass cache_position.
        self._sync()
        q = query_length.shape[0] if isinstance(query_length, torch.Tensor) else int(query_length)
        if self._states is not None:        # the mask of a K/V layer (a state layer has none: full sizes)
            kl = self._states.kv_of.get(layer_idx)
            window = self._windows[kl] if self._windows is not None and kl is not None else 0
        else:
            window = self._windows[layer_idx] if self._windows is not None else 0
        if window:
            return hf_windows.sliding_mask_sizes(self._columns, q, window)
        return self._columns + q, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1

    @property
    def is_compileable(self) -> bool:
        return False

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Write this pass's K/V ``[B, H, q, D]`` of ``layer_idx``; return ``[B, H, columns, D]``.

        If it raises, the pass is undone (see :meth:`_abort_step`): nothing is left
        reserved, and no row is left behind."""
        try:
            return self._update(key_states, value_states, layer_idx)
        except BaseException as e:
            try:
                self._abort_step()
            except Exception as undo:   # keep the original error; say the rollback failed too
                e.add_note(f"pagedkv: undoing the failed forward pass also failed: {undo!r}")  # type: ignore[attr-defined]  # Python 3.11+; 3.10 has no notes
            raise

    def _update(self, key_states, value_states, layer_idx: int):
        if not 0 <= layer_idx < self.num_layers:
            raise InvalidArgumentError(expected("layer_idx", f"an int in [0, {self.num_layers})", layer_idx))
        model_layer = layer_idx
        if self._states is not None:    # K/V layer l of the store is the l-th layer with attention
            layer_idx = self._states.kv_layer(model_layer)
            self._note(model_layer, "kv", "update")
            if self._plan is None:
                self._plan_step(key_states.shape[0], key_states.shape[2])
        elif layer_idx == 0:
            self._plan_step(key_states.shape[0], key_states.shape[2])
        plan = self._plan
        if plan is None:
            raise InvalidArgumentError(expected("layer_idx", "0 first in every forward pass", layer_idx))
        B, H, q, D = key_states.shape
        if q != plan.q or B != len(self.seq_ids):
            raise ShapeError(expected("key_states", f"[{len(self.seq_ids)}, H, {plan.q}, D] as at layer 0",
                                      tuple(key_states.shape)))
        Dv = value_states.shape[-1]     # an MLA latent: kv_nope (D = kv_lora_rank) and k_rot (qk_rope_head_dim)
        if self._latent is not None:
            self._check_latent(key_states, value_states)
        # Read before writing: the new tokens' rows are overwritten below by their K/V
        # as computed, and a recent window still holds the tokens just before the pass.
        columns = plan.columns
        if self.paged_attention:
            return self._write_only(key_states, value_states, layer_idx, plan, model_layer)
        groups = self.kv.config.layer_groups
        if plan.groups is not None and groups is not None:   # layer groups: this layer's group's tables
            step = plan.groups[groups.layer_group[layer_idx]]
            k, v = self.kv.gather_pages(layer_idx, step.indptr, step.indices, step.lens, pending=plan.n_new)
            keys, values = hf_windows.assemble(step, k, v, B, H, D)
            columns = step.columns
        else:
            k, v = self.kv.gather_pages(layer_idx, plan.indptr, plan.indices, plan.lens, pending=plan.n_new)
            if plan.dest is None:  # no padding: the packed rows are the rectangle
                keys = k.view(B, columns, H, D)
                values = v.view(B, columns, H, Dv)
            else:
                keys = k.new_zeros(B * columns, H, D).index_copy_(0, plan.dest, k.view(-1, H, D)).view(B, columns, H, D)
                values = v.new_zeros(B * columns, H, Dv).index_copy_(0, plan.dest, v.view(-1, H, Dv)).view(
                    B, columns, H, Dv)
        # The pass's own tokens attend to their K/V as computed, as in serving engines
        # (prefill attention runs on the in-flight K/V) and HF's QuantizedCache; earlier
        # tokens are read back from the arena (for a lossy store: dequantized). A
        # lossless store reads back the same values, so this changes nothing there.
        new = torch.from_numpy(plan.new_mask).to(keys.device)
        keys[:, columns - q:][new] = key_states.transpose(1, 2)[new].to(keys.dtype)
        values[:, columns - q:][new] = value_states.transpose(1, 2)[new].to(values.dtype)
        # [B, H, q, D] -> [B*q, H, D]: one small copy of the new tokens only.
        self.kv.write(layer_idx, plan.write_slots, key_states.transpose(1, 2).reshape(B * q, H, D),
                      value_states.transpose(1, 2).reshape(B * q, H, Dv))
        self.layers[model_layer].is_initialized = True   # always our PagedLayer
        if self._states is None and layer_idx == self.num_layers - 1:
            self._finish_step()
        return keys.transpose(1, 2), values.transpose(1, 2)

    def _check_latent(self, kv_nope, k_rot) -> None:
        """An MLA layer's update: one latent "head" of ``kv_lora_rank``, then of
        ``qk_rope_head_dim`` (a model that caches expanded heads is refused here, typed)."""
        r, p = self._latent   # type: ignore[misc]  # set for an MLA cache
        B, _, q, _ = kv_nope.shape
        if tuple(kv_nope.shape) != (B, 1, q, r):
            raise ShapeError(expected("key_states", f"the latent kv_nope [batch, 1, tokens, {r}] of an MLA model",
                                      tuple(kv_nope.shape)))
        if tuple(k_rot.shape) != (B, 1, q, p):
            raise ShapeError(expected("value_states", f"the latent k_rot [batch, 1, tokens, {p}] of an MLA model",
                                      tuple(k_rot.shape)))

    # ---- batch reshaping (beam search, num_return_sequences) ------------------------
    def _replace_rows(self, order: Sequence[int]) -> None:
        """Rows become ``[old_row[i] for i in order]``; duplicates are forks (shared blocks)."""
        if self._plan is not None:
            raise InvalidArgumentError(expected("reorder", "no forward pass in progress", "a pending step"))
        old = self.seq_ids
        new_ids = []
        try:
            for i in order:
                sid = self._new_id()
                self.kv.fork(old[i], sid)
                new_ids.append(sid)
        except BaseException:
            if new_ids:
                self.kv.free(new_ids)
            raise
        owned = [s for s in old if s in self._owned]
        if owned:
            self.kv.free(owned)
        self._pads = self._pads[np.asarray(order, dtype=np.int64)]
        self.seq_ids = new_ids
        self._owned.clear()
        self._owned.update(new_ids)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._sync()
        if self.seq_ids:
            self._replace_rows([i for i in range(len(self.seq_ids)) for _ in range(repeats)])

    def batch_select_indices(self, indices) -> None:
        self._sync()
        if self.seq_ids:
            self._replace_rows([int(i) for i in torch.as_tensor(indices).reshape(-1).tolist()])

    def reorder_cache(self, beam_idx) -> None:
        self._sync()
        if self.seq_ids:
            self._replace_rows([int(i) for i in torch.as_tensor(beam_idx).reshape(-1).tolist()])

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last columns (5.x: ``-n`` drops n; 4.x: ``n > 0`` keeps n; 0 is a
        no-op in both, which 5.x's assisted generation relies on), e.g. the
        draft tokens an assisted-generation step rejected. Every row loses the same
        columns; blocks left empty go back to the pool, shared ones are never altered
        (see :meth:`PagedKVCache.truncate`). While the past is recorded
        (:meth:`activate_past_recording`), every crop, ``0`` included, then releases what
        left the sliding windows, as ``DynamicSlidingWindowLayer.crop`` does."""
        self._sync()
        if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, (int, np.integer)):
            raise InvalidArgumentError(expected("tokens_to_remove", "an int", repr(tokens_to_remove)))
        if self._plan is not None:
            raise InvalidArgumentError(expected("crop", "no forward pass in progress", "a pending step"))
        n = int(tokens_to_remove)
        if n and self._states is not None:
            raise InvalidArgumentError(expected(
                "crop", "PagedCache.rewind with recurrent-state layers (a state resumes only where one is kept; "
                "rewind says which columns to compute again)", f"crop({n})"))
        if n == 0:
            self._slide()     # like DynamicSlidingWindowLayer.crop(0): drop what left the window
            return
        target = n if n > 0 else max(self._columns + n, 0)
        if target >= self._columns or not self.seq_ids:
            self._slide()
            return
        have = self.kv.seq_lens(self.seq_ids, computed=True).astype(np.int64)
        keep = np.maximum(target - self._pads, 0)
        self.kv.truncate(self.seq_ids, np.maximum(have - keep, 0))
        self._pads = np.minimum(self._pads, target)
        self._columns = target
        self._slide()

    def reset(self) -> None:
        self.release()

    @property
    def is_croppable(self) -> bool:
        # a recurrent state cannot stop at any token: assisted generation (which crops after
        # its verify pass and never computes the kept tokens again) is refused up front, as
        # with transformers' own cache; PagedCache.rewind is the rollback that replays
        return self._states is None

    def __repr__(self) -> str:
        return f"PagedCache(rows={len(self.seq_ids)}, columns={self._columns}, kv={self.kv!r})"


def _free_on_collection(kv: PagedKVCache, owned: set) -> None:
    """Finalizer of a :class:`PagedCache` (it must not refer to the object): queue its
    rows for freeing. A garbage-collector pass can run inside another call of ``kv``,
    so this frees nothing itself (see :meth:`PagedKVCache.free_deferred`)."""
    if owned:
        kv.free_deferred(list(owned))
        owned.clear()
