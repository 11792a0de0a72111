"""Quality lost to quantized KV on a real model: SmolLM2-135M perplexity and greedy
agreement per KV precision, against full-precision (float32) KV measured in the same run.

Protocol (issue 11): SmolLM2-135M in float32, every K/V through a real
``PagedKVCache`` (via the transformers ``PagedCache``); the first 8,192 tokens of
``pydoc_data.topics.topics`` in sorted key order; the Hugging Face sliding-window
perplexity recipe with windows of 1,024 tokens and stride 512. Each window is fed in
chunks of 256 tokens, so three of every four chunks attend to KV read back from the
(quantized) paged arena. Greedy agreement: 5 prompts of 512 tokens (text after the
perplexity slice), 64 greedy tokens each with full-precision KV and with the precision
under test; the fraction of the 320 positions where the tokens agree.

Prints one JSON line per precision: perplexity delta (%), the goal, stored bits and
bytes per element (scales included; the window arena is reported apart, as bytes per
sequence), and greedy agreement. ``--probe`` adds the measurements behind the chosen
int4 scheme (group sizes, no rotation, 3-bit and per-channel keys simulated by
quantize-dequantize before the write). ``--smoke`` uses a tiny random-weight model and
a short text (no download), only to prove the script runs.
"""
from __future__ import annotations

import argparse
import json
import math
import time

import torch

from pagedkv import CacheConfig, PagedKVCache
from pagedkv.integrations.transformers import PagedCache

#: name -> (CacheConfig overrides, goal in % perplexity increase or None)
PRECISIONS = {
    "int8": (dict(kv_dtype="int8"), 0.07),
    "fp8_e4m3": (dict(kv_dtype="fp8_e4m3"), None),
    "fp8_e4m3_rotated": (dict(kv_dtype="fp8_e4m3", kv_rotation=True), 0.3),
    "int4_window128": (dict(kv_dtype="int4", kv_window=128), 0.1),
    "int4_window0": (dict(kv_dtype="int4", kv_window=0), 1.0),
}
PROBES = {
    "int8_rotated": (dict(kv_dtype="int8", kv_rotation=True), None),
    "fp8_e5m2_rotated": (dict(kv_dtype="fp8_e5m2", kv_rotation=True), None),
    "int4_g32_window0": (dict(kv_dtype="int4", kv_window=0, kv_group_size=32), None),
    "int4_g16_window0": (dict(kv_dtype="int4", kv_window=0, kv_group_size=16), None),
    "int4_unrotated_window0": (dict(kv_dtype="int4", kv_window=0, kv_rotation=False), None),
    "int4_unrotated_window128": (dict(kv_dtype="int4", kv_window=128, kv_rotation=False), None),
}


def text_ids(tokenizer, n, start=0):
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"][start:start + n]], dtype=torch.long)


def make_cache(model, overrides, num_blocks, cache_cls=PagedKVCache):
    extra = dict(kv_window_sequences=1, **overrides) if overrides else {}  # one sequence at a time
    return cache_cls(CacheConfig.from_hf_config(model.config, num_blocks=num_blocks, dtype=torch.float32, **extra))


@torch.no_grad()
def evaluate(model, ids, overrides, window, stride, chunk, cache_cls=PagedKVCache):
    """Sliding-window perplexity and the argmax tokens, KV in a paged cache built with
    ``overrides`` (None: float32 KV). Returns (perplexity, argmax tokens, config)."""
    kv = make_cache(model, overrides, window // 16 + 8, cache_cls)
    seq_len = ids.shape[1]
    nll, scored, prev_end = 0.0, 0, 0
    argmax = []
    for begin in range(0, seq_len, stride):
        end = min(begin + window, seq_len)
        trg_len = end - prev_end
        window_ids = ids[:, begin:end]
        with PagedCache(kv) as cache:
            logits = torch.cat([model(window_ids[:, s:s + chunk], past_key_values=cache, use_cache=True).logits.float()
                                for s in range(0, window_ids.shape[1], chunk)], dim=1)
        targets = window_ids[:, 1:].clone()
        skip = max(0, (end - begin) - trg_len - 1)
        targets[:, :skip] = -100
        nll += float(torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                       targets.reshape(-1), ignore_index=-100, reduction="sum"))
        scored += int((targets != -100).sum())
        argmax.append(logits[0, skip:-1].argmax(-1))
        prev_end = end
        if end == seq_len:
            break
    return math.exp(nll / scored), torch.cat(argmax), kv.config


@torch.no_grad()
def greedy(model, prompts, overrides, new_tokens, cache_cls=PagedKVCache):
    """Greedy continuations ``[len(prompts), new_tokens]`` with KV in a paged cache."""
    out = []
    for p in prompts:
        kv = make_cache(model, overrides, (p.shape[1] + new_tokens) // 16 + 4, cache_cls)
        toks = []
        with PagedCache(kv) as cache:
            nxt = model(p, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
            for _ in range(new_tokens):
                toks.append(nxt)
                if len(toks) == new_tokens:
                    break
                nxt = model(nxt, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        out.append(torch.cat(toks, dim=1))
    return torch.cat(out)


def bytes_report(cfg) -> dict:
    per_elem = cfg.bytes_per_token / (2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim)
    per_seq_window = cfg.window_bytes // max(1, cfg.kv_window_sequences) if cfg.kv_window else 0
    return {"bits_per_element": round(8 * per_elem, 3), "bytes_per_element": round(per_elem, 4),
            "bytes_per_token": cfg.bytes_per_token, "window_bytes_per_sequence": per_seq_window}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny random model, short text (CI)")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--only", nargs="*", help="precision names to run (default: all main ones)")
    ap.add_argument("--probe", action="store_true", help="also run the scheme-selection probes")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    if args.smoke:
        from pagedkv.testing.models import tiny_llama

        model, _ = tiny_llama(seed=0)
        ids = torch.randint(0, model.config.vocab_size, (1, 192))
        prompts = [torch.randint(0, model.config.vocab_size, (1, 40)) for _ in range(2)]
        window, stride, chunk, new_tokens, name = 128, 64, 32, 8, "tiny-random-llama"
    else:
        from pagedkv.testing.models import load_smollm2

        model, tokenizer = load_smollm2()
        ids = text_ids(tokenizer, args.tokens)
        prompts = [text_ids(tokenizer, 512, start=args.tokens + 600 * i) for i in range(5)]
        window, stride, chunk, new_tokens, name = 1024, 512, 256, 64, "SmolLM2-135M"
    model.eval()
    runs = dict(PRECISIONS)
    if args.probe:
        runs.update(PROBES)
    if args.only:
        runs = {k: v for k, v in {**PRECISIONS, **PROBES}.items() if k in args.only}
    hd = model.config.hidden_size // model.config.num_attention_heads
    runs = {k: v for k, v in runs.items() if hd % v[0].get("kv_group_size", 1) == 0}
    t0 = time.perf_counter()
    base_ppl, base_tokens, base_cfg = evaluate(model, ids, None, window, stride, chunk)
    base_greedy = greedy(model, prompts, None, new_tokens)
    print(json.dumps({"bench": "kv_quality", "model": name, "precision": "float32", "perplexity": round(base_ppl, 4),
                      **bytes_report(base_cfg), "seconds": round(time.perf_counter() - t0, 1)}), flush=True)
    for label, (overrides, goal) in runs.items():
        t0 = time.perf_counter()
        ppl, tokens, cfg = evaluate(model, ids, overrides, window, stride, chunk)
        gen = greedy(model, prompts, overrides, new_tokens)
        rel = 100 * (ppl - base_ppl) / base_ppl
        print(json.dumps({
            "bench": "kv_quality", "model": name, "precision": label, "perplexity": round(ppl, 4),
            "perplexity_increase_pct": round(rel, 3), "goal_pct": goal,
            "pass": None if goal is None else rel <= goal,
            "greedy_agreement": round(float((gen == base_greedy).float().mean()), 4),
            "argmax_agreement": round(float((tokens == base_tokens).float().mean()), 4),
            **bytes_report(cfg), "seconds": round(time.perf_counter() - t0, 1)}), flush=True)


if __name__ == "__main__":
    main()
