"""The manager's data path: writes into the KV arena, gathers (by sequence or through
a page table), attention over the pages, block copies.

:class:`DataPath` maps a model layer to its layer group's table and layer slot through
the table coordinator (:mod:`pagedkv.manager.coordinator`), the same way for one group
or many. The data calls run outside the manager's lock, except the table reads of a
gather (see ``PagedKVCache``'s thread-safety note).
"""
from __future__ import annotations

import numpy as np

from pagedkv.config.support import require
from pagedkv.errors import ArgumentTypeError, InvalidArgumentError, InvalidBlockError, expected
from pagedkv.manager.arguments import as_counts, tensor_values

__all__ = ["DataPath", "LayerAttention"]


class LayerAttention:
    """One forward step's paged attention over a cache's layers: planned once
    (:meth:`PagedKVCache.plan_attention`: the tables moved to the device once, the
    options fixed), then :meth:`run` per layer, FlashInfer's ``plan()``/``run()``."""

    __slots__ = ("_path", "step")

    def __init__(self, path, step):
        self._path = path
        self.step = step        # the ops' AttentionStep (the tables on the device)

    def run(self, layer: int, q, *, out=None):
        """The attention of ``q`` over ``layer``: ``[Nq, Hq, D]`` queries for K/V rows,
        ``(q_nope, q_pe)`` for MLA latent rows (see ``PagedKVCache.mla_attention``)."""
        return self._path.run_attention(self.step, layer, q, out)


class DataPath:
    """KV data calls (see ``PagedKVCache``).

    Args:
        config: the cache's ``CacheConfig``.
        store: the ``KVStore``, or None for a bookkeeping-only cache (every data call
            is then refused).
        groups: the table coordinator.
        ids: the ``SequenceIds`` map; ``lock``: the manager's lock.
    """

    def __init__(self, config, store, groups, ids, lock):
        self.config = config
        self.store = store
        self.groups = groups
        self.ids = ids
        self.lock = lock

    def require_store(self):
        if self.store is None:
            raise InvalidArgumentError(expected("allocate_store", "True for KV data operations", False))
        return self.store

    def write(self, layer: int, slot_mapping, key, value) -> None:
        store = self.require_store()
        layer, slot_mapping = self.groups.layer_slots(layer, slot_mapping)
        store.write(layer, _slots_tensor(slot_mapping, store.device), key, value)

    def gather(self, seq_ids, layer: int, num_tokens, with_positions: bool):
        import torch

        store = self.require_store()
        want = None if num_tokens is None else as_counts(num_tokens)
        with self.lock:
            keys, internal = self.ids.batch(seq_ids)
            g, slot = self.groups.layer_slot(layer)
            tables = self.groups.tables[g]
            indptr, indices, _ = tables.csr(keys, internal=internal)
            lens = tables.seq_lens(keys, internal=internal)
            gone = tables.released_tokens(keys, internal=internal) if self.groups.specs[g].releases_blocks else None
        if gone is not None and gone.any():
            if want is not None:
                raise InvalidArgumentError(expected("num_tokens", "None for a sliding-window layer whose "
                                                    "sequences released tokens", want.tolist()))
            want = lens - gone
        if want is not None:
            if want.shape != lens.shape or (want > lens).any():
                raise InvalidArgumentError(expected(
                    "num_tokens", f"{len(lens)} counts within the reserved lengths {lens.tolist()}", want.tolist()))
            lens = want
        dev = store.device
        k, v = store.gather(slot, torch.from_numpy(indptr).to(dev), torch.from_numpy(indices).to(dev),
                            torch.from_numpy(lens.astype(np.int32)).to(dev), sink=self.group_sink(g))
        cu = np.zeros(len(lens) + 1, dtype=np.int64)
        np.cumsum(lens, out=cu[1:])
        if not with_positions:
            return k, v, torch.from_numpy(cu)
        from pagedkv.groups.data import kept_positions

        positions = kept_positions(tables, lens, np.zeros_like(lens) if gone is None else gone)
        return k, v, torch.from_numpy(cu), torch.from_numpy(positions)

    def gather_pages(self, layer: int, indptr, indices, seq_lens, *, pending=None, rotated=False):
        if rotated is not False and rotated is not True:
            raise ArgumentTypeError(expected("rotated", "True or False", repr(rotated)))
        if rotated and not self.config.kv_rotation:
            raise InvalidArgumentError(expected("rotated", "False for a cache without kv_rotation", True))
        if rotated and self.config.block_keys:   # full blocks' keys are stored unrotated, per channel
            raise InvalidArgumentError(expected("rotated", "False for a cache with kv_key_quant='block'", True))
        g, layer = self.groups.layer_slot(layer)
        indptr, indices, seq_lens = (self.table_tensor(a, n) for a, n in
                                     ((indptr, "indptr"), (indices, "indices"), (seq_lens, "seq_lens")))
        if pending is not None:
            pending = self.pending_rows(pending, seq_lens)
        return self.require_store().gather(layer, indptr, indices, seq_lens, pending=pending, rotated=rotated,
                                           sink=self.group_sink(g))

    def group_sink(self, g: int) -> int | None:
        """The sink tokens layer group ``g``'s tables start with when that is not every
        sequence's first ``kv_sink_tokens`` (None): a sliding group releases the blocks
        that leave its window, so only the sink blocks it keeps (its attention sinks)
        begin its tables; its other rows are read exact only in the recent window."""
        plan = self.config.layer_groups
        group = plan.groups[g] if plan is not None else None
        if group is None or not group.window:
            return None
        bs = self.config.block_size
        return min(self.config.kv_sink_tokens or 0, -(-group.sinks // bs) * bs)

    def plan_attention(self, indptr, indices, seq_lens, q_indptr, **options) -> LayerAttention:
        """One step's attention over any layer (see :class:`LayerAttention`)."""
        from pagedkv.ops.attention_step import AttentionStep

        store = self.require_store()
        backend = options.pop("backend", "auto")
        return LayerAttention(self, AttentionStep(indptr, indices, seq_lens, q_indptr, device=store.device,
                                                  backend=backend, **options))

    def run_attention(self, step, layer: int, q, out=None):
        store = self.require_store()
        g, slot = self.groups.layer_slot(layer)
        if getattr(store, "window", None) is None:
            return step.run(q, store.view(slot), out=out)
        sink = self.group_sink(g)
        view = store.view(slot, sink=sink)     # the layer's format, views and exact rows: the store's to build
        if view.exact is None:
            return step.run(q, view, out=out)
        with store.window.lock:     # the window's slot map is shared by every sequence (see pagedkv.store.window)
            res = step.run(q, view, out=out)
            store.attended(slot, step.indptr, step.indices, step.seq_lens, sink=sink)
        return res

    def mla_attention(self, layer: int, q_nope, q_pe, indptr, indices, seq_lens, q_indptr, *, sm_scale,
                      num_splits=None, out=None):
        if self.config.kv_lora_rank is None:
            raise InvalidArgumentError(expected("cache", "an MLA cache (kv_lora_rank) for mla_attention",
                                                "a cache of K/V rows: use attention()"))
        step = self.plan_attention(indptr, indices, seq_lens, q_indptr, sm_scale=sm_scale, num_splits=num_splits)
        return step.run(layer, (q_nope, q_pe), out=out)

    def attention(self, layer: int, q, indptr, indices, seq_lens, q_indptr, **options):
        if self.config.kv_lora_rank is not None:
            require("paged attention (attention)", self.config)
        out = options.pop("out", None)
        return self.plan_attention(indptr, indices, seq_lens, q_indptr, **options).run(layer, q, out=out)

    def table_tensor(self, a, name: str):
        """A NumPy integer page-table array as an int32 tensor on the cache's device;
        anything else unchanged (the store checks and refuses it)."""
        if not isinstance(a, np.ndarray) or a.dtype.kind not in "iu":
            return a
        if a.size and (a.min() < np.iinfo(np.int32).min or a.max() > np.iinfo(np.int32).max):
            raise InvalidArgumentError(expected(name, "values within int32", f"{a.min()}..{a.max()}"))
        import torch

        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32)).to(self.require_store().device)

    def rotation_signs(self):
        if not self.config.kv_rotation:
            return None
        if self.store is not None and self.store.rotation_signs is not None:   # a kv_rotation store has them
            return self.store.rotation_signs.clone()

        from pagedkv.format.rotation import rotation_signs

        return rotation_signs(self.config.head_dim, self.config.kv_rotation_seed)

    @staticmethod
    def pending_rows(pending, seq_lens) -> np.ndarray:
        import torch

        want = "ints [B], 0 <= pending[b] <= seq_lens[b]"
        try:
            p = np.array(pending.cpu() if isinstance(pending, torch.Tensor) else pending)
        except (TypeError, ValueError, RuntimeError):
            raise ArgumentTypeError(expected("pending", want, type(pending).__name__)) from None
        if p.dtype.kind not in "iu" or p.ndim != 1:
            raise ArgumentTypeError(expected("pending", want, f"{p.dtype} array of shape {p.shape}"))
        lens = seq_lens.cpu().numpy() if isinstance(seq_lens, torch.Tensor) else np.asarray(seq_lens)
        p = p.astype(np.int64)
        if p.shape != lens.shape or (p < 0).any() or (p > lens).any():
            raise InvalidArgumentError(expected("pending", want + f" with B = {lens.shape[0]}", p.tolist()))
        return p

    def copy_blocks(self, pairs) -> None:
        import torch

        store = self.require_store()
        if isinstance(pairs, np.ndarray):
            pairs = torch.from_numpy(pairs)
        elif not isinstance(pairs, torch.Tensor):
            if isinstance(pairs, (str, bytes)) or not hasattr(pairs, "__len__"):
                raise ArgumentTypeError(expected("pairs", "an int [P, 2] array of (src, dst) block ids",
                                                 type(pairs).__name__))
            _check_pair_values(pairs, self.config.resolved_num_blocks)
            try:
                pairs = torch.as_tensor(pairs, dtype=torch.int64)
            except (TypeError, ValueError, RuntimeError, OverflowError):
                raise ArgumentTypeError(expected("pairs", "an int [P, 2] array of (src, dst) block ids",
                                                 f"a {type(pairs).__name__} of other values")) from None
        store.copy_blocks(pairs)


def _slots_tensor(slot_mapping, device):
    import torch

    if isinstance(slot_mapping, np.ndarray):
        if slot_mapping.dtype != np.int64:
            from pagedkv.errors import DTypeError

            raise DTypeError(expected("slot_mapping", "an int64 array", f"{slot_mapping.dtype} array"))
        slot_mapping = torch.from_numpy(slot_mapping)
    if isinstance(slot_mapping, torch.Tensor) and slot_mapping.device != device:
        if slot_mapping.layout != torch.strided or slot_mapping.device.type == "meta":
            tensor_values(slot_mapping, "slot_mapping")      # raises the typed error
        slot_mapping = slot_mapping.to(device, non_blocking=True)
    return slot_mapping


def _check_pair_values(pairs, num_blocks: int) -> None:
    """copy_blocks' list input, value by value, before torch converts it: a float or
    bool is a wrong type (torch would truncate 1.5 to 1), an int past int64 is an
    out-of-range block id (torch would fail with an overflow)."""
    want = "an int [P, 2] array of (src, dst) block ids"
    for i, row in enumerate(pairs):
        items = row if hasattr(row, "__len__") and not isinstance(row, (str, bytes)) else (row,)
        for j, v in enumerate(items):
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
                raise ArgumentTypeError(expected("pairs", want, f"{type(v).__name__} {v!r} at row {i}"))
            if not -2**63 <= v < 2**63:
                where = f"{('src', 'dst')[j]} row {i}" if j < 2 else f"row {i}"   # op_checks.block_id_error's words
                raise InvalidBlockError(expected("pairs", f"block ids in [0, {num_blocks})", f"{int(v)} at {where}"))
