"""What a transfer asks of the manager: hold every layer group's cached chain of a
prefix while its KV is copied out, and admit a sequence whose KV arrives whole.

(A module of the manager package: it reads the cache's parts, which nothing outside
the package does.)

Every layer group's cached chain of one prefix, held while its KV is copied out.

A sliding group's table holds only the blocks its window needs, but its prefix index
keeps the whole chain (the blocks that left the window stay cached, registered, until
evicted), and a peer or tier that is to serve the prefix needs that whole chain: a
later admission that shares only the chain's first blocks reads them in the window.
So a prefix copy reads each group's chain from the index, and pins it for the copy's
duration (a cached-free block could otherwise be taken, and overwritten, by another
thread's allocation while its bytes are on the wire).
"""
from __future__ import annotations

import numpy as np

__all__ = ["hold_chains", "release_chains", "admit_restored"]


def hold_chains(cache, tokens: np.ndarray, cache_salt, adapter_id) -> list[np.ndarray]:
    """Per layer group, the cached blocks of ``tokens``' full blocks, cut to the longest
    prefix every group holds, and pinned (undo with :func:`release_chains`). Without
    layer groups: the one chain. An unknown namespace holds nothing."""
    bs = cache.config.block_size
    groups = cache._groups
    with cache._lock:
        ns = cache._namespaces.find(cache_salt, adapter_id)
        if ns is None or cache.index is None:
            return [np.empty(0, dtype=np.int32) for _ in groups.tables]
        tokens = tokens[:len(tokens) // bs * bs]
        # the coordinator names each group's namespace (a full-attention cache: one group)
        chains = [cache.index.match(tokens, *groups.namespace(g, ns[0], ns[1])) for g in range(len(groups.tables))]
        m = min(len(c) for c in chains)
        chains = [np.asarray(c[:m], dtype=np.int32) for c in chains]
        if m:
            cache._pool.pin(np.concatenate(chains))
    return chains


def release_chains(cache, chains: list[np.ndarray]) -> None:
    """Undo :func:`hold_chains`' pins."""
    if chains and len(chains[0]):
        with cache._lock:
            cache._pool.unpin(np.concatenate(chains))


def admit_restored(cache, seq_id, tokens: np.ndarray | None, cache_salt, adapter_id, priority) -> None:
    """Admit a sequence of a layer-grouped cache whose KV is about to arrive whole from
    elsewhere: no prefix lookup, sliding groups untracked (see
    :meth:`~pagedkv.groups.tables.GroupTables.add_restored`)."""
    cache._life.admit_restored(seq_id, tokens, cache_salt, adapter_id, priority)
