"""The connector store's remote tier (``kv_connector_extra_config["remote"]``): the
lookup that extends a host chain with the server's verified blocks, and the write of
committed host chains. See :mod:`pagedkv.integrations.vllm_store` and
:mod:`pagedkv.tiers.remote`."""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from pagedkv._core.prefix import hash_bytes
from pagedkv.tiers.chain import ROOT, ROOT_HASH, chain_hash
from pagedkv.tiers.payload import Blocks
from pagedkv.tiers.verify import ChainQuery

if TYPE_CHECKING:
    from pagedkv.integrations.vllm_store import PrefixStore
    from pagedkv.tiers.remote import RemotePrefixTier

__all__ = ["remote_lookup", "to_remote", "watch_remote"]


def remote_lookup(store: PrefixStore, remote: RemotePrefixTier, tokens: np.ndarray, ns_key: bytes,
                  max_blocks: int, chain: list[int]) -> list[int]:
    """``chain`` (``store``'s host slots of ``tokens``' first blocks) extended by the
    remote tier's blocks, each promoted into a host slot once its value checked out
    (format, key, tokens, chain link, checksum: a failing block ends the chain). The
    store's lock is held."""
    bs, host = store.bs, store.host
    got = remote.lookup(ChainQuery(tokens, ns_key, bs), len(chain), max_blocks)
    if not got:
        return chain
    hns, hh = store._ns(host, ns_key, True)
    dst = Blocks(host.arenas, None, None)
    host.index.lease(chain)                       # the promotion must not evict our own prefix
    remote.lease(got)
    promoted: list[int] = []
    try:
        for d in got:
            i = len(chain)
            if not remote.verify(d):              # left the landing buffer: a miss from here
                break
            slot, created = host.index.insert(chain[-1] if chain else ROOT, hns, hh, tokens[i * bs:(i + 1) * bs])
            if slot < 0:
                break
            if created:
                try:
                    remote.load([d], dst, [slot])
                except BaseException:
                    host.index.release([slot])
                    host.index.remove(slot)
                    raise
                host.written(np.asarray([slot]))
                host.index.release([slot])
                promoted.append(slot)
            remote.num_hit_tokens += bs
            host.index.lease([slot])
            chain.append(slot)
    finally:
        host.index.release(chain)
        remote.release(got)
        if store.events is not None and promoted:
            store.events.stored("host", promoted)
    return chain


def to_remote(store: PrefixStore, remote: RemotePrefixTier, slots: Sequence[int]) -> None:
    """Queue these committed host slots' chains for the remote tier (copied out now, sent
    by its writer; blocks it holds from this engine, or that came from it, are skipped).
    The store's lock is held."""
    host = store.host
    rec = host.index.rec
    parents = {int(rec["parent"][s]) for s in slots}
    src = Blocks(host.arenas, None, None)
    for s in slots:
        if s in parents:
            continue                              # a child's chain carries it
        chain = host.index.chain(s)
        # up to the first block whose data has not landed, or that another namespace
        # holds (a query has one)
        ns = int(rec["ns"][chain[0]])
        n = 0
        while n < len(chain) and chain[n] not in store.pending and int(rec["ns"][chain[n]]) == ns:
            n += 1
        if n:
            tokens = np.concatenate([np.asarray(rec["tokens"][a]) for a in chain[:n]])
            before = remote.num_written
            remote.batched_put(ChainQuery(tokens, host.ns_keys[ns], store.bs), 0, src, chain[:n])
            sent = remote.num_written - before         # the chain's new blocks: its last ones
            if store.events is not None and sent > 0:
                store.events.stored("remote", chain[n - sent:n])


def watch_remote(store: PrefixStore, remote: RemotePrefixTier) -> None:
    """Report remote blocks this engine stored or served that turned out gone (a lookup
    found them missing, the writer could not store them) as removals, in the host
    tier's hash space (the chain hash of their tokens, as every engine computes it)."""
    weak = store.cfg.weak_hash

    def lost(digests) -> None:
        ev = store.events
        if ev is None or not digests:
            return
        memo: dict[bytes, int] = {}
        hashes, ids = [], []
        for d in digests:
            h = ROOT_HASH
            for a in remote.chain(d):
                if a not in memo:
                    rec = remote.record(a)
                    if rec is None:
                        break
                    memo[a] = chain_hash(h, hash_bytes(rec.ns_key), rec.tokens, weak)
                h = memo[a]
            else:
                if d in memo:
                    hashes.append(h)
                    ids.append(int.from_bytes(d[:8], "big", signed=True))
        ev.removed_hashes("remote", hashes, ids)

    remote.set_callbacks(None, lambda d: None, on_lost=lost)
