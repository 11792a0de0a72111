"""The prefix-cache calls of :class:`~pagedkv.manager.cache.PagedKVCache`: what is
cached, what an admission would cost, pins and resets (the work is
:class:`~pagedkv.manager.prefix.Prefixes`'). A mixin of the facade, as
:mod:`~pagedkv.manager.data_calls` is.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["PrefixCalls"]


class PrefixCalls:
    """The prefix-cache calls of a :class:`~pagedkv.manager.cache.PagedKVCache` (see there)."""

    _prefix: Any
    config: Any

    def match_prefix(self, token_ids: Iterable[int], *, cache_salt: str | None = None,
                     adapter_id: Any = None) -> int:
        """Tokens of ``token_ids`` a new sequence would find cached now (no side effects),
        on the device or in a prefix tier (whichever holds more full blocks). With
        layer groups: the longest prefix every group holds (:meth:`match_prefix_groups`)."""
        return self._prefix.match_prefix(token_ids, cache_salt, adapter_id)

    def prefetch_prefix(self, token_ids: Iterable[int], *, cache_salt: str | None = None,
                        adapter_id: Any = None) -> None:
        """Start bringing the blocks of ``token_ids`` from a remote prefix tier in the
        background (no effect without one), so a later :meth:`add_sequence` of them
        finds them landed instead of waiting on the network."""
        self._prefix.prefetch_prefix(token_ids, cache_salt, adapter_id)

    def match_prefix_groups(self, token_ids: Iterable[int], *, cache_salt: str | None = None,
                            adapter_id: Any = None) -> dict:
        """Per layer group, the cached prefix of ``token_ids``: a dict of ``tokens`` (what
        an admission reuses: the longest prefix every group holds), ``per_group`` and
        ``limited_by`` (the group holding the least, or None). No side effects."""
        return self._prefix.match_prefix_groups(token_ids, cache_salt, adapter_id)

    def has_available_blocks(self, n: int = 1) -> bool:
        """Whether ``n`` blocks can be allocated now (free or evictable).

        It does not know about prefix hits; for an admission use :meth:`can_admit`."""
        return self._prefix.has_available_blocks(n)

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether ``num_tokens`` tokens' worth of new blocks can be allocated now."""
        return self.has_available_blocks(self.config.blocks_for_tokens(num_tokens))

    def blocks_to_admit(self, prompt_token_ids: Iterable[int], num_tokens: int | None = None, *,
                        cache_salt: str | None = None, adapter_id: Any = None) -> int:
        """Free blocks that admitting this prompt, then reserving ``num_tokens`` tokens
        in all (default: the prompt), takes out of the pool now.

        Exact, where counting blocks is not: the prompt's cached prefix (in its
        namespace, without its last token, which is always computed) is not allocated,
        but each of its blocks that sits cached-free and evictable *is* taken off the
        free list when the admission revives it. Blocks in use by other sequences and
        pinned blocks cost nothing.
        """
        return self._prefix.blocks_to_admit(prompt_token_ids, num_tokens, cache_salt, adapter_id)

    def can_admit(self, prompt_token_ids: Iterable[int], num_tokens: int | None = None, *,
                  cache_salt: str | None = None, adapter_id: Any = None) -> bool:
        """Whether :meth:`add_sequence` of this prompt, then reserving ``num_tokens``
        tokens in all (default: the prompt), would succeed now
        (see :meth:`blocks_to_admit`)."""
        return self._prefix.can_admit(prompt_token_ids, num_tokens, cache_salt, adapter_id)

    def pin_prefix(self, token_ids: Iterable[int], *, cache_salt: str | None = None,
                   adapter_id: Any = None) -> int:
        """Pin the cached full blocks of ``token_ids``; returns the tokens pinned.

        Pinned blocks are never evicted, under any policy, until :meth:`unpin_prefix`.
        The blocks of this prefix that a prefix tier holds are pinned there too (the
        count is then the longest prefix pinned in any medium).
        """
        return self._prefix.pin_prefix(token_ids, cache_salt, adapter_id, True)

    def unpin_prefix(self, token_ids: Iterable[int], *, cache_salt: str | None = None,
                     adapter_id: Any = None) -> int:
        """Release the pins :meth:`pin_prefix` set on the cached full blocks of
        ``token_ids`` (same namespace: ``cache_salt``, ``adapter_id``), on the device and
        in the prefix tiers; returns the tokens unpinned. The blocks stay cached and
        become evictable again once no sequence references them."""
        return self._prefix.pin_prefix(token_ids, cache_salt, adapter_id, False)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix, in the prefix tiers too. Raises
        :class:`CacheBusyError` while any block is in use."""
        self._prefix.reset_prefix_cache()

