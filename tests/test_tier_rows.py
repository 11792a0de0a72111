"""Sink and window rows through the host prefix tier: a quantized cache keeps each
sequence's first sink tokens and its recent window in model precision (a window arena
beside the codes); a prefix evicted to the host tier and promoted back reads them
exactly as it would have in place, not quantized."""
import numpy as np
import pytest
import torch

from pagedkv import CacheConfig, PagedKVCache
from pagedkv.errors import OutOfBlocksError

BS = 4
CASES = {
    "int4-block-keys-sinks": dict(kv_dtype="int4", head_dim=8, kv_window=0, kv_key_quant="block", kv_sink_tokens=4),
    "int8-window": dict(kv_dtype="int8", head_dim=4, kv_window=6),
    "int4-hybrid-sinks-window": dict(kv_dtype="int4", head_dim=8, kv_window=4, kv_key_quant="block",
                                     kv_sink_tokens=5, layer_windows=(6, 0, 6, 0)),
}


def make(opts) -> PagedKVCache:
    o = dict(num_layers=4, num_kv_heads=2, block_size=BS, dtype="float32", num_blocks=24, prefix_host_blocks=32)
    o.update(opts)
    return PagedKVCache(CacheConfig(**o))


_NOISE = torch.randn((4, 64, 2, 2, 8), generator=torch.Generator().manual_seed(3))


def expected_kv(tokens, layer: int, heads: int, dim: int):
    """Values with outliers per row (every kv_dtype loses something on them); row i
    depends on position i and tokens[i] only, so a shared prefix has shared rows."""
    t = torch.from_numpy(np.asarray(tokens, dtype=np.float32))[:, None, None] / 100
    base = _NOISE[layer, :len(tokens), :, :heads, :dim] * torch.tensor([1.0] * (dim - 1) + [9.0])
    return (base[:, 0] + t).contiguous(), (base[:, 1] - t).contiguous()


def fill(cache, seq, tokens) -> int:
    hit = cache.add_sequence(seq, tokens)
    n = len(tokens) - hit
    slots = cache.reserve(seq, n)
    for layer in range(cache.config.num_layers):
        k, v = expected_kv(tokens, layer, 2, cache.config.head_dim)
        cache.write(layer, slots, k[hit:], v[hit:])
    cache.commit(seq, n)
    return hit


def reads(cache, seq, tokens):
    hit = fill(cache, seq, tokens)
    out = [cache.gather_window([seq], layer) for layer in range(cache.config.num_layers)]
    cache.free(seq)
    return hit, [(k, v, pos) for k, v, _, pos in out]


def flush_device(cache) -> None:
    cache.add_sequence("flush")
    try:
        while True:
            cache.reserve("flush", BS)
    except OutOfBlocksError:
        pass
    cache.free("flush")


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_promoted_prefix_reads_its_sink_and_window_rows_as_in_place(case):
    a = np.arange(100, 117, dtype=np.int32)         # 4 full blocks + 1 token
    short = np.append(a[:8], np.int32(7))           # shares the first two blocks only
    with make(CASES[case]) as cache:
        fill(cache, "a", a)
        cache.free("a")
        in_place = [reads(cache, "b", t) for t in (a, short)]
        assert [h for h, _ in in_place] == [16, 8]
        for toks, (_, want) in zip((a, short), in_place):
            flush_device(cache)                     # every cached block goes to the host tier
            assert cache.match_prefix(toks) >= 8 and cache.stats().host_hit_tokens >= 0
            before = cache.stats().host_hit_tokens
            hit, got = reads(cache, "c", toks)
            assert hit == (16 if toks is a else 8) and cache.stats().host_hit_tokens - before == hit
            for layer, ((k, v, pos), (wk, wv, wpos)) in enumerate(zip(got, want)):
                assert torch.equal(pos, wpos)
                assert torch.equal(k, wk) and torch.equal(v, wv), f"layer {layer}: the promoted prefix reads other KV"
        cache.check_invariants()
