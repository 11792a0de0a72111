"""The data path of layer groups: which arena slot and which slots a layer uses, and
which positions a sliding layer's gather returns.

Layer l of group g lives in layer slot ``plan.layer_slot[l]`` of the blocks g's tables
hand out, so a write or gather of layer l goes to that slot with group g's slots or
page table. A sliding group's tables hold only the sink blocks and the window, so its
gathers return those tokens, in position order, and :func:`kept_positions` says which
absolute positions they are (what RoPE'd keys and an attention mask need).
"""
from __future__ import annotations

import numpy as np

from pagedkv.errors import InvalidArgumentError, ShapeError, expected
from pagedkv.groups.layers import GroupPlan

__all__ = ["layer_slot", "layer_slots", "kept_lengths", "kept_positions"]


def layer_slot(plan: GroupPlan, layer) -> tuple[int, int]:
    """``(group, arena layer slot)`` of a model layer."""
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not 0 <= layer < plan.num_layers:
        raise InvalidArgumentError(expected("layer", f"an int in [0, {plan.num_layers})", repr(layer)))
    return plan.layer_group[int(layer)], plan.layer_slot[int(layer)]


def layer_slots(plan: GroupPlan, layer, slot_mapping):
    """The arena slot of ``layer`` and its group's row of a ``[num_groups, N]`` slot
    mapping (a 1-D mapping is taken as that group's already)."""
    g, slot = layer_slot(plan, layer)
    ndim = getattr(slot_mapping, "ndim", 1)
    if ndim == 2:
        if slot_mapping.shape[0] != len(plan.groups):
            raise ShapeError(expected("slot_mapping", f"[{len(plan.groups)}, N] (one row per layer group) or [N]",
                                      tuple(slot_mapping.shape)))
        slot_mapping = slot_mapping[g]
    return slot, slot_mapping


def kept_lengths(spec, tables, keys, internal: bool) -> tuple[np.ndarray, np.ndarray]:
    """Per sequence: tokens a gather through ``tables`` (of a group of ``spec``) returns,
    and tokens released."""
    lens = tables.seq_lens(keys, internal=internal)
    gone = tables.released_tokens(keys, internal=internal) if spec.releases_blocks else np.zeros_like(lens)
    return lens - gone, gone


def kept_positions(tables, lens: np.ndarray, gone: np.ndarray) -> np.ndarray:
    """Absolute positions (int64, concatenated per sequence) of the tokens a gather
    returns: ``[0, sinks_end)`` then ``[sinks_end + released, seq_len)``."""
    sinks_end = tables.sink_blocks * tables.block_size
    parts = []
    for total, g in zip((lens + gone).tolist(), gone.tolist()):
        if g:
            parts.append(np.arange(sinks_end, dtype=np.int64))
            parts.append(np.arange(sinks_end + g, total, dtype=np.int64))
        else:
            parts.append(np.arange(total, dtype=np.int64))
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
