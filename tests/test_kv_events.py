"""KV events on the wire: vLLM's EventBatch of tagged events over ZMQ PUB with a replay
socket, from the device and every tier, and a router that sends a request to the
replica holding its prefix."""
import os
import queue
import subprocess
import sys
import time

import numpy as np
import pytest

pytest.importorskip("zmq", reason="the events extra: pip install 'pagedkv[events]'")
pytest.importorskip("msgspec", reason="the events extra: pip install 'pagedkv[events]'")

import msgspec  # noqa: E402

from pagedkv import CacheConfig, PagedKVCache  # noqa: E402
from pagedkv.errors import InvalidArgumentError  # noqa: E402
from pagedkv.kv_events import KVEventPublisher, KVEventSubscriber, PrefixRouter, event_fields, wire  # noqa: E402

from tier_helpers import SHAPE, fill, make  # noqa: E402

BS = SHAPE["block_size"]
HERE = os.path.dirname(os.path.abspath(__file__))
LOOP = "tcp://127.0.0.1:0"


def prompt(start: int, n: int = 13) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int32)


def flush_device(cache) -> None:
    cache.add_sequence("flush")
    cache.reserve("flush", cache.pool.num_free_blocks * BS)
    cache.free("flush")


def listen(pub):
    sub = KVEventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint)
    time.sleep(0.05)
    return sub


def received(sub, n_batches, timeout=5.0):
    out, deadline = [], time.monotonic() + timeout
    while len(out) < n_batches and time.monotonic() < deadline:
        out += sub.poll(0.1)
    return out


def test_stores_removals_and_resets_of_every_medium_in_vllms_layout(tmp_path):
    a = prompt(100)
    with make(num_blocks=6, enable_kv_events=True, prefix_host_blocks=3, prefix_disk_dir=str(tmp_path),
              prefix_disk_blocks=16, prefix_tier_write="through") as cache, \
            KVEventPublisher(cache, LOOP, replay_endpoint=LOOP, topic="kv@pod-a@smol", data_parallel_rank=0) as pub:
        sub = listen(pub)
        fill(cache, "a", a)
        cache.free("a")
        assert pub.publish() > 0
        flush_device(cache)
        assert pub.publish() > 0
        cache.reset_prefix_cache()
        assert pub.publish() > 0
        assert pub.publish() == 0                                      # nothing new: nothing sent
        batches = received(sub, 3)
        assert [b[0] for b in batches] == [0, 1, 2] and all(b[3] == 0 for b in batches)
        events = [e for b in batches for e in b[2]]
        stored = [e for e in events if e["type"] == "BlockStored"]
        assert {e["medium"] for e in stored} == {"GPU", "CPU", "STORAGE"}
        hashes, tokens, parents = {}, {}, {}
        for e in stored:                                                # a tier's blocks may come one event each
            hashes.setdefault(e["medium"], []).extend(e["block_hashes"])
            tokens.setdefault(e["medium"], []).extend(e["token_ids"])
            parents.setdefault(e["medium"], []).append(e["parent_block_hash"])
            assert len(e["token_ids"]) == BS * len(e["block_hashes"]) and e["block_size"] == BS
        assert hashes["GPU"] == hashes["CPU"] == hashes["STORAGE"]     # one hash space, every medium
        assert len(hashes["GPU"]) == 3 and all(-2**63 <= h < 2**63 for h in hashes["GPU"])
        for medium in ("GPU", "CPU", "STORAGE"):
            assert tokens[medium] == a[:12].tolist()
            assert parents[medium][0] is None and set(parents[medium][1:]) <= set(hashes[medium])
        for e in stored:
            assert e["group_idx"] == 0
            assert e["kv_cache_spec_kind"] == "full_attention" and "kv_cache_spec_sliding_window" not in e
            assert e["lora_id"] is None and e["lora_name"] is None and "extra_keys" not in e
        removed = [e for e in events if e["type"] == "BlockRemoved"]
        assert removed and sorted(removed[0]["block_hashes"]) == sorted(hashes["GPU"])
        assert removed[0]["medium"] == "GPU"
        assert [e["type"] for e in events[-3:]] == ["AllBlocksCleared"] * 3   # the device and both tiers
        sub.close()


def test_both_wire_formats_carry_the_same_events():
    evs = None
    with make(num_blocks=8, enable_kv_events=True) as cache:
        fill(cache, "a", prompt(100), cache_salt="tenant-7")
        cache.free("a")
        evs = cache.drain_events()
    groups = [wire.group_spec(0)]
    as_map = wire.batch(evs, media=wire.MEDIA, groups=groups, wire_format="map", ts=1.0)
    as_array = wire.batch(evs, media=wire.MEDIA, groups=groups, wire_format="array", ts=1.0)
    assert isinstance(as_map[1][0], dict) and isinstance(as_array[1][0], list)
    assert as_array[1][0][0] == "BlockStored" and len(as_map) == 2          # the rank left out when None
    a = event_fields(msgspec.msgpack.decode(msgspec.msgpack.encode(as_array))[1][0])
    m = event_fields(msgspec.msgpack.decode(msgspec.msgpack.encode(as_map))[1][0])
    m.pop("locality")                                                      # only the map layout has it
    assert a == m
    assert m["extra_keys"] == [["tenant-7"]] * 3                           # (cache_salt,) per block


def test_hashes_are_signed_64_bit():
    assert wire.int64(2**64 - 1) == -1 and wire.int64(2**63) == -2**63 and wire.int64(5) == 5


def test_layer_groups_name_their_group_and_spec():
    cfg = CacheConfig(**dict(SHAPE, num_layers=4), num_blocks=32, layer_windows=(0, 8, 0, 8), enable_kv_events=True)
    with PagedKVCache(cfg) as cache, KVEventPublisher(cache, LOOP) as pub:
        sub = listen(pub)
        fill(cache, "a", prompt(100, 17))
        cache.free("a")
        pub.publish()
        events = [e for b in received(sub, 1) for e in b[2] if e["type"] == "BlockStored"]
        by_group = {e["group_idx"]: e for e in events}
        assert by_group[0]["kv_cache_spec_kind"] == "full_attention"
        assert by_group[1]["kv_cache_spec_kind"] == "sliding_window"
        assert by_group[1]["kv_cache_spec_sliding_window"] == 8
        assert by_group[0]["token_ids"][:16] == prompt(100, 16).tolist()
        sub.close()


def test_a_late_subscriber_replays_what_it_missed():
    with make(num_blocks=16, enable_kv_events=True) as cache, \
            KVEventPublisher(cache, LOOP, replay_endpoint=LOOP, buffer_steps=3) as pub:
        for i in range(5):
            fill(cache, i, prompt(1000 * i))
            cache.free(i)
            pub.publish()
        assert pub.flush()
        sub = KVEventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint)
        assert [b[0] for b in sub.replay(0)] == [2, 3, 4]                 # what the buffer still keeps
        sub.next_seq = 5
        time.sleep(0.05)
        fill(cache, "x", prompt(9000))
        cache.free("x")
        pub.publish()
        assert [b[0] for b in received(sub, 1)] == [5]
        sub.close()


class _Full(queue.Queue):
    """A queue the publisher's thread never drains and the engine finds full."""

    def put_nowait(self, item):
        raise queue.Full

    def get(self, block=True, timeout=None):
        time.sleep(0.01)
        raise queue.Empty


def test_a_full_queue_drops_a_batch_and_the_next_one_clears_first():
    with make(num_blocks=16, enable_kv_events=True) as cache, KVEventPublisher(cache, LOOP) as pub:
        sub = listen(pub)
        real, pub._queue = pub._queue, _Full()
        fill(cache, "a", prompt(100))
        cache.free("a")
        assert pub.publish() == 0 and pub.num_dropped == 1                 # dropped: the engine did not wait
        pub._queue = real
        fill(cache, "b", prompt(500))
        cache.free("b")
        assert pub.publish() == 2
        (batch,) = received(sub, 1)
        assert [e["type"] for e in batch[2]] == ["AllBlocksCleared", "BlockStored"]   # the mirror starts over
        assert batch[2][1]["token_ids"] == prompt(500)[:12].tolist()
        sub.close()


def test_a_cache_without_events_is_refused():
    with make(num_blocks=4) as cache:
        with pytest.raises(InvalidArgumentError, match="cache: expected a PagedKVCache with enable_kv_events=True"):
            KVEventPublisher(cache, LOOP)
        cache_e = make(num_blocks=4, enable_kv_events=True)
        with pytest.raises(InvalidArgumentError, match="wire_format: expected 'map' or 'array', got 'json'"):
            KVEventPublisher(cache_e, LOOP, wire_format="json")
        with pytest.raises(InvalidArgumentError, match="endpoint: expected addresses ZMQ can bind or connect"):
            KVEventPublisher(cache_e, "nonsense://x")
        cache_e.close()


def test_the_router_sends_a_shared_prefix_to_the_replica_that_holds_it():
    system = prompt(10_000, 24)                                          # a 6-block shared system prompt
    with make(num_blocks=32, enable_kv_events=True) as a, make(num_blocks=32, enable_kv_events=True) as b, \
            KVEventPublisher(a, LOOP, replay_endpoint=LOOP) as pa, KVEventPublisher(b, LOOP, replay_endpoint=LOOP) as pb:
        fill(a, "s", np.concatenate([system, prompt(1, 5)]))               # a served the system prompt
        a.free("s")
        fill(b, "o", prompt(50_000, 25))                                    # b something else
        b.free("o")
        pa.publish()
        pb.publish()
        assert pa.flush() and pb.flush()
        router = PrefixRouter({"a": KVEventSubscriber(pa.endpoint, replay_endpoint=pa.replay_endpoint),
                               "b": KVEventSubscriber(pb.endpoint, replay_endpoint=pb.replay_endpoint)}, BS)
        request = np.concatenate([system, prompt(777, 9)])
        assert router.route(request) == ("a", 6)
        assert router.route(prompt(50_000, 30)) == ("b", 6)
        assert router.route(prompt(123_456, 30))[1] == 0
        flush_device(a)                                                      # a loses the prefix
        pa.publish()
        deadline = time.monotonic() + 5
        while router.held("a", request)[0] and time.monotonic() < deadline:
            router.update(0.05)
        assert router.held("a", request) == (0, 0)
        router.close()


def test_the_router_example_runs():
    example = os.path.join(os.path.dirname(HERE), "examples", "kv_router.py")
    if not os.path.exists(example):
        pytest.skip("examples/ is not shipped in this tree")
    r = subprocess.run([sys.executable, example], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "routed to replica-a (holds 8 of its blocks)" in r.stdout
