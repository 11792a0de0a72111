"""KV events of the vLLM connector's tiers, recorded by its store (no engine): a landed
save is a host store, a write-through a disk store, a queued block a remote store, a
promotion from disk or remote a host store, a host eviction a removal, a reset a clear.
Hashes are the tiers' chain hashes as signed 64-bit integers, the same on two engines
for the same prefix; every store carries its tokens. (tests_vllm/test_kv_events.py
turns them into vLLM's classes and decodes them with vLLM's decoder.)"""
from __future__ import annotations

import numpy as np
import torch

from pagedkv.events import AllBlocksCleared, BlockRemoved, BlockStored, EventsLost
from pagedkv.integrations.vllm_config import ConnectorConfig
from pagedkv.integrations.vllm_events import StoreEvents
from pagedkv.integrations.vllm_store import KVSpec, PrefixStore
from pagedkv.integrations.vllm_worker import BlockMover
from pagedkv.kv_events.wire import int64
from pagedkv.tiers.verify import ChainQuery

from redis_fixtures import fresh_redis, redis_server  # noqa: F401

BS, H, D, L, N = 16, 2, 32, 2, 16
NS = b"model\x00\x00"


def make(**cfg):
    store = PrefixStore(ConnectorConfig.from_extra(dict({"host_blocks": 4}, **cfg)),
                        KVSpec(L, H, BS, D, torch.bfloat16), "model")
    store.kv = [torch.randn(N, H, BS, 2 * D, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
                for _ in range(L)]
    store.mover = BlockMover()
    assert store.mover.register(store.spec, store.kv, "CPU_ATTN") is None     # vLLM for CPU's layout
    store.worker_ready = True
    store.enable_events()
    return store


def store_blocks(store, tokens, blocks):
    parent, saves = -1, []
    for i, b in enumerate(blocks):
        slot, created = store.admit(parent, tokens[i * BS:(i + 1) * BS], NS)
        if created:
            saves.append((b, slot))
        parent = slot
    got, why, _ = store.mover.arena(store.arena.name)
    assert why is None
    store.mover.save(*got, saves)
    store.committed([slot for _, slot in saves])


def toks(n, seed):
    return np.random.default_rng(seed).integers(0, 50_000, n).astype(np.int32)


def stored(events, medium):
    return [e for e in events if isinstance(e, BlockStored) and e.medium == medium]


def test_every_tier_reports_its_stores_removals_and_clears(tmp_path, fresh_redis):
    remote = {"url": fresh_redis.url, "timeout_s": 2.0, "retry_after_s": 0.0}
    a = make(disk_dir=str(tmp_path / "d"), disk_blocks=64, remote=remote)
    b = make(remote=remote)
    try:
        t = toks(3 * BS + 1, 0)
        store_blocks(a, t, [1, 2, 3])
        ev = a.events.drain()
        host, disk, rem = stored(ev, "host"), stored(ev, "disk"), stored(ev, "remote")
        assert len(host) == 1 and host[0].parent_block_hash is None and len(host[0].block_hashes) == 3
        assert host[0].token_ids == t[:3 * BS].tolist() and host[0].token_count == 3 * BS
        assert all(isinstance(h, int) and -2**63 <= h < 2**63 for h in host[0].block_hashes)
        assert [h for e in disk for h in e.block_hashes] == host[0].block_hashes
        assert [h for e in rem for h in e.block_hashes] == host[0].block_hashes
        assert a.remote.flush(10)
        chain = b.lookup(t, NS, 3)                               # promoted from the remote tier
        assert len(chain) == 3
        promoted = stored(b.events.drain(), "host")
        assert [h for e in promoted for h in e.block_hashes] == host[0].block_hashes    # one hash space
        assert [x for e in promoted for x in e.token_ids] == t[:3 * BS].tolist()
        b.lease(chain)
        b.loaded(chain, ok=True)
        store_blocks(b, toks(3 * BS + 1, 1), [4, 5, 6])         # 4 host slots: two of the first chain leave
        ev = b.events.drain()
        removed = [e for e in ev if isinstance(e, BlockRemoved)]
        assert [e.medium for e in removed] == ["host", "host"]
        assert {h for e in removed for h in e.block_hashes} <= set(host[0].block_hashes)
        assert not stored(ev, "remote") or all(h not in host[0].block_hashes
                                               for e in stored(ev, "remote") for h in e.block_hashes)
        a.clear(disk=True)
        assert [e.medium for e in a.events.drain() if isinstance(e, AllBlocksCleared)] == ["host", "disk"]
        a2 = make(disk_dir=str(tmp_path / "d2"), disk_blocks=64)
        try:
            store_blocks(a2, t, [1, 2, 3])                       # another engine, the same prefix: same hashes
            assert stored(a2.events.drain(), "host")[0].block_hashes == host[0].block_hashes
        finally:
            a2.close()
    finally:
        a.close()
        b.close()


def test_too_many_undrained_events_become_one_loss():
    a = make()
    try:
        a.events = StoreEvents(a.host.index, BS, limit=2)
        for seed in range(4):
            store_blocks(a, toks(BS + 1, seed), [seed])
        ev = a.events.drain()
        assert len(ev) == 3 and isinstance(ev[-1], EventsLost) and ev[-1].count == 2
        assert a.events.drain() == []
    finally:
        a.close()


def removed(events, medium):
    return [h for e in events if isinstance(e, BlockRemoved) and e.medium == medium for h in e.block_hashes]


def test_a_remote_block_the_server_lost_is_removed_with_the_blocks_below_it(fresh_redis):
    a = make(remote={"url": fresh_redis.url, "timeout_s": 2.0, "retry_after_s": 0.0})
    try:
        t = toks(3 * BS + 1, 0)
        store_blocks(a, t, [1, 2, 3])
        hashes = stored(a.events.drain(), "host")[0].block_hashes
        assert a.remote.flush(10)
        fresh_redis.client().delete(a.remote.wire.key(ChainQuery(t, NS, BS).digest(1)))   # its TTL, its size limit
        store_blocks(a, toks(3 * BS + 1, 1), [4, 5, 6])          # 4 host slots: the first chain's tail leaves
        a.events.drain()
        chain = a.lookup(t, NS, 3)                               # the host's head, then the server lacks block 1
        assert len(chain) == 1
        assert removed(a.events.drain(), "remote") == [hashes[2], hashes[1]]    # deepest first
        assert removed(a.events.drain(), "remote") == []
    finally:
        a.close()


def test_disk_removals_by_this_engine_and_by_another_are_reported(tmp_path):
    a = make(disk_dir=str(tmp_path), disk_blocks=4)
    b = make(disk_dir=str(tmp_path), disk_blocks=4)
    try:
        t0, t1 = toks(2 * BS + 1, 0), toks(2 * BS + 1, 1)
        store_blocks(a, t0, [1, 2])
        written = [h for e in stored(a.events.drain(), "disk") for h in e.block_hashes]
        assert len(written) == 2
        store_blocks(b, t1, [3, 4])                              # another engine: the disk is full
        before = written + [h for e in stored(b.events.drain(), "disk") for h in e.block_hashes]
        store_blocks(b, toks(2 * BS + 1, 2), [5, 6])             # evicts two of those
        with b.disk() as d:
            held = {int64(int(d.index.rec["hash"][s])) for s in np.flatnonzero(d.index.rec["valid"] == 1)}
        gone = set(before) - held
        assert len(gone) == 2 and sorted(removed(b.events.drain(), "disk")) == sorted(gone)    # b evicted them
        a.lookup(toks(BS + 1, 9), NS, 1)                         # a's next disk turn sees what left
        assert set(removed(a.events.drain(), "disk")) == gone & set(written) != set()
        b.clear(disk=True)
        a.lookup(toks(BS + 1, 9), NS, 1)
        assert [e.medium for e in a.events.drain() if isinstance(e, AllBlocksCleared)] == ["disk"]
    finally:
        a.close()
        b.close()
