"""pagedkv's vLLM connector under tensor parallelism: time to first token of a
~1,900-token prompt at ``tensor_parallel_size=2`` (vLLM for CPU, the "mp" executor, one
worker process per rank, each bound to its own core), recomputed / served by vLLM's own
prefix cache / by the connector's host tier / by its disk tier. The model is a random-
weight Llama saved with ``save_pretrained`` (8 layers, hidden 512, 8 heads, 4 KV heads of
64, so each rank holds 2 KV heads), SmolLM2's tokenizer; its weights are random, so only
timings and hit counts mean anything. Prints one JSON line.

Run in the vLLM venv (``bash .ci/vllm_venv.sh; . .venv-vllm/bin/activate``). Without
vLLM, or with fewer than 2 CPUs, it prints ``{"skipped": ...}`` and exits 0 (CI runs every
benchmark with ``--smoke`` in the main venv)."""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

for k, v in {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1",
             "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(k, v)

NAME = "vllm_connector_tp"
TOKENIZER_DIR = Path(os.environ.get("PAGEDKV_VLLM_MODEL", str(Path.home() / ".cache/pagedkv/smollm2-hf"))).expanduser()
BLOCK = 128
TP = 2


def save_model(out: Path) -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=4096,
                      tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="one repetition")
    args = ap.parse_args()
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        print(json.dumps({"benchmark": NAME, "skipped": f"vllm not importable ({exc}); see .ci/vllm_venv.sh"}))
        return
    if not TOKENIZER_DIR.exists() or (os.cpu_count() or 1) < TP:
        print(json.dumps({"benchmark": NAME, "skipped": f"needs {TOKENIZER_DIR} (.ci/vllm_venv.sh) and {TP} CPUs"}))
        return
    from vllm import LLM, SamplingParams

    reps = 1 if args.smoke else 3
    tmp = Path(tempfile.mkdtemp(prefix="pagedkv-vllm-tp-bench-"))
    model = save_model(tmp / "model")
    ktc = {"kv_connector": "PagedKVConnector", "kv_role": "kv_both", "kv_connector_module_path": "pagedkv.integrations.vllm",
           "kv_connector_extra_config": {"disk_dir": str(tmp / "tier"), "host_blocks": 16, "disk_blocks": 256}}
    t0 = time.perf_counter()
    llm = LLM(model=str(model), dtype="bfloat16", max_model_len=4096, enforce_eager=True, enable_prefix_caching=True,
              block_size=BLOCK, kv_transfer_config=ktc, seed=0, tensor_parallel_size=TP,
              distributed_executor_backend="mp")
    start_s = time.perf_counter() - t0
    def words(n, seed):                   # random ids: the model is random too
        r = random.Random(seed)
        return [r.randrange(1000, 40_000) for _ in range(n)]

    prompt, fillers = words(1900, 0), [words(1900, 1), words(1900, 2)]
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def gen(p):
        t = time.perf_counter()
        o = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)
        return time.perf_counter() - t, int(o[0].num_cached_tokens or 0)

    gen(words(64, 3))                                                  # warm-up
    ttft: dict = {"recompute": [], "vllm_prefix_cache": [], "pagedkv_host": [], "pagedkv_disk": []}
    cached: dict = {k: [] for k in ttft}

    def timed(kind):
        dt, c = gen(prompt)
        ttft[kind].append(dt)
        cached[kind].append(c)

    for _ in range(reps):
        llm.reset_prefix_cache(reset_connector=True)
        timed("recompute")
        timed("vllm_prefix_cache")
        llm.reset_prefix_cache()
        timed("pagedkv_host")
        for f in fillers:                 # 16 host blocks: two more prompts push it to disk
            gen(f)
        llm.reset_prefix_cache()
        timed("pagedkv_disk")
    ms = {k: round(1000 * statistics.median(v), 1) for k, v in ttft.items()}
    print(json.dumps({
        "benchmark": NAME, "smoke": args.smoke, "model": "random Llama 8x512, 4 KV heads, bf16",
        "tensor_parallel_size": TP, "prompt_tokens": len(prompt), "block_size": BLOCK, "reps": reps,
        "engine_start_s": round(start_s, 1), "ttft_ms": ms,
        "cached_tokens": {k: statistics.median(v) for k, v in cached.items()},
        "speedup_vs_recompute": {k: round(ms["recompute"] / v, 2) for k, v in ms.items()},
    }))


if __name__ == "__main__":
    main()
