"""pagedkv's vLLM connector on SmolLM2 (CPU): time to first token of a ~1,900-token
prompt served by vLLM's own prefix cache / the host tier / the disk tier / recomputed;
throughput with the connector and nothing to hit vs no connector; bytes at rest per
cached token, bf16 vs quantized. Prints one JSON line.

Run in the vLLM venv (``bash .ci/vllm_venv.sh; . .venv-vllm/bin/activate``). Without
vLLM it prints ``{"skipped": ...}`` and exits 0 (CI runs every benchmark with
``--smoke`` in the main venv)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

for k, v in {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0",
             "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(k, v)

NAME = "vllm_connector"
MODEL_DIR = Path(os.environ.get("PAGEDKV_VLLM_MODEL", str(Path.home() / ".cache/pagedkv/smollm2-hf"))).expanduser()
BLOCK = 128


def tokens(n: int, offset: int = 0) -> list:
    from pydoc_data.topics import topics
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    ids = tok("\n\n".join(topics[k] for k in sorted(topics)), add_special_tokens=False)["input_ids"]
    return [int(i) for i in ids[offset:offset + n]]


def make_llm(extra=None):
    from vllm import LLM

    ktc = None if extra is None else {"kv_connector": "PagedKVConnector", "kv_role": "kv_both",
                                      "kv_connector_module_path": "pagedkv.integrations.vllm",
                                      "kv_connector_extra_config": extra}
    return LLM(model=str(MODEL_DIR), dtype="bfloat16", max_model_len=2048, enforce_eager=True,
               enable_prefix_caching=True, block_size=BLOCK, kv_transfer_config=ktc, seed=0)


def gen(llm, prompts, max_tokens):
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return time.perf_counter() - t, outs


def batch(rep: int, n_req: int) -> list:
    """``n_req`` distinct 200-token prompts, new for every ``rep``: nothing to hit."""
    return [tokens(200, 5000 + 300 * (rep * n_req + i)) for i in range(n_req)]


def tok_s(llm, prompts, max_tokens) -> float:
    dt, outs = gen(llm, prompts, max_tokens)
    return sum(len(o.outputs[0].token_ids) for o in outs) / dt


def no_connector_throughput(n_req: int, max_tokens: int, reps: int) -> list:
    llm = make_llm(None)
    gen(llm, [tokens(64, 90_000)], 4)                              # warm-up
    return [tok_s(llm, batch(r, n_req), max_tokens) for r in range(reps)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="one repetition, small throughput run")
    ap.add_argument("--throughput-child", choices=["off"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        print(json.dumps({"benchmark": NAME, "skipped": f"vllm not importable ({exc}); see .ci/vllm_venv.sh"}))
        return
    if not MODEL_DIR.exists():
        print(json.dumps({"benchmark": NAME, "skipped": f"{MODEL_DIR} missing; run .ci/vllm_venv.sh"}))
        return
    n_req, max_tok = (4, 16) if args.smoke else (8, 32)
    reps = 1 if args.smoke else 4
    if args.throughput_child:
        print(json.dumps({"tok_s": no_connector_throughput(n_req, max_tok, 2 * reps)}))
        return

    import dataclasses

    from pagedkv.integrations.vllm_codec import bytes_per_token, make_codec
    from pagedkv.integrations.vllm_store import PrefixStore, lookup_store, replace_store

    tmp = tempfile.mkdtemp(prefix="pagedkv-vllm-bench-")
    llm = make_llm({"disk_dir": f"{tmp}/tier", "host_blocks": 64, "disk_blocks": 256})
    key = str(llm.llm_engine.vllm_config.kv_transfer_config.engine_id)
    store = lookup_store(key)
    prompt = tokens(1900, 1000)
    gen(llm, [tokens(64, 90_000)], 1)                               # warm-up
    ttft = {"recompute": [], "vllm_prefix_cache": [], "pagedkv_host": [], "pagedkv_disk": []}
    cached = {}
    for r in range(reps):
        store.clear(disk=True)
        llm.reset_prefix_cache()
        dt, o = gen(llm, [prompt], 1)
        ttft["recompute"].append(dt)
        cached["recompute"] = o[0].num_cached_tokens
        dt, o = gen(llm, [prompt], 1)
        ttft["vllm_prefix_cache"].append(dt)
        cached["vllm_prefix_cache"] = o[0].num_cached_tokens
        llm.reset_prefix_cache()
        dt, o = gen(llm, [prompt], 1)
        ttft["pagedkv_host"].append(dt)
        cached["pagedkv_host"] = o[0].num_cached_tokens
        store.clear(disk=False)
        llm.reset_prefix_cache()
        dt, o = gen(llm, [prompt], 1)
        ttft["pagedkv_disk"].append(dt)
        cached["pagedkv_disk"] = o[0].num_cached_tokens
    ttft_ms = {k: round(1000 * statistics.median(v), 1) for k, v in ttft.items()}
    spec = store.spec
    bpt = {s: bytes_per_token(make_codec(s, spec.kv_heads, spec.block_size, spec.head_size, spec.dtype, 1),
                              spec.num_layers) for s in ("bf16", "int8", "fp8", "int4")}
    meta = json.loads(Path(f"{tmp}/tier/meta.json").read_text())

    # The connector's own work (lookups that miss, saves, write-through) on this engine,
    # interleaved with the same engine whose connector is inert (a refused store).
    inert = PrefixStore(dataclasses.replace(store.cfg, disk_dir=None), store.spec, store.tag)
    tput = {"connector_active": [], "connector_inert": []}
    for r in range(2 * reps):
        active = r % 2 == 0
        if not active:
            replace_store(key, inert)
            inert.refuse("benchmark: inert connector")
        tput["connector_active" if active else "connector_inert"].append(tok_s(llm, batch(10 + r, n_req), max_tok))
        replace_store(key, store)
    del llm
    # No connector at all: another process (vLLM takes other paths), same machine, right after.
    out = subprocess.run([sys.executable, __file__, "--throughput-child", "off"] + (["--smoke"] if args.smoke else []),
                         capture_output=True, text=True, check=True)
    tput["no_connector"] = json.loads(out.stdout.strip().splitlines()[-1])["tok_s"]
    med = {k: statistics.median(v) for k, v in tput.items()}
    best = {k: max(v) for k, v in tput.items()}
    print(json.dumps({
        "benchmark": NAME, "smoke": args.smoke, "model": "SmolLM2-135M bf16", "prompt_tokens": len(prompt),
        "block_size": BLOCK, "reps": reps, "ttft_ms": ttft_ms, "cached_tokens": cached,
        "speedup_vs_recompute": {k: round(ttft_ms["recompute"] / v, 2) for k, v in ttft_ms.items()},
        "throughput_tok_s_median": {k: round(v, 1) for k, v in med.items()},
        "throughput_tok_s_best": {k: round(v, 1) for k, v in best.items()},
        "connector_work_overhead_pct": round(100 * (med["connector_inert"] - med["connector_active"])
                                             / med["connector_inert"], 1),
        "vs_no_connector_overhead_pct_best": round(100 * (best["no_connector"] - best["connector_active"])
                                                   / best["no_connector"], 1),
        "bytes_per_token": {k: round(v, 1) for k, v in bpt.items()},
        "disk_record_bytes_per_token_bf16": meta["record_bytes"] / BLOCK,
    }))


if __name__ == "__main__":
    main()
