"""Block keys (``kv_key_quant="block"``): full blocks' keys requantized per channel,
through the store and the manager, against the reference definition in pagedkv.format.quant."""
import numpy as np
import pytest
import torch
from test_lowbit_store import BS, D, H, L, config, expected_quantized, fill, kv_data

from pagedkv import CacheConfig, PagedKVCache
from pagedkv.config.planner import plan
from pagedkv.errors import InvalidArgumentError
from pagedkv.format.fingerprint import kv_format
from pagedkv.format.quant import quantize_key_channels
from pagedkv.store.kvstore import KVStore


def block_config(**kw):
    return config(kv_dtype="int4", kv_key_quant="block", **kw)


def expected_keys(cfg, k, window=0):
    """What a block-keys cache reads for keys ``k`` written from position 0: whole
    blocks per channel, the partial tail per token, the newest ``window`` exact."""
    full = k.shape[0] // BS * BS
    out = expected_quantized(cfg, k).clone()
    if full:   # codes of cfg.kv_key_bits (5 by default: the high bit in the rows' parameters)
        codes, s, z = quantize_key_channels(k[:full].reshape(-1, BS, H, D), cfg.kv_key_bits)
        per_channel = (codes.float() * s.unsqueeze(1).float() + z.unsqueeze(1).float()).to(k.dtype)
        out[:full] = per_channel.reshape(full, H, D)
    if window:
        out[-window:] = k[-window:]
    return out


def gathers(cache, seq):
    return [cache.gather(seq, layer) for layer in range(L)]


# -- configuration and sizes ---------------------------------------------------------------


def test_sizes_count_the_per_channel_parameters_and_the_staging_window():
    cfg = block_config(head_dim=64, kv_window=0, kv_window_sequences=3)
    token = config(kv_dtype="int4", head_dim=64, kv_window=0)
    assert cfg.kv_key_quant == "block" and token.kv_key_quant == "token" and cfg.block_keys
    # bfloat16 scale and zero per (layer, head, channel) per block: 32 bits over BS keys
    assert cfg.key_param_bytes_per_block == L * H * 64 * 4
    assert cfg.bits_per_element == token.bits_per_element + 16 / BS
    assert cfg.bytes_per_block == token.bytes_per_block + cfg.key_param_bytes_per_block
    assert cfg.window_blocks == 3 and token.window_blocks == 0   # staging exists without a window
    store = KVStore(cfg)
    assert store.key_scale.shape == store.key_zero.shape == (L, 24, H, 64)
    assert store.key_scale.dtype == torch.bfloat16 and store.window is not None
    assert store.nbytes == cfg.total_bytes
    assert [a[0] for a in kv_format(store)["arenas"]] == ["uint8", "float32", "float32", "bfloat16", "bfloat16"]
    assert kv_format(store) != kv_format(KVStore(token))


def test_budget_and_plan_count_block_keys():
    cfg = block_config(num_blocks=None, memory_budget=4 << 20)
    assert cfg.resolved_num_blocks == ((4 << 20) - cfg.window_bytes) // cfg.bytes_per_block
    assert KVStore(cfg).nbytes == cfg.total_bytes <= 4 << 20
    hf = dict(num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128)
    c = CacheConfig.from_hf_config(hf, num_blocks=4, kv_dtype="int4", kv_key_quant="block")
    assert c.bits_per_element == 5.0 + 1.0  # blocks of 16: 2 bits per key, 1 per element
    p = plan(hf, "4GiB", 200_000, dtype="float16", kv_dtype="int4", kv_key_quant="block")
    p4 = plan(hf, "4GiB", 200_000, dtype="float16", kv_dtype="int4")
    assert p.bytes_per_block == p4.bytes_per_block + 28 * 8 * 128 * 4


@pytest.mark.parametrize("kw,match", [
    (dict(kv_dtype="int4", kv_key_quant="channel"), r"^kv_key_quant: expected 'token' or 'block', got 'channel'$"),
    (dict(kv_dtype="int8", kv_key_quant="block"),
     r"^kv_key_quant: expected 'token' for kv_dtype='int8' \('block' is int4 and int2 only\), got 'block'$"),
    (dict(kv_dtype="int3", kv_key_quant="block"), r"^kv_key_quant: expected 'token' for kv_dtype='int3'"),
    (dict(kv_key_quant="block"), r"^kv_key_quant: expected its default for an unquantized cache"),
])
def test_bad_key_modes_are_typed_errors(kw, match):
    with pytest.raises(InvalidArgumentError, match=match):
        config(**kw)


# -- what a read returns --------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("step", [None, 1, 3])
@pytest.mark.parametrize("window,rotation", [(0, True), (6, True), (0, False)])
def test_full_blocks_read_per_channel_the_tail_per_token_the_window_exact(layout, step, window, rotation):
    cfg = block_config(kv_window=window, layout=layout, kv_rotation=rotation)
    cache = PagedKVCache(cfg)
    token = PagedKVCache(config(kv_dtype="int4", kv_window=window, layout=layout, kv_rotation=rotation))
    k, v = kv_data(30, seed=1)
    fill(cache, "a", k, v, step=step)
    fill(token, "a", k, v, step=step)
    want = expected_keys(cfg, k, window)
    for layer, (gk, gv) in enumerate(gathers(cache, "a")):
        assert torch.equal(gk, want)
        assert torch.equal(gv, token.gather("a", layer)[1])   # values are not touched
    # per-channel keys beat per-token ones on keys with an outlier channel
    full = 28
    err_block = (cache.gather("a", 0)[0][:full] - k[:full]).abs().mean()
    err_token = (token.gather("a", 0)[0][:full] - k[:full]).abs().mean()
    assert err_block < 0.5 * err_token
    cache.free("a")
    token.free("a")


def test_half_precision_and_a_batch():
    cfg = block_config(kv_window=5, dtype="bfloat16")
    cache = PagedKVCache(cfg)
    data = [kv_data(n, seed=n, dtype=torch.bfloat16) for n in (9, 17, 3)]
    for i, (k, v) in enumerate(data):
        fill(cache, i, k, v)
    keys, _, cu = cache.gather_batch([0, 1, 2], 1)
    for i, (k, _) in enumerate(data):
        assert torch.equal(keys[cu[i]:cu[i + 1]], expected_keys(cfg, k, min(5, k.shape[0])))
    cache.free([0, 1, 2])


def test_a_block_whose_copies_left_the_window_keeps_per_token_keys():
    cfg = block_config(kv_window=0, kv_window_sequences=1)   # one staging block for everyone
    cache = PagedKVCache(cfg)
    ka, va = kv_data(BS, seed=3)
    kb, vb = kv_data(BS, seed=4)
    cache.add_sequence("a")
    cache.add_sequence("b")
    for i in range(BS):   # a and b interleave: each write takes the only staging slot
        for seq, k, v in (("a", ka, va), ("b", kb, vb)):
            slots = cache.reserve(seq, 1)
            for layer in range(L):
                cache.write(layer, slots, k[i:i + 1], v[i:i + 1])
            cache.commit(seq, 1)
    # each write took the slot from the other sequence's block, so neither filled there
    assert torch.equal(cache.gather("a", 0)[0], expected_quantized(cfg, ka))
    assert torch.equal(cache.gather("b", 0)[0], expected_quantized(cfg, kb))
    assert not bool(cache.store.key_scale.any())
    kc, vc = kv_data(BS, seed=5)
    fill(cache, "c", kc, vc, step=1)      # alone, the same writes seal
    assert torch.equal(cache.gather("c", 0)[0], expected_keys(cfg, kc))
    cache.free(["a", "b", "c"])


@pytest.mark.parametrize("window", [0, 6])
def test_a_rewrite_into_a_sealed_block_keeps_the_rows_before_it(window):
    cfg = block_config(kv_window=window)
    cache = PagedKVCache(cfg)
    k, v = kv_data(12, seed=5)
    fill(cache, "a", k, v)                     # three sealed blocks
    cache.truncate("a", 2)                     # roll back into the third block
    k2, v2 = kv_data(2, seed=6)
    slots = cache.reserve("a", 2)
    for layer in range(L):
        cache.write(layer, slots, k2, v2)
    cache.commit("a", 2)
    keys = torch.cat([k[:10], k2])
    # the third block was unsealed, its live rows requantized per token from their
    # window copies, then sealed again when the rewrite filled it
    want = expected_keys(cfg, keys, window)
    for layer in range(L):
        assert torch.equal(cache.gather("a", layer)[0], want)
    cache.truncate("a", 3)                     # a rollback with no rewrite keeps the seal
    for layer in range(L):
        want = expected_keys(cfg, keys)[:9]
        if window:
            want[-window:] = keys[9 - window:9]
        assert torch.equal(cache.gather("a", layer)[0], want)
    cache.free("a")


def test_a_rewrite_after_the_window_copies_are_gone_requantizes_the_per_channel_values():
    cfg = block_config(kv_window=0, kv_window_sequences=1)
    cache = PagedKVCache(cfg)
    k, v = kv_data(8, seed=7)
    fill(cache, "a", k, v)
    fill(cache, "b", *kv_data(2 * BS, seed=8))  # takes the only staging slot
    sealed = cache.gather("a", 0)[0]
    cache.truncate("a", 2)
    k2, v2 = kv_data(1, seed=9)
    slots = cache.reserve("a", 1)
    for layer in range(L):
        cache.write(layer, slots, k2, v2)
    cache.commit("a", 1)
    got = cache.gather("a", 0)[0]
    assert torch.equal(got[:4], sealed[:4])                      # the first block stays sealed
    assert torch.equal(got[4:6], expected_quantized(cfg, sealed[4:6]))   # per token, from per channel
    assert torch.equal(got[6:], expected_quantized(cfg, k2))
    cache.free(["a", "b"])


def test_a_reused_block_never_mixes_in_its_last_occupants_keys():
    cfg = block_config(kv_window=0, num_blocks=4)
    cache = PagedKVCache(cfg)
    fill(cache, "a", *kv_data(4 * BS, seed=10))   # every block sealed
    cache.free("a")
    cache.reset_prefix_cache()
    k, v = kv_data(4 * BS - 1, seed=11)
    fill(cache, "b", k, v, step=1)   # each block's first write unseals it; stale rows stop counting
    want = expected_keys(cfg, k)
    for layer in range(L):
        assert torch.equal(cache.gather("b", layer)[0], want)
    cache.free("b")


# -- blocks that move -------------------------------------------------------------------------


def test_copy_on_write_child_seals_its_own_copy():
    cfg = block_config(kv_window=0)
    cache = PagedKVCache(cfg)
    k, v = kv_data(6, seed=12)
    fill(cache, "p", k, v)               # one sealed block, one partial
    cache.fork("p", "c")
    k2, v2 = kv_data(2, seed=13)
    slots = cache.reserve("c", 2)        # fills the child's copy of the partial block
    for layer in range(L):
        cache.write(layer, slots, k2, v2)
    cache.commit("c", 2)
    assert torch.equal(cache.gather("p", 0)[0], expected_keys(cfg, k))
    assert torch.equal(cache.gather("c", 0)[0], expected_keys(cfg, torch.cat([k, k2])))
    cache.free(["p", "c"])


@pytest.mark.parametrize("window", [0, 3])
def test_swap_out_and_in_keeps_sealed_and_staged_blocks(window):
    cache = PagedKVCache(block_config(kv_window=window, host_num_blocks=16))
    k, v = kv_data(14, seed=14)
    fill(cache, "a", k, v)
    before = gathers(cache, "a")
    cache.swap_out("a")
    fill(cache, "filler", *kv_data(40, seed=15))   # reuses a's device blocks
    cache.free("filler")
    cache.swap_in("a")
    for layer, (gk, gv) in enumerate(gathers(cache, "a")):
        assert torch.equal(gk, before[layer][0]) and torch.equal(gv, before[layer][1])
    k2, v2 = kv_data(2, seed=16)          # the partial block still fills and seals
    slots = cache.reserve("a", 2)
    for layer in range(L):
        cache.write(layer, slots, k2, v2)
    cache.commit("a", 2)
    assert torch.equal(cache.gather("a", 0)[0], expected_keys(cache.config, torch.cat([k, k2]), window))
    cache.free("a")


def test_a_prefix_hit_reads_the_sealed_blocks():
    cfg = block_config(kv_window=0)
    cache = PagedKVCache(cfg)
    toks = list(range(100, 110))
    k, v = kv_data(10, seed=17)
    cache.add_sequence("a", toks)
    slots = cache.reserve("a", 10)
    for layer in range(L):
        cache.write(layer, slots, k, v)
    cache.commit("a", 10)
    cache.add_sequence("b", toks[:8] + [7, 7])
    hit = cache.num_tokens("b")
    assert hit == 8
    slots = cache.reserve("b", 2)
    k2, v2 = kv_data(2, seed=18)
    for layer in range(L):
        cache.write(layer, slots, k2, v2)
    cache.commit("b", 2)
    assert torch.equal(cache.gather("b", 0)[0], expected_keys(cfg, torch.cat([k[:8], k2])))
    cache.free(["a", "b"])


# -- refusals ----------------------------------------------------------------------------------


def test_rotated_domain_read_is_refused():
    cache = PagedKVCache(block_config(kv_window=0))
    fill(cache, "a", *kv_data(5))
    indptr, indices, lens = cache.page_table_csr(["a"])
    before = [t.clone() for t in cache.store.arenas]
    with pytest.raises(InvalidArgumentError, match=r"^rotated: expected False for a cache with kv_key_quant='block'"):
        cache.gather_pages(0, indptr, indices, lens, rotated=True)
    assert all(torch.equal(a, b) for a, b in zip(before, cache.store.arenas))
    cache.free("a")


def test_a_rejected_write_leaves_every_arena_and_the_staging_unchanged():
    store = KVStore(block_config(kv_window=0))
    k, v = kv_data(BS)
    store.write(0, torch.arange(BS), k, v)
    assert bool((store.key_scale[0, 0] != 0).all())
    before = [t.clone() for t in store.arenas] + [store.window.data.clone(), store.window.valid.clone()]
    with pytest.raises(InvalidArgumentError):
        store.write(0, torch.tensor([0, 1, 2, 24 * BS]), k, v)
    after = [t for t in store.arenas] + [store.window.data, store.window.valid]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert np.array_equal(store.window.slot_of[:1], [0])


def test_compaction_moves_sealed_blocks_and_the_partial_one_still_seals():
    cfg = block_config(kv_window=0)
    cache = PagedKVCache(cfg)
    fill(cache, "x", *kv_data(3 * BS, seed=19))       # occupies the low blocks
    k, v = kv_data(2 * BS + 2, seed=20)
    fill(cache, "a", k, v)
    cache.free("x")
    before = gathers(cache, "a")
    pairs = cache.compact(["a"])
    assert len(pairs) == 3                             # every block of a moved down
    for layer, (gk, gv) in enumerate(gathers(cache, "a")):
        assert torch.equal(gk, before[layer][0]) and torch.equal(gv, before[layer][1])
    k2, v2 = kv_data(2, seed=21)
    slots = cache.reserve("a", 2)
    for layer in range(L):
        cache.write(layer, slots, k2, v2)
    cache.commit("a", 2)
    assert torch.equal(cache.gather("a", 2)[0], expected_keys(cfg, torch.cat([k, k2])))
    cache.free("a")


def test_full_precision_layers_hold_no_block_key_parameters():
    cfg = block_config(kv_window=0, kv_full_precision_layers=(0,))
    cache = PagedKVCache(cfg)
    assert cache.store.key_scale.shape[0] == L - 1
    assert cfg.key_param_bytes_per_block == (L - 1) * H * D * 4 and cache.store.nbytes == cfg.total_bytes
    k, v = kv_data(9, seed=22)
    fill(cache, "a", k, v)
    assert torch.equal(cache.gather("a", 0)[0], k)
    for layer in (1, 2):
        assert torch.equal(cache.gather("a", layer)[0], expected_keys(cfg, k))
    cache.free("a")


def test_sliding_window_groups_seal_their_blocks_too():
    # layers 0 and 2 full attention, layer 1 a sliding window of 8: two layer groups
    cfg = block_config(kv_window=0, layer_windows=(0, 8, 0), num_blocks=48)
    cache = PagedKVCache(cfg)
    k, v = kv_data(4 * BS, seed=23)
    fill(cache, "a", k, v, step=1)
    want = expected_keys(cfg, k)
    for layer in (0, 2):
        assert torch.equal(cache.gather("a", layer)[0], want)
    keys, _, _, positions = cache.gather_window(["a"], 1)
    assert len(positions) < 4 * BS                      # the window released whole blocks
    assert torch.equal(keys, want[positions.long()])    # the blocks it keeps, sealed
    cache.free("a")


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("sequences", [1, 16])
def test_a_prefill_seals_every_block_it_writes_whole_whatever_the_staging_size(window, sequences):
    # one staging slot per sequence: a 7-block write keeps at most two blocks' copies,
    # but every block it writes whole is sealed from the write's own keys
    cfg = block_config(kv_window=window, kv_window_sequences=sequences)
    cache = PagedKVCache(cfg)
    k, v = kv_data(7 * BS + 1, seed=24)
    fill(cache, "a", k[:2], v[:2])                   # a partial first block, then the rest at once
    slots = cache.reserve("a", k.shape[0] - 2)
    for layer in range(L):
        cache.write(layer, slots, k[2:], v[2:])
    cache.commit("a", k.shape[0] - 2)
    want = expected_keys(cfg, k, window)
    for layer in range(L):
        got = cache.gather("a", layer)[0]
        assert torch.equal(got[BS:], want[BS:])
        # the first block was finished by the write from the window's copies of its first
        # rows; with one staging slot (kv_window=0) the first layer's write gave that slot
        # to the newest block, so the later layers keep that block's per-token keys. With
        # kv_window=5 the write's early blocks (none holds one of the newest 5 tokens)
        # take only slots no read needs, so the first block keeps its copies for every layer
        if sequences > 1 or layer == 0 or window:
            assert torch.equal(got[:BS], want[:BS])
        else:
            assert torch.equal(got[:BS], expected_quantized(cfg, k[:BS]))
    cache.free("a")
