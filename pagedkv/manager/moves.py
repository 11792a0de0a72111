"""The manager's calls that move a sequence's KV: between device blocks (relocate,
compact) and between the device and the host tier (swap out, swap in).

:class:`Moves` works through the table coordinator and the host tier (or its stand-in,
:class:`~pagedkv.manager.absent.NoHost`, which refuses swapping); block copies go to
the copier (:mod:`pagedkv.manager.absent`: done in the store, or owed by a
bookkeeping-only cache).
"""
from __future__ import annotations

import numpy as np

from pagedkv.errors import InvalidArgumentError, SequenceNotFoundError

__all__ = ["Moves"]


class Moves:
    """Relocation, compaction and host swap (see ``PagedKVCache``).

    Args:
        lock: the manager's lock; ``settle``: runs the queued deferred frees.
        ids: the ``SequenceIds`` map.
        pool: the device ``BlockPool``.
        groups: the table coordinator.
        copies: the copier of moved blocks' KV.
        host: the host tier, or :class:`~pagedkv.manager.absent.NoHost`.
    """

    def __init__(self, lock, settle, ids, pool, groups, copies, host):
        self.lock = lock
        self.settle = settle
        self.ids = ids
        self.pool = pool
        self.groups = groups
        self.copies = copies
        self.host = host

    # ---- within the device ---------------------------------------------------------------
    def relocate(self, seq_id, moves) -> np.ndarray:
        with self.lock:
            self.settle()
            pairs = self.groups.relocate(self.ids.key(seq_id), moves)
            if len(pairs):
                self.copies.copy(pairs)
            return pairs

    def compact(self, seq_ids) -> np.ndarray:
        from pagedkv.manager.compaction import plan_compaction

        with self.lock:
            self.settle()
            tables = self.groups.tables
            first = tables[0]
            if seq_ids is None:
                keys = first.keys().tolist()
            else:
                keys, internal = self.ids.batch(seq_ids)
                keys = list(dict.fromkeys(np.atleast_1d(keys).tolist()))
                for k in keys:
                    if k < 0 and not internal:      # negative keys name interned ids only
                        raise SequenceNotFoundError(k, "seq_ids")
                    first.blocks(k)                 # unknown ids raise before anything moves
            plan = plan_compaction(self.pool, tables, keys)
            done = []
            try:
                for (g, k), moves in plan.items():
                    done.append(tables[g].relocate(k, moves))
            finally:                   # moves applied are copied whatever happens next
                pairs = np.concatenate(done) if done else np.empty((0, 2), dtype=np.int32)
                if len(pairs):
                    self.copies.copy(pairs)
            return pairs[np.argsort(-pairs[:, 0].astype(np.int64), kind="stable")]

    def take_copies(self) -> np.ndarray:
        with self.lock:
            return self.copies.take()

    # ---- to the host and back ------------------------------------------------------------
    def swap_out(self, seq_id) -> int:
        host = self.host
        host.require()
        with self.lock:
            return host.swap_out(self.ids.key(seq_id))

    def swap_in(self, seq_id) -> int:
        host = self.host
        host.require()
        with self.lock:
            self.settle()
            return host.swap_in(self.ids.key(seq_id))

    def is_swapped(self, seq_id) -> bool:
        with self.lock:
            try:
                return self.host.holds(self.ids.key(seq_id))
            except (SequenceNotFoundError, InvalidArgumentError):
                return False
