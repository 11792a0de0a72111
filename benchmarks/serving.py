"""Serving with SmolLM2-135M (float32): the demo's continuous batching, and one decode step (JSON).

    OMP_NUM_THREADS=1 python benchmarks/serving.py           # the issue-33 workloads
    python benchmarks/serving.py --smoke                      # the tiny random Llama, for CI

Two figures, same process:

- ``serving``: 16 chat requests sharing a 412-token prefix (:data:`SYSTEM_PROMPT` in
  SmolLM2's chat template), greedy answers of up to ``--max-new-tokens`` each, in two
  arrival patterns: ``staggered`` (two engine steps apart) and ``burst`` (all at once).
  Each is served by :func:`pagedkv.cli.demo.serve` (a token budget per step, prefixes
  shared between requests admitted together) with fp32/int8/int4 KV through pagedkv's
  registered attention (``paged``), fp32 through the gather path (``gather``), and fp32
  by the loop before issue 33 (``before``: no token budget, every admitted prompt
  prefilled whole with its own copy of the shared prefix). Beside them, in ``baselines``:
  ``model.generate`` with ``DynamicCache`` on all requests as one left-padded batch
  (``generate_batched``) and one request at a time (``generate_each``, whose answers are
  the reference). Per row: generated tokens per second of wall time and of thread CPU
  time (with one thread, CPU time stays meaningful on a loaded machine), the median time
  to first token (CPU and wall seconds after arrival), the prefix hit rate, the prompt
  tokens computed, the peak KV bytes, and how many answers equal the reference;
- ``decode_step``: one batched decode forward at batch ``--step-batch`` with
  ``--step-context`` tokens of context per row (random K/V written straight into the
  caches, so no prefill is timed), through ``PagedCache(paged_attention=True)`` and
  through ``DynamicCache`` + SDPA: the median seconds per step over ``--step-reps`` steps,
  wall and thread CPU time (with one thread, CPU time stays meaningful on a loaded machine).

``load`` gives the 1-minute load average before and after, and the CPUs.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

#: the shared system prompt: 412 tokens of prefix common to every request in SmolLM2's
#: chat template (404 of them this text), the size the issue-33 measurements used
SYSTEM_PROMPT = (
    "You are the on-call assistant of a systems programming team that builds an inference server for "
    "large language models. The server is written in Python and C++, runs on Linux machines with and "
    "without GPUs, and keeps the attention keys and values of every running request in a paged cache: "
    "fixed-size blocks handed out on demand, shared between requests that start with the same tokens, "
    "and evicted in least-recently-used order when memory runs short.\n\n"
    "How to answer:\n"
    "- Answer in one or two short sentences unless the user asks for more detail.\n"
    "- Be concrete and accurate: name the data structure, the system call, the algorithm or the "
    "complexity class the question is about.\n"
    "- Do not repeat the question and do not add a closing summary at the end.\n"
    "- When a question is ambiguous, answer the most likely reading and say which one you chose.\n"
    "- Prefer the vocabulary of the Linux kernel, of CPython and of the CUDA programming guide over "
    "marketing terms.\n"
    "- If you do not know, say so in one sentence and name where the answer can be found.\n"
    "- Never invent command-line flags, configuration keys, function names or version numbers.\n\n"
    "Context you may rely on:\n"
    "- The team measures speed in tokens per second of wall time and per second of CPU time, and "
    "latency as the time to the first token and time between tokens.\n"
    "- Memory is counted in bytes of key/value cache per token: layers times two times key/value heads "
    "times head size times bytes per element.\n"
    "- Requests arrive at any moment, are batched continuously, and leave as soon as they emit their "
    "end-of-turn token or reach their token budget.\n"
    "- Code reviews ask for tests that fail before a fix, typed errors with messages that name the "
    "argument, and benchmarks that compare against a baseline measured in the same process.\n\n"
    "Style: plain text, no markdown headings and no emoji."
)


PATTERNS = {"staggered": 2, "burst": 0}


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


def _median(values: list) -> float:
    values = sorted(values)
    return values[len(values) // 2] if values else float("nan")


def _requests(tok, requests: int, max_new_tokens: int, gap: int, system_prompt):
    from pagedkv.cli import demo

    return demo.make_requests(tok, requests, max_new_tokens, gap, system_prompt=system_prompt, varied_budgets=False)


def _serve_row(model, tok, a, gap: int, kv_dtype, paged: bool, before: bool, system_prompt) -> tuple[dict, list]:
    from pagedkv.cli import demo

    reqs = _requests(tok, a.requests, a.max_new_tokens, gap, system_prompt)
    kv = _kv(model, kv_dtype, a.num_blocks)
    c0 = time.thread_time()
    res = demo.serve(model, tok, reqs, kv, max_batch=a.max_batch, paged=paged,
                     token_budget=None if before else a.token_budget, share_prefixes=not before)
    cpu = time.thread_time() - c0
    if paged:
        model.set_attn_implementation("sdpa")
    kv.close()
    name = f"{kv_dtype or 'fp32'} {'paged' if paged else 'gather'}{' before' if before else ''}"
    row = dict(system=name, tokens=res.generated_tokens, wall_s=res.wall_s, tokens_per_s=res.generated_tokens / res.wall_s,
               cpu_s=cpu, tokens_per_cpu_s=res.generated_tokens / cpu,
               ttft_cpu_median_s=_median([r.ttft_cpu for r in reqs]),
               ttft_median_s=_median([r.first_token_at - r.arrived_at for r in reqs]),
               hit_rate=res.hit_rate, prompt_tokens=sum(len(r.prompt_ids) for r in reqs),
               prefill_tokens=res.prefill_tokens, decode_steps=res.decode_steps,
               prefill_forwards=res.prefill_forwards, peak_kv_bytes=res.peak_bytes)
    return row, [r.output_ids for r in reqs]


def _answer(ids: list, eos: int) -> list:
    return ids[:ids.index(eos) + 1] if eos in ids else ids


def _generate_each(model, tok, reqs) -> tuple[dict, list]:
    """``model.generate`` one request at a time (the reference answers)."""
    from transformers import DynamicCache

    out, tokens = [], 0
    t0, c0 = time.perf_counter(), time.thread_time()
    with torch.no_grad():
        for r in reqs:
            ids = torch.tensor([r.prompt_ids])
            g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=r.max_new_tokens,
                               do_sample=False, past_key_values=DynamicCache(config=model.config),
                               eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
            out.append(_answer(g[0, ids.shape[1]:].tolist(), tok.eos_token_id))
            tokens += len(out[-1])
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    return dict(system="generate_each", tokens=tokens, wall_s=wall, tokens_per_s=tokens / wall, cpu_s=cpu,
                tokens_per_cpu_s=tokens / cpu), out


class _FirstCall:
    """A logits processor that notes when generate's first logits (the prefill's) arrive."""

    def __init__(self):
        self.at = self.cpu = None

    def __call__(self, input_ids, scores):
        if self.at is None:
            self.at, self.cpu = time.perf_counter(), time.thread_time()
        return scores


def _generate_batched(model, tok, reqs) -> tuple[dict, list]:
    """``model.generate`` on every request at once, left-padded (all arrive together)."""
    from transformers import DynamicCache, LogitsProcessorList

    width = max(len(r.prompt_ids) for r in reqs)
    ids = torch.full((len(reqs), width), tok.eos_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(reqs):
        ids[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
        mask[i, width - len(r.prompt_ids):] = 1
    first = _FirstCall()
    t0, c0 = time.perf_counter(), time.thread_time()
    with torch.no_grad():
        g = model.generate(ids, attention_mask=mask, max_new_tokens=max(r.max_new_tokens for r in reqs),
                           do_sample=False, past_key_values=DynamicCache(config=model.config),
                           eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id,
                           logits_processor=LogitsProcessorList([first]))
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    out = [_answer(g[i, width:].tolist()[:r.max_new_tokens], tok.eos_token_id) for i, r in enumerate(reqs)]
    tokens = sum(len(o) for o in out)
    return dict(system="generate_batched", tokens=tokens, wall_s=wall, tokens_per_s=tokens / wall, cpu_s=cpu,
                tokens_per_cpu_s=tokens / cpu, ttft_cpu_median_s=first.cpu - c0, ttft_median_s=first.at - t0), out


def serving(model, tok, a, system_prompt) -> dict:
    """Every arrival pattern's rows, and the generate baselines (see the module docstring)."""
    reqs = _requests(tok, a.requests, a.max_new_tokens, 0, system_prompt)
    each, ref = _generate_each(model, tok, reqs)
    batched, got = _generate_batched(model, tok, reqs)
    batched["requests_equal_to_generate"] = sum(x == y for x, y in zip(got, ref))
    out: dict = {"baselines": [batched, each]}
    for pattern in a.patterns:
        rows = []
        runs = [(kv_dtype, True, False) for kv_dtype in a.kv] + [(None, False, False), (None, True, True)]
        for kv_dtype, paged, before in runs:
            row, answers = _serve_row(model, tok, a, PATTERNS[pattern], kv_dtype, paged, before, system_prompt)
            row["requests_equal_to_generate"] = sum(x == y for x, y in zip(answers, ref))
            row["over_batched_generate_cpu"] = row["tokens_per_cpu_s"] / batched["tokens_per_cpu_s"]
            rows.append(row)
        out[pattern] = rows
    return out


def decode_step(model, batch: int, context: int, reps: int) -> dict:
    """Median seconds of one batched decode forward, paged attention vs DynamicCache + SDPA."""
    from transformers import DynamicCache

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
    times, cpu = [], []
    with torch.no_grad():
        for s in range(reps):
            pos = torch.full((batch, 1), context + s)
            t0, c0 = time.perf_counter(), time.thread_time()
            model(ids, position_ids=pos, past_key_values=dyn)
            times.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
    result["dynamic_cache_s"] = sorted(times)[len(times) // 2]
    result["dynamic_cache_cpu_s"] = sorted(cpu)[len(cpu) // 2]
    del dyn
    # PagedCache: the registered attention (reads the pages) for every KV format, and the
    # gather path (PagedCache hands SDPA a gathered copy) for fp32
    for kv_dtype, paged in ((None, True), ("int8", True), ("int4", True), (None, False)):
        label = f"{kv_dtype or 'fp32'}_{'paged' if paged else 'gather'}"
        wall, cpu_s = _paged_step(model, ids, keys, values, batch, context, reps, kv_dtype, paged)
        result[f"{label}_s"] = wall
        result[f"{label}_cpu_s"] = cpu_s
        result[f"{label}_over_dynamic_cpu"] = cpu_s / result["dynamic_cache_cpu_s"]
    # the names earlier runs reported
    result["paged_s"], result["paged_cpu_s"] = result["fp32_paged_s"], result["fp32_paged_cpu_s"]
    result["paged_over_dynamic"] = result["paged_s"] / result["dynamic_cache_s"]
    result["paged_over_dynamic_cpu"] = result["paged_cpu_s"] / result["dynamic_cache_cpu_s"]
    result.update(batch=batch, context=context, reps=reps)
    return result


def _paged_step(model, ids, keys, values, batch, context, reps, kv_dtype, paged):
    """Median (wall, thread CPU) seconds of one decode forward through a PagedCache."""
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
    times, cpu = [], []
    try:
        with torch.no_grad():
            for _ in range(reps):
                mask, pos = cache.select(sids, 1)
                t0, c0 = time.perf_counter(), time.thread_time()
                model(ids, attention_mask=mask, position_ids=pos, past_key_values=cache)
                times.append(time.perf_counter() - t0)
                cpu.append(time.thread_time() - c0)
    finally:
        cache.release()
        kv.free(sids)
        kv.close()
        model.set_attn_implementation("sdpa")
    return sorted(times)[len(times) // 2], sorted(cpu)[len(cpu) // 2]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="the tiny random Llama, small sizes (CI)")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--max-batch", type=int, default=None, help="requests decoding at once (the demo's default)")
    p.add_argument("--token-budget", type=int, default=None, help="tokens per engine step (the demo's default)")
    p.add_argument("--patterns", default="staggered,burst", help="arrival patterns: staggered, burst")
    p.add_argument("--kv", default="fp32,int8,int4", help="KV formats served through paged attention")
    p.add_argument("--threads", type=int, default=1, help="torch threads (CPU time is per thread: keep 1)")
    p.add_argument("--step-batch", type=int, default=8)
    p.add_argument("--step-context", type=int, default=2000)
    p.add_argument("--step-reps", type=int, default=7)
    p.add_argument("--skip-serving", action="store_true")
    p.add_argument("--skip-decode-step", action="store_true")
    a = p.parse_args(argv)
    from pagedkv.cli import demo

    torch.set_num_threads(a.threads)
    name, system_prompt = "smollm2", SYSTEM_PROMPT
    if a.smoke:   # the tiny model's byte tokenizer would make the long prompt 2,000 tokens
        name, a.requests, a.max_new_tokens, a.step_context, a.step_reps = "tiny", 3, 4, 64, 2
        system_prompt = None
    a.max_batch = demo.MAX_BATCH if a.max_batch is None else a.max_batch
    a.token_budget = demo.TOKEN_BUDGET if a.token_budget is None else a.token_budget
    a.patterns = [x for x in a.patterns.split(",") if x]
    if not set(a.patterns) <= set(PATTERNS):
        p.error(f"--patterns: expected a comma-separated subset of {sorted(PATTERNS)}, got {a.patterns}")
    a.kv = [None if x == "fp32" else x for x in a.kv.split(",") if x]
    model, tok = _model(name)
    load_before = os.getloadavg()
    res = dict(benchmark="serving", model=name, threads=torch.get_num_threads(), max_batch=a.max_batch,
               token_budget=a.token_budget, requests=a.requests, max_new_tokens=a.max_new_tokens)
    if not a.skip_decode_step:
        res["decode_step"] = decode_step(model, a.step_batch, a.step_context, a.step_reps)
    if not a.skip_serving:
        res["serving"] = serving(model, tok, a, system_prompt)
    res["load"] = dict(before=load_before, after=os.getloadavg(), cpus=os.cpu_count())
    json.dump(res, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
