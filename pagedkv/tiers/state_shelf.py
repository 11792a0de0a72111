"""Recurrent-state snapshots on the host, disk and remote tiers: a shelf per tier.

A snapshot is one sequence's state in every state layer right after a whole number of
blocks. On a tier it is one self-describing record, verified on every read like a
block is (:mod:`pagedkv.tiers.verify`):

- **format**: the digest of the cache's KV format fingerprint (which includes the
  state tensors and layer kinds) the record was written for;
- **namespace**: the state group's namespace key (cache salt, adapter);
- **tokens**: every token the state covers, compared with the query's prefix;
- **checksum**: CRC-32 over the whole record.

Any mismatch is a miss (the record is dropped), never a wrong state. Records are
filed under a BLAKE2b-128 of the namespace key and the tokens, so a lookup of a prompt
hashes it once, block by block. A shelf keeps at most ``capacity`` records and drops
the least recently used first.

Record layout: ``MAGIC``, a u32 header length, a JSON header (format digest,
namespace key, token count, state bytes), the tokens (int32 little endian), the state
bytes, then the u32 CRC of everything before it.
"""
from __future__ import annotations

import collections
import hashlib
import json
import os
import stat
import struct
import zlib

import numpy as np

from pagedkv.errors import TierFileError, expected

__all__ = ["StateShelf", "HostStateShelf", "DiskStateShelf", "RemoteStateShelf", "shelf_keys"]

MAGIC = b"PKVSNAP1"
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_SUFFIX = ".snap"


def shelf_keys(ns_key: bytes, tokens: np.ndarray, block_size: int, blocks: int) -> list[str]:
    """The shelf keys of ``tokens``' prefixes of 1..``blocks`` blocks (hex)."""
    h = hashlib.blake2b(digest_size=16, person=b"pagedkv-state-v1")
    h.update(len(ns_key).to_bytes(4, "little"))
    h.update(ns_key)
    toks = np.ascontiguousarray(tokens[:blocks * block_size], dtype="<i4")
    out = []
    for k in range(blocks):
        h.update(toks[k * block_size:(k + 1) * block_size].tobytes())
        out.append(h.copy().hexdigest())
    return out


def encode(fmt: str, ns_key: bytes, tokens: np.ndarray, payload: bytes) -> bytes:
    head = json.dumps({"format": fmt, "ns": ns_key.hex(), "tokens": int(len(tokens)),
                       "nbytes": len(payload)}, sort_keys=True).encode()
    body = b"".join((MAGIC, struct.pack("<I", len(head)), head,
                     np.ascontiguousarray(tokens, dtype="<i4").tobytes(), payload))
    return body + struct.pack("<I", zlib.crc32(body))


def decode(record: bytes, fmt: str, ns_key: bytes, tokens: np.ndarray) -> bytes | None:
    """The state bytes of ``record`` when it verifies for this query, else None."""
    try:
        if len(record) < len(MAGIC) + 8 or record[:len(MAGIC)] != MAGIC:
            return None
        body, crc = record[:-4], struct.unpack("<I", record[-4:])[0]
        if zlib.crc32(body) != crc:
            return None
        (hl,) = struct.unpack_from("<I", body, len(MAGIC))
        at = len(MAGIC) + 4
        head = json.loads(body[at:at + hl])
        at += hl
        n, nbytes = int(head["tokens"]), int(head["nbytes"])
        if head["format"] != fmt or bytes.fromhex(head["ns"]) != ns_key or n != len(tokens):
            return None
        stored = np.frombuffer(body, dtype="<i4", count=n, offset=at)
        if not np.array_equal(stored, np.asarray(tokens)):
            return None
        at += 4 * n
        if len(body) - at != nbytes:
            return None
        return bytes(body[at:])
    except (ValueError, KeyError, TypeError, struct.error):
        return None


class StateShelf:
    """Snapshots kept on one tier (see the module docstring).

    Args:
        capacity: records kept at most.
        fmt: the digest of the cache's format fingerprint.
    """

    medium = ""

    def __init__(self, capacity: int, fmt: str):
        self.capacity = max(1, int(capacity))
        self.fmt = fmt
        self._lru: collections.OrderedDict[str, int] = collections.OrderedDict()   # key -> record bytes
        self.num_stored = 0
        self.num_hits = 0
        self.num_evicted = 0
        self.num_verify_failures = 0

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: str) -> bool:
        return key in self._lru

    @property
    def nbytes(self) -> int:
        return sum(self._lru.values())

    def put(self, key: str, ns_key: bytes, tokens: np.ndarray, payload: bytes) -> None:
        """File the state ``payload`` after ``tokens`` (replacing a record of that key)."""
        record = encode(self.fmt, ns_key, tokens, payload)
        self._write(key, record)
        self._lru[key] = len(record)
        self._lru.move_to_end(key)
        self.num_stored += 1
        while len(self._lru) > self.capacity:
            old, _ = self._lru.popitem(last=False)
            self._delete(old)
            self.num_evicted += 1

    def prefetch(self, keys: list[str]) -> None:
        """Learn which of ``keys`` the medium holds before ``in`` asks of each (a remote
        server: one round trip for a whole prompt); a local shelf knows already."""

    def get(self, key: str, ns_key: bytes, tokens: np.ndarray) -> bytes | None:
        """The verified state after ``tokens``, or None (a record that fails is dropped)."""
        if key not in self:
            return None
        record = self._read(key)
        payload = None if record is None else decode(record, self.fmt, ns_key, tokens)
        if payload is None:
            self.num_verify_failures += 1
            self.drop(key)
            return None
        if key in self._lru:
            self._lru.move_to_end(key)
        self.num_hits += 1
        return payload

    def drop(self, key: str) -> None:
        if self._lru.pop(key, None) is not None or key in self:
            self._delete(key)

    def clear(self) -> None:
        for key in list(self._lru):
            self.drop(key)

    def stats(self) -> dict:
        return {"medium": self.medium, "snapshots": len(self), "bytes": self.nbytes, "stored": self.num_stored,
                "hits": self.num_hits, "evicted": self.num_evicted, "verify_failures": self.num_verify_failures}

    def close(self) -> None:
        pass

    # the medium: one record per key
    def _write(self, key: str, record: bytes) -> None:
        raise NotImplementedError

    def _read(self, key: str) -> bytes | None:
        raise NotImplementedError

    def _delete(self, key: str) -> None:
        raise NotImplementedError


class HostStateShelf(StateShelf):
    """Snapshots in host memory."""

    medium = "host"

    def __init__(self, capacity: int, fmt: str):
        super().__init__(capacity, fmt)
        self.records: dict[str, bytearray] = {}

    def _write(self, key: str, record: bytes) -> None:
        self.records[key] = bytearray(record)

    def _read(self, key: str) -> bytes | None:
        r = self.records.get(key)
        return None if r is None else bytes(r)

    def _delete(self, key: str) -> None:
        self.records.pop(key, None)


class DiskStateShelf(StateShelf):
    """Snapshots as files in ``<prefix_disk_dir>/states`` (one file per record, written
    to a temporary name and renamed, so a crash leaves a whole record or none). A new
    shelf on the directory finds the records a previous one left (a warm restart),
    oldest first by modification time.

    The tier directory's rules hold here (docs/tier-directory.md): ``states`` must be a
    directory of this user's (a link or another user's is refused with
    :class:`~pagedkv.errors.TierFileError`), files are opened without following links
    and temporaries created exclusively; anything there but a regular file of ours is
    not read (a miss).

    Args:
        path: the directory (created when missing).
        capacity: records kept at most.
        fmt: the digest of the cache's format fingerprint.
    """

    medium = "disk"

    def __init__(self, path: str, capacity: int, fmt: str):
        super().__init__(capacity, fmt)
        self.path = path
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            raise TierFileError(expected(path, f"a directory owned by this user (uid {os.getuid()})",
                                         "a link or another kind of file" if not stat.S_ISDIR(st.st_mode)
                                         else f"one of uid {st.st_uid}"))
        found = []
        for entry in os.scandir(path):
            if not entry.is_file(follow_symlinks=False):
                continue
            if entry.name.endswith(_SUFFIX):
                est = entry.stat(follow_symlinks=False)
                found.append((est.st_mtime_ns, entry.name[:-len(_SUFFIX)], est.st_size))
            elif entry.name.endswith(".tmp"):
                os.unlink(entry.path)          # a write a crash interrupted
        for _, key, size in sorted(found):
            self._lru[key] = size
        while len(self._lru) > self.capacity:
            old, _ = self._lru.popitem(last=False)
            self._delete(old)

    def _file(self, key: str) -> str:
        return os.path.join(self.path, key + _SUFFIX)

    def _write(self, key: str, record: bytes) -> None:
        tmp = self._file(key) + ".tmp"
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(record)
        except BaseException:
            os.unlink(tmp)
            raise
        os.replace(tmp, self._file(key))

    def _read(self, key: str) -> bytes | None:
        try:
            fd = os.open(self._file(key), os.O_RDONLY | _NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return None                 # gone, or a link: a miss
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                return None
            return f.read()

    def _delete(self, key: str) -> None:
        try:
            os.unlink(self._file(key))
        except FileNotFoundError:
            pass


class RemoteStateShelf(StateShelf):
    """Snapshots on the remote tier's server (Redis, Valkey or a Redis Cluster), one
    value per record under ``<key_prefix>:<format>:state:<key>``, shared by every host
    that points at the server: another host's snapshot is found by :meth:`prefetch` (one
    pipelined ``EXISTS`` per prompt) and verified on read like a local one. The server's
    TTL and memory policy decide what it keeps, not ``capacity`` (which bounds only this
    process's index of the records it wrote). A server that is down, slow or refuses
    costs a miss within ``timeout_s``, never an error or a hang.

    Args:
        remote: the remote tier's :class:`~pagedkv.config.remote.RemoteTierConfig`.
        capacity: records this process remembers writing.
        fmt: the digest of the cache's format fingerprint.
    """

    medium = "remote"

    def __init__(self, remote, capacity: int, fmt: str):
        from pagedkv.tiers.remote_client import RemoteClient

        super().__init__(capacity, fmt)
        self.client = RemoteClient(remote, readers=2)
        self.prefix = f"{remote.key_prefix}:{fmt[:32]}:state:"
        self.ttl_ms = None if remote.ttl_s is None else max(1, int(remote.ttl_s * 1000))
        self._seen: set[str] = set()       # keys the last prefetch found on the server
        self.num_errors = 0

    def __contains__(self, key: str) -> bool:
        return key in self._lru or key in self._seen

    def prefetch(self, keys: list[str]) -> None:
        from pagedkv.tiers.remote_client import Unavailable

        ask = [k for k in keys if k not in self._lru]
        self._seen = set()
        if not ask:
            return
        names = [self.prefix + k for k in ask]

        def exists(client, names):
            pipe = client.pipeline(transaction=False)
            for n in names:
                pipe.exists(n)
            return pipe.execute()

        try:
            found = self.client.call(exists, names)
        except Unavailable:
            self.num_errors += 1
            return
        self._seen = {k for k, f in zip(ask, found) if f}

    def put(self, key: str, ns_key: bytes, tokens: np.ndarray, payload: bytes) -> None:
        record = encode(self.fmt, ns_key, tokens, payload)
        if not self._write(key, record):
            return
        self._lru[key] = len(record)
        self._lru.move_to_end(key)
        self.num_stored += 1
        while len(self._lru) > self.capacity:     # forget, never delete: other hosts may read it
            self._lru.popitem(last=False)

    def clear(self) -> None:
        super().clear()
        self._seen = set()

    def stats(self) -> dict:
        return dict(super().stats(), errors=self.num_errors)

    def close(self) -> None:
        self.client.close()

    def _call(self, fn, *args):
        from pagedkv.tiers.remote_client import Unavailable

        try:
            return True, self.client.call(fn, *args)
        except Unavailable:
            self.num_errors += 1
            return False, None

    def _write(self, key: str, record: bytes) -> bool:   # type: ignore[override]
        ok, _ = self._call(lambda c, n, v, px: c.set(n, v, px=px), self.prefix + key, record, self.ttl_ms)
        return ok

    def _read(self, key: str) -> bytes | None:
        ok, value = self._call(lambda c, n: c.get(n), self.prefix + key)
        return value if ok and isinstance(value, bytes) else None

    def _delete(self, key: str) -> None:
        self._seen.discard(key)
        self._call(lambda c, n: c.delete(n), self.prefix + key)


def build_shelves(cfg, store) -> list[StateShelf]:
    """The shelves of ``cfg``'s host, disk and remote tiers, top tier first. The host and
    disk shelves keep as many snapshots as the device state pool has slots; the remote
    one what its server keeps."""
    from pagedkv.format.fingerprint import kv_format

    fmt = hashlib.sha256(json.dumps(kv_format(store, cfg.prefix_disk_tag), sort_keys=True).encode()).hexdigest()
    cap = cfg.resolved_state_slots
    shelves: list[StateShelf] = []
    if cfg.prefix_host_blocks:
        shelves.append(HostStateShelf(cap, fmt))
    if cfg.prefix_disk_blocks:
        shelves.append(DiskStateShelf(os.path.join(cfg.prefix_disk_dir, "states"), cap, fmt))
    if cfg.prefix_remote is not None:
        shelves.append(RemoteStateShelf(cfg.prefix_remote, cap, fmt))
    return shelves
