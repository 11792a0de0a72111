"""The remote prefix tier on a real redis-server (standalone and a 3-node local cluster):
warm restarts, sharing between caches, the payload formats, the writer's bounds, the
server's size limit and TTL, and a hostile or broken server, which must cost misses or
typed errors, never wrong KV and never a wait past the configured timeout."""
import socket
import threading
import time

import numpy as np
import pytest
import torch

from pagedkv import BlockStored, CacheConfig
from pagedkv.config.remote import RemoteTierConfig
from pagedkv.errors import ArgumentTypeError, InvalidArgumentError
from pagedkv.manager.namespaces import namespace_key
from pagedkv.tiers.verify import ChainQuery, checksum

from redis_fixtures import fresh_redis, redis_cluster, redis_server  # noqa: F401
from tier_helpers import SHAPE, assert_clean, assert_kv, fill, make

BS = SHAPE["block_size"]
NS = namespace_key(None, None)
LOW_BIT = dict(head_dim=8, kv_window=0, kv_sink_tokens=0)


def prompt(start: int, n: int = 13) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int32)


def remote(url, **over):
    return RemoteTierConfig(url=url, **dict(dict(timeout_s=2.0, retry_after_s=0.0), **over))


def written(url, tokens, **opts):
    """A cache that computes ``tokens`` and writes them through to the remote tier;
    returns the reference KV (what a hit must read back)."""
    r = opts.pop("prefix_remote", None) or remote(url)
    blocks = opts.pop("num_blocks", len(tokens) // BS + 2)
    with make(num_blocks=blocks, prefix_remote=r, prefix_tier_write="through", **opts) as cache:
        fill(cache, "w", tokens)
        want = [cache.gather("w", layer) for layer in range(SHAPE["num_layers"])]
        cache.free("w")
        assert cache._tiers.remote.flush(10)
        assert cache.stats().tiers[-1].written_blocks == len(tokens) // BS * len(cache._tiers.groups)
    return want


def served(cache, tokens, want, expect_hit):
    """The hit is ``expect_hit`` and the sequence reads exactly the writer's KV (the hit
    part from the tier, the rest computed)."""
    assert fill(cache, "r", tokens) == expect_hit
    for layer, (k, v) in enumerate(want):
        got = cache.gather("r", layer)
        assert torch.equal(got[0], k) and torch.equal(got[1], v)
    cache.free("r")


def keys_of(tier, tokens, ns=NS):
    q = ChainQuery(tokens, ns, BS)
    return [tier.wire.key(q.digest(i)) for i in range(q.num_blocks)]


@pytest.mark.parametrize("kv_dtype, extra", [(None, {}), ("int8", {}), ("int4", LOW_BIT),
                                             ("int4", dict(head_dim=8, kv_window=4, kv_sink_tokens=2))],
                         ids=["float32", "int8", "int4", "int4-window-sinks"])
def test_a_warm_restart_hits_the_remote_tier_bit_exact(fresh_redis, kv_dtype, extra):
    a = prompt(100, 17)                                       # 4 full blocks + 1
    want = written(fresh_redis.url, a, kv_dtype=kv_dtype, **extra)
    with make(num_blocks=8, kv_dtype=kv_dtype, prefix_remote=remote(fresh_redis.url), **extra) as cache:
        assert cache.match_prefix(a) == 16
        served(cache, a, want, 16)
        st = cache.stats()
        assert st.remote_hit_tokens == 16 and st.device_hit_tokens == 0
        assert_clean(cache)


def test_a_value_is_a_header_and_the_record_in_its_at_rest_format(fresh_redis):
    header = 4 + 2 + 2 + 16 * 3 + 4 + 8 + 4 * BS + 4          # fixed part, tokens, CRC-32
    sizes = {}
    for name, opts in (("float32", dict(head_dim=64)),
                       ("int4", dict(head_dim=64, kv_dtype="int4", kv_window=0, kv_sink_tokens=0))):
        fresh_redis.client().flushall()
        written(fresh_redis.url, prompt(100), **opts)
        c = fresh_redis.client()
        sizes[name] = {c.strlen(k) for k in c.keys("pagedkv:*")}
        with make(num_blocks=4, **opts) as cache:
            bpb = cache.config.bytes_per_block
        assert sizes[name] == {header + bpb}, (name, sizes[name], bpb)     # one record: every arena, no padding here
    (f32,), (i4,) = sizes["float32"], sizes["int4"]
    assert f32 - header == 2 * 2 * BS * 2 * 64 * 4
    assert (i4 - header) * 6 < f32 - header                   # int4 codes and scales: over 6x fewer bytes than fp32


def test_a_block_without_sink_or_window_rows_leaves_them_out_of_its_value(fresh_redis):
    opts = dict(head_dim=8, kv_dtype="int4", kv_window=4, kv_sink_tokens=2, kv_window_sequences=1)
    a = prompt(100, 33)                                        # 8 blocks: sinks in the first, the window at the end
    want = written(fresh_redis.url, a, **opts)
    with make(num_blocks=12, prefix_remote=remote(fresh_redis.url), **opts) as cache:
        tier = cache._tiers.remote
        c = fresh_redis.client()
        sizes = [c.strlen(k) for k in keys_of(tier, a)]
        full = tier.wire.value_bytes
        short = tier.wire.header_bytes + tier.layout.section("rows").offset
        assert sizes[0] == full and short in sizes and set(sizes) <= {full, short}
        served(cache, a, want, 32)                             # rows or none, every block reads as in place
        assert_clean(cache)


def test_two_caches_share_prefixes_through_one_server_and_write_back_goes_host_then_remote(fresh_redis):
    a, b = prompt(100), prompt(500)
    r = remote(fresh_redis.url)
    with make(num_blocks=6, prefix_host_blocks=3, prefix_remote=r) as one, \
            make(num_blocks=6, prefix_remote=r) as two:
        assert [t.medium for t in one._tiers.tiers] == ["host", "remote"]
        fill(one, "a", a)
        one.free("a")
        fill(one, "b", b)                                     # a's blocks: device -> host
        one.free("b")
        one.add_sequence("f")
        one.reserve("f", one.pool.num_free_blocks * BS)      # b's too: host evicts a's -> remote
        one.free("f")
        assert one._tiers.remote.flush(10)
        assert one.stats().tiers[0].eviction_count >= 3
        assert two.match_prefix(a) == 12
        assert fill(two, "a", a) == 12
        assert_kv(two, "a", a)
        two.free("a")
        assert two.stats().remote_hit_tokens == 12
        assert_clean(one)
        assert_clean(two)


def test_a_cluster_spreads_the_blocks_and_serves_them(redis_cluster):
    a = prompt(100, 33)                                       # 8 full blocks
    want = written(redis_cluster.url, a)
    per_node = [n.client().dbsize() for n in redis_cluster.nodes]
    assert sum(per_node) == 8 and sum(1 for n in per_node if n) >= 2
    with make(num_blocks=12, prefix_remote=remote(redis_cluster.url)) as cache:
        served(cache, a, want, 32)
        assert_clean(cache)


def test_keys_hold_no_cluster_hash_tag_whatever_the_fingerprint_and_digest_bytes():
    from pagedkv.tiers.remote_wire import Wire

    w = Wire("pagedkv", b"{" + bytes(14) + b"}", 4, 64)          # a fingerprint with braces in it
    keys = [w.key(bytes([i]) + b"{" + bytes(13) + b"}" + bytes([i])) for i in range(4)]
    assert len(set(keys)) == 4 and not any(b"{" in k or b"}" in k for k in keys)
    assert all(k.startswith(w.prefix) for k in keys) and w.pattern().endswith(b"*")


def test_a_cluster_node_down_mid_run_costs_the_blocks_behind_it_never_wrong_kv_nor_a_hang(redis_cluster):
    a = prompt(100, 33)
    want = written(redis_cluster.url, a)
    with make(num_blocks=12, prefix_remote=remote(redis_cluster.url, timeout_s=0.5)) as cache:
        tier = cache._tiers.remote
        keys = keys_of(tier, a)
        victim = next(n for n in redis_cluster.nodes if n.client().dbsize())
        on_victim = set(victim.client().scan_iter())
        held = [i for i, k in enumerate(keys) if k in on_victim]
        victim.stop()
        t0 = time.monotonic()
        hit = fill(cache, "r", a)
        assert time.monotonic() - t0 < 0.5 + 1.5           # the timeout, plus this machine's slack
        assert hit == min(held) * BS, held                  # every block before the first on the dead node
        for layer, (k, v) in enumerate(want):
            got = cache.gather("r", layer)
            assert torch.equal(got[0], k) and torch.equal(got[1], v)    # the rest was computed: exact
        cache.free("r")
        assert_clean(cache)


# ---- a hostile or broken server ---------------------------------------------------------------------
def _tamper(server, key, fn):
    c = server.client()
    c.set(key, fn(c.get(key)))


@pytest.mark.parametrize("how, reason", [
    ("flip a record byte", "checksum"),
    ("flip a token", "other_key"),
    ("truncate", "truncated"),
    ("extend", "truncated"),
    ("other key's value", "other_key"),
    ("another format's value", "other_format"),
    ("garbage", "foreign"),
    ("empty", "truncated"),
])
def test_a_server_that_returns_wrong_values_costs_a_miss_never_wrong_kv(fresh_redis, how, reason):
    a = prompt(100, 17)
    want = written(fresh_redis.url, a)
    other = written(fresh_redis.url, a, kv_dtype="int8")        # the same tokens in another format
    assert other
    with make(num_blocks=8, prefix_remote=remote(fresh_redis.url)) as cache:
        tier = cache._tiers.remote
        keys = keys_of(tier, a)
        c = fresh_redis.client()
        victim = keys[2]
        if how == "flip a record byte":
            _tamper(fresh_redis, victim, lambda v: v[:-5] + bytes([v[-5] ^ 1]) + v[-4:])
        elif how == "flip a token":
            off = 4 + 2 + 2 + 48 + 4 + 8
            _tamper(fresh_redis, victim, lambda v: v[:off] + bytes([v[off] ^ 1]) + v[off + 1:])
        elif how == "truncate":
            _tamper(fresh_redis, victim, lambda v: v[:-7])
        elif how == "extend":
            _tamper(fresh_redis, victim, lambda v: v + b"\x00" * 4)
        elif how == "other key's value":
            c.set(victim, c.get(keys[1]))
        elif how == "another format's value":
            foreign = [k for k in c.keys("pagedkv:*") if not k.startswith(tier.wire.prefix)]
            c.set(victim, c.get(foreign[0]))
        elif how == "garbage":
            c.set(victim, b"\xde\xad\xbe\xef" * 100)
        else:
            c.set(victim, b"")
        served(cache, a, want, 8)                                  # the blocks before the bad one
        assert dict(cache.stats().tiers[0].refused).get(reason, 0) >= 1
        assert cache.stats().tiers[0].corrupt_blocks >= 1
        assert_clean(cache)


def test_a_value_forged_with_a_valid_crc_is_refused_when_the_hosts_share_a_secret(fresh_redis):
    a = prompt(100, 17)
    secret = remote(fresh_redis.url, secret="s3cret")
    want = written(fresh_redis.url, a, prefix_remote=secret)
    with make(num_blocks=8, prefix_remote=secret) as cache:
        tier = cache._tiers.remote
        key = keys_of(tier, a)[1]
        c = fresh_redis.client()
        v = c.get(key)
        head, tag, record = v[:tier.wire.header_bytes - 16], v[tier.wire.header_bytes - 16:tier.wire.header_bytes], \
            bytearray(v[tier.wire.header_bytes:])
        assert checksum((head, bytes(record)), b"s3cret") == tag
        record[-1] ^= 0xFF                                       # the KV changed, the tag recomputed with a guess
        c.set(key, head + checksum((head, bytes(record)), b"guess") + bytes(record))
        served(cache, a, want, 4)
        assert dict(cache.stats().tiers[0].refused)["checksum"] == 1
    with make(num_blocks=8, prefix_remote=remote(fresh_redis.url, secret="other")) as cache:
        assert fill(cache, "r", a) == 0                          # another secret: nothing verifies
        assert dict(cache.stats().tiers[0].refused) == {"checksum": 1}
        cache.free("r")


def test_a_server_that_stops_answering_costs_at_most_the_timeout(fresh_redis):
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    a, b = prompt(100, 17), prompt(500, 17)
    written(fresh_redis.url, a)
    written(fresh_redis.url, b)
    with make(num_blocks=8, prefix_remote=remote(fresh_redis.url, timeout_s=0.3, retry_after_s=5.0)) as cache:
        probe = fresh_redis.client(socket_timeout=0.05, socket_connect_timeout=5, retry=Retry(NoBackoff(), 0))
        probe.ping()                                             # connected before the server sleeps
        sleeper = threading.Thread(target=lambda: fresh_redis.client().execute_command("DEBUG", "SLEEP", "2"))
        sleeper.start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:                       # until the server stops answering
            try:
                probe.ping()
                time.sleep(0.01)
            except Exception:
                break
        t0 = time.monotonic()
        assert fill(cache, "r", a) == 0                          # a miss, not a hang
        first = time.monotonic() - t0
        cache.free("r")
        t0 = time.monotonic()
        assert fill(cache, "r", b) == 0                          # skipped while retry_after_s runs: no wait at all
        second = time.monotonic() - t0
        cache.free("r")
        sleeper.join()
        assert first < 0.3 + 1.0 and second < 0.2, (first, second)
        st = cache.stats().tiers[0]
        assert st.errors >= 1 and dict(st.refused)["unavailable"] >= 2
        assert_clean(cache)


def test_a_dropped_connection_and_a_restarted_server_recover(fresh_redis):
    a, b = prompt(100, 17), prompt(700, 17)
    want = written(fresh_redis.url, a)
    with make(num_blocks=8, prefix_remote=remote(fresh_redis.url, timeout_s=0.5), prefix_tier_write="through") as cache:
        fresh_redis.client().client_kill_filter(_type="normal", skipme=True)     # drops the cache's connections
        served(cache, a, want, 16)                               # reconnects at once
        fresh_redis.stop()
        t0 = time.monotonic()
        assert fill(cache, "b", b) == 0                          # down: a miss and a dropped write
        cache.free("b")
        assert time.monotonic() - t0 < 1.5
        assert cache._tiers.remote.flush(5)
        assert cache.stats().tiers[0].dropped_blocks >= 1
        fresh_redis.start()                                      # empty after the restart (no persistence)
        c = prompt(900, 17)
        fill(cache, "c", c)                                      # written through again
        cache.free("c")
        assert cache._tiers.remote.flush(5)
        assert fresh_redis.client().exists(*keys_of(cache._tiers.remote, c)) == 4
        assert_clean(cache)


def test_a_server_that_accepts_but_never_answers_costs_the_timeout(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        url = f"redis://127.0.0.1:{s.getsockname()[1]}/0"
        with make(num_blocks=8, prefix_remote=remote(url, timeout_s=0.2), prefix_tier_write="through") as cache:
            a = prompt(100, 17)
            t0 = time.monotonic()
            assert fill(cache, "a", a) == 0
            assert cache.match_prefix(prompt(900)) == 0
            cache.free("a")
            assert time.monotonic() - t0 < 1.5
            t0 = time.monotonic()
        assert time.monotonic() - t0 < 10                        # close() gives up on the writes in bounded time


# ---- bounds, size limit, TTL, prefetch ------------------------------------------------------------------
def test_the_writer_queue_is_bounded_and_never_blocks(fresh_redis):
    r = remote(fresh_redis.url, max_queue_bytes=1200)            # room for two 512-byte blocks at most
    with make(num_blocks=32, prefix_remote=r, prefix_tier_write="through") as cache:
        fill(cache, "a", prompt(100, 33))                        # 8 blocks registered (and queued) at once
        cache.free("a")
        st = cache.stats().tiers[0]
        assert st.dropped_blocks >= 6 and st.queued_blocks <= 2
        assert cache._tiers.remote.flush(5)
        assert cache.stats().tiers[0].written_blocks + cache.stats().tiers[0].dropped_blocks == 8


def test_the_servers_size_limit_holds_and_survivors_are_exact(fresh_redis):
    c = fresh_redis.client()
    base = c.info("memory")["used_memory"]
    c.config_set("maxmemory", base + (1 << 20))
    c.config_set("maxmemory-policy", "allkeys-lru")
    c.config_set("maxmemory-samples", 64)                      # close to exact LRU: the newest survive
    big = dict(num_kv_heads=4, head_dim=32)                     # 4 KiB a block
    prompts = [prompt(1000 * i, 33) for i in range(40)]         # 320 blocks written
    for p in prompts:
        written(fresh_redis.url, p, **big)
    assert c.info("memory")["used_memory"] <= base + (1 << 20) + (100 << 10)
    assert c.info("stats")["evicted_keys"] > 0 and 0 < c.dbsize() < 320
    with make(num_blocks=12, prefix_remote=remote(fresh_redis.url), **big) as cache:
        hits = {}
        for i in (39, 38, 37, 0):                                # newest first (reads write back too)
            hits[i] = fill(cache, i, prompts[i])
            assert_kv(cache, i, prompts[i])
            cache.free(i)
        # the newest survived, the oldest went (Redis's LRU samples keys: a stray old block may stay)
        assert hits[39] + hits[38] + hits[37] > 0 and hits[0] < max(hits[39], hits[38], hits[37])
    c.config_set("maxmemory-policy", "noeviction")
    c.flushall(asynchronous=False)
    c.config_set("maxmemory", c.info("memory")["used_memory"] + (16 << 10))     # room for a few blocks
    with make(num_blocks=40, prefix_remote=remote(fresh_redis.url), prefix_tier_write="through", **big) as cache:
        fill(cache, "x", prompt(5, 129))                         # 32 blocks: the server refuses most (OOM)
        cache.free("x")
        assert cache._tiers.remote.flush(5)
        st = cache.stats().tiers[0]
        assert st.dropped_blocks > 0 and st.written_blocks + st.dropped_blocks == 32


def test_keys_expire_after_their_ttl(fresh_redis):
    a = prompt(100, 17)
    written(fresh_redis.url, a, prefix_remote=remote(fresh_redis.url, ttl_s=0.3))
    c = fresh_redis.client()
    assert all(0 < c.pttl(k) <= 300 for k in c.keys("pagedkv:*"))
    time.sleep(0.5)
    with make(num_blocks=8, prefix_remote=remote(fresh_redis.url)) as cache:
        assert fill(cache, "r", a) == 0
        cache.free("r")


def test_a_prefetched_prefix_is_served_without_the_server(fresh_redis):
    a = prompt(100, 17)
    want = written(fresh_redis.url, a)
    with make(num_blocks=8, prefix_remote=remote(fresh_redis.url)) as cache:
        cache.prefetch_prefix(a)
        deadline = time.monotonic() + 5
        while len(cache._tiers.remote.landing) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        fresh_redis.stop()                                       # the admission needs no server now
        served(cache, a, want, 16)
        assert_clean(cache)


def test_clear_server_removes_this_formats_keys_only_and_reset_keeps_them(fresh_redis):
    a = prompt(100, 17)
    written(fresh_redis.url, a)
    written(fresh_redis.url, a, kv_dtype="int8")
    c = fresh_redis.client()
    assert c.dbsize() == 8
    with make(num_blocks=8, prefix_remote=remote(fresh_redis.url)) as cache:
        cache.reset_prefix_cache()
        assert c.dbsize() == 8                                  # shared with other hosts: kept
        assert cache.match_prefix(a) == 16
        assert cache._tiers.remote.clear_server() == 4
        assert c.dbsize() == 4 and cache.match_prefix(a) == 0


def test_remote_events_name_the_remote_medium(fresh_redis):
    with make(num_blocks=8, prefix_remote=remote(fresh_redis.url), prefix_tier_write="through",
              enable_kv_events=True) as cache:
        fill(cache, "a", prompt(100, 17))
        cache.free("a")
        stored = [e for e in cache.drain_events() if isinstance(e, BlockStored)]
        dev = [e for e in stored if e.medium == "device"]
        rem = [e for e in stored if e.medium == "remote"]
        assert sum(len(e.block_hashes) for e in rem) == 4
        assert [h for e in rem for h in e.block_hashes] == [h for e in dev for h in e.block_hashes]


def test_remote_options_are_validated():
    base = dict(SHAPE, num_blocks=4)
    with pytest.raises(InvalidArgumentError, match=r"prefix_remote\.url: expected a URL with a scheme among redis, "
                                                   r"rediss, unix, redis\+cluster, rediss\+cluster, got 'http://x'"):
        CacheConfig(**base, prefix_remote="http://x")
    with pytest.raises(InvalidArgumentError, match=r"prefix_remote\.timeout_s: expected a number >= 0\.001, got 0"):
        CacheConfig(**base, prefix_remote={"url": "redis://h:1", "timeout_s": 0})
    with pytest.raises(ArgumentTypeError, match=r"prefix_remote\.batch_blocks: expected an int, got str '8'"):
        CacheConfig(**base, prefix_remote={"url": "redis://h:1", "batch_blocks": "8"})
    with pytest.raises(InvalidArgumentError, match=r"prefix_remote: expected keys among .*, got unknown key 'ttl'"):
        CacheConfig(**base, prefix_remote={"url": "redis://h:1", "ttl": 3})
    with pytest.raises(InvalidArgumentError, match=r"prefix_remote\.key_prefix: expected 1 to 64 characters"):
        CacheConfig(**base, prefix_remote={"url": "redis://h:1", "key_prefix": "a b"})
    cfg = CacheConfig(**base, prefix_remote={"url": "redis://h:1", "secret": "k"})
    assert cfg.prefix_remote.secret == b"k" and "k'" not in repr(cfg.prefix_remote)
    with pytest.raises(InvalidArgumentError, match=r"prefix_remote\.max_landed_bytes: expected >= one block's record"):
        make(num_blocks=4, prefix_remote={"url": "redis://h:1", "max_landed_bytes": 16})


def test_a_block_fetched_from_the_tier_is_not_sent_back_and_existing_keys_can_be_skipped(fresh_redis):
    a = prompt(100, 17)
    written(fresh_redis.url, a)
    with make(num_blocks=8, prefix_remote=remote(fresh_redis.url), prefix_tier_write="through") as cache:
        assert fill(cache, "r", a) == 16                       # promoted from the tier, registered on the device
        cache.free("r")
        assert cache._tiers.remote.flush(5)
        st = cache._tiers.remote.writer
        assert (st.num_sent, st.num_present) == (0, 0)          # nothing went back
    c = fresh_redis.client()
    c.execute_command("CONFIG", "RESETSTAT")
    with make(num_blocks=8, prefix_remote=remote(fresh_redis.url, check_existing=True, ttl_s=50.0),
              prefix_tier_write="through") as cache:
        cache.add_sequence("w", a, max_cached_tokens=0)         # computes a again: the same blocks
        cache.reserve("w", len(a))
        cache.commit("w", len(a))
        cache.free("w")
        assert cache._tiers.remote.flush(5)
        st = cache._tiers.remote.writer
        assert (st.num_sent, st.num_present) == (0, 4)          # asked first: already there, not sent
    assert "cmdstat_set" not in c.info("commandstats")
    assert all(0 < c.pttl(k) <= 50_000 for k in c.keys("pagedkv:*"))   # their TTL refreshed


def test_layer_groups_go_through_the_remote_tier_each_under_its_own_namespace(fresh_redis):
    opts = dict(num_layers=4, layer_windows=(0, 8, 0, 8))      # a full group and a sliding one
    a = prompt(100, 17)
    want = written(fresh_redis.url, a, num_blocks=16, **opts)
    with make(num_blocks=16, prefix_remote=remote(fresh_redis.url), **opts) as cache:
        cache.prefetch_prefix(a)
        deadline = time.monotonic() + 5
        while len(cache._tiers.remote.landing) < 8 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(cache._tiers.remote.landing) == 8           # 4 blocks in each group's chain
        fresh_redis.stop()
        assert fill(cache, "r", a) == 16
        for layer, (k, v) in enumerate(want):
            got = cache.gather("r", layer)
            assert torch.equal(got[0], k) and torch.equal(got[1], v)
        cache.free("r")
        cache.check_invariants()
