"""PrefixTiers: the host and disk prefix tiers of one :class:`~pagedkv.PagedKVCache`.

The device is the top tier; below it a host tier, a disk tier, or both, in that order.
A block moves down:

- **write-back** (always): when the device evicts a cached block, it is copied to the
  top lower tier; when the host tier evicts a block, it is copied to the disk tier;
- **write-through** (``prefix_tier_write="through"``): also when the device registers a
  block, to every lower tier.

Admission is chain-closed (see :mod:`pagedkv.tiers.chain`): a block enters a tier under
its parent's slot in that tier, so its still-registered ancestors are copied too when
the tier lacks them (their device KV is intact). A block whose chain cannot be closed
(its parent's KV is gone and the tier never held it) is not admitted: a later miss,
never wrong KV.

A block moves up at admission (:meth:`promote`): the device misses, a tier's verified
chain goes further, so the sequence reserves device blocks for those tokens, the KV is
copied in (the disk tier checks each block's CRC first), and committing registers them
exactly like computed blocks.

Timing is what keeps write-back exact. The device index logs every registration and
every end of one; an evicted block's KV is intact until its new owner writes, and the
manager calls :meth:`sync` right after each call that allocates (before copy-on-write
copies run and before slots reach the caller), so the copies read intact KV.
"""
from __future__ import annotations

import warnings
from collections import defaultdict
from typing import Any, NamedTuple

import numpy as np
import torch

from pagedkv.errors import TierFileError
from pagedkv.events import AllBlocksCleared, BlockRemoved, BlockStored, events_from_records
from pagedkv.format.fingerprint import kv_format
from pagedkv.groups.tables import GROUP_NS_BITS, group_key
from pagedkv.store.window import RecentWindow
from pagedkv.tiers.base import Tier
from pagedkv.tiers.chain import ROOT
from pagedkv.tiers.disk import DiskPrefixTier
from pagedkv.tiers.host import HostPrefixTier
from pagedkv.tiers.stats import TierStats

__all__ = ["PrefixTiers"]

DEVICE = "device"
_MAX_LINKS = 8        # device incarnations remembered per tier slot (more only cost a miss)


class _Rec(NamedTuple):
    """A block as a source of a copy: its content, its parent's key, and where its data is."""

    tokens: np.ndarray
    ns_key: bytes
    parent: tuple[int, int] | None   # (id, generation) of the parent in the same source
    data: int                           # device block or tier slot holding the KV
    dev_hash: int | None             # this process's device hash (for KV events)
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
    """

    def __init__(self, config, index, store, pool, namespaces, tables):
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
        weak = self.index.weak_hash
        self.host: HostPrefixTier | None = None
        self.disk: DiskPrefixTier | None = None
        if cfg.prefix_host_blocks:
            host = self.host = HostPrefixTier(self.store.arenas, cfg.prefix_host_blocks, self.bs,
                                              eviction=cfg.prefix_tier_eviction, weak_hash=weak,
                                              pin=self.store.device.type == "cuda",
                                              on_evict=lambda s: self._evicting(host, s))
            host.index.on_removed = lambda s: self._removed_slot(host, s)
            host.window = self.store.tier_window(cfg.prefix_host_blocks)
        if cfg.prefix_disk_blocks:
            disk = self.disk = DiskPrefixTier(cfg.prefix_disk_dir, self.store.arenas, cfg.prefix_disk_blocks, self.bs,
                                              kv_format(self.store, cfg.prefix_disk_tag),
                                              eviction=cfg.prefix_tier_eviction, weak_hash=weak,
                                              on_evict=lambda s: self._evicting(disk, s), rows=self.store.window)
            persist = disk.index.on_removed      # the disk's own record keeping, then ours

            def on_removed(s: int) -> None:
                if persist is not None:
                    persist(s)
                self._removed_slot(disk, s)

            disk.index.on_removed = on_removed
        self.tiers: list[Tier] = [t for t in (self.host, self.disk) if t is not None]
        # (target medium, source medium, id, gen) -> (slot, slot gen); per target slot its keys
        self._links: dict[tuple, tuple[int, int]] = {}
        self._link_keys: dict[tuple[str, int], list[tuple]] = defaultdict(list)
        self._dev_hash: dict[tuple[str, int], int] = {}
        self._removed: dict[tuple[int, int], _Rec] = {}       # this drain's ended registrations
        self._copies: dict[tuple[str, str], list[tuple[int, int]]] = defaultdict(list)
        self._new: dict[str, list[int]] = defaultdict(list)
        self._buffer: list = []                                 # KV events, all media, in order
        self.num_lost = 0

    # ---- write-back / write-through -----------------------------------------------------
    def sync(self, promoted: dict[int, str] | None = None) -> None:
        """Copy down what the last device call evicted (and, write-through, registered).

        Must run before anything writes into the blocks that call allocated."""
        if self.events:
            self._pull_device_events(promoted)
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

    def _record(self, src: str, key: tuple[int, int]) -> _Rec | None:
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
        tier = self._tier(src)
        s, g = key
        r = tier.index.rec
        if r["valid"][s] != 1 or r["gen"][s] != g:
            return None
        p = int(r["parent"][s])
        parent = None if p == ROOT else (p, int(r["parent_gen"][s]))
        return _Rec(np.array(r["tokens"][s]), tier.ns_keys[int(r["ns"][s])], parent, s,
                    self._dev_hash.get((src, s)), int(tier.index.pins[s]))

    def _linked(self, target: Tier, src: str, key: tuple[int, int]) -> int:
        found = self._links.get((target.medium, src) + key)
        if found is None:
            return -1
        s, g = found
        r = target.index.rec
        if r["valid"][s] != 1 or r["gen"][s] != g:
            return -1
        target.index.touch(s)
        return s

    def _link(self, target: Tier, src: str, key: tuple[int, int], slot: int) -> None:
        k = (target.medium, src) + key
        if k not in self._links:
            keys = self._link_keys[(target.medium, slot)]
            keys.append(k)
            if len(keys) > _MAX_LINKS:
                self._links.pop(keys.pop(0), None)
        self._links[k] = (slot, int(target.index.rec["gen"][slot]))

    def _admit(self, target: Tier, src: str, key: tuple[int, int]) -> int:
        """The slot of ``target`` holding the chain ending at ``key`` of ``src``, admitting
        the blocks it lacks (root first); -1 when the chain cannot be closed."""
        path = []
        parent = ROOT
        while True:
            s = self._linked(target, src, key)
            if s >= 0:
                parent = s
                break
            rec = self._record(src, key)
            if rec is None:
                return -1
            path.append((key, rec))
            if rec.parent is None:
                break
            key = rec.parent
        for key, rec in reversed(path):
            try:
                ns = target.namespace(rec.ns_key, create=True)
            except TierFileError as e:
                # The disk refused namespaces.json (ENOSPC...): the device call that got
                # here already happened, so this block is not written down (a later miss).
                warnings.warn(f"prefix tier: block not written down: {e}", RuntimeWarning, stacklevel=2)
                return -1
            slot, created = target.index.insert(parent, ns, target.ns_hashes[ns], rec.tokens)
            if slot < 0:
                return -1
            if created:
                for _ in range(rec.pins):        # a pinned prefix stays pinned wherever it goes
                    target.index.pin(slot)
                self._copies[(src, target.medium)].append((rec.data, slot))
                self._new[target.medium].append(slot)
                if rec.dev_hash is not None:
                    self._dev_hash[(target.medium, slot)] = rec.dev_hash
                if self.events:
                    self._tier_event(target, slot, stored=True)
            self._link(target, src, key, slot)
            parent = slot
        return parent

    def _evicting(self, tier: Tier, slot: int) -> None:
        # The host's victim moves to the disk before its slot is reused (the copy is
        # queued ahead of the copy that overwrites it, see _flush).
        if tier is self.host and self.disk is not None:
            d = self._admit(self.disk, tier.medium, (slot, int(tier.index.rec["gen"][slot])))
            if d >= 0:                    # the device incarnations it holds go with it
                for b, g in list(self._incarnations(tier, slot)):
                    self._link(self.disk, DEVICE, (b, g), d)
        if self.events:
            self._tier_event(tier, slot, stored=False)

    def _removed_slot(self, tier: Tier, slot: int) -> None:
        for k in self._link_keys.pop((tier.medium, slot), ()):
            self._links.pop(k, None)
        self._dev_hash.pop((tier.medium, slot), None)

    def _flush(self) -> None:
        # Host -> disk first: a host slot evicted in this batch may be overwritten below.
        order = [("host", "disk"), (DEVICE, "disk"), (DEVICE, "host")]
        try:
            for src, dst in order:
                pairs = self._copies.pop((src, dst), None)
                if pairs:
                    src_arenas = self.store.arenas if src == DEVICE else self._tier(src).arenas
                    self._tier(dst).write(src_arenas, [p[0] for p in pairs], [p[1] for p in pairs])
                    self._copy_rows(src, dst, pairs)
            for t in self.tiers:
                new = self._new.pop(t.medium, None)
                if new:
                    t.written(np.asarray(new))
                    t.index.release(new)
        except BaseException:
            for t in self.tiers:                 # data that never landed must not be found
                for s in reversed(self._new.pop(t.medium, [])):
                    t.index.release([s])
                    if not t.index.children[s]:
                        t.index.remove(s)
            self._copies.clear()
            raise

    def _window(self, medium: str):
        return self.store.window if medium == DEVICE else self._tier(medium).window

    def _copy_rows(self, src: str, dst: str, pairs) -> None:
        """The sink and window rows that go with a block copy (model precision, so a
        promoted prefix reads them as it would have in place): ``(src block or slot,
        dst block or slot)`` pairs. A medium that keeps no rows gives or takes none (the
        destination's earlier rows for those blocks are dropped all the same)."""
        to = self._window(dst)
        if to is None:
            return
        p = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
        source = self._window(src)
        if source is None:
            to.drop(p[:, 1])
        elif isinstance(to, RecentWindow) and isinstance(source, RecentWindow):
            to.copy(p[:, 0], p[:, 1], source=source)
        else:                 # the disk's rows live in its records: moved as a transfer moves them
            with self.store.window.lock:
                which, data, valid = source.export_rows(p[:, 0])
                to.drop(p[:, 1])
                to.import_rows(p[which, 1], data, valid)

    def _tier(self, medium: str) -> Tier:
        tier = self.host if medium == "host" else self.disk
        if tier is None:     # a medium named here comes from a copy between existing tiers
            raise KeyError(medium)
        return tier

    # ---- promotion ------------------------------------------------------------------------
    def _sources(self, tokens: np.ndarray, dev_ns: int | None, ns_key: bytes, max_blocks: int) -> list:
        """Where each full block of ``tokens`` (from the first, at most ``max_blocks``)
        can be read, as ``(tier, slot)`` or ``(None, device block)``, as far as the
        device and the tiers together verifiably hold a chain.

        The device's own chain comes first, then, block by block, a device run that
        continues the chain (preferred: no tier read), else a tier's block. A device run
        can start after a tier block only through a link: the tier slot is the copy of
        a device incarnation ``(block, generation)``, and the run's first block was
        registered under exactly that incarnation (its parent, evicted since). So a
        sliding group whose head left the device early (released out of the window,
        then evicted first) is found whole: head from the tier, tail from the device.
        Every block is verified by its tokens (the device index's ``match_from``, the
        tier's lookup)."""
        chains = list(self._chains(tokens, ns_key, max_blocks))
        if dev_ns is None:
            src: list[tuple[Tier | None, int]] = []
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
                for b, g in self._incarnations(last, s):
                    found = self.index.match_from(tokens[:max_blocks * self.bs], i, hashes[i - 1], b, g,
                                                  dev_ns, ns_hash)
                    if len(found) > len(run):
                        run = found.tolist()
                if run:
                    src.extend((None, b) for b in run)
                    continue
            tier = next(((t, c[i]) for t, c in chains if len(c) > i), None)
            if tier is None:
                break
            src.append(tier)
        return src

    def _incarnations(self, tier: Tier, slot: int):
        """The device incarnations ``(block, generation)`` whose chain ``slot`` holds."""
        gen = int(tier.index.rec["gen"][slot])
        for k in self._link_keys.get((tier.medium, slot), ()):
            if k[1] == DEVICE and self._links.get(k) == (slot, gen):
                yield k[2], k[3]

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
        chains = [self._sources(tokens, ns_id | (g << GROUP_NS_BITS), self.namespaces.key_of(ns_id | (g << GROUP_NS_BITS)),
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
        leases: dict[Tier, list[int]] = defaultdict(list)
        for c in chains:
            for t, s in c[:have + n]:
                if t is not None:
                    leases[t].append(s)
        for t, held in leases.items():
            t.index.lease(held)
        holding = device_sources(n)
        self.pool.touch(holding)

        def release(tier=None):
            for t in list(leases):
                if tier is None or t is tier:
                    t.index.release(leases.pop(t))

        reserved = False
        try:
            for src in sources:
                for j, (t, s) in enumerate(src[:n]):
                    if t is not None and not t.verify(s):
                        n = j
                        release(t)        # a leased slot cannot leave its tier
                        self._drop_corrupt(t, s)
                        break
            if n == 0:
                return hit
            sources = [src[:n] for src in sources]
            self.tables.reserve(key, n * bs, internal=True)
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
                        by_tier[t.medium].append((s, b))
                for medium, pairs in by_tier.items():
                    self._tier(medium).read([p[0] for p in pairs], self.store.arenas, [p[1] for p in pairs])
                    self.store.replaced([p[1] for p in pairs])
                    self._copy_rows(medium, DEVICE, pairs)
            if on_device:                 # KV, scales and window rows, as copy-on-write copies
                self.store.copy_blocks(torch.as_tensor(on_device, dtype=torch.int64))
            self.tables.commit(key, n * bs, internal=True)
            reserved = False
        except BaseException:
            if reserved:
                self.tables.unreserve(key, internal=True)
            raise
        finally:
            release()
            self.pool.free(holding)
        promoted = {}
        for src, dst in zip(sources, blocks):
            deepest = {}
            for (t, s), b in zip(src, dst):
                if t is None:
                    continue
                if self.index.is_cached(b):
                    self._link(t, DEVICE, (b, self.index.generation(b)), s)
                    for _ in range(int(t.index.pins[s])):   # pinned there: pinned here too
                        self.pool.pin([b])
                deepest[t.medium] = s
                promoted[b] = t.medium
            for medium, s in deepest.items():
                t = self._tier(medium)
                for a in t.index.chain(s):
                    t.index.touch(a, hit=True)
        for j in range(n):                # a hit's tokens are counted once, for the lowest tier it needed
            used = {src[j][0] for src in sources} - {None}
            if used:
                next(t for t in reversed(self.tiers) if t in used).num_hit_tokens += bs
        self.sync(promoted)
        return (have + n) * bs

    def _drop_corrupt(self, tier: Tier, slot: int) -> None:
        # Its data failed its checksum: it and everything below it leave the tier.
        for s in tier.index.descendants(slot) + [slot]:
            if self.events:
                self._tier_event(tier, s, stored=False)
            tier.index.remove(s)

    # ---- queries, pins, reset -----------------------------------------------------------------
    def _chains(self, tokens: np.ndarray, ns_key: bytes, max_blocks: int | None = None):
        for t in self.tiers:
            ns = t.namespace(ns_key, create=False)
            if ns is not None:
                yield t, t.index.lookup(tokens, ns, t.ns_hashes[ns],
                                        len(tokens) // self.bs if max_blocks is None else max_blocks)

    def match(self, tokens: np.ndarray, ns_key: bytes, ns_id: int | None = None) -> int:
        """Tokens of ``tokens`` (full blocks) the tiers and the device together hold
        (with layer groups: that every group holds), as :meth:`promote` would find them
        (``ns_id``: the namespace's device id, None when the device never used it); no
        side effects."""
        n = len(tokens) // self.bs
        return min(len(self._sources(tokens, None if ns_id is None else ns_id | (g << GROUP_NS_BITS),
                                     group_key(ns_key, g), n)) for g in range(len(self.groups))) * self.bs

    def pin(self, tokens: np.ndarray, ns_key: bytes, pin: bool) -> int:
        """Pin (or unpin) the blocks of this prefix each tier holds (every layer group's):
        pinned slots never leave. Returns the tokens of the longest chain (un)pinned
        that every group holds."""
        reach = []
        for g in range(len(self.groups)):
            longest = 0
            for t, chain in self._chains(tokens, group_key(ns_key, g)):
                for s in chain:
                    t.index.pin(s) if pin else t.index.unpin(s)
                longest = max(longest, len(chain))
            reach.append(longest)
        return min(reach) * self.bs

    def clear(self) -> None:
        """Forget every prefix in every tier (with ``reset_prefix_cache``)."""
        self.index.drain_tier_log()          # the device registrations all ended
        for t in self.tiers:
            for s in t.index.clear():
                self._removed_slot(t, s)
            t.cleared()
            if self.events:
                self._buffer.append(AllBlocksCleared(medium=t.medium))
        self._links.clear()
        self._link_keys.clear()

    # ---- events ---------------------------------------------------------------------------------
    def _pull_device_events(self, promoted: dict[int, str] | None = None) -> None:
        events = events_from_records(self.index.drain_events(), self.namespaces.name, self.bs, self.index.root)
        if promoted:
            events = [e for ev in events for e in _split_loaded(ev, promoted)]
        self._buffer.extend(events)

    def drain_events(self) -> list:
        self._pull_device_events()
        out, self._buffer = self._buffer, []
        return out

    def _device_hash(self, tier: Tier, slot: int) -> int:
        # This process's device hash of a tier block (for events), from its chain.
        h = self._dev_hash.get((tier.medium, slot))
        if h is None:
            chain = tier.index.chain(slot)
            toks = np.concatenate([np.asarray(tier.index.rec["tokens"][s]) for s in chain])
            ns_hash = self.namespaces.hash_of_key(tier.ns_keys[int(tier.index.rec["ns"][slot])])
            for s, hs in zip(chain, self.index.hash_tokens(toks, ns_hash).tolist()):
                self._dev_hash[(tier.medium, s)] = hs
            h = self._dev_hash[(tier.medium, slot)]
        return h

    def _tier_event(self, tier: Tier, slot: int, stored: bool) -> None:
        h = self._device_hash(tier, slot)
        if not stored:
            last = self._buffer[-1] if self._buffer else None
            if isinstance(last, BlockRemoved) and last.medium == tier.medium:
                last.block_hashes.append(h)
                last.block_ids.append(slot)
            else:
                self._buffer.append(BlockRemoved([h], [slot], medium=tier.medium))
            return
        r = tier.index.rec
        parent = int(r["parent"][slot])
        ph = None if parent == ROOT else self._device_hash(tier, parent)
        ns = self.namespaces.name_of_key(tier.ns_keys[int(r["ns"][slot])])
        last = self._buffer[-1] if self._buffer else None
        if (isinstance(last, BlockStored) and last.medium == tier.medium and last.block_hashes[-1] == ph
                and last.namespace == ns):
            last.block_hashes.append(h)
            last.block_ids.append(slot)
            object.__setattr__(last, "token_count", last.token_count + self.bs)
        else:
            self._buffer.append(BlockStored([h], ph, self.bs, ns, [slot], medium=tier.medium))

    # ---- stats, checks, close ------------------------------------------------------------------
    def stats(self) -> list[TierStats]:
        return [TierStats(medium=t.medium, capacity=t.capacity, used_blocks=t.index.num_used,
                          pinned_blocks=t.index.num_pinned, hit_tokens=t.num_hit_tokens,
                          written_blocks=t.num_written, eviction_count=t.index.num_evictions,
                          corrupt_blocks=t.num_corrupt) for t in self.tiers]

    def check_invariants(self) -> None:
        for t in self.tiers:
            t.index.check_invariants()

    def close(self) -> None:
        for t in self.tiers:
            t.close()


def _split_loaded(event, promoted: dict[int, str]):
    """A device BlockStored of promoted blocks, split by the tier each block came from."""
    if not isinstance(event, BlockStored) or not any(b in promoted for b in event.block_ids):
        return [event]
    out: list[Any] = []
    parent = event.parent_block_hash
    for h, b in zip(event.block_hashes, event.block_ids):
        src = promoted.get(b)
        last = out[-1] if out else None
        if last is not None and last.loaded_from == src:
            last.block_hashes.append(h)
            last.block_ids.append(b)
            object.__setattr__(last, "token_count", last.token_count + event.token_count // len(event.block_ids))
        else:
            out.append(BlockStored([h], parent, event.token_count // len(event.block_ids), event.namespace, [b],
                                   medium=event.medium, loaded_from=src))
        parent = h
    return out
