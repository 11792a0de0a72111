"""The vLLM connector's store with a remote tier (``kv_connector_extra_config["remote"]``)
on a real redis-server, without an engine: the scheduler side's store and the worker
side's mover wired as the connector wires them. Two stores stand for two engines on two
hosts; what one committed, the other serves bit-exact into its own KV tensors; a value
the server altered is a miss from that block on, never wrong KV."""
from __future__ import annotations

import socket
import time

import numpy as np
import pytest
import torch

from pagedkv.errors import ArgumentTypeError, InvalidArgumentError
from pagedkv.integrations.vllm_config import ConnectorConfig
from pagedkv.integrations.vllm_store import KVSpec, PrefixStore
from pagedkv.integrations.vllm_worker import BlockMover
from pagedkv.tiers.verify import ChainQuery

from redis_fixtures import fresh_redis, redis_server  # noqa: F401

BS, H, D, L, N = 16, 2, 32, 2, 16
NS = b"model\x00\x00"


def make(url, seed, **cfg):
    extra = dict({"host_blocks": 8, "remote": {"url": url, "timeout_s": 2.0, "retry_after_s": 0.0}}, **cfg)
    store = PrefixStore(ConnectorConfig.from_extra(extra), KVSpec(L, H, BS, D, torch.bfloat16), "model")
    g = torch.Generator().manual_seed(seed)
    store.kv = [torch.randn(N, H, BS, 2 * D, generator=g).to(torch.bfloat16) for _ in range(L)]
    store.mover = BlockMover()
    assert store.mover.register(store.spec, store.kv, "CPU_ATTN") is None     # vLLM for CPU's layout
    store.worker_ready = True
    return store


def mapped(store):
    got, why, _ = store.mover.arena(store.arena.name)
    assert why is None, why
    return got


def store_blocks(store, tokens, blocks):
    """Admit each full block, the worker's copy, then the commit its report triggers."""
    parent, saves = -1, []
    for i, b in enumerate(blocks):
        slot, created = store.admit(parent, tokens[i * BS:(i + 1) * BS], NS)
        assert slot >= 0
        if created:
            saves.append((b, slot))
        parent = slot
    store.mover.save(*mapped(store), saves)
    store.committed([slot for _, slot in saves])


def load_into(store, chain, blocks):
    store.lease(chain)
    store.mover.load(*mapped(store), list(zip(chain, blocks)))
    store.loaded(chain, ok=True)


def toks(n, seed):
    return np.random.default_rng(seed).integers(0, 50_000, n).astype(np.int32)


def remote_stats(store):
    return [t for t in store.stats() if t.medium == "remote"][0]


@pytest.mark.parametrize("storage, exact", [("bf16", True), ("int4", False)])
def test_an_engine_on_another_host_serves_what_one_committed(fresh_redis, storage, exact):
    a, b = make(fresh_redis.url, 0, storage=storage), make(fresh_redis.url, 1, storage=storage)
    try:
        t = toks(4 * BS + 1, 1)
        store_blocks(a, t, [2, 3, 4])
        assert a.remote.flush(10)
        assert remote_stats(a).written_blocks == 3 and fresh_redis.client().dbsize() == 3
        assert b.lookup(t, NS, 2) != [] and remote_stats(b).hit_tokens == 2 * BS    # at most what was asked
        chain = b.lookup(t, NS, 3)
        assert len(chain) == 3 and remote_stats(b).hit_tokens == 3 * BS             # the host now holds two
        load_into(b, chain, [9, 10, 11])
        # what a's host tier holds of a's blocks, decoded into b's tensors: the same bytes
        a2 = make(fresh_redis.url, 2, storage=storage, remote=None)
        try:
            for x, y in zip(a2.kv, a.kv):
                x.copy_(y)
            store_blocks(a2, t, [2, 3, 4])
            chain2 = a2.lookup(t, NS, 3)
            load_into(a2, chain2, [5, 6, 7])
            for la, lb, l2 in zip(a.kv, b.kv, a2.kv):
                assert torch.equal(lb[[9, 10, 11]], l2[[5, 6, 7]])
                if exact:
                    assert torch.equal(lb[[9, 10, 11]], la[[2, 3, 4]])
        finally:
            a2.close()
        # b computed one more block: only it is sent, not the three it fetched
        store_blocks(b, t, [9, 10, 11, 12])
        assert b.remote.flush(10) and remote_stats(b).written_blocks == 1 and fresh_redis.client().dbsize() == 4
        # a prefix that differs in its third block is a miss from there
        other = t.copy()
        other[2 * BS] += 1
        assert len(b.lookup(other, NS, 3)) == 2
    finally:
        a.close()
        b.close()


def test_a_value_the_server_altered_is_a_miss_from_that_block_on(fresh_redis):
    a, b = make(fresh_redis.url, 0), make(fresh_redis.url, 1)
    try:
        t = toks(3 * BS + 1, 2)
        store_blocks(a, t, [1, 2, 3])
        assert a.remote.flush(10)
        c = fresh_redis.client()
        key = a.remote.wire.key(ChainQuery(t, NS, BS).digest(1))
        v = c.get(key)
        c.set(key, v[:-3] + bytes([v[-3] ^ 0x40]) + v[-2:])
        chain = b.lookup(t, NS, 3)
        assert len(chain) == 1
        assert dict(remote_stats(b).refused) == {"checksum": 1} and remote_stats(b).corrupt_blocks == 1
        load_into(b, chain, [7])
        for la, lb in zip(a.kv, b.kv):
            assert torch.equal(lb[7], la[1])
    finally:
        a.close()
        b.close()


def test_a_server_that_is_down_costs_a_miss_within_the_timeout(fresh_redis):
    a = make(fresh_redis.url, 0)
    try:
        t = toks(2 * BS + 1, 3)
        store_blocks(a, t, [1, 2])
        assert a.remote.flush(10)
        a.clear()                                   # the host tier forgets; the server still holds them
        fresh_redis.stop()
        t0 = time.monotonic()
        assert a.lookup(t, NS, 2) == []
        assert time.monotonic() - t0 < 2.0 + 1.0
        assert remote_stats(a).errors >= 1 or dict(remote_stats(a).refused).get("unavailable", 0) >= 1
    finally:
        a.close()
        fresh_redis.start()


def test_a_server_that_accepts_but_never_answers_costs_the_scheduler_at_most_the_timeout():
    """The scheduler side's lookup (vLLM's get_num_new_matched_tokens) and commit
    (a worker's report: the write is queued) against a socket that never answers."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(16)
        url = f"redis://127.0.0.1:{srv.getsockname()[1]}/0"
        a = make(url, 0, remote={"url": url, "timeout_s": 0.3, "retry_after_s": 5.0})
        try:
            t = toks(3 * BS + 1, 3)
            t0 = time.monotonic()
            assert a.lookup(t, NS, 3) == []                     # a miss, within the timeout
            first = time.monotonic() - t0
            assert first < 0.3 + 0.5, first
            t0 = time.monotonic()
            store_blocks(a, t, [1, 2, 3])                       # committed: queued for the writer, no wait
            assert time.monotonic() - t0 < 0.3
            a.clear()
            t0 = time.monotonic()
            assert a.lookup(t, NS, 3) == []                     # the server is skipped after a failure
            assert time.monotonic() - t0 < 0.1
            st = remote_stats(a)
            assert st.errors >= 1 and dict(st.refused).get("unavailable", 0) >= 2
        finally:
            t0 = time.monotonic()
            a.close()
            assert time.monotonic() - t0 < 10                   # close gives up on the writes in bounded time


@pytest.mark.parametrize("value, error", [(5, InvalidArgumentError), ("http://x", InvalidArgumentError),
                                          ({"url": "redis://h:1", "timeout_s": "1"}, ArgumentTypeError),
                                          ({"host": "h"}, InvalidArgumentError)])
def test_a_bad_remote_setting_is_a_typed_error_naming_the_key(value, error):
    with pytest.raises(error, match=r"kv_connector_extra_config\['remote'\]"):
        ConnectorConfig.from_extra({"remote": value})
