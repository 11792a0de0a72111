"""The tier chain a :class:`~pagedkv.CacheConfig` asks for, top first: any subset of
host (``prefix_host_blocks``), disk (``prefix_disk_dir`` + ``prefix_disk_blocks``) and
remote (``prefix_remote``), in that order."""
from __future__ import annotations

from pagedkv.format.fingerprint import kv_format
from pagedkv.tiers.base import PrefixTier

__all__ = ["build_tiers"]


def build_tiers(cfg, store, weak_hash: bool) -> list[PrefixTier]:
    """The tiers of ``cfg`` over ``store``'s arenas (each tier closes the ones opened
    before it if a later one fails)."""
    tiers: list[PrefixTier] = []
    try:
        if cfg.prefix_host_blocks:
            from pagedkv.tiers.host import HostPrefixTier

            tiers.append(HostPrefixTier(store.arenas, cfg.prefix_host_blocks, cfg.block_size,
                                        eviction=cfg.prefix_tier_eviction, weak_hash=weak_hash,
                                        pin=store.device.type == "cuda",
                                        window=store.tier_window(cfg.prefix_host_blocks)))
        if cfg.prefix_disk_blocks:
            from pagedkv.tiers.disk import DiskPrefixTier

            tiers.append(DiskPrefixTier(cfg.prefix_disk_dir, store.arenas, cfg.prefix_disk_blocks, cfg.block_size,
                                        kv_format(store, cfg.prefix_disk_tag), eviction=cfg.prefix_tier_eviction,
                                        weak_hash=weak_hash, rows=store.window))
        remote = cfg.prefix_remote
        if remote is not None:
            from pagedkv.tiers.remote import RemotePrefixTier

            tiers.append(RemotePrefixTier(remote, store.arenas, cfg.block_size, kv_format(store, cfg.prefix_disk_tag),
                                          rows=store.window))
    except BaseException:
        for t in tiers:
            t.close()
        raise
    return tiers
