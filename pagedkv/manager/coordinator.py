"""The block tables the manager drives, behind one interface whatever the layer groups.

A model whose layers are all full attention has one :class:`~pagedkv._core.tables.FullAttentionTables`;
one that mixes in sliding-window layers has one per layer group
(:class:`~pagedkv.groups.tables.GroupTables`). :func:`coordinator` returns either as the
same protocol, so the manager, the host tier and the prefix tiers fan their calls out
without asking which:

- the lifecycle calls of ``BlockTables`` (``add``, ``reserve``, ``advance``, ``commit``,
  ``unreserve``, ``truncate``, ``fork``, ``hold_window``, ``slide``, ``remove``,
  ``relocate``, ``take_copies``, ``num_pending_copies``, ``set_priority``,
  ``check_invariants``) plus ``add_restored``;
- ``tables`` (one per group), ``book`` (what the per-step calls go to: the one
  ``BlockTables`` itself, so a full-attention cache pays no Python frame for the
  fan-out), ``group_for``, ``namespace``, ``match``, ``blocks_to_admit``,
  ``held_blocks``;
- the data path's ``layer_slot`` / ``layer_slots`` and the facade's ``names``,
  ``sequence_info`` and ``stats``.
"""
from __future__ import annotations

import numpy as np

from pagedkv.errors import InvalidArgumentError, expected
from pagedkv.groups.data import layer_slot, layer_slots
from pagedkv.groups.spec import KVSpec
from pagedkv.groups.tables import GroupNamespaces, GroupTables, make_tables
from pagedkv.manager.stats import CacheStats

__all__ = ["OneGroup", "Groups", "coordinator"]

# BlockTables calls a OneGroup forwards as the table's own bound methods (no frame)
_FORWARDED = ("add", "reserve", "advance", "commit", "unreserve", "truncate", "fork", "hold_window", "slide",
              "remove", "relocate", "take_copies", "set_priority", "check_invariants")


class OneGroup:
    """One layer group (every layer full attention, or every layer MLA): its tables,
    of its spec's class, as a group of one."""

    def __init__(self, pool, index, block_size: int, namer, spec: KVSpec):
        t = make_tables(pool, block_size, index, spec, namer)
        self.book = t
        self.tables = [t]
        self.specs = (spec,)
        self.pool = pool
        self.index = index
        self.block_size = block_size
        self.limited_by = [0]
        for name in _FORWARDED:
            setattr(self, name, getattr(t, name))

    @property
    def num_pending_copies(self) -> int:
        return self.book.num_pending_copies

    # the group questions, answered for one group by the grouped code itself
    prefix_hits = GroupTables.prefix_hits
    agreed_hit = GroupTables.agreed_hit
    match = GroupTables.match
    blocks_to_admit = GroupTables.blocks_to_admit
    held_blocks = GroupTables.held_blocks

    @staticmethod
    def namespace(group: int, ns_id: int, ns_hash: int) -> tuple[int, int]:
        return ns_id, ns_hash

    def add_restored(self, key: int, tokens, ns_id: int, ns_hash: int, priority: int = -1) -> None:
        """Admit a sequence whose KV arrives whole from elsewhere: no prefix lookup."""
        self.book.add(key, tokens, ns_id, ns_hash, priority, False)

    def group_for(self, group):
        if group is not None and not (isinstance(group, (int, np.integer)) and not isinstance(group, bool)
                                      and group == 0):
            raise InvalidArgumentError(expected("group", "None or 0 (the cache has one layer group)", repr(group)))
        return self.book

    def spec_for(self, group):
        """The spec of layer group ``group`` (None: the first), checked as :meth:`group_for`."""
        self.group_for(group)
        return self.specs[0]

    @staticmethod
    def layer_slot(layer: int) -> tuple[int, int]:
        return 0, layer

    @staticmethod
    def layer_slots(layer: int, slot_mapping):
        return layer, slot_mapping

    @staticmethod
    def names(registry):
        """The namespace registry as the prefix tiers and KV events see it."""
        return registry

    @staticmethod
    def sequence_info(info: dict, key: int) -> dict:
        return info

    def stats(self, pool, config, host, tiers) -> CacheStats:
        return CacheStats.collect(pool, self.book, config, host, tiers, None)


class Groups(GroupTables):
    """Sliding-window layer groups: :class:`~pagedkv.groups.tables.GroupTables` with the
    facade's questions."""

    @property
    def book(self) -> Groups:
        return self

    def spec_for(self, group):
        """The spec of layer group ``group`` (None: the first), checked as :meth:`group_for`."""
        self.group_for(group)
        return self.specs[0 if group is None else int(group)]

    def layer_slot(self, layer: int) -> tuple[int, int]:
        return layer_slot(self.plan, layer)

    def layer_slots(self, layer: int, slot_mapping):
        return layer_slots(self.plan, layer, slot_mapping)

    @staticmethod
    def names(registry) -> GroupNamespaces:
        return GroupNamespaces(registry)

    def sequence_info(self, info: dict, key: int) -> dict:
        """``info`` plus ``groups``: each group's block counts and priority (block counts
        differ per group), and the block counts as their sums."""
        per = []
        for t in self.tables:
            g = t.info(key)
            per.append({"num_blocks": int((t.blocks(key) >= 0).sum()),
                        "num_dropped_blocks": g["num_dropped_blocks"],
                        "num_prefix_hit_blocks": g["num_prefix_hit_blocks"], "priority": g["priority"]})
        info["groups"] = per
        for field in ("num_blocks", "num_dropped_blocks", "num_prefix_hit_blocks"):
            info[field] = sum(g[field] for g in per)
        return info

    def stats(self, pool, config, host, tiers) -> CacheStats:
        return CacheStats.collect(pool, self.tables[0], config, host, tiers, self)


def coordinator(pool, index, config, namer, state_store=None):
    """The tables of a cache with ``config``: one group, or one per layer group; with
    recurrent-state layers, those wrapped with the state group
    (:class:`~pagedkv.manager.states.StateGroups`, whose states ``state_store`` holds)."""
    if config.layer_groups is None:
        inner: OneGroup | Groups = OneGroup(pool, index, config.block_size, namer, config.kv_specs[0])
    else:
        inner = Groups(pool, index, config.block_size, config.layer_groups, namer)
    if config.state_spec is None:
        return inner
    from pagedkv.manager.states import StateGroups

    return StateGroups(inner, config, index, state_store)
