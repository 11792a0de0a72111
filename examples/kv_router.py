"""Route requests between two pagedkv replicas by their KV events.

Two caches ("replica-a" and "replica-b", here in one process; in a deployment, two
engine processes on two hosts) publish their KV events over ZMQ in vLLM's wire format
(:class:`pagedkv.kv_events.KVEventPublisher`). A :class:`pagedkv.kv_events.PrefixRouter`
subscribes to both and sends each request to the replica that already holds the
longest prefix of it. Run: ``python examples/kv_router.py``.
"""
import time

import numpy as np

from pagedkv import CacheConfig, PagedKVCache
from pagedkv.kv_events import KVEventPublisher, KVEventSubscriber, PrefixRouter

BLOCK = 16
SHAPE = dict(num_layers=2, num_kv_heads=2, head_dim=8, block_size=BLOCK, num_blocks=64, enable_kv_events=True)


def serve(cache: PagedKVCache, seq_id: str, tokens: np.ndarray) -> int:
    """Admit a prompt, "compute" its KV (zeros here), commit it; returns the prefix hit."""
    hit = cache.add_sequence(seq_id, tokens)
    cache.reserve(seq_id, len(tokens) - hit)
    cache.commit(seq_id, len(tokens) - hit)
    cache.free(seq_id)
    return hit


def main() -> None:
    rng = np.random.default_rng(0)
    system = rng.integers(1000, 30000, 8 * BLOCK, dtype=np.int32)       # a long shared system prompt
    with PagedKVCache(CacheConfig(**SHAPE)) as a, PagedKVCache(CacheConfig(**SHAPE)) as b:
        pubs = {"replica-a": KVEventPublisher(a, "tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0",
                                              topic="kv@replica-a@demo"),
                "replica-b": KVEventPublisher(b, "tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0",
                                              topic="kv@replica-b@demo")}
        router = PrefixRouter({name: KVEventSubscriber(p.endpoint, replay_endpoint=p.replay_endpoint)
                               for name, p in pubs.items()}, BLOCK)
        serve(a, "first-chat", np.concatenate([system, rng.integers(1000, 30000, 20, dtype=np.int32)]))
        serve(b, "other-chat", rng.integers(1000, 30000, 5 * BLOCK + 3, dtype=np.int32))
        for p in pubs.values():
            p.publish()
        request = np.concatenate([system, rng.integers(1000, 30000, 30, dtype=np.int32)])
        deadline = time.monotonic() + 10
        while router.route(request)[1] < 8 and time.monotonic() < deadline:
            router.update(0.05)
        name, blocks = router.route(request)
        hit = serve(a if name == "replica-a" else b, "second-chat", request)
        print(f"routed to {name} (holds {blocks} of its blocks); its prefix hit there: {hit} tokens")
        router.close()
        for p in pubs.values():
            p.close()


if __name__ == "__main__":
    main()
