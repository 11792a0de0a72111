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
"""
from __future__ import annotations

from typing import Any, Dict, Hashable, Optional, Tuple

from pagedkv._core.prefix import hash_bytes
from pagedkv.errors import ArgumentTypeError, InvalidArgumentError, expected
from pagedkv.seq_ids import strict_key

__all__ = ["NamespaceRegistry", "DEFAULT"]

#: the default namespace (no salt, no adapter): id 0, hash 0
DEFAULT: Tuple[int, int] = (0, 0)

_NS_MAX = 2**31 - 1   # ns ids are int32 in the core


class NamespaceRegistry:
    """The namespaces a cache has admitted (see the module docstring)."""

    __slots__ = ("_ids", "_names", "_hashes")

    def __init__(self) -> None:
        self._ids: Dict[Hashable, int] = {(None, None): 0}       # strict key -> ns id
        self._names: Dict[int, Tuple[Any, Any]] = {0: (None, None)}
        self._hashes: Dict[int, int] = {0: 0}

    def __len__(self) -> int:
        return len(self._names)

    def find(self, cache_salt: Optional[str], adapter_id: Any) -> Optional[Tuple[int, int]]:
        """``(ns_id, ns_hash)`` of a registered namespace, or None (nothing cached in it)."""
        if cache_salt is None and adapter_id is None:
            return DEFAULT
        ns_id = self._ids.get(_key(cache_salt, adapter_id))
        return None if ns_id is None else (ns_id, self._hashes[ns_id])

    def register(self, cache_salt: Optional[str], adapter_id: Any) -> Tuple[int, int]:
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
        self._hashes[ns_id] = namespace_hash(cache_salt, adapter_id)
        return ns_id, self._hashes[ns_id]

    def rollback(self, size: int) -> None:
        """Forget the namespaces registered after the registry had ``size`` of them
        (an admission that registered one failed, so nothing can refer to it)."""
        for ns_id in range(size, len(self._names)):
            name = self._names.pop(ns_id)
            del self._hashes[ns_id]
            del self._ids[_key(*name)]

    def name(self, ns_id: int) -> Tuple[Any, Any]:
        """``(cache_salt, adapter_id)`` of a namespace id."""
        return self._names[ns_id]

    def hash_of(self, ns_id: int) -> int:
        return self._hashes[ns_id]


def _key(cache_salt: Optional[str], adapter_id: Any) -> Hashable:
    if cache_salt is not None and type(cache_salt) is not str:
        raise InvalidArgumentError(expected("cache_salt", "a str or None", type(cache_salt).__name__))
    try:
        return (cache_salt, strict_key(adapter_id))
    except TypeError:
        raise ArgumentTypeError(expected("adapter_id", "a hashable adapter id or None",
                                         type(adapter_id).__name__)) from None


def namespace_hash(cache_salt: Optional[str], adapter_id: Any) -> int:
    """The namespace's hash seed. Domain separation: each field is tagged and
    length-prefixed, with its type, so a salt "X" and an adapter "X" (or "a" + "bc" vs
    "ab" + "c", or adapter 1 vs True) never hash alike by construction."""
    parts = [b"pagedkv-namespace-v1"]
    for tag, value in ((b"salt", cache_salt), (b"adapter", adapter_id)):
        if value is None:
            parts.append(tag + b":none")
        else:
            raw = value.encode() if isinstance(value, str) else repr(value).encode()
            kind = type(value).__name__.encode()
            parts.append(tag + b":" + kind + b":" + str(len(raw)).encode() + b":" + raw)
    return hash_bytes(b"\x00".join(parts))
