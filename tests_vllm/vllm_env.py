"""Shared by the vLLM tests, their subprocess runner and the benchmark: environment,
model folder, prompts and engine construction. Import this before vllm."""
from __future__ import annotations

import os
from pathlib import Path

# Offline, a small CPU KV space, OMP bound to core 0 (with a connector vLLM reserves a
# second core; on 2 cores binding avoids a 3-4x slowdown), and callables allowed through
# collective_rpc (the negative control flips a switch on the worker side). vLLM's
# multiprocessing is left at its default; the test process's own engine turns it off
# (conftest) so a test can reach the connector's store.
for k, v in {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0",
             "VLLM_ALLOW_INSECURE_SERIALIZATION": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(k, v)

MODEL_DIR = Path(os.environ.get("PAGEDKV_VLLM_MODEL", str(Path.home() / ".cache/pagedkv/smollm2-hf"))).expanduser()
BLOCK = 128
CONNECTOR = {"kv_connector": "PagedKVConnector", "kv_connector_module_path": "pagedkv.integrations.vllm",
             "kv_role": "kv_both"}


def text_tokens(n: int, offset: int = 0) -> list:
    """``n`` token ids of pydoc's topics text (deterministic), starting ``offset`` tokens in."""
    from pydoc_data.topics import topics
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    text = "\n\n".join(topics[k] for k in sorted(topics))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return [int(i) for i in ids[offset:offset + n]]


def prompt_set(name: str, n_prompts: int = 3, prefix_blocks: int = 4, suffix: int = 24) -> list:
    """Prompts sharing a ``prefix_blocks``-block prefix, each with its own suffix."""
    base = {"A": 0, "B": 20_000, "C": 40_000, "D": 60_000}[name]
    plen = prefix_blocks * BLOCK
    ids = text_tokens(plen + n_prompts * suffix, base)
    return [ids[:plen] + ids[plen + i * suffix: plen + (i + 1) * suffix] for i in range(n_prompts)]


def make_llm(extra: dict | None = None, connector: bool = True, block_size: int = BLOCK, model=None, **kw):
    from vllm import LLM

    ktc = None
    if connector:
        ktc = dict(CONNECTOR, kv_connector_extra_config=extra or {})
    return LLM(model=str(model or MODEL_DIR), dtype="bfloat16", max_model_len=2048, enforce_eager=True,
               enable_prefix_caching=True, block_size=block_size, kv_transfer_config=ktc, seed=0, **kw)


def generate(llm, prompts, max_tokens: int = 12, logprobs: bool = False):
    """``[(token_ids, num_cached_tokens, first_logprobs)]``, greedy."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1 if logprobs else None)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    res = []
    for o in outs:
        c = o.outputs[0]
        lp = [float(d[t].logprob) for d, t in zip(c.logprobs, c.token_ids)] if logprobs else None
        res.append((list(c.token_ids), int(o.num_cached_tokens or 0), lp))
    return res


def set_shuffle(llm, on: bool) -> None:
    """The negative control's switch, on the worker side wherever it runs."""
    from pagedkv.integrations.vllm_connector import set_debug_shuffle_loads

    assert sum(llm.collective_rpc(set_debug_shuffle_loads, args=(on,))) >= 1, "no worker side to switch"


def engine_store(llm):
    """The pagedkv store behind ``llm``'s connector (engine core in this process)."""
    from pagedkv.integrations import vllm_store as store

    key = str(llm.llm_engine.vllm_config.kv_transfer_config.engine_id)
    return key, store.lookup_store(key)
