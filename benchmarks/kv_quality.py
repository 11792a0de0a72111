"""Quality lost to quantized KV on a real model: SmolLM2-135M perplexity and greedy
agreement with int8 and fp8 KV, against full-precision KV measured in the same run.

Perplexity is the Hugging Face sliding-window recipe on a fixed, download-free text (the
first 4,096 tokens of ``pydoc_data.topics.topics`` in sorted key order; windows of
1,024, stride 512). Each window is fed in chunks of 256 tokens, so three of every four
chunks attend to KV read back from the (quantized) paged arena. Greedy agreement is the
fraction of positions whose argmax token equals the full-precision run's.

Prints one JSON line per KV dtype. ``--smoke`` uses a tiny random-weight model and a
short text (no download), only to prove the script runs.
"""
from __future__ import annotations

import argparse
import json
import math
import time

import torch

from pagedkv import CacheConfig, PagedKVCache
from pagedkv.integrations.transformers import PagedCache


def text_ids(tokenizer, n):
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"][:n]], dtype=torch.long)


@torch.no_grad()
def evaluate(model, ids, kv_dtype, window, stride, chunk):
    """Sliding-window NLL and the argmax tokens, with a paged cache of ``kv_dtype``."""
    cfg = CacheConfig.from_hf_config(model.config, num_blocks=window // 16 + 8, dtype=torch.float32,
                                     kv_dtype=kv_dtype)
    kv = PagedKVCache(cfg)
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
    return math.exp(nll / scored), torch.cat(argmax), cfg.bytes_per_token


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny random model, short text (CI)")
    ap.add_argument("--tokens", type=int, default=4096)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    if args.smoke:
        from pagedkv.testing.models import tiny_llama

        model, _ = tiny_llama(seed=0)
        ids = torch.randint(0, model.config.vocab_size, (1, 192))
        window, stride, chunk, name = 128, 64, 32, "tiny-random-llama"
    else:
        from pagedkv.testing.models import load_smollm2

        model, tokenizer = load_smollm2()
        ids = text_ids(tokenizer, args.tokens)
        window, stride, chunk, name = 1024, 512, 256, "SmolLM2-135M"
    model.eval()
    base_ppl, base_tokens, base_bytes = evaluate(model, ids, None, window, stride, chunk)
    print(json.dumps({"bench": "kv_quality", "model": name, "kv_dtype": "float32", "perplexity": round(base_ppl, 4),
                      "bytes_per_token": base_bytes}), flush=True)
    for kv_dtype in ("int8", "fp8_e4m3", "fp8_e5m2"):
        t0 = time.perf_counter()
        ppl, tokens, nbytes = evaluate(model, ids, kv_dtype, window, stride, chunk)
        rel = (ppl - base_ppl) / base_ppl
        print(json.dumps({
            "bench": "kv_quality", "model": name, "kv_dtype": kv_dtype, "perplexity": round(ppl, 4),
            "perplexity_increase_pct": round(100 * rel, 3), "bar_pct": 2.0, "pass": 100 * rel < 2.0,
            "greedy_agreement": round(float((tokens == base_tokens).float().mean()), 4),
            "bytes_per_token": nbytes, "memory_vs_fp16_pct": round(100 * nbytes / (base_bytes / 2), 1),
            "seconds": round(time.perf_counter() - t0, 1)}), flush=True)


if __name__ == "__main__":
    main()
