"""The disk tier's sink and window rows: a model-precision section of each block record.

A quantized cache with ``kv_window`` or ``kv_sink_tokens`` keeps some blocks' rows in
model precision (:mod:`pagedkv.store.window`). The disk tier stores a block's rows in its
own record in ``blocks.bin``, after the codes and scales: ``[L, 2, bs, H, D]`` in the
model dtype, then a validity byte per layer and token (all zero: the block had none).

Inside the record, the rows are covered by the block's CRC-32 and sealed with it (the
data and the rows land, then the CRC, then the slot record): a crash leaves at worst an
empty slot, and damaged rows fail the block's check, a miss like damaged codes, never a
block served with other rows or without the ones it had. A warm restart reads them back
from the file: nothing about them lives only in memory.

The tier manager moves rows between this and a :class:`~pagedkv.store.window.RecentWindow`
(the device's, the host tier's) through :meth:`export_rows` / :meth:`import_rows`, the
same calls a sequence transfer uses.
"""
from __future__ import annotations

import numpy as np
import torch

__all__ = ["DiskRows", "rows_format"]


def rows_format(window) -> dict | None:
    """What a disk tier's rows must have been written for, from the store's window arena
    (None: no rows to keep, e.g. block keys' staging only, which no read overlays)."""
    if window is None or not (window.window or window.sink):
        return None
    shape = [window.data.shape[0]] + list(window.data.shape[2:])
    return {"kv_window": int(window.window), "kv_sink_tokens": int(window.sink),
            "dtype": str(window.data.dtype).replace("torch.", ""), "shape": shape}


class DiskRows:
    """Row views over a disk tier's records.

    Args:
        data: ``[capacity, L, 2, bs, H, D]`` (model dtype), a view of the records.
        valid: ``[capacity, L, bs]`` uint8, a view of the records.
        lock: the store window's lock (rows move between the two under it).
    """

    def __init__(self, data: torch.Tensor, valid: torch.Tensor, lock):
        self.data = data
        self.valid = valid
        self.lock = lock

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.valid.numel()

    def export_rows(self, slots: np.ndarray):
        """``(which, data, valid)`` like :meth:`RecentWindow.export_rows
        <pagedkv.store.window.RecentWindow.export_rows>`: ``which`` the positions in
        ``slots`` whose record holds a row, ``data`` ``[L, len(which), 2, bs, H, D]``,
        ``valid`` ``[L, len(which), bs]`` (bool). Read from the file's bytes as they are:
        the caller verified the records' CRC first."""
        s = torch.from_numpy(np.asarray(slots, dtype=np.int64))
        valid = self.valid[s].bool()
        which = torch.nonzero(valid.flatten(1).any(dim=1)).flatten()
        picked = s[which]
        return which.numpy(), self.data[picked].transpose(0, 1), valid[which].transpose(0, 1)

    def import_rows(self, slots: np.ndarray, data: torch.Tensor, valid: torch.Tensor) -> None:
        """Store ``data``/``valid`` (as :meth:`export_rows` gives them) in ``slots``' records."""
        if not len(slots):
            return
        s = torch.from_numpy(np.asarray(slots, dtype=np.int64))
        self.data[s] = data.transpose(0, 1).to(device="cpu", dtype=self.data.dtype)
        self.valid[s] = valid.transpose(0, 1).to(device="cpu", dtype=torch.uint8)

    def drop(self, slots: np.ndarray) -> None:
        """``slots``' records hold no rows (their data is zeroed too, so a record's bytes,
        and its CRC, depend on its content only)."""
        if not len(slots):
            return
        s = torch.from_numpy(np.asarray(slots, dtype=np.int64))
        self.data[s] = 0
        self.valid[s] = 0
