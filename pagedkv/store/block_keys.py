"""Block keys: a full block's keys requantized per channel (``kv_key_quant="block"``).

Keys have outlier channels, which per-token groups spread over every code of a row;
quantizing each channel over a block's tokens (KIVI's per-channel keys, aligned to the
paged block) halves int4's loss on SmolLM2 (README, "Low-bit KV"). A channel's range is
only known once the block is full, so every key is first written per token, as int4
always does, and its model-precision copy is kept in the window arena. A write that
fills a block *seals* it: its key codes are rewritten by
:func:`pagedkv.format.quant.quantize_key_block` from the exact keys (the write's own rows,
plus the window copies of the rows written before it, when the window still holds every
one: a prefill seals every block it writes whole, a decode step the block it finishes), and its bfloat16 per-channel scale and zero land
in the store's ``key_scale``/``key_zero`` arenas, whose nonzero scale tells the
gathers to read the block's keys per channel.

A block can only fill when its last row is written, and a sequence writes a block's
rows in order, so by then every row held was written by the block's current occupant
(a block that takes a new window slot starts with no row held). A block whose copies
left the window arena before it filled keeps its per-token keys: less accurate, never
wrong. (That happens to a block begun before a write that spans more blocks than the
window arena holds: the write's first layer gives the block's slot to newer blocks.) A write into a sealed block (a rollback, or a freed block taken by another
sequence) unseals it first: the live rows before the write are requantized per token,
from their window copies when held (exactly what a per-token write would have stored),
else from their per-channel values.

The parameter arenas travel with the codes through every block copy (copy-on-write,
host swap, prefix tiers, transfers), so a block is sealed wherever its bytes go.
"""
from __future__ import annotations

import numpy as np
import torch

from pagedkv import ops

__all__ = ["BlockKeys"]


class BlockKeys:
    """Seals and unseals the blocks of one :class:`~pagedkv.store.kvstore.KVStore` on write."""

    def __init__(self, store) -> None:
        self.store = store
        self.bs = store.config.block_size
        self.format = store.format     # int4 with key_quant="block": what the ops verify against
        ks = store.key_scale
        self._bits = ks.view(torch.int16).numpy() if ks.device.type == "cpu" else None

    def on_write(self, layer: int, view: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                 slots: np.ndarray, key: torch.Tensor) -> None:
        """After the per-token write and before the window takes this write's rows:
        unseal the sealed blocks it touched, then seal the blocks it finished (wrote
        their last row) from their exact keys: this write's own rows, and the window
        copies of the rows written before, when the window holds every one of them
        (``layer`` indexes the quantized arena; ``slots``: the write's slot mapping)."""
        rows = np.nonzero(slots >= 0)[0]
        if not len(rows):
            return
        s = slots[rows]
        blocks, offs = s // self.bs, s % self.bs
        order = np.lexsort((offs, blocks))
        b, o, r = blocks[order], offs[order], rows[order]
        head = np.empty(len(b), dtype=bool)
        head[0] = True
        np.not_equal(b[1:], b[:-1], out=head[1:])
        start = np.flatnonzero(head)
        end = np.append(start[1:], len(b))
        ids = b[start]
        sealed = self._sealed(layer, ids)
        if sealed.any():
            # rows before the write's first are live: they go back per token (none: only the seal goes)
            self._unseal(layer, view, scale, zero, ids[sealed], o[start][sealed])
        finished = o[end - 1] == self.bs - 1
        if not finished.any():
            return
        fin = ids[finished]
        keys = torch.empty((len(fin), self.bs) + tuple(key.shape[1:]), dtype=torch.float32, device=key.device)
        have = np.zeros((len(fin), self.bs), dtype=bool)
        window = self.store.window
        held = window.slot_of[fin] >= 0
        if held.any():
            data, valid = window.rows(layer, fin[held])
            keys[torch.from_numpy(np.flatnonzero(held)).to(key.device)] = data.to(device=key.device,
                                                                                  dtype=torch.float32)
            have[held] = valid.cpu().numpy()
        group = np.repeat(np.cumsum(finished) - 1, end - start)   # finished-block index per row
        mine = np.repeat(finished, end - start)
        gi, go = group[mine], o[mine]
        keys[torch.from_numpy(gi).to(key.device), torch.from_numpy(go).to(key.device)] = \
            key[torch.from_numpy(r[mine]).to(key.device)].to(torch.float32)
        have[gi, go] = True
        ok = have.all(axis=1)
        if ok.any():
            self._seal(layer, view, fin[ok], keys[torch.from_numpy(np.flatnonzero(ok)).to(key.device)])

    def _sealed(self, layer: int, blocks: np.ndarray) -> np.ndarray:
        """Whether each block's keys are per channel (its head 0 scale is nonzero; a
        block is sealed and unsealed whole)."""
        if self._bits is not None:     # the CPU arena's bfloat16 bits, read in place
            return (self._bits[layer, blocks, 0, 0] & 0x7FFF) != 0
        ks = self.store.key_scale[layer]
        return (ks[torch.from_numpy(blocks).to(ks.device), 0, 0] != 0).cpu().numpy()

    def _seal(self, layer: int, view: torch.Tensor, blocks: np.ndarray, keys: torch.Tensor) -> None:
        """Requantize ``blocks``' keys per channel from their exact ``keys`` ``[n, bs, H, D]``."""
        ops.seal_key_blocks(view, torch.from_numpy(blocks).to(view.device), keys, self.store.key_scale[layer],
                            self.store.key_zero[layer], layout=self.store.layout, layer_format=self.format)

    def _unseal(self, layer: int, view, scale, zero, blocks: np.ndarray, live: np.ndarray) -> None:
        """Requantize rows ``[0, live[i])`` of ``blocks[i]``'s keys per token (from their
        window copies where held), then clear the seals (one op call for the write)."""
        dev = view.device
        exact = valid = None
        window = self.store.window
        held = window.slot_of[blocks] >= 0
        if held.any() and live.any():
            data, ok = window.rows(layer, blocks[held])
            exact = torch.zeros((len(blocks),) + tuple(data.shape[1:]), dtype=data.dtype, device=data.device)
            valid = torch.zeros((len(blocks), self.bs), dtype=torch.bool, device=ok.device)
            where = torch.from_numpy(np.flatnonzero(held)).to(data.device)
            exact[where] = data
            valid[where.to(ok.device)] = ok
        kscale, kzero = self.store.key_scale[layer], self.store.key_zero[layer]
        ops.unseal_key_blocks(view, torch.from_numpy(blocks).to(dev), torch.from_numpy(live.astype(np.int64)).to(dev),
                              scale, zero, kscale, kzero, exact=exact, exact_valid=valid, layout=self.store.layout,
                              rotation_signs=self.store.rotation_signs, layer_format=self.format)
