"""The disk prefix tier: a memory-mapped block file, a memory-mapped slot index, and a
small JSON header, in one directory that a later process can reopen.

Files (``dir/``):

- ``meta.json``: format version, capacity, record size, and the KV format this tier
  was written for (model shape, dtypes, layout, tensor-parallel heads, tag); with sink
  and window rows (version 2), their format too (``kv_window``, ``kv_sink_tokens``);
- ``blocks.bin``: ``capacity`` records, one per slot. A record holds every arena's
  bytes of one block (all layers), so a block is one contiguous read, and, for a
  quantized cache with ``kv_window``/``kv_sink_tokens``, the block's model-precision
  sink and window rows (:mod:`pagedkv.tiers.disk_rows`), under the same CRC;
- ``index.bin``: ``capacity`` slot records (:func:`~pagedkv.tiers.chain.slot_dtype`):
  tokens, namespace, parent link, tier hash, the block's CRC-32 and a CRC-32 of the
  record itself;
- ``namespaces.json``: the namespace keys (hex) that slot records refer to;
- ``lock``: held (``flock``) while a cache has the tier open.

Nothing here depends on a per-process secret: hits are verified by tokens and chain
links, and the tier hash uses a fixed seed. Opening verifies the header against this
cache, every slot record (its CRC, its parent link, its hash recomputed from its
tokens) and, unless ``verify_blocks=False``, every block's CRC. A header or file
size that does not match raises :class:`~pagedkv.errors.TierFileError` and the directory
is not used; a record that fails its checks is dropped with its descendants, a miss
each (corruption, or a write torn by a power loss), and the rest is served. Reads verify the block's CRC again before its data reaches the device; a
block that fails is dropped (with its descendants) and costs a miss.

A slot becomes valid on disk only after its data is written and sealed (CRC, then the
record, whose ``valid`` byte is stored last; emptying stores it first), so a process
killed mid-write leaves at worst an empty slot. A record a crash can orphan (its parent
slot emptied, its namespace never written) costs that record, a miss, never the tier;
``hits`` and ``stamp``, which only order eviction, are renumbered at open.

The files are opened only through :class:`~pagedkv.tiers.tierdir.TierDir` (no symbolic
link, no FIFO, no file of another user; see docs/tier-directory.md), with their space
reserved, so a full filesystem is a :class:`~pagedkv.errors.TierStorageError` when the
tier is opened, never a ``SIGBUS`` later.
"""
from __future__ import annotations

import errno
import os
import warnings
import weakref
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from pagedkv.errors import HostMemoryError, InvalidArgumentError, TierFileError, TierStorageError, expected
from pagedkv.format.fingerprint import differences, shown
from pagedkv.tiers.base import Tier
from pagedkv.tiers.chain import ROOT, ROOT_HASH, ChainIndex, chain_hash, slot_dtype
from pagedkv.tiers.disk_rows import DiskRows, rows_format
from pagedkv.tiers.tierdir import TierDir, storage_error

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = ["DiskPrefixTier", "FORMAT_VERSION"]

FORMAT_VERSION = 1
ROWS_VERSION = 2          # records carry sink and window rows (meta.json names their format)
_MAGIC = "pagedkv-prefix-tier"
_ALIGN = 64
MAX_SLOTS = 2**31 - 1          # slot ids and parent links are int32
_NAMES = ("lock", "meta.json", "meta.json.tmp", "namespaces.json", "namespaces.json.tmp", "blocks.bin", "index.bin")
_JSON_NAMES = {str: "string", int: "integer", bool: "boolean", dict: "object"}
_META_TYPES = {"magic": str, "version": int, "capacity": int, "record_bytes": int, "block_size": int,
               "weak_hash": bool, "kv_format": dict}


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class DiskPrefixTier(Tier):
    """Open (or create) the disk tier in ``path`` for KV shaped like ``store_arenas``.

    Args:
        kv_format: what the files must have been written for (see
            :func:`pagedkv.format.fingerprint.kv_format`); any difference refuses the directory.
        verify_blocks: check every block's CRC when opening (a full read).
    """

    medium = "disk"

    def __init__(self, path: str, store_arenas: list[torch.Tensor], capacity: int, block_size: int,
                 kv_format: dict, *, eviction: str, weak_hash: bool, verify_blocks: bool = True,
                 on_evict: Callable[[int], None] | None = None, rows=None):
        super().__init__()
        self.block_size = block_size
        self.weak_hash = weak_hash
        self.num_write_errors = 0     # namespaces.json writes that failed (those blocks were not written down)
        self._maps: list = []
        self._loaded = False
        sections, offset = [], 0
        for a in store_arenas:
            per_block = a[:, 0].numel() * a.element_size()
            sections.append((offset, a.dtype, (a.shape[0],) + tuple(a.shape[2:])))
            offset = _aligned(offset + per_block)
        rows_meta = rows_format(rows)
        # the rows' section (data offset, dtype, shape, validity offset, shape): model-precision
        # data, then a byte per layer and token
        section: tuple[int, torch.dtype, tuple[int, ...], int, tuple[int, int]] | None = None
        if rows_meta is not None:
            rshape = tuple(rows_meta["shape"])
            section = (offset, rows.data.dtype, rshape, offset + _aligned(
                int(np.prod(rshape)) * rows.data.element_size()), (rshape[0], rshape[2]))
            offset = _aligned(section[3] + rshape[0] * rshape[2])
        self.rows_section = section
        self.record_bytes = offset
        self.meta: dict[str, Any] = {"magic": _MAGIC, "version": FORMAT_VERSION, "capacity": capacity,
                                     "record_bytes": offset, "block_size": block_size,
                                     "weak_hash": bool(weak_hash), "kv_format": kv_format}
        if rows_meta is not None:
            self.meta.update(version=ROWS_VERSION, rows=rows_meta)
        if not 0 < capacity <= MAX_SLOTS:               # before anything is created or allocated
            raise InvalidArgumentError(expected("prefix_disk_blocks", f"an int in [1, {MAX_SLOTS}] (tier slot "
                                                "ids are int32)", capacity))
        self._check_host_memory(capacity)
        self.dir = TierDir(path)
        self.path = self.dir.path
        try:
            self._unlock = weakref.finalize(self, _unlock, self._lock())   # also on garbage collection
            for name in _NAMES:                         # nothing but our own regular files, before any change
                self.dir.check(name)
            fresh = self.dir.lstat("meta.json") is None
            if fresh:
                self._create()
            else:
                self._check_meta()
            self._open_maps()
            if not fresh:
                self._load_namespaces()
                self._check_records(verify_blocks)
            self._loaded = True
            self.index = ChainIndex(self.records, block_size, eviction=eviction, weak_hash=weak_hash,
                                    on_evict=on_evict, on_removed=self._persist)
            self.index.pins[:] = 0
        except BaseException:
            self.dir.rollback()       # before close(): it removes what this open created through the directory
            self.close()
            raise
        self.arenas, self._records_view = [], []
        base = torch.from_numpy(self.blocks).view(capacity, self.record_bytes)
        for off, dtype, shape in sections:
            size = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
            view = base[:, off:off + size].view(torch.uint8).view((capacity, size))
            self._records_view.append(view)      # slot -> this arena's bytes of the block, all layers
            self.arenas.append(view.view(dtype).view((capacity,) + shape).transpose(0, 1))
        if section is not None:
            off, dtype, shape, voff, vshape = section
            size = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
            data = base[:, off:off + size].view(dtype).view((capacity,) + shape)
            valid = base[:, voff:voff + int(np.prod(vshape))].view((capacity,) + vshape)
            self.window = DiskRows(data, valid, rows.lock)

    @property
    def nbytes(self) -> int:
        """Bytes of the tier's files (its blocks' records, their rows included, and the slot index)."""
        return sum(size for _, size in self._sizes())

    @property
    def rows_bytes(self) -> int:
        """Bytes of a record's sink and window rows (0 without rows)."""
        return self.record_bytes - self.rows_section[0] if self.rows_section is not None else 0

    # ---- files ----------------------------------------------------------------------
    def _file(self, name: str) -> str:
        return self.dir.file(name)

    def _sizes(self):
        n = self.meta["capacity"]
        return (("blocks.bin", n * self.record_bytes), ("index.bin", n * slot_dtype(self.block_size).itemsize))

    def _check_host_memory(self, capacity: int) -> None:
        # The index is a private copy in host memory, plus four per-slot arrays.
        need = capacity * (slot_dtype(self.block_size).itemsize + 16)
        try:
            have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):   # pragma: no cover - no sysconf
            return
        if need > have:
            raise HostMemoryError(expected("prefix_disk_blocks", f"a tier index that fits in host memory "
                                           f"({have} bytes)", f"{capacity} blocks ({need} bytes of index)"))

    def _lock(self):
        fd = self.dir.open("lock", os.O_RDWR, create=True)
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise TierFileError(expected("prefix_disk_dir", "a directory no other cache has open",
                                                 f"{self.path!r} (locked by another cache)")) from None
                raise storage_error(self._file("lock"), "a file pagedkv can lock", e) from None
        return fd

    def _create(self) -> None:
        need = sum(size for _, size in self._sizes())
        free = self.dir.free_bytes()
        if need > free:
            per = self.record_bytes + slot_dtype(self.block_size).itemsize
            err = TierStorageError(expected("prefix_disk_blocks", f"at most {free // per} blocks ({free} bytes "
                                            f"free in {self.path!r})", f"{self.meta['capacity']} ({need} bytes)"))
            err.errno = errno.ENOSPC
            raise err
        for name, size in self._sizes():
            self.dir.create_file(name, size)
        self._write_json("namespaces.json", [])
        self._write_json("meta.json", self.meta)     # last: its presence marks a complete tier

    def _write_json(self, name: str, obj) -> None:
        self.dir.write_json(name, obj)

    def _read_json(self, name: str):
        return self.dir.read_json(name)

    def _open_maps(self) -> None:
        n = self.meta["capacity"]
        dt = slot_dtype(self.block_size)
        for name, size in self._sizes():
            self._maps.append(self.dir.map(name, size))
        self.blocks = np.frombuffer(self._maps[0], dtype=np.uint8)
        # The index works on a private copy; a record reaches the file only when it is
        # sealed (data written) or emptied, so the file never shows a half-written slot.
        self._disk = np.frombuffer(self._maps[1], dtype=dt)
        self._disk_raw = self._disk.view(np.uint8).reshape(n, dt.itemsize)
        self.records = np.array(self._disk)
        self._raw_records = self.records.view(np.uint8).reshape(n, dt.itemsize)
        self._checked_bytes = dt.fields["rec_crc"][1]  # type: ignore[index]  # a record dtype has fields

    def _check_meta_types(self, meta: dict) -> None:
        # Before any comparison: a field of the wrong type is a foreign header, not a crash.
        for key, kind in _META_TYPES.items():
            v = meta.get(key)
            if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
                raise TierFileError(expected(self._file("meta.json"), f"{key} as a JSON {_JSON_NAMES[kind]}",
                                             f"{type(v).__name__} {v!r}"[:200]))

    def _check_meta(self) -> None:
        meta = self._read_json("meta.json")
        if not isinstance(meta, dict) or meta.get("magic") != _MAGIC:
            raise TierFileError(expected(self._file("meta.json"), "a pagedkv prefix-tier header",
                                         f"magic {meta.get('magic') if isinstance(meta, dict) else meta!r}"))
        if meta.get("version") not in (FORMAT_VERSION, ROWS_VERSION):
            raise TierFileError(expected(self._file("meta.json"), f"version={self.meta['version']}",
                                         f"version={meta.get('version')!r}"))
        self._check_meta_types(meta)
        diff = differences(self.meta["kv_format"], meta.get("kv_format"))
        if diff:     # every differing setting, both values: the directory is left as it is
            raise TierFileError(expected(
                self._file("meta.json"), "a tier written for this model shape and settings ("
                + ", ".join(f"{k}={shown(m)}" for k, _, m in diff) + ")",
                ", ".join(f"{k}={shown(t)}" for k, t, _ in diff)))
        self._check_rows(meta)
        for key in ("capacity", "record_bytes", "block_size", "weak_hash"):
            if meta.get(key) != self.meta[key]:
                raise TierFileError(expected(self._file("meta.json"), f"{key}={self.meta[key]!r} (this cache)",
                                             f"{key}={meta.get(key)!r}"))

    def _check_rows(self, meta: dict) -> None:
        """The sink and window rows: a tier is used only with the rows this cache keeps,
        for the same ``kv_window`` and ``kv_sink_tokens``. A tier without rows (version 1:
        an older pagedkv, or a cache that kept none) would serve a prefix without them,
        and one with rows to a cache without them would keep them stale: both refused."""
        mine = self.meta.get("rows")
        theirs = meta.get("rows") if meta["version"] == ROWS_VERSION else None
        if mine is None and theirs is None:
            if meta["version"] != self.meta["version"]:    # version 2 that names no rows: not ours
                raise TierFileError(expected(self._file("meta.json"), f"version={self.meta['version']}",
                                             f"version={meta['version']} without rows"))
            return
        name = self._file("meta.json")
        if theirs is None:
            raise TierFileError(expected(name, "a tier whose records carry sink and window rows (" + _settings(mine)
                                         + ": this cache keeps them in model precision)",
                                         f"version={meta['version']}, no rows (written by an older pagedkv or by "
                                         "a cache without kv_window/kv_sink_tokens)"))
        if mine is None:
            raise TierFileError(expected(name, "a tier without sink and window rows (this cache keeps none)",
                                         "rows for " + (_settings(theirs) if isinstance(theirs, dict) else shown(theirs))))
        diff = differences(mine, theirs) if isinstance(theirs, dict) else [("rows", theirs, mine)]
        if diff:
            raise TierFileError(expected(name, "a tier whose rows were written for this cache ("
                                         + ", ".join(f"{k}={shown(m)}" for k, _, m in diff) + ")",
                                         ", ".join(f"{k}={shown(t)}" for k, t, _ in diff)))

    def _load_namespaces(self) -> None:
        keys = self._read_json("namespaces.json")
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise TierFileError(expected(self._file("namespaces.json"), "a list of hex namespace keys", type(keys).__name__))
        try:
            raw = [bytes.fromhex(k) for k in keys]
        except ValueError:
            raise TierFileError(expected(self._file("namespaces.json"), "hex namespace keys", "non-hex text")) from None
        for key in raw:
            self.namespace(key, create=True)

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
        return super().namespace(key, create)

    def _check_records(self, verify_blocks: bool = True) -> None:
        """Drop, as a miss, every record that cannot be trusted, and keep the rest: a bad
        valid flag, a record or (``verify_blocks``) block whose CRC-32 disagrees, a hash
        that disagrees with its tokens or repeats another's (corruption, or a write torn
        by a crash), and what an interrupted writer can leave (a record whose parent slot
        was emptied or whose namespace never reached namespaces.json). A dropped
        record's descendants go with it (their chain is broken). Counted in
        ``num_corrupt_dropped`` and ``num_orphans_dropped``, and warned about: a damaged
        record costs that record, never the tier, and is never served."""
        r = self.records
        raw_valid = np.array(r["valid"])
        bad = set(np.flatnonzero(~np.isin(raw_valid, (0, 1))).tolist())
        valid = np.where(np.isin(raw_valid, (0, 1)), raw_valid, 0)
        n = self.meta["capacity"]
        parent, pgen, gen = np.array(r["parent"]), np.array(r["parent_gen"]), np.array(r["gen"])
        ns, stored, rec_crc = np.array(r["ns"]), np.array(r["hash"]), np.array(r["rec_crc"])
        held = np.flatnonzero(valid == 1).tolist()
        kids: dict[int, list[int]] = {}
        for s in held:
            if zlib.crc32(self._raw_records[s, :self._checked_bytes]) != int(rec_crc[s]) or (  # type: ignore[arg-type]
                    verify_blocks and not self.verify(s)):
                bad.add(s)
                continue
            p = int(parent[s])
            if (p == ROOT or (0 <= p < n and valid[p] == 1 and gen[p] == pgen[s])) and 0 <= ns[s] < len(self.ns_keys):
                kids.setdefault(p, []).append(s)
        # Recompute every hash from the root down (parents first): a record that decodes
        # but lies about its content is dropped too, with its subtree.
        hashes, owner = {ROOT: ROOT_HASH}, {}
        frontier = kids.get(ROOT, [])
        while frontier:
            nxt: list[int] = []
            for s in frontier:
                h = chain_hash(hashes[int(parent[s])], self.ns_hashes[int(ns[s])], np.asarray(r["tokens"][s]),
                               self.weak_hash)
                if h != int(stored[s]) or h in owner:
                    bad.add(s)
                    continue
                hashes[s], owner[h] = h, s
                nxt.extend(kids.get(s, ()))
            frontier = nxt
        kept = set(owner.values())
        dropped = sorted(bad | (set(held) - kept))
        for s in dropped:
            r["valid"][s] = 0
            r["gen"][s] += 1
            self._persist(s)
        self.num_corrupt_dropped = len(bad)
        self.num_orphans_dropped = len(dropped) - len(bad)
        if bad:
            warnings.warn(f"pagedkv: {self._file('index.bin')}: dropped {len(bad)} damaged record(s) and "
                          f"{self.num_orphans_dropped} record(s) below them (a miss each, never served)",
                          RuntimeWarning, stacklevel=3)
        # hits and stamp are outside the CRC and only order eviction: renumber the stamps
        # (any stored value, 2**64-1 included, becomes a rank) so the clock cannot overflow.
        live = np.flatnonzero(r["valid"] == 1)
        order = live[np.argsort(np.array(r["stamp"][live]), kind="stable")]
        r["stamp"][:] = 0
        r["stamp"][order] = np.arange(1, len(live) + 1)

    # ---- data ------------------------------------------------------------------------------
    # A slot's bytes are contiguous here and strided (one run per layer) in an arena:
    # one copy per block and arena beats a gather over the file's strided views.
    def read(self, slots, dst_arenas, dst_blocks) -> None:
        for a, dst in enumerate(dst_arenas):
            for s, b in zip(slots, dst_blocks):
                _bytes(dst[:, b]).copy_(self._records_view[a][s].view(_bytes(dst[:, b]).shape))

    def write(self, src_arenas, src_blocks, slots) -> None:
        for a, src in enumerate(src_arenas):
            for b, s in zip(src_blocks, slots):
                part = _bytes(src[:, b])
                self._records_view[a][s].view(part.shape).copy_(part)

    # ---- data integrity ----------------------------------------------------------------
    def _block_crc(self, slot: int) -> int:
        start = slot * self.record_bytes
        return zlib.crc32(self.blocks[start:start + self.record_bytes])  # type: ignore[arg-type]  # numpy: a buffer

    def verify(self, slot: int) -> bool:
        ok = self._block_crc(slot) == int(self.records["crc"][slot])
        if not ok:
            self.num_corrupt += 1
        return ok

    # A record's first byte is its valid flag. Sealing stores it last and emptying stores
    # it first, so a writer killed between any two stores leaves the slot empty on disk.
    def written(self, slots: np.ndarray) -> None:
        r, raw, disk = self.records, self._raw_records, self._disk_raw
        for s in np.asarray(slots).tolist():
            r["crc"][s] = self._block_crc(s)
            r["rec_crc"][s] = zlib.crc32(raw[s, :self._checked_bytes])  # type: ignore[arg-type]  # numpy: a buffer
            disk[s, 1:] = raw[s, 1:]
            disk[s, 0] = raw[s, 0]
        super().written(slots)

    def _persist(self, slot: int) -> None:
        # An emptied slot is marked so on disk before anything can overwrite its data.
        self._disk_raw[slot, 0] = self._raw_records[slot, 0]
        self._disk_raw[slot, 1:] = self._raw_records[slot, 1:]

    def cleared(self) -> None:
        self._disk_raw[:, 0] = self._raw_records[:, 0]
        self._disk_raw[:, 1:] = self._raw_records[:, 1:]

    def flush(self) -> None:
        """Write the eviction order (hits, recency) and push the maps to the file."""
        if getattr(self, "_disk", None) is None:
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
            self.arenas, self._records_view, self.window = [], [], None
            self.blocks = self._disk = self._disk_raw = None  # type: ignore[assignment]  # closed
            for m in getattr(self, "_maps", ()):
                try:
                    m.close()
                except BufferError:      # a caller still holds a view: the map goes with it
                    pass
            self._maps = []
            unlock = getattr(self, "_unlock", None)
            if unlock is not None:
                unlock()
            d = getattr(self, "dir", None)
            if d is not None:
                d.close()


def _settings(rows: Any) -> str:
    return f"kv_window={shown(rows.get('kv_window'))}, kv_sink_tokens={shown(rows.get('kv_sink_tokens'))}"


def _unlock(fd: int) -> None:
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The same memory as bytes (the last dim widened), so any dtype copies as bytes."""
    return t.view(torch.uint8)
