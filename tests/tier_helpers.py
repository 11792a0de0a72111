"""Helpers for the prefix-tier and transfer tests: KV that is a function of the whole
prefix, so a block reused under the wrong tokens or the wrong parent shows up."""
from __future__ import annotations

import numpy as np
import torch

from pagedkv import CacheConfig, PagedKVCache
from pagedkv.testing import weak_hash_cache

SHAPE = dict(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype="float32")


def prefix_codes(tokens) -> np.ndarray:
    """code[i] depends on tokens[: i + 1] (order included); exact in float32."""
    codes = np.empty(len(tokens), dtype=np.int64)
    c = 7
    for i, t in enumerate(np.asarray(tokens).tolist()):
        c = (c * 31 + int(t) + 1) % 262139
        codes[i] = c
    return codes


def expected_kv(tokens, layer: int, heads: int = 2, dim: int = 4):
    """K, V ``[len(tokens), heads, dim]`` that :func:`fill` writes."""
    code = torch.from_numpy(prefix_codes(tokens).astype(np.float32))[:, None, None]
    h = torch.arange(heads, dtype=torch.float32)[None, :, None] / 4
    d = torch.arange(dim, dtype=torch.float32)[None, None, :] / 16
    k = code + h + d + layer * 0.5
    return k.contiguous(), (-k).contiguous()


def fill(cache: PagedKVCache, seq_id, tokens, **admit) -> int:
    """Admit ``tokens``, compute (write) the uncached rest, commit; returns the hit."""
    tokens = np.asarray(tokens, dtype=np.int32)
    cfg = cache.config
    hit = cache.add_sequence(seq_id, tokens, **admit)
    n = len(tokens) - hit
    slots = cache.reserve(seq_id, n)
    for layer in range(cfg.num_layers):
        k, v = expected_kv(tokens, layer, cfg.kv_heads_per_rank, cfg.head_dim)
        cache.write(layer, slots, k[hit:], v[hit:])
    cache.commit(seq_id, n)
    return hit


def assert_kv(cache: PagedKVCache, seq_id, tokens) -> None:
    """The sequence's gathered KV equals what :func:`fill` writes for ``tokens``."""
    cfg = cache.config
    for layer in range(cfg.num_layers):
        k, v = cache.gather(seq_id, layer)
        ek, ev = expected_kv(tokens, layer, cfg.kv_heads_per_rank, cfg.head_dim)
        assert torch.equal(k, ek), f"layer {layer}: wrong K"
        assert torch.equal(v, ev), f"layer {layer}: wrong V"


def make(**over) -> PagedKVCache:
    weak = over.pop("weak_hash", False)
    opts = dict(SHAPE)
    opts.update(over)
    config = CacheConfig(**opts)
    return weak_hash_cache(config) if weak else PagedKVCache(config)


def assert_clean(cache: PagedKVCache) -> None:
    """No sequence, every device block free, every invariant (tiers included)."""
    cache.check_invariants()
    assert len(cache) == 0
    assert cache.pool.num_in_use_blocks == 0
    assert cache.pool.num_free_blocks == cache.pool.num_blocks
