"""Per-tier statistics (part of :class:`pagedkv.CacheStats`)."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TierStats"]


@dataclass(frozen=True)
class TierStats:
    medium: str              # "host" or "disk"
    capacity: int            # blocks the tier can hold
    used_blocks: int         # blocks it holds now
    pinned_blocks: int       # of those, pinned (never evicted)
    hit_tokens: int          # prompt tokens promoted from this tier to the device
    written_blocks: int      # blocks copied into it, ever
    eviction_count: int      # blocks it dropped to make room (the host's go to disk first)
    corrupt_blocks: int      # blocks refused at read because their checksum failed (disk)

    def describe(self) -> str:
        return (f"{self.medium} tier: {self.used_blocks}/{self.capacity} blocks ({self.pinned_blocks} pinned), "
                f"{self.hit_tokens} hit tokens, {self.written_blocks} written, {self.eviction_count} evicted"
                + (f", {self.corrupt_blocks} corrupt refused" if self.corrupt_blocks else ""))
