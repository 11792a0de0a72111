"""A remote tier's keys and values.

Key: ``<key_prefix>:`` + the tier's format fingerprint (16 bytes) + ``:`` + the block's
chain digest (16 bytes, :func:`pagedkv.tiers.verify.chain_digest`), both in hex: the
verified chain, the namespace (inside the digest) and the format. Hex, because a Redis
Cluster hashes only what lies between a key's first ``{`` and the next ``}``: raw bytes
that happen to hold a brace would put a whole format's keys on one node.

Value: a header, then the block's record in pagedkv's at-rest format
(:mod:`pagedkv.tiers.payload`: codes, scales, block keys, sink and window rows)::

    magic      4   b"PKVR"
    version    1
    flags      1   bit 0: the record's sink and window rows are all empty and not sent
    tag_bytes  2   4 (CRC-32C) or 16 (keyed BLAKE2b)
    fingerprint 16 the format (must equal this tier's)
    digest     16  the block's chain digest (must equal the key's)
    parent     16  its parent's chain digest (must equal the query's previous block's)
    block_size 4
    record_bytes 8 (must equal this tier's, and the value's length must agree)
    tokens     4 * block_size (int32; must equal the query block's)
    tag        4 or 16, over everything before it and the record as sent
    record     record_bytes (or, flag 0, up to its rows: the rest is zeros)

A block of a quantized cache keeps model-precision rows only near a sequence's head
(sinks) and tail (the recent window): every other block's value leaves its empty rows
out, so the network moves its codes and scales only.

Anything else (another fingerprint, a value for another key, a truncated value, a bad
tag) is refused: a miss, counted by reason, never wrong KV.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import struct

import numpy as np

from pagedkv._core.crc import crc32c
from pagedkv.tiers.verify import checksum, same_block

__all__ = ["Wire", "WIRE_VERSION", "format_fingerprint"]

MAGIC = b"PKVR"
WIRE_VERSION = 2              # 2: the unkeyed tag is a CRC-32C (1 had zlib's CRC-32, 8x slower here)
_FIXED = struct.Struct("<4sBBH16s16s16sIQ")
_ROWS_OMITTED = 1


def format_fingerprint(kv_format: dict, layout_description: list) -> bytes:
    """16 bytes naming what a record's bytes mean: the cache's KV format and the
    payload layout (sections, offsets, dtypes, shapes) and the wire version."""
    text = json.dumps({"kv_format": kv_format, "layout": layout_description, "wire": WIRE_VERSION},
                      sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16, person=b"pagedkv-format-1").digest()


class Wire:
    """Keys and values of one remote tier.

    Args:
        key_prefix: the keys' first part.
        fingerprint: :func:`format_fingerprint` of the tier's format.
        block_size: tokens per block.
        record_bytes: bytes of one record.
        secret: None (CRC-32), or the key of a BLAKE2b tag.
    """

    def __init__(self, key_prefix: str, fingerprint: bytes, block_size: int, record_bytes: int,
                 secret: bytes | None = None, rows: tuple[int, int, int] | None = None):
        self.prefix = key_prefix.encode("ascii") + b":" + fingerprint.hex().encode("ascii") + b":"
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.record_bytes = record_bytes
        self.secret = secret
        self.tag_bytes = 4 if secret is None else 16
        self.header_bytes = _FIXED.size + 4 * block_size + self.tag_bytes
        self.value_bytes = self.header_bytes + record_bytes
        # (rows offset, rows_valid offset, rows_valid end) in a record, or None: no rows
        self.rows = rows

    def tag(self, parts) -> bytes:
        """The tag of the concatenated buffers ``parts``: a CRC-32C (little endian; the
        CPU's crc32 instruction, where the record's bytes cost least), or with a secret
        a keyed BLAKE2b (:func:`pagedkv.tiers.verify.checksum`)."""
        if self.secret is not None:
            return checksum(parts, self.secret)
        crc = 0
        for p in parts:
            crc = crc32c(p, crc)
        return crc.to_bytes(4, "little")

    def key(self, digest: bytes) -> bytes:
        return self.prefix + digest.hex().encode("ascii")

    def pattern(self) -> bytes:
        """A SCAN pattern of every key of this tier's format (glob characters escaped)."""
        return b"".join(b"\\" + bytes([c]) if c in b"*?[]\\" else bytes([c]) for c in self.prefix) + b"*"

    def encode(self, digest: bytes, parent: bytes, tokens: np.ndarray, record) -> bytes:
        """The value of a block (``record``: its record's bytes)."""
        buf = np.empty(self.value_bytes, dtype=np.uint8)
        buf[self.header_bytes:] = np.frombuffer(memoryview(record).cast("B"), dtype=np.uint8)
        return bytes(self.encode_into(buf, digest, parent, tokens))

    def encode_into(self, buf: np.ndarray, digest: bytes, parent: bytes, tokens: np.ndarray) -> memoryview:
        """Write the header of the block whose record is ``buf[header_bytes:]`` in front
        of it (``buf``: ``value_bytes`` uint8); returns the value, a view of ``buf``: the
        record is not copied (the client sends it as it is)."""
        hb = self.header_bytes
        view = memoryview(buf.data)
        rec = view[hb:]
        flags, sent = 0, self.record_bytes
        if self.rows is not None and not buf[hb + self.rows[1]:hb + self.rows[2]].any():
            flags, sent = _ROWS_OMITTED, self.rows[0]
        head = _FIXED.pack(MAGIC, WIRE_VERSION, flags, self.tag_bytes, self.fingerprint, digest, parent,
                           self.block_size, self.record_bytes) + np.ascontiguousarray(tokens, dtype="<i4").tobytes()
        n = len(head)
        buf[:n] = np.frombuffer(head, dtype=np.uint8)
        buf[n:hb] = np.frombuffer(self.tag((head, rec[:sent])), dtype=np.uint8)
        return view[:hb + sent]

    def decode(self, value, digest: bytes, parent: bytes, tokens: np.ndarray) -> tuple[memoryview | None, str]:
        """``(record, "")`` when ``value`` is the block ``digest`` under ``parent`` with
        ``tokens`` in this format, else ``(None, reason)``. ``record`` is a view of
        ``value`` (no copy): the whole record, or the part before its rows when the value
        left them out (the rest is zeros)."""
        if value is None:
            return None, "missing"
        view = memoryview(value)
        if len(view) < _FIXED.size:
            return None, "truncated"
        magic, version, flags, tag_bytes, fp, got, got_parent, bs, rb = _FIXED.unpack_from(view, 0)
        if magic != MAGIC or version != WIRE_VERSION or flags & ~_ROWS_OMITTED:
            return None, "foreign"
        if fp != self.fingerprint:
            return None, "other_format"
        if tag_bytes != self.tag_bytes or bs != self.block_size or rb != self.record_bytes:
            return None, "other_format"
        omitted = bool(flags & _ROWS_OMITTED)
        if omitted and self.rows is None:
            return None, "other_format"
        sent = self.rows[0] if omitted else self.record_bytes       # type: ignore[index]  # checked above
        if len(view) != self.header_bytes + sent:
            return None, "truncated"
        toks = np.frombuffer(view, dtype="<i4", count=bs, offset=_FIXED.size)
        if got != digest or not same_block(toks, 0, bytes(got_parent), tokens, 0, parent):
            return None, "other_key"
        head = view[:_FIXED.size + 4 * bs]
        tag = view[_FIXED.size + 4 * bs:self.header_bytes]
        record = view[self.header_bytes:]
        if not hmac.compare_digest(self.tag((head, record)), bytes(tag)):
            return None, "checksum"
        return record, ""
