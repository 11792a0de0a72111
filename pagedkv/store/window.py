"""The recent window: the newest tokens of each sequence, kept in model precision.

A quantized store writes every token twice: its codes go to the quantized arena (so a
token that leaves the window is already quantized, exactly as if it were quantized on
leaving), and its model-precision values go to a small window arena of whole blocks.
A gather reads a sequence's last ``window`` tokens from the window arena when their
block holds them there, and everything else from the quantized arena.

The window arena has ``window_blocks`` block slots, shared by all sequences. A block
gets a slot when it is written and keeps it until the slot is needed for a more
recently written block (least recently written first); the config sizes the arena for
``kv_window_sequences`` sequences' windows. A per-token validity mask makes a slot
answer only for tokens written since the block got it, so a reused block, a copied
block or a block loaded back from the host never shows stale values.

Attention sinks (``kv_sink_tokens``): a sequence's first blocks are *pinned* in the
arena when their tokens are reserved, so the least-recently-written rule never takes
them; at most ``pin_capacity`` slots are pinned, and pinning one more unpins the least
recently used. A read overlays a sequence's first ``sink`` tokens as it overlays its
last ``window`` tokens. A pin that outlives its sequence (the block freed and reused
elsewhere) only occupies a slot until it is the oldest: rows are valid only once
written since the slot was claimed, so no read ever gets another block's rows.

Claims follow what a sequence will read exactly: the manager marks blocks warm, soon
cold or cold (:meth:`RecentWindow.mark`; ``pagedkv.manager.lifecycle``): a reservation's
fresh blocks that lie wholly between the sinks and the newest ``window`` tokens are cold,
and so are blocks that left their sequence's window; a write gives a cold block only a
spare slot (a prefill of thousands of tokens claims its last blocks, not every block,
so it displaces no other sequence's window), and a claim takes free, then cold, then
soon-cold slots before the least recently written warm one. So up to ``kv_window_sequences`` sequences keep their sink and
recent rows exact (a pass that extends a sequence by several tokens reads its previous
window while it writes its next: it counts twice until it commits), and a read that
finds one of them gone (past that count, or a prefix hit whose block lost its slot)
counts a fallback (:attr:`RecentWindow.fallbacks`).

Threads: the slot map is shared by every sequence, so a write of one sequence's block
can take the slot another sequence's block is read from, and two claims at once can
give one slot to two blocks. Every method that reads or changes the slot map holds
:attr:`RecentWindow.lock` from the slot lookup to the last row it moves (the store
also holds it across a write's block-key seal, which reads window rows). The manager's
lock does not cover this: data calls (``write``, ``gather_pages``) run outside it, so
that sequences' KV moves in parallel.

The slot map lives on the host (numpy): it is bookkeeping, touched once per call.
"""
from __future__ import annotations

import functools
import threading

import numpy as np
import torch

from pagedkv.config.memory import arena_bytes, check_fits

__all__ = ["RecentWindow", "blocks_of_csr", "blocks_of_padded", "WARM", "SOON", "COLD"]

#: a block's mark (see RecentWindow.mark; pagedkv.manager.lifecycle repeats them, torch-free)
WARM, SOON, COLD = 0, 1, 2


def _locked(method):
    """Run ``method`` holding the window's lock (see the module docstring: Threads)."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)
    return run


class RecentWindow:
    """Window arena and block -> slot map for the quantized layers of one store.

    Args:
        num_layers: quantized layers (the arena's leading dim).
        num_blocks: blocks of the main arena (block ids are ``[0, num_blocks)``).
        capacity: window block slots.
        block_size, num_heads, head_dim: block geometry.
        window: tokens per sequence read from the window (``>= 0``).
        dtype, device: the model dtype and the arena device.
        sink: leading tokens per sequence read from the window (pinned blocks).
        pin_capacity: most slots pinned at once.
        lock: the re-entrant lock guarding the slot map (default: a new one). Windows
            that copy rows between them (a store's device and host windows) share one.
    """

    def __init__(self, num_layers: int, num_blocks: int, capacity: int, block_size: int, num_heads: int,
                 head_dim: int, window: int, dtype: torch.dtype, device: torch.device, sink: int = 0,
                 pin_capacity: int = 0, lock: threading.RLock | None = None):
        check_fits(device, RecentWindow.needs("kv_window", window, num_layers, num_blocks, capacity, block_size,
                                              num_heads, head_dim, dtype))
        self.lock = threading.RLock() if lock is None else lock
        self.window = window
        self.sink = sink
        self.pin_capacity = min(pin_capacity, capacity)
        self.pinned = np.zeros(capacity, dtype=bool)
        self.block_size = block_size
        self.capacity = capacity
        # NHD whatever the main layout: the window arena is internal
        self.data = torch.zeros((num_layers, capacity, 2, block_size, num_heads, head_dim), dtype=dtype,
                                device=device)
        self.valid = torch.zeros((num_layers, capacity, block_size), dtype=torch.bool, device=device)
        self.slot_of = np.full(num_blocks, -1, dtype=np.int64)
        # per block: WARM, SOON (read only by the pass in progress) or COLD (no read wants
        # its rows exact: a write claims no slot for it); see mark
        self.cold = np.zeros(num_blocks, dtype=np.int8)
        self.fallbacks = 0      # sequence reads (first quantized layer) that found a sink or recent row gone
        self.block_of = np.full(capacity, -1, dtype=np.int64)
        self.stamp = np.zeros(capacity, dtype=np.int64)
        self.clock = 0

    @staticmethod
    def needs(option: str, value, num_layers: int, num_blocks: int, capacity: int, block_size: int,
              num_heads: int, head_dim: int, dtype: torch.dtype):
        """Size-check entries (:mod:`pagedkv.config.memory`) of the arenas ``__init__``
        allocates: the data and validity arenas, and the slot maps (host arrays, counted
        with the device arenas: they are a small fraction of them)."""
        data = arena_bytes(option, value, (num_layers, capacity, 2, block_size, num_heads, head_dim), dtype.itemsize)
        valid = arena_bytes(option, value, (num_layers, capacity, block_size), 1)
        maps = arena_bytes(option, value, (num_blocks + 2 * capacity,), 8) + capacity
        return [(option, value, data + valid + maps)]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.valid.numel()

    # -- slot map -------------------------------------------------------------------

    def _claim(self, blocks: np.ndarray, pinned_ok: bool = False) -> None:
        """Give every block in ``blocks`` (distinct, oldest first) a slot, stamped in order.

        Pinned blocks keep theirs; the other blocks share the slots the pins leave, the
        oldest going without when there are too few. ``pinned_ok`` (:meth:`pin`): pinned
        slots may be taken too, least recently used first, after every unpinned one."""
        blocks = blocks[-self.capacity:]
        have = self.slot_of[blocks]
        if not pinned_ok and self.pinned.any():
            pin_held = np.zeros(len(blocks), dtype=bool)
            h = have >= 0
            pin_held[h] = self.pinned[have[h]]
            rest = np.nonzero(~pin_held)[0]
            room = self.capacity - int(self.pinned.sum())
            if len(rest) > room:
                sel = np.ones(len(blocks), dtype=bool)
                sel[rest[:len(rest) - room]] = False
                blocks, have = blocks[sel], have[sel]
        stamps = self.clock + 1 + np.arange(len(blocks))
        self.clock += len(blocks)
        keep = have >= 0
        self.stamp[have[keep]] = stamps[keep]
        need, stamps = blocks[~keep], stamps[~keep]
        if len(need):
            taken = np.zeros(self.capacity, dtype=bool)
            taken[have[keep]] = True
            # free slots first, then cold blocks' (no read wants their rows), then those only
            # a pass in progress reads, then the least recently written; pinned ones last
            held = self.block_of >= 0
            state = np.full(self.capacity, 3, dtype=np.int64)
            state[held] = self.cold[self.block_of[held]]
            c = self.clock + 1
            rank = self.stamp + np.where(self.pinned, c, 0) - np.select([state == 3, state == COLD, state == SOON],
                                                                         [3 * c, 2 * c, c], 0)
            order = np.argsort(np.where(taken, np.iinfo(np.int64).max, rank), kind="stable")
            slots = order[:len(need)]
            old = self.block_of[slots]
            self.slot_of[old[old >= 0]] = -1
            self.block_of[slots] = need
            self.slot_of[need] = slots
            self.stamp[slots] = stamps
            self.pinned[slots] = False
            self.valid[:, torch.from_numpy(slots).to(self.valid.device)] = False

    def _spare(self, blocks: np.ndarray) -> None:
        """Give cold ``blocks`` (distinct) slots that no read needs: free ones, then other
        cold blocks' (least recently written first); never a warm or pinned block's. A
        cold block that holds a slot keeps it, unstamped. So a prefix that a later
        sequence hits finds its copies when the arena had room for them."""
        need = blocks[self.slot_of[blocks] < 0]
        if not len(need):
            return
        held = self.block_of >= 0
        spare = ~held & ~self.pinned
        spare[held] = (self.cold[self.block_of[held]] == COLD) & ~self.pinned[held]
        spare[self.slot_of[blocks[self.slot_of[blocks] >= 0]]] = False
        cand = np.nonzero(spare)[0]
        if not len(cand):
            return
        cand = cand[np.argsort(np.where(held[cand], self.stamp[cand], -1), kind="stable")][:len(need)]
        need = need[-len(cand):]
        old = self.block_of[cand]
        self.slot_of[old[old >= 0]] = -1
        self.block_of[cand] = need
        self.slot_of[need] = cand
        self.clock += 1
        self.stamp[cand] = self.clock
        self.valid[:, torch.from_numpy(cand).to(self.valid.device)] = False

    @_locked
    def pin(self, blocks: np.ndarray, held_only: bool = False) -> None:
        """Keep ``blocks`` (a sequence's first blocks, distinct) in the arena: claim a slot
        for each and pin it; beyond ``pin_capacity`` the least recently used pins are
        released. The blocks' rows are held from their next write on. ``held_only``:
        pin only blocks that hold a slot already (a prefix hit's blocks: a new slot would
        hold none of their rows)."""
        blocks = np.asarray(blocks, dtype=np.int64)
        blocks = blocks[blocks >= 0]
        if held_only:
            blocks = blocks[self.slot_of[blocks] >= 0]
        blocks = blocks[-self.pin_capacity:] if self.pin_capacity else blocks[:0]
        if not len(blocks):
            return
        self._claim(blocks, pinned_ok=True)
        self.pinned[self.slot_of[blocks]] = True
        over = int(self.pinned.sum()) - self.pin_capacity
        if over > 0:
            mine = np.zeros(self.capacity, dtype=bool)
            mine[self.slot_of[blocks]] = True
            cand = np.nonzero(self.pinned & ~mine)[0]
            self.pinned[cand[np.argsort(self.stamp[cand], kind="stable")[:over]]] = False

    @_locked
    def mark(self, blocks: np.ndarray, state: np.ndarray | int) -> None:
        """Say what reads want ``blocks``' rows exact (the manager knows the sequences):
        :data:`WARM` (a sequence's sinks or newest ``window`` tokens, now or after the
        pass in progress), :data:`SOON` (only the pass in progress: its sequence's
        previous window) or :data:`COLD` (none). A write claims no slot for a cold block;
        when slots run short, cold blocks give theirs first, then those read only by a
        pass in progress, then the least recently written. A block that holds a slot
        keeps it and its rows whatever its mark until a claim takes it."""
        self.cold[blocks] = state

    @_locked
    def drop(self, blocks: np.ndarray) -> None:
        """Forget the window copies of ``blocks`` (their data was replaced by other means).
        A pinned block keeps its slot and pin, with no row held: it is still its
        sequence's first block, and its next rows (a transfer's, a rewrite's) belong there."""
        blocks = np.asarray(blocks, dtype=np.int64)
        slots = self.slot_of[blocks]
        slots = slots[slots >= 0]
        if len(slots):
            free = slots[~self.pinned[slots]]
            self.slot_of[self.block_of[free]] = -1
            self.block_of[free] = -1
            self.stamp[free] = 0
            self.valid[:, torch.from_numpy(slots).to(self.valid.device)] = False

    @_locked
    def copy(self, src: np.ndarray, dst: np.ndarray, source: RecentWindow | None = None) -> None:
        """Block copies: ``dst[i]`` gets the window copy of ``src[i]`` in ``source`` (default:
        this window; copy-on-write), or none when ``src[i]`` has none there. ``source`` may
        be another window (the host tier's) with the same geometry."""
        source = self if source is None else source
        with source.lock:       # the same lock for a store's two windows
            self._copy(src, dst, source)

    def _copy(self, src: np.ndarray, dst: np.ndarray, source: RecentWindow) -> None:
        self.drop(dst)
        has = source.slot_of[src] >= 0
        if not has.any():
            return
        src, dst = src[has], dst[has]
        pins = dst[source.pinned[source.slot_of[src]]]     # a copied sink block stays pinned
        if source is self:
            self._claim(_distinct_by_last(np.concatenate([src, dst])))  # dst stamped newest
        else:
            self._claim(_distinct_by_last(dst))
        if len(pins):
            self.pin(_distinct_by_last(pins))
        both = (source.slot_of[src] >= 0) & (self.slot_of[dst] >= 0)
        src, dst = src[both], dst[both]
        s = torch.from_numpy(source.slot_of[src]).to(source.data.device)
        d = torch.from_numpy(self.slot_of[dst]).to(self.data.device)
        self.data[:, d] = source.data[:, s].to(self.data.device)
        self.valid[:, d] = source.valid[:, s].to(self.valid.device)

    @_locked
    def export_rows(self, blocks: np.ndarray):
        """The window copies of ``blocks``, for another process's window (a sequence
        handoff): ``(which, data, valid)`` with ``which`` the positions in ``blocks`` that
        have one, ``data`` ``[L, len(which), 2, bs, H, D]`` and ``valid`` ``[L, len(which), bs]``."""
        slots = self.slot_of[np.asarray(blocks, dtype=np.int64)]
        which = np.nonzero(slots >= 0)[0]
        s = torch.from_numpy(slots[which]).to(self.data.device)
        return which, self.data[:, s], self.valid[:, s]

    @_locked
    def import_rows(self, blocks: np.ndarray, data: torch.Tensor, valid: torch.Tensor) -> None:
        """Give ``blocks`` (distinct, oldest first) the window copies ``data``/``valid``
        that :meth:`export_rows` produced elsewhere; with fewer slots than blocks the
        newest keep theirs."""
        blocks = np.asarray(blocks, dtype=np.int64)
        if not len(blocks):
            return
        self.drop(blocks)
        self._claim(blocks)
        slots = self.slot_of[blocks]
        held = np.nonzero(slots >= 0)[0]
        d = torch.from_numpy(slots[held]).to(self.data.device)
        h = torch.from_numpy(held).to(data.device)
        self.data[:, d] = data[:, h].to(device=self.data.device, dtype=self.data.dtype)
        self.valid[:, d] = valid[:, h].to(device=self.valid.device, dtype=torch.bool)

    # -- data -------------------------------------------------------------------------

    @_locked
    def write(self, layer: int, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              slots: np.ndarray | None = None) -> None:
        """Keep the model-precision K/V of the written tokens (slots < 0 skipped).

        Every layer claims the same blocks (an engine writes the same slots in each
        layer), so the claim after the first layer of a step only refreshes stamps.
        ``slots``: ``slot_mapping`` as numpy, when the caller has it already."""
        slots = slot_mapping.cpu().numpy() if slots is None else slots
        ok = np.nonzero(slots >= 0)[0]
        if not len(ok):
            return
        blocks = slots[ok] // self.block_size
        # warm blocks, and the partly written block a pass completes (its earlier rows:
        # this pass's reads, the block keys' seal), claim and refresh slots; cold ones
        # take spare slots only
        cold = self.cold[blocks] == COLD
        n_cold = np.count_nonzero(cold)
        if n_cold < len(blocks):
            self._claim(_distinct_by_last(blocks[~cold] if n_cold else blocks))
        if n_cold:
            self._spare(_distinct_by_last(blocks[cold]))
        wslot = self.slot_of[blocks]
        held = wslot >= 0
        if not held.any():
            return
        dev = self.data.device
        rows = torch.from_numpy(ok[held]).to(dev)
        ws = torch.from_numpy(wslot[held]).to(dev)
        off = torch.from_numpy(slots[ok][held] % self.block_size).to(dev)
        self.data[layer, ws, 0, off] = key[rows].to(self.data.dtype)
        self.data[layer, ws, 1, off] = value[rows].to(self.data.dtype)
        self.valid[layer, ws, off] = True

    @_locked
    def full_blocks(self, layer: int, blocks: np.ndarray) -> np.ndarray:
        """Those of ``blocks`` (distinct) whose every row is held for ``layer``."""
        ws = self.slot_of[blocks]
        held = ws >= 0
        if not held.any():
            return blocks[:0]
        full = self.valid[layer, torch.from_numpy(ws[held]).to(self.valid.device)].all(dim=-1).cpu().numpy()
        return blocks[held][full]

    @_locked
    def rows(self, layer: int, blocks: np.ndarray, kv: int = 0):
        """``(data, valid)`` of held ``blocks`` for ``layer``: ``[n, bs, H, D]`` and ``[n, bs]``."""
        ws = torch.from_numpy(self.slot_of[blocks]).to(self.data.device)
        return self.data[layer, ws, kv], self.valid[layer, ws]

    @_locked
    def overlay(self, layer: int, blocks_per_seq, seq_lens: np.ndarray, key: torch.Tensor,
                value: torch.Tensor, pending: np.ndarray | None = None, transform=None,
                sink: int | None = None) -> None:
        """Overwrite, in gathered ``key``/``value`` ``[sum(seq_lens), H, D]``, each
        sequence's first ``sink`` and last ``window`` tokens that the window arena holds.

        ``blocks_per_seq(b)`` returns sequence ``b``'s block ids (numpy int64).
        ``pending[b]``: sequence ``b``'s trailing tokens that are not written yet (the
        caller holds them in flight); the window is then the ``window`` tokens before
        them, which the arena still holds because the pass has not written over them.
        ``transform``: applied to the window rows first (a read in the rotated domain).
        ``sink``: the sink tokens these tables start with, when not :attr:`sink` (a
        sliding-window group's tables release their first blocks: only the sink blocks
        it keeps, if any, are its first rows)."""
        rows, wsl, offs, wanted = [], [], [], []
        base = 0
        ends = seq_lens if pending is None else seq_lens - pending
        sinks = []
        for b, (n, end) in enumerate(zip(seq_lens.tolist(), ends.tolist())):
            table = blocks_per_seq(b)
            pos, head = self._exact_positions(end, sink)
            if len(pos):
                if head and layer == 0:
                    sinks.append(table[:(head - 1) // self.block_size + 1])
                ws = self.slot_of[table[pos // self.block_size]]
                held = ws >= 0
                rows.append(base + pos[held])
                wsl.append(ws[held])
                offs.append(pos[held] % self.block_size)
                wanted.append(len(pos))
            base += n
        if sinks:       # pins in use stay the most recently used (once per pass: at layer 0)
            first = np.concatenate(sinks)
            ws = self.slot_of[first[first >= 0]]
            ws = ws[ws >= 0]
            ws = ws[self.pinned[ws]]
            self.clock += 1
            self.stamp[ws] = self.clock
        if not rows:
            return
        dev = self.data.device
        ws = torch.from_numpy(np.concatenate(wsl)).to(dev)
        off = torch.from_numpy(np.concatenate(offs)).to(dev)
        ok = self.valid[layer, ws, off]
        if layer == 0:      # once per pass: a fallback of one sequence's read (see the module)
            self._count(wanted, [len(x) for x in rows], ok)
        rows_np = np.concatenate(rows)
        if not len(rows_np):
            return
        r = torch.from_numpy(rows_np).to(key.device)[ok]
        ws, off = ws[ok], off[ok]
        wk, wv = self.data[layer, ws, 0, off], self.data[layer, ws, 1, off]
        if transform is not None:
            wk, wv = transform(wk), transform(wv)
        key[r] = wk.to(key.dtype)
        value[r] = wv.to(value.dtype)

    def _exact_positions(self, end: int, sink: int | None = None) -> tuple[np.ndarray, int]:
        """A sequence's positions read from the window arena when it holds ``end``
        written tokens: its first ``sink`` not already among its newest ``window``, then
        those; and how many of the first are sink positions."""
        lo = max(0, end - self.window)
        head = min(self.sink if sink is None else sink, lo)     # the sinks not already in the recent window
        pos = np.arange(lo, end, dtype=np.int64)
        if head:
            pos = np.concatenate([np.arange(head, dtype=np.int64), pos])
        return pos, head

    def _count(self, wanted: list[int], held: list[int], ok: torch.Tensor) -> None:
        """Count the sequences that wanted ``wanted[b]`` exact rows and found fewer valid
        ones (``ok``: the validity of their ``held[b]`` held rows, concatenated)."""
        found = ok.cpu().numpy()
        at = 0
        for w, h in zip(wanted, held):
            if int(found[at:at + h].sum()) < w:
                self.fallbacks += 1
            at += h

    @_locked
    def count_fallbacks(self, blocks_per_seq, seq_lens: np.ndarray, sink: int | None = None) -> None:
        """Count the fallbacks of a read that another path makes (paged attention reads
        the rows itself, from :attr:`data`): as :meth:`overlay` counts them at layer 0."""
        wanted, held, oks = [], [], []
        for b, end in enumerate(seq_lens.tolist()):
            pos, _ = self._exact_positions(end, sink)
            if not len(pos):
                continue
            ws = self.slot_of[blocks_per_seq(b)[pos // self.block_size]]
            keep = ws >= 0
            wanted.append(len(pos))
            held.append(int(keep.sum()))
            oks.append(self.valid[0, torch.from_numpy(ws[keep]).to(self.valid.device),
                                  torch.from_numpy(pos[keep] % self.block_size).to(self.valid.device)])
        if wanted:
            self._count(wanted, held, torch.cat(oks))

    @_locked
    def touch_sinks(self, indptr, indices, seq_lens, sink: int | None = None) -> None:
        """A read of these sequences' rows in place (paged attention through the exact
        rows) used their pinned sink blocks: they become the most recently used, as
        :meth:`overlay` makes them for a gather (once per pass). ``sink``: as for
        :meth:`overlay`."""
        ptr, idx = (np.asarray(t.cpu() if hasattr(t, "cpu") else t) for t in (indptr, indices))
        lens = np.asarray(seq_lens.cpu() if hasattr(seq_lens, "cpu") else seq_lens).astype(np.int64)
        heads = np.minimum(self.sink if sink is None else sink, np.maximum(lens - self.window, 0))
        first = [idx[ptr[b]:ptr[b] + (n - 1) // self.block_size + 1] for b, n in enumerate(heads.tolist()) if n]
        if first:
            ws = self.slot_of[np.concatenate(first).astype(np.int64)]
            ws = ws[ws >= 0]
            self.clock += 1
            self.stamp[ws[self.pinned[ws]]] = self.clock

    @_locked
    def held(self, block: int) -> int | None:
        """The window slot of ``block`` (None when it has none)."""
        s = int(self.slot_of[block])
        return None if s < 0 else s

    @_locked
    def __len__(self) -> int:
        return int((self.block_of >= 0).sum())


def _distinct_by_last(blocks: np.ndarray) -> np.ndarray:
    """Distinct ids of ``blocks``, ordered by their last occurrence."""
    rev = blocks[::-1]
    _, first = np.unique(rev, return_index=True)
    return rev[np.sort(first)][::-1].copy()


def blocks_of_csr(indptr: np.ndarray, indices: np.ndarray):
    return lambda b: indices[indptr[b]:indptr[b + 1]].astype(np.int64)


def blocks_of_padded(table: np.ndarray):
    return lambda b: table[b].astype(np.int64)
