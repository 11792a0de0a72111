"""Links: which tier block holds the copy of which source block.

A copy down the chain remembers ``(target tier, source, id, generation) -> (target
handle, its stamp)`` (the source: a tier, or the device): the next copy of the same block (or of a block below it)
finds its parent in the target without walking the chain again, and a promotion finds
the device run that continues a tier block (the device incarnations it was copied
from). A link is used only while the target handle still holds the occupant it
was made with (its stamp), so a stale link costs a lookup, never a wrong parent.
"""
from __future__ import annotations

from collections import defaultdict

from pagedkv.tiers.base import Handle, PrefixTier

__all__ = ["Links", "DEVICE"]

DEVICE = "device"
_MAX_LINKS = 8        # device incarnations remembered per tier block (more only cost a miss)


class Links:
    def __init__(self):
        self._links: dict[tuple, tuple[Handle, int]] = {}
        self._keys: dict[tuple[PrefixTier, Handle], list[tuple]] = defaultdict(list)

    def find(self, target: PrefixTier, src, key: tuple) -> Handle | None:
        """The target's handle linked to ``key`` of ``src`` (a tier or DEVICE; touched), or None."""
        found = self._links.get((target, src) + key)
        if found is None:
            return None
        h, stamp = found
        if not target.current(h, stamp):
            return None
        target.touch(h)
        return h

    def add(self, target: PrefixTier, src, key: tuple, handle: Handle) -> None:
        k = (target, src) + key
        if k not in self._links:
            keys = self._keys[(target, handle)]
            keys.append(k)
            if len(keys) > _MAX_LINKS:
                self._links.pop(keys.pop(0), None)
        self._links[k] = (handle, target.stamp(handle))

    def removed(self, tier: PrefixTier, handle: Handle) -> None:
        """A tier block was emptied: its links go."""
        for k in self._keys.pop((tier, handle), ()):
            self._links.pop(k, None)

    def incarnations(self, tier: PrefixTier, handle: Handle):
        """The device incarnations ``(block, generation)`` whose chain ``handle`` holds."""
        stamp = tier.stamp(handle)
        for k in self._keys.get((tier, handle), ()):
            if k[1] == DEVICE and self._links.get(k) == (handle, stamp):
                yield k[2], k[3]

    def forget_tier(self, tier: PrefixTier) -> None:
        """Every link into ``tier`` goes (it lost track of its blocks)."""
        for th in [th for th in self._keys if th[0] is tier]:
            self.removed(*th)

    def clear(self) -> None:
        self._links.clear()
        self._keys.clear()
