"""One block payload: what a block is at rest, the unit every tier moves.

A block's payload is a list of typed *sections*, one record of ``record_bytes`` bytes
(each section 64-byte aligned):

- one ``arena`` section per store arena, in the store's order: the codes (or model
  precision data), then quantization scales, zero points, block keys, whatever arenas
  the store has, each ``[num_layers, *per_block_shape]``;
- with model-precision sink and window rows (a quantized cache with ``kv_window`` or
  ``kv_sink_tokens``): a ``rows`` section ``[L, 2, bs, H, D]`` in the model dtype and a
  ``rows_valid`` section ``[L, bs]`` (a byte per layer and token; all zero: none held).

A kind of data a layer group keeps (a latent row, a recurrent-state snapshot) is one
more section, not a branch: every mover copies sections, and the CRC covers the whole
record. The disk tier's ``blocks.bin`` is an array of these records; a remote value is
one record behind a header (:mod:`pagedkv.tiers.remote_wire`).

:class:`Blocks` names where a batch of payloads lives for a copy (the device store,
a tier's arenas, a batch of records) so one function moves data and rows between any
two of them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from pagedkv.store.window import RecentWindow
from pagedkv.tiers.disk_rows import DiskRows
from pagedkv.tiers.verify import checksum

__all__ = ["Section", "PayloadLayout", "Payloads", "Blocks", "move_rows", "record_crc"]

ALIGN = 64


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


@dataclass(frozen=True)
class Section:
    """One typed part of a block's record."""

    kind: str                     # "arena", "rows", "rows_valid" (a new kind of data: a new kind here)
    offset: int                   # bytes from the record's start (64-aligned)
    dtype: torch.dtype
    shape: tuple[int, ...]        # per block

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * _itemsize(self.dtype)


class PayloadLayout:
    """The sections of one block's record (see the module docstring).

    Args:
        parts: ``(kind, dtype, per-block shape)`` in record order.
    """

    def __init__(self, parts: list[tuple[str, torch.dtype, tuple[int, ...]]]):
        sections, offset = [], 0
        for kind, dtype, shape in parts:
            s = Section(kind, offset, dtype, tuple(int(x) for x in shape))
            sections.append(s)
            offset = _aligned(offset + s.nbytes)
        self.sections: list[Section] = sections
        # a model without attention layers (pure Mamba2) still keeps its blocks' tokens on
        # a tier: their records hold no data, but a file of empty records cannot be mapped
        self.record_bytes = max(offset, ALIGN)

    @classmethod
    def of(cls, store_arenas: list[torch.Tensor], rows=None) -> PayloadLayout:
        """The layout of blocks shaped like ``store_arenas`` (``[L, num_blocks, ...]``)
        with the rows a window arena ``rows`` keeps (None, or one keeping none: no rows)."""
        parts: list[tuple[str, torch.dtype, tuple[int, ...]]] = [
            ("arena", a.dtype, (a.shape[0],) + tuple(a.shape[2:])) for a in store_arenas]
        if rows is not None and (rows.window or rows.sink):
            shape = (rows.data.shape[0],) + tuple(rows.data.shape[2:])
            parts.append(("rows", rows.data.dtype, shape))
            parts.append(("rows_valid", torch.uint8, (shape[0], shape[2])))
        return cls(parts)

    def section(self, kind: str) -> Section | None:
        return next((s for s in self.sections if s.kind == kind), None)

    @property
    def arena_sections(self) -> list[Section]:
        return [s for s in self.sections if s.kind == "arena"]

    @property
    def rows_bytes(self) -> int:
        """Bytes of a record from its rows on (0 without rows)."""
        s = self.section("rows")
        return self.record_bytes - s.offset if s is not None else 0

    def describe(self) -> list[list[Any]]:
        """A JSON-able description (part of a remote tier's fingerprint)."""
        return [[s.kind, s.offset, str(s.dtype).replace("torch.", ""), list(s.shape)] for s in self.sections]

    def over(self, base: torch.Tensor, lock=None) -> Payloads:
        """Payloads over ``base``, ``[n, record_bytes]`` uint8 (a file's map, a buffer)."""
        return Payloads(self, base, lock)

    def empty(self, n: int, *, pin: bool = False, lock=None) -> Payloads:
        """``n`` zeroed records, their pages touched now (a buffer meant for reuse: the
        kernel's first-touch faults cost far more than the copies that follow)."""
        base = torch.empty((n, self.record_bytes), dtype=torch.uint8, pin_memory=pin)
        base.fill_(0)
        return Payloads(self, base, lock)


class Payloads:
    """``n`` block payloads in one ``[n, record_bytes]`` byte tensor.

    Attributes:
        arenas: per arena section, ``[L, n, ...]`` views shaped like the store's arenas.
        records: per arena section, ``[n, bytes]`` views (one block's bytes, all layers).
        window: the rows sections as a :class:`~pagedkv.tiers.disk_rows.DiskRows`, or None.
    """

    def __init__(self, layout: PayloadLayout, base: torch.Tensor, lock=None):
        n = base.shape[0]
        self.layout, self.base, self.n = layout, base, n
        self.arenas: list[torch.Tensor] = []
        self.records: list[torch.Tensor] = []
        for s in layout.arena_sections:
            view = base[:, s.offset:s.offset + s.nbytes]
            self.records.append(view)
            self.arenas.append(view.view(s.dtype).view((n,) + s.shape).transpose(0, 1))
        self.window: DiskRows | None = None
        rows, valid = layout.section("rows"), layout.section("rows_valid")
        if rows is not None and valid is not None:
            data = base[:, rows.offset:rows.offset + rows.nbytes].view(rows.dtype).view((n,) + rows.shape)
            flags = base[:, valid.offset:valid.offset + valid.nbytes].view((n,) + valid.shape)
            self.window = DiskRows(data, flags, lock)

    # A block's bytes are contiguous here and strided (one run per layer) in an arena:
    # one copy per block and arena beats a gather over strided views.
    def read(self, ids, dst_arenas: list[torch.Tensor], dst_blocks) -> None:
        """Copy the data sections of records ``ids`` into blocks ``dst_blocks`` of ``dst_arenas``."""
        for a, dst in enumerate(dst_arenas):
            for i, b in zip(ids, dst_blocks):
                part = _bytes(dst[:, b])
                part.copy_(self.records[a][i].view(part.shape))

    def write(self, src_arenas: list[torch.Tensor], src_blocks, ids) -> None:
        """Copy blocks ``src_blocks`` of ``src_arenas`` into the data sections of records ``ids``."""
        for a, src in enumerate(src_arenas):
            for b, i in zip(src_blocks, ids):
                part = _bytes(src[:, b])
                self.records[a][i].view(part.shape).copy_(part)

    def record(self, i: int) -> np.ndarray:
        """Record ``i``'s bytes (a view)."""
        return self.base[i].numpy()

    def crc(self, i: int) -> int:
        return record_crc(self.record(i))


class Blocks(NamedTuple):
    """Where a batch of block payloads lives for a copy: the arenas (store-shaped,
    ``[L, n, ...]``), the rows (a :class:`~pagedkv.store.window.RecentWindow`, a
    :class:`~pagedkv.tiers.disk_rows.DiskRows`, or None: rows are neither kept nor
    given) and the lock every rows copy takes (the store window's)."""

    arenas: list[torch.Tensor]
    window: Any
    lock: Any


def move_rows(src: Blocks, dst: Blocks, pairs) -> None:
    """The sink and window rows that go with block copies ``(src id, dst id)``: model
    precision, so a moved block reads them as it would have in place. A side that keeps
    no rows gives or takes none (the destination's earlier rows for those ids are
    dropped all the same)."""
    to = dst.window
    if to is None:
        return
    p = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
    source = src.window
    if source is None:
        to.drop(p[:, 1])
    elif isinstance(to, RecentWindow) and isinstance(source, RecentWindow):
        to.copy(p[:, 0], p[:, 1], source=source)     # two window arenas of one store
    else:                  # records keep rows in place: moved as a transfer moves them
        with src.lock if src.lock is not None else _nolock():
            which, data, valid = source.export_rows(p[:, 0])
            to.drop(p[:, 1])
            to.import_rows(p[which, 1], data, valid)


class _nolock:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def record_crc(record) -> int:
    """The CRC-32 of a record's bytes (every section): :func:`pagedkv.tiers.verify.checksum`."""
    return int.from_bytes(checksum((record,)), "little")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The same memory as bytes (the last dim widened), so any dtype copies as bytes."""
    return t.view(torch.uint8)
