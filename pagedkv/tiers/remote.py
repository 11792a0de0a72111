"""The remote prefix tier: a Redis (or Valkey) server or a Redis Cluster that several
hosts share.

A block is stored under a key made of its chain digest, the namespace (inside the
digest) and the tier's format fingerprint (:mod:`pagedkv.tiers.remote_wire`); its
value is a header (format, tokens, chain link, lengths, a checksum) and its record in
pagedkv's at-rest format (codes, scales, block keys, sink and window rows), so a
quantized cache moves its quantized bytes. Two hosts with the same model and settings
name a prefix alike and share it; a warm restart finds what the last run stored.

Nothing a server returns is trusted: a value counts only when its header names this
format, this key, the query's tokens and the query's previous block, and its checksum
holds (:mod:`pagedkv.tiers.verify`). Wrong bytes, another format, a truncated value,
a value for another key, a timeout, a dropped connection or a cluster node that went
down give a miss, counted by reason in :meth:`RemotePrefixTier.stats`, never wrong KV
and never a wait past ``timeout_s``.

The network stays off the engine's critical path where it can:

- stores are queued (the payload is copied out of the device at once) and sent by a
  background writer in pipelined batches, bounded in bytes;
- a lookup that must fetch sends one pipelined batch per ``batch_blocks`` blocks and
  waits at most ``timeout_s``; :meth:`prefetch` (``PagedKVCache.prefetch``) starts it
  earlier, in the background, so the admission finds the blocks landed;
- each hit refreshes the key's TTL (``GETEX``); the server's ``maxmemory`` policy
  evicts (an LRU policy is expected; a server that refuses a write for lack of memory
  costs that write, counted as dropped).

The tier cannot pin (the server is shared). The server evicts on its own (its
``maxmemory`` policy, TTLs, another host's ``clear_server``): a block this process
stored that a lookup finds gone (or refused), a store the writer dropped or that
failed, is reported lost (``on_lost``: a ``BlockRemoved`` event), with the blocks it
knows below it, which no lookup can reach any more.
"""
from __future__ import annotations

import threading
import time
import weakref
from collections import OrderedDict, defaultdict, deque
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch

from pagedkv.config.remote import RemoteTierConfig
from pagedkv.errors import InvalidArgumentError, expected
from pagedkv.tiers.base import Handle, PrefixTier, TierRecord
from pagedkv.tiers.payload import Blocks, PayloadLayout, Payloads, move_rows
from pagedkv.tiers.remote_client import RemoteClient, Unavailable, delete_matching, exists_many, get_many
from pagedkv.tiers.remote_io import Landing, Put, RowPool, Writer
from pagedkv.tiers.remote_wire import Wire, format_fingerprint
from pagedkv.tiers.stats import TierStats
from pagedkv.tiers.verify import ROOT_DIGEST, ChainQuery, chain_digest

__all__ = ["RemotePrefixTier", "RemoteTierError"]

_KNOWN = 1 << 16          # blocks this process stored, remembered (links, events); older ones forgotten
_REASONS = ("missing", "truncated", "foreign", "other_format", "other_key", "checksum", "unavailable")


class RemoteTierError(ConnectionError):
    """An explicit remote-tier operation (``clear_server``, ``flush``) could not be done."""


class RemotePrefixTier(PrefixTier):
    """A remote tier for KV shaped like ``store_arenas``.

    Args:
        config: a :class:`~pagedkv.config.remote.RemoteTierConfig` (or its URL).
        store_arenas: the store's arenas (``[L, num_blocks, ...]`` each).
        block_size: tokens per block.
        kv_format: what the values must have been written for
            (:func:`pagedkv.format.fingerprint.kv_format`): part of every key.
        rows: the store's window arena (its sink and window rows travel with a block).
    """

    medium = "remote"

    def __init__(self, config: RemoteTierConfig | str, store_arenas: list[torch.Tensor], block_size: int,
                 kv_format: dict, *, rows=None):
        super().__init__()
        cfg = RemoteTierConfig.of(config)
        if cfg is None:
            raise InvalidArgumentError(expected("prefix_remote", "a URL or a RemoteTierConfig", None))
        self.cfg = cfg
        self.bs = block_size
        self.layout = PayloadLayout.of(store_arenas, rows)
        self.lock = None if rows is None else rows.lock
        self.fingerprint = format_fingerprint(kv_format, self.layout.describe())
        secret = cfg.secret.encode() if isinstance(cfg.secret, str) else cfg.secret     # a str was encoded already
        rows, valid = self.layout.section("rows"), self.layout.section("rows_valid")
        self.wire = Wire(cfg.key_prefix, self.fingerprint, block_size, self.layout.record_bytes, secret,
                         None if rows is None or valid is None else (rows.offset, valid.offset,
                                                                     valid.offset + valid.nbytes))
        if cfg.max_landed_bytes < self.layout.record_bytes:
            raise InvalidArgumentError(expected("prefix_remote.max_landed_bytes", f">= one block's record "
                                                f"({self.layout.record_bytes} bytes)", cfg.max_landed_bytes))
        self.ttl_ms = None if cfg.ttl_s is None else max(1, int(cfg.ttl_s * 1000))
        self.client = RemoteClient(cfg)
        # rows for what the writer holds (its queue and one batch in flight) and one store
        self.pool = RowPool(self.layout, self.wire.header_bytes,
                            cfg.max_queue_bytes // self.wire.value_bytes + 2 * cfg.batch_blocks, self.lock)
        self._loads: Payloads | None = None
        self.writer = Writer(self.client, self.wire, max_bytes=cfg.max_queue_bytes, batch=cfg.batch_blocks,
                             ttl_ms=self.ttl_ms, check_existing=cfg.check_existing, pool=self.pool)
        self.landing = Landing(cfg.max_landed_bytes)
        self._known: OrderedDict[bytes, tuple[bytes | None, np.ndarray, bytes]] = OrderedDict()
        self._staged: dict[bytes, Any] = {}     # admitted digest -> its staging row (RowPool)
        self._inflight: dict[bytes, Future] = {}
        self._inflight_lock = threading.Lock()
        self._on_removed = None
        self._on_lost = None
        self._gone: deque[bytes] = deque()    # found gone, maybe on a reader thread: reported by reap()
        self.refused = dict.fromkeys(_REASONS, 0)            # values refused at read, by reason
        self._finalizer = weakref.finalize(self, _shutdown, self.writer, self.client, cfg.timeout_s)

    # ---- queries ------------------------------------------------------------------------------
    def _keys(self, query: ChainQuery, start: int, stop: int) -> list[bytes]:
        return [self.wire.key(query.digest(i)) for i in range(start, stop)]

    def contains(self, query, start, max_blocks) -> int:
        n = self._contains(query, start, max_blocks)
        self.reap()
        return n

    def _contains(self, query, start, max_blocks) -> int:
        stop = min(max_blocks, query.num_blocks)
        if start >= stop:
            return 0
        try:
            there = self.client.call(exists_many, self._keys(query, start, stop))
        except Unavailable:
            self.refused["unavailable"] += 1
            return 0
        n = 0
        for e in there:
            if e != 1:
                if e == 0:
                    self._found_gone(query.digest(start + n))
                break
            n += 1
        return n

    def lookup(self, query, start, max_blocks, *, fetch=True):
        out = self._lookup(query, start, max_blocks, fetch)
        self.reap()
        return out

    def _lookup(self, query, start, max_blocks, fetch):
        """:meth:`lookup` without reporting what it found gone (any thread may run it)."""
        stop = min(max_blocks, query.num_blocks)
        if start >= stop:
            return []
        if not fetch:
            return [query.digest(i) for i in range(start, start + self._contains(query, start, stop))]
        # at most what the landing buffer holds, so this lookup's blocks are still there to load
        stop = min(stop, start + self.cfg.max_landed_bytes // self.layout.record_bytes)
        deadline = time.monotonic() + self.cfg.timeout_s
        out: list[Handle] = []
        i = start
        while i < stop:
            d = query.digest(i)
            if d in self.landing:
                out.append(d)
                i += 1
                continue
            pending = self._inflight.get(d)
            if pending is not None:        # a prefetch is bringing it
                try:
                    pending.result(timeout=max(0.0, deadline - time.monotonic()))
                except Exception:
                    pass
                if d in self.landing:
                    continue
            asked = min(stop, i + self.cfg.batch_blocks) - i
            got = self._fetch(query, i, i + asked, deadline)
            out.extend(got)
            i += len(got)
            if len(got) < asked:
                break                      # the batch ended at a block the server lacks (or refused)
        for j, d in enumerate(out):        # on the server: a store of them (the device's copy) is not sent back
            self._know(d, None if start + j == 0 else query.digest(start + j - 1), query.block(start + j), query.ns_key)
        return out

    def _fetch(self, query: ChainQuery, start: int, stop: int, deadline: float | None = None,
               direct: bool = False) -> list[bytes]:
        """Get, verify and land blocks ``start:stop`` of ``query``; their digests, up to
        the first that fails."""
        keys = self._keys(query, start, stop)
        try:
            if direct:
                values = self.client.direct(get_many, keys, self.ttl_ms)
            else:
                values = self.client.call(get_many, keys, self.ttl_ms, deadline=deadline)
        except Unavailable:
            self.refused["unavailable"] += 1
            return []
        out = []
        for j, v in enumerate(values):
            i = start + j
            if isinstance(v, Exception):
                self.refused["unavailable"] += 1
                break
            d = query.digest(i)
            record, why = self.wire.decode(v, d, query.parent_digest(i), query.block(i))
            if record is None:
                self.refused[why] += 1
                if why != "missing":
                    self.num_corrupt += 1
                self._found_gone(d)
                break
            self.landing.add(d, record)
            out.append(d)
        return out

    def verify(self, handle) -> bool:
        """A leased block is landed (a lookup's record that left the landing buffer since
        is fetched again by :meth:`lookup`'s caller only through a new lookup: a miss)."""
        return handle in self.landing

    # ---- asynchronous verbs ------------------------------------------------------------------------
    def prefetch(self, query, start, max_blocks) -> None:
        stop = min(max_blocks, query.num_blocks, start + self.cfg.max_landed_bytes // self.layout.record_bytes)
        todo = [i for i in range(start, stop) if query.digest(i) not in self.landing]
        if not todo:
            return
        first = todo[0]
        digests = [query.digest(i) for i in range(first, stop)]
        try:
            fut = self.client.submit(self._prefetch_run, query, first, stop)
        except Unavailable:
            return
        with self._inflight_lock:
            for d in digests:
                self._inflight[d] = fut

        def done(_f, digests=digests):
            with self._inflight_lock:
                for d in digests:
                    if self._inflight.get(d) is _f:
                        del self._inflight[d]

        fut.add_done_callback(done)

    def _prefetch_run(self, _client, query: ChainQuery, start: int, stop: int) -> int:
        n = 0
        for i in range(start, stop, self.cfg.batch_blocks):
            got = self._fetch(query, i, min(stop, i + self.cfg.batch_blocks), direct=True)
            n += len(got)
            if len(got) < min(stop, i + self.cfg.batch_blocks) - i:
                break
        return n

    def get_non_blocking(self, query, start, max_blocks) -> Future:
        fut: Future = Future()

        def run():
            try:
                fut.set_result(self._lookup(query, start, max_blocks, True))    # reported by the next call
            except BaseException as e:           # pragma: no cover - lookup turns failures into misses
                fut.set_exception(e)

        threading.Thread(target=run, name="pagedkv-remote-get", daemon=True).start()
        return fut

    # ---- payloads -----------------------------------------------------------------------------------
    def load(self, handles, dst: Blocks, dst_ids) -> None:
        n = len(handles)
        if not n:
            return
        staging = self._loads
        if staging is None or staging.n < n:                # reused: a fresh buffer pays page faults per load
            staging = self._loads = self.layout.empty(max(n, 2 * (staging.n if staging is not None else 0)))
        rows = staging.base.numpy()
        for i, d in enumerate(handles):
            record = self.landing.get(d)
            if record is None:
                raise RuntimeError("remote tier: a leased block left the landing buffer (a bug in pagedkv)")
            sent = len(record)
            rows[i, :sent] = np.frombuffer(record, dtype=np.uint8)
            rows[i, sent:] = 0                               # rows the value left out: none held
        ids = list(range(n))
        staging.read(ids, dst.arenas, list(dst_ids))
        move_rows(Blocks(staging.arenas, staging.window, dst.lock), dst, list(zip(ids, dst_ids)))

    def admit(self, parent, ns_key, tokens):
        self.reap()                        # a block the server lost is stored again
        d = chain_digest(ROOT_DIGEST if parent is None else parent, ns_key, tokens)
        if d in self._known:
            self._known.move_to_end(d)
            return d, False
        self._know(d, parent, tokens, ns_key)
        return d, True

    def _know(self, d: bytes, parent: bytes | None, tokens, ns_key: bytes) -> None:
        """Remember a block this process knows the server has (or will have)."""
        if d in self._known:
            self._known.move_to_end(d)
            return
        self._known[d] = (parent, np.array(tokens, dtype=np.int32), bytes(ns_key))
        while len(self._known) > _KNOWN:
            old = next(iter(self._known))
            if old in self._staged:
                break
            self._forget(old)

    def store(self, src: Blocks, src_ids, handles) -> None:
        for b, d in zip(src_ids, handles):
            row = self.pool.take()
            if row is None:          # as many rows out as the writer's queue holds: this one is dropped
                continue
            row.payloads.write(src.arenas, [b], [0])
            move_rows(src, Blocks(row.payloads.arenas, row.payloads.window, src.lock), [(b, 0)])
            self._staged[d] = row

    def commit(self, handles) -> None:
        puts = []
        for d in handles:
            row = self._staged.pop(d, None)
            known = self._known.get(d)
            if row is None or known is None:
                if row is not None:
                    self.pool.give(row)
                self._lose([d])
                self.writer.num_dropped += row is None
                continue
            parent, tokens, _ = known
            puts.append(Put(d, ROOT_DIGEST if parent is None else parent, tokens, row))
        self._lose([p.digest for p in self.writer.put(puts)])     # dropped: a later store may try again
        self.num_written += len(puts)

    def abandon(self, handles) -> None:
        for d in handles:
            row = self._staged.pop(d, None)
            if row is not None:
                self.pool.give(row)
        self._lose(list(handles))

    def _forget(self, d: bytes) -> None:
        if self._known.pop(d, None) is not None and self._on_removed is not None:
            self._on_removed(d)

    def _found_gone(self, d: bytes) -> None:
        if d in self._known:               # stored (or seen) by this process: it was announced
            self._gone.append(d)

    def reap(self) -> None:
        """Report what lookups found gone and what the writer failed to store."""
        lost = []
        for q in (self._gone, self.writer.failed):
            while q:
                lost.append(q.popleft())
        if lost:
            self._lose(lost)

    def _lose(self, digests: list[bytes]) -> None:
        """These blocks are not on the server: they and the known blocks below them
        (unreachable: a lookup stops at the first block it lacks) are reported, then forgotten."""
        gone = [d for d in dict.fromkeys(digests) if d in self._known and d not in self._staged]
        if not gone:
            return
        children: dict[bytes, list[bytes]] = defaultdict(list)
        for d, (parent, _, _) in self._known.items():
            if parent is not None:
                children[parent].append(d)
        order: list[bytes] = []
        frontier = gone
        while frontier:
            order.extend(frontier)
            frontier = [c for d in frontier for c in children.get(d, ())]
        order = list(dict.fromkeys(order))
        order.reverse()                    # deepest first, every record still readable
        if self._on_lost is not None:
            self._on_lost(order)
        for d in order:
            self._forget(d)

    # ---- what this process knows of its blocks ---------------------------------------------------------
    def set_callbacks(self, on_evict, on_removed, on_lost=None) -> None:
        self._on_removed = on_removed
        self._on_lost = on_lost

    def current(self, handle, stamp) -> bool:
        return handle in self._known

    def record(self, handle) -> TierRecord | None:
        k = self._known.get(handle)
        if k is None:
            return None
        parent, tokens, ns_key = k
        return TierRecord(tokens, ns_key, None if parent is None else (parent, 0), 0)

    def chain(self, handle) -> list[Handle]:
        out: list[Handle] = []
        d: bytes | None = handle
        while d is not None:
            k = self._known.get(d)
            if k is None:
                return []
            out.append(d)
            d = k[0]
        return out[::-1]

    def lease(self, handles) -> None:
        self.landing.lease(handles)

    def release(self, handles) -> None:
        self.landing.release(handles)

    def drop(self, handle) -> None:
        self._forget(handle)

    def clear(self) -> list[Handle]:
        """Forget what this process knows and has landed (the server's keys stay: other
        hosts share them; :meth:`clear_server` removes them)."""
        held = list(self._known)
        self._known.clear()
        for row in self._staged.values():
            self.pool.give(row)
        self._staged.clear()
        self.landing.clear()
        return held

    # ---- explicit operations ----------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued store was answered; False when ``timeout`` passed first."""
        return self.writer.flush(timeout)

    def clear_server(self) -> int:
        """Remove every key of this tier's format from the server (every node of a
        cluster); returns how many. Raises :class:`RemoteTierError` when the server
        cannot be reached."""
        self.flush(self.cfg.timeout_s * 10)
        self.clear()
        try:
            return self.client.direct(delete_matching, self.wire.pattern())
        except Unavailable as e:
            raise RemoteTierError(expected("prefix_remote", "a server that answers", str(e))) from None

    # ---- stats, close -------------------------------------------------------------------------------------
    def stats(self) -> TierStats:
        w = self.writer
        return TierStats(medium=self.medium, capacity=0, used_blocks=len(self._known), pinned_blocks=0,
                         hit_tokens=self.num_hit_tokens, written_blocks=w.num_sent + w.num_present,
                         eviction_count=0, corrupt_blocks=self.num_corrupt, queued_blocks=w.queued,
                         dropped_blocks=w.num_dropped, errors=self.client.num_errors,
                         refused=tuple((k, v) for k, v in self.refused.items() if v))

    def close(self) -> None:
        self._finalizer()


def _shutdown(writer: Writer, client: RemoteClient, timeout: float) -> None:
    writer.close(max(1.0, 20 * timeout))
    client.close()
