"""Recurrent-state snapshots on the remote tier (pagedkv.tiers.state_shelf.RemoteStateShelf):
a second host finds the first host's snapshot on the server and resumes from it; a
value that fails its checks, or a server that is down, is a shorter hit, never a wrong
state or an error. A real redis-server on a loopback port."""
import time

from redis_fixtures import fresh_redis, redis_server  # noqa: F401
from test_state_tiers import A, assert_state, config, prefill, step

from pagedkv import PagedKVCache
from pagedkv.config.remote import RemoteTierConfig


def remote_config(url, **kw):
    rc = RemoteTierConfig(url=url, timeout_s=kw.pop("timeout_s", 2.0), retry_after_s=0.0)
    return config(prefix_remote=rc, prefix_tier_write="through", hash_seed=7, **kw)


def computed_on_a_first_host(url):
    with PagedKVCache(remote_config(url)) as kv:
        prefill(kv, "a", A, (4, 4, 2))             # snapshots at 4 and 8 tokens
        kv.free("a")
        assert kv._tiers.remote.flush(10)
        shelf = kv._groups.tier_states.shelves[-1]
        assert shelf.medium == "remote" and shelf.stats()["stored"] == 2


def test_a_second_host_resumes_from_the_first_hosts_snapshot(fresh_redis):  # noqa: F811
    computed_on_a_first_host(fresh_redis.url)
    with PagedKVCache(remote_config(fresh_redis.url)) as kv:      # another host: empty device and index
        assert kv.match_prefix(A) == 8
        assert kv.add_sequence("b", A) == 8
        assert kv.stats().remote_hit_tokens == 8
        assert_state(kv, "b", A[:8])                # the first host's state, verified
        step(kv, "b", A, 2)
        assert_state(kv, "b", A)
        kv.free("b")
        kv.check_invariants()


def test_a_changed_value_on_the_server_is_a_shorter_hit(fresh_redis):  # noqa: F811
    computed_on_a_first_host(fresh_redis.url)
    client = fresh_redis.client()
    names = sorted(client.keys("*:state:*"), key=lambda n: len(client.get(n)))
    assert len(names) == 2
    whole = client.get(names[-1])                   # the 8-token snapshot (the longer record)
    raw = bytearray(whole)
    raw[-40] ^= 0x10                                # a bit of the state bytes
    client.set(names[-1], bytes(raw))
    with PagedKVCache(remote_config(fresh_redis.url)) as kv:
        assert kv.add_sequence("b", A) == 4          # the 8-token one fails its checksum
        assert_state(kv, "b", A[:4])
        assert kv._groups.tier_states.shelves[-1].stats()["verify_failures"] == 1
        kv.free("b")
    assert client.get(names[-1]) is None            # the failing record was dropped from the server
    client.set(names[0], whole)                     # a whole record under another key: its tokens differ
    with PagedKVCache(remote_config(fresh_redis.url)) as kv:
        assert kv.add_sequence("b", A) == 0           # no snapshot checks out: computed from the start
        step(kv, "b", A, 4)
        assert_state(kv, "b", A[:4])
        kv.free("b")


def test_a_server_that_is_down_costs_a_miss_not_an_error(fresh_redis):  # noqa: F811
    computed_on_a_first_host(fresh_redis.url)
    with PagedKVCache(remote_config(fresh_redis.url, timeout_s=0.5)) as kv:
        fresh_redis.stop()
        t0 = time.monotonic()
        assert kv.add_sequence("b", A) == 0
        assert time.monotonic() - t0 < 3.0
        step(kv, "b", A, 4)                          # computing goes on; its snapshot's write is a miss too
        assert_state(kv, "b", A[:4])
        kv.free("b")
        kv.check_invariants()
