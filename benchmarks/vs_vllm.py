"""pagedkv's bookkeeping against vLLM's own, side by side in one process (issue 10).

The same workloads as ``benchmarks/core.py`` run through pagedkv and through vLLM's real
KV-cache bookkeeping classes, on a 65,536-block pool of 16-token blocks:

- W1: ``vllm.v1.core.block_pool.BlockPool.get_new_blocks(32)`` then ``free_blocks``,
  the blocks freed in allocation order and tail first (``reversed(blocks)``, as vLLM's
  managers free a request), with vLLM's prefix caching off (its cheapest path) and on
  (its default); pagedkv: ``BlockPool.allocate(32)`` + ``free`` (``ids[::-1]``).
- W2: decode churn, 256 live sequences, one token per step each, finished requests
  replaced by new ones with 64-2,048-token prompts; prefix caching off and on. Both
  sides get the same trace (``core.w2_workload``: prompts, output lengths, which slots
  finish at which step, the decode tokens).
- W3: per-request admission of 1,280-token prompts sharing a 1,024-token system prompt,
  prefix caching on, each request freed after admission (``core.w3_prompts``).

vLLM is driven as its ``Scheduler`` (``vllm/v1/core/sched/scheduler.py``) drives it:

- a ``KVCacheManager`` built with the scheduler's arguments (one ``FullAttentionSpec``
  group, ``hash_block_size`` = block size, no events, no stats, no watermark, no
  lookahead); the block hasher is the engine core's: ``init_none_hash`` and
  ``get_request_block_hasher`` over ``get_hash_fn_by_name("sha256")`` (vLLM's default
  ``prefix_caching_hash_algo``), and ``None`` when prefix caching is off, as in
  ``EngineCore``;
- a new request: ``Request(...)`` (``EngineCore.add_request``; its constructor hashes the
  prompt), ``get_computed_blocks``, ``allocate_slots(request, num_new_tokens,
  num_new_computed_tokens, new_computed_blocks, full_sequence_must_fit=True,
  has_scheduled_reqs=...)`` as in the waiting loop, ``num_computed_tokens`` set and
  advanced as ``schedule``/``_update_after_schedule`` do, then the prefill's sampled
  token appended (``update_from_output``), which hashes a block when it fills;
- every step: ``new_step_starts()``, ``allocate_slots(request, 1,
  num_lookahead_tokens=0)`` per running request (the running loop),
  ``num_computed_tokens``/``num_in_flight_tokens`` advanced, then per request
  ``num_in_flight_tokens`` settled and ``append_output_token_ids(token)``; a finished
  request gets its status and ``KVCacheManager.free``.

Timed on both sides: exactly that bookkeeping, admissions included (amortized over the
token-steps). Not included on either side: sampling, a model, the stop checks (the trace
says who finishes), building the scheduler output (``get_block_ids``), the engine's
queues, detokenization, preemption (the pool never runs out). Admissions happen at the
end of the step whose request finished, as pagedkv's W2 does (vLLM would admit in the
next step's waiting loop: the same calls, one step later). The KV of the token appended
at step t is computed at step t+1 in vLLM, as in a real engine; so that both sides hold
the same tokens, vLLM appends the token pagedkv commits one step later. vLLM's pool
keeps block 0 as its null block: it has 65,535 usable blocks, pagedkv 65,536. Both
sides run with the garbage collector's heap frozen, as vLLM's engine core runs
(``freeze_gc_heap``).

Locating vLLM: ``--vllm-path DIR`` (or ``$PAGEDKV_VLLM_PATH``) is put first on
``sys.path``, else a plain ``import vllm``. Without an importable vLLM the script prints
``{"bench": "vs_vllm", "skipped": ...}`` and exits 0 (CI does not install vLLM).

Usage: ``python benchmarks/vs_vllm.py [--vllm-path DIR] [--smoke] [--repeats N]
[--only W1,W2,W3] [--vllm-hash sha256|sha256_cbor|xxhash|xxhash_cbor]`` (vLLM's
``prefix_caching_hash_algo``; default: vLLM's default, sha256). Prints one JSON line per
figure: ns per op for both, the ratio vLLM / pagedkv and the issue's goal (>= 20x).
"""
from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")   # stdout carries only JSON

import argparse
import gc
import inspect
import statistics
import sys
import time
from types import SimpleNamespace

import numpy as np

import core
from pagedkv._core.pool import BlockPool as PagedPool

GOAL = 20.0
BLOCKS, BLOCK_SIZE = 65536, 16


def load_vllm(path):
    """vLLM's modules, or (None, reason) when they cannot be imported."""
    if path:
        sys.path.insert(0, os.path.abspath(path))
    try:
        import torch
        import vllm
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core import kv_cache_utils
        from vllm.v1.core.block_pool import BlockPool
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.request import Request, RequestStatus
    except Exception as e:   # any failure to import (missing deps, ABI) means: no vLLM here
        return None, f"vLLM not importable: {type(e).__name__}: {e}"
    return SimpleNamespace(
        torch=torch, vllm=vllm, SamplingParams=SamplingParams, get_hash_fn_by_name=get_hash_fn_by_name,
        kv_cache_utils=kv_cache_utils, BlockPool=BlockPool, KVCacheManager=KVCacheManager,
        FullAttentionSpec=FullAttentionSpec, KVCacheConfig=KVCacheConfig, KVCacheGroupSpec=KVCacheGroupSpec,
        Request=Request, RequestStatus=RequestStatus), None


class VLLM:
    """vLLM's bookkeeping classes, and the manager its scheduler would build."""

    def __init__(self, m, hash_name="sha256"):
        self.version = m.vllm.__version__
        self.BlockPool, self.Request, self.RequestStatus = m.BlockPool, m.Request, m.RequestStatus
        self.KVCacheManager, self.SamplingParams = m.KVCacheManager, m.SamplingParams
        spec = m.FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype=m.torch.float16)
        self.config = m.KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[],
                                      kv_cache_groups=[m.KVCacheGroupSpec(["layer.0"], spec)])
        # What EngineCore sets up when prefix caching is on; "sha256" is the default of
        # CacheConfig.prefix_caching_hash_algo.
        self.hash_name = hash_name
        hash_fn = m.get_hash_fn_by_name(hash_name)
        m.kv_cache_utils.init_none_hash(hash_fn)
        self.hasher = m.kv_cache_utils.get_request_block_hasher(BLOCK_SIZE, hash_fn)

    def manager(self, prefix, max_model_len):
        kwargs = dict(
            kv_cache_config=self.config, max_model_len=max_model_len, max_in_flight_tokens=8192,
            enable_caching=prefix, use_eagle=False, num_hash_lookahead_tokens=0,
            num_prefill_lookahead=0, log_stats=False, enable_kv_cache_events=False,
            dcp_world_size=1, pcp_world_size=1, scheduler_block_size=BLOCK_SIZE,
            hash_block_size=BLOCK_SIZE, metrics_collector=None, watermark=0.0)
        # vLLM releases add and drop keyword arguments (0.32 has no
        # num_hash_lookahead_tokens); pass those this one takes, all of them defaults here
        taken = inspect.signature(self.KVCacheManager.__init__).parameters
        return self.KVCacheManager(**{k: v for k, v in kwargs.items() if k in taken})


def timed(fn):
    """Run ``fn`` with the GC heap frozen, as vLLM's engine core does after start-up;
    ``fn`` returns (ns, extra)."""
    gc.collect()
    gc.freeze()
    try:
        return fn()
    finally:
        gc.unfreeze()


def paired(run_pagedkv, run_vllm, repeats):
    """Alternate the two sides (after one warm-up each), so that load on a shared
    machine hits both alike; medians of ns and the last run's extra result."""
    run_pagedkv()
    run_vllm()
    ours, theirs = [], []
    for _ in range(repeats):
        ours.append(timed(run_pagedkv))
        theirs.append(timed(run_vllm))
    return (statistics.median(r[0] for r in ours), ours[-1][1],
            statistics.median(r[0] for r in theirs), theirs[-1][1])


def verdict(vllm_ns, pagedkv_ns):
    ratio = vllm_ns / pagedkv_ns
    return {"ratio_vllm_over_pagedkv": round(ratio, 1), "goal_ratio": GOAL, "pass": ratio >= GOAL}


def load():
    return round(os.getloadavg()[0], 2)


# ---- W1 ---------------------------------------------------------------------------------
def w1(v, args):
    seqs, per_seq = (2000 if args.smoke else 200_000), 32

    def vllm_loop(prefix, tail_first):
        def run():
            pool = v.BlockPool(BLOCKS, enable_caching=prefix, hash_block_size=BLOCK_SIZE)
            get, free = pool.get_new_blocks, pool.free_blocks
            t0 = time.perf_counter_ns()
            if tail_first:
                for _ in range(seqs):
                    free(reversed(get(per_seq)))
            else:
                for _ in range(seqs):
                    free(get(per_seq))
            return time.perf_counter_ns() - t0, pool.get_num_free_blocks()
        return run

    def pagedkv_loop(tail_first):
        def run():
            pool = PagedPool(BLOCKS)
            loop = core.w1_loop(pool, seqs, per_seq, tail_first=tail_first)
            t0 = time.perf_counter_ns()
            loop()
            return time.perf_counter_ns() - t0, pool.num_free_blocks
        return run

    for tail_first in (False, True):
        for prefix in (False, True):
            ns, free_ours, ns_v, free_v = paired(pagedkv_loop(tail_first), vllm_loop(prefix, tail_first),
                                                 args.repeats)
            n = seqs * per_seq
            core.emit(bench="vs_vllm", workload="W1", vllm=v.version,
                      free_order="tail first" if tail_first else "allocation order",
                      vllm_prefix_caching=prefix, blocks=BLOCKS, sequences=seqs, blocks_per_sequence=per_seq,
                      pagedkv_ns_per_block=round(ns / n, 2), vllm_ns_per_block=round(ns_v / n, 2),
                      all_blocks_free_after={"pagedkv": free_ours == BLOCKS, "vllm": free_v == BLOCKS - 1},
                      load_1m=load(), **verdict(ns_v, ns))


def schedule_waiting(mgr, req, running, has_scheduled_reqs):
    """What vLLM's scheduler does for a request it takes from the waiting queue: the
    prefix lookup, the allocation with the waiting loop's arguments, the status, and
    ``num_computed_tokens`` as ``_update_after_schedule`` sets it. Returns the hit tokens."""
    computed, hit, _ = mgr.get_computed_blocks(req)
    num_new = req.num_tokens - hit
    if mgr.allocate_slots(req, num_new, num_new_computed_tokens=hit, new_computed_blocks=computed,
                          num_lookahead_tokens=0, num_external_computed_tokens=0,
                          delay_cache_blocks=False, num_encoder_tokens=0, full_sequence_must_fit=True,
                          reserved_blocks=0, has_scheduled_reqs=has_scheduled_reqs) is None:
        raise RuntimeError("vLLM pool exhausted: the workloads are sized never to preempt")
    req.status = running
    req.num_computed_tokens = hit + num_new
    return hit


# ---- W2 ---------------------------------------------------------------------------------
def w2_run_vllm(v, prefix, workload, live):
    """One W2 run through vLLM's KVCacheManager; (ns, end state)."""
    requests, finishing, tokens = workload
    steps = len(finishing)
    # Inputs an engine receives as Python lists, built before timing (ints shared, so the
    # lists cost 8 bytes per token): prompt token ids, and per step the sampled tokens.
    as_int = np.array(range(32000), dtype=object)
    prompts = [as_int[p].tolist() for p, _ in requests]
    # vLLM appends at step t the token whose KV it computes at step t+1 (pagedkv commits
    # it at t+1): row t+1 of pagedkv's tokens; the last row is never computed.
    sampled = as_int[np.concatenate([tokens[1:], tokens[-1:]])].tolist()
    max_model_len = max(len(p) + out for p, out in requests) + 1
    mgr = v.manager(prefix, max_model_len)
    hasher = v.hasher if prefix else None
    Request, sp = v.Request, v.SamplingParams(max_tokens=max_model_len)
    RUNNING, FINISHED = v.RequestStatus.RUNNING, v.RequestStatus.FINISHED_LENGTH_CAPPED
    running = [None] * live
    counts = {"admitted": 0, "finished": 0, "hit_tokens": 0}

    def admit(slot, first_token):
        r = counts["admitted"]
        counts["admitted"] = r + 1
        req = Request(str(r), prompts[r], sp, None, block_hasher=hasher)
        counts["hit_tokens"] += schedule_waiting(mgr, req, RUNNING, has_scheduled_reqs=True)
        req.append_output_token_ids(first_token)   # update_from_output of the prefill step
        running[slot] = req

    first = as_int[tokens[0]].tolist()   # the prompts' sampled tokens, computed at step 0
    for slot in range(live):
        admit(slot, first[slot])

    def run():
        allocate, free = mgr.allocate_slots, mgr.free
        t0 = time.perf_counter_ns()
        for step in range(steps):
            mgr.new_step_starts()
            for req in running:                    # schedule(): the running loop
                if allocate(req, 1, num_lookahead_tokens=0) is None:
                    raise RuntimeError("vLLM pool exhausted: W2 is sized never to preempt")
                req.num_computed_tokens += 1       # _update_after_schedule
                req.num_in_flight_tokens += 1
            row = sampled[step]
            for slot, req in enumerate(running):   # update_from_output
                req.num_in_flight_tokens -= 1
                req.append_output_token_ids(row[slot])
            done = finishing[step]
            if done.size:
                for slot in done.tolist():
                    req = running[slot]
                    req.status = FINISHED
                    free(req)
                    counts["finished"] += 1
                    admit(slot, row[slot])
        return time.perf_counter_ns() - t0

    ns = timed(run)
    end = {"admitted": counts["admitted"], "finished": counts["finished"],
           "slot_tokens": sum(r.num_computed_tokens for r in running),
           "blocks_in_use": BLOCKS - 1 - mgr.block_pool.get_num_free_blocks(),
           "hit_tokens": counts["hit_tokens"]}
    tokens_held = [list(r.all_token_ids) for r in running]
    for req in running:
        req.status = FINISHED
        mgr.free(req)
    return ns, end, tokens_held


def w2_run_ours(prefix, workload, live):
    """One W2 run through pagedkv (``advance``); (ns, end state, committed tokens per slot).
    Slot tokens are reserved tokens: ``advance`` commits the previous step's token and
    reserves the next, where vLLM counts the scheduled token as computed."""
    requests, finishing, _ = workload
    steps = len(finishing)
    ns_per, st, cache, ids = timed(lambda: core.w2_run_pagedkv(prefix, live, steps, workload=workload,
                                                               keep=True))
    finished = sum(int(f.size) for f in finishing)
    end = {"admitted": live + finished, "finished": finished,
           "slot_tokens": int(cache.seq_lens(ids).sum()), "blocks_in_use": st.allocated_blocks,
           "hit_tokens": st.hit_tokens}
    committed = [cache.token_ids(int(i)).tolist() for i in ids]
    cache.free(ids)
    return ns_per * steps * live, end, committed


def same_tokens(committed, held):
    """Whether every live sequence holds the same tokens on both sides: pagedkv's
    committed tokens are a prefix of vLLM's (which also holds the computed token not
    yet committed by pagedkv and the sampled one not yet computed)."""
    return len(committed) == len(held) and all(h[:len(c)] == c for c, h in zip(committed, held))


def w2(v, args):
    live = 256
    steps = 200 if args.smoke else 20_000
    workload = core.w2_workload(live, steps, seed=0)
    for prefix in (False, True):
        ours, theirs = [], []
        for _ in range(args.repeats):   # one W2 run is long: no separate warm-up
            ours.append(w2_run_ours(prefix, workload, live))
            theirs.append(w2_run_vllm(v, prefix, workload, live))
        ns = statistics.median(r[0] for r in ours)
        ns_v = statistics.median(r[0] for r in theirs)
        end_ours, end_v = ours[-1][1], theirs[-1][1]
        per = steps * live
        same = (all(end_ours[k] == end_v[k] for k in ("admitted", "finished", "slot_tokens"))
                and same_tokens(ours[-1][2], theirs[-1][2]))
        core.emit(bench="vs_vllm", workload="W2", vllm=v.version, prefix_caching=prefix,
                  vllm_hash=v.hash_name if prefix else None, blocks=BLOCKS,
                  live_sequences=live, steps=steps, repeats=args.repeats,
                  pagedkv_ns_per_token_step=round(ns / per, 1), vllm_ns_per_token_step=round(ns_v / per, 1),
                  pagedkv_s=round(ns / 1e9, 3), vllm_s=round(ns_v / 1e9, 3),
                  pagedkv_end=end_ours, vllm_end=end_v, same_trace=same, load_1m=load(), **verdict(ns_v, ns))


# ---- W3 ---------------------------------------------------------------------------------
def w3(v, args):
    requests = 50 if args.smoke else 1000
    prompts = core.w3_prompts(requests)
    as_int = np.array(range(32000), dtype=object)
    lists = [as_int[p].tolist() for p in prompts]

    def run_pagedkv():
        ns, st = core.w3_run_pagedkv(prompts, num_blocks=BLOCKS)
        return ns, {"hit_tokens": st.hit_tokens, "blocks_in_use": st.allocated_blocks}

    def run_vllm():
        mgr = v.manager(True, max(len(p) for p in lists) + 1)
        Request, sp, hasher = v.Request, v.SamplingParams(max_tokens=1), v.hasher
        RUNNING, FINISHED = v.RequestStatus.RUNNING, v.RequestStatus.FINISHED_LENGTH_CAPPED
        hits = 0
        t0 = time.perf_counter_ns()
        for i, p in enumerate(lists):
            req = Request(str(i), p, sp, None, block_hasher=hasher)
            hits += schedule_waiting(mgr, req, RUNNING, has_scheduled_reqs=False)
            req.status = FINISHED
            mgr.free(req)
        ns = time.perf_counter_ns() - t0
        return ns, {"hit_tokens": hits, "blocks_in_use": BLOCKS - 1 - mgr.block_pool.get_num_free_blocks()}

    ns, end_ours, ns_v, end_v = paired(run_pagedkv, run_vllm, args.repeats)
    tokens = sum(len(p) for p in prompts)
    core.emit(bench="vs_vllm", workload="W3", vllm=v.version, prefix_caching=True, vllm_hash=v.hash_name,
              blocks=BLOCKS,
              requests=requests, prompt_tokens=1280, shared_prefix=1024,
              pagedkv_us_per_request=round(ns / requests / 1e3, 2),
              vllm_us_per_request=round(ns_v / requests / 1e3, 2),
              pagedkv_hit_rate=round(end_ours["hit_tokens"] / tokens, 4),
              vllm_hit_rate=round(end_v["hit_tokens"] / tokens, 4),
              load_1m=load(), **verdict(ns_v, ns))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vllm-path", default=os.environ.get("PAGEDKV_VLLM_PATH"),
                    help="directory holding the vllm package (put first on sys.path)")
    ap.add_argument("--vllm-hash", default="sha256", choices=["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"],
                    help="vLLM's prefix_caching_hash_algo (default: vLLM's default, sha256)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CI)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", default="W1,W2,W3")
    args = ap.parse_args(argv)
    if args.smoke:
        args.repeats = 1
    modules, reason = load_vllm(args.vllm_path)
    if modules is None:
        core.emit(bench="vs_vllm", skipped=reason)
        return
    v = VLLM(modules, args.vllm_hash)
    todo = {"W1": w1, "W2": w2, "W3": w3}
    for name in args.only.split(","):
        todo[name](v, args)


if __name__ == "__main__":
    main()
