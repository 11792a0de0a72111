"""pagedkv's vLLM connector on SmolLM2 (CPU), with vLLM's default multiprocessing
(engine core and worker in processes of their own): time to first token of a
~1,900-token prompt served by vLLM's own prefix cache / the host tier / the disk tier /
recomputed, and by the host tier with layer-wise copies (``transfer="layerwise"``);
throughput with the connector configured and nothing to hit (synchronous copies, and
layer-wise) vs no connector (three engines alive in this run, batches interleaved,
median of the repetitions); bytes at rest per cached token, bf16 vs quantized. Prints
one JSON line.

Run in the vLLM venv (``bash .ci/vllm_venv.sh; . .venv-vllm/bin/activate``). Without
vLLM it prints ``{"skipped": ...}`` and exits 0 (CI runs every benchmark with
``--smoke`` in the main venv)."""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

for k, v in {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0",
             "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(k, v)

try:      # the control engine's connector: vLLM's connector plumbing with no work at all
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata

    class NullConnector(KVConnectorBase_V1):
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            return 0, False

        def update_state_after_alloc(self, request, blocks, num_external_tokens):
            return None

        def build_connector_meta(self, scheduler_output):
            return KVConnectorMetadata()

        def start_load_kv(self, forward_context, **kwargs):
            return None

        def wait_for_layer_load(self, layer_name):
            return None

        def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
            return None

        def wait_for_save(self):
            return None
except ImportError:
    pass

NAME = "vllm_connector"
MODEL_DIR = Path(os.environ.get("PAGEDKV_VLLM_MODEL", str(Path.home() / ".cache/pagedkv/smollm2-hf"))).expanduser()
BLOCK = 128


@functools.lru_cache(maxsize=1)
def _text_ids() -> tuple:
    from pydoc_data.topics import topics
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    return tuple(int(i) for i in tok("\n\n".join(topics[k] for k in sorted(topics)), add_special_tokens=False)["input_ids"])


def tokens(n: int, offset: int = 0) -> list:
    return list(_text_ids()[offset:offset + n])


def make_llm(extra=None, null=False):
    from vllm import LLM

    ktc = None if extra is None else {"kv_connector": "PagedKVConnector", "kv_role": "kv_both",
                                      "kv_connector_module_path": "pagedkv.integrations.vllm",
                                      "kv_connector_extra_config": extra}
    if null:      # this file's NullConnector, imported by name in the engine's processes
        here = str(Path(__file__).resolve().parent)
        os.environ["PYTHONPATH"] = os.pathsep.join([here] + [p for p in [os.environ.get("PYTHONPATH")] if p])
        ktc = {"kv_connector": "NullConnector", "kv_role": "kv_both", "kv_connector_module_path": NAME}
    return LLM(model=str(MODEL_DIR), dtype="bfloat16", max_model_len=2048, enforce_eager=True,
               enable_prefix_caching=True, block_size=BLOCK, kv_transfer_config=ktc, seed=0)


def gen(llm, prompts, max_tokens):
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return time.perf_counter() - t, outs


def batch(rep: int, n_req: int) -> list:
    """``n_req`` distinct 200-token prompts, new for every ``rep`` (and apart from the
    TTFT prompts, which start below 30,000): nothing to hit."""
    out = [tokens(200, 30_000 + 200 * (rep * n_req + i)) for i in range(n_req)]
    if min(map(len, out)) < 200:
        raise SystemExit(f"batch {rep}: the text has too few tokens for {n_req} requests per batch")
    return out


def tok_s(llm, prompts, max_tokens) -> float:
    dt, outs = gen(llm, prompts, max_tokens)
    return sum(len(o.outputs[0].token_ids) for o in outs) / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="one repetition, small throughput run")
    ap.add_argument("--throughput-only", action="store_true", help="only the overhead part (no TTFT, no bytes)")
    ap.add_argument("--null-control", action="store_true",
                    help="a third engine with a connector that does nothing: vLLM's own cost of having one")
    args = ap.parse_args()
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        print(json.dumps({"benchmark": NAME, "skipped": f"vllm not importable ({exc}); see .ci/vllm_venv.sh"}))
        return
    if not MODEL_DIR.exists():
        print(json.dumps({"benchmark": NAME, "skipped": f"{MODEL_DIR} missing; run .ci/vllm_venv.sh"}))
        return
    n_req, max_tok = (4, 16) if args.smoke else (16, 32)
    reps = 1 if args.smoke else 3
    tput_reps = 1 if args.smoke else 7           # 3 * 7 * 16 prompts of 200 tokens from 30k: the text has ~113k

    import torch

    from pagedkv.integrations.vllm_codec import bytes_per_token, make_codec

    tmp = tempfile.mkdtemp(prefix="pagedkv-vllm-bench-")
    # 16 host blocks: the 1,900-token prompt (14 full blocks) fits; two other prompts of
    # that size push it out to the disk tier (written through), where the next load finds it.
    llm = make_llm({"disk_dir": f"{tmp}/tier", "host_blocks": 16, "disk_blocks": 256})
    prompt = tokens(1900, 1000)
    fillers = [tokens(1900, 10_000), tokens(1900, 20_000)]
    gen(llm, [tokens(64, 90_000)], 1)                               # warm-up
    ttft = {"recompute": [], "vllm_prefix_cache": [], "pagedkv_host": [], "pagedkv_disk": []}
    cached: dict = {k: [] for k in ttft}

    def timed(kind):
        dt, o = gen(llm, [prompt], 1)
        ttft[kind].append(dt)
        cached[kind].append(o[0].num_cached_tokens)

    for r in range(0 if args.throughput_only else reps):
        llm.reset_prefix_cache(reset_connector=True)                 # both tiers emptied
        timed("recompute")
        timed("vllm_prefix_cache")
        llm.reset_prefix_cache()
        timed("pagedkv_host")
        for f in fillers:
            gen(llm, [f], 1)
        llm.reset_prefix_cache()
        timed("pagedkv_disk")
    # Layer-wise copies: its own engine (host tier only), the same prompt served from host.
    lw = make_llm({"host_blocks": 16, "transfer": "layerwise"})
    gen(lw, [tokens(64, 90_000)], 1)
    ttft["pagedkv_host_layerwise"], cached["pagedkv_host_layerwise"] = [], []
    for r in range(0 if args.throughput_only else reps):
        lw.reset_prefix_cache(reset_connector=True)
        gen(lw, [prompt], 1)                                         # computed and stored
        lw.reset_prefix_cache()
        dt, o = gen(lw, [prompt], 1)
        ttft["pagedkv_host_layerwise"].append(dt)
        cached["pagedkv_host_layerwise"].append(o[0].num_cached_tokens)
    ttft_ms = {k: round(1000 * statistics.median(v), 1) for k, v in ttft.items() if v}
    # SmolLM2-135M: 30 layers, 3 KV heads, head size 64
    bpt = {s: bytes_per_token(make_codec(s, 3, BLOCK, 64, torch.bfloat16, 1), 30) for s in ("bf16", "int8", "fp8", "int4")}
    meta_path = Path(f"{tmp}/tier/meta.json")
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else None

    # Overhead: the connector configured (host + disk, write-through) with nothing to hit
    # vs an engine without it, both alive, batches interleaved (the machine's load drifts).
    base = make_llm(None)
    gen(base, [tokens(64, 90_000)], 4)                             # warm-up
    tput: dict = {"connector": [], "connector_layerwise": [], "no_connector": []}
    engines = [("connector", llm), ("connector_layerwise", lw), ("no_connector", base)]
    if args.null_control:
        null = make_llm(null=True)
        gen(null, [tokens(64, 90_000)], 4)
        tput["null_connector"] = []
        engines.append(("null_connector", null))
    for r in range(tput_reps):
        for j, (name, engine) in enumerate(engines[r % len(engines):] + engines[:r % len(engines)]):
            k = [n for n, _ in engines].index(name)
            tput[name].append(tok_s(engine, batch(len(engines) * r + k, n_req), max_tok))
    med = {k: statistics.median(v) for k, v in tput.items()}
    ratios = sorted(c / b for c, b in zip(tput["connector"], tput["no_connector"]))
    ratios_lw = sorted(c / b for c, b in zip(tput["connector_layerwise"], tput["no_connector"]))
    extra_out = {}
    if args.null_control:
        extra_out["null_connector_overhead_pct_median"] = round(
            100 * (med["no_connector"] - med["null_connector"]) / med["no_connector"], 1)
    print(json.dumps({
        "benchmark": NAME, "smoke": args.smoke, "model": "SmolLM2-135M bf16", "vllm_multiprocessing": True,
        "prompt_tokens": len(prompt), "block_size": BLOCK, "reps": reps, "ttft_ms": ttft_ms,
        "cached_tokens": {k: statistics.median(v) for k, v in cached.items() if v},
        "speedup_vs_recompute": {k: round(ttft_ms["recompute"] / v, 2) for k, v in ttft_ms.items()
                                 if "recompute" in ttft_ms},
        "throughput_only": args.throughput_only,
        "throughput_requests": n_req, "throughput_max_tokens": max_tok, "throughput_reps": tput_reps,
        "throughput_tok_s_median": {k: round(v, 1) for k, v in med.items()},
        "throughput_tok_s_all": {k: [round(x, 1) for x in v] for k, v in tput.items()},
        "overhead_pct_median": round(100 * (med["no_connector"] - med["connector"]) / med["no_connector"], 1),
        "overhead_pct_median_of_paired": round(100 * (1 - statistics.median(ratios)), 1),
        "overhead_layerwise_pct_median": round(
            100 * (med["no_connector"] - med["connector_layerwise"]) / med["no_connector"], 1),
        "overhead_layerwise_pct_median_of_paired": round(100 * (1 - statistics.median(ratios_lw)), 1),
        **extra_out,
        "bytes_per_token": {k: round(v, 1) for k, v in bpt.items()},
        "disk_record_bytes_per_token_bf16": None if meta is None else meta["record_bytes"] / BLOCK,
    }))


if __name__ == "__main__":
    main()
