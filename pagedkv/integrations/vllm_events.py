"""KV events of the connector's tiers, for vLLM's own event stream.

vLLM publishes its device blocks' events itself (``kv_events_config``); a connector
adds its own through ``take_events()``, and vLLM sends them in the same stream (ZMQ
PUB with replay, ``[topic, seq, payload]``). :class:`StoreEvents` records what the
connector's store does with its host slots: a block that became a host hit (a landed
save, or a promotion from the disk or the remote tier), written to disk, queued for the
remote tier, evicted from the host tier, or a reset. :func:`to_vllm` turns them into
vLLM's ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` with ``medium``
``"CPU"``, ``"STORAGE"`` or ``"REMOTE"`` (``locality="REMOTE"`` for the shared tier).

Hashes are the tiers' chain hashes (tokens, parent and namespace: the same on every
engine that runs the same model tag), as signed 64-bit integers, not vLLM's device
hashes; every event carries its blocks' ``token_ids``, so a router keyed by tokens
(Dynamo) or by these hashes (llm-d, across engines) follows them. Every tier reports
its removals: a host eviction; a disk slot this engine emptied, or that another engine
emptied (seen at this engine's next disk turn; a full re-check is a disk clear); a
remote block a lookup found gone (the server's TTL or size limit) or a store the writer
could not make, with the blocks this engine knows below it.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pagedkv.events import AllBlocksCleared, BlockRemoved, BlockStored, EventsLost, KVEvent
from pagedkv.kv_events.wire import MEDIA, int64
from pagedkv.tiers.chain import ROOT

__all__ = ["StoreEvents", "to_vllm", "watch_disk"]


class StoreEvents:
    """The events of one store's host slots (see the module docstring); at most
    ``limit`` undrained, then an :class:`~pagedkv.events.EventsLost` in their place."""

    def __init__(self, index, block_size: int, limit: int = 1 << 16):
        self.index, self.bs, self.limit = index, block_size, limit
        self.events: list[KVEvent] = []
        self.lost = 0

    def _add(self, ev: KVEvent) -> None:
        if len(self.events) >= self.limit:
            self.lost += 1
            return
        self.events.append(ev)

    def stored(self, medium: str, slots: Sequence[int]) -> None:
        """These host slots' blocks are now held by ``medium``: one event per run of
        slots that each continue the previous one's chain."""
        rec = self.index.rec
        run: list[int] = []

        def flush():
            if run:
                p = int(rec["parent"][run[0]])
                self._add(BlockStored(
                    block_hashes=[int64(int(rec["hash"][s])) for s in run],
                    parent_block_hash=None if p == ROOT else int64(int(rec["hash"][p])),
                    token_count=len(run) * self.bs, namespace=None, block_ids=list(run), medium=medium,
                    token_ids=[int(t) for s in run for t in rec["tokens"][s]]))
                run.clear()
        for s in slots:
            if run and int(rec["parent"][s]) != run[-1]:
                flush()
            run.append(int(s))
        flush()

    def removed(self, medium: str, slots: Sequence[int], index=None) -> None:
        """These slots of ``index`` (default: the host's) left ``medium`` (their records
        still name their blocks)."""
        rec = (self.index if index is None else index).rec
        self.removed_hashes(medium, [int(rec["hash"][s]) for s in slots], slots)

    def removed_hashes(self, medium: str, hashes: Sequence[int], ids: Sequence[int]) -> None:
        if len(hashes):
            self._add(BlockRemoved(block_hashes=[int64(h) for h in hashes], block_ids=[int(i) for i in ids],
                                   medium=medium))

    def cleared(self, medium: str) -> None:
        self._add(AllBlocksCleared(medium=medium))

    def drain(self) -> list[KVEvent]:
        out, self.events = self.events, []
        if self.lost:
            out.append(EventsLost(self.lost))
            self.lost = 0
        return out


def watch_disk(tier, events_of: Callable[[], StoreEvents | None]) -> None:
    """Report the removals of a connector's disk tier to ``events_of()`` (the store's
    events, None while they are off): a slot it emptied (an eviction, a drop), slots
    another engine emptied (seen at a turn), or a full re-check (a clear)."""
    def removed(slot: int) -> None:
        ev = events_of()
        if ev is not None:
            ev.removed("disk", [slot], tier.index)

    def lost(slots) -> None:
        ev = events_of()
        if ev is None:
            return
        if slots is None:
            ev.cleared("disk")
        else:
            ev.removed("disk", slots, tier.index)

    tier.set_callbacks(None, removed, on_lost=lost)


def to_vllm(events: Sequence[KVEvent], block_size: int) -> list[Any]:
    """pagedkv's events as vLLM's event objects (``vllm.distributed.kv_events``). A lost
    stretch becomes ``AllBlocksCleared``: a consumer starts over, which only
    underestimates what the tiers hold."""
    from vllm.distributed import kv_events as kv

    out: list[Any] = []
    for e in events:
        if isinstance(e, BlockStored):
            out.append(kv.BlockStored(block_hashes=list(e.block_hashes), parent_block_hash=e.parent_block_hash,
                                      token_ids=list(e.token_ids), block_size=block_size, lora_id=None,
                                      medium=MEDIA[e.medium], lora_name=None,
                                      locality="REMOTE" if e.medium == "remote" else "LOCAL"))
        elif isinstance(e, BlockRemoved):
            out.append(kv.BlockRemoved(block_hashes=list(e.block_hashes), medium=MEDIA[e.medium],
                                       locality="REMOTE" if e.medium == "remote" else "LOCAL"))
        else:
            out.append(kv.AllBlocksCleared())
    return out
