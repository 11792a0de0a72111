"""The tier chain as a list: any number of tiers behind one protocol, and the protocol's
verbs on a tier by itself (what a connector's store calls)."""
import numpy as np
import pytest
import torch

from pagedkv.format.fingerprint import kv_format
from pagedkv.tiers import ChainQuery, DiskPrefixTier, HostPrefixTier, PayloadLayout
from pagedkv.tiers import manager as tier_manager
from pagedkv.tiers.payload import Blocks

from tier_helpers import SHAPE, assert_clean, expected_kv, fill, make

BS = SHAPE["block_size"]


def prompt(start: int, n: int = 13) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int32)


def flush_device(cache) -> None:
    cache.add_sequence("flush")
    cache.reserve("flush", cache.pool.num_free_blocks * BS)
    cache.free("flush")


def three_slot_tiers(tmp_path):
    """host (3 blocks) -> disk "a" (6 blocks) -> disk "b" (64 blocks), built in place of
    the config's chain: a third tier is an entry in the list."""
    def build(cfg, store, weak):
        fmt = kv_format(store, "")
        return [HostPrefixTier(store.arenas, 3, BS, eviction="lru", weak_hash=weak, pin=False,
                               window=store.tier_window(3)),
                DiskPrefixTier(str(tmp_path / "a"), store.arenas, 6, BS, fmt, eviction="lru", weak_hash=weak,
                               rows=store.window),
                DiskPrefixTier(str(tmp_path / "b"), store.arenas, 64, BS, fmt, eviction="lru", weak_hash=weak,
                               rows=store.window)]
    return build


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_three_tiers_cascade_evictions_down_and_serve_exact_kv_from_the_deepest(tmp_path, monkeypatch, kv_dtype):
    monkeypatch.setattr(tier_manager, "build_tiers", three_slot_tiers(tmp_path))
    prompts = [prompt(1000 * i) for i in range(8)]          # 3 full blocks each: 24 blocks
    want = {}
    with make(num_blocks=6, kv_dtype=kv_dtype, prefix_host_blocks=1) as cache:
        assert [t.medium for t in cache._tiers.tiers] == ["host", "disk", "disk"]
        for i, p in enumerate(prompts):
            fill(cache, i, p)
            want[i] = [cache.gather(i, layer) for layer in range(SHAPE["num_layers"])]
            cache.free(i)
            flush_device(cache)
        host, a, b = cache._tiers.tiers
        assert host.index.num_evictions > 0 and a.index.num_evictions > 0    # both passed blocks down
        assert b.index.num_used > a.capacity                                   # the deepest holds the overflow
        for i, p in enumerate(prompts):
            assert cache.match_prefix(p) == 12
            assert fill(cache, "q", p) == 12
            for layer, (k, v) in enumerate(want[i]):
                got = cache.gather("q", layer)
                assert torch.equal(got[0], k) and torch.equal(got[1], v)
            cache.free("q")
            flush_device(cache)
        assert [s.hit_tokens for s in cache.stats().tiers][2] > 0            # the deepest tier served hits
        assert_clean(cache)


def test_a_tier_by_itself_puts_finds_and_loads_through_the_protocol():
    with make(num_blocks=8) as cache:
        a = prompt(100, 16)                                  # 4 full blocks
        fill(cache, "a", a)
        blocks = cache.block_table("a")[:4].tolist()
        store = cache.store
        tier = HostPrefixTier(store.arenas, 8, BS, eviction="lru", weak_hash=False, pin=False)
        src = Blocks(store.arenas, None, None)
        q = ChainQuery(a, b"ns", BS)
        assert tier.contains(q, 0, 4) == 0
        assert tier.batched_put(q, 1, src, blocks[1:]) == 0        # chain-closed: block 0 is not there
        assert tier.batched_put(q, 0, src, blocks[:2]) == 2
        assert tier.batched_put(q, 2, src, blocks[2:]) == 2
        assert tier.contains(q, 0, 4) == 4 and tier.contains(q, 2, 4) == 2
        assert tier.contains(ChainQuery(a, b"other", BS), 0, 4) == 0      # another namespace
        b = a.copy()
        b[9] += 1                                                 # differs in block 2
        assert tier.contains(ChainQuery(b, b"ns", BS), 0, 4) == 2
        handles = tier.get_non_blocking(q, 0, 4).result(timeout=1)
        assert handles == tier.lookup(q, 0, 4) and len(handles) == 4
        cache.free("a")
        cache.add_sequence("b")
        dst = cache.reserve("b", 16)
        dst_blocks = cache.block_table("b")[:4].tolist()
        tier.load(handles, Blocks(store.arenas, None, None), dst_blocks)
        for layer in range(SHAPE["num_layers"]):
            k, v = cache.gather("b", layer)
            ek, ev = expected_kv(a, layer)
            assert torch.equal(k, ek) and torch.equal(v, ev)
        assert len(dst) == 16
        cache.free("b")
        assert tier.stats().written_blocks == 4 and tier.stats().used_blocks == 4
        tier.check_invariants()


def test_the_payload_layout_has_a_section_per_arena_and_rows():
    with make(num_blocks=4, kv_dtype="int4", head_dim=8, kv_window=4, prefix_host_blocks=2) as cache:
        store = cache.store
        layout = PayloadLayout.of(store.arenas, store.window)
        kinds = [s.kind for s in layout.sections]
        assert kinds == ["arena"] * len(store.arenas) + ["rows", "rows_valid"]
        assert all(s.offset % 64 == 0 for s in layout.sections)
        for s, a in zip(layout.arena_sections, store.arenas):
            assert s.nbytes == a[:, 0].numel() * a.element_size()
        assert layout.record_bytes >= sum(s.nbytes for s in layout.sections)
        p = layout.empty(3)
        assert [t.shape for t in p.arenas] == [(a.shape[0], 3) + tuple(a.shape[2:]) for a in store.arenas]
        assert p.window is not None and p.window.data.shape[0] == 3
        plain = PayloadLayout.of(store.arenas, None)
        assert [s.kind for s in plain.sections] == ["arena"] * len(store.arenas)
        assert_clean(cache)
