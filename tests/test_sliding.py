"""Sliding-window layers: layer kinds from HF configs, layer groups, and the core's
release of blocks that left the window (BlockTables(window=, sinks=))."""
from __future__ import annotations

import numpy as np
import pytest

from pagedkv._core.pool import BlockPool
from pagedkv._core.prefix import PrefixIndex
from pagedkv._core.tables import BlockTables
from pagedkv.config.options import CacheConfig
from pagedkv.errors import InvalidArgumentError, OutOfBlocksError
from pagedkv.groups.layers import layer_windows_from_hf, plan_groups

SHAPE = dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def sliding_tables(num_blocks=64, bs=4, window=10, sinks=0, prefix=True):
    index = PrefixIndex(bs, num_blocks) if prefix else None
    pool = BlockPool(num_blocks, "lru", index=index)
    return pool, BlockTables(pool, bs, index, window=window, sinks=sinks)


def held(tables, key):
    return [i for i, b in enumerate(tables.blocks(key).tolist()) if b >= 0]


# ---- layer kinds from Hugging Face configs ------------------------------------------------

def test_layer_types_alternating():
    src = dict(SHAPE, layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=512)
    assert layer_windows_from_hf(src, 4) == (512, 0, 512, 0)


def test_mistral_sliding_window_makes_every_layer_slide():
    assert layer_windows_from_hf(dict(SHAPE, sliding_window=4096), 4) == (4096,) * 4
    assert layer_windows_from_hf(dict(SHAPE, sliding_window=None), 4) is None


def test_qwen2_max_window_layers():
    src = dict(SHAPE, use_sliding_window=True, sliding_window=64, max_window_layers=2)
    assert layer_windows_from_hf(src, 4) == (0, 0, 64, 64)
    assert layer_windows_from_hf(dict(src, use_sliding_window=False), 4) is None
    assert layer_windows_from_hf(dict(src, max_window_layers=4), 4) is None


def test_gemma_configs_without_layer_types_use_their_pattern():
    assert layer_windows_from_hf(dict(SHAPE, model_type="gemma2", sliding_window=16), 4) == (16, 0, 16, 0)
    six = layer_windows_from_hf(dict(SHAPE, model_type="gemma3_text", sliding_window=16), 6)
    assert six == (16, 16, 16, 16, 16, 0)


def test_all_full_layer_types_mean_no_groups():
    src = dict(SHAPE, layer_types=["full_attention"] * 4, sliding_window=8)
    assert layer_windows_from_hf(src, 4) is None
    cfg = CacheConfig.from_hf_config(src, num_blocks=8)
    assert cfg.layer_groups is None and cfg.layer_windows is None and cfg.arena_layers == 4


def test_transformers_config_objects():
    from transformers import Gemma2Config, MistralConfig, Qwen2Config

    g = CacheConfig.from_hf_config(Gemma2Config(num_hidden_layers=4, sliding_window=32, head_dim=8,
                                                num_attention_heads=2, num_key_value_heads=1), num_blocks=8)
    assert g.layer_windows == (32, 0, 32, 0)
    m = CacheConfig.from_hf_config(MistralConfig(num_hidden_layers=2, sliding_window=64, head_dim=8,
                                                 num_attention_heads=2, num_key_value_heads=1), num_blocks=8)
    assert m.layer_windows == (64, 64)
    q = CacheConfig.from_hf_config(Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=16,
                                               max_window_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                               hidden_size=16), num_blocks=8)
    assert q.layer_windows == (0, 16, 16, 16)


@pytest.mark.parametrize("src, match", [
    (dict(layer_types=["sliding_attention"] * 4, sliding_window=0), r"sliding_window: expected a window of at least 1"),
    (dict(layer_types=["sliding_attention"] * 4, sliding_window=-3), r"sliding_window: expected a window of at least 1"),
    (dict(layer_types=["sliding_attention", "chunked_attention"] * 2, sliding_window=8),
     r"layer_types: expected 'full_attention' or 'sliding_attention' entries, got 'chunked_attention' at index 1"),
    (dict(layer_types=["full_attention"] * 3), r"layer_types: expected 4 entries \(one per layer\), got 3"),
    (dict(use_sliding_window=True, sliding_window=8, max_window_layers=5),
     r"max_window_layers: expected an int in \[0, 4\], got 5"),
    (dict(use_sliding_window=True, sliding_window=8, max_window_layers=-1),
     r"max_window_layers: expected an int in \[0, 4\], got -1"),
])
def test_bad_hf_layer_kinds_are_typed_errors(src, match):
    with pytest.raises(InvalidArgumentError, match=match):
        CacheConfig.from_hf_config(dict(SHAPE, **src), num_blocks=8)


@pytest.mark.parametrize("kw, match", [
    (dict(layer_windows=(8, 0, 8, 0), attention_sinks=-1), r"attention_sinks: expected an int >= 0, got -1"),
    (dict(layer_windows=(8, 0, 8, 0), attention_sinks=8),
     r"attention_sinks: expected fewer than the window \(8 tokens, layer 0\), got 8"),
    (dict(layer_windows=(8, 0, -1, 0)), r"layer_windows: expected ints >= 0 \(0 = full attention\), got -1 at layer 2"),
    (dict(layer_windows=(8, 0)), r"layer_windows: expected 4 windows \(one per layer\), got \(8, 0\)"),
    (dict(attention_sinks=4), r"attention_sinks: expected 0 without sliding-window layers, got 4"),
])
def test_bad_group_settings_are_typed_errors(kw, match):
    with pytest.raises(InvalidArgumentError, match=match):
        CacheConfig(num_layers=4, num_kv_heads=2, head_dim=8, num_blocks=8, **kw)


# ---- layer groups ---------------------------------------------------------------------------

def test_alternating_layers_form_two_groups_and_halve_bytes_per_token():
    full = CacheConfig(num_layers=4, num_kv_heads=2, head_dim=8, num_blocks=8)
    mixed = CacheConfig(num_layers=4, num_kv_heads=2, head_dim=8, num_blocks=8, layer_windows=(8, 0, 8, 0))
    plan = mixed.layer_groups
    assert [(g.window, g.layers) for g in plan.groups] == [(0, (1, 3)), (8, (0, 2))]
    assert plan.layer_group == (1, 0, 1, 0) and plan.layer_slot == (0, 0, 1, 1)
    assert mixed.arena_layers == 2 and mixed.arena_shape[0] == 2
    assert mixed.bytes_per_token * 2 == full.bytes_per_token


def test_uneven_kinds_split_into_equal_groups():
    plan = plan_groups([16, 16, 16, 16, 16, 0], sinks=2)
    assert [(g.window, g.sinks, len(g.layers)) for g in plan.groups] == [(0, 0, 1)] + [(16, 2, 1)] * 5
    assert plan.slots_per_block == 1
    plan = plan_groups([16, 16, 16, 16, 0, 0])
    assert [g.layers for g in plan.groups] == [(4, 5), (0, 1), (2, 3)]
    assert plan_groups([0, 0, 0]) is None


def test_budget_counts_layer_slots():
    mixed = CacheConfig(num_layers=4, num_kv_heads=2, head_dim=8, memory_budget=2 * 2 * 4 * 2 * 8 * 4 * 10,
                        layer_windows=(8, 0, 8, 0), block_size=4, dtype="float32")
    assert mixed.resolved_num_blocks == 10    # 2 layer slots x K,V x 4 tokens x 2 heads x 8 dims x 4 bytes


# ---- the core: releasing blocks that left the window ----------------------------------------

def test_window_releases_leading_blocks_on_commit():
    pool, t = sliding_tables(bs=4, window=10)
    t.add(1)
    t.reserve(1, 20)
    t.commit(1, 20)
    # next query at position 20 sees (10, 20]: positions 11..19; blocks 0 and 1 end before 11
    assert held(t, 1) == [2, 3, 4]
    assert t.info(1)["num_dropped_blocks"] == 2
    assert pool.num_in_use_blocks == 3
    assert t.released_tokens(1).tolist() == [8]
    t.check_invariants()
    t.remove(1)
    assert pool.num_in_use_blocks == 0


def test_sinks_stay_and_the_window_follows():
    pool, t = sliding_tables(bs=4, window=8, sinks=3)
    t.add(1)
    slots = []
    for _ in range(30):
        slots += t.advance(1, np.array([7], np.int32)).tolist()
    t.commit(1, 1)
    # 30 committed: the window of position 30 starts at 23 (block 5); sink block 0 stays
    assert held(t, 1) == [0, 5, 6, 7]
    assert t.block_table(1, pad=-9)[0].tolist()[:5] == [t.blocks(1)[0], -9, -9, -9, -9]
    indptr, indices, last = t.csr(1)
    assert indptr.tolist() == [0, 4] and indices.tolist() == [b for b in t.blocks(1).tolist() if b >= 0]
    assert last.tolist() == [2]
    t.check_invariants()
    t.remove(1)


def test_slot_mapping_refuses_released_positions():
    pool, t = sliding_tables(bs=4, window=6)
    t.add(1)
    t.reserve(1, 16)
    t.commit(1, 16)
    with pytest.raises(InvalidArgumentError, match=r"starts, counts: expected a range of kept tokens of sequence 1 "
                                                   r"\(positions \[0, 8\) left the sliding window\), got \[6, 6 \+ 4\)"):
        t.slot_mapping(np.array([1]), np.array([6]), np.array([4]))
    assert t.slot_mapping(np.array([1]), np.array([8]), np.array([8])).size == 8
    t.remove(1)


def test_truncate_refuses_a_window_already_released_and_changes_nothing():
    pool, t = sliding_tables(bs=4, window=6)
    t.add(1)
    t.reserve(1, 19)
    t.commit(1, 19)
    # held from position 12 (the window of position 19 starts at 14): 17 tokens keep theirs
    before = (t.blocks(1).tolist(), t.num_computed(1), pool.num_in_use_blocks)
    with pytest.raises(InvalidArgumentError, match=r"num_tokens: expected at most 2 for sequence 1 \(the window "
                                                   r"of the tokens left must still be held; 3 blocks left it already\)"):
        t.truncate(1, 3)
    assert (t.blocks(1).tolist(), t.num_computed(1), pool.num_in_use_blocks) == before
    t.truncate(1, 2)
    assert t.num_computed(1) == 17
    t.check_invariants()
    t.remove(1)


def test_fork_shares_only_held_blocks():
    pool, t = sliding_tables(bs=4, window=6)
    t.add(1)
    t.reserve(1, 16)
    t.commit(1, 16)
    t.fork(1, 2)
    assert t.blocks(2).tolist() == t.blocks(1).tolist()
    assert sorted(np.asarray(pool.ref_cnt)[t.blocks(1)[t.blocks(1) >= 0]].tolist()) == [2, 2]
    t.remove([1, 2])
    assert pool.num_in_use_blocks == 0


def test_released_registered_blocks_stay_findable_until_evicted():
    pool, t = sliding_tables(bs=4, window=5)
    prompt = np.arange(16, dtype=np.int32)
    t.add(1, prompt)
    t.reserve(1, 16)
    t.commit(1, 16)
    assert t.info(1)["num_dropped_blocks"] == 3     # the window of position 16 starts at 12
    assert pool.num_cached_free_blocks == 3        # released, still a verified prefix
    assert len(t.index.match(prompt)) == 4
    t.remove(1)


def test_sliding_sequence_may_outgrow_the_pool():
    pool, t = sliding_tables(num_blocks=8, bs=4, window=8)
    t.add(1)
    for _ in range(200):                        # 50 pool-fulls of tokens in 8 blocks
        t.advance(1, np.array([1], np.int32))
    assert pool.num_in_use_blocks <= 4
    t.remove(1)


def test_full_attention_tables_still_stop_at_the_pool():
    pool = BlockPool(4, "lru")
    t = BlockTables(pool, 4)
    t.add(1)
    with pytest.raises(OutOfBlocksError):
        t.reserve(1, 17)
    t.remove(1)


@pytest.mark.parametrize("kw, match", [
    (dict(window=-1), r"window: expected an int >= 1 \(tokens\), or 0 for full attention, got -1"),
    (dict(window=8, sinks=8), r"sinks: expected fewer sink tokens than the window \(8\), got 8"),
    (dict(window=8, sinks=-2), r"sinks: expected an int >= 0, got -2"),
    (dict(sinks=2), r"sinks: expected 0 for full attention \(window=0\), got 2"),
])
def test_bad_window_arguments(kw, match):
    with pytest.raises(InvalidArgumentError, match=match):
        BlockTables(BlockPool(4, "lru"), 4, **kw)


def test_million_token_stream_holds_constant_blocks():
    """1,000,000 decode steps through a window of 4,096 tokens with 4 sinks: the
    sequence never holds more than its sink block, the window's blocks and one more."""
    bs, window, sinks = 16, 4096, 4
    pool, t = sliding_tables(num_blocks=600, bs=bs, window=window, sinks=sinks)
    t.add(1)
    bound = 1 + -(-(window - 1) // bs) + 1 + 1    # sink block, window, a partial block each end
    ids = np.array([5], np.int32)
    peak = 0
    for step in range(1_000_000):
        t.advance(1, ids)
        if step % 997 == 0:
            peak = max(peak, pool.num_in_use_blocks)
    peak = max(peak, pool.num_in_use_blocks)
    assert t.num_reserved(1) == 1_000_000
    assert peak <= bound
    assert pool.num_in_use_blocks >= window // bs      # the window itself is held
    assert t.blocks(1)[0] >= 0                         # the sink block was never released
    t.check_invariants()
    t.remove(1)
    assert pool.num_in_use_blocks == 0


# ---- the planner ---------------------------------------------------------------------------

PLAN_MODEL = dict(num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=64)


def test_plan_alternating_layers_counts_context_and_window_separately():
    from pagedkv.config.planner import plan

    full = plan(PLAN_MODEL, "1GiB", max_seq_len=1_000_000)
    mixed = plan(dict(PLAN_MODEL, layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=4096),
                 "1GiB", max_seq_len=1_000_000, attention_sinks=4)
    assert full.layer_groups == () and full.context_bytes_per_token == full.bytes_per_token
    assert full.constant_bytes_per_sequence == 0
    assert mixed.layer_groups == ("full x 2 layers", "sliding(window=4096, sinks=4) x 2 layers")
    assert mixed.context_bytes_per_token * 2 == full.context_bytes_per_token
    window_blocks = 1 + 4095 // 16 + 1 + 1           # sink block, window, a partial block at each end
    assert mixed.constant_bytes_per_sequence == window_blocks * mixed.bytes_per_block
    assert mixed.blocks_per_sequence == 1_000_000 // 16 + window_blocks
    assert mixed.num_blocks == 2 * full.num_blocks   # a block holds 2 layer slots instead of 4


def test_plan_all_sliding_sequence_cost_is_constant():
    from pagedkv.config.planner import plan

    model = dict(PLAN_MODEL, sliding_window=4096)
    long, short = (plan(model, "1GiB", max_seq_len=n) for n in (10_000_000, 100_000))
    assert long.context_bytes_per_token == 0
    assert long.blocks_per_sequence == short.blocks_per_sequence == 4095 // 16 + 2
    assert long.num_sequences == short.num_sequences > 0


def test_plan_cli_attention_sinks(tmp_path, capsys):
    import json

    from pagedkv.cli import main

    p = tmp_path / "config.json"
    p.write_text(json.dumps(dict(PLAN_MODEL, sliding_window=64)))
    assert main(["plan", "--model-config", str(p), "--budget", "64MiB", "--attention-sinks", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["layer_groups"] == ["sliding(window=64, sinks=8) x 4 layers"]
    assert out["constant_bytes_per_sequence"] == (1 + 4 + 1) * out["bytes_per_block"]
    assert main(["plan", "--model-config", str(p), "--budget", "64MiB", "--attention-sinks", "64"]) == 2
    assert "attention_sinks: expected fewer than the window (64 tokens, layer 0), got 64" in capsys.readouterr().err


def test_hold_keeps_released_blocks_for_a_rollback():
    pool, t = sliding_tables(bs=4, window=6)
    t.add(1)
    t.reserve(1, 12)
    t.commit(1, 12)
    t.hold_window(1)
    t.reserve(1, 8)
    t.commit(1, 8)                            # 20 tokens: the window starts at 15, nothing released
    assert t.info(1)["num_dropped_blocks"] == 1 and t.info(1)["holding"]
    t.fork(1, 2)
    assert t.info(2)["holding"]
    t.truncate(1, 8)                          # roll the 8 speculative tokens back
    assert t.num_computed(1) == 12
    t.check_invariants()
    t.slide(1)                                # nothing more left the window of position 12
    assert t.info(1)["num_dropped_blocks"] == 1
    t.hold_window(2, False)                   # ending the hold releases what left the window
    assert t.info(2)["num_dropped_blocks"] == 3 and not t.info(2)["holding"]
    t.check_invariants()
    t.remove([1, 2])
    assert pool.num_in_use_blocks == 0
