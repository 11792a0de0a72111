"""KV events over ZMQ in vLLM's wire format: what a router reads to send a request to
the replica that already holds its prefix (vllm RFC #20492, llm-d, Dynamo).

- :class:`KVEventPublisher`: a :class:`~pagedkv.PagedKVCache`'s events (device and every
  tier, ``medium`` per tier) on a PUB socket with a ROUTER replay socket;
- :class:`KVEventSubscriber`: reads them back (gaps replayed), for routers and tests;
- :class:`PrefixRouter`: picks the replica holding a request's longest prefix;
- :func:`block_hashes`: the hashes a cache with a given ``hash_seed`` publishes for tokens;
- :mod:`pagedkv.kv_events.wire`: the batch and event layout.

Needs the ``events`` extra (``pip install 'pagedkv[events]'``: pyzmq, msgspec).
"""
from pagedkv.kv_events.hashes import block_hashes
from pagedkv.kv_events.publisher import KVEventPublisher
from pagedkv.kv_events.router import PrefixRouter
from pagedkv.kv_events.subscriber import KVEventSubscriber, event_fields
from pagedkv.kv_events.wire import MEDIA, batch, int64, to_wire

__all__ = ["KVEventPublisher", "KVEventSubscriber", "PrefixRouter", "MEDIA", "batch", "block_hashes", "event_fields",
           "int64", "to_wire"]
