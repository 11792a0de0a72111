"""Prefix tiers below the device: a chain of tiers (host memory, a disk arena that
survives restarts, a remote Redis / Redis Cluster shared by hosts), any subset, in
that order.

Configure them on :class:`~pagedkv.CacheConfig` (``prefix_host_blocks``,
``prefix_disk_dir`` + ``prefix_disk_blocks``, ``prefix_remote``, ``prefix_tier_write``,
``prefix_tier_eviction``); :class:`~pagedkv.PagedKVCache` then writes evicted (or
registered) prefix blocks down and promotes them back on admission. See
:mod:`pagedkv.tiers.manager` for the rules and :mod:`pagedkv.tiers.base` for the
protocol every tier implements.
"""
from pagedkv.tiers.base import PrefixTier, SlotTier
from pagedkv.tiers.chain import ChainIndex
from pagedkv.tiers.disk import DiskPrefixTier
from pagedkv.tiers.host import HostPrefixTier
from pagedkv.tiers.manager import PrefixTiers
from pagedkv.tiers.payload import Blocks, PayloadLayout, Payloads
from pagedkv.tiers.stats import TierStats
from pagedkv.tiers.verify import ChainQuery

__all__ = ["Blocks", "ChainIndex", "ChainQuery", "DiskPrefixTier", "HostPrefixTier", "PayloadLayout", "Payloads",
           "PrefixTier", "PrefixTiers", "SlotTier", "TierStats"]
