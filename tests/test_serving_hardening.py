"""The serving path under the issue 32 repros: window and sink rows stay exact until
``kv_window_sequences`` is passed (and each fallback is counted), ``PagedCache.select``
checks its arguments before it sizes anything, ``cache.attention`` never casts ``q``
and refuses the arena's own keywords by name, and a NaN or inf in ``q`` gives NaN as the
float64 definition and SDPA do."""
from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

from pagedkv import CacheConfig, PagedKVCache
from pagedkv.errors import ArgumentTypeError, DTypeError, InvalidArgumentError, PagedKVError
from pagedkv.ops import paged_attention
from pagedkv.ops.attention_reference import paged_attention as defined

L, H, D, BS = 4, 2, 8, 4


def make(**kw):
    base = dict(num_layers=L, num_kv_heads=H, head_dim=D, block_size=BS, num_blocks=160, dtype="float32",
                kv_dtype="int4", kv_sink_tokens=4, layer_windows=(8, 0, 8, 0))
    base.update(kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")           # the window arena costs more than int4 saves on 160 blocks
        return PagedKVCache(CacheConfig(**base))


def data(seq, n):
    g = torch.Generator().manual_seed(100 + seq)
    return [(torch.randn(n, H, D, generator=g), torch.randn(n, H, D, generator=g)) for _ in range(L)]


def run(seqs, steps, **kw):
    """Write ``steps`` ((seq, tokens) in order) into one cache holding ``seqs``; returns
    each sequence's gathers and paged-attention outputs per layer, and the fallbacks."""
    cache = make(**kw)
    kv = {s: data(s, sum(n for t, n in steps if t == s)) for s in seqs}
    done = dict.fromkeys(seqs, 0)
    for s in seqs:
        cache.add_sequence(s, [1000 * s + i for i in range(len(kv[s][0][0]))])
    for s, n in steps:
        if s not in done:
            continue
        slots = cache.reserve(s, n)
        for layer in range(L):
            k, v = kv[s][layer]
            cache.write(layer, slots, k[done[s]:done[s] + n], v[done[s]:done[s] + n])
        cache.commit(s, n)
        done[s] += n
    q = torch.randn(1, 2 * H, D, generator=torch.Generator().manual_seed(7))
    out = {}
    for s in seqs:
        reads = []
        for layer in range(L):
            group = cache.config.layer_groups.layer_group[layer]
            ptr, idx, _ = cache.page_table_csr([s], group=group)
            lens = torch.from_numpy(cache.seq_lens([s]).astype(np.int32) -
                                    cache.released_tokens([s], group=group).astype(np.int32))
            att = cache.attention(layer, q, torch.from_numpy(ptr), torch.from_numpy(idx), lens,
                                  torch.tensor([0, 1], dtype=torch.int32), window=8 if group == 1 else None)
            reads.append((cache.gather(s, layer), att))
        out[s] = reads
    fallbacks = cache.stats().window_fallbacks
    cache.free(list(seqs))
    return out, fallbacks


PREFILL = [(s, 20) for s in range(4)]
MIXED = [(0, 5), (1, 13), (2, 1), (0, 30), (3, 7), (1, 1), (2, 30), (3, 1), (0, 1), (1, 13), (2, 2), (3, 30),
         (0, 1), (1, 1), (2, 1), (3, 1)]
DECODE = [(s, 1) for _ in range(20) for s in range(4)]


@pytest.mark.parametrize("steps", [PREFILL, MIXED, DECODE], ids=["prefill", "mixed", "decode"])
@pytest.mark.parametrize("window", [None, 0, 4], ids=lambda w: f"kv_window={w}")
def test_four_sequences_read_their_sink_and_window_rows_as_alone(steps, window):
    # The repro: int4, kv_sink_tokens=4, layer_windows=(8, 0, 8, 0), 4 sequences,
    # below kv_window_sequences=16: a prefill gave every block a window slot and pushed
    # the others' exact rows out, so they read layer 0 back quantized.
    kw = {} if window is None else {"kv_window": window}
    shared, fallbacks = run(range(4), steps, **kw)
    assert fallbacks == 0
    for s in range(4):
        alone, _ = run([s], steps, **kw)
        for layer in range(L):
            (gk, gv), att = shared[s][layer]
            (ak, av), aatt = alone[s][layer]
            assert torch.equal(gk, ak) and torch.equal(gv, av), (s, layer)
            assert torch.equal(att, aatt), (s, layer)


def test_past_kv_window_sequences_the_fallback_is_counted():
    # 4 sequences decoding in turn with room for one: the others' windows give way, and
    # every read that finds its rows gone is counted (gather and attention alike)
    _, fallbacks = run(range(4), DECODE, kv_window=4, kv_window_sequences=1)
    assert fallbacks >= 3
    _, alone = run([0], DECODE, kv_window=4, kv_window_sequences=1)
    assert alone == 0


def test_a_prefill_keeps_its_newest_rows_and_takes_no_window_another_reads():
    cache = make(kv_window=4, kv_window_sequences=2, layer_windows=None)
    a, b = data(0, 9), data(1, 60)
    for s, kv in ((0, a), (1, b)):
        cache.add_sequence(s, None)
        slots = cache.reserve(s, len(kv[0][0]))
        for layer in range(L):
            cache.write(layer, slots, *kv[layer])
        cache.commit(s, len(kv[0][0]))
    for s, kv in ((0, a), (1, b)):
        for layer in range(L):
            k, _ = cache.gather(s, layer)
            assert torch.equal(k[-4:], kv[layer][0][-4:]) and torch.equal(k[:4], kv[layer][0][:4])
            assert not torch.equal(k[4:-4], kv[layer][0][4:-4])        # the rest is int4
    assert cache.stats().window_fallbacks == 0
    cache.free([0, 1])


# ---- PagedCache.select -----------------------------------------------------------------------
SELECT_BAD = [
    ("True", [0, 1], True, ArgumentTypeError), ("[True, 1]", [0, 1], [True, 1], ArgumentTypeError),
    ("[1.5, 1]", [0, 1], [1.5, 1], ArgumentTypeError), ("'ab' as ids", "ab", 1, ArgumentTypeError),
    ("['x', 1]", [0, 1], ["x", 1], ArgumentTypeError), ("None", [0, 1], None, ArgumentTypeError),
    ("[1, nan]", [0, 1], [1, math.nan], ArgumentTypeError), ("2.0", [0, 1], 2.0, ArgumentTypeError),
    ("[2**70, 1]", [0, 1], [2**70, 1], InvalidArgumentError), ("10**9", [0, 1], 10**9, InvalidArgumentError),
    ("2**63", [0, 1], 2**63, InvalidArgumentError), ("np float", [0, 1], np.array([1.0, 1.0]), ArgumentTypeError),
    ("2-D", [0, 1], np.ones((1, 2), np.int64), ArgumentTypeError), ("'11'", [0, 1], "11", ArgumentTypeError),
    ("ids None", None, 1, ArgumentTypeError), ("[0, 0]", [0, 0], 1, InvalidArgumentError),
    ("unknown id", [0, 9], 1, KeyError), ("[1, 0] counts", [0, 1], [1, 0], InvalidArgumentError),
]


@pytest.mark.parametrize("label,ids,counts,error", SELECT_BAD, ids=[c[0] for c in SELECT_BAD])
def test_select_checks_its_arguments_before_anything(label, ids, counts, error):
    from pagedkv.integrations.transformers import PagedCache

    kv = PagedKVCache(CacheConfig(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=16,
                                  dtype="float32"))
    for s in (0, 1):
        kv.add_sequence(s, [1, 2, 3])
        kv.reserve(s, 3)
        kv.commit(s, 3)
    cache = PagedCache(kv)
    mask, _ = cache.select([0, 1], 2)
    state = (list(cache.seq_ids), cache._pads.tolist(), cache._columns, kv.seq_lens([0, 1]).tolist())
    with pytest.raises(error) as e:
        cache.select(ids, counts)
    assert isinstance(e.value, PagedKVError)
    assert (list(cache.seq_ids), cache._pads.tolist(), cache._columns, kv.seq_lens([0, 1]).tolist()) == state
    assert mask.shape == (2, 5)
    cache.release()
    kv.free([0, 1])


def test_select_takes_at_most_what_the_cache_holds():
    from pagedkv.integrations.transformers import PagedCache

    kv = PagedKVCache(CacheConfig(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, num_blocks=16,
                                  dtype="float32"))
    kv.add_sequence(0, None)
    cache = PagedCache(kv)
    with pytest.raises(InvalidArgumentError, match=r"num_new_tokens: expected an int in \[1, 64\], got 65"):
        cache.select([0], 65)
    mask, pos = cache.select([0], 64)
    assert mask.shape == (1, 64) and pos[0, -1].item() == 63
    cache.release()
    kv.free(0)


# ---- cache.attention --------------------------------------------------------------------------
def written(kv_dtype, dtype="float32", n=6):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache = PagedKVCache(CacheConfig(num_layers=1, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=16,
                                         dtype=dtype, kv_dtype=kv_dtype))
    cache.add_sequence(0, list(range(n)))
    slots = cache.reserve(0, n)
    g = torch.Generator().manual_seed(1)
    t = getattr(torch, dtype)
    cache.write(0, slots, torch.randn(n, 2, 8, generator=g).to(t), torch.randn(n, 2, 8, generator=g).to(t))
    cache.commit(0, n)
    ptr, idx, _ = cache.page_table_csr([0])
    tables = (torch.from_numpy(ptr), torch.from_numpy(idx), torch.from_numpy(cache.seq_lens([0]).astype(np.int32)),
              torch.tensor([0, 1], dtype=torch.int32))
    return cache, tables


@pytest.mark.parametrize("kv_dtype", [None, "int8", "int4", "fp8_e4m3"])
@pytest.mark.parametrize("qdtype", [torch.float16, torch.bfloat16, torch.float64])
def test_attention_never_casts_q(kv_dtype, qdtype):
    cache, tables = written(kv_dtype)
    q = torch.randn(1, 4, 8).to(qdtype)
    with pytest.raises(DTypeError, match=r"q: expected dtype torch.float32 \(the .*\), got " + str(qdtype)):
        cache.attention(0, q, *tables)
    cache.free(0)


@pytest.mark.parametrize("key", ["layout", "kv_scale", "rotation_signs", "exact_rows", "layer_format", "bogus"])
def test_attention_refuses_the_arenas_own_keywords_by_name(key):
    cache, tables = written("int4")
    with pytest.raises(ArgumentTypeError, match=rf"attention: expected keywords among .*, got {key}="):
        cache.attention(0, torch.randn(1, 4, 8), *tables, **{key: "HND"})
    out = cache.attention(0, torch.randn(1, 4, 8), *tables, sm_scale=0.5, backend="cpu")
    assert out.shape == (1, 4, 8) and torch.isfinite(out).all()
    cache.free(0)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("kv_dtype,rotation", [(None, False), ("int8", False), ("int4", False), ("int4", True)])
def test_a_nan_or_inf_in_q_gives_nan_as_the_definition(bad, kv_dtype, rotation):
    extra = {"kv_rotation": rotation} if kv_dtype == "int4" else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache = PagedKVCache(CacheConfig(num_layers=1, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=16,
                                         dtype="float32", kv_dtype=kv_dtype, **extra))
    cache.add_sequence(0, list(range(10)))
    slots = cache.reserve(0, 10)
    cache.write(0, slots, torch.randn(10, 2, 8), torch.randn(10, 2, 8))
    cache.commit(0, 10)
    ptr, idx, _ = cache.page_table_csr([0])
    tables = (torch.from_numpy(ptr), torch.from_numpy(idx), torch.tensor([10], dtype=torch.int32),
              torch.tensor([0, 2], dtype=torch.int32))
    q = torch.randn(2, 4, 8)
    q[1, 1, 3] = bad
    ref = cache.attention(0, q, *tables, backend="reference")
    for splits in (None, 1, 3):
        out = cache.attention(0, q, *tables, backend="cpu", num_splits=splits)
        assert torch.isnan(out[1, 1]).all() and torch.isnan(ref[1, 1]).all()
        # the rows without it are untouched (q heads 0, 2, 3 of token 1; all of token 0)
        keep = torch.ones(2, 4, dtype=torch.bool)
        keep[1, 1] = False
        torch.testing.assert_close(out[keep], ref[keep], rtol=1e-5, atol=1e-5)
    cache.free(0)


def test_sdpa_by_its_definition_agrees_a_nan_query_row_is_nan():
    # SDPA's math backend (softmax(q k^T) v); torch 2.13's fused CPU kernel returns zeros
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, 1, 2, 8)
    q[0, 0, 1, 2] = math.nan
    k, v = torch.randn(1, 1, 5, 8), torch.randn(1, 1, 5, 8)
    with sdpa_kernel(SDPBackend.MATH):
        assert torch.isnan(torch.nn.functional.scaled_dot_product_attention(q, k, v)[0, 0, 1]).all()


@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize("splits", [None, 1, 3])
@pytest.mark.parametrize("kernel", ["tiled", "decode"])
def test_the_cuda_kernel_sources_emulated_give_nan_too(bad, splits, kernel):
    # both CUDA attention kernels (tiled; the decode kernel: one query per sequence,
    # head_dim 64), through their host emulation, against the definition
    import shutil

    from pagedkv.kernels import emulation

    if shutil.which(emulation.CXX) is None:
        pytest.skip(f"the host emulation needs {emulation.CXX}")
    d, bs, nq = (64, 16, 1) if kernel == "decode" else (8, 4, 2)
    kv = torch.randn(8, 2, bs, 2, d, generator=torch.Generator().manual_seed(0))
    tables = (torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0, 1, 2], dtype=torch.int32),
              torch.tensor([2 * bs + 2], dtype=torch.int32), torch.tensor([0, nq], dtype=torch.int32))
    q = torch.randn(nq, 4, d)
    q[nq - 1, 1, 3] = bad
    got = emulation.paged_attention(q, kv, *tables, num_splits=splits, kernel=kernel)
    want = defined(q, kv, *tables, num_splits=splits)
    cpu = paged_attention(q, kv, *tables, num_splits=splits, backend="cpu")
    assert torch.isnan(got[-1, 1]).all() and torch.isnan(want[-1, 1]).all() and torch.isnan(cpu[-1, 1]).all()
    keep = torch.ones(nq, 4, dtype=torch.bool)
    keep[-1, 1] = False
    torch.testing.assert_close(got[keep], want[keep], rtol=1e-4, atol=1e-4)
