"""Recurrent-state layers in a :class:`~pagedkv.integrations.transformers.PagedCache`.

transformers' reference code of Mamba, Mamba2, Gated DeltaNet and short-convolution
layers reads a layer's states at the start of its forward (``get_conv_state``,
``get_recurrent_state``: None when there is no previous state), hands a prompt chunk's
convolution input to ``update_conv_state`` (which returns it with the cached left
context in front) and its final state to ``update_recurrent_state``, and in a decode
step updates the tensors it read in place (``causal_conv1d_update``, the selective state
update). So a pass never says when it ends, and a decode step of a pure state model never
says how many tokens it has.

:class:`StatePass` holds one forward pass's working states: per state layer, the batch's
conv and SSM states in the model dtype, read from the cache's state slots when the layer
first asks and written back, with the commit, once the pass is over. A pass is over when
every layer has made its calls and a call comes from outside the model (``generate``
asks ``get_seq_length`` before each pass), or when a layer repeats a call (the next pass
began). The pass's token count is the one the first ``update`` / ``update_conv_state``
shows, or 1 (a decode step that only updated in place).
"""
from __future__ import annotations

import torch

from pagedkv.errors import InternalError, InvalidArgumentError, ShapeError, expected

try:
    from transformers.cache_utils import LinearAttentionCacheLayerMixin
except ImportError as exc:  # pragma: no cover - transformers without linear-attention layers
    raise ImportError("recurrent-state layers in a PagedCache need transformers >= 5.22 (LinearAttentionCacheLayerMixin): "
                      f"{exc}") from exc

__all__ = ["PagedStateLayer", "StatePass", "state_names"]


def state_names(spec) -> None:
    """A transformers model caches a ``conv`` state and, for every family but LFM2's
    short convolutions, an ``ssm`` (recurrent) state: refuse other tensor names."""
    names = [t.name for t in spec.tensors]
    if names not in (["conv", "ssm"], ["conv"]):
        raise InvalidArgumentError(expected("config.state_tensors", "the tensors 'conv' and 'ssm' (or 'conv' only) "
                                            "that transformers' linear-attention layers cache", names))


class PagedStateLayer(LinearAttentionCacheLayerMixin):
    """One recurrent-state layer's view of a PagedCache (every state lives in the parent)."""

    record_past = False     # the decode path updates the states in place: no past to keep

    def __init__(self, parent, layer_idx: int):
        super().__init__(number_of_states=1)
        self.parent = parent
        self.layer_idx = layer_idx

    def lazy_initialization(self, conv_states=None, recurrent_states=None, state_idx: int = 0, **kwargs) -> None:
        pass

    def update_conv_state(self, conv_states, state_idx: int = 0, **kwargs):
        return self.parent.update_conv_state(conv_states, self.layer_idx, state_idx, **kwargs)

    def update_recurrent_state(self, recurrent_states, state_idx: int = 0, **kwargs):
        return self.parent.update_recurrent_state(recurrent_states, self.layer_idx, state_idx, **kwargs)

    def reset(self) -> None:
        self.parent.reset()

    def reorder_cache(self, beam_idx) -> None:
        self.parent.reorder_cache(beam_idx)

    def crop(self, tokens_to_remove: int) -> None:
        raise InvalidArgumentError(expected("crop", "PagedCache.crop (all layers at once)",
                                            f"a crop of state layer {self.layer_idx}"))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.parent.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices) -> None:
        self.parent.batch_select_indices(indices)

    def offload(self):
        pass

    def prefetch(self):
        pass


class StatePass:
    """The working states of one forward pass (see the module docstring).

    Args:
        kv: the PagedKVCache.
        kinds: each model layer's kind (``config.layer_kinds``).
        dtype: the model dtype the working states are held in.
    """

    def __init__(self, kv, kinds, dtype):
        self.kv = kv
        self.dtype = dtype
        self.state_of: dict[int, int] = {}    # model layer -> state layer
        self.kv_of: dict[int, int] = {}       # model layer -> K/V layer
        for i, k in enumerate(kinds):
            if k in ("attention", "hybrid"):
                self.kv_of[i] = len(self.kv_of)
            if k in ("state", "hybrid"):
                self.state_of[i] = len(self.state_of)
        self.expected = {(i, "kv") for i in self.kv_of} | {(i, "state") for i in self.state_of}
        self.names = [t.name for t in kv.config.state_spec.tensors]
        self.clear()

    def clear(self) -> None:
        self.seen: dict[tuple[int, str], set[str]] = {}
        self.working: dict[int, dict[str, torch.Tensor]] = {}   # state layer -> name -> [B, *shape]
        self.prev: bool | None = None      # some row has a state from before this pass

    @property
    def started(self) -> bool:
        return bool(self.seen)

    @property
    def complete(self) -> bool:
        return self.expected.issubset(self.seen)

    def note(self, layer: int, part: str, kind: str) -> bool:
        """Record a call of ``layer``; True when it repeats one of this pass (a new pass)."""
        calls = self.seen.setdefault((layer, part), set())
        if kind in calls:
            return True
        calls.add(kind)
        return False

    def kv_layer(self, layer: int) -> int:
        kl = self.kv_of.get(layer)
        if kl is None:
            raise InvalidArgumentError(expected("layer_idx", "a layer with attention (K/V)",
                                                f"{layer}, a recurrent-state layer"))
        return kl

    def state_layer(self, layer: int) -> int:
        sl = self.state_of.get(layer)
        if sl is None:
            raise InvalidArgumentError(expected("layer_idx", "a recurrent-state layer", f"{layer}, a layer without one"))
        return sl

    # ---- the working states ------------------------------------------------------------------
    def has_prev(self, rows) -> bool:
        if self.prev is None:
            self.prev = bool(rows) and bool((self.kv.state_positions(rows) > 0).any())
        return self.prev

    def states(self, layer: int, rows) -> dict[str, torch.Tensor]:
        """The working states of model layer ``layer`` (read from the slots on first use)."""
        sl = self.state_layer(layer)
        w = self.working.get(sl)
        if w is None:
            w = {}
            if rows and self.has_prev(rows):
                w = {n: t.to(self.dtype) for n, t in self.kv.read_state(rows, sl).items()}
            self.working[sl] = w
        return w

    def expand(self, repeats: int) -> None:
        """generate repeated every row ``repeats`` times (beams) after the model read the
        states: repeat the working tensors in place, so the tensors it holds follow."""
        for w in self.working.values():
            for t in w.values():
                t.set_(t.repeat_interleave(repeats, dim=0))  # type: ignore[call-overload]  # Tensor source: documented

    def update_conv(self, layer: int, rows, conv: torch.Tensor, kernel: int | None) -> torch.Tensor:
        """A chunk's convolution input ``[B, C, q]``: keep the last ``kernel`` columns of
        (cached left context, input) and return the whole, as transformers does."""
        w = self.states(layer, rows)
        prev = w.get("conv")
        if prev is not None:
            if prev.shape[0] != conv.shape[0] or prev.shape[1] != conv.shape[1]:
                raise ShapeError(expected("conv_states", f"[{prev.shape[0]}, {prev.shape[1]}, q] (the cached rows)",
                                          tuple(conv.shape)))
            full = torch.cat([prev.to(conv.dtype), conv], dim=-1)
            k = prev.shape[-1]
        else:
            k = conv.shape[-1] if kernel is None else int(kernel)
            full = conv if conv.shape[-1] >= k else torch.nn.functional.pad(conv, (k - conv.shape[-1], 0), value=0)
        w["conv"] = full[..., -k:].clone()
        return full

    def update_recurrent(self, layer: int, rows, state: torch.Tensor) -> torch.Tensor:
        w = self.states(layer, rows)
        cur = w.get("ssm")
        if cur is None or cur.shape != state.shape:
            w["ssm"] = state.detach().clone()
        else:
            cur.copy_(state)
        return w["ssm"]

    def write(self, rows) -> None:
        """Store the pass's states in the rows' slots (reserved by the pass's plan)."""
        for sl, w in self.working.items():
            missing = [n for n in self.names if n not in w]
            if missing:
                raise InternalError(f"state layer {sl} ended a pass without its {missing} state (a bug)")
            self.kv.write_state(rows, sl, {n: w[n].float() for n in self.names})
