"""pagedkv's KV events in vLLM's wire format (``vllm/distributed/kv_events.py``).

A batch is an ``EventBatch``: a positional array ``[ts, events, data_parallel_rank]``
(the rank left out when None). Each event is a tagged struct, as vLLM 0.32 encodes it
(``wire_format="map"``, the default): a map with ``"type"`` (``"BlockStored"``,
``"BlockRemoved"``, ``"AllBlocksCleared"``) and named fields, fields at their default
left out. ``wire_format="array"`` writes each event as the tagged positional array
older vLLM releases used and some routers still read (``["BlockStored", block_hashes,
parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, extra_keys,
group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window]``, trailing defaults left
out).

``BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
lora_name, extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window)``,
``BlockRemoved(block_hashes, medium, group_idx)``, ``AllBlocksCleared()``:

- hashes are this process's device hashes as signed 64-bit integers (what llm-d,
  TensorRT-LLM and Dynamo read); ``token_ids`` are always there (every block's, in
  order), so a router can key blocks by tokens instead of trusting one hash function;
- ``medium`` names the tier (:data:`MEDIA`: vLLM's ``"GPU"``/``"CPU"``/``"STORAGE"``
  for the device, host and disk, ``"REMOTE"`` for the shared remote tier), and
  ``locality`` says ``"LOCAL"`` or ``"REMOTE"``;
- ``group_idx`` is the layer group, with its ``kv_cache_spec_kind``
  (``"full_attention"`` or ``"sliding_window"``) and window;
- the namespace goes to ``lora_name``/``lora_id`` (the adapter id) and ``extra_keys``
  (``(lora_name, cache_salt)`` per block, as vLLM lists them; None without either).

Events the cache could not keep (``EventsLost``) become ``AllBlocksCleared``: a
consumer mirroring the cache starts over, which only underestimates what it holds.
"""
from __future__ import annotations

import time
from typing import Any

from pagedkv.events import AllBlocksCleared, BlockRemoved, BlockStored, EventsLost

__all__ = ["MEDIA", "MLA_GROUP", "STATE_GROUP", "WIRE_FORMATS", "GroupSpec", "batch", "group_spec", "int64", "to_wire"]

#: pagedkv medium -> the wire's medium
MEDIA = {"device": "GPU", "host": "CPU", "disk": "STORAGE", "remote": "REMOTE"}
WIRE_FORMATS = ("map", "array")
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                  "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality")
_STORED_REQUIRED = 7          # the fields without a default (always on the wire)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx", "locality")
_REMOVED_REQUIRED = 2


GroupSpec = tuple[str, "int | None"]


#: the recurrent-state snapshots' group, and an MLA model's one group (vLLM's words)
STATE_GROUP: GroupSpec = ("mamba", None)
MLA_GROUP: GroupSpec = ("mla_attention", None)


def group_spec(window: int) -> GroupSpec:
    """``(kv_cache_spec_kind, kv_cache_spec_sliding_window)`` of a layer group with this
    window in tokens (0: full attention)."""
    return ("sliding_window", int(window)) if window else ("full_attention", None)


def int64(h: int) -> int:
    """A 64-bit hash as the signed integer the wire carries (two's complement)."""
    h &= (1 << 64) - 1
    return h - (1 << 64) if h >= 1 << 63 else h


def _namespace(ns) -> tuple[Any, str | None, Any]:
    """``(lora_id, lora_name, cache_salt)`` of a pagedkv namespace."""
    if ns is None:
        return None, None, None
    salt, adapter = ns
    lora_id = adapter if isinstance(adapter, int) and not isinstance(adapter, bool) and -2**63 <= adapter < 2**63 \
        else None
    return lora_id, None if adapter is None else str(adapter), salt


def _fields(values: dict[str, Any], names: tuple[str, ...], required: int, tag: str, wire_format: str):
    if wire_format == "map":
        out: dict[str, Any] = {"type": tag}
        for i, k in enumerate(names):
            if i < required or values[k] is not None:
                out[k] = values[k]
        return out
    row = [tag] + [values[k] for k in names if k != "locality"]     # the positional layout predates it
    while len(row) > required + 1 and row[-1] is None:     # trailing defaults left out
        row.pop()
    return row


def to_wire(event, *, media: dict[str, str], groups: list[GroupSpec], wire_format: str = "map") -> list:
    """One pagedkv event as wire events (a list: one, or none for an event the wire
    has no word for)."""
    if isinstance(event, (AllBlocksCleared, EventsLost)):
        return [_fields({}, (), 0, "AllBlocksCleared", wire_format)]
    medium = media.get(event.medium, event.medium)
    locality = "REMOTE" if event.medium == "remote" else "LOCAL"
    group = event.group
    if isinstance(event, BlockRemoved):
        return [_fields({"block_hashes": [int64(h) for h in event.block_hashes], "medium": medium,
                         "group_idx": group, "locality": locality}, _REMOVED_FIELDS, _REMOVED_REQUIRED,
                        "BlockRemoved", wire_format)]
    if not isinstance(event, BlockStored):
        return []
    lora_id, lora_name, salt = _namespace(event.namespace)
    keys = tuple(x for x in (lora_name, salt) if x is not None)
    kind, window = groups[group] if group < len(groups) else ("unknown", None)
    values = {
        "block_hashes": [int64(h) for h in event.block_hashes],
        "parent_block_hash": None if event.parent_block_hash is None else int64(event.parent_block_hash),
        "token_ids": [int(t) for t in event.token_ids],
        "block_size": event.token_count // max(1, len(event.block_hashes)),
        "lora_id": lora_id, "medium": medium, "lora_name": lora_name,
        "extra_keys": [keys] * len(event.block_hashes) if keys else None,
        "group_idx": group, "kv_cache_spec_kind": kind, "kv_cache_spec_sliding_window": window,
        "locality": locality,
    }
    return [_fields(values, _STORED_FIELDS, _STORED_REQUIRED, "BlockStored", wire_format)]


def batch(events: list, *, media: dict[str, str], groups: list[GroupSpec], wire_format: str = "map",
          data_parallel_rank: int | None = None, ts: float | None = None) -> list:
    """An ``EventBatch`` of pagedkv events: ``[ts, events]`` (``+ [rank]`` when set)."""
    out = [e for ev in events for e in to_wire(ev, media=media, groups=groups, wire_format=wire_format)]
    row: list = [time.time() if ts is None else ts, out]
    if data_parallel_rank is not None:
        row.append(data_parallel_rank)
    return row
