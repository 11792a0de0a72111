"""Block keys: a full block's keys requantized per channel (``kv_key_quant="block"``).

Keys have outlier channels, which per-token groups spread over every code of a row;
quantizing each channel over a block's tokens (KIVI's per-channel keys, aligned to the
paged block) halves int4's loss on SmolLM2 (README, "Low-bit KV"). A channel's range is
only known once the block is full, so every key is first written per token, as int4
always does, and its model-precision copy is kept in the window arena. When a write
leaves a block with all ``block_size`` rows held there, the block is *sealed*: its key
codes are rewritten from those copies by :func:`pagedkv.quant.quantize_key_block`, and
its bfloat16 per-channel scale and zero land in the store's ``key_scale``/``key_zero``
arenas, whose nonzero scale tells the gathers to read the block's keys per channel.

A block can only fill when its last row is written, and a sequence writes a block's
rows in order, so by then every row held was written by the block's current occupant
(a block that takes a new window slot starts with no row held). A block whose copies
left the window arena before it filled keeps its per-token keys: less accurate, never
wrong. A write into a sealed block (a rollback, or a freed block taken by another
sequence) unseals it first: the live rows before the write are requantized per token,
from their window copies when held (exactly what a per-token write would have stored),
else from their per-channel values.

The parameter arenas travel with the codes through every block copy (copy-on-write,
host swap, prefix tiers, transfers), so a block is sealed wherever its bytes go.
"""
from __future__ import annotations

import numpy as np
import torch

from pagedkv.ops.reference import _assign, _plane
from pagedkv.quant import dequantize_key_channels, quantize, quantize_key_block
from pagedkv.rotation import rotate

__all__ = ["BlockKeys"]


class BlockKeys:
    """Seals and unseals the blocks of one :class:`~pagedkv.store.KVStore` on write."""

    def __init__(self, store) -> None:
        self.store = store
        self.bs = store.config.block_size
        self.group = store.config.kv_group_size
        ks = store.key_scale
        self._bits = ks.view(torch.int16).numpy() if ks.device.type == "cpu" else None

    def after_write(self, layer: int, view: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                    slots: np.ndarray) -> None:
        """Unseal the sealed blocks this write touched, then seal the blocks it filled
        (``layer`` indexes the quantized arena; ``slots``: the write's slot mapping)."""
        slots = slots[slots >= 0]
        if not len(slots):
            return
        blocks, first, last = _offset_range(slots, self.bs)
        sealed = self._sealed(layer, blocks)
        for b, m in zip(blocks[sealed].tolist(), first[sealed].tolist()):
            self._unseal(layer, view, scale, zero, b, m)
        filled = blocks[last == self.bs - 1]
        if len(filled):
            full = self.store.window.full_blocks(layer, filled)
            if len(full):
                self._seal(layer, view, full)

    def _sealed(self, layer: int, blocks: np.ndarray) -> np.ndarray:
        """Whether each block's keys are per channel (its head 0 scale is nonzero; a
        block is sealed and unsealed whole)."""
        if self._bits is not None:     # the CPU arena's bfloat16 bits, read in place
            return (self._bits[layer, blocks, 0, 0] & 0x7FFF) != 0
        ks = self.store.key_scale[layer]
        return (ks[torch.from_numpy(blocks).to(ks.device), 0, 0] != 0).cpu().numpy()

    def _seal(self, layer: int, view: torch.Tensor, blocks: np.ndarray) -> None:
        keys, _ = self.store.window.rows(layer, blocks)
        codes, s, z = quantize_key_block(keys)
        blk = torch.from_numpy(blocks).to(view.device)
        if self.store.layout == "HND":
            codes = codes.transpose(1, 2)          # [n, H, bs, D / 2]
        view[blk, 0] = codes
        self.store.key_scale[layer, blk] = s
        self.store.key_zero[layer, blk] = z

    def _unseal(self, layer: int, view, scale, zero, block: int, live: int) -> None:
        """Requantize rows ``[0, live)`` of ``block``'s keys per token, then clear its seal."""
        kscale, kzero = self.store.key_scale[layer], self.store.key_zero[layer]
        if live:
            dev = view.device
            blk = torch.full((live,), block, dtype=torch.int64, device=dev)
            off = torch.arange(live, device=dev)
            keys = dequantize_key_channels(_plane(view, self.store.layout, 0, blk, off), kscale[block],
                                           kzero[block], torch.float32)
            window = self.store.window
            if window.held(block) is not None:
                exact, valid = window.rows(layer, np.array([block]))
                ok = valid[0, :live].to(dev)
                keys[ok] = exact[0, :live][ok].to(device=dev, dtype=torch.float32)
            if self.store.rotation_signs is not None:
                keys = rotate(keys, self.store.rotation_signs)
            q, s, z = quantize(keys, "int4", group_size=self.group)
            _assign(view, self.store.layout, 0, blk, off, q)
            _assign(scale, self.store.layout, 0, blk, off, s)
            _assign(zero, self.store.layout, 0, blk, off, z)
        kscale[block] = 0
        kzero[block] = 0


def _offset_range(slots: np.ndarray, bs: int):
    """Distinct blocks of ``slots``, with the lowest and highest offset written to each."""
    blocks = slots // bs
    offs = slots - blocks * bs
    order = np.lexsort((offs, blocks))
    b, o = blocks[order], offs[order]
    head = np.ones(len(b), dtype=bool)
    head[1:] = b[1:] != b[:-1]
    tail = np.ones(len(b), dtype=bool)
    tail[:-1] = head[1:]
    return b[head].astype(np.int64), o[head].astype(np.int64), o[tail].astype(np.int64)
