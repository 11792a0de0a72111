"""The KV format of a cache: what two caches (two processes, or a process and a disk
tier written by another) must agree on for a block's bytes to mean the same thing."""
from __future__ import annotations

from typing import Any, Dict

__all__ = ["kv_format"]

FORMAT = 1


def kv_format(store, tag: str = "") -> Dict[str, Any]:
    """A JSON-able description of ``store``'s blocks.

    Covers the model shape this rank stores (layers, the KV heads it holds, head dim),
    the block size, the model and cache dtypes, the layout, and every arena's element
    type and per-block shape (so quantization scales and any arena a future store adds
    are covered). ``tag`` names the weights (two models of one shape have different
    KV); the caller chooses it.
    """
    c = store.config
    return {
        "format": FORMAT,
        "tag": tag,
        "num_layers": c.num_layers,
        "num_kv_heads": c.num_kv_heads,
        "kv_head_indices": list(c.kv_head_indices),
        "head_dim": c.head_dim,
        "block_size": c.block_size,
        "dtype": c.dtype,
        "cache_dtype": c.cache_dtype,
        "layout": c.layout,
        "arenas": [[str(a.dtype).replace("torch.", ""), [a.shape[0]] + list(a.shape[2:])] for a in store.arenas],
    }
