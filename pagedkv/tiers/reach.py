"""Reach: which tier serves each block of one query, asking each tier only when needed.

Tiers are asked top down, and a tier only for a block that every tier above it lacks:
a query the host tier covers never reaches the disk, and never the network. A tier's
answer (verified handles from a block on) is kept for the rest of the walk; a tier is
asked again only past a block it lacked that another tier served, and only when it
is not chain-closed (a remote tier may hold blocks after a gap in its own run; a
local tier holds a block only under its parent).
"""
from __future__ import annotations

from pagedkv.tiers.base import Handle, PrefixTier
from pagedkv.tiers.verify import ChainQuery

__all__ = ["Reach"]


class Reach:
    def __init__(self, tiers: list[PrefixTier], query: ChainQuery, max_blocks: int, fetch: bool):
        self.tiers = tiers
        self.query = query
        self.max_blocks = max_blocks
        self.fetch = fetch
        self._runs: dict[PrefixTier, tuple[int, list[Handle]]] = {}

    def _handle(self, tier: PrefixTier, i: int) -> Handle | None:
        run = self._runs.get(tier)
        if run is not None:
            start, handles = run
            if start <= i < start + len(handles):
                return handles[i - start]
            if i <= start + len(handles) or tier.chain_closed:     # the tier's run ended
                return None
        handles = tier.lookup(self.query, i, self.max_blocks, fetch=self.fetch)
        self._runs[tier] = (i, handles)
        return handles[0] if handles else None

    def at(self, i: int) -> tuple[PrefixTier, Handle] | None:
        """``(tier, handle)`` of the first tier holding block ``i``, or None."""
        for t in self.tiers:
            h = self._handle(t, i)
            if h is not None:
                return t, h
        return None
