"""Host tier: preempted sequences park their KV in host blocks and come back later.

``swap_out`` copies a sequence's committed KV to host blocks (one batched copy over all
layers), then frees its device blocks (full ones stay cached on the device until
evicted). ``swap_in`` allocates device blocks, copies the KV back and re-registers the
full blocks for prefix reuse. Both are all or nothing.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pagedkv._core.pool import BYTES_PER_BLOCK, BlockPool
from pagedkv.config.memory import check_fits
from pagedkv.errors import InternalError, InvalidArgumentError, OutOfBlocksError, SequenceNotFoundError, expected

__all__ = ["HostSwap", "HostTier"]

_MAX_BLOCKS = 2**31 - 1   # block ids are int32 in the core


@dataclass
class _Swapped:
    host_blocks: np.ndarray   # int32 host block ids, every group's, in the order parts lists them
    parts: list[np.ndarray]   # per layer group: the table positions whose blocks were saved
    tokens: np.ndarray        # known token ids
    num_computed: int
    ns_id: int
    ns_hash: int
    priority: int
    state: bytes | None = None   # recurrent-state layers: the state after num_computed tokens


def _nothing() -> None:
    pass


class HostSwap:
    """Host blocks of swapped-out sequences, keyed by core sequence key.

    Args:
        tables: the device tables as the manager's coordinator
            (:mod:`pagedkv.manager.coordinator`): ``tables`` lists one ``BlockTables``
            per layer group (one without sliding-window groups); ``add_restored``,
            ``reserve``, ``commit`` and ``remove`` apply to every group.
        store: the :class:`~pagedkv.store.kvstore.KVStore` holding both arenas, or None for
            bookkeeping only (no bytes move).
        num_blocks: host blocks.
        namespace_hash: ``ns_id -> ns_hash`` of the manager's namespace registry, to
            re-register a swapped-in sequence's blocks under its namespace.
        sync: what moves the prefix blocks an allocation evicted down to the prefix
            tiers (``PrefixTiers.sync``) before a load overwrites their KV; None without
            prefix tiers.

    With layer groups every group's held blocks are saved (a sliding group holds only
    its window and sinks). Swapping in reserves every position in every group, loads
    the saved blocks and commits; a sliding group then releases what lies outside its
    window at once. It comes back without its token ids, so those blank blocks are
    never registered as prefixes (its new blocks are not either; full-attention
    groups register as before).

    Errors name the caller's ids through ``tables.namer``.
    """

    def __init__(self, tables, store, num_blocks: int, namespace_hash: Callable[[int], int],
                 sync: Callable[[], None] | None = None):
        self.tables = tables
        self.groups = list(tables.tables)   # one BlockTables per layer group
        self.store = store
        # the host pool's bookkeeping, sized under the option's own name (the store's
        # host arenas, when there is a store, were checked with it)
        check_fits("cpu", [("host_num_blocks", num_blocks, num_blocks * BYTES_PER_BLOCK)],
                   "a host pool whose bookkeeping fits")
        if num_blocks > _MAX_BLOCKS:
            raise InvalidArgumentError(expected("host_num_blocks", f"an int in [0, {_MAX_BLOCKS}]", num_blocks))
        self.pool = BlockPool(num_blocks)
        self._namespace_hash = namespace_hash
        self.swapped: dict[int, _Swapped] = {}
        self.sync = sync if sync is not None else _nothing

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    @property
    def num_blocks_in_use(self) -> int:
        """Host blocks holding swapped-out KV."""
        return self.pool.num_in_use_blocks

    @staticmethod
    def require() -> None:
        """Swapping is available (:class:`~pagedkv.manager.absent.NoHost` refuses it)."""

    def holds(self, key: int) -> bool:
        return key in self.swapped

    def swap_out(self, key: int) -> int:
        first = self.groups[0]
        if key not in first:
            raise SequenceNotFoundError(first.namer(key))
        info = first.info(key)
        computed = info["num_computed"]
        n = -(-computed // first.block_size)
        parts, device = [], []
        released = 0
        for t in self.groups:
            table = t.blocks(key)
            released += int((table >= 0).sum())
            pos = np.flatnonzero(table[:n] >= 0)
            parts.append(pos)
            device.append(table[pos])
        device_blocks = np.concatenate(device)
        # recurrent-state layers: the state goes to the host with the blocks (checked first)
        export = getattr(self.tables, "export_state_of", None)
        state = export(key) if export is not None else None
        total = len(device_blocks)
        if total > self.pool.num_free_blocks:
            raise OutOfBlocksError(total, self.pool.num_free_blocks, "swap_out to the host tier")
        host_blocks = self.pool.allocate(total)
        if self.store is not None and total:
            import torch

            pairs = np.stack([device_blocks, host_blocks], axis=1).astype(np.int64)
            self.store.offload(torch.from_numpy(pairs))
        tokens = first.tokens(key)
        self.swapped[key] = _Swapped(host_blocks, parts, tokens, computed, info["namespace"],
                                     self._namespace_hash(info["namespace"]), info["priority"], state)
        self.tables.remove(np.array([key], dtype=np.int64), internal=True)
        return released

    def swap_in(self, key: int) -> int:
        rec = self.swapped.get(key)
        if rec is None:
            raise SequenceNotFoundError(self.groups[0].namer(key))
        bs = self.groups[0].block_size
        need = len(self.groups) * -(-rec.num_computed // bs)     # every position, until the commit
        free = self.groups[0].pool.num_free_blocks
        if need > free:
            raise OutOfBlocksError(need, free, "swap_in from the host tier")
        keys = np.array([key], dtype=np.int64)
        self.tables.add_restored(key, rec.tokens, rec.ns_id, rec.ns_hash, rec.priority)
        try:
            if rec.num_computed:        # nothing computed: nothing to reserve (not even a state slot)
                self.tables.reserve(keys, rec.num_computed, internal=True)
        except BaseException:
            self.tables.remove(keys, internal=True)
            raise
        self.sync()     # prefix blocks it evicted go down before the load overwrites them
        if self.store is not None and len(rec.host_blocks):
            import torch

            device = np.concatenate([t.blocks(key)[pos] for t, pos in zip(self.groups, rec.parts)])
            pairs = np.stack([rec.host_blocks, device], axis=1).astype(np.int64)
            self.store.load(torch.from_numpy(pairs))
        if rec.state is not None and rec.num_computed:   # into the slot the reserve gave it (the commit snapshots it)
            self.tables.import_state_of(key, rec.state)
        if rec.num_computed:
            self.tables.commit(keys, rec.num_computed, internal=True)
        self.sync()
        self.pool.free(rec.host_blocks)
        del self.swapped[key]
        return len(rec.host_blocks)

    def discard(self, key: int) -> None:
        """Drop a swapped-out sequence's host copy (it was freed)."""
        rec = self.swapped.pop(key)
        self.pool.free(rec.host_blocks)

    def check_invariants(self) -> None:
        held = sum(len(r.host_blocks) for r in self.swapped.values())
        if held != self.pool.num_in_use_blocks:
            raise InternalError(f"host tier: swapped sequences hold {held} blocks, pool has "
                                f"{self.pool.num_in_use_blocks} in use")
        self.pool.check_invariants()


#: the 0.1 name (``pagedkv.offload.HostTier``), which read as the host *prefix* tier
#: (:class:`pagedkv.tiers.host.HostPrefixTier`); kept for one release.
HostTier = HostSwap
