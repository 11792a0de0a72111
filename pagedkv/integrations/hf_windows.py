"""Per-layer-group step plans for :class:`~pagedkv.integrations.transformers.PagedCache`.

With sliding-window layers the paged cache keeps one set of block tables per layer
group (see :mod:`pagedkv.groups.layers`), so every group needs its own page table for
the gathers, and a sliding layer must return what transformers'
``DynamicSlidingWindowLayer`` returns: the last ``min(cached, W - 1)`` cached columns,
then this pass's ``q`` columns, ``[B, H, min(cached, W - 1) + q, D]``. Its mask sizes
follow (``get_mask_sizes``: that length, and the offset ``max(cached - W + 1, 0)``).

The group's tables release blocks once their tokens leave the window of the next
query, so they always hold every column such a layer returns: each row's kept tokens
start at or before column ``max(cached - W + 1, 0)``.
"""
from __future__ import annotations

import numpy as np
import torch

from pagedkv.errors import InternalError

__all__ = ["GroupStep", "plan_groups_step", "sliding_mask_sizes", "assemble"]


class GroupStep:
    """One layer group's share of a forward pass."""

    __slots__ = ("indptr", "indices", "lens", "src", "dest", "columns")

    def __init__(self, indptr, indices, lens, src, dest, columns):
        self.indptr = indptr    # CSR page table of the rows in this group (device int32)
        self.indices = indices
        self.lens = lens        # int32 [B]: tokens the group's gather returns per row
        self.src = src          # None, or int64 rows of the gather to keep
        self.dest = dest        # None, or int64 rows of the [B * columns] output they go to
        self.columns = columns  # output columns per row


def sliding_mask_sizes(cached: int, query: int, window: int) -> tuple:
    """``(kv_length, kv_offset)`` of a sliding layer (transformers' convention)."""
    if cached >= window:
        return window - 1 + query, cached - window + 1
    return cached + query, 0


def plan_groups_step(kv, rows, pads: np.ndarray, cached: int, q: int, device) -> list[GroupStep]:
    """A :class:`GroupStep` per layer group, for a pass of ``q`` columns after ``cached``."""
    plan = kv.config.layer_groups
    steps = []
    columns = cached + q
    lens_all = kv.seq_lens(rows).astype(np.int64)         # reserved: the same in every group
    B = len(rows)
    for g, group in enumerate(plan.groups):
        indptr, indices, _ = kv.page_table_csr(rows, group=g)
        start = 0 if not group.window else max(cached - group.window + 1, 0)   # first output column
        width = columns - start
        gone = kv.released_tokens(rows, group=g).astype(np.int64)
        kept = lens_all - gone
        first = np.maximum(start - pads, 0)                    # first position each row returns
        if (gone > first).any():
            raise InternalError(f"layer group {g} released tokens {gone.tolist()} that the window "
                                f"still needs (from positions {first.tolist()}): a bug")
        src = dest = None
        if start or pads.any():
            offsets = np.concatenate([[0], np.cumsum(kept)[:-1]])
            src_parts, dest_parts = [], []
            for b in range(B):
                pos = np.arange(first[b], lens_all[b], dtype=np.int64)
                src_parts.append(offsets[b] + pos - gone[b])
                dest_parts.append(b * width + pos + pads[b] - start)
            src = torch.from_numpy(np.concatenate(src_parts)).to(device)
            dest = torch.from_numpy(np.concatenate(dest_parts)).to(device)
        steps.append(GroupStep(torch.from_numpy(indptr).to(device), torch.from_numpy(indices).to(device),
                               torch.from_numpy(kept.astype(np.int32)).to(device), src, dest, width))
    return steps


def assemble(step: GroupStep, k: torch.Tensor, v: torch.Tensor, B: int, H: int, D: int):
    """The gathered packed K/V as ``[B, columns, H, D]`` (zeros in padding columns)."""
    if step.dest is None:
        return k.view(B, step.columns, H, D), v.view(B, step.columns, H, D)
    keys = k.new_zeros(B * step.columns, H, D).index_copy_(0, step.dest, k.index_select(0, step.src))
    values = v.new_zeros(B * step.columns, H, D).index_copy_(0, step.dest, v.index_select(0, step.src))
    return keys.view(B, step.columns, H, D), values.view(B, step.columns, H, D)


def admit_caps(hits: np.ndarray, pads: np.ndarray, block_size: int, window: int) -> np.ndarray:
    """Most cached tokens each admitted row may reuse, given the prefix hits it could get.

    A row whose hit reaches past the batch's common cached columns recomputes the
    excess (see ``PagedCache.admit``), and its first pass then needs the window before
    that common point; a sliding group that took the whole hit released it already.
    So a row keeps its hit only while ``hit <= max(columns - pad, window - 1)``, with
    ``columns`` the batch's common point, which the caps themselves lower: iterate to
    the fixed point (it only decreases)."""
    hits = np.asarray(hits, dtype=np.int64)
    cols = int((pads + hits).min())
    while True:
        caps = np.minimum(hits, np.maximum(cols - pads, window - 1)) // block_size * block_size
        low = int((pads + caps).min())
        if low == cols:
            return caps
        cols = low


def layer_windows(kv) -> list | None:
    """Each layer's window (0 = full), or None when the cache has no layer groups."""
    plan = kv.config.layer_groups
    if plan is None:
        return None
    return [plan.group_of(i).window for i in range(plan.num_layers)]
