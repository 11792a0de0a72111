"""What every tier checks before a block counts as a hit, in one place.

A tier's block is the query's block only when all of these hold:

- **tokens**: its stored tokens equal the query block's (a hash finds candidates; it
  never decides);
- **namespace**: it was stored under the query's namespace key (cache salt, adapter,
  layer group);
- **link**: its parent is the block the query's previous block resolved to (a local
  tier: the parent slot and that slot's generation; a remote tier: the parent's chain
  digest), so by induction its whole prefix equals the query's;
- **format**: its tier was written for this cache's KV format (a disk tier's header, a
  remote value's fingerprint);
- **checksum**: its bytes are the bytes that were stored (CRC-32, or a keyed BLAKE2b
  tag where the tier is given a secret), checked before they reach the device.

:class:`ChainQuery` carries a query's blocks and, for keyed tiers, their chain digests
(BLAKE2b-128 over the parent's digest, the namespace key and the tokens: process and
host independent, so two hosts name a prefix alike).
"""
from __future__ import annotations

import hashlib
import hmac
import zlib

import numpy as np

__all__ = ["ChainQuery", "chain_digest", "same_block", "ROOT_DIGEST", "checksum", "checksum_ok"]

#: the parent digest of a chain's first block
ROOT_DIGEST = bytes(16)


def chain_digest(parent: bytes, ns_key: bytes, tokens: np.ndarray) -> bytes:
    """The chain digest of a block: BLAKE2b-128 of its parent's digest, its namespace key
    and its tokens (int32, little endian)."""
    h = hashlib.blake2b(digest_size=16, person=b"pagedkv-chain-v1")
    h.update(parent)
    h.update(len(ns_key).to_bytes(4, "little"))
    h.update(ns_key)
    h.update(np.ascontiguousarray(tokens, dtype="<i4").tobytes())
    return h.digest()


def same_block(tokens: np.ndarray, ns, parent, want_tokens: np.ndarray, want_ns, want_parent) -> bool:
    """Tokens, namespace and link of a stored block against the query's (see the module
    docstring). ``ns`` and ``parent`` are compared as the tier names them."""
    return ns == want_ns and parent == want_parent and bool(np.array_equal(tokens, want_tokens))


def checksum(parts, secret: bytes | None = None) -> bytes:
    """The checksum of the concatenated buffers ``parts``: a 4-byte CRC-32 (little
    endian), or, with a ``secret``, a 16-byte keyed BLAKE2b tag (a server that rewrites
    values cannot forge it)."""
    if secret is None:
        crc = 0
        for p in parts:
            crc = zlib.crc32(p, crc)
        return crc.to_bytes(4, "little")
    h = hashlib.blake2b(digest_size=16, key=secret, person=b"pagedkv-value-v1")
    for p in parts:
        h.update(p)
    return h.digest()


def checksum_ok(parts, tag, secret: bytes | None = None) -> bool:
    return hmac.compare_digest(checksum(parts, secret), bytes(tag))


class ChainQuery:
    """A query's full blocks as every tier sees them.

    Args:
        tokens: the query's token ids (int32; a trailing partial block is ignored).
        ns_key: the namespace key (cache salt, adapter id and layer group).
        block_size: tokens per block.
    """

    def __init__(self, tokens: np.ndarray, ns_key: bytes, block_size: int):
        self.tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        self.ns_key = bytes(ns_key)
        self.block_size = block_size
        self.num_blocks = len(self.tokens) // block_size
        self._digests: list[bytes] = []

    def block(self, i: int) -> np.ndarray:
        bs = self.block_size
        return self.tokens[i * bs:(i + 1) * bs]

    def digest(self, i: int) -> bytes:
        """The chain digest of block ``i`` (computed once, root first)."""
        d = self._digests
        while len(d) <= i:
            d.append(chain_digest(d[-1] if d else ROOT_DIGEST, self.ns_key, self.block(len(d))))
        return d[i]

    def parent_digest(self, i: int) -> bytes:
        return ROOT_DIGEST if i == 0 else self.digest(i - 1)
