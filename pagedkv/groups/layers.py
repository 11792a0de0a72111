"""Layer kinds and layer groups: which layers attend to everything, which to a window.

A model may mix full-attention layers with sliding-window ones (Mistral: every layer
slides; Gemma 2/3, gpt-oss: ``layer_types`` alternate; Qwen2: layers from
``max_window_layers`` on slide when ``use_sliding_window``). Each layer has a *window*
in tokens: 0 for full attention, W >= 1 when a query at position p sees keys
(p - W, p] (Hugging Face's convention), plus, optionally, S *sink* tokens (the first S
positions stay visible, StreamingLLM-style; HF configs do not carry them, so the
user sets them).

Layers of one kind form groups (each a :mod:`spec <pagedkv.groups.spec>`), as in vLLM's hybrid allocator: every group has its own
block tables over the one shared block pool, and only the bookkeeping differs between
groups. All groups have the same number of layer slots (the smallest kind's layer
count; a larger kind is split into several groups), so a block holds that many layers
of one group's tokens and no block is wasted on layers of another kind: an alternating
model pays half the bytes per token of a uniform one, in every layer. Layer l of group
g uses layer slot ``layers.index(l)`` of each block g's tables hand it.

A model whose layers are all full attention gets ``None`` (no plan): the manager then
takes exactly the path it always took.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pagedkv.errors import InvalidArgumentError, expected
from pagedkv.groups.spec import FullAttentionSpec, KVSpec, SlidingWindowSpec

__all__ = ["LayerGroup", "GroupPlan", "layer_windows_from_hf", "plan_groups"]

FULL = "full_attention"
SLIDING = "sliding_attention"
# Hugging Face models whose configs alternate layer kinds without a layer_types list:
# one full-attention layer every `pattern` layers (the others slide).
_IMPLICIT_PATTERN: dict[Any, int] = {"gemma2": 2, "gemma3": 6, "gemma3_text": 6, "cohere2": 4}


#: A layer group is its spec (:mod:`pagedkv.groups.spec`): the name this module had before.
LayerGroup = KVSpec


@dataclass(frozen=True)
class GroupPlan:
    """The layer groups of a model with at least one sliding layer."""

    groups: tuple[LayerGroup, ...]
    layer_group: tuple[int, ...]     # layer -> its group's index
    layer_slot: tuple[int, ...]      # layer -> its layer slot in the group's blocks

    @property
    def slots_per_block(self) -> int:
        """Layer slots a block holds (the arena's leading dimension)."""
        return max(len(g.layers) for g in self.groups)

    @property
    def num_layers(self) -> int:
        return len(self.layer_group)

    def group_of(self, layer: int) -> LayerGroup:
        return self.groups[self.layer_group[layer]]

    def blocks_held(self, tokens: int, block_size: int) -> tuple[int, ...]:
        """Blocks each group holds at most for a sequence of ``tokens`` tokens, by its
        spec's rule (:meth:`~pagedkv.groups.spec.KVSpec.blocks_held`)."""
        return tuple(g.placed(block_size=block_size).blocks_held(tokens) for g in self.groups)


def _window(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(expected(name, "a window of at least 1 token (an int)", repr(value)))
    return value


def layer_windows_from_hf(src: Mapping[str, Any], num_layers: int) -> tuple[int, ...] | None:
    """Each layer's window (0 = full attention) from a Hugging Face config mapping, or
    None when every layer attends to everything.

    Reads, in order: ``layer_types`` (``"full_attention"`` / ``"sliding_attention"``,
    one per layer, with ``sliding_window``); Qwen2's ``use_sliding_window`` with
    ``max_window_layers`` (layers from that index on slide); Gemma 2/3 and Cohere 2
    configs without ``layer_types`` (their model's fixed pattern, or
    ``sliding_window_pattern``); otherwise a ``sliding_window`` int makes every layer
    slide (Mistral).
    """
    window = src.get("sliding_window")
    types = src.get("layer_types")
    if types is not None:
        if isinstance(types, (str, bytes)) or not isinstance(types, Sequence):
            raise InvalidArgumentError(expected("layer_types", f"a list of {num_layers} layer kinds",
                                                type(types).__name__))
        if len(types) != num_layers:
            raise InvalidArgumentError(expected("layer_types", f"{num_layers} entries (one per layer)", len(types)))
        bad = [(i, t) for i, t in enumerate(types) if t not in (FULL, SLIDING)]
        if bad:
            i, t = bad[0]
            raise InvalidArgumentError(expected("layer_types", f"'{FULL}' or '{SLIDING}' entries",
                                                f"{t!r} at index {i}"))
        if SLIDING not in types:
            return None
        w = _window(window, "sliding_window")
        return tuple(w if t == SLIDING else 0 for t in types)
    if "use_sliding_window" in src:
        if not src.get("use_sliding_window") or window is None:
            return None
        w = _window(window, "sliding_window")
        first = src.get("max_window_layers", 0)
        if isinstance(first, bool) or not isinstance(first, int) or not 0 <= first <= num_layers:
            raise InvalidArgumentError(expected("max_window_layers", f"an int in [0, {num_layers}]", repr(first)))
        if first == num_layers:
            return None
        return tuple(w if i >= first else 0 for i in range(num_layers))
    if window is None:
        return None
    w = _window(window, "sliding_window")
    pattern = src.get("sliding_window_pattern", _IMPLICIT_PATTERN.get(src.get("model_type")))
    if pattern is None:
        return (w,) * num_layers
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
        raise InvalidArgumentError(expected("sliding_window_pattern", "an int >= 1", repr(pattern)))
    return tuple(w if (i + 1) % pattern else 0 for i in range(num_layers))


def plan_groups(layer_windows: Sequence[int], sinks: int = 0) -> GroupPlan | None:
    """Group layers by kind; None when every layer is full attention.

    ``sinks`` applies to every sliding layer and must be below each window.
    """
    if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
        raise InvalidArgumentError(expected("attention_sinks", "an int >= 0", repr(sinks)))
    windows = []
    for i, w in enumerate(layer_windows):
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            raise InvalidArgumentError(expected("layer_windows", "ints >= 0 (0 = full attention)",
                                                f"{w!r} at layer {i}"))
        if w and sinks >= w:
            raise InvalidArgumentError(expected("attention_sinks", f"fewer than the window ({w} tokens, layer {i})",
                                                sinks))
        windows.append(w)
    if not windows:
        raise InvalidArgumentError(expected("layer_windows", "one entry per layer", "none"))
    if not any(windows):
        return None
    kinds: dict = {}
    for layer, w in enumerate(windows):
        kinds.setdefault(w, []).append(layer)
    size = min(len(layers) for layers in kinds.values())
    groups: list[KVSpec] = []
    layer_group = [0] * len(windows)
    layer_slot = [0] * len(windows)
    # Full attention first: group 0 is then the one whose tables keep every block.
    for w in sorted(kinds):
        layers = kinds[w]
        for start in range(0, len(layers), size):
            members = tuple(layers[start:start + size])
            g = len(groups)
            groups.append(SlidingWindowSpec(g, members, window_tokens=w, sink_tokens=sinks) if w
                          else FullAttentionSpec(g, members))
            for slot, layer in enumerate(members):
                layer_group[layer] = g
                layer_slot[layer] = slot
    return GroupPlan(tuple(groups), tuple(layer_group), tuple(layer_slot))
