"""Per-tier statistics (part of :class:`pagedkv.CacheStats`)."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TierStats"]


@dataclass(frozen=True)
class TierStats:
    medium: str              # "host", "disk" or "remote"
    capacity: int            # blocks the tier can hold (0: a remote server's own limit)
    used_blocks: int         # blocks it holds now
    pinned_blocks: int       # of those, pinned (never evicted)
    hit_tokens: int          # prompt tokens promoted from this tier to the device
    written_blocks: int      # blocks copied into it, ever
    eviction_count: int      # blocks it dropped to make room (the host's go to disk first)
    corrupt_blocks: int      # blocks refused at read: checksum (disk), header or checksum (remote)
    queued_blocks: int = 0   # remote: blocks waiting for the background writer
    dropped_blocks: int = 0  # remote: blocks never stored (queue full, server refused or down)
    errors: int = 0          # remote: calls that timed out or failed (each a miss)
    refused: tuple = ()      # remote: (reason, count) of values refused at read or missing

    def describe(self) -> str:
        return (f"{self.medium} tier: {self.used_blocks}/{self.capacity} blocks ({self.pinned_blocks} pinned), "
                f"{self.hit_tokens} hit tokens, {self.written_blocks} written, {self.eviction_count} evicted"
                + (f", {self.corrupt_blocks} corrupt refused" if self.corrupt_blocks else "")
                + (f", {self.dropped_blocks} dropped" if self.dropped_blocks else "")
                + (f", {self.errors} errors" if self.errors else ""))
