"""Cache statistics and the block map (seeds 001 and 002)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import numpy as np

from pagedkv.config.options import format_bytes

__all__ = ["CacheStats", "GroupStats", "render_block_map", "with_window_figures"]


@dataclass(frozen=True)
class GroupStats:
    """One layer group's share of a cache with sliding-window layer groups."""

    group: int
    window: int                    # tokens; 0 = full attention
    layers: tuple[int, ...]
    blocks_held: int               # blocks its live sequences hold (released ones not counted)
    waste_slots: int               # unused slots in those sequences' partial last blocks
    cow_copies: int
    query_tokens: int
    hit_tokens: int
    attention: str = "full"        # the group's spec: "full", "sliding(window=W)", "mla(...)"


@dataclass(frozen=True)
class CacheStats:
    total_blocks: int
    allocated_blocks: int          # in use (ref_cnt >= 1)
    free_blocks: int               # allocatable now: empty + evictable cached-free
    empty_blocks: int              # free with no cached content
    cached_free_blocks: int        # ref_cnt 0, holding a reusable prefix (pinned included)
    pinned_blocks: int             # cached-free and pinned
    active_sequences: int
    total_tokens: int              # committed tokens over live sequences
    utilization_pct: float         # allocated / total * 100
    fragmentation: float           # unused slots in allocated blocks' partial tails / allocated slots
    allocation_count: int          # blocks handed out, ever
    deallocation_count: int        # references released, ever
    eviction_count: int            # cached blocks whose content was dropped for reuse
    query_tokens: int              # prompt tokens looked up in the prefix cache
    hit_tokens: int                # of those, served from cached blocks (device and tiers)
    hit_rate: float
    cow_copies: int                # copy-on-write block copies
    bytes_per_block: int
    bytes_in_use: int
    bytes_free: int
    swapped_sequences: int
    host_blocks_in_use: int
    device_hit_tokens: int = 0     # hit tokens the device index served
    host_hit_tokens: int = 0       # hit tokens promoted from the host prefix tier
    disk_hit_tokens: int = 0       # hit tokens promoted from the disk prefix tier
    remote_hit_tokens: int = 0     # hit tokens promoted from the remote prefix tier
    tiers: tuple = ()              # TierStats per prefix tier below the device
    group_hit_limits: tuple = ()   # layer groups: admissions whose prefix hit each group limited
    groups: tuple = ()             # layer groups: GroupStats per group (the totals above add them up)
    window_bytes: int = 0          # the window arena (model-precision rows), allocated up front
    states: object = None          # recurrent-state layers: the state pool's StateStats (None without)
    # sequence reads (once per pass) that found a sink or recent-window row no longer held
    # exact and read it quantized: with more live sequences than kv_window_sequences, or a
    # prefix hit whose blocks lost their window copies (pagedkv.store.window)
    window_fallbacks: int = 0

    @property
    def is_full(self) -> bool:
        return self.free_blocks == 0

    @classmethod
    def collect(cls, pool, tables, config, host=None, tiers=None, groups=None) -> CacheStats:
        """Read the figures from the core objects (``BlockPool``, ``BlockTables``), the
        ``CacheConfig``, the host tier (``HostSwap`` or None), the prefix tiers
        (:class:`~pagedkv.tiers.PrefixTiers` or None) and the layer groups
        (:class:`~pagedkv.groups.tables.GroupTables` or None, whose ``tables[0]`` is
        ``tables``), under the caller's lock. With groups, waste and copy-on-write
        copies add up every group's; tokens and prefix hits are per sequence (every
        group holds the same tokens and admits the same hit)."""
        cfg = config
        tokens, waste = tables.total_tokens()
        cow = tables.num_cow
        per_group: tuple = ()
        if groups is not None:
            per_group = tuple(GroupStats(group=g, **f) for g, f in enumerate(groups.group_figures()))
            waste = sum(f.waste_slots for f in per_group)
            cow = sum(f.cow_copies for f in per_group)
        used = pool.num_in_use_blocks
        bpb = cfg.bytes_per_block
        q, h = tables.num_query_tokens, tables.num_hit_tokens
        tiers = tuple(tiers.stats()) if tiers is not None else ()
        by_medium: dict[str, int] = {}
        for t in tiers:
            by_medium[t.medium] = by_medium.get(t.medium, 0) + t.hit_tokens
        device_hits = h
        h += sum(by_medium.values())
        return cls(
            total_blocks=pool.num_blocks,
            allocated_blocks=used,
            free_blocks=pool.num_free_blocks,
            empty_blocks=pool.num_empty_blocks,
            cached_free_blocks=pool.num_cached_free_blocks,
            pinned_blocks=pool.num_pinned_free_blocks,
            active_sequences=len(tables),
            total_tokens=tokens,
            utilization_pct=100.0 * used / pool.num_blocks,
            fragmentation=(waste / (used * cfg.block_size)) if used else 0.0,
            allocation_count=pool.num_allocations,
            deallocation_count=pool.num_frees,
            eviction_count=pool.num_evictions,
            query_tokens=q,
            hit_tokens=h,
            hit_rate=(h / q) if q else 0.0,
            cow_copies=cow,
            bytes_per_block=bpb,
            bytes_in_use=used * bpb,
            bytes_free=(pool.num_blocks - used) * bpb,
            swapped_sequences=host.num_swapped if host is not None else 0,
            host_blocks_in_use=host.num_blocks_in_use if host is not None else 0,
            device_hit_tokens=device_hits,
            host_hit_tokens=by_medium.get("host", 0),
            disk_hit_tokens=by_medium.get("disk", 0),
            remote_hit_tokens=by_medium.get("remote", 0),
            tiers=tiers,
            window_bytes=cfg.window_bytes,
            group_hit_limits=tuple(groups.limited_by) if groups is not None else (),
            groups=per_group,
        )

    def as_dict(self) -> dict:
        d = asdict(self)
        d["is_full"] = self.is_full
        return d

    def describe(self) -> str:
        return "\n".join([
            f"Blocks: {self.allocated_blocks}/{self.total_blocks} in use ({self.utilization_pct:.1f}%), "
            f"{self.free_blocks} allocatable ({self.empty_blocks} empty, {self.cached_free_blocks} cached-free, "
            f"{self.pinned_blocks} pinned)",
            f"Memory: {format_bytes(self.bytes_in_use)} in use, {format_bytes(self.bytes_free)} free "
            f"({format_bytes(self.bytes_per_block)} per block)"
            + (f", window arena {format_bytes(self.window_bytes)}" if self.window_bytes else ""),
            f"Sequences: {self.active_sequences} active, {self.total_tokens} tokens, "
            f"fragmentation {self.fragmentation:.3f}",
            f"Prefix cache: {self.hit_tokens}/{self.query_tokens} tokens hit ({100 * self.hit_rate:.1f}%), "
            f"{self.eviction_count} evictions, {self.cow_copies} copy-on-write copies",
            f"Counters: {self.allocation_count} blocks allocated, {self.deallocation_count} released",
        ] + ([f"Hits by medium: device {self.device_hit_tokens}, host {self.host_hit_tokens}, "
              f"disk {self.disk_hit_tokens}, remote {self.remote_hit_tokens} tokens"] if self.tiers else [])
          + [t.describe() for t in self.tiers]
          + [f"Layer group {g.group} ({'window ' + str(g.window) if g.window else 'full attention'}, "
             f"{len(g.layers)} layers): {g.blocks_held} blocks held, {g.cow_copies} copy-on-write copies, "
             f"{g.hit_tokens}/{g.query_tokens} tokens hit" for g in self.groups]
          + ([self.states.describe()] if self.states is not None else []))  # type: ignore[attr-defined]


_STATE_CHARS = np.frombuffer(b".#c", dtype=np.uint8)


def render_block_map(pool, width: int = 64) -> str:
    """One character per block: ``.`` free, ``#`` in use, ``+`` shared (ref_cnt > 1),
    ``c`` cached-free, ``p`` pinned cached-free."""
    states = pool.states()
    chars = _STATE_CHARS[states].copy()
    ref = np.asarray(pool.ref_cnt)
    chars[ref > 1] = ord("+")
    if pool.num_pinned_free_blocks:
        for b in np.flatnonzero(states == 2).tolist():
            if pool.pin_count(b):
                chars[b] = ord("p")
    text = chars.tobytes().decode()
    return "\n".join(text[i:i + width] for i in range(0, len(text), width))


def with_window_figures(stats: CacheStats, store) -> CacheStats:
    """``stats`` with the window arena's own counters (the KV store's, when it has one)."""
    window = getattr(store, "window", None)
    return stats if window is None else replace(stats, window_fallbacks=window.fallbacks)
