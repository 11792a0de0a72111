"""PrefixTiers: the tier chain below one :class:`~pagedkv.PagedKVCache`'s device.

The device is the top tier; below it a list of tiers, any subset of host, disk and
remote, in that order (:mod:`pagedkv.tiers.chain_config`), each behind the protocol of
:mod:`pagedkv.tiers.base`. A block moves down:

- **write-back** (always): when the device evicts a cached block, it is copied to the
  first tier; when a tier evicts a block, it is copied to the next one;
- **write-through** (``prefix_tier_write="through"``): also when the device registers a
  block, to every tier.

Admission is chain-closed (see :mod:`pagedkv.tiers.chain`): a block enters a tier under
its parent's block in that tier, so its still-registered ancestors are copied too when
the tier lacks them (their device KV is intact). A block whose chain cannot be closed
(its parent's KV is gone and the tier never held it) is not admitted: a later miss,
never wrong KV.

A block moves up at admission (:meth:`promote`): the device misses, a tier's verified
chain goes further, so the sequence reserves device blocks for those tokens, the KV is
copied in (each block's checksum checked first), and committing registers them exactly
like computed blocks.

Timing is what keeps write-back exact. The device index logs every registration and
every end of one; an evicted block's KV is intact until its new owner writes, and the
manager calls :meth:`sync` right after each call that allocates (before copy-on-write
copies run and before slots reach the caller), so the copies read intact KV.
"""
from __future__ import annotations

import warnings
from collections import defaultdict
from typing import NamedTuple

import numpy as np
import torch

from pagedkv.errors import TierFileError
from pagedkv.groups.tables import GROUP_NS_BITS, group_key
from pagedkv.tiers.base import Handle, PrefixTier
from pagedkv.tiers.chain_config import build_tiers
from pagedkv.tiers.links import DEVICE, Links
from pagedkv.tiers.payload import Blocks
from pagedkv.tiers.reach import Reach
from pagedkv.tiers.stats import TierStats
from pagedkv.tiers.tier_events import TierEvents
from pagedkv.tiers.verify import ChainQuery

__all__ = ["PrefixTiers"]


class _Rec(NamedTuple):
    """A block as a source of a copy: its content, its parent's key, and where its data is."""

    tokens: np.ndarray
    ns_key: bytes
    parent: tuple | None                # (id, generation) of the parent in the same source
    data: Handle                        # device block or tier handle holding the KV
    dev_hash: int | None                # this process's device hash (for KV events)
    pins: int = 0                       # pins it holds there (a copy holds them too)


class PrefixTiers:
    """The prefix tiers below one cache's device index.

    Args:
        config: the cache's :class:`~pagedkv.config.options.CacheConfig`.
        index: the device :class:`~pagedkv._core.prefix.PrefixIndex`.
        store: the :class:`~pagedkv.store.kvstore.KVStore` (the tiers copy its arenas' blocks).
        pool: the device :class:`~pagedkv._core.pool.BlockPool` (free blocks, pins).
        namespaces: ``key_of``, ``name``, ``hash_of_key`` and ``name_of_key`` of device
            namespace ids (the cache's registry, or a
            :class:`~pagedkv.groups.tables.GroupNamespaces` over it with layer groups).
        tables: what admissions promote into: the manager's table coordinator
            (:mod:`pagedkv.manager.coordinator`), whose ``tables`` lists one
            ``BlockTables`` per layer group (each group's blocks come from its own
            chain in the tiers, filed under its group's namespace).
        tiers: the tier list, top first (default: built from ``config``).
    """

    def __init__(self, config, index, store, pool, namespaces, tables, tiers: list[PrefixTier] | None = None):
        cfg = config
        self.index = index
        self.store = store
        self.pool = pool
        self.namespaces = namespaces
        self.tables = tables
        self.groups = list(tables.tables)     # one BlockTables per layer group
        self.bs = cfg.block_size
        self.through = cfg.prefix_tier_write == "through"
        self.events = cfg.enable_kv_events
        self.device = Blocks(store.arenas, store.window, None if store.window is None else store.window.lock)
        self.tiers: list[PrefixTier] = build_tiers(cfg, store, self.index.weak_hash) if tiers is None else tiers
        self._by_medium: dict[str, PrefixTier] = {}
        for t in self.tiers:
            self._by_medium.setdefault(t.medium, t)     # the first tier of each medium (host, disk, remote)
        for i, t in enumerate(self.tiers):
            t.set_callbacks(on_evict=lambda s, t=t: self._evicting(t, s),
                            on_removed=lambda s, t=t: self._removed_slot(t, s),
                            on_lost=lambda hs, t=t: self._lost(t, hs))
        self._below = {t: (self.tiers[i + 1] if i + 1 < len(self.tiers) else None) for i, t in enumerate(self.tiers)}
        self.links = Links()
        self.log = TierEvents(index, namespaces, self.bs)
        self._removed: dict[tuple[int, int], _Rec] = {}       # this drain's ended registrations
        # (source: a tier or DEVICE, target tier) -> (source id, target handle) owed this flush
        self._copies: dict[tuple, list[tuple[Handle, Handle]]] = defaultdict(list)
        self._new: dict[PrefixTier, list[Handle]] = defaultdict(list)
        self.num_lost = 0

    @property
    def host(self) -> PrefixTier | None:
        return self._by_medium.get("host")

    @property
    def disk(self) -> PrefixTier | None:
        return self._by_medium.get("disk")

    @property
    def remote(self) -> PrefixTier | None:
        return self._by_medium.get("remote")

    # ---- write-back / write-through -----------------------------------------------------
    def sync(self, promoted: dict[int, str] | None = None) -> None:
        """Copy down what the last device call evicted (and, write-through, registered).

        Must run before anything writes into the blocks that call allocated."""
        if self.events:
            self.log.pull_device(promoted)
        log = self.index.drain_tier_log()
        self.num_lost += int(log["lost"])
        kinds = log["kind"]
        if not len(kinds):
            return
        blocks, gens = log["block"].tolist(), log["gen"].tolist()
        pblocks, pgens = log["parent_block"].tolist(), log["parent_gen"].tolist()
        hashes, ns = log["hash"].tolist(), log["ns"].tolist()
        tokens = log["tokens"]

        def rec(i):
            parent = None if pblocks[i] < 0 else (pblocks[i], pgens[i])
            return _Rec(tokens[i], self.namespaces.key_of(ns[i]), parent, blocks[i], hashes[i])

        removed = np.flatnonzero(kinds == 2).tolist()
        self._removed = {(blocks[i], gens[i]): rec(i) for i in removed}
        try:
            for i in removed:
                self._admit(self.tiers[0], DEVICE, (blocks[i], gens[i]))
            if self.through:
                for i in np.flatnonzero(kinds == 1).tolist():
                    for t in self.tiers:
                        self._admit(t, DEVICE, (blocks[i], gens[i]))
            self._flush()
        finally:
            self._removed = {}

    def _record(self, src, key: tuple) -> _Rec | None:
        if src == DEVICE:
            found = self._removed.get(key)
            if found is not None:
                return found
            b, g = key
            if not self.index.is_cached(b) or self.index.generation(b) != g:
                return None                 # its KV is gone
            info = self.index.block_info(b)
            parent = None if info["parent_block"] < 0 else (info["parent_block"], info["parent_generation"])
            return _Rec(np.asarray(info["tokens"], dtype=np.int32), self.namespaces.key_of(info["namespace"]),
                        parent, b, info["hash"], self.pool.pin_count(b))
        h, stamp = key
        if not src.current(h, stamp):
            return None
        r = src.record(h)
        if r is None:
            return None
        return _Rec(r.tokens, r.ns_key, r.parent, h, self.log.dev_hash.get((src, h)), r.pins)

    def _admit(self, target: PrefixTier, src, key: tuple) -> Handle | None:
        """The handle of ``target`` holding the chain ending at ``key`` of ``src``,
        admitting the blocks it lacks (root first); None when the chain cannot be closed."""
        path = []
        parent: Handle | None = None
        while True:
            s = self.links.find(target, src, key)
            if s is not None:
                parent = s
                break
            rec = self._record(src, key)
            if rec is None:
                return None
            path.append((key, rec))
            if rec.parent is None:
                break
            key = rec.parent
        for key, rec in reversed(path):
            try:
                slot, created = target.admit(parent, rec.ns_key, rec.tokens)
            except TierFileError as e:
                # The disk refused namespaces.json (ENOSPC...): the device call that got
                # here already happened, so this block is not written down (a later miss).
                warnings.warn(f"prefix tier: block not written down: {e}", RuntimeWarning, stacklevel=2)
                return None
            if slot is None:
                return None
            if created:
                for _ in range(rec.pins):        # a pinned prefix stays pinned wherever it goes
                    target.pin(slot)
                self._copies[(src, target)].append((rec.data, slot))
                self._new[target].append(slot)
                if rec.dev_hash is not None:
                    self.log.dev_hash[(target, slot)] = rec.dev_hash
                if self.events:
                    self.log.tier_block(target, slot, stored=True)
            self.links.add(target, src, key, slot)
            parent = slot
        return parent

    def _evicting(self, tier: PrefixTier, slot: Handle) -> None:
        # The victim moves to the next tier before its slot is reused (the copy is
        # queued ahead of the copy that overwrites it, see _flush).
        below = self._below[tier]
        if below is not None:
            d = self._admit(below, tier, (slot, tier.stamp(slot)))
            if d is not None:                 # the device incarnations it holds go with it
                for b, g in list(self.links.incarnations(tier, slot)):
                    self.links.add(below, DEVICE, (b, g), d)
        if self.events:
            self.log.tier_block(tier, slot, stored=False)

    def _removed_slot(self, tier: PrefixTier, slot: Handle) -> None:
        self.links.removed(tier, slot)
        self.log.forget(tier, slot)

    def _lost(self, tier: PrefixTier, handles: list | None) -> None:
        # Gone without this process dropping them (another process, the server's
        # eviction or TTL): a router must stop counting them here.
        if handles is None:
            if self.events:
                self.log.cleared(tier.medium)
            self.log.forget_tier(tier)
            self.links.forget_tier(tier)
            return
        if self.events:
            for h in handles:
                self.log.tier_block(tier, h, stored=False)
        for h in handles:
            self._removed_slot(tier, h)

    def _flush(self) -> None:
        # Deepest destination first: a block a tier evicted in this batch is copied out
        # of its slot before the copy that overwrites that slot runs.
        try:
            for d in reversed(range(len(self.tiers))):
                dst = self.tiers[d]
                for src in self.tiers[:d] + [DEVICE]:
                    pairs = self._copies.pop((src, dst), None)
                    if pairs:
                        dst.store(self._blocks(src), [p[0] for p in pairs], [p[1] for p in pairs])
            for t in self.tiers:
                new = self._new.pop(t, None)
                if new:
                    t.commit(new)
        except BaseException:
            for t in self.tiers:                 # data that never landed must not be found
                t.abandon(self._new.pop(t, []))
            self._copies.clear()
            raise

    def _blocks(self, src) -> Blocks:
        if src is DEVICE:
            return self.device
        found = src.source_blocks
        if found is None:               # only a tier that evicts down is a copy source
            raise KeyError(src.medium)
        return found

    # ---- promotion ------------------------------------------------------------------------
    def _sources(self, tokens: np.ndarray, dev_ns: int | None, ns_key: bytes, max_blocks: int,
                 fetch: bool = True) -> list:
        """Where each full block of ``tokens`` (from the first, at most ``max_blocks``)
        can be read, as ``(tier, handle)`` or ``(None, device block)``, as far as the
        device and the tiers together verifiably hold a chain.

        The device's own chain comes first, then, block by block, a device run that
        continues the chain (preferred: no tier read), else a tier's block (the first
        tier, top down, that holds it). A device run can start after a tier block only
        through a link: the tier block is the copy of a device incarnation ``(block,
        generation)``, and the run's first block was registered under exactly that
        incarnation (its parent, evicted since). So a sliding group whose head left
        the device early (released out of the window, then evicted first) is found
        whole: head from the tier, tail from the device. Every block is verified by its
        tokens (the device index's ``match_from``, the tier's lookup); a tier is asked
        only for blocks the device and the tiers above it lack."""
        reach = Reach(self.tiers, ChainQuery(tokens, ns_key, self.bs), max_blocks, fetch)
        if dev_ns is None:
            src: list[tuple[PrefixTier | None, Handle]] = []
        else:
            ns_hash = self.namespaces.hash_of_key(ns_key)
            src = [(None, b) for b in self.index.match(tokens, dev_ns, ns_hash)[:max_blocks].tolist()]
        hashes = None
        while len(src) < max_blocks:
            i = len(src)
            last, s = src[-1] if i else (None, -1)
            if last is not None and dev_ns is not None:
                if hashes is None:
                    hashes = self.index.hash_tokens(tokens[:max_blocks * self.bs], ns_hash).tolist()
                run: list[int] = []
                for b, g in self.links.incarnations(last, s):
                    found = self.index.match_from(tokens[:max_blocks * self.bs], i, hashes[i - 1], b, g,
                                                  dev_ns, ns_hash)
                    if len(found) > len(run):
                        run = found.tolist()
                if run:
                    src.extend((None, b) for b in run)
                    continue
            tier = reach.at(i)
            if tier is None:
                break
            src.append(tier)
        return src

    def _group_ns(self, ns_id: int | None, g: int) -> int | None:
        return None if ns_id is None else ns_id | (g << GROUP_NS_BITS)

    def promote(self, key: int, tokens: np.ndarray, ns_id: int, hit: int, max_blocks: int | None = None) -> int:
        """Extend a just-admitted sequence's device hit (``hit`` tokens) from the tiers
        and from device blocks the device lookup cannot reach (see :meth:`_sources`);
        returns the new hit. Verified like a device hit; limited by free device blocks.
        With layer groups every group is extended by the same blocks, each from its own
        chain (a sliding group's too: its commit then releases what left the window, as
        after a computed prefill), so the hit is the longest every group can reach.
        A block read from the device is copied into the sequence's new block (the
        sequence's table takes fresh blocks past its hit); the source is held meanwhile,
        and a source hanging off an evicted parent is replaced by its copy at commit.
        ``max_blocks`` caps the hit (``add_sequence(max_cached_tokens=)``)."""
        bs = self.bs
        cap = (len(tokens) - 1) // bs
        max_blocks = cap if max_blocks is None else min(cap, max_blocks)
        have = hit // bs
        if have >= max_blocks:
            return hit
        ngroups = len(self.groups)
        chains = [self._sources(tokens, self._group_ns(ns_id, g), self.namespaces.key_of(self._group_ns(ns_id, g)),
                                max_blocks) for g in range(ngroups)]
        n = min(len(c) for c in chains) - have

        def device_sources(n):
            return sorted({b for c in chains for t, b in c[have:have + n] if t is None})

        # Held device sources stop being free: the hit is what the rest can hold.
        while n > 0 and (self.pool.num_free_blocks - sum(self.pool.is_free(b) for b in device_sources(n))
                         ) // ngroups < n:
            n -= 1
        if n <= 0:
            return hit
        sources = [c[have:have + n] for c in chains]
        leases: dict[PrefixTier, list[Handle]] = defaultdict(list)
        for c in chains:
            for t, s in c[:have + n]:
                if t is not None:
                    leases[t].append(s)
        for t, held in leases.items():
            t.lease(held)
        holding = device_sources(n)
        self.pool.touch(holding)

        def release(tier=None):
            for t in list(leases):
                if tier is None or t is tier:
                    t.release(leases.pop(t))
        reserved = False
        # with recurrent-state layers the attention groups take the blocks, and the state
        # resumes from the snapshot where the promotion ends (never a KV-only advance)
        cap_states = getattr(self.tables, "cap_promotion", None)
        tables = self.tables if cap_states is None else self.tables.attention
        try:
            for src in sources:
                for j, (t, s) in enumerate(src[:n]):
                    if t is not None and not t.verify(s):
                        n = j
                        release(t)        # a leased block cannot leave its tier
                        self._drop_corrupt(t, s)
                        break
            if n and cap_states is not None:     # recurrent states: only to a boundary with a snapshot
                n = cap_states(key, tokens, have, n)
            if n == 0:
                return hit
            sources = [src[:n] for src in sources]
            tables.reserve(key, n * bs, internal=True)
            reserved = True
            self.sync()                   # evicted blocks go down before we overwrite them
            blocks = [tb.blocks(key)[have:have + n].tolist() for tb in self.groups]
            on_device = []
            for src, dst in zip(sources, blocks):
                by_tier = defaultdict(list)
                for (t, s), b in zip(src, dst):
                    if t is None:
                        on_device.append((s, b))
                    else:
                        by_tier[t].append((s, b))
                for t, pairs in by_tier.items():
                    self.store.replaced([p[1] for p in pairs])
                    t.load([p[0] for p in pairs], self.device, [p[1] for p in pairs])
            if on_device:                 # KV, scales and window rows, as copy-on-write copies
                self.store.copy_blocks(torch.as_tensor(on_device, dtype=torch.int64))
            tables.commit(key, n * bs, internal=True)
            reserved = False
            if cap_states is not None:
                self.tables.resume_promoted(key, tokens, have + n)
        except BaseException:
            if reserved:
                tables.unreserve(key, internal=True)
            raise
        finally:
            release()
            self.pool.free(holding)
        promoted = {}
        for src, dst in zip(sources, blocks):
            deepest: dict[PrefixTier, Handle] = {}
            for (t, s), b in zip(src, dst):
                if t is None:
                    continue
                if self.index.is_cached(b):
                    self.links.add(t, DEVICE, (b, self.index.generation(b)), s)
                    for _ in range(t.pins(s)):   # pinned there: pinned here too
                        self.pool.pin([b])
                deepest[t] = s
                promoted[b] = t.medium
            for t, s in deepest.items():
                for a in t.chain(s) or [s]:
                    t.touch(a, hit=True)
        for j in range(n):                # a hit's tokens are counted once, for the lowest tier it needed
            used = {src[j][0] for src in sources} - {None}
            if used:
                next(t for t in reversed(self.tiers) if t in used).num_hit_tokens += bs
        self.sync(promoted)
        return (have + n) * bs

    def _drop_corrupt(self, tier: PrefixTier, slot: Handle) -> None:
        # Its data failed its checksum: it and everything below it leave the tier.
        if self.events:
            for s in tier.subtree(slot):
                self.log.tier_block(tier, s, stored=False)
        tier.drop(slot)

    # ---- queries, pins, reset -----------------------------------------------------------------
    def match(self, tokens: np.ndarray, ns_key: bytes, ns_id: int | None = None) -> int:
        """Tokens of ``tokens`` (full blocks) the tiers and the device together hold
        (with layer groups: that every group holds), as :meth:`promote` would find them
        (``ns_id``: the namespace's device id, None when the device never used it); no
        side effects (a remote tier is asked whether it holds them, nothing is fetched)."""
        n = len(tokens) // self.bs
        return min(len(self._sources(tokens, self._group_ns(ns_id, g), group_key(ns_key, g), n, fetch=False))
                   for g in range(len(self.groups))) * self.bs

    def prefetch(self, tokens: np.ndarray, ns_key: bytes) -> None:
        """Start bringing the blocks of ``tokens`` from slow tiers (a remote one) close,
        so a later admission of them does not wait on the network (every group's)."""
        for g in range(len(self.groups)):
            query = ChainQuery(tokens, group_key(ns_key, g), self.bs)
            for t in self.tiers:
                t.prefetch(query, 0, query.num_blocks)

    def pin(self, tokens: np.ndarray, ns_key: bytes, pin: bool) -> int:
        """Pin (or unpin) the blocks of this prefix each tier holds (every layer group's):
        pinned blocks never leave (a tier that cannot pin, a shared remote one, is
        skipped). Returns the tokens of the longest chain (un)pinned that every group holds."""
        reach = []
        for g in range(len(self.groups)):
            query = ChainQuery(tokens, group_key(ns_key, g), self.bs)
            reach.append(max([t.pin_prefix(query, pin) for t in self.tiers] + [0]))
        return min(reach) * self.bs

    def clear(self) -> None:
        """Forget every prefix in every tier (with ``reset_prefix_cache``)."""
        self.index.drain_tier_log()          # the device registrations all ended
        for t in self.tiers:
            for s in t.clear():
                self._removed_slot(t, s)
            if self.events:
                self.log.cleared(t.medium)
        self.links.clear()

    # ---- events ---------------------------------------------------------------------------------
    def drain_events(self) -> list:
        for t in self.tiers:
            t.reap()
        return self.log.drain()

    # ---- stats, checks, close ------------------------------------------------------------------
    def stats(self) -> list[TierStats]:
        return [t.stats() for t in self.tiers]

    def check_invariants(self) -> None:
        for t in self.tiers:
            t.check_invariants()

    def close(self) -> None:
        for t in self.tiers:
            t.close()
