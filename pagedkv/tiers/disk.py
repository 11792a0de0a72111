"""The disk prefix tier: a memory-mapped block file, a memory-mapped slot index, and a
small JSON header, in one directory that a later process can reopen.

Files (``dir/``):

- ``meta.json``: format version, capacity, record size, and the KV format this tier
  was written for (model shape, dtypes, layout, tensor-parallel heads, tag);
- ``blocks.bin``: ``capacity`` records, one per slot. A record holds every arena's
  bytes of one block (all layers), so a block is one contiguous read;
- ``index.bin``: ``capacity`` slot records (:func:`~pagedkv.tiers.chain.slot_dtype`):
  tokens, namespace, parent link, tier hash, the block's CRC-32 and a CRC-32 of the
  record itself;
- ``namespaces.json``: the namespace keys (hex) that slot records refer to;
- ``lock``: held (``flock``) while a cache has the tier open.

Nothing here depends on a per-process secret: hits are verified by tokens and chain
links, and the tier hash uses a fixed seed. Opening verifies the header against this
cache, every slot record (its CRC, its parent link, its hash recomputed from its
tokens) and, unless ``verify_blocks=False``, every block's CRC; anything wrong raises
:class:`~pagedkv.errors.TierFileError` naming the file and the slot, and the directory
is not used. Reads verify the block's CRC again before its data reaches the device; a
block that fails is dropped (with its descendants) and costs a miss.

A slot becomes valid on disk only after its data is written and sealed (CRC, then the
record), so a process killed mid-write leaves at worst an empty slot.
"""
from __future__ import annotations

import errno
import json
import os
import weakref
import zlib
from typing import Callable, List, Optional

import numpy as np
import torch

from pagedkv.errors import TierFileError, expected
from pagedkv.kvformat import differences, shown
from pagedkv.tiers.base import Tier
from pagedkv.tiers.chain import ROOT, ROOT_HASH, ChainIndex, chain_hash, slot_dtype

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

__all__ = ["DiskPrefixTier", "FORMAT_VERSION"]

FORMAT_VERSION = 1
_MAGIC = "pagedkv-prefix-tier"
_ALIGN = 64


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class DiskPrefixTier(Tier):
    """Open (or create) the disk tier in ``path`` for KV shaped like ``store_arenas``.

    Args:
        kv_format: what the files must have been written for (see
            :func:`pagedkv.kvformat.kv_format`); any difference refuses the directory.
        verify_blocks: check every block's CRC when opening (a full read).
    """

    medium = "disk"

    def __init__(self, path: str, store_arenas: List[torch.Tensor], capacity: int, block_size: int,
                 kv_format: dict, *, eviction: str, weak_hash: bool, verify_blocks: bool = True,
                 on_evict: Optional[Callable[[int], None]] = None):
        super().__init__()
        self.path = path
        self.block_size = block_size
        self.weak_hash = weak_hash
        sections, offset = [], 0
        for a in store_arenas:
            per_block = a[:, 0].numel() * a.element_size()
            sections.append((offset, a.dtype, (a.shape[0],) + tuple(a.shape[2:])))
            offset = _aligned(offset + per_block)
        self.record_bytes = offset
        self.meta = {"magic": _MAGIC, "version": FORMAT_VERSION, "capacity": capacity,
                     "record_bytes": offset, "block_size": block_size, "weak_hash": bool(weak_hash),
                     "kv_format": kv_format}
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise TierFileError(expected("prefix_disk_dir", "a directory pagedkv can create",
                                         f"{path!r} ({e.strerror})")) from None
        self._unlock = weakref.finalize(self, _unlock, self._lock())   # also on garbage collection
        try:
            fresh = not os.path.exists(self._file("meta.json"))
            if fresh:
                self._create()
            else:
                self._check_meta()
            self._open_maps()
            if not fresh:
                self._load_namespaces()
                self._check_records()
            self.index = ChainIndex(self.records, block_size, eviction=eviction, weak_hash=weak_hash,
                                    on_evict=on_evict, on_removed=self._persist)
            if not fresh and verify_blocks:
                for s in np.flatnonzero(self.records["valid"] == 1).tolist():
                    if not self.verify(s):
                        raise self._corrupt("blocks.bin", s, "its data does not match its CRC-32")
            self.index.pins[:] = 0
        except BaseException:
            self.close()
            raise
        self.arenas, self._records_view = [], []
        base = torch.from_numpy(self.blocks).view(capacity, self.record_bytes)
        for off, dtype, shape in sections:
            size = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
            view = base[:, off:off + size].view(torch.uint8).view((capacity, size))
            self._records_view.append(view)      # slot -> this arena's bytes of the block, all layers
            self.arenas.append(view.view(dtype).view((capacity,) + shape).transpose(0, 1))

    # ---- files ----------------------------------------------------------------------
    def _file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def _lock(self):
        fd = os.open(self._file("lock"), os.O_RDWR | os.O_CREAT, 0o644)
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise TierFileError(expected("prefix_disk_dir", "a directory no other cache has open",
                                                 f"{self.path!r} (locked by another cache)")) from None
                raise
        return fd

    def _create(self) -> None:
        n = self.meta["capacity"]
        for name, size in (("blocks.bin", n * self.record_bytes),
                           ("index.bin", n * slot_dtype(self.block_size).itemsize)):
            with open(self._file(name), "wb") as f:
                f.truncate(size)
        self._write_json("namespaces.json", [])
        self._write_json("meta.json", self.meta)     # last: its presence marks a complete tier

    def _write_json(self, name: str, obj) -> None:
        tmp = self._file(name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._file(name))

    def _read_json(self, name: str):
        try:
            with open(self._file(name), encoding="utf-8") as f:
                return json.load(f)
        except (OSError, ValueError) as e:
            raise TierFileError(expected(self._file(name), "a readable pagedkv prefix-tier JSON file",
                                         f"{type(e).__name__}: {e}")) from None

    def _open_maps(self) -> None:
        n = self.meta["capacity"]
        dt = slot_dtype(self.block_size)
        for name, size in (("blocks.bin", n * self.record_bytes), ("index.bin", n * dt.itemsize)):
            have = os.path.getsize(self._file(name)) if os.path.exists(self._file(name)) else -1
            if have != size:
                raise TierFileError(expected(self._file(name), f"{size} bytes", f"{have} bytes (truncated or foreign)"))
        self.blocks = np.memmap(self._file("blocks.bin"), dtype=np.uint8, mode="r+")
        # The index works on a private copy; a record reaches the file only when it is
        # sealed (data written) or emptied, so the file never shows a half-written slot.
        self._disk = np.memmap(self._file("index.bin"), dtype=dt, mode="r+")
        self.records = np.array(self._disk)
        self._raw_records = self.records.view(np.uint8).reshape(n, dt.itemsize)
        self._checked_bytes = dt.fields["rec_crc"][1]

    def _check_meta(self) -> None:
        meta = self._read_json("meta.json")
        if not isinstance(meta, dict) or meta.get("magic") != _MAGIC:
            raise TierFileError(expected(self._file("meta.json"), "a pagedkv prefix-tier header",
                                         f"magic {meta.get('magic') if isinstance(meta, dict) else meta!r}"))
        if meta.get("version") != self.meta["version"]:
            raise TierFileError(expected(self._file("meta.json"), f"version={FORMAT_VERSION}",
                                         f"version={meta.get('version')!r}"))
        diff = differences(self.meta["kv_format"], meta.get("kv_format"))
        if diff:     # every differing setting, both values: the directory is left as it is
            raise TierFileError(expected(
                self._file("meta.json"), "a tier written for this model shape and settings ("
                + ", ".join(f"{k}={shown(m)}" for k, _, m in diff) + ")",
                ", ".join(f"{k}={shown(t)}" for k, t, _ in diff)))
        for key in ("capacity", "record_bytes", "block_size", "weak_hash"):
            if meta.get(key) != self.meta[key]:
                raise TierFileError(expected(self._file("meta.json"), f"{key}={self.meta[key]!r} (this cache)",
                                             f"{key}={meta.get(key)!r}"))

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

    def _namespace_added(self, key: bytes) -> None:
        if getattr(self, "index", None) is not None:   # not while loading them
            self._write_json("namespaces.json", [k.hex() for k in self.ns_keys])

    def _corrupt(self, name: str, slot: int, why: str) -> TierFileError:
        return TierFileError(expected(self._file(name), f"slot {slot} intact", why))

    def _check_records(self) -> None:
        r = self.records
        valid = np.array(r["valid"])
        if not np.isin(valid, (0, 1)).all():
            raise self._corrupt("index.bin", int(np.flatnonzero(~np.isin(valid, (0, 1)))[0]), "a bad valid flag")
        n = self.meta["capacity"]
        parent, pgen, gen = np.array(r["parent"]), np.array(r["parent_gen"]), np.array(r["gen"])
        ns, stored, rec_crc = np.array(r["ns"]), np.array(r["hash"]), np.array(r["rec_crc"])
        held = np.flatnonzero(valid == 1).tolist()
        kids = {}
        for s in held:
            if zlib.crc32(self._raw_records[s, :self._checked_bytes]) != int(rec_crc[s]):
                raise self._corrupt("index.bin", s, "its record does not match its CRC-32")
            p = int(parent[s])
            if not (p == ROOT or (0 <= p < n and valid[p] == 1 and gen[p] == pgen[s])):
                raise self._corrupt("index.bin", s, f"its parent link ({p}) names no valid slot")
            if not 0 <= ns[s] < len(self.ns_keys):
                raise self._corrupt("index.bin", s, f"namespace {int(ns[s])} is not in namespaces.json")
            kids.setdefault(p, []).append(s)
        # Recompute every hash from the root down (parents first): a record that decodes
        # but lies about its content is refused too.
        hashes, owner = {ROOT: ROOT_HASH}, {}
        frontier = kids.get(ROOT, [])
        while frontier:
            nxt = []
            for s in frontier:
                h = chain_hash(hashes[int(parent[s])], self.ns_hashes[int(ns[s])], np.asarray(r["tokens"][s]),
                               self.weak_hash)
                if h != int(stored[s]):
                    raise self._corrupt("index.bin", s, "its hash does not match its tokens")
                if h in owner:
                    raise self._corrupt("index.bin", s, f"it repeats the hash of slot {owner[h]}")
                hashes[s], owner[h] = h, s
                nxt.extend(kids.get(s, ()))
            frontier = nxt
        if len(owner) != len(held):
            raise self._corrupt("index.bin", min(set(held) - set(owner.values())), "it is not reachable from the root")

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
        return zlib.crc32(self.blocks[start:start + self.record_bytes])

    def verify(self, slot: int) -> bool:
        ok = self._block_crc(slot) == int(self.records["crc"][slot])
        if not ok:
            self.num_corrupt += 1
        return ok

    def written(self, slots: np.ndarray) -> None:
        r = self.records
        for s in np.asarray(slots).tolist():
            r["crc"][s] = self._block_crc(s)
            r["rec_crc"][s] = zlib.crc32(self._raw_records[s, :self._checked_bytes])
            self._disk[s] = r[s]
        super().written(slots)

    def _persist(self, slot: int) -> None:
        # An emptied slot is marked so on disk before anything can overwrite its data.
        self._disk[slot] = self.records[slot]

    def cleared(self) -> None:
        self._disk[:] = self.records

    def flush(self) -> None:
        """Write the eviction order (hits, recency) and push the maps to the file."""
        if getattr(self, "_disk", None) is None:
            return
        sealed = (self.records["valid"] == 1) & (self.index.busy == 0)
        self._disk["hits"][sealed] = self.records["hits"][sealed]
        self._disk["stamp"][sealed] = self.records["stamp"][sealed]
        self._disk.flush()
        self.blocks.flush()

    def close(self) -> None:
        """Flush and release the files (idempotent)."""
        if getattr(self, "index", None) is not None:
            self.flush()
        self.arenas = []
        self.blocks = self._disk = self._raw_records = None
        unlock = getattr(self, "_unlock", None)
        if unlock is not None:
            unlock()


def _unlock(fd: int) -> None:
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The same memory as bytes (the last dim widened), so any dtype copies as bytes."""
    return t.view(torch.uint8)
