"""Layer groups in the manager (PagedKVCache) and in PagedCache: slots per group, KV of
each layer in its group's blocks, hybrid prefix hits, and greedy generation of tiny
sliding-window models identical to DynamicCache."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from pagedkv.config.options import CacheConfig
from pagedkv.errors import InvalidArgumentError, OutOfBlocksError
from pagedkv.integrations.transformers import PagedCache
from pagedkv.manager.cache import PagedKVCache
from pagedkv.testing.batches import left_pad
from pagedkv.testing.sliding_models import tiny_gemma2, tiny_gemma3, tiny_mistral, tiny_qwen2

BS = 4


def hybrid(num_blocks=64, window=6, windows=None, **kw) -> PagedKVCache:
    windows = windows or (window, 0, window, 0)      # groups: 0 = full (layers 1, 3), 1 = sliding (0, 2)
    cfg = CacheConfig(num_layers=4, num_kv_heads=2, head_dim=8, block_size=BS, num_blocks=num_blocks,
                      dtype="float32", layer_windows=windows, **kw)
    return PagedKVCache(cfg)


def kv_of(layer, positions):
    """A distinct K for every (layer, position); V is its negation."""
    p = torch.as_tensor(positions, dtype=torch.float32)
    return (1000.0 * layer + p)[:, None, None].expand(len(p), 2, 8).contiguous()


def fill(kv, seq, tokens, start=0):
    slots = kv.reserve(seq, len(tokens))
    for layer in range(4):
        k = kv_of(layer, range(start, start + len(tokens)))
        kv.write(layer, slots, k, -k)
    kv.commit(seq, len(tokens))
    return slots


def test_reserve_gives_slots_per_group_and_layers_read_their_own():
    kv = hybrid(window=6)
    kv.add_sequence("a", list(range(10)))
    slots = fill(kv, "a", list(range(10)))
    assert slots.shape == (2, 10)
    assert not set(slots[0].tolist()) & set(slots[1].tolist())     # the groups never share a block
    for layer in range(4):
        k, v, cu, pos = kv.gather_window(["a"], layer)
        # full layers: everything; sliding (window 6): position 10 sees 5.., so block 1 on
        want = list(range(10)) if layer % 2 else list(range(4, 10))
        assert pos.tolist() == want
        assert torch.equal(k, kv_of(layer, want)) and torch.equal(v, -kv_of(layer, want))
        assert cu.tolist() == [0, len(want)]
    assert kv.released_tokens("a", group=1).tolist() == [4]
    assert kv.released_tokens("a", group=0).tolist() == [0]
    assert kv.block_tables(["a"], pad=-7, group=1)[0].tolist()[0] == -7
    indptr, indices, _ = kv.page_table_csr(["a"], group=1)
    assert indices.tolist() == kv.block_table("a", group=1)[1:].tolist()
    kv.free("a")


def test_decode_stream_holds_the_window_in_the_sliding_group():
    kv = hybrid(num_blocks=128, window=8)
    kv.add_sequence(0, [1, 2, 3])
    kv.reserve(0, 3)
    kv.commit(0, 3)
    for _ in range(200):
        kv.advance(np.array([0], np.int64), np.array([5], np.int32))
    held = [int((kv.block_table(0, group=g) >= 0).sum()) for g in (0, 1)]
    assert held[0] == -(-kv.num_reserved(0) // BS)         # full group: every block
    assert held[1] <= -(-(8 - 1) // BS) + 2                # sliding group: the window
    kv.check_invariants()
    kv.free(0)


def test_out_of_blocks_in_any_group_changes_nothing():
    kv = hybrid(num_blocks=10, window=6)
    kv.add_sequence("a")
    fill(kv, "a", list(range(8)))
    before = (kv.pool.num_free_blocks, [kv.block_table("a", group=g).tolist() for g in (0, 1)], kv.num_reserved("a"))
    with pytest.raises(OutOfBlocksError, match=r"reserve needs \d+ block\(s\), \d+ free"):
        kv.reserve("a", 24)
    assert (kv.pool.num_free_blocks, [kv.block_table("a", group=g).tolist() for g in (0, 1)],
            kv.num_reserved("a")) == before
    kv.free("a")


def test_truncate_refused_by_the_sliding_group_changes_no_group():
    kv = hybrid(window=6)
    kv.add_sequence("a")
    fill(kv, "a", list(range(19)))
    tables = [kv.block_table("a", group=g).tolist() for g in (0, 1)]
    with pytest.raises(InvalidArgumentError, match=r"num_tokens: expected at most 2 for sequence 'a'"):
        kv.truncate("a", 3)
    assert [kv.block_table("a", group=g).tolist() for g in (0, 1)] == tables and kv.num_tokens("a") == 19
    kv.truncate("a", 2)
    assert kv.num_tokens("a") == 17
    kv.check_invariants()
    kv.free("a")


def test_fork_and_free_cover_every_group():
    kv = hybrid(window=6)
    kv.add_sequence("a")
    fill(kv, "a", list(range(13)))
    kv.fork("a", "b")
    for g in (0, 1):
        assert kv.block_table("b", group=g).tolist() == kv.block_table("a", group=g).tolist()
    kv.check_invariants()
    kv.free(["a", "b"])
    assert kv.stats().allocated_blocks == 0


def test_block_moves_and_bad_groups_are_refused():
    kv = hybrid()
    kv.add_sequence("a")
    fill(kv, "a", list(range(5)))
    with pytest.raises(InvalidArgumentError, match=r"group: expected a layer group in \[0, 2\), got 2"):
        kv.block_table("a", group=2)
    with pytest.raises(InvalidArgumentError, match=r"layer: expected an int in \[0, 4\), got 4"):
        kv.gather_window(["a"], 4)
    kv.free("a")


# ---- hybrid prefix hits ----------------------------------------------------------------------

def evict_one_or_two(kv):
    """Take every empty block and one or two cached-free ones (each group takes a block
    per 4 tokens, so the total is even); returns how many cached blocks were evicted."""
    empty = kv.pool.num_empty_blocks
    per_group = (empty + 2) // 2
    kv.add_sequence("x")
    kv.reserve("x", per_group * BS)
    return 2 * per_group - empty


def run_prompt(kv, seq, prompt):
    kv.add_sequence(seq, prompt)
    start = kv.num_tokens(seq)
    fill(kv, seq, prompt[start:], start)
    kv.free(seq)


def test_full_group_hit_limited_by_the_sliding_group():
    kv = hybrid(num_blocks=40, window=6)
    prompt = list(range(100, 125))                  # 6 full blocks + 1 token
    run_prompt(kv, "a", prompt)
    # The sliding group released its early blocks while "a" ran, so they lead the
    # eviction order; taking one block evicts the sliding group's first block.
    assert evict_one_or_two(kv) in (1, 2)
    match = kv.match_prefix_groups(prompt)
    assert match["per_group"][0] == 24 and match["per_group"][1] == 0
    assert match["limited_by"] == 1 and match["tokens"] == 0 == kv.match_prefix(prompt)
    kv.free("x")
    assert kv.add_sequence("b", prompt) == 0
    assert kv.stats().group_hit_limits == (0, 1)
    kv.free("b")


def test_sliding_group_hit_limited_by_the_full_group():
    kv = hybrid(num_blocks=24, window=64)
    prompt = list(range(100, 113))                  # 3 full blocks + 1 token, all inside the window
    run_prompt(kv, "a", prompt)
    # Freed tail first, group 0 (full) first: its last block leads the eviction order.
    evicted = evict_one_or_two(kv)
    hit = (3 - evicted) * BS
    match = kv.match_prefix_groups(prompt)
    assert match["per_group"] == [hit, 12] and match["limited_by"] == 0 and match["tokens"] == hit
    kv.free("x")
    assert kv.add_sequence("b", prompt) == hit
    assert kv.stats().group_hit_limits == (1, 0)
    # the hit blocks hold "a"'s KV, in each group's own layers
    for layer in range(4):
        k, _, _, pos = kv.gather_window(["b"], layer)
        assert pos.tolist() == list(range(hit)) and torch.equal(k, kv_of(layer, range(hit)))
    kv.free("b")


def test_groups_never_share_a_prefix_block():
    kv = hybrid(window=64)
    prompt = list(range(9))
    run_prompt(kv, "a", prompt)
    kv.add_sequence("b", prompt)
    a0, a1 = (kv.block_table("b", group=g).tolist() for g in (0, 1))
    assert len(a0) == len(a1) == 2 and not set(a0) & set(a1)
    kv.free("b")


def test_blocks_to_admit_counts_every_group():
    kv = hybrid(window=64)
    assert kv.blocks_to_admit(list(range(9))) == 2 * 3
    run_prompt(kv, "a", list(range(9)))
    assert kv.blocks_to_admit(list(range(9))) == 2 * 3     # 2 hit blocks per group, revived from cached-free
    assert kv.can_admit(list(range(9)))


# ---- PagedCache: transformers' sliding layers ---------------------------------------------------

def paged(model, num_blocks=256, block_size=4) -> PagedKVCache:
    cfg = CacheConfig.from_hf_config(model.config, num_blocks=num_blocks, block_size=block_size,
                                     dtype=torch.float32, shuffle_free_blocks=3)
    return PagedKVCache(cfg)


MODELS = {"mistral": lambda: tiny_mistral(window=8), "gemma2": lambda: tiny_gemma2(window=8),
          "gemma3": lambda: tiny_gemma3(window=8), "qwen2": lambda: tiny_qwen2(window=8)}


@pytest.fixture(scope="module", params=sorted(MODELS))
def sliding_model(request):
    return MODELS[request.param]()


def test_layers_report_is_sliding(sliding_model):
    model, _ = sliding_model
    kv = paged(model)
    cache = PagedCache(kv)
    ref = DynamicCache(config=model.config)
    assert [layer.is_sliding for layer in cache.layers] == [layer.is_sliding for layer in ref.layers]
    assert any(layer.is_sliding for layer in cache.layers)


def test_greedy_matches_dynamic_cache_batch_one(sliding_model):
    model, _ = sliding_model
    kv = paged(model)
    ids = torch.randint(3, 250, (1, 21), generator=torch.Generator().manual_seed(1))   # prompt > window
    gen = dict(max_new_tokens=24, do_sample=False, attention_mask=torch.ones_like(ids))
    ref = model.generate(ids, past_key_values=DynamicCache(config=model.config), **gen)
    with PagedCache(kv) as cache:
        cache.admit(ids)
        out = model.generate(ids, past_key_values=cache, **gen)
        plan = kv.config.layer_groups
        sliding = [g.index for g in plan.groups if g.window]
        for g in sliding:                # the window moved: blocks were released along the way
            assert kv.released_tokens(cache.seq_ids, group=g)[0] > 0
    assert out.tolist() == ref.tolist()
    assert len(set(out[0, 21:].tolist())) > 1


def test_greedy_matches_dynamic_cache_with_left_padding(sliding_model):
    model, tok = sliding_model
    kv = paged(model)
    g = torch.Generator().manual_seed(2)
    rows = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (13, 22, 5)]
    ids, mask = left_pad(rows, tok.pad_token_id)
    gen = dict(max_new_tokens=20, do_sample=False, attention_mask=mask)
    ref = model.generate(ids, past_key_values=DynamicCache(config=model.config), **gen)
    with PagedCache(kv) as cache:
        cache.admit(ids, mask)
        out = model.generate(ids, past_key_values=cache, **gen)
    assert out.tolist() == ref.tolist()


def test_mask_sizes_and_returned_columns_match_dynamic_cache(sliding_model):
    model, _ = sliding_model
    kv = paged(model)
    ids = torch.randint(3, 250, (1, 11), generator=torch.Generator().manual_seed(3))
    ref = DynamicCache(config=model.config)
    with PagedCache(kv) as cache:
        with torch.no_grad():
            for c in (ref, cache):
                model(ids, past_key_values=c, use_cache=True)
                model(ids[:, :1], past_key_values=c, use_cache=True)
        for layer in range(len(cache.layers)):
            assert cache.get_mask_sizes(1, layer) == ref.get_mask_sizes(1, layer)
        assert cache.get_seq_length() == ref.get_seq_length() == 12
        k = torch.randn(1, 2, 1, 16)
        for layer in range(len(cache.layers)):
            got, _ = cache.update(k, k, layer)
            want, _ = ref.update(k, k, layer)
            assert got.shape == want.shape
            assert torch.allclose(got, want, atol=1e-5)


def test_attention_sinks_are_refused_by_paged_cache():
    model, _ = tiny_mistral(window=8)
    cfg = CacheConfig.from_hf_config(model.config, num_blocks=16, block_size=4, dtype=torch.float32,
                                     attention_sinks=2)
    kv = PagedKVCache(cfg)
    with pytest.raises(InvalidArgumentError, match=r"kv: expected a PagedKVCache without attention sinks"):
        PagedCache(kv)


def test_prefix_hits_of_unequal_rows_keep_the_window(sliding_model):
    """A row whose cached prefix reaches past the batch's common point keeps only what
    the sliding layers can still serve; generation still equals DynamicCache."""
    model, tok = sliding_model
    kv = paged(model)
    g = torch.Generator().manual_seed(4)
    shared = torch.randint(3, 250, (30,), generator=g).tolist()
    with PagedCache(kv) as cache:        # the first request leaves its blocks cached
        first = torch.tensor([shared])
        cache.admit(first)
        model.generate(first, past_key_values=cache, max_new_tokens=2, do_sample=False,
                       attention_mask=torch.ones_like(first))
    rows = [shared + torch.randint(3, 250, (3,), generator=g).tolist(), torch.randint(3, 250, (6,), generator=g).tolist()]
    ids, mask = left_pad(rows, tok.pad_token_id)
    gen = dict(max_new_tokens=12, do_sample=False, attention_mask=mask)
    ref = model.generate(ids, past_key_values=DynamicCache(config=model.config), **gen)
    assert kv.match_prefix(rows[0]) >= 28
    with PagedCache(kv) as cache:
        hits = cache.admit(ids, mask)
        # row 1 has 27 padding columns and no hit: the common point is column 27, so row 0
        # keeps 24 of its 28 cached tokens (27, block-aligned) instead of all of them
        assert hits.tolist() == [24, 0]
        out = model.generate(ids, past_key_values=cache, **gen)
    assert out.tolist() == ref.tolist()


def test_admit_caps_fixed_point():
    from pagedkv.integrations.hf_windows import admit_caps

    # rows: pads 0 and 3; hits 28 and 0; window 8, blocks of 4: the common point is 3
    assert admit_caps(np.array([28, 0]), np.array([0, 3]), 4, 8).tolist() == [4, 0]
    # equal rows keep everything
    assert admit_caps(np.array([12, 12]), np.array([0, 0]), 4, 8).tolist() == [12, 12]
    # pads 2 apart never align on blocks of 4: the common point falls until the window's
    # own slack (W - 1 = 8 tokens of recomputed excess) covers both rows
    assert admit_caps(np.array([16, 16]), np.array([0, 2]), 4, 9).tolist() == [8, 8]
    assert admit_caps(np.array([16, 16]), np.array([0, 2]), 4, 4).tolist() == [0, 0]


@pytest.mark.parametrize("kv_dtype", ["int8", "int4", "int3"])
def test_quantized_store_with_layer_groups(kv_dtype):
    kv = hybrid(window=6, kv_dtype=kv_dtype, kv_window=0)
    kv.add_sequence("a")
    fill(kv, "a", list(range(10)))
    for layer in range(4):
        k, v, _, pos = kv.gather_window(["a"], layer)
        want = kv_of(layer, pos.tolist())       # layers are 1000 apart: a wrong slot is far off
        for got, ref in ((k, want), (v, -want)):
            err = (got - ref).norm(dim=(1, 2))
            assert (err <= 0.2 * ref.norm(dim=(1, 2)) + 1.0).all()
    kv.free("a")


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_full_precision_layers_with_layer_groups(kv_dtype):
    """Layer 1 (full group, slot 0) in model precision: its slot is exact in every
    group, so layer 0 (the sliding group's slot 0) reads exactly too; layers 2 and 3
    stay quantized. The sizes count one model-precision slot."""
    kv = hybrid(window=6, kv_dtype=kv_dtype, kv_window=0, kv_full_precision_layers=(1,))
    c = kv.config
    assert c.full_precision_slots == (0,) and c.quantized_slots == (1,)
    assert kv.store.layer(0).dtype == torch.float32 and kv.store.layer(1).dtype != torch.float32
    assert not kv.store.is_quantized_layer(0) and kv.store.is_quantized_layer(1)
    plain = hybrid(window=6, kv_dtype=kv_dtype, kv_window=0).config
    assert c.bytes_per_block > plain.bytes_per_block
    kv.add_sequence("a")
    fill(kv, "a", list(range(10)))
    for layer in range(4):
        k, v, _, pos = kv.gather_window(["a"], layer)
        want = kv_of(layer, pos.tolist())
        if layer in (0, 1):
            assert torch.equal(k, want) and torch.equal(v, -want)
        else:
            err = (k - want).norm(dim=(1, 2))
            assert (err <= 0.2 * want.norm(dim=(1, 2)) + 1.0).all()
    kv.free("a")
    with pytest.raises(InvalidArgumentError, match=r"kv_full_precision_layers: expected at least one quantized layer "
                                                   r"slot \(with layer groups"):
        hybrid(kv_dtype="int8", kv_full_precision_layers=(1, 2))     # slots 0 and 1: nothing left quantized


def test_assisted_generation_with_sliding_layers_matches_plain_greedy(monkeypatch):
    """The draft's rejected tokens are rolled back past the window: PagedCache holds
    what the sliding layers release while the past is recorded, and releases it at each
    crop. The output equals plain greedy decoding."""
    from transformers import MistralForCausalLM

    model, tok = tiny_mistral(window=8)
    draft, _ = tiny_mistral(window=8, seed=5)
    with torch.no_grad():      # propose the plain model's choice shifted by one id: mostly rejected
        draft.lm_head.weight = torch.nn.Parameter(torch.roll(draft.lm_head.weight.detach(), 1, 0))
    draft.generation_config.assistant_confidence_threshold = 0.0
    draft.generation_config.num_assistant_tokens = 4
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    assert isinstance(draft, MistralForCausalLM)
    ids = torch.randint(3, 250, (1, 19), generator=torch.Generator().manual_seed(5))
    kw = dict(max_new_tokens=24, do_sample=False, pad_token_id=tok.pad_token_id, attention_mask=torch.ones_like(ids))
    plain = model.generate(ids, past_key_values=DynamicCache(config=model.config), **kw)
    kv = paged(model, num_blocks=128)
    crops = []
    orig = PagedCache.crop
    monkeypatch.setattr(PagedCache, "crop", lambda cache, n: (crops.append(n), orig(cache, n))[1])
    with PagedCache(kv) as cache:
        out = model.generate(ids, past_key_values=cache, assistant_model=draft, **kw)
        # every crop released what left the window: the sequence holds its window only
        assert kv.released_tokens(cache.seq_ids, group=0)[0] > 0
        assert (kv.block_table(cache.seq_ids[0], group=0) >= 0).sum() <= -(-(8 - 1) // 4) + 2
    assert out.tolist() == plain.tolist()
    assert sum(n < 0 for n in crops) >= 3, f"too few rollbacks: {crops}"
    kv.check_invariants()


# ---- hostile input to the new arguments ------------------------------------------------------

BAD = [-1, 2, 2**63, 1.5, float("nan"), True, "0", b"0", np.uint64(2**64 - 1), np.float64(1.0), [0], object(),
       np.array([0])]


def observe(kv, groups):
    seqs = tuple((s, kv.num_tokens(s), kv.num_reserved(s),
                  tuple(tuple(kv.block_table(s, group=g).tolist()) for g in range(groups)))
                 for s in sorted(kv.sequences(), key=repr))
    return seqs, tuple(kv.pool.ref_cnt.tolist()), tuple(map(tuple, kv.pool.free_lists()))


@pytest.mark.parametrize("layered", [True, False])
def test_bad_group_layer_hold_and_cap_arguments_are_typed_errors(layered):
    from pagedkv.errors import PagedKVError

    kv = hybrid(window=6) if layered else PagedKVCache(CacheConfig(num_layers=4, num_kv_heads=2, head_dim=8,
                                                                   block_size=BS, num_blocks=64, dtype="float32"))
    groups = 2 if layered else 1
    kv.add_sequence(0, list(range(9)))
    fill(kv, 0, list(range(9)))
    k = torch.zeros(1, 2, 8)
    calls = {
        "block_tables(group=)": lambda v: kv.block_tables([0], group=v),
        "page_table_csr(group=)": lambda v: kv.page_table_csr([0], group=v),
        "slot_mapping(group=)": lambda v: kv.slot_mapping(0, 0, 1, group=v),
        "block_table(group=)": lambda v: kv.block_table(0, group=v),
        "released_tokens(group=)": lambda v: kv.released_tokens([0], group=v),
        "gather_window(layer)": lambda v: kv.gather_window([0], v),
        "hold_window(hold)": lambda v: kv.hold_window([0], v),
        "add_sequence(max_cached_tokens=)": lambda v: (kv.add_sequence(9, [1, 2, 3, 4, 5], max_cached_tokens=v),
                                                      kv.free(9)),
        "write(layer)": lambda v: kv.write(v, np.full((groups, 1), -1, np.int64) if layered else
                                           np.full(1, -1, np.int64), k, k),
    }
    valid = {("block_tables(group=)", 1), ("page_table_csr(group=)", 1), ("slot_mapping(group=)", 1),
             ("block_table(group=)", 1), ("released_tokens(group=)", 1), ("gather_window(layer)", 2),
             ("write(layer)", 2)}
    for name, call in calls.items():
        for v in BAD:
            before = observe(kv, groups)
            try:
                call(v)
            except PagedKVError:
                assert observe(kv, groups) == before, f"{name} {v!r}: a failing call changed the cache"
            else:
                ok = (type(v) is int and (name, v) in valid and (layered or "group" not in name)) or \
                    (name == "hold_window(hold)" and v is True) or \
                    (name.startswith("add_sequence") and type(v) is int and v >= 0)
                assert ok, f"{name} accepted {v!r}"
    kv.free(0)


def test_pin_prefix_pins_every_group_and_events_name_the_namespace():
    kv = hybrid(window=64, enable_kv_events=True)
    prompt = list(range(13))
    kv.add_sequence("a", prompt, cache_salt="s")
    fill(kv, "a", prompt)
    kv.free("a")
    free = kv.pool.num_free_blocks
    assert kv.pin_prefix(prompt, cache_salt="s") == 12
    assert len(kv.pool.pinned_blocks()) == 6      # 3 full blocks in each of the 2 groups
    assert kv.pool.num_free_blocks == free - 6    # pinned blocks are not evictable
    assert kv.unpin_prefix(prompt, cache_salt="s") == 12
    assert len(kv.pool.pinned_blocks()) == 0 and kv.pool.num_free_blocks == free
    stored = [e for e in kv.drain_events() if type(e).__name__ == "BlockStored"]
    assert sum(len(e.block_hashes) for e in stored) == 6
    assert all(e.namespace == ("s", None) for e in stored)
