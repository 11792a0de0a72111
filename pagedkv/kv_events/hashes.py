"""The block hashes a cache publishes, computed from tokens: what a router needs to key
replicas' blocks by hash without trusting one replica's events for the hash function.

A cache's device hashes chain from a root derived from ``CacheConfig.hash_seed``, block
by block over the tokens and the namespace (cache salt, adapter). Caches with the same
``hash_seed`` and block size give a prefix the same hashes in every process and on
every host, in every medium (the tiers' events carry the device hashes); a cache
without a ``hash_seed`` draws its root at random, so its hashes mean nothing outside
it (a router then keys blocks by ``token_ids``, which every ``BlockStored`` carries).
"""
from __future__ import annotations

from typing import Any

from pagedkv._core.prefix import PrefixIndex, hash_bytes
from pagedkv.errors import InvalidArgumentError, expected
from pagedkv.kv_events.wire import int64
from pagedkv.manager.arguments import as_token_ids
from pagedkv.manager.namespaces import namespace_key

__all__ = ["block_hashes"]


def block_hashes(tokens, block_size: int, hash_seed: int, *, cache_salt: str | None = None,
                 adapter_id: Any = None) -> list[int]:
    """The signed 64-bit hashes (``block_hashes`` of ``BlockStored``) a cache with this
    ``hash_seed`` and ``block_size`` publishes for the full blocks of ``tokens``; block
    ``i``'s ``parent_block_hash`` is block ``i - 1``'s hash (None for the first).

    Args:
        tokens: token ids (the prompt's, from its first token).
        block_size: tokens per block (the cache's).
        hash_seed: the cache's ``hash_seed`` (an int in [0, 2**64)).
        cache_salt: the request's cache salt (None: none).
        adapter_id: the request's adapter (None: none).
    """
    if hash_seed is None:
        raise InvalidArgumentError(expected("hash_seed", "the caches' hash_seed (a cache without one hashes "
                                            "with a random root)", None))
    index = PrefixIndex(block_size, 1, hash_seed=hash_seed)
    ns_hash = 0 if cache_salt is None and adapter_id is None else hash_bytes(namespace_key(cache_salt, adapter_id))
    return [int64(h) for h in index.hash_tokens(as_token_ids(tokens, "tokens"), ns_hash).tolist()]
