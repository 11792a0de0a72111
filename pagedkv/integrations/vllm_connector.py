"""PagedKVConnector: vLLM's ``KVConnectorBase_V1`` backed by pagedkv's prefix tiers.

Load it with ``kv_transfer_config={"kv_connector": "PagedKVConnector",
"kv_connector_module_path": "pagedkv.integrations.vllm", "kv_role": "kv_both",
"kv_connector_extra_config": {...}}`` (keys: :class:`.vllm_config.ConnectorConfig`).

Scheduler side: ``get_num_new_matched_tokens`` answers from the tiers with the
request's tokens verified (:meth:`.vllm_store.PrefixStore.lookup`) and leases the slots it
will load; ``build_connector_meta`` admits every block that this step completes (prompt
or output) under its parent's host slot. Worker side: ``start_load_kv`` copies the
leased slots into the request's blocks before the forward (vLLM runs it first whenever
a step has synchronous loads), ``wait_for_save`` copies the completed blocks out after
it. Only vLLM's public connector API is used.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from pagedkv.errors import InternalError
from pagedkv.integrations.vllm_config import ConnectorConfig
from pagedkv.integrations.vllm_store import KVSpec, PrefixStore, get_store, lookup_store
from pagedkv.tiers.chain import ROOT

__all__ = ["PagedKVConnector", "PagedKVMetadata"]

log = logging.getLogger("pagedkv.vllm")


@dataclass
class PagedKVMetadata(KVConnectorMetadata):
    loads: list[tuple[int, int]] = field(default_factory=list)    # (host slot, vLLM block)
    saves: list[tuple[int, int]] = field(default_factory=list)    # (vLLM block, host slot)


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
        spec, why, self._layer_names = _spec_of(kv_cache_config)
        self._tag = self.cfg.model_tag or str(vllm_config.model_config.model)
        self._key = str(ktc.engine_id)
        self._why = why
        if spec is None:
            log.warning("pagedkv connector: serving nothing: %s", why)
        else:
            get_store(self._key, self.cfg, spec, self._tag)
        # scheduler side
        self._lookups: dict[str, tuple[int, list[int]]] = {}   # req -> (first block, leased slots)
        self._loads: list[tuple[int, int]] = []
        self._reqs: dict[str, Any] = {}
        self._chains: dict[str, list[tuple[int, int]]] = {}    # req -> host (slot, gen) per stored block
        self._warned_unregistered = False
        # worker side
        self._load_errors: set = set()
        self.num_loaded_tokens = 0
        self.num_saved_blocks = 0

    @property
    def store(self) -> PrefixStore | None:
        # Looked up each time: both sides share the engine's store (and a test may swap it).
        return None if self._why is not None else lookup_store(self._key)

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
        if self.store is None:
            raise InternalError("pagedkv connector: the store was used before it was opened")
        return self.store

    def _usable(self) -> bool:
        s = self.store
        if s is None or s.refused is not None:
            return False
        if s.kv is None:
            if not self._warned_unregistered:
                self._warned_unregistered = True
                log.warning("pagedkv connector: no worker registered its KV in this process: vLLM's CPU "
                            "worker runs in its own process unless VLLM_ENABLE_V1_MULTIPROCESSING=0 "
                            "(the connector's scheduler and worker sides share one store); serving nothing")
            return False
        return True

    def on_new_request(self, request) -> None:
        self._reqs[request.request_id] = request

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        rid = request.request_id
        self._reqs[rid] = request
        self._drop_lookup(rid)
        ns_key = self._ns_key(request)
        if ns_key is None or not self._usable():
            return 0, False
        s = self._live()
        bs = s.bs
        tokens = np.asarray(request.all_token_ids, dtype=np.int32)
        max_blocks = (len(tokens) - 1) // bs        # vLLM must compute at least one token
        first = num_computed_tokens // bs
        if max_blocks <= first:
            return 0, False
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
        meta = PagedKVMetadata(loads=self._loads)
        self._loads = []
        if not self._usable() or self._kv_cache_manager is None:
            return meta
        so = scheduler_output
        rids = [r.req_id for r in so.scheduled_new_reqs] + list(so.scheduled_cached_reqs.req_ids)
        for rid in rids:
            req = self._reqs.get(rid)
            if req is None:
                continue
            ns_key = self._ns_key(req)
            if ns_key is None:
                continue
            end = req.num_computed_tokens + so.num_scheduled_tokens.get(rid, 0)
            self._plan_saves(rid, req, ns_key, min(end, req.num_tokens), meta.saves)
        return meta

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

    def request_finished(self, request, block_ids):
        rid = request.request_id
        self._drop_lookup(rid)
        self._reqs.pop(rid, None)
        self._chains.pop(rid, None)
        return False, None

    def reset_cache(self) -> bool:
        if self.store is not None:
            self.store.clear(disk=True)
        return True

    # ---- worker side -------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        if self.store is None:
            return
        missing = [n for n in self._layer_names if n not in kv_caches]
        if missing:
            self.store.refuse(f"vLLM registered no KV tensor for layer {missing[0]!r}")
            return
        self.store.register([kv_caches[n] for n in self._layer_names])

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, PagedKVMetadata) or not meta.loads or self.store is None:
            return
        try:
            self.store.load(meta.loads)
            self.num_loaded_tokens += len(meta.loads) * self.store.bs
        except Exception as e:      # vLLM recomputes blocks reported as failed; never serve them
            log.warning("pagedkv connector: load failed (%s: %s); %d blocks recomputed",
                        type(e).__name__, e, len(meta.loads))
            self._load_errors.update(b for _, b in meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return

    def wait_for_save(self):
        meta = self._get_connector_metadata()
        if not isinstance(meta, PagedKVMetadata) or not meta.saves or self.store is None:
            return
        try:
            self.store.save(meta.saves)
            self.num_saved_blocks += len(meta.saves)
        except Exception as e:      # a lost save is a later miss
            log.warning("pagedkv connector: save failed (%s: %s)", type(e).__name__, e)
            self.store.abandon([slot for _, slot in meta.saves])

    def get_block_ids_with_load_errors(self) -> set:
        out, self._load_errors = self._load_errors, set()
        return out
