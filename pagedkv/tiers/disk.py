"""The disk prefix tier: a memory-mapped block file, a memory-mapped slot index, a
journal and a small JSON header, in one directory that a later process (or several
processes taking turns) can reopen.

Files (``dir/``):

- ``meta.json``: format version, the tier's limit in blocks (``capacity``), record
  size, and the KV format this tier was written for (model shape, dtypes, layout,
  tensor-parallel heads, tag); with sink and window rows (version 2), their format too
  (``kv_window``, ``kv_sink_tokens``); see :mod:`pagedkv.tiers.disk_meta`;
- ``blocks.bin``: one record per slot (:mod:`pagedkv.tiers.payload`): every arena's
  bytes of one block (all layers), so a block is one contiguous read, and, for a
  quantized cache with ``kv_window``/``kv_sink_tokens``, the block's model-precision
  sink and window rows (:mod:`pagedkv.tiers.disk_rows`), under the same CRC;
- ``index.bin``: one slot record per slot (:func:`~pagedkv.tiers.chain.slot_dtype`):
  tokens, namespace, parent link, tier hash, the block's CRC-32 and a CRC-32 of the
  record itself;
- ``journal.bin``: the slots changed, appended before each change
  (:mod:`pagedkv.tiers.disk_journal`);
- ``namespaces.json``: the namespace keys (hex) that slot records refer to;
- ``lock``: held (``flock``) while a cache uses the tier.

**Capacity grows on demand.** The files start at the limit or :data:`INITIAL_BYTES`,
whichever is less, and double (their space reserved first) when every slot is taken,
up to the limit; only then does the tier evict. A filesystem that refuses to grow them
stops the growth (a warning), never the cache. :meth:`DiskPrefixTier.clear` empties the
tier and gives the space back.

**Reopening costs what changed.** A first open in a process checks everything: the
header against this cache, every slot record (its CRC, its parent link, its hash
recomputed from its tokens) and, unless ``verify_blocks=False``, every block's CRC. A
process that keeps the tier between turns (:meth:`DiskPrefixTier.unlock`,
:meth:`DiskPrefixTier.relock`: the vLLM connector's engines sharing a directory) reads
only the journal's new entries and checks just those slots, so a lookup, a hit or a
commit after another engine wrote costs in proportion to what it wrote, not to the
directory. A header or file size that does not match raises
:class:`~pagedkv.errors.TierFileError` and the directory is not used; a record that
fails its checks is dropped with its descendants, a miss each (corruption, or a write
torn by a power loss), and the rest is served. Reads verify the block's CRC again
before its data reaches the device; a block that fails is dropped (with its
descendants) and costs a miss.

A slot becomes valid on disk only after its data is written and sealed (journal entry,
CRC, then the record, whose ``valid`` byte is stored last; emptying stores it first),
so a process killed mid-write leaves at worst an empty slot. A record a crash can
orphan (its parent slot emptied, its namespace never written) costs that record, a
miss, never the tier; ``hits`` and ``stamp``, which only order eviction, are
renumbered at open.

The files are opened only through :class:`~pagedkv.tiers.tierdir.TierDir` (no symbolic
link, no FIFO, no file of another user; see docs/tier-directory.md), with their space
reserved, so a full filesystem is a :class:`~pagedkv.errors.TierStorageError` when the
tier is opened or grows, never a ``SIGBUS`` later.
"""
from __future__ import annotations

import errno
import os
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from pagedkv.errors import HostMemoryError, InvalidArgumentError, TierFileError, TierStorageError, expected
from pagedkv.tiers.base import SlotTier
from pagedkv.tiers.chain import ChainIndex, slot_dtype
from pagedkv.tiers.disk_journal import GROWN, NAMESPACES, Journal
from pagedkv.tiers.disk_journal import NAME as JOURNAL
from pagedkv.tiers.disk_meta import FORMAT_VERSION, MAGIC, ROWS_VERSION, check_meta
from pagedkv.tiers.disk_records import check_all, check_changed
from pagedkv.tiers.disk_rows import rows_format
from pagedkv.tiers.payload import PayloadLayout, record_crc
from pagedkv.tiers.tierdir import TierDir, storage_error

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = ["DiskPrefixTier", "FORMAT_VERSION", "INITIAL_BYTES"]

MAX_SLOTS = 2**31 - 1          # slot ids and parent links are int32
#: the files' size at creation when the limit is larger (they grow on demand)
INITIAL_BYTES = 64 << 20
_NAMES = ("lock", "meta.json", "meta.json.tmp", "namespaces.json", "namespaces.json.tmp", "blocks.bin", "index.bin",
          JOURNAL)


class DiskPrefixTier(SlotTier):
    """Open (or create) the disk tier in ``path`` for KV shaped like ``store_arenas``.

    Args:
        capacity: the tier's limit in blocks (the files grow up to it).
        kv_format: what the files must have been written for (see
            :func:`pagedkv.format.fingerprint.kv_format`); any difference refuses the directory.
        verify_blocks: check every block's CRC when opening (a full read).
        initial_blocks: the files' slots at creation (default: the limit, or
            :data:`INITIAL_BYTES` worth, whichever is less).
    """

    medium = "disk"

    def __init__(self, path: str, store_arenas: list[torch.Tensor], capacity: int, block_size: int,
                 kv_format: dict, *, eviction: str, weak_hash: bool, verify_blocks: bool = True,
                 on_evict: Callable[[int], None] | None = None, rows=None, initial_blocks: int | None = None):
        super().__init__()
        self.block_size = block_size
        self.weak_hash = weak_hash
        self.eviction = eviction
        self.num_write_errors = 0     # namespaces.json writes that failed (those blocks were not written down)
        self.num_grown = 0            # times the files grew
        self.num_refreshed = 0        # slots re-checked after other processes' changes
        self.num_full_checks = 0      # opens or re-opens that checked every record
        self._maps: list = []
        self._loaded = False
        self._locked = False
        self.journal: Journal | None = None
        rows_meta = rows_format(rows)
        self.layout = PayloadLayout.of(store_arenas, rows if rows_meta is not None else None)
        self.record_bytes = self.layout.record_bytes
        self.lock = None if rows is None else rows.lock
        self._slot_bytes = slot_dtype(block_size).itemsize
        self.meta: dict[str, Any] = {"magic": MAGIC, "version": FORMAT_VERSION, "capacity": capacity,
                                     "record_bytes": self.record_bytes, "block_size": block_size,
                                     "weak_hash": bool(weak_hash), "kv_format": kv_format}
        if rows_meta is not None:
            self.meta.update(version=ROWS_VERSION, rows=rows_meta)
        if isinstance(capacity, bool) or not isinstance(capacity, int) or not 0 < capacity <= MAX_SLOTS:
            raise InvalidArgumentError(expected("prefix_disk_blocks", f"an int in [1, {MAX_SLOTS}] (tier slot "
                                                "ids are int32)", capacity))
        self.limit = capacity
        per = self.record_bytes + self._slot_bytes
        first = initial_blocks if initial_blocks is not None else max(1, INITIAL_BYTES // per)
        self._initial = min(capacity, max(1, int(first)))
        self._check_host_memory(capacity)
        self.dir = TierDir(path)
        self.path = self.dir.path
        try:
            self._lock_fd = self._lock()
            self._unlock = weakref.finalize(self, _unlock, self._lock_fd)   # also on garbage collection
            self._locked = True
            for name in _NAMES:                         # nothing but our own regular files, before any change
                self.dir.check(name)
            fresh = self.dir.lstat("meta.json") is None
            if fresh:
                self._create()
            else:
                check_meta(self._file("meta.json"), self.meta, self._read_json("meta.json"))
            self._open_maps()
            self.journal = Journal(self.dir, max_entries=4 * capacity + 4096)
            if not fresh:
                self._check_limit()
                self._load_namespaces()
                self.num_full_checks += 1
                check_all(self, verify_blocks)
            self._loaded = True
            self._new_index()
        except BaseException:
            self.dir.rollback()       # before close(): it removes what this open created through the directory
            self.close()
            raise

    def _new_index(self) -> None:
        callbacks = (self.index.on_evict, self.index.on_removed) if hasattr(self, "index") else (None, None)
        self.index = ChainIndex(self.records, self.block_size, eviction=self.eviction, weak_hash=self.weak_hash,
                                on_evict=callbacks[0], on_removed=callbacks[1] or self._persist, on_full=self._grow)
        self.index.pins[:] = 0
        self._views()

    def _views(self) -> None:
        n = len(self.records)
        self.payloads = self.layout.over(torch.from_numpy(self.blocks[:n * self.record_bytes]).view(n, self.record_bytes),
                                         self.lock)
        self.arenas, self._records_view = self.payloads.arenas, self.payloads.records
        self.window = self.payloads.window

    @property
    def nbytes(self) -> int:
        """Bytes of the tier's files (its blocks' records, their rows included, and the slot index)."""
        return sum(size for _, size in self._sizes())

    @property
    def rows_section(self) -> tuple[int, int] | None:
        """``(offset, bytes)`` of a record's sink and window rows (None without rows)."""
        rows = self.layout.section("rows")
        return None if rows is None else (rows.offset, self.layout.rows_bytes)

    @property
    def rows_bytes(self) -> int:
        """Bytes of a record's sink and window rows (0 without rows)."""
        return self.layout.rows_bytes

    # ---- files ----------------------------------------------------------------------
    def _file(self, name: str) -> str:
        return self.dir.file(name)

    def _sizes(self, n: int | None = None):
        n = len(self.records) if n is None else n
        return (("blocks.bin", n * self.record_bytes), ("index.bin", n * self._slot_bytes))

    def _check_host_memory(self, capacity: int) -> None:
        # The index is a private copy in host memory, plus four per-slot arrays.
        need = capacity * (self._slot_bytes + 16)
        try:
            have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):   # pragma: no cover - no sysconf
            return
        if need > have:
            raise HostMemoryError(expected("prefix_disk_blocks", f"a tier index that fits in host memory "
                                           f"({have} bytes)", f"{capacity} blocks ({need} bytes of index)"))

    def _lock(self):
        fd = self.dir.open("lock", os.O_RDWR, create=True)
        try:
            self._flock(fd)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _flock(self, fd: int) -> None:
        if fcntl is None:      # pragma: no cover - Windows
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise TierFileError(expected("prefix_disk_dir", "a directory no other cache has open",
                                             f"{self.path!r} (locked by another cache)")) from None
            raise storage_error(self._file("lock"), "a file pagedkv can lock", e) from None

    def _create(self) -> None:
        need = self.limit * (self.record_bytes + self._slot_bytes)
        free = self.dir.free_bytes()
        if need > free:       # a limit the filesystem cannot hold now is a mistake to name at once
            per = self.record_bytes + self._slot_bytes
            err = TierStorageError(expected("prefix_disk_blocks", f"at most {free // per} blocks ({free} bytes "
                                            f"free in {self.path!r})", f"{self.limit} ({need} bytes)"))
            err.errno = errno.ENOSPC
            raise err
        for name, size in self._sizes(self._initial):
            self.dir.create_file(name, size)
        self._write_json("namespaces.json", [])
        self._write_json("meta.json", self.meta)     # last: its presence marks a complete tier

    def _write_json(self, name: str, obj) -> None:
        self.dir.write_json(name, obj)

    def _read_json(self, name: str):
        return self.dir.read_json(name)

    def _open_maps(self) -> None:
        """Map the files at their current size (the index's sets the slot count)."""
        dt = slot_dtype(self.block_size)
        st = self.dir.check("index.bin")
        size = 0 if st is None else st.st_size
        if size % dt.itemsize or not size:
            raise TierFileError(expected(self._file("index.bin"), f"a positive multiple of {dt.itemsize} bytes",
                                         f"{size} bytes (truncated or foreign)"))
        n = size // dt.itemsize
        maps = [self.dir.map("blocks.bin", n * self.record_bytes, at_least=True), self.dir.map("index.bin", size)]
        self._maps = maps
        self.blocks = np.frombuffer(maps[0], dtype=np.uint8)
        # The index works on a private copy; a record reaches the file only when it is
        # sealed (data written) or emptied, so the file never shows a half-written slot.
        self._disk = np.frombuffer(maps[1], dtype=dt)
        self._disk_raw = self._disk.view(np.uint8).reshape(n, dt.itemsize)
        self.records = np.array(self._disk)
        self._raw_records = self.records.view(np.uint8).reshape(n, dt.itemsize)
        self._checked_bytes = dt.fields["rec_crc"][1]  # type: ignore[index]  # a record dtype has fields

    def _check_limit(self) -> None:
        """A limit below what the files hold is refused; a new limit is written down."""
        held = len(self.records)
        if self.limit < held:
            raise TierFileError(expected("prefix_disk_blocks", f">= {held} (the slots {self._file('index.bin')} "
                                         "holds; a smaller limit would drop blocks)", self.limit))
        meta = self._read_json("meta.json")
        if meta.get("capacity") != self.limit:
            self._write_json("meta.json", dict(meta, capacity=self.limit))

    def _grow(self) -> bool:
        """Every slot is taken: double the files (up to the limit). False: at the limit,
        or the filesystem refused (then the tier stops growing and evicts)."""
        n = len(self.records)
        if n >= self.limit:
            return False
        new = min(self.limit, max(2 * n, n + 1))
        try:
            self.journal.append([GROWN])              # type: ignore[union-attr]  # open
            for name, size in self._sizes(new):      # blocks first: a crash between leaves the index's count
                self.dir.extend(name, size)
        except TierFileError as e:
            warnings.warn(f"pagedkv: the disk tier stops growing at {n} blocks: {e}", RuntimeWarning, stacklevel=4)
            self.limit = n
            return False
        old = self.records
        self._open_maps()
        self.records[:n] = old                        # this process's view of its own slots
        self._raw_records = self.records.view(np.uint8).reshape(new, self._slot_bytes)
        self.index.grow(self.records)
        self._views()
        self.num_grown += 1
        return True

    # ---- turns between processes -------------------------------------------------------------
    def unlock(self) -> None:
        """Let another process use the directory; this one keeps its view (its index,
        its maps) and must :meth:`relock` before touching the tier again."""
        if self._locked and fcntl is not None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        self._locked = False

    def relock(self, timeout: float = 0.0) -> bool:
        """Take the directory back (waiting up to ``timeout`` seconds for another
        process's turn) and take in what others changed since this process last looked:
        the journal's new entries, the namespaces, grown files. False: still locked by
        another process (nothing changed here)."""
        if self._locked:
            return True
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._flock(self._lock_fd)
                break
            except TierFileError:
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.001)
        self._locked = True
        try:
            self.refresh()
        except BaseException:
            self.unlock()
            raise
        return True

    def unchanged(self) -> bool:
        """Whether no process changed the tier since this one last looked (no lock
        taken: a hint for whether a turn is needed; the turn itself re-checks)."""
        return self.journal is not None and self.journal.unchanged()

    def refresh(self) -> None:
        """Take in other processes' changes (the lock is held): what the journal lists,
        or everything when it cannot say (:mod:`pagedkv.tiers.disk_journal`)."""
        changed = self.journal.since()               # type: ignore[union-attr]  # open
        if changed is not None and not len(changed):
            return
        if changed is not None and ((changed == GROWN).any() or self._index_size() != len(self.records)):
            if self._index_size() < len(self.records):
                changed = None                        # shrunk (cleared): everything
            else:
                self._regrow()
        if changed is not None and ((changed == NAMESPACES).any() or self._names_missing(changed)):
            if not self._reload_namespaces():
                changed = None
        if changed is None or not check_changed(self, changed):
            self._reload()
            return
        self.num_refreshed += int((changed >= 0).sum())

    def _names_missing(self, changed: np.ndarray) -> bool:
        slots = changed[(changed >= 0) & (changed < len(self.records))]
        return bool(len(slots)) and int(self._disk["ns"][slots].max()) >= len(self.ns_keys)

    def _index_size(self) -> int:
        st = self.dir.check("index.bin")
        return 0 if st is None else st.st_size // self._slot_bytes

    def _regrow(self) -> None:
        n, old = len(self.records), self.records
        if self._index_size() <= n:
            return
        self._open_maps()
        self.records[:n] = old
        self.records[n:] = np.zeros(1, dtype=self.records.dtype)  # empty here until their journal entries are checked
        self._raw_records = self.records.view(np.uint8).reshape(len(self.records), self._slot_bytes)
        self.index.grow(self.records)
        self._views()

    def _reload(self) -> None:
        """Check everything again, as a first open does (the journal cannot say what changed)."""
        if self.on_lost is not None and self.index.num_used:
            self.on_lost(None)                # which of our blocks survive is not known here
        self._open_maps()
        self.ns_ids, self.ns_keys, self.ns_hashes = {}, [], []
        self._loaded = False
        self._load_namespaces()
        self._loaded = True
        self.num_full_checks += 1
        check_all(self, verify_blocks=False)
        self._new_index()

    def _reload_namespaces(self) -> bool:
        keys = self._namespace_file()
        if [bytes.fromhex(k) for k in keys[:len(self.ns_keys)]] != self.ns_keys:
            return False                      # not an extension of ours: check everything
        loaded, self._loaded = self._loaded, False
        try:
            for k in keys[len(self.ns_keys):]:
                self.namespace(bytes.fromhex(k), create=True)
        finally:
            self._loaded = loaded
        return True

    # ---- namespaces -----------------------------------------------------------------------------
    def _namespace_file(self) -> list[str]:
        keys = self._read_json("namespaces.json")
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise TierFileError(expected(self._file("namespaces.json"), "a list of hex namespace keys", type(keys).__name__))
        try:
            for k in keys:
                bytes.fromhex(k)
        except ValueError:
            raise TierFileError(expected(self._file("namespaces.json"), "hex namespace keys", "non-hex text")) from None
        return keys

    def _load_namespaces(self) -> None:
        for key in self._namespace_file():
            self.namespace(bytes.fromhex(key), create=True)

    def namespace(self, key: bytes, create: bool):
        # namespaces.json is written before the namespace exists in memory: a failed
        # write (ENOSPC) leaves both as they were, and no sealed record can name a
        # namespace the file lacks.
        if create and self._loaded and key not in self.ns_ids:
            try:
                self._write_json("namespaces.json", [k.hex() for k in self.ns_keys] + [key.hex()])
            except TierFileError:
                self.num_write_errors += 1
                raise
            try:        # a hint for other processes (a record naming a namespace they lack is one too)
                self.journal.append([NAMESPACES])      # type: ignore[union-attr]  # open
            except TierFileError:
                pass
        return super().namespace(key, create)

    # ---- data ------------------------------------------------------------------------------
    def read(self, slots, dst_arenas, dst_blocks) -> None:
        self.payloads.read(slots, dst_arenas, dst_blocks)

    def write(self, src_arenas, src_blocks, slots) -> None:
        self.payloads.write(src_arenas, src_blocks, slots)

    # ---- data integrity ----------------------------------------------------------------
    def _block_crc(self, slot: int) -> int:
        start = slot * self.record_bytes
        return record_crc(self.blocks[start:start + self.record_bytes])

    def verify(self, slot: int) -> bool:
        ok = self._block_crc(slot) == int(self.records["crc"][slot])
        if not ok:
            self.num_corrupt += 1
        return ok

    # A record's first byte is its valid flag. Sealing stores it last and emptying stores
    # it first, so a writer killed between any two stores leaves the slot empty on disk.
    def written(self, slots: np.ndarray) -> None:
        r, raw, disk = self.records, self._raw_records, self._disk_raw
        slots = np.asarray(slots)
        self.journal.append(slots)                    # type: ignore[union-attr]  # open
        for s in slots.tolist():
            r["crc"][s] = self._block_crc(s)
            r["rec_crc"][s] = record_crc(raw[s, :self._checked_bytes])
            disk[s, 1:] = raw[s, 1:]
            disk[s, 0] = raw[s, 0]
        super().written(slots)
        if self.journal.due():                        # type: ignore[union-attr]
            self.journal.restart()                    # type: ignore[union-attr]  # readers check everything once

    def _store_record(self, slot: int) -> None:
        # An emptied slot is marked so on disk before anything can overwrite its data.
        self._disk_raw[slot, 0] = self._raw_records[slot, 0]
        self._disk_raw[slot, 1:] = self._raw_records[slot, 1:]

    def _persist(self, slot: int) -> None:
        self.journal.append([slot])                   # type: ignore[union-attr]  # open
        self._store_record(slot)

    def clear(self) -> list:
        """Empty every slot and give the files' space back (down to their size at
        creation); other processes check everything at their next turn."""
        held = self.index.clear()
        self.cleared()
        return held

    def cleared(self) -> None:
        self.journal.restart()                        # type: ignore[union-attr]  # open
        self._disk_raw[:, 0] = self._raw_records[:, 0]
        self._disk_raw[:, 1:] = self._raw_records[:, 1:]
        n = len(self.records)
        if n > self._initial and not self.index.busy.any():
            keep = self.records[:self._initial].copy()
            self.payloads = self.arenas = self.window = self._records_view = None  # type: ignore[assignment]
            self.blocks = self._disk = self._disk_raw = None  # type: ignore[assignment]
            self._maps = []
            for name, size in self._sizes(self._initial):
                self.dir.truncate(name, size)
            self._open_maps()
            self.records[:] = keep
            self._raw_records = self.records.view(np.uint8).reshape(self._initial, self._slot_bytes)
            self._new_index()

    def flush(self) -> None:
        """Write the eviction order (hits, recency) and push the maps to the file."""
        if getattr(self, "_disk", None) is None or not self._locked:
            return
        sealed = (self.records["valid"] == 1) & (self.index.busy == 0)
        self._disk["hits"][sealed] = self.records["hits"][sealed]
        self._disk["stamp"][sealed] = self.records["stamp"][sealed]
        for m in self._maps:
            m.flush()

    def close(self) -> None:
        """Flush and release the files at once (descriptors, maps, lock), without waiting
        for the garbage collector (idempotent)."""
        try:
            if getattr(self, "index", None) is not None:
                self.flush()
        finally:
            self.arenas, self._records_view, self.window, self.payloads = [], [], None, None  # type: ignore[assignment]
            self.blocks = self._disk = self._disk_raw = None  # type: ignore[assignment]  # closed
            for m in getattr(self, "_maps", ()):
                try:
                    m.close()
                except BufferError:      # a caller still holds a view: the map goes with it
                    pass
            self._maps = []
            j = getattr(self, "journal", None)
            if j is not None:
                j.close()
            unlock = getattr(self, "_unlock", None)
            if unlock is not None:
                unlock()
            self._locked = False
            d = getattr(self, "dir", None)
            if d is not None:
                d.close()


def _unlock(fd: int) -> None:
    if fcntl is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError:
            pass
    os.close(fd)
