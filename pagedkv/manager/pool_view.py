"""The read-only face of a cache's block pool.

``PagedKVCache.pool`` lets a caller watch the pool (free counts, lists, states, ref
counts, invariants) but not change it: the cache's sequences own its blocks, and a
direct ``free`` or ``allocate`` would leave the cache's tables pointing at blocks the
pool thinks are somewhere else. Taking and releasing blocks goes through the cache.
"""
from __future__ import annotations

from typing import Any

from pagedkv.errors import InvalidArgumentError, expected

# Calls that change the pool; the cache offers each through its own API.
_MUTATING = {
    "allocate": "reserve/add_sequence", "allocate_many": "reserve", "free": "free",
    "touch": "match_prefix/add_sequence", "mark_cached": "commit", "pin": "pin_prefix",
    "unpin": "unpin_prefix", "reset_cache": "reset_prefix_cache", "__setstate__": "a new cache",
}


class PoolView:
    """Forwards every read of a :class:`~pagedkv._core.pool.BlockPool`; refuses writes
    with a typed error naming the cache call to use instead."""

    __slots__ = ("_pool",)

    def __init__(self, pool: Any):
        object.__setattr__(self, "_pool", pool)

    def __getattr__(self, name: str) -> Any:
        use = _MUTATING.get(name)
        if use is None:
            return getattr(self._pool, name)

        def refused(*args: Any, **kwargs: Any) -> None:
            raise InvalidArgumentError(expected(
                "cache.pool", f"read-only use (the cache's sequences own its blocks: use cache.{use})",
                f"a call to pool.{name}()"))
        return refused

    def __setattr__(self, name: str, value: Any) -> None:
        raise InvalidArgumentError(expected("cache.pool", "read-only use", f"setting pool.{name}"))

    def __len__(self) -> int:
        return self._pool.num_blocks

    def __repr__(self) -> str:
        return f"PoolView({self._pool!r})"
