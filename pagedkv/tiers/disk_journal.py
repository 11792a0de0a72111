"""The disk tier's journal: which slots changed, so a process that looked before pays
for what changed since, not for the directory.

``journal.bin`` is a 16-byte header (``b"PKVJ"``, version, a random 64-bit epoch) and
then one little-endian int64 per change, appended *before* the change reaches the
slot index (write-ahead): a slot id, :data:`NAMESPACES` (``namespaces.json`` grew) or
:data:`GROWN` (the files grew). Every append happens under the directory's lock.

A reader remembers ``(epoch, offset)``. Taking the lock again it reads the entries
past its offset and re-checks just those slots. Another epoch (the journal was
restarted: it grew past its bound, or the tier was cleared), a journal shorter than
the offset, far more new entries than writers let it hold, or a header it cannot read
means "anything may have changed": a full check, as at a first open. Entries are
never trusted beyond naming slots to re-check: an id out of range is ignored, and a
named slot is checked like a first open checks it. A torn last entry (a writer killed mid-append) is ignored;
its slot's record was not changed yet (write-ahead), or it is the valid-byte-last
seal of :mod:`pagedkv.tiers.disk`, which a reader's checks cover.
"""
from __future__ import annotations

import os
import secrets
import struct
import weakref

import numpy as np

from pagedkv.tiers.tierdir import TierDir, storage_error

__all__ = ["Journal", "NAMESPACES", "GROWN", "NAME"]

NAME = "journal.bin"
NAMESPACES = -1
GROWN = -2
_HEADER = struct.Struct("<4sIQ")
_MAGIC = b"PKVJ"
_VERSION = 1


class Journal:
    """The journal of one open tier (see the module docstring).

    Args:
        tierdir: the tier's directory.
        max_entries: past this many entries the next :meth:`restart` check restarts it.
    """

    def __init__(self, tierdir: TierDir, max_entries: int):
        self.dir = tierdir
        self.max_entries = max_entries
        self.fd = tierdir.open(NAME, os.O_RDWR, create=True)
        self._close = weakref.finalize(self, os.close, self.fd)      # also when dropped unclosed
        self.epoch, self.offset = self._header(), _HEADER.size
        if self.epoch is None:
            self.restart()
        else:                                          # a first open checks everything anyway
            self.offset = self._aligned(os.fstat(self.fd).st_size)

    def _header(self) -> int | None:
        raw = os.pread(self.fd, _HEADER.size, 0)
        if len(raw) != _HEADER.size:
            return None
        magic, version, epoch = _HEADER.unpack(raw)
        return epoch if magic == _MAGIC and version == _VERSION else None

    def restart(self) -> None:
        """A new, empty journal with a new epoch (readers then check everything)."""
        self.epoch = int.from_bytes(secrets.token_bytes(8), "little")
        try:
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, _HEADER.pack(_MAGIC, _VERSION, self.epoch), 0)
        except OSError as e:
            raise storage_error(self.dir.file(NAME), "room to restart the journal", e) from None
        self.offset = _HEADER.size

    @staticmethod
    def _aligned(size: int) -> int:
        return max(_HEADER.size, size - (size - _HEADER.size) % 8)

    def append(self, entries) -> None:
        """Record changes about to be made (under the lock, after reading what others
        appended, so this process's offset is the end; a torn last entry of a killed
        writer is overwritten). This process's own view has them: its offset moves on."""
        data = np.asarray(entries, dtype="<i8").tobytes()
        if not data:
            return
        try:
            os.pwrite(self.fd, data, self.offset)
        except OSError as e:
            raise storage_error(self.dir.file(NAME), "room to append to the journal", e) from None
        self.offset += len(data)

    def unchanged(self) -> bool:
        """Whether nothing was appended since this process last read (no lock needed)."""
        try:
            return os.fstat(self.fd).st_size == self.offset and self._header() == self.epoch
        except OSError:
            return False

    def since(self) -> np.ndarray | None:
        """The entries appended since this process last read them, or None when it must
        check everything (another epoch, a shorter journal). Moves the offset on."""
        epoch = self._header()
        size = os.fstat(self.fd).st_size
        if epoch is None or epoch != self.epoch or size < self.offset:
            if epoch is None:
                self.restart()
            else:
                self.epoch, self.offset = epoch, self._aligned(size)
            return None
        n = (size - self.offset) // 8
        if n == 0:
            return np.empty(0, dtype=np.int64)
        if n > 2 * self.max_entries:       # past what writers let it reach (a damaged or hostile file):
            self.offset = self._aligned(size)      # a full check costs less than reading it
            return None
        raw = os.pread(self.fd, n * 8, self.offset)
        self.offset += len(raw) - len(raw) % 8
        return np.frombuffer(raw[:len(raw) - len(raw) % 8], dtype="<i8").astype(np.int64)

    @property
    def entries(self) -> int:
        return (os.fstat(self.fd).st_size - _HEADER.size) // 8

    def due(self) -> bool:
        """Whether the journal grew past its bound (the writer restarts it, under the lock)."""
        return self.entries > self.max_entries

    def close(self) -> None:
        if self.fd >= 0:
            self._close()
            self.fd = -1
