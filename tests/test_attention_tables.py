"""One block-tables class per attention type: FullAttentionTables and
SlidingWindowTables behind one protocol, picked by ``BlockTables(...)`` and, per layer
group, by the coordinator (GroupTables)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pagedkv import BlockPool, BlockTables, PrefixIndex
from pagedkv._core.sliding import SlidingWindowTables
from pagedkv._core.tables import FullAttentionTables, TablesBase
from pagedkv.config.options import CacheConfig
from pagedkv.errors import ArgumentTypeError, InvalidArgumentError, SequenceNotFoundError
from pagedkv.groups.layers import GroupPlan, LayerGroup, plan_groups
from pagedkv.groups.spec import SlidingWindowSpec
from pagedkv.groups.tables import TABLES_FOR, AttentionTables, GroupTables
from pagedkv.manager.cache import PagedKVCache


def pool_and_index(num_blocks=16, bs=4):
    index = PrefixIndex(bs, num_blocks)
    return BlockPool(num_blocks, "lru", index=index), index


@pytest.mark.parametrize("kw, cls", [
    ({}, FullAttentionTables),
    (dict(window=0), FullAttentionTables),
    (dict(window=8), SlidingWindowTables),
    (dict(window=8, sinks=2), SlidingWindowTables),
    (dict(window=np.int64(8)), SlidingWindowTables),
])
def test_block_tables_builds_the_class_of_its_attention_type(kw, cls):
    pool, index = pool_and_index()
    t = BlockTables(pool, 4, index, **kw)
    assert type(t) is cls
    assert isinstance(t, BlockTables) and isinstance(t, TablesBase) and isinstance(t, AttentionTables)
    assert t.window == kw.get("window", 0) and t.sinks == kw.get("sinks", 0)
    assert t.sink_blocks == -(-kw.get("sinks", 0) // 4)


def test_both_classes_implement_every_protocol_member():
    members = sorted({m for m in dir(AttentionTables) if not m.startswith("_")} | set(AttentionTables.__annotations__))
    assert {"add", "advance", "commit", "hold_window", "released_tokens", "window"} <= set(members)
    for cls in (FullAttentionTables, SlidingWindowTables):
        missing = [m for m in members if not hasattr(cls, m)]
        assert missing == [], (cls.__name__, missing)


@pytest.mark.parametrize("kw, err, match", [
    (dict(window=8), InvalidArgumentError,
     r"window: expected 0 \(FullAttentionTables keeps every block; SlidingWindowTables releases those "
     r"that left a window\), got 8"),
    (dict(sinks=2), InvalidArgumentError, r"sinks: expected 0 for full attention \(window=0\), got 2"),
    (dict(window=-1), InvalidArgumentError, r"window: expected an int >= 1 \(tokens\), or 0 for full attention, got -1"),
    (dict(window="8"), ArgumentTypeError, r"window: expected an int >= 1 \(tokens\), or 0 for full attention, got '8'"),
])
def test_full_attention_tables_refuse_a_window(kw, err, match):
    pool, index = pool_and_index()
    with pytest.raises(err, match=match):
        FullAttentionTables(pool, 4, index, **kw)
    assert pool.num_free_blocks == 16


@pytest.mark.parametrize("kw, err, match", [
    ({}, ArgumentTypeError, r"window: expected an int >= 1 \(tokens\) for a sliding window "
                            r"\(full attention: FullAttentionTables\), got None"),
    (dict(window=0), InvalidArgumentError, r"window: expected an int >= 1 \(tokens\) for a sliding window "
                                           r"\(full attention: FullAttentionTables\), got 0"),
    (dict(window=8, sinks=8), InvalidArgumentError, r"sinks: expected fewer sink tokens than the window \(8\), got 8"),
    (dict(window=8, sinks=-1), InvalidArgumentError, r"sinks: expected an int >= 0, got -1"),
])
def test_sliding_window_tables_refuse_full_attention(kw, err, match):
    pool, index = pool_and_index()
    with pytest.raises(err, match=match):
        SlidingWindowTables(pool, 4, index, **kw)


def test_full_attention_has_nothing_to_hold_or_slide_but_checks_its_keys():
    pool, index = pool_and_index()
    t = FullAttentionTables(pool, 4, index)
    t.add(1)
    t.reserve(1, 12)
    t.commit(1, 12)
    t.hold_window(1)
    t.slide(1)
    t.hold_window(1, False)
    assert t.blocks(1).tolist() == [b for b in t.blocks(1).tolist() if b >= 0] and len(t.blocks(1)) == 3
    assert t.released_tokens(1).tolist() == [0]
    with pytest.raises(SequenceNotFoundError, match="2"):
        t.hold_window(2)
    with pytest.raises(SequenceNotFoundError, match="2"):
        t.slide(np.array([1, 2], np.int64))
    t.check_invariants()
    t.remove(1)


def test_the_same_stream_releases_only_in_the_sliding_class():
    pool_f, index_f = pool_and_index(num_blocks=32)
    pool_s, index_s = pool_and_index(num_blocks=32)
    full = FullAttentionTables(pool_f, 4, index_f)
    sliding = SlidingWindowTables(pool_s, 4, index_s, window=6, sinks=1)
    for t in (full, sliding):
        t.add(7, np.arange(5, dtype=np.int32))
        t.reserve(7, 5)
        t.commit(7, 5)
        for step in range(20):
            t.advance(7, np.array([step], np.int32))
        t.check_invariants()
    assert full.released_tokens(7).tolist() == [0]
    assert pool_f.num_in_use_blocks == 7                 # 24 committed tokens + 1 reserved, all kept
    # position 24's query sees 19..24 and the sink (position 0): blocks 1-3 are released
    assert sliding.released_tokens(7).tolist() == [12]
    assert sliding.blocks(7).tolist()[1:4] == [-1] * 3
    assert pool_s.num_in_use_blocks == 4                 # the sink block, blocks 4-5, the reserved block 6
    full.remove(7)
    sliding.remove(7)


def hybrid_cache(windows=(6, 0, 6, 0), sinks=0) -> PagedKVCache:
    cfg = CacheConfig(num_layers=len(windows), num_kv_heads=2, head_dim=8, block_size=4, num_blocks=64,
                      dtype="float32", layer_windows=windows, attention_sinks=sinks)
    return PagedKVCache(cfg)


def test_a_grouped_cache_mixes_both_classes():
    kv = hybrid_cache(windows=(6, 0, 6, 6, 0, 6), sinks=2)
    plan = kv.config.layer_groups
    tables = kv._groups.tables
    assert [type(t) for t in tables] == [FullAttentionTables if g.window == 0 else SlidingWindowTables
                                         for g in plan.groups]
    assert {type(t) for t in tables} == {FullAttentionTables, SlidingWindowTables}
    assert [(t.window, t.sinks) for t in tables] == [(g.window, g.sinks) for g in plan.groups]
    kv.add_sequence("a", list(range(30)))
    kv.reserve("a", 30)
    kv.commit("a", 30)
    held = kv._groups.held_blocks(kv._ids.key("a"))
    assert held[0] == 8                                  # full attention keeps all 30 tokens' blocks
    assert all(h == 1 + 2 + 0 for h in held[1:])         # sink block, then the window of position 30
    kv.free("a")


class _ChunkedGroup(LayerGroup):
    @property
    def attention(self) -> str:
        return "chunked_local"


def test_the_coordinator_refuses_an_attention_type_without_tables():
    plan = plan_groups((6, 0))
    odd = _ChunkedGroup(**{f.name: getattr(plan.groups[1], f.name) for f in dataclasses.fields(LayerGroup)})
    bad = GroupPlan((plan.groups[0], odd), plan.layer_group, plan.layer_slot)
    pool, index = pool_and_index(num_blocks=32)
    with pytest.raises(InvalidArgumentError, match=r"layer_groups: expected attention types with block tables "
                                                   r"\(full, mla, sliding\), got 'chunked_local' in group 1"):
        GroupTables(pool, index, 4, bad, str)
    assert sorted(TABLES_FOR) == ["full", "mla", "sliding"]
    assert pool.num_free_blocks == 32


@dataclasses.dataclass(frozen=True)
class _EvenBoundaries(SlidingWindowSpec):
    """A type whose reuse needs something at exactly a boundary (as a recurrent state's
    snapshot): here, only after an even number of blocks."""

    def longest_hit(self, tables, matched, cap):
        return min(matched, cap) // 2 * 2


def test_a_per_type_hit_rule_lowers_the_hit_every_group_agrees_on():
    pool, index = pool_and_index(num_blocks=32)
    plan = plan_groups((64, 0))
    odd = _EvenBoundaries(**{f.name: getattr(plan.groups[1], f.name) for f in dataclasses.fields(plan.groups[1])})
    groups = GroupTables(pool, index, 4, GroupPlan((plan.groups[0], odd), plan.layer_group, plan.layer_slot), str)
    tokens = np.arange(14, dtype=np.int32)
    assert groups.add(1, tokens) == 0
    groups.reserve(1, 14)
    groups.commit(1, 14)
    groups.remove(1)
    assert groups.prefix_hits(tokens, 0, 0) == [3, 2]          # each group's own rule (3 cached full blocks)
    assert groups.match(tokens, 0, 0)["tokens"] == 8
    assert groups.add(2, tokens) == 8                          # both groups reuse 2 blocks, not 3
    assert [len(t.blocks(2)) for t in groups.tables] == [2, 2]
    groups.check_invariants()
    groups.remove(2)
