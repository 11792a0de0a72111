"""The manager's data path: writes into the KV arena, gathers (by sequence or through
a page table), attention over the pages, block copies.

:class:`DataPath` maps a model layer to its layer group's table and layer slot through
the table coordinator (:mod:`pagedkv.manager.coordinator`), the same way for one group
or many. The data calls run outside the manager's lock, except the table reads of a
gather (see ``PagedKVCache``'s thread-safety note).
"""
from __future__ import annotations

import numpy as np

from pagedkv.errors import ArgumentTypeError, InvalidArgumentError, InvalidBlockError, expected
from pagedkv.manager.arguments import as_counts, tensor_values

__all__ = ["DataPath"]


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
            done = tables.seq_lens(keys, computed=True, internal=internal)
            gone = tables.released_tokens(keys, internal=internal) if tables.window else None
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
        if store.layer_format(slot).quantized:
            ends = lens if gone is None else lens + gone
            _refuse_pass_rows(seq_ids, ends, done)
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

    def attention(self, layer: int, q, indptr, indices, seq_lens, q_indptr, *, k_new=None, v_new=None,
                  pending=None, **options):
        from pagedkv.ops import ExactRows, paged_attention

        store = self.require_store()
        g, layer = self.groups.layer_slot(layer)
        fmt = store.layer_format(layer)
        if k_new is None and v_new is None and (fmt.quantized or pending is not None):
            pending = self._no_pass_rows(pending, q_indptr)
        view = store.layer(layer)
        if not fmt.quantized and k_new is not None:
            _held_pass_rows(q, view, store.layout, fmt, k_new, v_new, pending, q_indptr)
            k_new = v_new = pending = None
        options.update(k_new=k_new, v_new=v_new, pending=pending)
        scale, zero = store.layer_scales(layer)
        kscale, kzero = store.layer_key_params(layer)
        main, i = store._where[layer]
        w, exact = store.window, None
        sink = self.group_sink(g) if w is not None else None
        if main and w is not None and (w.window or w.sink):
            exact = ExactRows(w.data[i], w.slot_of, w.valid[i], w.window, w.sink if sink is None else sink)
        if exact is None:
            return paged_attention(q, view, indptr, indices, seq_lens, q_indptr, layout=store.layout,
                                   kv_scale=scale, kv_zero=zero, key_scale=kscale, key_zero=kzero,
                                   rotation_signs=store.rotation_signs if main else None,
                                   layer_format=fmt, **options)
        with w.lock:     # the window's slot map is shared by every sequence (see pagedkv.store.window)
            return self._attention_exact(w, i, q, view, indptr, indices, seq_lens, q_indptr, scale, zero, kscale,
                                         kzero, exact, fmt, options, sink)

    def _attention_exact(self, w, i, q, view, indptr, indices, seq_lens, q_indptr, scale, zero, kscale, kzero,
                         exact, fmt, options, sink=None):
        from pagedkv.ops import paged_attention
        from pagedkv.store.window import blocks_of_csr

        store = self.require_store()
        out = paged_attention(q, view, indptr, indices, seq_lens, q_indptr, layout=store.layout, kv_scale=scale,
                              kv_zero=zero, key_scale=kscale, key_zero=kzero, rotation_signs=store.rotation_signs,
                              exact_rows=exact, layer_format=fmt, **options)
        if i == 0:      # once per pass, as a gather: count fallbacks, keep the sinks' pins recent
            ptr, idx = np.asarray(indptr.cpu() if hasattr(indptr, "cpu") else indptr), np.asarray(
                indices.cpu() if hasattr(indices, "cpu") else indices)
            lens = np.asarray(seq_lens.cpu() if hasattr(seq_lens, "cpu") else seq_lens).astype(np.int64)
            lens = lens - _pass_rows(options, q_indptr)     # the window ends where the pass's rows begin
            w.count_fallbacks(blocks_of_csr(ptr, idx), lens, sink)
        if i == 0 and exact.sink:
            heads = np.minimum(exact.sink, np.maximum(lens - w.window, 0))
            first = [idx[ptr[b]:ptr[b] + (n - 1) // w.block_size + 1] for b, n in enumerate(heads.tolist()) if n]
            if first:
                ws = w.slot_of[np.concatenate(first).astype(np.int64)]
                ws = ws[ws >= 0]
                w.clock += 1
                w.stamp[ws[w.pinned[ws]]] = w.clock
        return out

    def _no_pass_rows(self, pending, q_indptr):
        """A quantized layer read without the pass's own K/V: only when the caller says
        that no query's row was written by this pass (``pending`` all zeros); otherwise
        the op would read those rows back quantized, silently unlike every other read
        (one definition of what a read returns: see :mod:`pagedkv.format.new_rows`)."""
        import torch

        want = ("the pass's own K/V (k_new, v_new) for a quantized layer: the rows a forward pass wrote "
                "are read at model precision; pending=0 (ints [B]) where no query's row was written by this pass")
        if pending is None:
            raise InvalidArgumentError(expected("k_new", want, None))
        try:
            p = np.asarray(pending.cpu() if isinstance(pending, torch.Tensor) else pending)
        except (TypeError, ValueError, RuntimeError):
            raise ArgumentTypeError(expected("pending", "ints [B]", type(pending).__name__)) from None
        try:
            qp = np.asarray(q_indptr.cpu() if isinstance(q_indptr, torch.Tensor) else q_indptr)
        except (TypeError, ValueError, RuntimeError):
            qp = None
        # a q_indptr that is no 1-D table: the op names it (its length is not compared here)
        batch = max(qp.shape[0] - 1, 0) if qp is not None and qp.ndim == 1 else None
        if p.dtype.kind not in "iu" or p.ndim != 1 or (batch is not None and p.shape[0] != batch) or p.any():
            raise InvalidArgumentError(expected("pending", "zeros [B] without k_new and v_new (" + want + ")",
                                                p.tolist() if p.ndim == 1 else repr(pending)))
        return None

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


def _refuse_pass_rows(seq_ids, ends: np.ndarray, done: np.ndarray) -> None:
    """A gather by sequence of a quantized layer reads committed rows only: rows written
    by the forward pass in progress (reserved, not committed) are read at model precision
    (one definition of what a read returns), which the arena no longer holds."""
    over = np.nonzero(np.asarray(ends) > np.asarray(done))[0]
    if len(over):
        b = int(over[0])
        sid = seq_ids if isinstance(seq_ids, (str, bytes)) or not hasattr(seq_ids, "__len__") else list(seq_ids)[b]
        raise InvalidArgumentError(expected(
            "num_tokens", "at most the committed tokens of a quantized layer's sequence (the forward pass's own "
            "rows are read at model precision: gather before writing, gather_pages(pending=), or commit first)",
            f"{int(ends[b])} tokens of {sid!r}, {int(done[b])} committed"))


def _held_pass_rows(q, view, layout, fmt, k_new, v_new, pending, q_indptr) -> None:
    """A model-precision layer holds the pass's rows as computed, so the arena reads the
    same as ``k_new``/``v_new`` (and a CUDA decode keeps the decode kernel, which reads
    only the arena): checked as the op would check them, then not passed on."""
    import torch

    from pagedkv.format.new_rows import check_new_rows, check_pending_values
    from pagedkv.format.op_checks import check_layer

    if not isinstance(q, torch.Tensor):
        return None          # the op names the problem
    geo = check_layer(view, layout, None, None, layer_format=fmt)
    check_new_rows(k_new, v_new, pending, q, geo, view.device)
    if pending is not None:
        qp = np.asarray(q_indptr.cpu() if isinstance(q_indptr, torch.Tensor) else q_indptr).astype(np.int64)
        p = np.asarray(pending.cpu() if isinstance(pending, torch.Tensor) else pending)
        if p.dtype.kind not in "iu" or p.ndim != 1:
            raise ArgumentTypeError(expected("pending", "ints [B]", f"{p.dtype} array of shape {p.shape}"))
        check_pending_values(p.astype(np.int64).tolist(), qp.tolist())
    return None


def _pass_rows(options, q_indptr) -> np.ndarray:
    """Each row's positions read from the pass's own K/V (the op checked the counts)."""
    if options.get("k_new") is None:
        return np.zeros(1, dtype=np.int64)
    pending = options.get("pending")
    if pending is not None:
        return np.asarray(pending.cpu() if hasattr(pending, "cpu") else pending).astype(np.int64)
    qp = np.asarray(q_indptr.cpu() if hasattr(q_indptr, "cpu") else q_indptr).astype(np.int64)
    return np.diff(qp)


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
