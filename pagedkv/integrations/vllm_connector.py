"""PagedKVConnector: vLLM's ``KVConnectorBase_V1`` backed by pagedkv's prefix tiers.

Load it with ``kv_transfer_config={"kv_connector": "PagedKVConnector",
"kv_connector_module_path": "pagedkv.integrations.vllm", "kv_role": "kv_both",
"kv_connector_extra_config": {...}}`` (keys: :class:`.vllm_config.ConnectorConfig`).

vLLM builds two instances: the scheduler side (in the engine core) and the worker side
(in the worker process, by default another process). The scheduler side owns the
:class:`~.vllm_store.PrefixStore` (verified index, disk tier, the host tier's shared
arena); ``get_num_new_matched_tokens`` answers from it with the request's tokens
verified and leases the slots it will load; ``build_connector_meta`` admits every block
the step completes as pending and sends the arena's name with ``(slot, block)`` loads and
``(block, slot)`` saves. The worker side (:class:`~.vllm_worker.BlockMover`) maps the
arena, copies before the forward (``start_load_kv``, which vLLM runs first whenever a
step has synchronous loads) and after it (``wait_for_save``), and reports what it did
(``build_connector_worker_meta``); the scheduler side commits saved slots and releases
loaded ones in ``update_connector_output``. Only vLLM's public connector API is used.

Before the first step the scheduler side must know the worker can copy (a failed load
fails the request under vLLM's default ``kv_load_failure_policy``): the worker, which
vLLM sets up first, leaves its verdict on its KV tensors in a small status file keyed by
the engine id; without one, the scheduler serves loads only after the worker's first
report.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import secrets
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from pagedkv.errors import InternalError
from pagedkv.integrations.vllm_config import ConnectorConfig
from pagedkv.integrations.vllm_events import to_vllm
from pagedkv.integrations.vllm_layerwise import LayerCopies
from pagedkv.integrations.vllm_shm import _alive, read_status, shm_dir
from pagedkv.integrations.vllm_store import PrefixStore, get_store, lookup_store, store_of_arena
from pagedkv.integrations.vllm_worker import BlockMover, KVSpec
from pagedkv.tiers.chain import ROOT

__all__ = ["PagedKVConnector", "PagedKVMetadata", "PagedKVWorkerMetadata", "set_debug_shuffle_loads", "worker_stats"]

log = logging.getLogger("pagedkv.vllm")

_movers: dict[str, BlockMover] = {}      # this process's worker sides, by engine id


@dataclass
class PagedKVMetadata(KVConnectorMetadata):
    arena: str | None = None                                      # the shared arena's name
    step: int = 0                                                 # the scheduler side's step number
    loads: list[tuple[int, int]] = field(default_factory=list)    # (host slot, vLLM block)
    saves: list[tuple[int, int]] = field(default_factory=list)    # (vLLM block, host slot)


@dataclass
class ArenaReport:
    arena: str = ""                                        # the arena's name
    step: int = 0                                          # the step whose metadata this reports on
    opened: bool = False
    refused: str | None = None
    loaded: list[int] = field(default_factory=list)        # slots copied into vLLM blocks
    load_failed: list[int] = field(default_factory=list)
    saved: list[int] = field(default_factory=list)         # slots written from vLLM blocks
    save_failed: list[int] = field(default_factory=list)

    def merge(self, o: ArenaReport) -> None:
        self.opened = self.opened or o.opened
        self.refused = self.refused or o.refused
        for k in ("loaded", "load_failed", "saved", "save_failed"):
            getattr(self, k).extend(getattr(o, k))


@dataclass
class PagedKVWorkerMetadata(KVConnectorWorkerMetadata):
    reports: dict[str, ArenaReport] = field(default_factory=dict)   # "<arena>@<step>" -> that step's report

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, PagedKVWorkerMetadata):
            for name, r in other.reports.items():
                self.reports.setdefault(name, ArenaReport(arena=r.arena, step=r.step)).merge(r)
        return self


def set_debug_shuffle_loads(worker: Any, on: bool) -> int:
    """Tests only (``llm.collective_rpc(set_debug_shuffle_loads, args=(True,))``): load
    each layer's blocks into the next layer, so a test proves loaded KV is really read.
    Returns how many worker sides in this process it set."""
    for m in _movers.values():
        m.debug_shuffle_loads = bool(on)
    return len(_movers)


def worker_stats(worker: Any) -> list[dict]:
    """Tests and benchmarks (``llm.collective_rpc(worker_stats)``): per worker side in this
    process, its layout and layer-wise counters."""
    out = []
    for m in _movers.values():
        lc = getattr(m, "copies", None)
        out.append({"layout": m.layout, "refused": m.refused, "transfer": "sync" if lc is None else "layerwise",
                    "num_unwaited": 0 if lc is None else lc.num_unwaited,
                    "num_backpressure": 0 if lc is None else lc.num_backpressure})
    return out


def _status_path(engine_id: str):
    return shm_dir() / f"pagedkv-vllm-worker-{hashlib.sha1(engine_id.encode()).hexdigest()[:16]}.json"


def _spec_of(kv_cache_config) -> tuple[KVSpec | None, str | None, list[str]]:
    """The KV spec of a single full-attention group, or why there is none."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) != 1:
        kinds = ", ".join(type(g.kv_cache_spec).__name__ for g in groups)
        return None, (f"the model has {len(groups)} KV cache groups ({kinds}); the pagedkv connector serves "
                      "single-group full-attention models only (it does not implement SupportsHMA; vLLM "
                      "merges sliding-window layers into one group without HMA, SSM hybrids cannot be "
                      "served)"), []
    spec = groups[0].kv_cache_spec
    kind = type(spec).__name__
    if kind != "FullAttentionSpec":
        return None, f"KV cache spec {kind}: the pagedkv connector serves full attention only", []
    head_v = getattr(spec, "head_size_v", None)
    if head_v not in (None, spec.head_size):
        return None, f"head_size_v={head_v} differs from head_size={spec.head_size}", []
    names = list(groups[0].layer_names)
    return KVSpec(len(names), spec.num_kv_heads, spec.block_size, spec.head_size, spec.dtype), None, names


class PagedKVConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        self.cfg = ConnectorConfig.from_extra(getattr(ktc, "kv_connector_extra_config", None))
        self._spec, why, self._layer_names = _spec_of(kv_cache_config)
        self._tag = self.cfg.model_tag or str(vllm_config.model_config.model)
        self._key = str(ktc.engine_id)
        self._why = why
        self._scheduler = role == KVConnectorRole.SCHEDULER
        if self._spec is None:
            log.warning("pagedkv connector: serving nothing: %s", why)
        elif self._scheduler:
            store = get_store(self._key, self.cfg, self._spec, self._tag)
            self._read_worker_status(store)
            events = getattr(vllm_config, "kv_events_config", None)
            if events is not None and getattr(events, "enable_kv_cache_events", False):
                store.enable_events()             # vLLM publishes them with its own (take_events)
        # scheduler side
        self._lookups: dict[str, tuple[int, list[int]]] = {}   # req -> (first block, leased slots)
        self._loads: list[tuple[int, int]] = []
        self._reqs: dict[str, Any] = {}
        self._step = 0                                          # the metadata's step number
        self._chains: dict[str, list[tuple[int, int]]] = {}    # req -> host (slot, gen) per stored block
        # worker side
        self.mover: BlockMover | None = None
        self.layers: LayerCopies | None = None        # transfer="layerwise"
        self._pending_loads: tuple | None = None       # (meta, report, block size) of the step's layer-wise loads
        self._pending_saves: tuple | None = None       # (meta, report or None when already settled)
        self._report: dict[str, ArenaReport] = {}
        self._load_errors: set = set()
        self.num_loaded_tokens = 0
        self.num_saved_blocks = 0

    @property
    def store(self) -> PrefixStore | None:
        # Looked up each time: a test or benchmark may swap the engine's store.
        return None if self._why is not None else lookup_store(self._key)

    def _read_worker_status(self, store: PrefixStore) -> None:
        path = _status_path(self._key)
        status = read_status(path)      # never blocks, follows no symlink, reads only this user's small file
        if status is None:
            log.info("pagedkv connector: no usable worker status at %s; loads start after the worker's first "
                     "report", path)
            return
        try:
            path.unlink()
        except OSError:
            pass
        if not _alive(status["pid"]):
            log.info("pagedkv connector: stale worker status at %s ignored", path)
        elif status.get("refused"):
            store.refuse(f"the worker refused vLLM's KV: {status['refused']}")
        else:
            store.worker_ready = True

    # ---- scheduler side ------------------------------------------------------------------
    def _ns_key(self, request) -> bytes | None:
        if getattr(request, "mm_features", None) or getattr(request, "prompt_embeds", None) is not None:
            return None                        # tokens do not identify the content
        lora = getattr(request, "lora_request", None)
        salt = getattr(request, "cache_salt", None) or ""
        parts = [self._tag, salt, "" if lora is None else f"lora:{lora.lora_name}:{lora.lora_int_id}"]
        return "\x00".join(parts).encode()

    def _live(self) -> PrefixStore:
        """The store, once :meth:`_usable` said there is one."""
        s = self.store
        if s is None:
            raise InternalError("pagedkv connector: the store was used before it was opened")
        return s

    def _usable(self, loads: bool = True) -> bool:
        s = self.store
        return s is not None and s.refused is None and (s.worker_ready or not loads)

    def on_new_request(self, request) -> None:
        self._reqs[request.request_id] = request

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        rid = request.request_id
        self._reqs[rid] = request
        self._drop_lookup(rid)
        if not self._usable():
            return 0, False
        s = self._live()
        bs = s.bs
        n_tok = request.num_tokens
        max_blocks = (n_tok - 1) // bs        # vLLM must compute at least one token
        first = num_computed_tokens // bs
        if max_blocks <= first:
            return 0, False
        ns_key = self._ns_key(request)
        if ns_key is None:
            return 0, False
        tokens = np.asarray(request.all_token_ids, dtype=np.int32)
        chain = s.lookup(tokens, ns_key, max_blocks)
        if len(chain) <= first:
            return 0, False
        leased = chain[first:]
        s.lease(leased)
        self._lookups[rid] = (first, leased)
        return len(chain) * bs - num_computed_tokens, False

    def _drop_lookup(self, rid: str) -> None:
        found = self._lookups.pop(rid, None)
        if found is not None:
            self._live().release(found[1])

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        rid = request.request_id
        found = self._lookups.pop(rid, None)
        if found is None:
            return
        first, leased = found
        s = self._live()
        n = num_external_tokens // s.bs if num_external_tokens > 0 else 0
        ids = blocks.get_block_ids()[0]
        use = leased[:n]
        s.release(leased[n:])
        self._loads.extend(zip(use, ids[first:first + n]))

    def build_connector_meta(self, scheduler_output) -> PagedKVMetadata:
        self._step += 1
        meta = PagedKVMetadata(loads=self._loads, step=self._step)
        self._loads = []
        if self.store is not None:
            self.store.expire()                    # steps whose report never came (see PrefixStore.expire)
        if not self._usable(loads=False) or self._kv_cache_manager is None:
            if meta.loads:                         # the store was swapped or refused since the lookup
                self._live().release([p[0] for p in meta.loads])
                meta.loads = []
            return meta
        so = scheduler_output
        s = self._live()
        bs = s.bs
        for new in so.scheduled_new_reqs:
            self._maybe_save(new.req_id, so, bs, meta.saves)
        for rid in so.scheduled_cached_reqs.req_ids:
            self._maybe_save(rid, so, bs, meta.saves)
        if meta.loads or meta.saves:
            meta.arena = s.arena.name
            s.sent(meta.step, [slot for _, slot in meta.saves], [slot for slot, _ in meta.loads])
        return meta

    def _maybe_save(self, rid: str, so, bs: int, saves: list) -> None:
        req = self._reqs.get(rid)
        if req is None:
            return
        known = min(req.num_computed_tokens + so.num_scheduled_tokens.get(rid, 0), req.num_tokens)
        chain = self._chains.get(rid)
        # The common decode step completes no block: nothing to check.
        if chain is not None and len(chain) >= known // bs and not self._chain_broken(chain):
            return
        ns_key = self._ns_key(req)
        if ns_key is not None:
            self._plan_saves(rid, req, ns_key, known, saves)

    def _chain_broken(self, chain: list) -> bool:
        rec = self._live().host.index.rec
        return bool(chain) and (rec["valid"][chain[-1][0]] != 1 or rec["gen"][chain[-1][0]] != chain[-1][1])

    def _plan_saves(self, rid: str, req, ns_key: bytes, known: int, saves: list) -> None:
        s = self._live()
        bs = s.bs
        full = known // bs
        chain = self._chains.setdefault(rid, [])
        rec = s.host.index.rec
        # A slot evicted since (its generation moved on) breaks the chain there: re-admit.
        for i, (slot, gen) in enumerate(chain):
            if rec["valid"][slot] != 1 or rec["gen"][slot] != gen:
                del chain[i:]
                break
        if len(chain) >= full:
            return
        ids = self._kv_cache_manager.get_block_ids(rid)[0]
        tokens = req.all_token_ids
        for i in range(len(chain), min(full, len(ids))):
            parent = chain[-1][0] if chain else ROOT
            slot, created = s.admit(parent, np.asarray(tokens[i * bs:(i + 1) * bs], dtype=np.int32), ns_key)
            if slot < 0:
                return                             # a collision or a full tier: stop this chain here
            if created:
                saves.append((ids[i], slot))
            chain.append((slot, int(rec["gen"][slot])))

    def update_connector_output(self, connector_output) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if not isinstance(meta, PagedKVWorkerMetadata):
            return
        for r in meta.reports.values():
            name = r.arena
            s = store_of_arena(name)
            if s is None:
                continue
            if r.refused:
                s.refuse(f"the worker refused arena {name}: {r.refused}")
            elif r.opened:
                s.worker_ready = True
                s.arena.unlink()                   # both sides hold it mapped: a crash leaves nothing
            # each settles only what step r.step sent (a report that comes after its step
            # expired, or names slots that step did not send, changes nothing)
            if r.loaded:
                s.loaded(r.loaded, ok=True, step=r.step)
            if r.load_failed:
                s.loaded(r.load_failed, ok=False, step=r.step)
            if r.saved:
                s.committed(r.saved, step=r.step)
            if r.save_failed:
                s.abandon(r.save_failed, step=r.step)

    def request_finished(self, request, block_ids):
        rid = request.request_id
        self._drop_lookup(rid)
        self._reqs.pop(rid, None)
        self._chains.pop(rid, None)
        # The step that completed a block already copied it (wait_for_save is synchronous),
        # so vLLM may free the blocks now; the commit waits for the worker's report.
        return False, None

    def take_events(self):
        """The tiers' KV events since the last call, as vLLM's event objects (vLLM sends
        them in its own stream with its device events; :mod:`.vllm_events`)."""
        s = self.store
        if s is None or s.events is None:
            return ()
        with s.lock:
            if s.remote is not None:
                s.remote.reap()             # what the remote writer could not store
            drained = s.events.drain()
        return to_vllm(drained, s.bs)

    def reset_cache(self) -> bool:
        if self.store is not None:
            self.store.clear(disk=True)
        return True

    def shutdown(self):
        if self._scheduler and self._why is None:
            s = lookup_store(self._key)
            if s is not None:
                s.arena.unlink()
        if self.layers is not None:
            self.layers.close()
            self.layers = None
        if self.mover is not None:
            _movers.pop(self._key, None)
            self.mover.close()

    # ---- worker side -------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        if self._spec is None:
            return
        self.mover = BlockMover()
        missing = [n for n in self._layer_names if n not in kv_caches]
        if missing:
            why: str | None = f"vLLM registered no KV tensor for layer {missing[0]!r}"
            self.mover.refused = why
            log.warning("pagedkv connector: serving nothing: %s", why)
        else:
            why = self.mover.register(self._spec, [kv_caches[n] for n in self._layer_names],
                                      self._backend_name())
            if why is None and self.cfg.transfer == "layerwise":
                self.layers = LayerCopies(self.mover, self._layer_names, self.cfg.transfer_depth)
                self.mover.copies = self.layers
        _movers[self._key] = self.mover
        # The scheduler side is built after this (vLLM sets the worker up first): leave it
        # the verdict, atomically, keyed by the engine id.
        path = _status_path(self._key)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(8)}.tmp")
        created = False
        try:       # a fresh name, created here: nothing planted under it is followed or truncated
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            created = True
            try:
                os.write(fd, json.dumps({"pid": os.getpid(), "refused": why}).encode())
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as e:
            if created:
                with contextlib.suppress(OSError):
                    tmp.unlink()
            log.info("pagedkv connector: could not leave the worker status (%s); loads start after the "
                     "first report", e)

    def _backend_name(self) -> str | None:
        """The attention backend's name (settles a layout the shape alone leaves open),
        from vLLM's per-layer forward context; None when vLLM does not expose it."""
        ctx = getattr(getattr(self._vllm_config, "compilation_config", None), "static_forward_context", None) or {}
        layer = ctx.get(self._layer_names[0]) if self._layer_names else None
        backend = getattr(layer, "attn_backend", None)
        try:
            return None if backend is None else str(backend.get_name())
        except Exception:     # a backend class without get_name: the shape must decide alone
            return None

    def _arena_for(self, meta: PagedKVMetadata):
        if self.mover is None or meta.arena is None:
            return None, None
        got, why, new = self.mover.arena(meta.arena)
        r = self._report.setdefault(f"{meta.arena}@{meta.step}", ArenaReport(arena=meta.arena, step=meta.step))
        if new:
            r.opened = got is not None
            r.refused = why
        return got, r

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, PagedKVMetadata) or not meta.loads:
            return
        got, r = self._arena_for(meta)
        try:
            if got is None:
                raise InternalError(f"no usable arena for {len(meta.loads)} loads ({meta.arena})")
            if self.layers is not None:
                self.layers.start_loads(got[0], got[1], meta.loads)     # finished in wait_for_save
                self._pending_loads = (meta, r, got[0].layout["block_size"])
                return
            self.mover.load(got[0], got[1], meta.loads)      # type: ignore[union-attr]
        except Exception as e:
            self._load_done(meta, r, 0, e)
            return
        self._load_done(meta, r, got[0].layout["block_size"], None)

    def _load_done(self, meta: PagedKVMetadata, r: ArenaReport | None, block_size: int,
                   err: BaseException | None) -> None:
        slots = [p[0] for p in meta.loads]
        if err is None:
            self.num_loaded_tokens += len(meta.loads) * block_size
            if r is not None:
                r.loaded.extend(slots)
            return
        # vLLM recomputes (or fails, per its kv_load_failure_policy) blocks reported as
        # failed; they are never served
        log.warning("pagedkv connector: load failed (%s: %s); %d blocks not served",
                    type(err).__name__, err, len(meta.loads))
        self._load_errors.update(b for _, b in meta.loads)
        if r is not None:
            r.load_failed.extend(slots)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.layers is not None:
            self.layers.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        if self.layers is None:
            return
        if not self.layers.saving and self._pending_saves is None:
            meta = self._get_connector_metadata()
            if not isinstance(meta, PagedKVMetadata) or not meta.saves:
                return
            got, r = self._arena_for(meta)
            try:
                if got is None:
                    raise InternalError(f"no usable arena for {len(meta.saves)} saves ({meta.arena})")
                self.layers.start_saves(got[0], got[1], meta.saves)
            except Exception as e:
                self._save_done(meta, r, e)
                self._pending_saves = (meta, None)      # this step's saves are settled
                return
            self._pending_saves = (meta, r)
        self.layers.save_layer(layer_name)

    def _save_done(self, meta: PagedKVMetadata, r: ArenaReport | None, err: BaseException | None) -> None:
        slots = [p[1] for p in meta.saves]
        if err is None:
            self.num_saved_blocks += len(meta.saves)
            if r is not None:
                r.saved.extend(slots)
            return
        log.warning("pagedkv connector: save failed (%s: %s)", type(err).__name__, err)    # a later miss
        if r is not None:
            r.save_failed.extend(slots)

    def wait_for_save(self):
        if self.layers is not None:
            self._finish_layerwise()
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, PagedKVMetadata) or not meta.saves:
            return
        got, r = self._arena_for(meta)
        try:
            if got is None:
                raise InternalError(f"no usable arena for {len(meta.saves)} saves ({meta.arena})")
            self.mover.save(got[0], got[1], meta.saves)      # type: ignore[union-attr]
        except Exception as e:
            self._save_done(meta, r, e)
            return
        self._save_done(meta, r, None)

    def _finish_layerwise(self) -> None:
        """The step is over: settle its layer-wise loads and saves (a save no layer
        started, e.g. a step without attention metadata, runs now, whole)."""
        layers = self.layers
        if layers is None:
            return
        if self._pending_loads is not None:
            meta, r, bs = self._pending_loads
            self._pending_loads = None
            err = layers.finish_loads()
            self._load_done(meta, r, bs if err is None else 0, err)
        if self._pending_saves is None:
            meta = self._get_connector_metadata()
            if isinstance(meta, PagedKVMetadata) and meta.saves:
                got, r = self._arena_for(meta)
                try:
                    if got is None:
                        raise InternalError(f"no usable arena for {len(meta.saves)} saves ({meta.arena})")
                    layers.start_saves(got[0], got[1], meta.saves)
                except Exception as e:
                    self._save_done(meta, r, e)
                else:
                    self._save_done(meta, r, layers.finish_saves())
            return
        meta, r = self._pending_saves
        self._pending_saves = None
        if r is not None or layers.saving:
            self._save_done(meta, r, layers.finish_saves())

    def build_connector_worker_meta(self) -> PagedKVWorkerMetadata | None:
        if not self._report:
            return None
        out, self._report = PagedKVWorkerMetadata(self._report), {}
        return out

    def get_block_ids_with_load_errors(self) -> set:
        out, self._load_errors = self._load_errors, set()
        return out
