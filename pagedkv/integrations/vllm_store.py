"""PrefixStore: pagedkv's host and disk prefix tiers holding vLLM's blocks.

The connector's scheduler side owns the store: the verified index of both tiers, the
disk tier, leases, admission. The host tier's block bytes live in a
:class:`~.vllm_shm.SharedArena` that the worker side (:class:`~.vllm_worker.BlockMover`,
in vLLM's worker process by default) maps by name; the two sides exchange only slot
numbers and vLLM block ids (the step's metadata one way, the worker's report the other).

- **Lookups** walk the tiers' :class:`~pagedkv.tiers.ChainIndex` with the request's
  tokens: a slot is accepted only when its tokens, namespace and parent link match, so
  a hash collision is a miss. Disk hits are CRC-checked, then promoted into host slots
  (here, before the load is issued); every load is host -> vLLM. A loaded slot stays
  leased until the worker reports the copy done.
- **Stores** admit each newly full block under its parent's host slot as *pending*
  (never a hit, never evicted); the worker fills it after the forward and reports it;
  only then is it committed (:meth:`PrefixStore.committed`): visible to lookups and,
  with ``disk_write="through"``, written to disk. A save the worker reports failed is
  abandoned. Each step's copies are recorded (:meth:`PrefixStore.sent`) with the step's
  number, which the worker's report carries back: a report commits or releases only what
  that step sent, and a step whose report has not come within ``report_timeout_s`` has
  its pending saves abandoned and its loads released (:meth:`PrefixStore.expire`,
  counted in ``num_report_timeouts``), so a lost report never holds host slots for good
  and a late one changes nothing. Host evictions go to disk before their slot is reused (chain-closed, like
  :class:`~pagedkv.tiers.PrefixTiers`).
- **Sharing a directory:** the disk tier is locked (``flock``) only for one batch of
  lookups or writes, a *turn*, so several engines take turns; a block's CRC is
  checked before it is served, and a slot is valid on disk only once sealed. The tier
  stays open between turns; taking a turn reads what other engines changed since
  from the tier's journal and re-checks just those slots
  (:meth:`~pagedkv.tiers.disk.DiskPrefixTier.relock`): a turn costs what changed, not
  the directory.
- **A remote tier** (``remote``: a Redis server or Cluster that engines on several
  hosts share, :mod:`pagedkv.tiers.remote`): what the host and disk tiers cannot
  serve is asked of it; each fetched block is checked (format, key, tokens, chain
  link, checksum) before it is promoted into a host slot like a disk hit. Committed
  blocks are copied out at once and sent by its background writer; blocks fetched
  from it are not sent back.
- **Misses without a turn:** between turns the tier's in-memory index is a *view*.
  While no engine changed the tier since (the journal did not move), a lookup the view
  answers with no longer chain than the host's, and a write-down of blocks the view
  already holds, cost hash lookups, not a turn. The view only decides whether to take
  one: every hit is still found, token-verified and CRC-checked in a locked turn.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Sequence

import numpy as np
import torch

from pagedkv.config.memory import arena_bytes, check_fits
from pagedkv.errors import ArgumentTypeError, InvalidArgumentError, TierFileError, expected
from pagedkv.integrations.vllm_codec import Codec, make_codec
from pagedkv.integrations.vllm_config import ConnectorConfig
from pagedkv.integrations.vllm_events import StoreEvents, watch_disk
from pagedkv.integrations.vllm_remote import remote_lookup, to_remote, watch_remote
from pagedkv.integrations.vllm_shm import SharedArena
from pagedkv.integrations.vllm_worker import KVSpec
from pagedkv.manager.arguments import as_int, as_token_ids
from pagedkv.tiers import DiskPrefixTier, HostPrefixTier, TierStats
from pagedkv.tiers.base import Tier
from pagedkv.tiers.chain import ROOT, ChainIndex, slot_dtype
from pagedkv.tiers.remote import RemotePrefixTier

__all__ = ["PrefixStore", "KVSpec", "get_store", "lookup_store", "store_of_arena", "replace_store", "drop_store"]

log = logging.getLogger("pagedkv.vllm")

_stores: dict[str, PrefixStore] = {}
_engine_specs: dict[str, KVSpec] = {}     # the KV shape each engine's connector was built for
_by_arena: weakref.WeakValueDictionary[str, PrefixStore] = weakref.WeakValueDictionary()
_stores_lock = threading.RLock()      # get_store holds it while PrefixStore registers its arena

#: the layout this module reads and writes (see :mod:`.vllm_codec`); part of the format.
LAYOUT = "vllm-cpu-kT-v"


def get_store(key: str, cfg: ConnectorConfig, spec: KVSpec, tag: str) -> PrefixStore:
    """The store of engine ``key`` (created by its scheduler-side connector)."""
    with _stores_lock:
        store = _stores.get(key)
        if store is None:
            store = _stores[key] = PrefixStore(cfg, spec, tag)
            _engine_specs[key] = spec
        return store


def lookup_store(key: str) -> PrefixStore | None:
    return _stores.get(key)


def store_of_arena(name: str) -> PrefixStore | None:
    """The store whose host arena is ``name`` (routes the worker's reports)."""
    return _by_arena.get(name)


def replace_store(key: str, store: PrefixStore) -> PrefixStore:
    """Swap engine ``key``'s store (tests and benchmarks: another storage format on the
    same engine). A store built for another KV shape than the engine's is refused here
    (and again by the worker, against vLLM's tensors, before any copy)."""
    with _stores_lock:
        old = _stores[key]
        want = _engine_specs.get(key, old.spec)
        if store.spec != want:
            store.refuse(f"the store's KV shape {store.spec} differs from the engine's {want}")
        store.worker_ready = store.worker_ready or old.worker_ready
        _stores[key] = store
        return old


def drop_store(key: str) -> None:
    with _stores_lock:
        store = _stores.pop(key, None)
    if store is not None:
        store.close()


def _checked(tokens, ns_key, length: int | None = None) -> tuple[np.ndarray, bytes]:
    """A request's token ids (int32, flat; ``length`` of them for one block) and its
    namespace key (bytes), or a typed error: what vLLM hands the scheduler side is
    checked before it reaches the tier index."""
    tokens = as_token_ids(tokens, "tokens")
    if length is not None and tokens.shape != (length,):
        raise InvalidArgumentError(expected("tokens", f"{length} token ids (one block)", tokens.shape[0]))
    if not isinstance(ns_key, bytes):
        raise ArgumentTypeError(expected("ns_key", "bytes", type(ns_key).__name__))
    return tokens, ns_key


class SharedHostTier(HostPrefixTier):
    """The host tier over a shared arena (the worker side maps the same bytes)."""

    def __init__(self, shared: SharedArena, block_size: int, *, eviction: str, weak_hash: bool, on_evict=None):
        Tier.__init__(self)
        capacity = shared.layout["capacity"]
        check_fits("cpu", [("host_blocks", capacity,
                            arena_bytes("host_blocks", capacity, (capacity,), slot_dtype(block_size).itemsize))])
        self.shared = shared
        self.arenas = shared.tensors
        records = np.zeros(capacity, dtype=slot_dtype(block_size))
        self.index = ChainIndex(records, block_size, eviction=eviction, weak_hash=weak_hash, on_evict=on_evict)


class PrefixStore:
    def __init__(self, cfg: ConnectorConfig, spec: KVSpec, tag: str):
        self.cfg, self.spec, self.tag = cfg, spec, tag
        self.bs = spec.block_size
        self.codec: Codec = make_codec(cfg.storage, spec.kv_heads, spec.block_size, spec.head_size,
                                       spec.dtype, cfg.rotation_seed)
        self.template = [torch.empty((spec.num_layers, 1) + shape, dtype=dt) for shape, dt in self.codec.arenas]
        self.format = {
            "connector": "pagedkv.integrations.vllm", "tag": tag, "layout": LAYOUT,
            "num_layers": spec.num_layers, "kv_heads": spec.kv_heads, "head_size": spec.head_size,
            "block_size": spec.block_size, "dtype": str(spec.dtype).replace("torch.", ""),
            "storage": cfg.storage,
            "rotation_seed": cfg.rotation_seed if cfg.storage == "fp8" else None,
            "arenas": [[str(dt).replace("torch.", ""), list(shape)] for shape, dt in self.codec.arenas],
        }
        self.arena = SharedArena.create(self.codec.arenas, spec.num_layers, cfg.staging_blocks,
                                        dict(self.format, **spec.as_dict()))
        self.host = SharedHostTier(self.arena, self.bs, eviction=cfg.eviction, weak_hash=cfg.weak_hash,
                                   on_evict=self._host_evicting)
        self.remote: RemotePrefixTier | None = None
        remote = cfg.remote_config
        if remote is not None:
            try:
                self.remote = RemotePrefixTier(remote, self.template, self.bs, self.format)
                watch_remote(self, self.remote)
            except BaseException:
                self.arena.close()
                raise
        with _stores_lock:
            _by_arena[self.arena.name] = self
        self.lock = threading.RLock()
        # True once the worker side mapped the arena (or registered its KV, see the
        # connector): until then lookups miss (a failed load would fail the request).
        self.worker_ready = False
        self.refused: str | None = None                 # why nothing is served, if so
        self.disk_refused: str | None = None
        self.pending: set = set()                          # host slots admitted, data not yet landed
        self._pending_step: dict[int, int] = {}            # pending slot -> the step that carries its save
        # step -> (deadline, its pending saves' slots, its loads' leased slots) until its report
        self._sent: dict[int, tuple[float, list[int], list[int]]] = {}
        self.num_report_timeouts = 0                       # slots a step's report never settled in time
        self._disk: DiskPrefixTier | None = None     # the tier, during a turn
        self._tier: DiskPrefixTier | None = None     # the tier, open between turns (its index: the view)
        self.num_disk_turns = 0
        self.num_disk_hit_tokens = 0
        self.num_disk_written = 0
        self.num_disk_corrupt = 0
        self.num_lock_misses = 0
        self.events: StoreEvents | None = None       # KV events of the tiers, once enabled

    def enable_events(self) -> None:
        """Record KV events of the host, disk and remote tiers (drained by the connector's
        ``take_events`` into vLLM's event stream; :mod:`.vllm_events`)."""
        with self.lock:
            if self.events is None:
                self.events = StoreEvents(self.host.index, self.bs)

    # ---- refusals -------------------------------------------------------------------------
    def refuse(self, reason: str) -> None:
        if self.refused is None:
            self.refused = reason
            log.warning("pagedkv connector: serving nothing: %s", reason)

    @property
    def serving(self) -> bool:
        return self.refused is None and self.worker_ready

    # ---- disk turns -------------------------------------------------------------------------
    @contextlib.contextmanager
    def disk(self):
        """The disk tier, locked for one batch of work (a turn); None when unusable."""
        if self._disk is not None or self.cfg.disk_path is None or self.disk_refused:
            yield self._disk
            return
        try:
            d = self._take_turn()
        except TierFileError as e:
            self.disk_refused = str(e)
            log.warning("pagedkv connector: disk tier refused, using host only: %s", e)
            d = None
        if d is None:
            yield None
            return
        self._disk = d
        self.num_disk_turns += 1
        try:
            yield d
        finally:
            self._disk = None
            d.unlock()

    def _take_turn(self) -> DiskPrefixTier | None:
        path = self.cfg.disk_path
        if path is None:
            return None
        if self._tier is not None:
            if self._tier.relock(self.cfg.lock_timeout_s):
                return self._tier
        else:
            deadline = time.monotonic() + self.cfg.lock_timeout_s
            while True:
                try:
                    self._tier = DiskPrefixTier(path, self.template, self.cfg.disk_blocks, self.bs,
                                                self.format, eviction=self.cfg.eviction, weak_hash=self.cfg.weak_hash,
                                                verify_blocks=False)
                    watch_disk(self._tier, lambda: self.events)
                    return self._tier
                except TierFileError as e:
                    if "locked by another cache" not in str(e):
                        raise
                    if time.monotonic() >= deadline:
                        break
                    time.sleep(0.002)
        self.num_lock_misses += 1
        log.info("pagedkv connector: disk tier busy for %.1f s; skipped", self.cfg.lock_timeout_s)
        return None

    def _fresh_view(self) -> DiskPrefixTier | None:
        """The tier's index between turns, while no engine has changed the tier since."""
        t = self._tier
        if t is None or self._disk is not None or not t.unchanged():
            return None
        return t

    # ---- lookups --------------------------------------------------------------------------
    def _ns(self, tier, ns_key: bytes, create: bool):
        ns = tier.namespace(ns_key, create=create)
        return (None, 0) if ns is None else (ns, tier.ns_hashes[ns])

    def _host_chain(self, tokens: np.ndarray, ns_key: bytes, max_blocks: int) -> list[int]:
        ns, h = self._ns(self.host, ns_key, False)
        if ns is None:
            return []
        chain = self.host.index.lookup(tokens, ns, h, max_blocks)
        for i, s in enumerate(chain):
            if s in self.pending:
                return chain[:i]
        return chain

    def lookup(self, tokens: np.ndarray, ns_key: bytes, max_blocks: int) -> list[int]:
        """Host slots of the longest verified prefix of ``tokens`` (at most ``max_blocks``),
        promoting disk and remote hits into the host tier. The caller leases what it will load."""
        tokens, ns_key = _checked(tokens, ns_key)
        max_blocks = as_int(max_blocks, "max_blocks")
        with self.lock:
            chain = self._host_chain(tokens, ns_key, max_blocks)
            if len(chain) < max_blocks and self.cfg.disk_path is not None and not self.disk_refused:
                chain = self._disk_lookup(tokens, ns_key, max_blocks, chain)
            if len(chain) < max_blocks and self.remote is not None:
                chain = remote_lookup(self, self.remote, tokens, ns_key, max_blocks, chain)
            return chain

    def _disk_lookup(self, tokens: np.ndarray, ns_key: bytes, max_blocks: int, chain: list[int]) -> list[int]:
        """``chain`` (host slots) extended by the disk tier's verified blocks."""
        view = self._fresh_view()
        if view is not None:
            ns, h = self._ns(view, ns_key, False)
            if ns is None or len(view.index.lookup(tokens, ns, h, max_blocks)) <= len(chain):
                return chain                   # the disk holds no longer prefix: no need to open it
        with self.disk() as d:
            if d is None:
                return chain
            ns, h = self._ns(d, ns_key, False)
            if ns is None:
                return chain
            dchain = d.index.lookup(tokens, ns, h, max_blocks)
            if len(dchain) <= len(chain):
                return chain
            hns, hh = self._ns(self.host, ns_key, True)
            self.host.index.lease(chain)               # the promotion must not evict our own prefix
            d.index.lease(dchain)                      # nor a host eviction's write-down the disk's
            promoted: list[int] = []
            try:
                for i in range(len(chain), len(dchain)):
                    s = dchain[i]
                    if not d.verify(s):
                        self.num_disk_corrupt += 1
                        log.warning("pagedkv connector: disk slot %d failed its CRC-32; dropped (a miss)", s)
                        d.index.release(dchain[i:])
                        dchain = dchain[:i]
                        d.drop(s)
                        break
                    parent = chain[-1] if chain else ROOT
                    slot, created = self.host.index.insert(parent, hns, hh, tokens[i * self.bs:(i + 1) * self.bs])
                    if slot < 0:
                        break
                    if created:
                        try:
                            d.read([s], self.host.arenas, [slot])
                        except BaseException:
                            self.host.index.release([slot])
                            self.host.index.remove(slot)
                            raise
                        self.host.written(np.asarray([slot]))
                        self.host.index.release([slot])
                        promoted.append(slot)
                    d.index.touch(s, hit=True)
                    self.num_disk_hit_tokens += self.bs
                    self.host.index.lease([slot])
                    chain.append(slot)
            finally:
                self.host.index.release(chain)
                d.index.release(dchain)
                if self.events is not None and promoted:
                    self.events.stored("host", promoted)
        return chain

    def lease(self, slots: Sequence[int]) -> None:
        with self.lock:
            self.host.index.lease(slots)

    def release(self, slots: Sequence[int]) -> None:
        with self.lock:
            self.host.index.release(slots)

    # ---- admission (scheduler side) -----------------------------------------------------------
    def admit(self, parent: int, tokens: np.ndarray, ns_key: bytes) -> tuple[int, bool]:
        """``(slot, created)`` for one full block under host ``parent``; a created slot is
        pending until :meth:`save` fills it. ``(-1, False)``: not admitted (collision or full)."""
        tokens, ns_key = _checked(tokens, ns_key, self.bs)
        parent = as_int(parent, "parent", ROOT, self.host.capacity - 1)
        if parent != ROOT and self.host.index.rec["valid"][parent] != 1:
            raise InvalidArgumentError(expected("parent", "the root (-1) or a host slot that holds a block", parent))
        with self.lock:
            ns, h = self._ns(self.host, ns_key, True)
            slot, created = self.host.index.insert(parent, ns, h, tokens)
            if created:
                self.pending.add(slot)
            return slot, created

    def abandon(self, slots: Sequence[int], step: int | None = None) -> None:
        """Pending slots whose data will never land (the step did not run); with ``step``,
        only those that step's save carries (a report settles only its own step)."""
        with self.lock:
            for s in reversed(self._of_step(slots, step)):
                if s in self.pending:
                    for x in self.host.index.descendants(s) + [s]:
                        if x in self.pending:      # a pending slot holds its admission's lease
                            self._settle(x)
                            self.host.index.release([x])
                        self.host.index.remove(x)

    # ---- the worker's reports ------------------------------------------------------------
    def sent(self, step: int, saves: Sequence[int], loads: Sequence[int]) -> None:
        """Step ``step``'s metadata carries these saves (pending slots) and loads (leased
        slots): recorded until its report settles them, or :meth:`expire` does."""
        with self.lock:
            for s in saves:
                self._pending_step[s] = step
            self._sent[step] = (time.monotonic() + self.cfg.report_timeout_s, list(saves), list(loads))

    def expire(self, now: float | None = None) -> int:
        """Settle the steps whose report is overdue (see the module): their pending saves
        are abandoned and their loads released. Returns the slots settled."""
        now = time.monotonic() if now is None else now
        with self.lock:
            late = [step for step, (deadline, _, _) in self._sent.items() if deadline <= now]
            n = 0
            for step in late:
                _, saves, loads = self._sent.pop(step)
                saves = [s for s in saves if self._pending_step.get(s) == step]
                self.abandon(saves, step)
                if loads:
                    self.host.index.release(loads)
                n += len(saves) + len(loads)
            if n:
                self.num_report_timeouts += n
                log.warning("pagedkv connector: no worker report for %d step(s) within %.1f s; %d host slot(s) "
                            "released (their saves are misses)", len(late), self.cfg.report_timeout_s, n)
            return n

    def _of_step(self, slots: Sequence[int], step: int | None) -> list[int]:
        if step is None:
            return list(slots)
        return [s for s in slots if self._pending_step.get(s) == step]

    def _settle(self, slot: int) -> None:
        self.pending.discard(slot)
        step = self._pending_step.pop(slot, None)
        if step is None:
            return
        rec = self._sent.get(step)
        if rec is not None and slot in rec[1]:
            rec[1].remove(slot)
            self._drop_settled(step)

    def _drop_settled(self, step: int) -> None:
        rec = self._sent.get(step)
        if rec is not None and not rec[1] and not rec[2]:
            del self._sent[step]

    def committed(self, slots: Sequence[int], step: int | None = None) -> None:
        """The worker wrote these pending slots: they become hits (and go to disk). With
        ``step``, only the slots that step's save carries."""
        with self.lock:
            landed = [s for s in self._of_step(slots, step) if s in self.pending]
            if not landed:
                return
            self.host.written(np.asarray(landed))
            for s in landed:
                self._settle(s)
            self.host.index.release(landed)
            if self.events is not None:
                self.events.stored("host", landed)
            if self.cfg.disk_path is not None and self.cfg.disk_write == "through":
                self.to_disk(landed)
            if self.remote is not None:
                to_remote(self, self.remote, landed)

    def loaded(self, slots: Sequence[int], ok: bool, step: int | None = None) -> None:
        """The worker copied (``ok``) or failed to copy these leased slots: release them.
        With ``step``, only the leases that step's loads hold (a step already expired
        released its own)."""
        with self.lock:
            if step is not None:
                rec = self._sent.get(step)
                held = rec[2] if rec is not None else []
                mine = []
                for s in slots:
                    if s in held:
                        held.remove(s)
                        mine.append(s)
                slots = mine
                self._drop_settled(step)
            if ok:
                for s in slots:
                    self.host.index.touch(s, hit=True)
                self.host.num_hit_tokens += self.bs * len(slots)
            self.host.index.release(slots)

    # ---- host -> disk ------------------------------------------------------------------------
    def _host_evicting(self, slot: int) -> None:
        if self.cfg.disk_path is not None and slot not in self.pending:
            self.to_disk([slot])
        if self.events is not None and slot not in self.pending:
            self.events.removed("host", [slot])

    def to_disk(self, slots: Sequence[int]) -> None:
        """Admit these host slots' chains to the disk tier (ancestors first)."""
        with self.lock:
            view = self._fresh_view()
            if view is not None and all(self._held_by(view, s) for s in slots):
                return                             # all there already (written through): no need to open
            self._to_disk(slots)

    def _held_by(self, view: DiskPrefixTier, slot: int) -> bool:
        """Whether the disk tier, as ``view`` shows it, holds host ``slot``'s whole chain."""
        host = self.host
        parent = ROOT
        for a in host.index.chain(slot):
            ns, h = self._ns(view, host.ns_keys[int(host.index.rec["ns"][a])], False)
            if ns is None:
                return False
            parent = view.index.find_child(parent, ns, h, host.index.rec["tokens"][a])
            if parent < 0:
                return False
        return True

    def _to_disk(self, slots: Sequence[int]) -> None:
        with self.disk() as d:
            if d is None:
                return
            host = self.host
            done: dict[int, int] = {}
            new: list[int] = []                         # host slots written down (for events)
            for slot in slots:
                parent = ROOT
                for a in host.index.chain(slot):
                    if a in done:
                        parent = done[a]
                        continue
                    key = host.ns_keys[int(host.index.rec["ns"][a])]
                    ns, h = self._ns(d, key, True)
                    tok = np.array(host.index.rec["tokens"][a])
                    s, created = d.index.insert(parent, ns, h, tok)
                    if s < 0:
                        break
                    if created:
                        try:
                            d.write(host.arenas, [a], [s])
                            d.written(np.asarray([s]))
                        finally:
                            d.index.release([s])
                        self.num_disk_written += 1
                        new.append(a)
                    done[a] = parent = s
            if self.events is not None and new:
                self.events.stored("disk", new)

    # ---- pins, stats, reset -----------------------------------------------------------------
    def pin(self, tokens: np.ndarray, ns_key: bytes, pin: bool = True) -> int:
        """(Un)pin the host blocks of this prefix (pinned slots are never evicted);
        returns the tokens covered."""
        tokens, ns_key = _checked(tokens, ns_key)
        with self.lock:
            chain = self._host_chain(tokens, ns_key, len(tokens) // self.bs)
            for s in chain:
                self.host.index.pin(s) if pin else self.host.index.unpin(s)
            return len(chain) * self.bs

    def stats(self) -> list[TierStats]:
        h = self.host
        out = [TierStats(medium="host", capacity=h.capacity, used_blocks=h.index.num_used,
                         pinned_blocks=h.index.num_pinned, hit_tokens=h.num_hit_tokens,
                         written_blocks=h.num_written, eviction_count=h.index.num_evictions, corrupt_blocks=0)]
        if self.cfg.disk_path is not None:
            with self.lock, self.disk() as d:
                used = d.index.num_used if d is not None else -1
            out.append(TierStats(medium="disk", capacity=self.cfg.disk_blocks, used_blocks=used, pinned_blocks=0,
                                 hit_tokens=self.num_disk_hit_tokens, written_blocks=self.num_disk_written,
                                 eviction_count=0, corrupt_blocks=self.num_disk_corrupt))
        if self.remote is not None:
            out.append(self.remote.stats())
        return out

    def clear(self, disk: bool = False) -> None:
        with self.lock:
            busy = [s for s in range(self.host.capacity) if self.host.index.busy[s]]
            if busy:
                log.info("pagedkv connector: reset skipped, %d host slots in use", len(busy))
                return
            self.host.index.clear()
            self.pending.clear()
            self._pending_step.clear()
            self._sent.clear()
            if self.remote is not None:
                self.remote.clear()                        # what this engine knows; the server's keys stay
            if self.events is not None:
                self.events.cleared("host")
            if disk:
                with self.disk() as d:
                    if d is not None:
                        d.clear()
                        if self.events is not None:
                            self.events.cleared("disk")

    def close(self) -> None:
        with _stores_lock:
            _by_arena.pop(self.arena.name, None)
        with self.lock:
            if self._tier is not None:
                self._tier.close()
                self._tier = None
            if self.remote is not None:
                self.remote.close()
        self.arena.close()

