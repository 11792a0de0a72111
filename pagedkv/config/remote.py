"""RemoteTierConfig: where a remote prefix tier lives and how it behaves.

A remote tier is a Redis (or Valkey) server or a Redis Cluster that several hosts
share (see :mod:`pagedkv.tiers.remote`). Pass one as ``CacheConfig(prefix_remote=...)``,
or just its URL.
"""
from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from pagedkv.errors import ArgumentTypeError, InvalidArgumentError, expected

__all__ = ["RemoteTierConfig", "REMOTE_SCHEMES"]

#: URL schemes: one server (``redis``, ``rediss`` with TLS, ``unix`` socket) or a cluster
#: (``redis+cluster``, ``rediss+cluster``: any reachable node; the rest are discovered)
REMOTE_SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")
_KEY_PREFIX = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


def _number(name: str, value: Any, minimum: float, *, integer: bool = False, allow_none: bool = False):
    if value is None and allow_none:
        return None
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind):
        what = ("an int" if integer else "a number") + (" or None" if allow_none else "")
        raise ArgumentTypeError(expected(f"prefix_remote.{name}", what, f"{type(value).__name__} {value!r}"[:200]))
    v = int(value) if integer else float(value)  # type: ignore[call-overload]  # an Integral when integer
    if not math.isfinite(v) or v < minimum:
        raise InvalidArgumentError(expected(f"prefix_remote.{name}", f"a number >= {minimum}", repr(value)))
    return v


@dataclass(frozen=True)
class RemoteTierConfig:
    """Args:
        url: ``redis://host:port[/db]``, ``rediss://...`` (TLS), ``unix:///path.sock``, or
            ``redis+cluster://host:port[,host:port...]`` for a Redis Cluster.
        key_prefix: the keys' first part (several deployments on one server keep apart).
        ttl_s: a stored block's time to live on the server (refreshed by each hit);
            None: no TTL, the server's ``maxmemory`` eviction policy alone decides.
        timeout_s: the longest a lookup or a load waits on the server; past it, a miss.
            Connecting and every socket read use it too.
        retry_after_s: after a failure (timeout, refused or dropped connection) the tier
            is skipped this long (doubling up to 30 s while failures go on): a down
            server costs one timeout, not one per request.
        max_queue_bytes: the background writer's bound: a store that would pass it is
            dropped (counted in the tier's stats), never waited for.
        max_landed_bytes: fetched blocks kept for the load that follows (and prefetched
            ones): a bounded cache, least recently used first out.
        batch_blocks: blocks per pipelined batch of gets or sets.
        secret: with a secret shared by the hosts (bytes or str), every value carries a
            keyed BLAKE2b tag instead of a CRC-32: a server that rewrites values cannot
            forge one. The secret is not part of the key.
        check_existing: the writer first asks which keys the server already holds (one
            more round trip a batch) and sends only the others, refreshing their TTL:
            worth it when hosts often compute the same prefix at once. Without it a
            block already there is written again (same bytes). Blocks a host fetched
            from the tier are never sent back either way.
    """

    url: str
    key_prefix: str = "pagedkv"
    ttl_s: float | None = 24 * 3600.0
    timeout_s: float = 0.5
    retry_after_s: float = 1.0
    max_queue_bytes: int = 256 << 20
    max_landed_bytes: int = 256 << 20
    batch_blocks: int = 32
    secret: bytes | str | None = None
    check_existing: bool = False

    def __post_init__(self) -> None:
        put = object.__setattr__
        if not isinstance(self.url, str):
            raise ArgumentTypeError(expected("prefix_remote.url", "a str", type(self.url).__name__))
        scheme = urlsplit(self.url).scheme
        if scheme not in REMOTE_SCHEMES:
            raise InvalidArgumentError(expected("prefix_remote.url", "a URL with a scheme among "
                                                + ", ".join(REMOTE_SCHEMES), repr(self.url)[:200]))
        if not isinstance(self.key_prefix, str) or not _KEY_PREFIX.fullmatch(self.key_prefix):
            raise InvalidArgumentError(expected("prefix_remote.key_prefix", "1 to 64 characters of [A-Za-z0-9_.:-]",
                                                repr(self.key_prefix)[:200]))
        ttl = _number("ttl_s", self.ttl_s, 0.001, allow_none=True)
        put(self, "ttl_s", ttl)
        put(self, "timeout_s", _number("timeout_s", self.timeout_s, 0.001))
        put(self, "retry_after_s", _number("retry_after_s", self.retry_after_s, 0.0))
        put(self, "max_queue_bytes", _number("max_queue_bytes", self.max_queue_bytes, 0, integer=True))
        put(self, "max_landed_bytes", _number("max_landed_bytes", self.max_landed_bytes, 0, integer=True))
        put(self, "batch_blocks", _number("batch_blocks", self.batch_blocks, 1, integer=True))
        if isinstance(self.secret, str):
            put(self, "secret", self.secret.encode("utf-8"))
        if self.secret is not None and (not isinstance(self.secret, bytes) or not 1 <= len(self.secret) <= 64):
            raise InvalidArgumentError(expected("prefix_remote.secret", "None, or 1 to 64 bytes (a str is encoded "
                                                "as UTF-8)", f"{type(self.secret).__name__} of length "
                                                f"{len(self.secret) if hasattr(self.secret, '__len__') else '?'}"))
        if not isinstance(self.check_existing, bool):
            raise ArgumentTypeError(expected("prefix_remote.check_existing", "True or False", repr(self.check_existing)))

    @property
    def cluster(self) -> bool:
        return urlsplit(self.url).scheme.endswith("+cluster")

    @classmethod
    def of(cls, value: Any) -> RemoteTierConfig | None:
        """``value`` as a config: None, a URL, a mapping of the fields, or a config."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            return cls(url=value)
        if isinstance(value, dict):
            unknown = sorted(set(value) - set(cls.__dataclass_fields__))
            if unknown:
                raise InvalidArgumentError(expected("prefix_remote", f"keys among {sorted(cls.__dataclass_fields__)}",
                                                    f"unknown key {unknown[0]!r}"))
            if "url" not in value:
                raise InvalidArgumentError(expected("prefix_remote", "a mapping with a 'url'", sorted(value)))
            return cls(**value)
        raise ArgumentTypeError(expected("prefix_remote", "None, a URL, a dict or a RemoteTierConfig",
                                         type(value).__name__))

    def __repr__(self) -> str:      # the secret stays out of logs and error messages
        shown = {k: getattr(self, k) for k in self.__dataclass_fields__}
        if shown["secret"] is not None:
            shown["secret"] = "<hidden>"
        return "RemoteTierConfig(" + ", ".join(f"{k}={v!r}" for k, v in shown.items()) + ")"
