"""The KV format of a cache: what two caches (two processes, or a process and a disk
tier written by another) must agree on for a block's bytes to mean the same thing.

The format is derived here, in one place, from the :class:`~pagedkv.config.options.CacheConfig`:
every dataclass field of CacheConfig is classified below, either in :data:`STORED`
(it changes what a stored block's bytes mean, and enters the fingerprint) or in
:data:`NOT_STORED` (with the reason it does not). A field in neither table is a bug
that a test catches, so a setting added later cannot be forgotten again.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from pagedkv.errors import InternalError

__all__ = ["kv_format", "fingerprint", "unclassified", "differences", "describe", "shown", "STORED", "NOT_STORED", "FORMAT"]

#: Version of the fingerprint's own layout (2: every CacheConfig field classified).
FORMAT = 2


def _value(name: str) -> Callable[[Any], dict[str, Any]]:
    return lambda c: {name: getattr(c, name)}


def _heads(c) -> dict[str, Any]:
    # A rank's block holds these model heads; tp_size/tp_rank matter only through them
    # (rank 0 of 2 and rank 0 of 4 on a 2-head model both hold head 0: same bytes).
    return {"kv_head_indices": list(c.kv_head_indices)}


def _rotation_seed(c) -> dict[str, Any]:
    # The seed picks the rotation; without rotation it means nothing (no false refusal).
    return {"kv_rotation_seed": c.kv_rotation_seed if c.kv_rotation else None}


def _specs(c) -> dict[str, Any]:
    # Each layer group's spec says what of it a block's bytes depend on; a cache of one
    # full-attention group has nothing to add (None, as before specs).
    specs = c.kv_specs
    if len(specs) == 1 and specs[0].attention == "full":
        return {"layer_groups": None}
    return {"layer_groups": [s.fingerprint() for s in specs]}


#: CacheConfig field -> its entries in the fingerprint (named after the setting, so a
#: refusal names what to change). These change what a stored block's bytes mean.
STORED: dict[str, Callable[[Any], dict[str, Any]]] = {
    "num_layers": _value("num_layers"),               # layers a block holds
    "num_kv_heads": _value("num_kv_heads"),           # the model's KV heads
    "tp_size": _heads,                                # which heads this rank holds
    "tp_rank": _heads,
    "head_dim": _value("head_dim"),
    "block_size": _value("block_size"),               # tokens per block
    "dtype": _value("dtype"),                         # model-precision layers, unquantized data
    "kv_dtype": lambda c: {"kv_dtype": c.kv_dtype, "cache_dtype": c.cache_dtype},   # the codes' encoding
    "layout": _value("layout"),                       # NHD / HND element order
    "kv_group_size": _value("kv_group_size"),         # elements per scale/zero group
    "kv_rotation": _value("kv_rotation"),             # codes are of rotated K/V
    "kv_rotation_seed": _rotation_seed,               # which rotation
    "kv_key_quant": _value("kv_key_quant"),           # keys per token or per channel of a block
    "kv_key_bits": _value("kv_key_bits"),             # a sealed block key's code width (high bits in its params)
    "kv_full_precision_layers": lambda c: {"kv_full_precision_layers": list(c.kv_full_precision_layers)},
    "kv_full_precision_dtype": _value("kv_full_precision_dtype"),   # those layers' storage
    "layer_windows": _value("layer_windows"),         # which layers share a block's layer slots
    "attention_sinks": _value("attention_sinks"),
    "_specs": _specs,                                 # each layer group's attention type and slots
    "kv_lora_rank": _value("kv_lora_rank"),           # MLA: a latent row's compressed elements
    "qk_rope_head_dim": _value("qk_rope_head_dim"),   # MLA: its positional elements
    "prefix_disk_tag": lambda c: {"tag": c.prefix_disk_tag},   # names the weights the KV is of
    # recurrent-state layers (absent from the fingerprint of a model without them)
    "layer_kinds": lambda c: {} if c.layer_kinds is None else {"layer_kinds": list(c.layer_kinds)},
    "state_tensors": lambda c: {} if c.state_spec is None else {"state": c.state_spec.fingerprint()},
    "_state": lambda c: {},                           # the state spec: its entry is state_tensors'
}

#: CacheConfig field -> why it does not change what a stored block's bytes mean.
NOT_STORED: dict[str, str] = {
    "num_attention_heads": "query heads; a block holds only the KV heads",
    "num_blocks": "capacity",
    "memory_budget": "capacity",
    "_resolved_blocks": "capacity",
    "_groups": "the layer partition the specs carry (their entry, _specs)",
    "device": "where the arena lives, not what its bytes mean",
    "enable_prefix_caching": "bookkeeping policy",
    "eviction": "bookkeeping policy",
    "priority_classes": "bookkeeping policy",
    "low_watermark": "bookkeeping policy",
    "high_watermark": "bookkeeping policy",
    "shuffle_free_blocks": "bookkeeping policy",
    "enable_kv_events": "bookkeeping policy",
    "hash_seed": "the device index's hashes; tiers and transfers hash with a fixed seed and compare tokens",
    "host_num_blocks": "capacity of the host swap arena",
    "kv_window": "model-precision copies kept beside the blocks (window arena); a block's codes are the same "
                 "(the disk tier checks it for the rows its records carry: meta.json's rows)",
    "kv_window_sequences": "capacity of the window arena",
    "kv_sink_tokens": "model-precision copies kept beside the blocks (window arena); a block's codes are the same "
                 "(the disk tier checks it for the rows its records carry: meta.json's rows)",
    "prefix_host_blocks": "tier capacity",
    "prefix_disk_dir": "where the disk tier lives",
    "prefix_disk_blocks": "tier capacity (the disk tier checks its own capacity)",
    "prefix_tier_write": "tier policy",
    "prefix_tier_eviction": "tier policy",
    "prefix_remote": "where the remote tier lives (its keys and values carry this fingerprint)",
    "state_slots": "capacity of the state pool",
    "state_memory_budget": "capacity of the state pool",
    "_state_slots": "capacity of the state pool",
    "state_checkpoint_every": "bookkeeping policy (where snapshots are taken, not what they hold)",
}


def _jsonable(obj: Any) -> Any:
    """``obj`` as it reads back from JSON (tuples become lists), so a fingerprint compares
    equal to itself after a disk header or a transfer header carried it."""
    return json.loads(json.dumps(obj, sort_keys=True))


def unclassified(cls) -> tuple[list[str], list[str]]:
    """``(fields of cls in neither table, names in the tables that are not fields of cls)``."""
    names = [f.name for f in dataclasses.fields(cls)]
    known = set(STORED) | set(NOT_STORED)
    return [n for n in names if n not in known], sorted(known - set(names))


def fingerprint(config) -> dict[str, Any]:
    """The fingerprint of everything in ``config`` that changes what a stored block means
    (see :data:`STORED`), JSON-normalized. Raises :class:`~pagedkv.errors.InternalError`
    when a field of ``config`` is not classified (or a classified name is gone)."""
    missing, gone = unclassified(type(config))
    if missing:
        raise InternalError(f"CacheConfig field(s) {missing} not classified in pagedkv.format.fingerprint "
                            "(STORED or NOT_STORED)")
    if gone:
        raise InternalError(f"classified in pagedkv.format.fingerprint but not CacheConfig fields: {gone}")
    out: dict[str, Any] = {"format": FORMAT}
    for derive in STORED.values():
        out.update(derive(config))
    return _jsonable(out)


def kv_format(store, tag: Any = None) -> dict[str, Any]:
    """A JSON-able description of ``store``'s blocks: :func:`fingerprint` of its config,
    plus every arena's element type and per-block shape (so quantization scales and any
    arena a future store adds are covered). ``tag`` (default: the config's
    ``prefix_disk_tag``) names the weights: two models of one shape have different KV.
    """
    out = fingerprint(store.config)
    if tag is not None:
        out["tag"] = tag
    out["arenas"] = [[str(a.dtype).replace("torch.", ""), [a.shape[0]] + list(a.shape[2:])] for a in store.arenas]
    return _jsonable(out)


def _canon(value: Any) -> str:
    # JSON text, so True and 1 (equal in Python) differ, as they do in a config.
    return json.dumps(value, sort_keys=True)


def differences(mine: dict[str, Any], theirs: Any) -> list[tuple[str, Any, Any]]:
    """``(setting, theirs, mine)`` for every setting that differs, sorted by name; a
    ``theirs`` that is not a dict (a corrupt header) differs as a whole (``kv_format``)."""
    if not isinstance(theirs, dict):
        return [("kv_format", theirs, mine)]
    keys = sorted(set(mine) | {k for k in theirs if isinstance(k, str)})
    return [(k, theirs.get(k), mine.get(k)) for k in keys if _canon(theirs.get(k)) != _canon(mine.get(k))]


def shown(value: Any, limit: int = 200) -> str:
    """``repr(value)``, cut to ``limit`` characters (a peer's or a file's values may be huge)."""
    r = repr(value)
    return r if len(r) <= limit else r[:limit] + "..."


def describe(diffs: list[tuple[str, Any, Any]], there: str = "there", here: str = "here") -> str:
    """``"kv_rotation=True there, False here; ..."``."""
    return "; ".join(f"{k}={shown(t)} {there}, {shown(m)} {here}" for k, t, m in diffs)
