"""Serving with SmolLM2-135M (float32): the demo's continuous batching, and one decode step (JSON).

    OMP_NUM_THREADS=1 python benchmarks/serving.py           # the issue-26 workload
    python benchmarks/serving.py --smoke                      # the tiny random Llama, for CI

Two figures, same process:

- ``serving``: the demo workload (``pagedkv demo``: requests sharing the ~412-token system
  prompt, arriving two engine steps apart, greedy answers of up to ``--max-new-tokens``),
  served by :func:`pagedkv.cli.demo.serve` with fp32/int8/int4 KV, each through pagedkv's
  registered attention (``paged``) and through the gather path (``gather``), and by plain
  ``model.generate`` (one request at a time, ``DynamicCache``, the same budgets):
  generated tokens per second of wall time and of thread CPU time (with one thread, the
  latter stays meaningful on a loaded machine), and how many answers equal ``generate``'s;
- ``decode_step``: one batched decode forward at batch ``--step-batch`` with
  ``--step-context`` tokens of context per row (random K/V written straight into the
  caches, so no prefill is timed), through ``PagedCache(paged_attention=True)`` for
  fp32/int8/int4 KV, through the gather path, and through transformers' ``DynamicCache``
  and ``StaticCache`` (a preallocated cache that does not copy) + SDPA, side by side in
  one process: the median seconds per step over ``--step-reps`` steps of wall time, of
  the calling thread's CPU time (``_cpu_s``) and of the process's CPU time, every thread
  (``_proc_cpu_s``; a second thread's work counts here), and each paged figure over
  ``StaticCache``'s (``_over_static_cpu``: thread CPU time; ``_over_static_proc_cpu``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch


def _model(name: str):
    if name == "tiny":
        from pagedkv.testing.models import tiny_llama

        return tiny_llama(seed=0)
    from pagedkv.testing.models import load_smollm2

    return load_smollm2()


def _kv(model, kv_dtype, num_blocks: int):
    from pagedkv.config.options import CacheConfig
    from pagedkv.manager.cache import PagedKVCache

    cfg = CacheConfig.from_hf_config(model.config, num_blocks=num_blocks, block_size=16, dtype=torch.float32,
                                     kv_dtype=kv_dtype, shuffle_free_blocks=0)
    return PagedKVCache(cfg)


def serving(model, tok, requests: int, max_new_tokens: int, num_blocks: int, max_batch: int) -> list[dict]:
    from transformers import DynamicCache

    from pagedkv.cli import demo

    out = []
    answers = {}
    for kv_dtype in (None, "int8", "int4"):
        for paged in (True, False):
            reqs = demo.make_requests(tok, requests, max_new_tokens, 2)
            kv = _kv(model, kv_dtype, num_blocks)
            c0 = time.thread_time()
            res = demo.serve(model, tok, reqs, kv, max_batch=max_batch, paged=paged)
            cpu = time.thread_time() - c0
            if paged:
                model.set_attn_implementation("sdpa")
            name = f"{kv_dtype or 'fp32'} {'paged' if paged else 'gather'}"
            answers[name] = [r.output_ids for r in reqs]
            out.append(dict(system=name, tokens=res.generated_tokens, wall_s=res.wall_s,
                            tokens_per_s=res.generated_tokens / res.wall_s, cpu_s=cpu,
                            tokens_per_cpu_s=res.generated_tokens / cpu, decode_steps=res.decode_steps,
                            prefill_forwards=res.prefill_forwards, hit_rate=res.hit_rate,
                            peak_kv_bytes=res.peak_bytes))
            kv.close()
    reqs = demo.make_requests(tok, requests, max_new_tokens, 2)
    tokens = 0
    t0, c0 = time.perf_counter(), time.thread_time()
    with torch.no_grad():
        for r in reqs:
            ids = torch.tensor([r.prompt_ids])
            g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=r.max_new_tokens,
                               do_sample=False, past_key_values=DynamicCache(config=model.config),
                               eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
            r.output_ids = g[0, ids.shape[1]:].tolist()
            tokens += len(r.output_ids)
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    ref = [r.output_ids for r in reqs]
    out.append(dict(system="generate", tokens=tokens, wall_s=wall, tokens_per_s=tokens / wall, cpu_s=cpu,
                    tokens_per_cpu_s=tokens / cpu))
    for row in out[:-1]:
        got = answers[row["system"]]
        row["requests_equal_to_generate"] = sum(a == b for a, b in zip(got, ref))
    return out


def _timed(run, reps: int, prepare=None) -> tuple[float, float, float]:
    """Median (wall, thread CPU, process CPU) seconds of ``run(step, prepare(step))`` over
    ``reps`` steps (``prepare``, untimed: e.g. an engine's batch selection)."""
    wall, cpu, proc = [], [], []
    for s in range(reps):
        arg = None if prepare is None else prepare(s)
        t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
        run(s, arg)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
        proc.append(time.process_time() - p0)
    return tuple(sorted(x)[len(x) // 2] for x in (wall, cpu, proc))  # type: ignore[return-value]


def decode_step(model, batch: int, context: int, reps: int) -> dict:
    """Median seconds of one batched decode forward: paged attention, the gather path,
    DynamicCache and StaticCache + SDPA."""
    from transformers import DynamicCache, StaticCache

    cfg = model.config
    layers, heads = cfg.num_hidden_layers, cfg.num_key_value_heads
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    gen = torch.Generator().manual_seed(0)
    keys = [torch.randn(batch, heads, context, dim, generator=gen) for _ in range(layers)]
    values = [torch.randn(batch, heads, context, dim, generator=gen) for _ in range(layers)]
    ids = torch.randint(0, cfg.vocab_size, (batch, 1), generator=gen)
    result = {}
    # DynamicCache + SDPA
    model.set_attn_implementation("sdpa")
    dyn = DynamicCache(config=cfg)
    for i in range(layers):
        dyn.update(keys[i].clone(), values[i].clone(), i)
    with torch.no_grad():
        wall, cpu_s, proc = _timed(lambda s, _: model(ids, position_ids=torch.full((batch, 1), context + s),
                                                     past_key_values=dyn), reps)
    result.update(dynamic_cache_s=wall, dynamic_cache_cpu_s=cpu_s, dynamic_cache_proc_cpu_s=proc)
    del dyn
    # StaticCache + SDPA: K/V preallocated for the whole run, the step's token written in place
    static = StaticCache(config=cfg, max_cache_len=context + reps)
    for i in range(layers):
        static.update(keys[i].clone(), values[i].clone(), i, {"cache_position": torch.arange(context)})
    with torch.no_grad():
        wall, cpu_s, proc = _timed(lambda s, _: model(ids, position_ids=torch.full((batch, 1), context + s),
                                                     cache_position=torch.tensor([context + s]),
                                                     past_key_values=static), reps)
    result.update(static_cache_s=wall, static_cache_cpu_s=cpu_s, static_cache_proc_cpu_s=proc)
    del static
    # PagedCache: the registered attention (reads the pages) for every KV format, and the
    # gather path (PagedCache hands SDPA a gathered copy) for fp32
    for kv_dtype, paged in ((None, True), ("int8", True), ("int4", True), (None, False)):
        label = f"{kv_dtype or 'fp32'}_{'paged' if paged else 'gather'}"
        wall, cpu_s, proc = _paged_step(model, ids, keys, values, batch, context, reps, kv_dtype, paged)
        result[f"{label}_s"] = wall
        result[f"{label}_cpu_s"] = cpu_s
        result[f"{label}_proc_cpu_s"] = proc
        result[f"{label}_over_dynamic_cpu"] = cpu_s / result["dynamic_cache_cpu_s"]
        result[f"{label}_over_static_cpu"] = cpu_s / result["static_cache_cpu_s"]
        result[f"{label}_over_static_proc_cpu"] = proc / result["static_cache_proc_cpu_s"]
    # the names earlier runs reported
    result["paged_s"], result["paged_cpu_s"] = result["fp32_paged_s"], result["fp32_paged_cpu_s"]
    result["paged_over_dynamic"] = result["paged_s"] / result["dynamic_cache_s"]
    result["paged_over_dynamic_cpu"] = result["paged_cpu_s"] / result["dynamic_cache_cpu_s"]
    result.update(batch=batch, context=context, reps=reps)
    return result


def _paged_step(model, ids, keys, values, batch, context, reps, kv_dtype, paged):
    """Median (wall, thread CPU, process CPU) seconds of one decode forward through a PagedCache."""
    from pagedkv.integrations import hf_attention
    from pagedkv.integrations.transformers import PagedCache

    layers, heads, dim = len(keys), keys[0].shape[1], keys[0].shape[3]
    kv = _kv(model, kv_dtype, batch * (-(-(context + reps + 1) // 16)) + 8)
    sids = list(range(batch))
    for sid in sids:
        kv.add_sequence(sid)
    slots = kv.reserve(sids, context)
    for i in range(layers):
        kv.write(i, slots, keys[i].transpose(1, 2).reshape(batch * context, heads, dim),
                 values[i].transpose(1, 2).reshape(batch * context, heads, dim))
    kv.commit(sids, context)
    model.set_attn_implementation(hf_attention.register() if paged else "sdpa")
    cache = PagedCache(kv, paged_attention=paged)
    def step(s, selected):
        mask, pos = selected
        model(ids, attention_mask=mask, position_ids=pos, past_key_values=cache)
    try:
        with torch.no_grad():
            return _timed(step, reps, lambda s: cache.select(sids, 1))
    finally:
        cache.release()
        kv.free(sids)
        kv.close()
        model.set_attn_implementation("sdpa")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="the tiny random Llama, small sizes (CI)")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--max-batch", type=int, default=None, help="requests decoding at once (the demo's default)")
    p.add_argument("--step-batch", type=int, default=8)
    p.add_argument("--step-context", type=int, default=2000)
    p.add_argument("--step-reps", type=int, default=7)
    p.add_argument("--skip-serving", action="store_true")
    a = p.parse_args(argv)
    name = "smollm2"
    if a.smoke:
        name, a.requests, a.max_new_tokens, a.step_context, a.step_reps = "tiny", 3, 4, 64, 2
    if a.max_batch is None:
        from pagedkv.cli import demo

        a.max_batch = demo.MAX_BATCH
    model, tok = _model(name)
    load_before = os.getloadavg()
    res = dict(benchmark="serving", model=name, threads=torch.get_num_threads(), max_batch=a.max_batch)
    res["decode_step"] = decode_step(model, a.step_batch, a.step_context, a.step_reps)
    if not a.skip_serving:
        res["serving"] = serving(model, tok, a.requests, a.max_new_tokens, a.num_blocks, a.max_batch)
    res["load"] = [load_before, os.getloadavg()]
    json.dump(res, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
