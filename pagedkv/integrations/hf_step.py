"""One forward pass of a :class:`~pagedkv.integrations.transformers.PagedCache`: layer 0
plans it (one ``reserve`` for every row, the slots each new column writes, the page
tables the layers read), the last layer commits it; with ``paged_attention=True`` each
layer only writes, and the "pagedkv" attention reads the pages through a ticket."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pagedkv.errors import InternalError, InvalidArgumentError, ShapeError, expected
from pagedkv.integrations import hf_attention, hf_windows

if TYPE_CHECKING:
    from pagedkv.integrations.hf_states import StatePass

__all__ = ["StepCalls", "StepPlan"]


class StepPlan:
    """What layer 0 decided for one forward pass; every layer reuses it."""

    __slots__ = ("q", "write_slots", "n_new", "new_mask", "indptr", "indices", "lens", "dest", "columns", "groups",
                 "q_indptr", "q_rows", "pending")

    def __init__(self, q, write_slots, n_new, new_mask, indptr, indices, lens, dest, columns, groups=None):
        self.q = q                      # new columns in this pass
        self.write_slots = write_slots  # int64 [B*q], -1 = do not write
        self.n_new = n_new              # int64 [B], tokens reserved (committed after the last layer)
        self.new_mask = new_mask        # bool [B, q], which new columns are new tokens
        self.indptr = indptr            # CSR page table of the rows, for the gathers
        self.indices = indices
        self.lens = lens                # int32 [B], tokens per row after this pass
        self.dest = dest                # None, or int64 rows of the padded output per gathered token
        self.columns = columns          # columns after this pass
        self.groups = groups            # None, or a hf_windows.GroupStep per layer group
        self.q_indptr = None            # paged attention: int32 [B+1] real queries per row
        self.q_rows = None              # paged attention: None (every column) or int64 rows of [B*q]
        self.pending = None             # paged attention: int32 [B] new tokens read from the pass's K/V


class StepCalls:
    """Mixed into PagedCache (whose rows, columns and windows these methods share)."""

    kv: Any
    cache_salt: str | None
    seq_ids: list
    layers: list
    num_layers: int
    forward_tokens: int
    _plan: StepPlan | None
    _ticket: Any
    _states: StatePass | None
    _windows: list | None
    _pads: np.ndarray
    _columns: int
    _fresh: bool
    _holding: bool
    _implicit: bool
    _owned: set
    _reserved: np.ndarray | None
    _input_ids: Any

    if TYPE_CHECKING:     # PagedCache's own
        def _new_id(self) -> Any: ...
        def _replace_rows(self, order) -> None: ...

    def _write_only(self, key_states, value_states, layer_idx: int, plan, model_layer: int):
        """Paged attention: write the pass's K/V, hand the attention a ticket to the pages
        (``layer_idx``: the KV layer; ``model_layer``: the model's)."""
        self._check_ticket()
        B, H, q, D = key_states.shape
        self.kv.write(layer_idx, plan.write_slots, key_states.transpose(1, 2).reshape(B * q, H, D),
                      value_states.transpose(1, 2).reshape(B * q, H, D))
        self.layers[model_layer].is_initialized = True   # always our PagedLayer
        ticket = self._ticket = hf_attention.Ticket(self, layer_idx, plan, key_states, value_states)
        if self._states is None and layer_idx == self.num_layers - 1:
            self._finish_step()
        return hf_attention.tag(key_states, ticket), value_states

    def _check_ticket(self) -> None:
        ticket, self._ticket = self._ticket, None
        if ticket is not None and not ticket.taken:
            raise InvalidArgumentError(expected(
                "attn_implementation", f"'{hf_attention.NAME}' (hf_attention.register()) for a PagedCache with "
                "paged_attention=True", f"an attention that did not read layer {ticket.layer_idx}'s pages"))

    def paged_attend(self, ticket, query, scaling, soft_cap):
        """The attention of a ticket's layer over its pages: ``query`` ``[B, Hq, q, D]`` ->
        ``[B, q, Hq, D]`` (padding query columns get zeros). The pass's new tokens are
        read from the ticket's K/V as computed, the rest from the pages: what the gather
        path reads (one definition of what a read returns)."""
        plan = ticket.plan
        key, value, ticket.key, ticket.value = ticket.key, ticket.value, None, None
        B, Hq, q, D = query.shape
        # With layer groups, the layer's group's table: a sliding group lists the tokens
        # it still holds, from the first one its window needs, so positions are relative
        # to that token and the window mask (keys after p - W) reads the same.
        window = None
        table = plan
        groups = self.kv.config.layer_groups
        if plan.groups is not None and groups is not None:
            g = groups.layer_group[ticket.layer_idx]
            table = plan.groups[g]
            window = groups.groups[g].window or None
        tkey = id(table)
        if plan.q_indptr is None:
            plan.q_indptr, plan.q_rows, plan.pending = {}, {}, {}
        if tkey not in plan.q_indptr:
            nq = np.minimum(table.lens.cpu().numpy().astype(np.int64), q)
            qp = np.zeros(B + 1, dtype=np.int32)
            np.cumsum(nq, out=qp[1:])
            plan.q_indptr[tkey] = torch.from_numpy(qp).to(query.device)
            # the pass's new tokens are each row's last columns (a recomputed prefix hit is not one)
            plan.pending[tkey] = torch.from_numpy(np.minimum(plan.n_new, nq).astype(np.int32)).to(query.device)
            plan.q_rows[tkey] = None
            if (nq != q).any():
                rows = np.concatenate([b * q + np.arange(q - n, q) for b, n in enumerate(nq.tolist())])
                plan.q_rows[tkey] = torch.from_numpy(rows.astype(np.int64)).to(query.device)
        q_rows = plan.q_rows[tkey]
        flat = query.transpose(1, 2).reshape(B * q, Hq, D)
        H = key.shape[1]
        k_new = key.transpose(1, 2).reshape(B * q, H, D)
        v_new = value.transpose(1, 2).reshape(B * q, H, D)
        if q_rows is not None:
            flat, k_new, v_new = flat[q_rows], k_new[q_rows], v_new[q_rows]
        out = self.kv.attention(ticket.layer_idx, flat, table.indptr, table.indices, table.lens, plan.q_indptr[tkey],
                                k_new=k_new, v_new=v_new, pending=plan.pending[tkey], sm_scale=scaling,
                                soft_cap=soft_cap, window=window)
        if q_rows is None:
            return out.view(B, q, Hq, D)
        return out.new_zeros(B * q, Hq, D).index_copy_(0, q_rows, out).view(B, q, Hq, D)

    def _plan_step(self, B: int, q: int) -> None:
        if self._plan is not None:   # undone by update()'s handler before this reaches the caller
            raise InvalidArgumentError(expected(
                "forward", f"the previous forward pass to reach layer {self.num_layers - 1}",
                "a pass that stopped early (its reserved slots are given back)"))
        if not self.seq_ids:  # first pass without admit(): rows with unknown prompts
            ids = [self._new_id() for _ in range(B)]
            for i, sid in enumerate(ids):
                try:
                    self.kv.add_sequence(sid, cache_salt=self.cache_salt)
                except BaseException:
                    if i:
                        self.kv.free(ids[:i])
                    raise
            self.seq_ids = ids
            self._owned.update(ids)
            self._implicit = True
            self._pads = np.zeros(B, dtype=np.int64)
            self._columns = 0
        if self._fresh and B != len(self.seq_ids) and B % len(self.seq_ids) == 0:
            # generate() repeats each prompt for num_return_sequences / num_beams
            # before the first forward; mirror that with forks (shared prefix blocks).
            repeats = B // len(self.seq_ids)
            self._replace_rows([i for i in range(len(self.seq_ids)) for _ in range(repeats)])
            if self._states is not None:     # states the model read already follow the rows
                self._states.expand(repeats)
        self._fresh = False
        if B != len(self.seq_ids):
            raise ShapeError(expected("key_states", f"batch {len(self.seq_ids)} (the cache's rows)", B))
        kv, rows = self.kv, self.seq_ids
        if self._holding:     # rows created or replaced since the hold began
            kv.hold_window(rows, True)
        have = kv.seq_lens(rows, computed=True).astype(np.int64)
        positions = self._columns + np.arange(q)[None, :] - self._pads[:, None]   # [B, q]
        new_mask = positions >= have[:, None]
        n_new = new_mask.sum(axis=1).astype(np.int64)
        slots = kv.reserve(rows, n_new)
        self._reserved = n_new     # given back by _abort_step until the last layer commits
        if slots.ndim == 2:        # layer groups: one row of slots per group
            write_slots = np.full((slots.shape[0], B, q), -1, dtype=np.int64)
            write_slots[:, new_mask] = slots
        else:
            write_slots = np.full((B, q), -1, dtype=np.int64)
            write_slots[new_mask] = slots  # row-major: each row's new tokens are its last columns
        columns = self._columns + q
        lens = kv.seq_lens(rows).astype(np.int64)
        if (lens != columns - self._pads).any():
            raise InternalError(f"row lengths {lens.tolist()} disagree with columns {columns} - pads "
                                f"{self._pads.tolist()}")
        device = kv.device
        if self._windows is not None:
            self._plan = StepPlan(
                q, torch.from_numpy(write_slots.reshape(write_slots.shape[0], -1)).to(device), n_new, new_mask,
                None, None, None, None, columns,
                hf_windows.plan_groups_step(kv, rows, self._pads, self._columns, q, device))
            return
        indptr, indices, _ = kv.page_table_csr(rows)
        dest = None
        if self._pads.any():
            dest = torch.from_numpy(np.concatenate([b * columns + np.arange(self._pads[b], columns)
                                                    for b in range(B)]))
        self._plan = StepPlan(
            q, torch.from_numpy(write_slots.reshape(-1)).to(device), n_new, new_mask,
            torch.from_numpy(indptr).to(device), torch.from_numpy(indices).to(device),
            torch.from_numpy(lens.astype(np.int32)).to(device),
            None if dest is None else dest.to(device), columns)

    def _finish_step(self) -> None:
        plan = self._plan
        if plan is None:
            raise InternalError("a forward pass finished that layer 0 never planned: a bug")
        if self._states is not None:
            self._states.write(self.seq_ids)
        token_ids = None
        if self._input_ids is not None and tuple(self._input_ids.shape) == tuple(plan.new_mask.shape):
            token_ids = self._input_ids.cpu().numpy()[plan.new_mask]
        self.kv.commit(self.seq_ids, plan.n_new, token_ids)
        self._plan = self._reserved = self._input_ids = None
        self._implicit = False   # the rows' first pass is complete: they live until release
        self._columns = plan.columns
        self.forward_tokens += int(plan.n_new.sum())
