"""Per-call cost of the vLLM connector's scheduler side on the no-hit path, without an
engine: the store and connector methods vLLM calls for every new request and every
step, driven with fake ``Request``/``SchedulerOutput`` objects shaped like vLLM's, on
the throughput benchmark's settings (SmolLM2-135M shapes, 128-token blocks, 16 host
blocks, a 256-block disk tier, write-through). Each request is new (a miss), prefills
one full block, and finishes; the worker's copy is done in-process (a mover on fake KV
tensors) and is timed apart. Prints one JSON line (ns per call, median of rounds).

Needs vLLM for the connector (run in the vLLM venv); without it only the store's calls
are timed."""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from types import SimpleNamespace

import numpy as np
import torch

from pagedkv.integrations.vllm_config import ConnectorConfig
from pagedkv.integrations.vllm_store import KVSpec, PrefixStore
from pagedkv.integrations.vllm_worker import BlockMover

NAME = "vllm_connector_calls"
L, H, D, BS = 30, 3, 64, 128
NS = b"model\x00\x00"


def make_store(tmp: str, disk_filled: int) -> PrefixStore:
    cfg = ConnectorConfig.from_extra({"host_blocks": 16, "disk_dir": f"{tmp}/tier", "disk_blocks": 256})
    store = PrefixStore(cfg, KVSpec(L, H, BS, D, torch.bfloat16), "model")
    store.kv = [torch.zeros(64, H, BS, 2 * D, dtype=torch.bfloat16) for _ in range(L)]
    store.mover = BlockMover()
    store.mover.register(store.spec, store.kv, "CPU_ATTN")
    store.worker_ready = True
    rng = np.random.default_rng(1)
    for _ in range(disk_filled):          # a disk tier that already holds other prompts' blocks
        run_request(store, rng.integers(0, 50_000, 200).astype(np.int32), {})
    return store


def run_request(store: PrefixStore, tokens: np.ndarray, t: dict) -> None:
    def timed(key, fn, *a):
        t0 = time.perf_counter_ns()
        out = fn(*a)
        t.setdefault(key, []).append(time.perf_counter_ns() - t0)
        return out

    chain = timed("lookup_miss", store.lookup, tokens, NS, (len(tokens) - 1) // BS)
    if chain:
        raise SystemExit("expected a miss")
    slot, created = timed("admit", store.admit, -1, tokens[:BS], NS)
    got, _, _ = store.mover.arena(store.arena.name)
    timed("worker_save", store.mover.save, got[0], got[1], [(1, slot)])
    timed("commit_write_through", store.committed, [slot])


def connector_steps(store: PrefixStore, rounds: int) -> dict:
    """build_connector_meta on decode steps (nothing to load or save) and the worker's
    per-step calls with empty metadata."""
    from pagedkv.integrations import vllm_store
    from pagedkv.integrations.vllm_connector import PagedKVConnector, PagedKVMetadata

    vllm_store._stores["bench"] = store
    c = PagedKVConnector.__new__(PagedKVConnector)
    c._why, c._key, c._tag = None, "bench", "model"
    c._lookups, c._loads, c._reqs, c._chains = {}, [], {}, {}
    c.mover, c._report, c._load_errors = None, {}, set()
    n_req = 16
    reqs = {f"r{i}": SimpleNamespace(request_id=f"r{i}", num_computed_tokens=200 + 5, num_tokens=206,
                                     all_token_ids=list(range(206)), mm_features=None, prompt_embeds=None,
                                     lora_request=None, cache_salt=None) for i in range(n_req)}
    c._reqs = dict(reqs)
    c._chains = {rid: [(0, 0)] for rid in reqs}          # each request's one full block already stored
    store.host.index.rec["valid"][0], store.host.index.rec["gen"][0] = 1, 0
    c._kv_cache_manager = SimpleNamespace(get_block_ids=lambda rid: ([1, 2],))
    so = SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(req_ids=list(reqs)),
                         num_scheduled_tokens={rid: 1 for rid in reqs})
    meta_empty = PagedKVMetadata()
    c._connector_metadata = meta_empty
    out: dict = {}
    for key, fn in (("build_connector_meta_decode_16req", lambda: c.build_connector_meta(so)),
                    ("worker_start_load_kv_empty", lambda: c.start_load_kv(None)),
                    ("worker_wait_for_save_empty", c.wait_for_save),
                    ("worker_build_worker_meta_empty", c.build_connector_worker_meta)):
        ts = []
        for _ in range(rounds):
            t0 = time.perf_counter_ns()
            fn()
            ts.append(time.perf_counter_ns() - t0)
        out[key] = statistics.median(ts)
    vllm_store._stores.pop("bench", None)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--disk-filled", type=int, default=200, help="requests stored before timing")
    args = ap.parse_args()
    n, filled = (20, 20) if args.smoke else (args.requests, args.disk_filled)
    tmp = tempfile.mkdtemp(prefix="pagedkv-vllm-calls-")
    store = make_store(tmp, filled)
    rng = np.random.default_rng(2)
    t: dict = {}
    for _ in range(n):
        run_request(store, rng.integers(0, 50_000, 200).astype(np.int32), t)
    res = {k: round(statistics.median(v)) for k, v in t.items()}
    res_mean = {k: round(statistics.mean(v)) for k, v in t.items()}
    try:
        steps = connector_steps(store, 20 if args.smoke else 2000)
    except ImportError as exc:
        steps = {"skipped": f"vllm not importable ({exc})"}
    store.close()
    print(json.dumps({"benchmark": NAME, "smoke": args.smoke, "requests": n, "disk_filled_requests": filled,
                      "ns_per_call_median": res, "ns_per_call_mean": res_mean,
                      "per_request_scheduler_ns_mean": sum(v for k, v in res_mean.items() if k != "worker_save"),
                      "ns_per_step": steps}))


if __name__ == "__main__":
    main()
