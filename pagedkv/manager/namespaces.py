"""Prefix-cache namespaces: ``(cache_salt, adapter_id)`` -> ``(ns_id, ns_hash)``.

Sequences in different namespaces never share KV blocks. The core keeps the small
``ns_id`` with every cached block and compares it exactly before a block is reused;
``ns_hash`` seeds the block hash chain, so one prefix hashes differently per namespace
(and a router mirroring KV events sees different hashes).

Two namespaces are the same only when their salts and adapter ids are equal *and of
the same types*, recursively through tuples: adapters ``1``, ``True`` and ``1.0`` are
three namespaces (Python's ``==``, and so a plain dict, would make them one). The
hash's input tags each field with its type the same way.

An id, once given, stays with its namespace for the cache's life: cached blocks carry
it after every sequence of the namespace is gone, and a later sequence of the same
namespace must find them. Only admissions register a namespace; lookups
(``match_prefix``, ``pin_prefix``...) of an unknown namespace register nothing.

Ids are per process. What leaves the process (a prefix tier's disk files, a peer over
:mod:`pagedkv.transfer.distributed`) names a namespace by its *key*, the bytes its hash is
computed from (:func:`namespace_key`).
"""
from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from pagedkv._core.prefix import hash_bytes
from pagedkv.errors import ArgumentTypeError, InvalidArgumentError, expected
from pagedkv.manager.seq_ids import strict_key

__all__ = ["NamespaceRegistry", "DEFAULT", "namespace_key", "namespace_hash"]

#: the default namespace (no salt, no adapter): id 0, hash 0
DEFAULT: tuple[int, int] = (0, 0)

_NS_MAX = 2**31 - 1   # ns ids are int32 in the core


class NamespaceRegistry:
    """The namespaces a cache has admitted (see the module docstring)."""

    __slots__ = ("_ids", "_names", "_hashes", "_keys", "_by_key")

    def __init__(self) -> None:
        self._ids: dict[Hashable, int] = {(None, None): 0}       # strict key -> ns id
        self._names: dict[int, tuple[Any, Any]] = {0: (None, None)}
        self._hashes: dict[int, int] = {0: 0}
        default = namespace_key(None, None)
        self._keys: dict[int, bytes] = {0: default}               # ns id -> namespace key
        self._by_key: dict[bytes, int] = {default: 0}

    def __len__(self) -> int:
        return len(self._names)

    def find(self, cache_salt: str | None, adapter_id: Any) -> tuple[int, int] | None:
        """``(ns_id, ns_hash)`` of a registered namespace, or None (nothing cached in it)."""
        if cache_salt is None and adapter_id is None:
            return DEFAULT
        ns_id = self._ids.get(_key(cache_salt, adapter_id))
        return None if ns_id is None else (ns_id, self._hashes[ns_id])

    def register(self, cache_salt: str | None, adapter_id: Any) -> tuple[int, int]:
        """``(ns_id, ns_hash)``, registering the namespace on first use."""
        if cache_salt is None and adapter_id is None:
            return DEFAULT
        key = _key(cache_salt, adapter_id)
        ns_id = self._ids.get(key)
        if ns_id is not None:
            return ns_id, self._hashes[ns_id]
        ns_id = len(self._names)
        if ns_id > _NS_MAX:
            raise InvalidArgumentError(expected("cache_salt, adapter_id", f"at most {_NS_MAX} namespaces",
                                                "one more"))
        self._ids[key] = ns_id
        self._names[ns_id] = (cache_salt, adapter_id)
        nkey = namespace_key(cache_salt, adapter_id)
        self._hashes[ns_id] = hash_bytes(nkey)
        self._keys[ns_id] = nkey
        self._by_key[nkey] = ns_id
        return ns_id, self._hashes[ns_id]

    def rollback(self, size: int) -> None:
        """Forget the namespaces registered after the registry had ``size`` of them
        (an admission that registered one failed, so nothing can refer to it)."""
        for ns_id in range(size, len(self._names)):
            name = self._names.pop(ns_id)
            del self._hashes[ns_id]
            del self._ids[_key(*name)]
            del self._by_key[self._keys.pop(ns_id)]

    def name(self, ns_id: int) -> tuple[Any, Any]:
        """``(cache_salt, adapter_id)`` of a namespace id."""
        return self._names[ns_id]

    def hash_of(self, ns_id: int) -> int:
        return self._hashes[ns_id]

    def key_of(self, ns_id: int) -> bytes:
        """The process-independent key of a namespace id."""
        return self._keys[ns_id]

    def hash_of_key(self, nkey: bytes) -> int:
        """The hash seed of a namespace key (registered here or not). The default
        namespace's seed is 0 by convention, not the hash of its key."""
        ns_id = self._by_key.get(nkey)
        return hash_bytes(nkey) if ns_id is None else self._hashes[ns_id]

    def name_of_key(self, nkey: bytes):
        """``(cache_salt, adapter_id)`` of a namespace key as KV events name it (None for
        the default); the raw key when this process has not used that namespace."""
        ns_id = self._by_key.get(nkey)
        if ns_id is None:
            return nkey
        name = self._names[ns_id]
        return None if name == (None, None) else name


def _key(cache_salt: str | None, adapter_id: Any) -> Hashable:
    if cache_salt is not None and type(cache_salt) is not str:
        raise InvalidArgumentError(expected("cache_salt", "a str or None", type(cache_salt).__name__))
    try:
        return (cache_salt, strict_key(adapter_id))
    except TypeError:
        raise ArgumentTypeError(expected("adapter_id", "a hashable adapter id or None",
                                         type(adapter_id).__name__)) from None


def namespace_hash(cache_salt: str | None, adapter_id: Any) -> int:
    """The namespace's hash seed: the hash of :func:`namespace_key` (0 for the default)."""
    if cache_salt is None and adapter_id is None:
        return 0
    return hash_bytes(namespace_key(cache_salt, adapter_id))


def namespace_key(cache_salt: str | None, adapter_id: Any) -> bytes:
    """The process-independent key of a namespace. Domain separation: each field is
    tagged and length-prefixed, with its type, so a salt "X" and an adapter "X" (or
    "a" + "bc" vs "ab" + "c", or adapter 1 vs True) never collide by construction."""
    parts = [b"pagedkv-namespace-v1"]
    for tag, value in ((b"salt", cache_salt), (b"adapter", adapter_id)):
        if value is None:
            parts.append(tag + b":none")
        else:
            raw = value.encode() if isinstance(value, str) else repr(value).encode()
            kind = type(value).__name__.encode()
            parts.append(tag + b":" + kind + b":" + str(len(raw)).encode() + b":" + raw)
    return b"\x00".join(parts)
