"""The manager: :class:`~pagedkv.manager.cache.PagedKVCache` and what it is built from
(sequence ids, namespaces, argument checks, stats, events, threads, compaction moves)."""
