"""The manager's prefix-cache calls: what a prompt would find cached (on the device,
per layer group, in the prefix tiers), what admitting it costs, pins, reset and KV
events.

:class:`Prefixes` answers through the table coordinator and the prefix tiers (or their
stand-in, :class:`~pagedkv.manager.absent.NoTiers`), the same way for one layer group
or many.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from pagedkv.errors import InvalidArgumentError, expected
from pagedkv.events import KVEvent
from pagedkv.manager.arguments import as_count, as_token_ids
from pagedkv.manager.namespaces import namespace_key

__all__ = ["Prefixes"]


class Prefixes:
    """Prefix lookups, admission costs, pins and events (see ``PagedKVCache``).

    Args:
        config: the cache's ``CacheConfig``.
        lock: the manager's lock; ``settle``: runs the queued deferred frees.
        index: the device ``PrefixIndex``, or None without prefix caching.
        pool: the device ``BlockPool``.
        namespaces: the ``NamespaceRegistry``.
        groups: the table coordinator (:mod:`pagedkv.manager.coordinator`).
        tiers: the prefix tiers, or :class:`~pagedkv.manager.absent.NoTiers`.
    """

    def __init__(self, config, lock, settle, index, pool, namespaces, groups, tiers):
        self.config = config
        self.lock = lock
        self.settle = settle
        self.index = index
        self.pool = pool
        self.namespaces = namespaces
        self.groups = groups
        self.tiers = tiers

    # ---- lookups ------------------------------------------------------------------------
    def match_prefix(self, token_ids, cache_salt, adapter_id) -> int:
        tokens = as_token_ids(token_ids)
        with self.lock:
            found = self.match_prefix_groups(tokens, cache_salt, adapter_id)["tokens"]
            ns = self.namespaces.find(cache_salt, adapter_id)
            nkey = namespace_key(cache_salt, adapter_id)
            tiered = self.tiers.match(tokens, nkey, None if ns is None else ns[0])
            cap = getattr(self.groups, "cap_match", None)      # recurrent states: where a snapshot is
            if cap is not None and tiered > found:
                tiered = cap(tokens, nkey, ns, tiered)
            return max(found, tiered)

    def prefetch_prefix(self, token_ids, cache_salt, adapter_id) -> None:
        tokens = as_token_ids(token_ids)
        with self.lock:
            self.tiers.prefetch(tokens, namespace_key(cache_salt, adapter_id))

    def match_prefix_groups(self, token_ids, cache_salt, adapter_id) -> dict:
        tokens = as_token_ids(token_ids)
        with self.lock:
            ns = self.namespaces.find(cache_salt, adapter_id)
            if ns is None:
                return {"tokens": 0, "per_group": [0] * len(self.groups.tables), "limited_by": None}
            return self.groups.match(tokens, ns[0], ns[1])

    def prefix_blocks(self, token_ids, cache_salt, adapter_id, required: bool = True) -> np.ndarray:
        """Blocks of the verified cached prefix of ``token_ids`` in a namespace, every
        group's chain, looked up without registering it (an unknown namespace holds
        nothing)."""
        if self.index is None:
            if required:
                raise InvalidArgumentError(expected("config.enable_prefix_caching", "True to pin prefixes", False))
            return np.empty(0, dtype=np.int32)
        tokens = as_token_ids(token_ids)
        with self.lock:
            ns = self.namespaces.find(cache_salt, adapter_id)
            if ns is None:
                return np.empty(0, dtype=np.int32)
            groups = self.groups
            return np.concatenate([self.index.match(tokens, *groups.namespace(g, ns[0], ns[1]))
                                   for g in range(len(groups.tables))])

    # ---- admission costs -------------------------------------------------------------------
    def has_available_blocks(self, n) -> bool:
        n = as_count(n, "n")
        with self.lock:
            self.settle()
            return self.pool.num_free_blocks >= n

    def blocks_to_admit(self, prompt_token_ids, num_tokens, cache_salt, adapter_id) -> int:
        tokens = as_token_ids(prompt_token_ids, "prompt_token_ids")
        total = len(tokens) if num_tokens is None else as_count(num_tokens, "num_tokens")
        if total < len(tokens):
            raise InvalidArgumentError(expected("num_tokens", f"at least the prompt's {len(tokens)} tokens", total))
        with self.lock:
            self.settle()
            ns = self.namespaces.find(cache_salt, adapter_id)
            if ns is None:
                return len(self.groups.tables) * -(-total // self.config.block_size)
            return self.groups.blocks_to_admit(tokens, total, ns[0], ns[1])

    def can_admit(self, prompt_token_ids, num_tokens, cache_salt, adapter_id) -> bool:
        with self.lock:
            need = self.blocks_to_admit(prompt_token_ids, num_tokens, cache_salt, adapter_id)
            return need <= self.pool.num_free_blocks

    # ---- pins ---------------------------------------------------------------------------
    def pin_prefix(self, token_ids: Iterable[int], cache_salt, adapter_id: Any, pin: bool) -> int:
        """Pin (or unpin) the cached full blocks of ``token_ids`` on the device and in
        the tiers; the tokens (un)pinned: the longest prefix in any medium."""
        with self.lock:
            blocks = self.prefix_blocks(token_ids, cache_salt, adapter_id)
            (self.pool.pin if pin else self.pool.unpin)(blocks)
            pin_states = getattr(self.groups, "pin_states", None)     # recurrent states: their snapshots too
            ns = self.namespaces.find(cache_salt, adapter_id)
            if pin_states is not None and ns is not None:
                pin_states(as_token_ids(token_ids), ns[0], ns[1], pin)
            tiers = self.tiers.pin(as_token_ids(token_ids), namespace_key(cache_salt, adapter_id), pin)
        device = self.match_prefix_groups(token_ids, cache_salt, adapter_id)["tokens"] if len(blocks) else 0
        return max(device, tiers)

    def reset_prefix_cache(self) -> None:
        with self.lock:
            self.pool.reset_cache()
            self.tiers.clear()
            clear_states = getattr(self.groups, "clear_states", None)
            if clear_states is not None:
                clear_states()

    def drain_events(self) -> list[KVEvent]:
        if self.index is None or not self.index.events_enabled:
            raise InvalidArgumentError(expected("config.enable_kv_events", "True to drain events", False))
        with self.lock:
            events = self.tiers.drain_events()
            state_events = getattr(self.groups, "drain_state_events", None)   # recurrent states' snapshots
            return events + state_events() if state_events is not None else events
