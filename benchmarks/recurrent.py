"""Prefix caching for a hybrid model (Gated DeltaNet + attention) on a multi-turn chat
workload (issue 35): hit rate, prompt tokens computed again and state memory, for
pagedkv's rule against two simulations of what engines do today.

The workload: ``--conversations`` chats share a system prompt; each turn's prompt is
the previous prompt, the model's answer and a new user message (lengths drawn from a
seeded generator); the chats take turns, so a chat's next turn comes after every other
chat's. Each turn is admitted, its uncached prompt tokens prefilled in chunks of at
most ``--chunk`` tokens, and its answer decoded a token at a time.

- ``pagedkv``: a :class:`~pagedkv.PagedKVCache` with the model's recurrent-state
  layers (bookkeeping only: the rule, not the arithmetic). Snapshots are taken every
  ``state_checkpoint_every`` blocks, at prefill chunk ends on a block boundary (the
  engine ends a chunk at the prompt's last block boundary and at
  :meth:`~pagedkv.PagedKVCache.next_checkpoint`) and at shared-prefix junctions; a hit
  is the longest prefix with the KV chain and a snapshot at exactly its end. Block size
  ``--block-size``.
- ``pagedkv_every_block``: the same with ``state_checkpoint_every=1`` (a snapshot at
  every block boundary, decode included: the next turn also skips the previous
  answer, for more snapshot memory).
- ``pagedkv_align_memory``: the default rule in a state pool of the size vLLM's
  ``align`` ends up holding (its snapshots plus one request's two pages): snapshots
  are evicted to make room (superseded ones first: see :mod:`pagedkv.state.snapshots`);
  ``pagedkv_every_block_align_memory``: the same with a snapshot at every block.
- ``vllm_align`` (a simulation of vLLM's ``mamba_cache_mode="align"``): the attention
  block is raised until an attention page holds one state page (the state page as
  pagedkv stores it), a state is cached only where a prefill chunk ends, clipped down
  to that block grid, and where a decode step completes a block; a hit is the longest
  cached state that is a prefix of the prompt (its KV assumed present).
- ``no_state_caching``: a KV-only hit cannot be used, so every prompt token is computed.

Figures per geometry (``tiny``: the 3-layer test model of
:mod:`pagedkv.testing.state_models`; ``qwen3.5-4b``: Qwen3.5-4B's shapes, 24 Gated
DeltaNet + 8 attention layers, for which vLLM's block becomes 544 tokens here and 528
with its own state layout, vllm#40696): hit tokens, hit rate, recomputed tokens,
state bytes one request holds live, snapshot bytes held at the end, and pagedkv's
bookkeeping ns per turn against the same calls without prefix caching (same process).

Usage: ``python benchmarks/recurrent.py [--smoke] [--conversations N] [--turns N]``.
"""
from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # idle BLAS threads spin and skew timings

import argparse
import time

import numpy as np
from core import emit  # benchmarks/core.py: one JSON line

from pagedkv import CacheConfig, PagedKVCache
from pagedkv.testing.state_models import state_config

QWEN35_4B = dict(num_hidden_layers=32, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 8,
                 hidden_size=2560, num_attention_heads=16, num_key_value_heads=4, head_dim=256,
                 linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                 linear_value_head_dim=128, linear_conv_kernel_dim=4)


def hf_config(geometry: str) -> dict:
    d = state_config("qwen3_5").to_dict()
    if geometry == "qwen3.5-4b":
        d.update(QWEN35_4B)
    return d


def workload(conversations: int, turns: int, seed: int = 0) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """``(chat, prompt, answer)`` per turn, in serving order (the chats take turns)."""
    rng = np.random.default_rng(seed)
    system = rng.integers(3, 250, 200)
    history = [system.copy() for _ in range(conversations)]
    out = []
    for _ in range(turns):
        for c in range(conversations):
            prompt = np.concatenate([history[c], rng.integers(3, 250, int(rng.integers(20, 200)))]).astype(np.int32)
            answer = rng.integers(3, 250, int(rng.integers(20, 300))).astype(np.int32)
            out.append((c, prompt, answer))
            history[c] = np.concatenate([prompt, answer])
    return out


def run_pagedkv(cfg: CacheConfig, turns, chunk: int, caching: bool = True) -> dict:
    kv = PagedKVCache(cfg, allocate_store=False)
    bs = cfg.block_size
    hit_tokens = prompt_tokens = 0
    t0 = time.perf_counter_ns()
    for i, (_, prompt, answer) in enumerate(turns):
        sid = i
        hit = kv.add_sequence(sid, prompt)
        p = len(prompt)
        prompt_tokens += p
        hit_tokens += hit
        pos = hit
        last = p // bs * bs
        while pos < p:
            end = min(p, pos + chunk, kv.next_checkpoint(sid))
            if pos < last < end:
                end = last                      # a chunk ends at the prompt's last block boundary
            kv.reserve(sid, end - pos)
            kv.commit(sid, end - pos)
            pos = end
        for tok in answer.tolist():
            kv.reserve(sid, 1)
            kv.commit(sid, 1, [tok])
        kv.free(sid)
        kv.take_state_copies()                  # a bookkeeping-only cache's owed copies
    ns = time.perf_counter_ns() - t0
    st = kv.stats().states
    kv.check_invariants()
    return dict(hit_tokens=hit_tokens, prompt_tokens=prompt_tokens, ns_per_turn=ns / len(turns),
                snapshots_held=st.snapshots, snapshot_bytes_held=st.snapshots * st.slot_bytes,
                live_state_bytes_per_request=st.slot_bytes)


def run_align(turns, block: int, chunk: int, state_bytes: int) -> dict:
    """vLLM's ``align`` rule, simulated (see the module docstring)."""
    saved: set[bytes] = set()
    lengths: set[int] = set()
    hit_tokens = prompt_tokens = 0
    for _, prompt, answer in turns:
        p = len(prompt)
        prompt_tokens += p
        hit = max((n for n in lengths if n <= p - 1 and prompt[:n].tobytes() in saved), default=0)
        hit_tokens += hit
        full = np.concatenate([prompt, answer])
        pos = hit
        while pos < p:                          # prefill chunks: a state where each ends, clipped to the grid
            pos = min(p, pos + chunk)
            n = pos // block * block
            if n:
                saved.add(full[:n].tobytes())
                lengths.add(n)
        for n in range(p + 1, len(full) + 1):   # a decode step that completes a block
            if n % block == 0:
                saved.add(full[:n].tobytes())
                lengths.add(n)
    return dict(hit_tokens=hit_tokens, prompt_tokens=prompt_tokens, attention_block=block,
                snapshots_held=len(saved), snapshot_bytes_held=len(saved) * state_bytes,
                live_state_bytes_per_request=2 * state_bytes)


def figures(geometry: str, conversations: int, turns: int, block_size: int, chunk: int, every: int) -> None:
    hf = hf_config(geometry)
    turns_ = workload(conversations, turns)
    total_tokens = sum(len(p) + len(a) for _, p, a in turns_)
    blocks = total_tokens // block_size + 8 * len(turns_) + 64      # no eviction: the rules alone differ
    common = dict(num_blocks=blocks, block_size=block_size, dtype="bfloat16", state_checkpoint_every=every)
    cfg = CacheConfig.from_hf_config(hf, state_slots=blocks, **common)
    spec = cfg.state_spec
    state_bytes = spec.slot_bytes()
    # vLLM: one attention page (block_size tokens of one layer) at least one state page (one layer's state)
    per_token_layer = cfg.bytes_per_token // max(1, cfg.num_layers)
    need = -(-spec.layer_bytes() // per_token_layer)
    align_block = -(-need // block_size) * block_size
    ours = run_pagedkv(cfg, turns_, chunk)
    dense = run_pagedkv(CacheConfig.from_hf_config(hf, state_slots=blocks,
                                                   **(common | dict(state_checkpoint_every=1))), turns_, chunk)
    base = run_pagedkv(CacheConfig.from_hf_config(hf, state_slots=64, enable_prefix_caching=False, **common),
                       turns_, chunk)
    align = run_align(turns_, align_block, chunk, state_bytes)
    # the state memory align ends up holding (its snapshots and one request's two live pages)
    equal = run_pagedkv(CacheConfig.from_hf_config(hf, state_slots=align["snapshots_held"] + 2, **common),
                        turns_, chunk)
    equal_dense = run_pagedkv(CacheConfig.from_hf_config(hf, state_slots=align["snapshots_held"] + 2,
                                                         **(common | dict(state_checkpoint_every=1))), turns_, chunk)
    none = dict(hit_tokens=0, prompt_tokens=ours["prompt_tokens"], snapshots_held=0, snapshot_bytes_held=0,
                live_state_bytes_per_request=state_bytes)
    for name, r in (("pagedkv", ours), ("pagedkv_every_block", dense), ("pagedkv_align_memory", equal),
                    ("pagedkv_every_block_align_memory", equal_dense),
                    ("vllm_align", align), ("no_state_caching", none)):
        extra = {}
        if name.endswith("_align_memory"):
            extra = dict(state_slots=align["snapshots_held"] + 2)
        if name == "pagedkv_every_block_align_memory":
            extra["state_checkpoint_every"] = 1
        if name == "pagedkv_every_block":
            extra = dict(state_checkpoint_every=1)
        if name == "pagedkv":
            extra = dict(ns_per_turn=round(r["ns_per_turn"]), baseline="the same calls without prefix caching",
                         baseline_ns_per_turn=round(base["ns_per_turn"]), block_size=block_size)
        if name == "vllm_align":
            extra = dict(attention_block=r["attention_block"])
        emit(bench="recurrent_chat", geometry=geometry, policy=name, conversations=conversations, turns=turns,
             prompt_tokens=r["prompt_tokens"], hit_tokens=r["hit_tokens"],
             hit_rate=round(r["hit_tokens"] / r["prompt_tokens"], 4),
             recomputed_tokens=r["prompt_tokens"] - r["hit_tokens"],
             live_state_bytes_per_request=r["live_state_bytes_per_request"],
             snapshots_held=r["snapshots_held"], snapshot_bytes_held=r["snapshot_bytes_held"],
             **(dict(chunk=chunk) | (dict(state_checkpoint_every=every) if name.startswith("pagedkv") else {})
                | extra))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="a few chats and turns (seconds)")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=2048, help="most tokens per prefill chunk")
    ap.add_argument("--checkpoint-every", type=int, default=16, help="blocks between periodic snapshots")
    args = ap.parse_args()
    conv, turns = (3, 3) if args.smoke else (args.conversations, args.turns)
    for geometry in ("tiny", "qwen3.5-4b"):
        figures(geometry, conv, turns, args.block_size, args.chunk, args.checkpoint_every)


if __name__ == "__main__":
    main()
