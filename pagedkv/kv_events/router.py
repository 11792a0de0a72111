"""PrefixRouter: send a request to the replica that already holds its longest prefix,
from the replicas' KV events (pagedkv's, or vLLM's: the same wire).

The router mirrors each replica's cached blocks as a tree keyed by what the events
say a block *is*: its parent block, its tokens and its extra keys (adapter, cache
salt). It never recomputes a replica's hash function, so replicas with different
hash seeds, or other engines, are mirrored alike. A block counts while some medium
of its replica holds it (``BlockStored`` adds a medium, ``BlockRemoved`` takes one
away, ``AllBlocksCleared`` forgets the replica's blocks); media a replica shares with
others (the remote tier) count for every replica and never decide alone.

Routing takes the replica with the most leading blocks of the request, ties broken by
how many of those blocks are on the replica's own device, then by the order the
replicas were given.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pagedkv.errors import InvalidArgumentError, expected
from pagedkv.kv_events.subscriber import KVEventSubscriber

__all__ = ["PrefixRouter"]


class _Replica:
    def __init__(self):
        self.media: dict[int, set[str]] = {}                    # block hash -> media holding it
        self.by_key: dict[tuple, int] = {}                      # (parent hash, tokens, extra) -> hash
        self.key_of: dict[int, tuple] = {}

    def stored(self, e: dict) -> None:
        bs = int(e["block_size"])
        toks = list(e["token_ids"])
        parent = e.get("parent_block_hash")
        extra = e.get("extra_keys") or [None] * len(e["block_hashes"])
        medium = e.get("medium") or ""
        for i, h in enumerate(e["block_hashes"]):
            key = (parent, tuple(toks[i * bs:(i + 1) * bs]), tuple(extra[i]) if extra[i] else None,
                   e.get("group_idx") or 0)
            old = self.key_of.get(h)
            if old is not None and old != key:
                self.by_key.pop(old, None)
            self.by_key[key] = h
            self.key_of[h] = key
            self.media.setdefault(h, set()).add(medium)
            parent = h

    def removed(self, e: dict) -> None:
        medium = e.get("medium") or ""
        for h in e["block_hashes"]:
            held = self.media.get(h)
            if held is None:
                continue
            held.discard(medium)
            if not held:
                del self.media[h]
                key = self.key_of.pop(h, None)
                if key is not None and self.by_key.get(key) == h:
                    del self.by_key[key]

    def cleared(self) -> None:
        self.media.clear()
        self.by_key.clear()
        self.key_of.clear()


class PrefixRouter:
    """Route requests among replicas by their KV events.

    Args:
        replicas: name -> the replica's :class:`KVEventSubscriber`.
        block_size: tokens per block (every replica's).
        device_media: media that mean "on the replica's own device" (tie-break).
        shared_media: media several replicas share (never decide alone).
    """

    def __init__(self, replicas: dict[str, KVEventSubscriber], block_size: int, *,
                 device_media: Sequence[str] = ("GPU",), shared_media: Sequence[str] = ("REMOTE",)):
        self.subscribers = dict(replicas)
        self.block_size = block_size
        self.device_media = set(device_media)
        self.shared_media = set(shared_media)
        self.replicas = {name: _Replica() for name in self.subscribers}
        if not self.replicas:
            raise InvalidArgumentError(expected("replicas", "at least one replica", "none"))
        for name, sub in self.subscribers.items():       # what was published before we listened
            self._apply(name, sub.replay(sub.next_seq))

    def _apply(self, name: str, batches) -> int:
        r = self.replicas[name]
        sub = self.subscribers[name]
        n = 0
        for seq, _ts, events, _rank in batches:
            sub.next_seq = max(sub.next_seq, seq + 1)
            for e in events:
                kind = e.get("type")
                if kind == "BlockStored":
                    r.stored(e)
                elif kind == "BlockRemoved":
                    r.removed(e)
                elif kind == "AllBlocksCleared":
                    r.cleared()
                n += 1
        return n

    def update(self, timeout: float = 0.0) -> int:
        """Take in every replica's new events (waiting up to ``timeout`` for each);
        returns how many."""
        return sum(self._apply(name, sub.poll(timeout)) for name, sub in self.subscribers.items())

    def held(self, name: str, tokens, *, extra: tuple | None = None, group: int = 0) -> tuple[int, int]:
        """``(blocks, on its device)`` of the leading full blocks of ``tokens`` replica
        ``name`` holds (``extra``: the events' extra keys, e.g. ``(cache_salt,)``)."""
        r = self.replicas[name]
        toks = np.asarray(tokens).tolist()
        bs = self.block_size
        parent, n, dev = None, 0, 0
        for i in range(len(toks) // bs):
            h = r.by_key.get((parent, tuple(toks[i * bs:(i + 1) * bs]), extra, group))
            if h is None:
                break
            media = r.media.get(h, set())
            if not media - self.shared_media:
                break
            n += 1
            dev += bool(media & self.device_media)
            parent = h
        return n, dev

    def route(self, tokens, *, extra: tuple | None = None, group: int = 0) -> tuple[str, int]:
        """``(replica, blocks it holds)`` for a request of ``tokens``."""
        best, key = None, (-1, -1)
        for name in self.replicas:
            k = self.held(name, tokens, extra=extra, group=group)
            if k > key:
                best, key = name, k
        return str(best), key[0]

    def close(self) -> None:
        for sub in self.subscribers.values():
            sub.close()
