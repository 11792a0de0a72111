"""Replicas for test_event_hashes.py, one process: for each ``[hash_seed, cache_salt,
prompts]`` on stdin, a cache with events and a host tier fed those prompts in order;
prints each one's wire events (msgpack, decoded)."""
import json
import sys

import msgspec
import numpy as np

from pagedkv.kv_events import wire

sys.path.insert(0, __import__("os").path.dirname(__file__))
from tier_helpers import fill, make  # noqa: E402


def run(seed, salt, prompts):
    with make(num_blocks=8, enable_kv_events=True, hash_seed=seed, prefix_host_blocks=32) as cache:
        for i, p in enumerate(prompts):
            fill(cache, i, np.asarray(p, dtype=np.int32), cache_salt=salt)
            cache.free(i)
        cache.add_sequence("flush")                       # everything to the host tier
        cache.reserve("flush", cache.pool.num_free_blocks * 4)
        cache.free("flush")
        batch = wire.batch(cache.drain_events(), media=wire.MEDIA, groups=[wire.group_spec(0)], ts=0.0)
    return msgspec.msgpack.decode(msgspec.msgpack.encode(batch))[1]


def main():
    print(json.dumps([run(*r) for r in json.loads(sys.stdin.read())]))


if __name__ == "__main__":
    main()
