"""The connector's store, codecs, settings and shared arena on fake vLLM KV tensors (no
engine): the scheduler side's store and the worker side's mover wired as the connector
wires them (the mover maps the store's arena by name, the store commits what the mover
reports)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from pagedkv.errors import InvalidArgumentError, TierFileError
from pagedkv.integrations import vllm_shm
from pagedkv.integrations.vllm_codec import bytes_per_token, make_codec
from pagedkv.integrations.vllm_config import ConnectorConfig
from pagedkv.integrations.vllm_shm import SharedArena
from pagedkv.integrations.vllm_store import KVSpec, PrefixStore
from pagedkv.integrations.vllm_worker import BlockMover

BS, H, D, L, N = 32, 2, 64, 3, 24
NS = b"model\x00\x00"


def make(tmp_path=None, **cfg):
    base = {"host_blocks": 8}
    if tmp_path is not None:
        base.update(disk_dir=str(tmp_path / "tier"), disk_blocks=32)
    base.update(cfg)
    store = PrefixStore(ConnectorConfig.from_extra(base), KVSpec(L, H, BS, D, torch.bfloat16), "model")
    g = torch.Generator().manual_seed(0)
    store.kv = [torch.randn(N, H, BS, 2 * D, generator=g).to(torch.bfloat16) for _ in range(L)]
    store.mover = BlockMover()                       # the worker side (here: same process)
    assert store.mover.register(store.spec, store.kv, "CPU_ATTN") is None
    store.worker_ready = True
    return store


def mapped(store):
    got, why, _ = store.mover.arena(store.arena.name)
    assert why is None, why
    return got


def admit_blocks(store, tokens, blocks):
    """The scheduler side for a computed prompt: admit each full block -> the step's saves."""
    parent, saves = -1, []
    for i, b in enumerate(blocks):
        slot, created = store.admit(parent, tokens[i * BS:(i + 1) * BS], NS)
        assert slot >= 0
        if created:
            saves.append((b, slot))
        parent = slot
    return saves


def store_blocks(store, tokens, blocks):
    """Admit, the worker's copy, then the commit its report triggers."""
    saves = admit_blocks(store, tokens, blocks)
    store.mover.save(*mapped(store), saves)
    store.committed([slot for _, slot in saves])


def load_into(store, chain, blocks):
    store.lease(chain)
    store.mover.load(*mapped(store), list(zip(chain, blocks)))
    store.loaded(chain, ok=True)


def toks(n, seed):
    return np.random.default_rng(seed).integers(0, 50_000, n).astype(np.int32)


def test_config_errors_are_typed_and_named():
    with pytest.raises(InvalidArgumentError, match="unknown key 'hostblocks'"):
        ConnectorConfig.from_extra({"hostblocks": 4})
    with pytest.raises(InvalidArgumentError, match=r"\['storage'\].*one of .*got 'int1'"):
        ConnectorConfig.from_extra({"storage": "int1"})
    with pytest.raises(InvalidArgumentError, match=r"\['host_blocks'\].*an int in \[0, 1099511627776\], got -1"):
        ConnectorConfig.from_extra({"host_blocks": -1})


@pytest.mark.parametrize("storage,tol,ratio", [("bf16", 0.0, 1.0), ("int8", 0.02, 1.7), ("fp8", 0.08, 1.8),
                                                ("int4", 0.35, 3.0), ("int2", 0.4, 4.5)])
def test_codec_round_trip_keeps_vllm_layout(storage, tol, ratio):
    c = make_codec(storage, H, BS, D, torch.bfloat16, 3)
    x = torch.randn(5, H, BS, 2 * D).to(torch.bfloat16)
    k, v = c.split(x)
    assert k[1, 0, 7, 3] == x[1, 0].reshape(-1)[3 * BS + 7]        # K[t, d] at d * block_size + t
    assert v[1, 0, 7, 3] == x[1, 0].reshape(-1)[D * BS + 7 * D + 3]
    assert torch.equal(c.join(k, v), x)
    y = c.decode(c.encode(x))
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert float((y.float() - x.float()).abs().max()) <= tol * float(x.float().abs().max()) + 1e-6
    assert bytes_per_token(make_codec("bf16", H, BS, D, torch.bfloat16), L) / bytes_per_token(c, L) >= ratio


@pytest.mark.parametrize("storage,tol", [("bf16", 0.0), ("int8", 0.02), ("fp8", 0.08), ("int4", 0.35),
                                         ("int2", 0.4)])
def test_verified_hit_copies_the_right_blocks(storage, tol):
    s = make(storage=storage)
    t = toks(3 * BS + 5, 1)
    store_blocks(s, t, [3, 7, 9])
    chain = s.lookup(t, NS, 3)
    assert len(chain) == 3
    load_into(s, chain, [0, 1, 2])
    for layer in s.kv:
        got, want = layer[[0, 1, 2]].float(), layer[[3, 7, 9]].float()
        assert float((got - want).abs().max()) <= tol * float(want.abs().max())
        assert tol == 0 or not torch.equal(got, want)      # quantized storage really was used
    assert int(s.host.index.busy.sum()) == 0


def test_forced_collision_is_a_miss():
    from pagedkv.tiers.chain import ROOT_HASH, chain_hash

    s = make(weak_hash=True)                  # a 4-valued tier hash: collisions are easy to make
    a = toks(BS, 1)
    store_blocks(s, a, [3])
    ns_hash = s.host.ns_hashes[0]
    target = chain_hash(ROOT_HASH, ns_hash, a, True)
    b = next(b for b in (toks(BS, seed) for seed in range(2, 100)) if chain_hash(ROOT_HASH, ns_hash, b, True) == target)
    assert s.lookup(b, NS, 1) == []           # same hash, other tokens: a miss
    assert s.admit(-1, b, NS) == (-1, False)  # and never stored over the other block
    assert len(s.lookup(a, NS, 1)) == 1


def test_disk_crc_failure_is_a_miss_and_drops_the_chain(tmp_path):
    s = make(tmp_path)
    t = toks(2 * BS + 1, 4)
    store_blocks(s, t, [1, 2])
    s.clear(disk=False)
    rec = (tmp_path / "tier" / "blocks.bin")
    raw = bytearray(rec.read_bytes())
    raw[10] ^= 0xFF                           # slot 0: the root block
    rec.write_bytes(bytes(raw))
    assert s.lookup(t, NS, 2) == []
    assert s.num_disk_corrupt == 1
    s2 = make(tmp_path)                       # a restart sees a clean tier without them
    assert s2.lookup(t, NS, 2) == []


def test_warm_restart_serves_from_disk(tmp_path):
    s = make(tmp_path)
    t = toks(2 * BS + 1, 5)
    store_blocks(s, t, [4, 5])
    want = [layer[[4, 5]].clone() for layer in s.kv]
    s2 = make(tmp_path)                       # new store, same directory, other KV tensors
    chain = s2.lookup(t, NS, 2)
    assert len(chain) == 2 and s2.num_disk_hit_tokens == 2 * BS
    load_into(s2, chain, [10, 11])
    for layer, w in zip(s2.kv, want):
        assert torch.equal(layer[[10, 11]], w)


def test_other_format_on_the_directory_is_refused(tmp_path):
    s = make(tmp_path)
    t = toks(BS + 1, 6)
    store_blocks(s, t, [1])
    other = PrefixStore(dataclasses.replace(s.cfg), KVSpec(L, H, BS, D, torch.bfloat16), "other-model")
    assert other.lookup(t, NS, 1) == [] and "tag" in other.disk_refused
    q = make(tmp_path, storage="int8")
    assert q.lookup(t, NS, 1) == [] and "int8" in q.disk_refused     # the storage format differs


def test_mismatched_kv_tensors_are_refused():
    m = BlockMover()
    assert "shape" in m.register(KVSpec(L, H, BS, D, torch.bfloat16),
                                 [torch.zeros(N, H + 1, BS, 2 * D, dtype=torch.bfloat16)] * L)
    assert m.kv is None
    m = BlockMover()
    assert "dtype" in m.register(KVSpec(L, H, BS, D, torch.bfloat16),
                                 [torch.zeros(N, H, BS, 2 * D, dtype=torch.float16)] * L)


def test_arena_of_another_shape_is_refused_by_the_worker():
    s = make()
    other = PrefixStore(s.cfg, KVSpec(L, H + 1, BS, D, torch.bfloat16), "model")
    got, why, new = s.mover.arena(other.arena.name)
    assert got is None and new and "differs" in why
    assert s.mover.arena(other.arena.name)[1] == why         # refused once, remembered


def test_pending_slots_are_never_hits_until_the_worker_reports():
    s = make()
    t = toks(2 * BS + 1, 11)
    saves = admit_blocks(s, t, [3, 4])
    assert s.lookup(t, NS, 2) == []                   # admitted, bytes not yet written
    s.mover.save(*mapped(s), saves)
    assert s.lookup(t, NS, 2) == []                   # written, not yet reported
    s.committed([slot for _, slot in saves])
    assert len(s.lookup(t, NS, 2)) == 2
    u = toks(BS + 1, 12)
    failed = admit_blocks(s, u, [5])
    s.abandon([slot for _, slot in failed])           # the worker reported the save failed
    assert s.lookup(u, NS, 1) == [] and s.pending == set()
    assert int(s.host.index.busy.sum()) == 0


def test_shared_arena_survives_unlink_and_stale_segments_are_swept():
    s = make()
    t = toks(BS + 1, 13)
    store_blocks(s, t, [6])
    s.arena.unlink()                                  # what the scheduler does once the worker mapped it
    assert not s.arena.path.exists()
    chain = s.lookup(t, NS, 1)
    load_into(s, chain, [12])
    for layer in s.kv:
        assert torch.equal(layer[12], layer[6])
    with pytest.raises(TierFileError, match="shared arena: expected .* readable"):
        SharedArena.open(s.arena.name)
    with pytest.raises(TierFileError, match="arena name: expected pagedkv-vllm-<pid>-<16 hex>, got '../x'"):
        SharedArena.open("../x")
    dead = vllm_shm.shm_dir() / f"{vllm_shm.PREFIX}999999999-{'0' * 16}"   # no such pid
    dead.write_bytes(b"x")
    verdict = vllm_shm.shm_dir() / f"{vllm_shm.PREFIX}worker-test{__import__('os').getpid()}.json"
    verdict.write_text('{"pid": 999999999, "refused": null}')
    live = make()
    assert not dead.exists() and not verdict.exists() and live.arena.path.exists()
    live.close()
    assert not live.arena.path.exists()


def test_held_directory_costs_a_miss_not_an_error(tmp_path):
    s = make(tmp_path)
    t = toks(BS + 1, 7)
    store_blocks(s, t, [1])
    other = make(tmp_path, lock_timeout_s=0.05)
    with s.disk():                            # the first engine holds the tier
        assert other.lookup(t, NS, 1) == []
    assert other.num_lock_misses == 1
    assert len(other.lookup(t, NS, 1)) == 1   # its turn came


def test_host_evictions_go_to_disk_and_pins_stay(tmp_path):
    s = make(tmp_path, host_blocks=4, disk_write="back")
    pinned = toks(2 * BS + 1, 8)
    store_blocks(s, pinned, [0, 1])
    assert s.pin(pinned, NS) == 2 * BS
    for i in range(4):                        # 8 more blocks through a 4-slot host tier
        store_blocks(s, toks(2 * BS + 1, 20 + i), [2 + 2 * i, 3 + 2 * i])
    assert s.host.index.num_evictions >= 4
    assert len(s._host_chain(pinned, NS, 2)) == 2          # pinned: still on the host
    first = toks(2 * BS + 1, 20)
    assert s._host_chain(first, NS, 2) == []
    chain = s.lookup(first, NS, 2)                          # evicted to disk, promoted back
    assert len(chain) == 2
    load_into(s, chain, [20, 21])
    for layer in s.kv:
        assert torch.equal(layer[[20, 21]], layer[[2, 3]])


def test_an_unclosed_store_leaves_no_segment_at_exit(tmp_path):
    import subprocess
    import sys

    code = ("import torch\nfrom pagedkv.integrations.vllm_config import ConnectorConfig\n"
            "from pagedkv.integrations.vllm_store import KVSpec, PrefixStore\n"
            "s = PrefixStore(ConnectorConfig.from_extra({'host_blocks': 4}), KVSpec(1, 1, 32, 64, torch.bfloat16), 't')\n"
            "print(s.arena.path)\n")
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True)
    path = out.stdout.strip().splitlines()[-1]
    assert path.startswith(str(vllm_shm.shm_dir())) and not __import__("os").path.exists(path)


def test_replace_store_checks_the_engines_shape_not_the_replaced_ones():
    from pagedkv.integrations.vllm_store import drop_store, get_store, replace_store

    cfg = ConnectorConfig.from_extra({"host_blocks": 4})
    spec = KVSpec(L, H, BS, D, torch.bfloat16)
    first = get_store("engine-x", cfg, spec, "m")
    try:
        shaped = PrefixStore(cfg, KVSpec(L, H + 1, BS, D, torch.bfloat16), "m")
        replace_store("engine-x", shaped)
        assert "differs from the engine's" in shaped.refused
        replace_store("engine-x", first)          # back to the engine's own shape: still served
        assert first.refused is None
    finally:
        drop_store("engine-x")


def test_a_miss_on_an_unchanged_disk_tier_takes_no_turn(tmp_path):
    s = make(tmp_path, host_blocks=2)
    store_blocks(s, toks(BS + 1, 30), [1])
    turns = s.num_disk_turns
    for seed in range(31, 35):                # new prompts: misses; each admission evicts a written-through block
        t = toks(BS + 1, seed)
        assert s.lookup(t, NS, 1) == []
        saves = admit_blocks(s, t, [2])
        s.mover.save(*mapped(s), saves)
        s.committed([slot for _, slot in saves])
    assert s.num_disk_turns - turns == 4      # one write-through per commit; no lookup, no eviction took one
    assert len(s.lookup(toks(BS + 1, 31), NS, 1)) == 1     # and what went down is still found
    assert s._tier.num_full_checks == 0       # the directory was new: nothing to check, ever


def test_another_engines_write_makes_the_view_stale_and_the_turn_reads_only_it(tmp_path):
    a, b = make(tmp_path), make(tmp_path)
    t = toks(2 * BS + 1, 40)
    assert b.lookup(t, NS, 2) == []           # b's view: the tier without t
    turns = b.num_disk_turns
    assert b.lookup(t, NS, 2) == [] and b.num_disk_turns == turns     # unchanged: answered from the view
    store_blocks(a, t, [6, 7])                # a writes t through (one turn)
    want = [layer[[6, 7]].clone() for layer in a.kv]
    chain = b.lookup(t, NS, 2)                # the journal moved: b takes a turn and finds it
    assert len(chain) == 2 and b.num_disk_turns == turns + 1
    assert b._tier.num_refreshed == 2 and b._tier.num_full_checks <= 1   # the two slots a wrote, no full check
    load_into(b, chain, [12, 13])
    for layer, w in zip(b.kv, want):
        assert torch.equal(layer[[12, 13]], w)


def test_a_journal_restarted_behind_the_view_forces_a_full_check(tmp_path):
    a, b = make(tmp_path), make(tmp_path)
    t = toks(BS + 1, 41)
    store_blocks(a, t, [3])
    assert len(b.lookup(t, NS, 1)) == 1       # b's first turn checks everything (the directory existed)
    checks = b._tier.num_full_checks
    a.clear(disk=True)                        # restarts the journal (and gives the space back)
    b.clear()                                 # b's host tier forgets t too
    assert b.lookup(t, NS, 1) == []           # the view is stale: a turn, a full check, nothing there
    assert b._tier.num_full_checks == checks + 1
