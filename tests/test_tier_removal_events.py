"""Removal events of every tier: a block that leaves the host, disk or remote tier (an
eviction, a reset, another process's change, the server's TTL or size limit found on
a lookup) is a ``BlockRemoved`` with that tier's medium, so a router that follows the
stream (decoded from the wire) never counts a replica for a prefix it lost."""
import time

import numpy as np
import pytest

pytest.importorskip("zmq", reason="the events extra: pip install 'pagedkv[events]'")
pytest.importorskip("msgspec", reason="the events extra: pip install 'pagedkv[events]'")
pytest.importorskip("redis", reason="the remote extra: pip install 'pagedkv[remote]'")

from pagedkv.config.remote import RemoteTierConfig  # noqa: E402
from pagedkv.format.fingerprint import kv_format  # noqa: E402
from pagedkv.kv_events import KVEventPublisher, KVEventSubscriber, wire  # noqa: E402
from pagedkv.tiers.disk import DiskPrefixTier  # noqa: E402
from pagedkv.tiers.payload import Blocks  # noqa: E402
from pagedkv.tiers.verify import ChainQuery  # noqa: E402

from redis_fixtures import fresh_redis, redis_server  # noqa: E402,F401
from tier_helpers import SHAPE, assert_clean, fill, make  # noqa: E402

BS = SHAPE["block_size"]
LOOP = "tcp://127.0.0.1:0"


def prompt(start: int, n: int = 17) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int32)


def flush_device(cache) -> None:
    cache.add_sequence("flush")
    cache.reserve("flush", cache.pool.num_free_blocks * BS)
    cache.free("flush")


class Mirror:
    """What a router following the decoded wire believes, per medium: block hash -> tokens."""

    def __init__(self, pub):
        self.sub = KVEventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint)
        self.media: dict[str, dict[int, tuple]] = {}
        self.sent = 0
        time.sleep(0.05)

    def update(self, pub):
        self.sent += pub.publish() > 0
        assert pub.flush()
        deadline = time.monotonic() + 5
        while self.sub.next_seq < self.sent and time.monotonic() < deadline:
            for _seq, _ts, events, _rank in self.sub.poll(0.1):
                for e in events:
                    if e["type"] == "BlockStored":
                        bs = e["block_size"]
                        held = self.media.setdefault(e["medium"], {})
                        for i, h in enumerate(e["block_hashes"]):
                            held[h] = tuple(e["token_ids"][i * bs:(i + 1) * bs])
                    elif e["type"] == "BlockRemoved":
                        for h in e["block_hashes"]:
                            self.media.get(e["medium"], {}).pop(h, None)
                    else:
                        self.media.clear()
        assert self.sub.next_seq >= self.sent, "the events did not arrive"

    def holds(self, medium):
        return set(self.media.get(medium, {}))


def remote(url, **over):
    return RemoteTierConfig(url=url, timeout_s=2.0, retry_after_s=0.0, **over)


def device_hashes(cache, tokens):
    """The device hashes a router is told for ``tokens``' full blocks."""
    return [wire.int64(h) for h in cache.index.hash_tokens(np.asarray(tokens, dtype=np.int32), 0).tolist()]


def on_server(tier, tokens):
    """How many leading blocks of ``tokens`` the server serves (asked directly)."""
    return tier.contains(ChainQuery(np.asarray(tokens, dtype=np.int32), tier_ns(tier), BS), 0, len(tokens) // BS)


def tier_ns(tier):
    return next(iter(tier._known.values()))[2]


def test_a_block_the_server_lost_leaves_the_stream_with_the_blocks_below_it(fresh_redis):
    a, b = prompt(100), prompt(500)
    with make(num_blocks=16, prefix_remote=remote(fresh_redis.url), prefix_tier_write="through",
              enable_kv_events=True) as cache, KVEventPublisher(cache, LOOP, replay_endpoint=LOOP) as pub:
        mirror = Mirror(pub)
        for seq, toks in (("a", a), ("b", b)):
            fill(cache, seq, toks)
            cache.free(seq)
        tier = cache._tiers.remote
        assert tier.flush(5)
        mirror.update(pub)
        ha, hb = device_hashes(cache, a), device_hashes(cache, b)
        assert mirror.holds("REMOTE") == set(ha + hb) and mirror.holds("GPU") == set(ha + hb)
        # the server evicts a's second block (its size limit, a TTL); pagedkv learns at a lookup
        fresh_redis.client().delete(tier.wire.key(ChainQuery(a, tier_ns(tier), BS).digest(1)))
        flush_device(cache)
        assert cache.match_prefix(a) == BS                       # the block, and what hangs below it, gone
        mirror.update(pub)
        assert mirror.holds("REMOTE") == set(ha[:1] + hb)         # what the server still serves, no more
        assert mirror.holds("GPU") == set()
        assert on_server(tier, a) == 1 and on_server(tier, b) == 4
        # a's lost blocks are stored again by the next computation of them
        assert fill(cache, "a", a) == BS
        cache.free("a")
        assert tier.flush(5)
        mirror.update(pub)
        assert mirror.holds("REMOTE") == set(ha + hb) and on_server(tier, a) == 4
        assert_clean(cache)


def test_stores_the_writer_could_not_make_are_removed(fresh_redis):
    r = remote(fresh_redis.url, max_queue_bytes=1200)            # room for two 512-byte blocks at most
    with make(num_blocks=32, prefix_remote=r, prefix_tier_write="through", enable_kv_events=True) as cache, \
            KVEventPublisher(cache, LOOP, replay_endpoint=LOOP) as pub:
        mirror = Mirror(pub)
        fresh_redis.stop()                                          # every send fails
        try:
            for i in range(4):
                fill(cache, f"s{i}", prompt(1000 * i + 7))
                cache.free(f"s{i}")
            cache._tiers.remote.flush(5)
            mirror.update(pub)
            assert mirror.holds("REMOTE") == set()                 # announced, then taken back
            assert mirror.holds("GPU")
        finally:
            fresh_redis.start()


def test_a_reset_clears_every_tier_in_the_stream(tmp_path):
    with make(num_blocks=6, enable_kv_events=True, prefix_host_blocks=3, prefix_disk_dir=str(tmp_path),
              prefix_disk_blocks=16) as cache, KVEventPublisher(cache, LOOP, replay_endpoint=LOOP) as pub:
        mirror = Mirror(pub)
        for i in range(3):
            fill(cache, f"s{i}", prompt(100 * i + 1))
            cache.free(f"s{i}")
        flush_device(cache)                                        # write-back: device -> host -> disk
        mirror.update(pub)
        host, disk = cache._tiers.host, cache._tiers.disk
        assert len(mirror.holds("CPU")) == host.index.num_used > 0
        assert len(mirror.holds("STORAGE")) == disk.index.num_used > 0
        cache.reset_prefix_cache()
        mirror.update(pub)
        assert mirror.media == {}


def test_host_and_disk_evictions_keep_the_stream_equal_to_what_the_tiers_hold(tmp_path):
    with make(num_blocks=6, enable_kv_events=True, prefix_host_blocks=3, prefix_disk_dir=str(tmp_path),
              prefix_disk_blocks=4) as cache, \
            KVEventPublisher(cache, LOOP, replay_endpoint=LOOP) as pub:
        mirror = Mirror(pub)
        for i in range(6):                                         # more than the host and the disk hold
            fill(cache, f"s{i}", prompt(100 * i + 1))
            cache.free(f"s{i}")
            flush_device(cache)
            mirror.update(pub)
            for medium, tier in (("CPU", cache._tiers.host), ("STORAGE", cache._tiers.disk)):
                held = {wire.int64(cache._tiers.log.device_hash(tier, s)) for s in np.flatnonzero(tier.index.rec["valid"] == 1)}
                assert mirror.holds(medium) == held, medium
        assert cache._tiers.disk.index.num_evictions > 0
        assert_clean(cache)


def test_a_disk_tier_reports_what_another_process_evicted_or_cleared_at_its_next_turn(tmp_path):
    with make(num_blocks=16) as cache:
        fmt = kv_format(cache.store, "")
        opts = dict(eviction="lru", weak_hash=False, verify_blocks=False)
        a = DiskPrefixTier(str(tmp_path), cache.store.arenas, 64, BS, fmt, **opts)
        a.unlock()
        b = DiskPrefixTier(str(tmp_path), cache.store.arenas, 64, BS, fmt, **opts)
        b.unlock()
        lost: list = []
        b.set_callbacks(None, lambda s: None, on_lost=lambda slots: lost.append(
            None if slots is None else sorted((s, tuple(b.record(s).tokens.tolist())) for s in slots)))
        one, two = prompt(100, 13), prompt(500, 13)
        for tier, toks in ((b, one), (b, two)):
            assert tier.relock(1.0)
            fill(cache, "s", toks)
            blocks = cache.block_table("s")[:3].tolist()
            assert tier.batched_put(ChainQuery(toks, b"ns", BS), 0, Blocks(cache.store.arenas, None, None), blocks) == 3
            cache.free("s")
            tier.unlock()
        assert a.relock(1.0)                                         # "a" (another engine) evicts two's chain
        gone = a.lookup(ChainQuery(two, b"ns", BS), 0, 3)
        for s in a.subtree(gone[0]):
            a.index.remove(s)
        assert a.lookup(ChainQuery(one, b"ns", BS), 0, 3)             # and touches one's: not a loss
        a.unlock()
        assert b.relock(1.0) and lost == [sorted((s, tuple(two[i * BS:(i + 1) * BS].tolist()))
                                                 for i, s in enumerate(gone))]
        b.unlock()
        assert a.relock(1.0)
        a.clear()                                                    # a reset: b cannot say which survive
        a.unlock()
        assert b.relock(1.0) and lost[-1] is None and b.index.num_used == 0
        for t in (a, b):
            t.close()
