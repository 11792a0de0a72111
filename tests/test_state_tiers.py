"""Recurrent-state snapshots on the host and disk prefix tiers (pagedkv.tiers.state_shelf,
pagedkv.manager.state_tiers): they travel with their chain, are verified like blocks, come
back with a promotion and after a warm restart; a missing or corrupt one is a shorter hit."""
import os

import numpy as np
import pytest
import torch

from pagedkv import CacheConfig, PagedKVCache
from pagedkv.errors import OutOfBlocksError
from pagedkv.testing.state_model import state_of
from pagedkv.tiers.state_shelf import decode, encode

BS = 4
KINDS = ("state", "attention", "state")
TENSORS = [("conv", (3, 4)), ("ssm", (2, 2, 2))]


def config(**kw):
    base = dict(num_layers=1, num_kv_heads=1, head_dim=4, block_size=BS, num_blocks=8, dtype="float32",
                layer_kinds=KINDS, state_tensors=TENSORS, state_slots=16, state_checkpoint_every=2)
    return CacheConfig(**(base | kw))


def step(kv, sid, tokens, n):
    pos = kv.num_tokens(sid)
    kv.reserve(sid, n)
    for layer in range(2):
        kv.write_state(sid, layer, state_of(kv.config.state_spec, [tokens[:pos + n]], layer))
    kv.commit(sid, n)


def prefill(kv, sid, tokens, chunks):
    hit = kv.add_sequence(sid, tokens)
    assert hit == 0
    for n in chunks:
        step(kv, sid, tokens, n)


def assert_state(kv, sid, tokens):
    for layer in range(2):
        got = kv.read_state(sid, layer)
        want = state_of(kv.config.state_spec, [tokens], layer)
        for name in got:
            assert torch.equal(got[name], want[name]), (name, len(tokens))


def flush_device(kv):
    """Every cached block leaves the device (down to the tiers), and every device snapshot
    is dropped: what comes back comes from a tier."""
    kv.add_sequence("flush")
    try:
        while True:
            kv.reserve("flush", BS)
    except OutOfBlocksError:
        pass
    kv.free("flush")
    kv._groups.snapshots.clear()


A = list(range(1, 11))          # 10 tokens: snapshots at 4 and 8 after chunks of 4, 4, 2


def test_a_promotion_from_the_host_resumes_from_the_host_snapshot():
    with PagedKVCache(config(prefix_host_blocks=16)) as kv:
        prefill(kv, "a", A, (4, 4, 2))
        kv.free("a")
        flush_device(kv)
        assert kv.match_prefix(A) == 8
        assert kv.add_sequence("b", A) == 8
        assert kv.stats().host_hit_tokens == 8
        assert kv.state_positions("b").tolist() == [8]
        assert_state(kv, "b", A[:8])                  # before the fix: the initial state at 8 tokens
        st = kv.stats().states
        assert st.tiers[0]["medium"] == "host" and st.tiers[0]["hits"] == 1
        step(kv, "b", A, 2)
        assert_state(kv, "b", A)
        kv.free("b")
        kv.check_invariants()


def test_a_promotion_past_a_device_hit_switches_to_the_further_snapshot():
    with PagedKVCache(config(prefix_host_blocks=16, num_blocks=12)) as kv:
        b = A[:4] + [70, 71, 72, 73, 74]
        prefill(kv, "a", A, (4, 4, 2))
        kv.free("a")
        flush_device(kv)
        assert kv.add_sequence("x", b) == 4          # the first block comes back to the device (as x's)
        assert_state(kv, "x", b[:4])
        step(kv, "x", b, 5)
        assert kv.stats().host_hit_tokens == 4
        assert kv.add_sequence("c", A) == 8           # 4 from the device's chain, 4 more from the host
        assert kv.stats().host_hit_tokens == 8
        assert_state(kv, "c", A[:8])
        kv.free(["x", "c"])
        kv.check_invariants()


def test_a_chain_whose_snapshot_is_missing_on_the_tier_gives_a_shorter_hit():
    with PagedKVCache(config(prefix_host_blocks=16)) as kv:
        prefill(kv, "a", A, (4, 4, 2))
        kv.free("a")
        flush_device(kv)
        shelf = kv._groups.tier_states.shelves[0]
        longest = max(shelf._lru, key=lambda k: shelf._lru[k])     # the 8-token record is the longer one
        shelf.drop(longest)
        assert kv.match_prefix(A) == 4
        assert kv.add_sequence("b", A) == 4           # the KV chain holds 8 tokens: never a KV-only advance
        assert_state(kv, "b", A[:4])
        kv.free("b")
        kv._groups.tier_states.clear()
        flush_device(kv)
        assert kv.match_prefix(A) == 0
        assert kv.add_sequence("c", A) == 0
        kv.free("c")
        kv.check_invariants()


def disk_opts(tmp_path, **kw):
    return dict(prefix_disk_dir=str(tmp_path / "tier"), prefix_disk_blocks=32, **kw)


def test_snapshots_survive_a_disk_round_trip_and_a_warm_restart(tmp_path):
    opts = disk_opts(tmp_path, prefix_host_blocks=4)
    with PagedKVCache(config(**opts)) as kv:
        prefill(kv, "a", A, (4, 4, 2))
        kv.free("a")
        flush_device(kv)
        prefill(kv, "f", list(range(100, 117)), (16, 1))   # pushes a's blocks from the host to disk
        kv.free("f")
        flush_device(kv)
        kv._groups.tier_states.shelves[0].clear()           # the host shelf lost it too
        assert kv.add_sequence("b", A) == 8
        assert kv.stats().disk_hit_tokens == 8
        assert_state(kv, "b", A[:8])
        assert kv._groups.tier_states.shelves[0].stats()["snapshots"] == 1   # back on the host shelf
        kv.free("b")
    assert sorted(os.listdir(tmp_path / "tier" / "states"))    # records on disk
    with PagedKVCache(config(**opts)) as again:                # a new cache on the same directory
        assert again.match_prefix(A) == 8
        assert again.add_sequence("b", A) == 8
        assert again.stats().disk_hit_tokens == 8
        assert_state(again, "b", A[:8])
        step(again, "b", A, 2)
        assert_state(again, "b", A)
        again.free("b")
        again.check_invariants()


@pytest.mark.parametrize("where", ["host", "disk"])
def test_a_bit_flip_in_a_stored_snapshot_is_a_miss(tmp_path, where):
    opts = dict(prefix_host_blocks=16) if where == "host" else disk_opts(tmp_path)
    with PagedKVCache(config(**opts)) as kv:
        prefill(kv, "a", A, (4, 4, 2))
        kv.free("a")
        flush_device(kv)
        shelf = kv._groups.tier_states.shelves[0]
        longest = max(shelf._lru, key=lambda k: shelf._lru[k])
        if where == "host":
            shelf.records[longest][-40] ^= 0x10              # a bit of the state bytes
        else:
            path = os.path.join(shelf.path, longest + ".snap")
            raw = bytearray(open(path, "rb").read())
            raw[-40] ^= 0x10
            open(path, "wb").write(bytes(raw))
        assert kv.add_sequence("b", A) == 4                   # the 8-token snapshot fails its checksum
        assert_state(kv, "b", A[:4])
        assert shelf.stats()["verify_failures"] == 1 and longest not in shelf
        kv.free("b")
        kv.check_invariants()


def test_a_record_is_verified_by_format_namespace_tokens_and_checksum():
    toks = np.arange(8, dtype=np.int32)
    rec = encode("fmt", b"ns", toks, b"\x01\x02\x03\x04")
    assert decode(rec, "fmt", b"ns", toks) == b"\x01\x02\x03\x04"
    assert decode(rec, "other", b"ns", toks) is None
    assert decode(rec, "fmt", b"other", toks) is None
    assert decode(rec, "fmt", b"ns", toks[::-1].copy()) is None
    assert decode(rec, "fmt", b"ns", toks[:4]) is None
    assert decode(rec[:-1], "fmt", b"ns", toks) is None
    for i in range(len(rec)):                # any flipped bit is refused
        bad = bytearray(rec)
        bad[i] ^= 1
        assert decode(bytes(bad), "fmt", b"ns", toks) is None, i


def test_namespaces_do_not_share_snapshots_on_a_tier(tmp_path):
    with PagedKVCache(config(**disk_opts(tmp_path))) as kv:
        kv.add_sequence("a", A, cache_salt="x")
        for n in (4, 4, 2):
            step(kv, "a", A, n)
        kv.free("a")
        flush_device(kv)
        assert kv.add_sequence("b", A, cache_salt="y") == 0
        assert kv.add_sequence("c", A, cache_salt="x") == 8
        assert_state(kv, "c", A[:8])
        kv.free(["b", "c"])


def test_reset_prefix_cache_forgets_the_tiers_snapshots(tmp_path):
    with PagedKVCache(config(prefix_host_blocks=16, **disk_opts(tmp_path))) as kv:
        prefill(kv, "a", A, (4, 4, 2))
        kv.free("a")
        assert [s["snapshots"] for s in kv.stats().states.tiers] == [2, 2]
        kv.reset_prefix_cache()
        assert [s["snapshots"] for s in kv.stats().states.tiers] == [0, 0]
        assert os.listdir(tmp_path / "tier" / "states") == []


@pytest.mark.parametrize("family", ["qwen3_5", "bamba", "mamba2"])
def test_greedy_after_a_warm_restart_from_disk_equals_the_models_own_cache(family, tmp_path):
    """A transformers hybrid (and a pure Mamba2): a prompt's chain and its snapshots go
    down to disk; a new cache on the directory hits them and generates what the model's
    own cache generates."""
    from pagedkv.integrations.transformers import PagedCache
    from pagedkv.testing.state_models import STATE_MODELS

    model = STATE_MODELS[family]()[0].eval()

    def make():
        cfg = CacheConfig.from_hf_config(model.config, num_blocks=16, block_size=BS, dtype=torch.float32,
                                         state_slots=8, prefix_disk_dir=str(tmp_path / "tier"),
                                         prefix_disk_blocks=64)
        return PagedKVCache(cfg)

    def serve(kv, ids, prefill=False):
        with PagedCache(kv) as cache, torch.no_grad():
            hits = cache.admit(ids)
            if prefill:
                cache.prefill(model, ids)
            return model.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False), hits

    g = torch.Generator().manual_seed(5)
    a = torch.randint(3, 256, (1, 12), generator=g)
    b = torch.cat([a, torch.randint(3, 256, (1, 3), generator=g)], 1)
    with torch.no_grad():
        want = model.generate(b, max_new_tokens=4, do_sample=False)
    with make() as kv:
        assert serve(kv, a, prefill=True)[1].tolist() == [0]
        flush_device_blocks(kv)                      # the chain goes down to disk (a pure Mamba2's: tokens only)
    with make() as again:
        out, hits = serve(again, b)
        assert hits.tolist() == [12]
        assert again.stats().states.tiers[0]["hits"] == 1
        assert torch.equal(out, want)


def flush_device_blocks(kv):
    kv.add_sequence("flush")
    try:
        while True:
            kv.reserve("flush", BS)
    except OutOfBlocksError:
        pass
    kv.free("flush")


def test_the_states_directory_follows_the_tier_directory_rules(tmp_path):
    (tmp_path / "tier").mkdir(mode=0o700)
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "tier" / "states")
    from pagedkv.errors import TierFileError

    with pytest.raises(TierFileError, match="states: expected a directory owned by this user"):
        PagedKVCache(config(**disk_opts(tmp_path)))
    assert os.listdir(tmp_path / "elsewhere") == []
    os.unlink(tmp_path / "tier" / "states")
    with PagedKVCache(config(**disk_opts(tmp_path))) as kv:
        prefill(kv, "a", A, (4, 4, 2))
        kv.free("a")
        shelf = kv._groups.tier_states.shelves[0]
        key = max(shelf._lru, key=lambda k: shelf._lru[k])
        path = os.path.join(shelf.path, key + ".snap")
        os.replace(path, tmp_path / "elsewhere" / "x")
        os.symlink(tmp_path / "elsewhere" / "x", path)        # a planted link is never read
        flush_device(kv)
        assert kv.add_sequence("b", A) == 4
        assert_state(kv, "b", A[:4])
        kv.free("b")
