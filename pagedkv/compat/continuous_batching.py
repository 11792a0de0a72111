"""Seed 000 (``ContinuousBatchKVCacheManager``) on a :class:`~pagedkv.manager.cache.PagedKVCache`.

A request is a sequence of the cache; a page is a block (``page_size_tokens`` must
equal the cache's ``block_size``). Allocating reserves whole pages for the request
(``initial_pages_per_request`` at least, ``max_pages_per_request`` at most), all or
nothing: the seed's allocate-then-roll-back loop is one ``reserve`` call that either
succeeds or changes nothing. The engine then writes and reads KV through the cache
(``slot_mapping``, ``write``, ``gather``, ``page_table_csr``...).

Byte counts follow the seed: ``pages * page_size_bytes`` with ``page_size_bytes =
page_size_tokens * cache_block_size_bytes``. ``KVCacheConfiguration.for_cache`` sets
``cache_block_size_bytes`` to the cache's real bytes per token (the seed's default
1 KiB is a placeholder).

``compact_cache`` is real (the seed left a placeholder): when compaction is enabled
and utilization is below target, blocks of this manager's requests move down into the
lowest free blocks, highest first, with their KV copied, by the cache's own
``compact`` (see :meth:`ContinuousBatchKVCacheManager.compact_cache`).

A request swapped out through the cache's host tier holds no device pages (its
allocation lists none, it cannot be extended) until it is swapped back in, with the
pages of its committed tokens (the host tier keeps those).

Thread safety: a lock serialises the manager's calls; the cache's ``compact`` holds
the cache's lock, so no other user of the cache can allocate in the middle of it.
"""
from __future__ import annotations

import numbers
import threading
from collections.abc import Hashable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, ClassVar

import numpy as np

from pagedkv.errors import InvalidArgumentError, OutOfBlocksError, SequenceExistsError, expected
from pagedkv.manager.cache import PagedKVCache

__all__ = ["KVCacheConfiguration", "CachePage", "CacheAllocation", "ContinuousBatchKVCacheManager"]

RequestId = Hashable


def _request(request_id: object) -> RequestId:
    try:
        hash(request_id)
    except TypeError:
        raise InvalidArgumentError(expected("request_id", "a hashable id", type(request_id).__name__)) from None
    return request_id


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise InvalidArgumentError(expected(name, f"an int >= {minimum}", repr(value)))
    return int(value)


@dataclass(frozen=True)
class KVCacheConfiguration:
    """The seed's configuration record, with its defaults."""

    page_size_tokens: int = 16
    initial_pages_per_request: int = 16      # 256 tokens at first
    max_pages_per_request: int = 256         # 4096 tokens at most
    cache_block_size_bytes: int = 1024       # bytes per token slot
    target_utilization: float = 0.85         # compact only below this (0-1)
    enable_compaction: bool = True

    DEFAULT: ClassVar[KVCacheConfiguration]

    def __post_init__(self) -> None:
        _check_int("page_size_tokens", self.page_size_tokens, 1)
        _check_int("initial_pages_per_request", self.initial_pages_per_request, 0)
        _check_int("max_pages_per_request", self.max_pages_per_request, 1)
        _check_int("cache_block_size_bytes", self.cache_block_size_bytes, 1)
        t = self.target_utilization
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not 0.0 <= t <= 1.0:
            raise InvalidArgumentError(expected("target_utilization", "a fraction in [0, 1]", repr(t)))
        if not isinstance(self.enable_compaction, bool):
            raise InvalidArgumentError(expected("enable_compaction", "True or False", repr(self.enable_compaction)))

    @property
    def page_size_bytes(self) -> int:
        return self.page_size_tokens * self.cache_block_size_bytes

    @classmethod
    def for_cache(cls, cache: PagedKVCache, **overrides) -> KVCacheConfiguration:
        """The seed's defaults with pages sized to ``cache``: ``page_size_tokens`` is
        its block size and ``cache_block_size_bytes`` its real bytes per token."""
        values: dict[str, Any] = dict(page_size_tokens=cache.config.block_size,
                      cache_block_size_bytes=cache.config.bytes_per_token)
        values.update(overrides)
        return cls(**values)


KVCacheConfiguration.DEFAULT = KVCacheConfiguration()


@dataclass(frozen=True)
class CachePage:
    page_index: int
    start_token: int
    token_count: int
    block_index: int

    @property
    def end_token(self) -> int:
        return self.start_token + self.token_count


@dataclass(frozen=True)
class CacheAllocation:
    """A snapshot of one request's pages (block indices as of the call)."""

    request_id: RequestId
    pages: tuple[CachePage, ...]
    total_tokens_allocated: int
    total_bytes_allocated: int
    allocated_time: datetime

    @property
    def page_count(self) -> int:
        return len(self.pages)

    @property
    def age(self) -> timedelta:
        return datetime.now(timezone.utc) - self.allocated_time


class ContinuousBatchKVCacheManager:
    """Per-request KV pages for a continuous-batching scheduler (see the module docstring).

    Args:
        paged_cache: the cache the pages come from. Requests are its sequences; other
            sequences in it are left alone.
        config: defaults to :meth:`KVCacheConfiguration.for_cache`.
    """

    def __init__(self, paged_cache: PagedKVCache, config: KVCacheConfiguration | None = None):
        if not isinstance(paged_cache, PagedKVCache):
            raise InvalidArgumentError(expected("paged_cache", "a PagedKVCache", type(paged_cache).__name__))
        self.cache = paged_cache
        self._lock = threading.RLock()
        self._allocated_at: dict[RequestId, datetime] = {}
        self.config = KVCacheConfiguration.for_cache(paged_cache) if config is None else config

    @property
    def config(self) -> KVCacheConfiguration:
        return self._config

    @config.setter
    def config(self, config: KVCacheConfiguration) -> None:
        """Replace the configuration (later calls use it; existing pages stay)."""
        if not isinstance(config, KVCacheConfiguration):
            raise InvalidArgumentError(expected("config", "a KVCacheConfiguration", type(config).__name__))
        bs = self.cache.config.block_size
        if config.page_size_tokens != bs:
            raise InvalidArgumentError(expected("config.page_size_tokens", f"the cache's block_size ({bs})",
                                                config.page_size_tokens))
        with self._lock:
            self._config = config

    # ---- helpers ---------------------------------------------------------------------
    def _pages(self, request_id: RequestId) -> int:
        if request_id not in self.cache:   # swapped out to the host tier: no device pages
            return 0
        return -(-self.cache.num_reserved(request_id) // self._config.page_size_tokens)

    def _reserve_pages(self, request_id: RequestId, pages: int) -> None:
        """Reserve up to ``pages`` whole pages (all or nothing)."""
        bs = self._config.page_size_tokens
        self.cache.reserve([request_id], [pages * bs - self.cache.num_reserved(request_id)])

    # ---- the seed's API ----------------------------------------------------------------
    def allocate_cache(self, request_id: RequestId, max_tokens: int) -> int:
        """Pages for up to ``max_tokens`` tokens (at least ``initial_pages_per_request``,
        at most ``max_pages_per_request``); returns the bytes allocated.

        All or nothing: on :class:`OutOfBlocksError` the request is not admitted and
        the cache is as it was.
        """
        request_id = _request(request_id)
        max_tokens = _check_int("max_tokens", max_tokens, 0)
        with self._lock:
            c = self._config
            pages = min(max(c.initial_pages_per_request, -(-max_tokens // c.page_size_tokens)),
                        c.max_pages_per_request)
            if request_id in self._allocated_at or request_id in self.cache:
                raise SequenceExistsError(request_id, "request_id")
            self.cache.add_sequence(request_id)
            try:
                self._reserve_pages(request_id, pages)
            except BaseException:
                self.cache.free([request_id])
                raise
            self._allocated_at[request_id] = datetime.now(timezone.utc)
            return pages * c.page_size_bytes

    def release_cache(self, request_id: RequestId) -> bool:
        """Free a request's pages; False (nothing done) for an unknown request."""
        request_id = _request(request_id)
        with self._lock:
            if self._allocated_at.pop(request_id, None) is None:
                return False
            self.cache.free([request_id])
            return True

    def get_current_usage_bytes(self) -> int:
        """Bytes allocated over all of this manager's requests."""
        with self._lock:
            pages = sum(self._pages(r) for r in self._allocated_at)
            return pages * self._config.page_size_bytes

    def try_extend_cache(self, request_id: RequestId, additional_tokens: int) -> bool:
        """Add pages for ``additional_tokens`` more tokens, capped at
        ``max_pages_per_request``. False, with nothing changed, for an unknown request,
        a request already at the cap, a zero extension, or too few free blocks."""
        request_id = _request(request_id)
        additional_tokens = _check_int("additional_tokens", additional_tokens, 0)
        with self._lock:
            if request_id not in self._allocated_at or request_id not in self.cache:
                return False
            c = self._config
            have = self._pages(request_id)
            add = min(-(-additional_tokens // c.page_size_tokens), c.max_pages_per_request - have)
            if add <= 0:
                return False
            try:
                self._reserve_pages(request_id, have + add)
            except OutOfBlocksError:
                return False
            return True

    def get_allocation(self, request_id: RequestId) -> CacheAllocation | None:
        """The request's pages now, or None for an unknown request."""
        request_id = _request(request_id)
        with self._lock:
            at = self._allocated_at.get(request_id)
            if at is None:
                return None
            c = self._config
            blocks = self.cache.block_table(request_id).tolist() if request_id in self.cache else []
            pages = tuple(CachePage(i, i * c.page_size_tokens, c.page_size_tokens, b) for i, b in enumerate(blocks))
            return CacheAllocation(request_id, pages, len(pages) * c.page_size_tokens,
                                   len(pages) * c.page_size_bytes, at)

    def requests(self) -> list[RequestId]:
        with self._lock:
            return list(self._allocated_at)

    def utilization(self) -> float:
        """Blocks in use / total blocks (the seed's ``CalculateFragmentationUtilization``)."""
        pool = self.cache.pool
        return pool.num_in_use_blocks / pool.num_blocks

    # ---- compaction ----------------------------------------------------------------------
    def compact_cache(self) -> np.ndarray:
        """Defragment: move this manager's blocks down into the lowest free blocks.

        Runs only when ``enable_compaction`` is set and :meth:`utilization` is below
        ``target_utilization`` (the seed's rule). Pairs the highest movable blocks with
        the lowest free (empty) blocks while that lowers them, copies their KV across
        all layers, and rewrites the requests' block tables. Returns the ``[P, 2]``
        int32 (src, dst) moves; with a bookkeeping-only cache (no store) nothing is
        copied, and the caller must copy these pairs before the cache allocates again.

        Done by the cache's :meth:`~pagedkv.manager.cache.PagedKVCache.compact` over this
        manager's device-resident requests: any of them moves (prefix-registered,
        namespaced, with token ids), but only the blocks it holds alone; blocks shared
        by forks or prefix hits, and other users' sequences, stay where they are.
        Token counts, token ids and priorities are unchanged. Slots taken before a
        compaction are stale after it.
        """
        with self._lock:
            c = self._config
            if not c.enable_compaction or self.utilization() >= c.target_utilization:
                return np.empty((0, 2), dtype=np.int32)
            return self.cache.compact([rid for rid in self._allocated_at if rid in self.cache])

    def __repr__(self) -> str:
        return f"ContinuousBatchKVCacheManager(requests={len(self._allocated_at)}, cache={self.cache!r})"

