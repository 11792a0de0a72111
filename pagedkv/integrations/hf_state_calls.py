"""The recurrent-state side of a :class:`~pagedkv.integrations.transformers.PagedCache`:
the calls transformers' Mamba, Mamba2, Gated DeltaNet and short-convolution layers make
(``get_conv_state``, ``update_conv_state``, ``update_recurrent_state``, ...), the
prefix-hit column every row resumes at, chunked prefill at checkpoints and rewind.
The pass's working states live in :class:`pagedkv.integrations.hf_states.StatePass`.
"""
from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pagedkv.errors import InvalidArgumentError, ShapeError, expected

if TYPE_CHECKING:
    from pagedkv.integrations.hf_states import StatePass

__all__ = ["StateCalls"]


class StateCalls:
    """Mixed into PagedCache (whose rows, plan and columns these methods share)."""

    kv: Any
    seq_ids: list
    layers: list
    _states: StatePass | None
    _plan: Any
    _pads: np.ndarray
    _columns: int
    _fresh: bool

    if TYPE_CHECKING:     # PagedCache's own
        def _abort_step(self) -> None: ...
        def _plan_step(self, B: int, q: int) -> None: ...
        def _finish_step(self) -> None: ...
        def _slide(self) -> None: ...

    def _live_states(self) -> StatePass:
        if self._states is None:
            raise InvalidArgumentError(expected("PagedCache", "a cache with recurrent-state layers",
                                                "a cache without them"))
        return self._states

    def _state_caps(self, ids, pads: np.ndarray, salt, adapter_id) -> np.ndarray:
        """Per row, the prefix-hit tokens a cache with recurrent-state layers lets it reuse:
        a recurrent state resumes only where a snapshot was taken, and the model runs every
        row from one column on, so each row's hit must end at that column (or the row has
        not begun there). The column is lowered until every row has a snapshot there."""
        bs = self.kv.config.block_size
        rows = [ids[b, int(pads[b]):].to("cpu") for b in range(ids.shape[0])]

        def hit(t, top: int) -> int:     # the agreed hit (KV and state) at most top tokens
            return min(self.kv.match_prefix(t[:top + 1], cache_salt=salt, adapter_id=adapter_id), top // bs * bs)

        col = int(min(int(pads[b]) + hit(t, len(t) - 1) for b, t in enumerate(rows)))
        while True:
            low = col
            for b, t in enumerate(rows):
                target = col - int(pads[b])
                if target > 0:
                    h = hit(t, target)
                    if h != target:
                        low = min(low, int(pads[b]) + h)
            if low == col:
                return np.maximum(col - pads, 0)
            col = low

    def prefill(self, model, input_ids, attention_mask=None, **forward_kwargs) -> int:
        """Run the admitted prompts through ``model`` up to their last block boundary, in
        chunks that end where a recurrent state is due to be kept (every
        ``state_checkpoint_every`` blocks, a shared prefix's junction, and the last block
        boundary before each prompt's end), so that a later prompt sharing any of those
        prefixes resumes from there. Call it after :meth:`admit`, with the same
        ``input_ids`` / ``attention_mask``; ``generate`` then computes the rest. Returns
        the columns now cached. A cache without state layers needs none of this (its
        blocks are kept whatever the chunks)."""
        self._sync()
        if not self.seq_ids or not self._fresh and self._plan is not None:
            raise InvalidArgumentError(expected("prefill", "admitted rows (admit() first)", "none"))
        ids = torch.as_tensor(input_ids)
        ids = ids[None] if ids.ndim == 1 else ids
        if ids.ndim != 2 or ids.shape[0] != len(self.seq_ids):
            raise ShapeError(expected("input_ids", f"[{len(self.seq_ids)}, tokens] (the admitted rows)",
                                      tuple(ids.shape)))
        mask = torch.ones_like(ids) if attention_mask is None else torch.as_tensor(attention_mask)
        if tuple(mask.shape) != tuple(ids.shape):
            raise ShapeError(expected("attention_mask", f"shape {tuple(ids.shape)}", tuple(mask.shape)))
        if self._states is None:
            return self._columns
        params = inspect.signature(model.forward).parameters
        positions = "position_ids" in params
        # transformers 5.2x names a pure state model's cache argument ``cache``
        cache_arg = "cache" if "cache" in params and "past_key_values" not in params else "past_key_values"
        bs, T = self.kv.config.block_size, ids.shape[1]
        while True:
            ends = []
            for b, sid in enumerate(self.seq_ids):
                pad = int(self._pads[b])
                last = (T - pad - 1) // bs * bs       # the last boundary before the prompt's last token
                done = self._columns - pad
                for t in (self.kv.next_checkpoint(sid), last):
                    if done < t <= last:
                        ends.append(pad + t)
            if not ends:
                return self._columns
            start, end = self._columns, min(ends)
            # a model without attention masks the chunk's own columns (Mamba's padding mask)
            chunk_mask = mask[:, start:end] if self.kv.config.num_layers == 0 else mask[:, :end]
            kwargs = dict(input_ids=ids[:, start:end].to(model.device), attention_mask=chunk_mask.to(model.device),
                          use_cache=True)
            kwargs[cache_arg] = self
            if positions:
                pos = (mask[:, :end].long().cumsum(-1) - 1).clamp(min=0)
                kwargs["position_ids"] = pos[:, start:end].to(model.device)
            with torch.no_grad():
                model(**kwargs, **forward_kwargs)
            self._sync()
            if self._columns != end:
                raise InvalidArgumentError(expected("model", f"a model that runs columns {start}:{end} through this "
                                                    "cache", f"{self._columns} columns cached after the pass"))

    # ---- recurrent-state layers (see hf_states) -------------------------------------------------
    def _guard(self, fn, *args):
        """Run a state call; if it raises, the pass is undone, as for :meth:`update`."""
        try:
            return fn(*args)
        except BaseException as e:
            try:
                self._abort_step()
            except Exception as undo:
                e.add_note(f"pagedkv: undoing the failed forward pass also failed: {undo!r}")  # type: ignore[attr-defined]  # Python 3.11+
            raise

    def _note(self, layer: int, part: str, kind: str) -> None:
        st = self._live_states()
        if st.note(layer, part, kind):         # a call this pass made already: the next pass began
            if not st.complete:
                raise InvalidArgumentError(expected(
                    "forward", "the previous forward pass to reach every layer",
                    "a pass that stopped early (its reserved slots are given back)"))
            self._end_pass()
            st.note(layer, part, kind)

    def _sync(self) -> None:
        """End the pass in progress if every layer made its calls (an outside call: the
        model's forward is over), writing the states and committing its tokens."""
        st = self._states
        if st is not None and st.started and st.complete:
            self._end_pass()

    def _end_pass(self) -> None:
        if self._plan is None:          # a decode step that only updated states in place: one token
            if not self.seq_ids:
                self._live_states().clear()
                return
            self._plan_step(len(self.seq_ids), 1)
        self._finish_step()
        self._live_states().clear()

    def _state_idx(self, state_idx) -> None:
        if state_idx not in (0, None):
            raise InvalidArgumentError(expected("state_idx", "0 (one conv and one recurrent state per layer)",
                                                repr(state_idx)))

    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        """The rows' conv states of ``layer_idx`` ``[B, C, K]``, or None without a previous
        state (the model then takes its prefill path)."""
        return self._guard(self._get_state, layer_idx, state_idx, "get_conv", "conv")

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0):
        """The rows' recurrent (SSM / delta-rule) states of ``layer_idx``, or None."""
        return self._guard(self._get_state, layer_idx, state_idx, "get_rec", "ssm")

    def _get_state(self, layer_idx, state_idx, kind: str, name: str):
        self._state_idx(state_idx)
        if self._states is None:
            raise InvalidArgumentError(expected("layer_idx", "a recurrent-state layer", f"{layer_idx} of a cache "
                                                "without state layers"))
        self._states.state_layer(layer_idx)
        self._note(layer_idx, "state", kind)
        return self._states.states(layer_idx, self.seq_ids).get(name)

    def update_conv_state(self, conv_states, layer_idx: int, state_idx: int = 0, **kwargs):
        """A chunk's convolution input ``[B, C, q]``; returns it after the cached left
        context (what the causal convolution reads)."""
        return self._guard(self._update_conv, conv_states, layer_idx, state_idx, kwargs.get("conv_kernel_size"))

    def _update_conv(self, conv_states, layer_idx, state_idx, kernel):
        self._state_idx(state_idx)
        if self._states is None:
            raise InvalidArgumentError(expected("layer_idx", "a recurrent-state layer", f"{layer_idx} of a cache "
                                                "without state layers"))
        self._states.state_layer(layer_idx)
        self._note(layer_idx, "state", "upd_conv")
        if conv_states.ndim != 3:
            raise ShapeError(expected("conv_states", "[batch, channels, tokens]", tuple(conv_states.shape)))
        if self._plan is None:
            self._plan_step(conv_states.shape[0], conv_states.shape[2])
        if conv_states.shape[0] != len(self.seq_ids):
            raise ShapeError(expected("conv_states", f"batch {len(self.seq_ids)} (the cache's rows)",
                                      tuple(conv_states.shape)))
        return self._states.update_conv(layer_idx, self.seq_ids, conv_states, kernel)

    def update_recurrent_state(self, recurrent_states, layer_idx: int, state_idx: int = 0, **kwargs):
        """The layer's recurrent state after the pass; returns the cache's copy."""
        return self._guard(self._update_recurrent, recurrent_states, layer_idx, state_idx)

    def _update_recurrent(self, recurrent_states, layer_idx, state_idx):
        self._state_idx(state_idx)
        if self._states is None:
            raise InvalidArgumentError(expected("layer_idx", "a recurrent-state layer", f"{layer_idx} of a cache "
                                                "without state layers"))
        self._states.state_layer(layer_idx)
        self._note(layer_idx, "state", "upd_rec")
        if self.seq_ids and recurrent_states.shape[0] != len(self.seq_ids):
            raise ShapeError(expected("recurrent_states", f"batch {len(self.seq_ids)} (the cache's rows)",
                                      tuple(recurrent_states.shape)))
        return self._states.update_recurrent(layer_idx, self.seq_ids, recurrent_states)

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        """Whether the rows' recurrent states hold tokens (a previous pass or a prefix hit)."""
        if self._states is None or not self.seq_ids:
            return False
        return self._states.has_prev(self.seq_ids)

    @property
    def is_linear(self) -> list[bool]:
        # Every layer reports the cached columns (get_seq_length), so generate feeds only
        # the columns not cached, a pure state model's included (a prefix hit skips them).
        return [False] * len(self.layers)

    def rewind(self, tokens_to_remove: int) -> int:
        """Roll every row back ``tokens_to_remove`` columns (e.g. rejected draft tokens),
        with recurrent-state layers: a state resumes only where one is kept (a restore
        point while recording the past, :meth:`activate_past_recording`, or a snapshot),
        so the rows go back to the newest such column at or before the target, all to the
        same one. Returns the columns the caller must compute again (feed the tokens from
        ``get_seq_length()`` on): 0 when the rows resumed exactly where asked."""
        self._sync()
        if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, (int, np.integer)) or \
                not 0 <= tokens_to_remove <= self._columns:
            raise InvalidArgumentError(expected("tokens_to_remove", f"an int in [0, {self._columns}]",
                                                repr(tokens_to_remove)))
        if self._plan is not None:
            raise InvalidArgumentError(expected("rewind", "no forward pass in progress", "a pending step"))
        target = self._columns - int(tokens_to_remove)
        col = target
        while self.seq_ids:
            have = self.kv.seq_lens(self.seq_ids, computed=True).astype(np.int64)
            drop = np.maximum(have - np.maximum(col - self._pads, 0), 0)
            if drop.any():
                self.kv.truncate(self.seq_ids, drop)
            now = self.kv.seq_lens(self.seq_ids, computed=True).astype(np.int64)
            ends = np.where(now > 0, self._pads + now, np.minimum(self._pads, col))
            low = int(ends.min())
            if low == col:
                break
            col = low
        self._pads = np.minimum(self._pads, col)
        self._columns = col
        self._slide()
        return target - col

