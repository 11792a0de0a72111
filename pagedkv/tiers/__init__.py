"""Prefix tiers below the device: host memory and a disk arena that survives restarts.

Configure them on :class:`~pagedkv.CacheConfig` (``prefix_host_blocks``,
``prefix_disk_dir`` + ``prefix_disk_blocks``, ``prefix_tier_write``,
``prefix_tier_eviction``); :class:`~pagedkv.PagedKVCache` then writes evicted (or
registered) prefix blocks down and promotes them back on admission. See
:mod:`pagedkv.tiers.manager` for the rules.
"""
from pagedkv.tiers.chain import ChainIndex
from pagedkv.tiers.disk import DiskPrefixTier
from pagedkv.tiers.host import HostPrefixTier
from pagedkv.tiers.manager import PrefixTiers
from pagedkv.tiers.stats import TierStats

__all__ = ["ChainIndex", "DiskPrefixTier", "HostPrefixTier", "PrefixTiers", "TierStats"]
