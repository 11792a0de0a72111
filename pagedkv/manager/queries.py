"""The manager's read-only calls: per-sequence counts and tables, page tables for
attention kernels, statistics, reports and the invariant audit.

:class:`Queries` reads under the manager's lock (the core's batch loops release the
GIL while they mutate), through the table coordinator, so a query either answers for
every layer group or names the group it reads.
"""
from __future__ import annotations

import numpy as np

from pagedkv.errors import ArgumentTypeError, InternalError, InvalidArgumentError, SequenceNotFoundError, expected
from pagedkv.manager.arguments import as_count, as_int, optional_int
from pagedkv.manager.stats import CacheStats, render_block_map

__all__ = ["Queries"]


class Queries:
    """Read-only calls (see ``PagedKVCache``).

    Args:
        config: the cache's ``CacheConfig``.
        lock: the manager's lock; ``settle``: runs the queued deferred frees.
        ids: the ``SequenceIds`` map; ``namespaces``: the ``NamespaceRegistry``.
        pool: the device ``BlockPool``; ``groups``: the table coordinator.
        host: the host tier, or :class:`~pagedkv.manager.absent.NoHost`.
        tiers: the prefix tiers, or :class:`~pagedkv.manager.absent.NoTiers`.
    """

    def __init__(self, config, lock, settle, ids, namespaces, pool, groups, host, tiers):
        self.config = config
        self.lock = lock
        self.settle = settle
        self.ids = ids
        self.namespaces = namespaces
        self.pool = pool
        self.groups = groups
        self.first = groups.tables[0]     # token counts: the same in every group
        self.host = host
        self.tiers = tiers

    # ---- sequences ----------------------------------------------------------------------
    def contains(self, seq_id) -> bool:
        with self.lock:
            try:
                return self.ids.key(seq_id) in self.first
            except (SequenceNotFoundError, InvalidArgumentError):
                return False

    def count(self) -> int:
        with self.lock:
            self.settle()
            return len(self.first)

    def sequences(self) -> list:
        with self.lock:
            self.settle()
            return [self.ids.name(k) for k in self.first.keys().tolist()]

    def one(self, method, seq_id, argument: str = "seq_id"):
        """``method(key)`` of one sequence."""
        with self.lock:
            return method(self.ids.key(seq_id, argument))

    def batch(self, method, seq_ids, *args):
        with self.lock:
            keys, internal = self.ids.batch(seq_ids)
            return method(keys, *args, internal=internal)

    def num_blocks(self, seq_id) -> int:
        with self.lock:
            return sum(self.groups.held_blocks(self.ids.key(seq_id)))

    def sequence_info(self, seq_id) -> dict:
        with self.lock:
            info = self.one(self.first.info, seq_id)
            info["namespace"] = self.namespaces.name(info["namespace"])
            return self.groups.sequence_info(info, self.ids.key(seq_id))

    # ---- tables for attention kernels -----------------------------------------------------
    def block_tables(self, seq_ids, pad, width, group):
        pad = as_int(pad, "pad", -2**31, 2**31 - 1)
        width = optional_int(width, "width", 0, 2**31 - 1)
        return self.batch(self.groups.group_for(group).block_table, seq_ids, pad, width)

    def released_tokens(self, seq_ids, group) -> np.ndarray:
        tables = self.groups.group_for(group)
        if not self.groups.spec_for(group).releases_blocks:
            return np.zeros(len(self.seq_lens(seq_ids, False)), dtype=np.int64)
        return self.batch(tables.released_tokens, seq_ids)

    def seq_lens(self, seq_ids, computed) -> np.ndarray:
        if not isinstance(computed, bool):
            raise ArgumentTypeError(expected("computed", "True or False", repr(computed)))
        return self.batch(self.first.seq_lens, seq_ids, computed)

    def slot_mapping(self, seq_id, start, count, group) -> np.ndarray:
        start, count = as_count(start, "start"), as_count(count, "count")
        with self.lock:
            k = self.ids.key(seq_id)
            return self.groups.group_for(group).slot_mapping(np.array([k], np.int64), np.array([start], np.int64),
                                                             np.array([count], np.int64), internal=True)

    # ---- figures and audits ---------------------------------------------------------------
    def stats(self) -> CacheStats:
        with self.lock:
            self.settle()
            return self.groups.stats(self.pool, self.config, self.host, self.tiers)

    def dump_block_map(self, width) -> str:
        width = as_int(width, "width", 1)
        with self.lock:
            return render_block_map(self.pool, width)

    def dump_stats(self) -> str:
        s = self.stats()
        lines = ["=== pagedkv cache ===", s.describe()]
        with self.lock:
            lines.append("Sequences:")
            groups = self.groups.tables
            for k in self.first.keys().tolist()[:32]:
                info = self.first.info(k)
                shown = []
                for g, t in enumerate(groups):
                    blocks = t.blocks(k)
                    held = blocks[blocks >= 0]
                    text = " ".join(map(str, held[:8].tolist())) + (" ..." if len(held) > 8 else "")
                    shown.append(f"{len(held)} blocks [{text}]" if len(groups) == 1 else
                                 f"group {g}: {len(held)} blocks [{text}]")
                lines.append(f"  {self.ids.name(k)!r}: {info['num_computed']}/{info['num_reserved']} tokens, "
                             + "; ".join(shown))
            lines.append("Block map:")
            lines.append(render_block_map(self.pool, 64))
        return "\n".join(lines)

    def check_invariants(self) -> None:
        with self.lock:
            self.settle()
            self.groups.check_invariants()
            self.host.check_invariants()
            self.tiers.check_invariants()
            for k in self.ids.interned_keys():
                if k not in self.first and not self.host.holds(k):
                    raise InternalError(f"sequence id {self.ids.name(k)!r} is interned as key {k}, "
                                        "which no live or swapped-out sequence has")
