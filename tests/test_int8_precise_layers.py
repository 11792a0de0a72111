"""``kv_full_precision_dtype="int8"``: the layers named in ``kv_full_precision_layers`` stored
in int8 (per-token scale and zero point, unrotated, no window) instead of the model dtype.
They read back as the int8 reference does, through every move (copy-on-write, host swap,
transfers and tiers go through the store's arenas), cost what the config says, change the
fingerprint, and are refused with typed errors where they make no sense.
"""
import pytest
import torch

from pagedkv import CacheConfig, PagedKVCache
from pagedkv.errors import ArgumentTypeError, InvalidArgumentError
from pagedkv.format.fingerprint import kv_format
from pagedkv.format.quant import dequantize, quantize
from test_lowbit_store import BS, D, H, L, config, expected_quantized, fill, kv_data

INT8 = dict(kv_dtype="int4", kv_key_quant="block", kv_window=0, kv_full_precision_layers=(0, 2),
            kv_full_precision_dtype="int8")


def int8_of(x):
    q, s, z = quantize(x.float(), "int8")
    return dequantize(q, s, z, torch.float32)


def test_the_named_layers_read_back_as_int8_and_the_others_as_int4():
    cfg = config(**INT8)
    cache = PagedKVCache(cfg)
    s = cache.store
    assert s.kv_full.dtype == torch.int8 and s.kv_full.shape == (2, 24, 2, BS, H, D)
    assert s.kv_full_scale.shape == s.kv_full_zero.shape == (2, 24, 2, BS, H)
    assert [s.is_quantized_layer(i) for i in range(L)] == [False, True, False]
    assert s.layer_format(0).kv_dtype == "int8" and not s.layer_format(0).rotation
    assert s.nbytes == cfg.total_bytes
    k, v = kv_data(11, seed=2)
    fill(cache, "a", k, v)
    for layer in (0, 2):
        gk, gv = cache.gather("a", layer)
        assert torch.equal(gk, int8_of(k)) and torch.equal(gv, int8_of(v))
        assert not torch.equal(gk, k)              # stored in int8, not exact
    # the int4 layer is untouched by the option (its tail block per token, the rest sealed)
    plain = PagedKVCache(config(**dict(INT8, kv_full_precision_dtype=None)))
    fill(plain, "a", k, v)
    assert torch.equal(cache.gather("a", 1)[0], plain.gather("a", 1)[0])
    cache.free("a")
    plain.free("a")


@pytest.mark.parametrize("move", ["fork", "swap"])
def test_copies_and_the_host_tier_carry_the_int8_scales(move):
    cache = PagedKVCache(config(**INT8, host_num_blocks=8))
    k, v = kv_data(10, seed=6)
    fill(cache, "p", k, v)
    before = [cache.gather("p", layer) for layer in range(L)]
    if move == "fork":      # the child's write into the shared last block copies it first
        cache.fork("p", "c")
        slots = cache.reserve("c", 1)
        ek, ev = kv_data(1, seed=7)
        for layer in range(L):
            cache.write(layer, slots, ek, ev)
        cache.commit("c", 1)
        assert cache.block_table("c")[-1] != cache.block_table("p")[-1]
        for layer in range(L):
            ck, cv = cache.gather("c", layer)
            assert torch.equal(ck[:10], before[layer][0]) and torch.equal(cv[:10], before[layer][1])
        cache.free("c")
    else:
        cache.swap_out("p")
        cache.swap_in("p")
    for layer in range(L):
        pk, pv = cache.gather("p", layer)
        assert torch.equal(pk, before[layer][0]) and torch.equal(pv, before[layer][1])
    cache.free("p")


def test_sizes_count_codes_and_row_parameters():
    base = dict(num_layers=30, num_kv_heads=3, head_dim=64, num_blocks=8, dtype="float32", kv_dtype="int4",
                kv_key_quant="block", kv_window=0)
    quant = CacheConfig(**base)
    fp32 = CacheConfig(**base, kv_full_precision_layers=(1, 2, 3))
    int8 = CacheConfig(**base, kv_full_precision_layers=(1, 2, 3), kv_full_precision_dtype="int8")
    per_layer_token = 2 * 3 * 64          # K and V elements of one layer and token
    row = 2 * 3 * (64 + 8)                # int8: 64 code bytes and a float32 scale and zero per row
    q_layer = 2 * 3 * quant.quant_head_bytes
    assert int8.bytes_per_token == fp32.bytes_per_token - 3 * (4 * per_layer_token - row)
    assert int8._row_bytes_per_token == 27 * q_layer + 3 * row
    # the window arena holds the int4 layers' rows only: three fewer layers than without
    assert int8.window_bytes == fp32.window_bytes == quant.window_bytes * 27 // 30
    # a quarter of a float32 layer's bytes: 3 int8 layers cost what one float32 layer does, about
    assert int8.sequence_bits_per_element(8192) < CacheConfig(**base, kv_full_precision_layers=(1,)) \
        .sequence_bits_per_element(8192) < fp32.sequence_bits_per_element(8192)


def test_the_fingerprint_tells_int8_layers_from_model_precision_ones():
    a = PagedKVCache(config(**INT8))
    b = PagedKVCache(config(**dict(INT8, kv_full_precision_dtype=None)))
    fa, fb = kv_format(a.store), kv_format(b.store)
    assert fa != fb and fa["kv_full_precision_dtype"] == "int8" and fb["kv_full_precision_dtype"] is None


@pytest.mark.parametrize("kw, err, match", [
    (dict(kv_full_precision_dtype="int4"), InvalidArgumentError,
     r"^kv_full_precision_dtype: expected None \(the model dtype\) or 'int8', got 'int4'$"),
    (dict(kv_full_precision_dtype=8), ArgumentTypeError, r"^kv_full_precision_dtype: expected None or 'int8', got 8$"),
    (dict(kv_dtype=None, kv_key_quant=None, kv_window=None, kv_full_precision_layers=()), InvalidArgumentError,
     r"^kv_full_precision_dtype: expected its default for an unquantized cache"),
])
def test_the_option_is_refused_where_it_makes_no_sense(kw, err, match):
    with pytest.raises(err, match=match):
        config(**dict(INT8, **kw))


def test_paged_attention_reads_the_int8_layers_as_the_gather_does():
    from pagedkv.ops import paged_attention

    cache = PagedKVCache(config(**INT8))
    k, v = kv_data(12, seed=9)
    fill(cache, "a", k, v)
    store = cache.store
    gk, gv = cache.gather("a", 0)
    q = torch.randn(1, 2 * H, D, generator=torch.Generator().manual_seed(1))
    table = torch.tensor(cache.block_table("a"), dtype=torch.int32)
    scale, zero = store.layer_scales(0)
    out = paged_attention(q, store.layer(0), torch.tensor([0, len(table)], dtype=torch.int32), table,
                          torch.tensor([12], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
                          layout=store.layout, kv_scale=scale, kv_zero=zero, layer_format=store.layer_format(0))
    kh, vh = gk.repeat_interleave(2, dim=1).double(), gv.repeat_interleave(2, dim=1).double()
    w = torch.softmax(torch.einsum("hd,thd->ht", q[0].double(), kh) / D ** 0.5, dim=-1)
    want = torch.einsum("ht,thd->hd", w, vh)
    assert float((out[0].double() - want).abs().max()) < 1e-5
    assert not torch.allclose(expected_quantized(cache.config, k), gk)   # the int8 layer is not int4
    cache.free("a")
