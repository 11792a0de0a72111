"""Per-layer views: what a data op takes instead of loose tensors.

A view is one layer of a store as the ops see it: the layer's format and its
tensors, checked against each other once (:meth:`LatentView.check`), so an op's
signature names the view, the tables and the inputs, never the parts of a format.

:class:`LatentView` is an MLA layer: a :class:`~pagedkv.store.latent.LatentFormat`
and its ``[num_blocks, block_size, row]`` arena view (the row carries its own scales).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedkv.errors import DTypeError, InvalidArgumentError, ShapeError, expected
from pagedkv.store import dtypes
from pagedkv.store.latent import LatentFormat

__all__ = ["LatentView"]


@dataclass(frozen=True)
class LatentView:
    """One MLA layer: its row ``format`` and ``data`` ``[num_blocks, block_size, row_elems]``
    (contiguous; the model dtype's elements, or uint8 bytes of a quantized row)."""

    format: LatentFormat
    data: torch.Tensor

    def check(self) -> None:
        """``data`` holds ``format``'s rows (typed errors naming what differs)."""
        f, t = self.format, self.data
        if not isinstance(f, LatentFormat):
            raise InvalidArgumentError(expected("view.format", "a LatentFormat", type(f).__name__))
        if not isinstance(t, torch.Tensor):
            raise DTypeError(expected("view.data", "a torch.Tensor", type(t).__name__))
        if t.dtype != f.storage_dtype:
            raise DTypeError(expected("view.data", f"dtype {f.storage_dtype} ({f.describe()})", t.dtype))
        if t.dim() != 3 or t.shape[2] != f.row_elems or 0 in tuple(t.shape[:2]):
            raise ShapeError(expected("view.data", f"[num_blocks, block_size, {f.row_elems}] ({f.describe()})",
                                      tuple(t.shape)))
        if not t.is_contiguous():
            raise InvalidArgumentError(expected("view.data", "a contiguous tensor", f"strides {t.stride()}"))

    @property
    def num_blocks(self) -> int:
        return int(self.data.shape[0])

    @property
    def block_size(self) -> int:
        return int(self.data.shape[1])

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def rows(self) -> torch.Tensor:
        """The arena as ``[num_slots, row_elems]`` (slot s is row s; no copy)."""
        return self.data.view(self.num_slots, self.format.row_elems)

    def format_dtype(self) -> torch.dtype:
        """The model dtype (what a read returns by default)."""
        return dtypes.info(self.format.model_dtype).torch_dtype
