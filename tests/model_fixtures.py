"""Shared fixtures and helpers for the real-model tests (SmolLM2-135M-Instruct).

Import the fixtures into a test module's namespace so pytest sees them (the shared
``conftest.py`` puts ``tests/`` on ``sys.path``)::

    from model_fixtures import smollm2  # noqa: F401

The model comes from :mod:`pagedkv.testing.models`. Without network and cache the tests
skip, naming the command that fetches the model; set ``PAGEDKV_REQUIRE_MODEL=1``
(CI does) to make a missing model an error instead.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

from pagedkv.errors import ModelUnavailableError
from pagedkv.testing.models import load_smollm2, tiny_llama

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about paging memory.",
    "Explain in one sentence why the sky is blue.",
]
SYSTEM_PROMPT = (
    "You are a concise, friendly assistant for a systems programming team. "
    "Answer in at most two sentences, prefer concrete facts, and never invent APIs."
)

PPL_TOKENS = 4096
PPL_WINDOW = 1024
PPL_STRIDE = 512


@pytest.fixture(scope="session")
def smollm2():
    """``(model, tokenizer)``, float32, eval mode, shared by the whole session."""
    try:
        return load_smollm2()
    except ModelUnavailableError as exc:
        if os.environ.get("PAGEDKV_REQUIRE_MODEL") == "1":
            raise
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def tiny():
    """``(model, ByteTokenizer)``: the 2-layer random GQA Llama."""
    return tiny_llama(seed=0)


def chat_ids(tokenizer, user: str, system: str | None = SYSTEM_PROMPT) -> list[int]:
    """Token ids of a one-turn chat, ready for the assistant's answer."""
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": user})
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    # transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True).
    if hasattr(ids, "keys") and "input_ids" in ids:
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def perplexity_ids(tokenizer, n: int = PPL_TOKENS) -> torch.Tensor:
    """The first ``n`` tokens of ``pydoc_data.topics.topics`` joined in sorted key order."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:n]
    if len(ids) < n:
        raise RuntimeError(f"pydoc topics gave only {len(ids)} tokens, expected {n}")
    return torch.tensor([ids], dtype=torch.long)


@torch.no_grad()
def sliding_window_perplexity(model, ids, make_cache=None, window=PPL_WINDOW, stride=PPL_STRIDE,
                              chunk=None, on_window_done=None) -> float:
    """The Hugging Face sliding-window perplexity recipe.

    Each window of ``window`` tokens starts ``stride`` tokens after the last and
    scores only the tokens the previous window did not. ``make_cache()`` gives the
    cache of one window (``None``: no cache). With ``chunk``, the window is fed in
    chunks of that many tokens, so later chunks attend to KV read back from the
    cache; the recipe's figure must not change. ``on_window_done(cache)`` runs
    after each window (to free it).
    """
    seq_len = ids.shape[1]
    nll_sum, n_scored, prev_end = 0.0, 0, 0
    for begin in range(0, seq_len, stride):
        end = min(begin + window, seq_len)
        trg_len = end - prev_end
        input_ids = ids[:, begin:end]
        cache = make_cache() if make_cache is not None else None
        step = chunk or input_ids.shape[1]
        logits = []
        for s in range(0, input_ids.shape[1], step):
            out = model(input_ids[:, s:s + step], past_key_values=cache, use_cache=cache is not None)
            logits.append(out.logits.float())
        logits = torch.cat(logits, dim=1)
        # Token t+1 is scored from the logits at t; the first `window - trg_len`
        # targets were scored by the previous window.
        targets = input_ids[:, 1:].clone()
        targets[:, : max(0, (end - begin) - trg_len - 1)] = -100
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1),
            ignore_index=-100, reduction="sum",
        )
        nll_sum += float(loss)
        n_scored += int((targets != -100).sum())
        if on_window_done is not None:
            on_window_done(cache)
        prev_end = end
        if end == seq_len:
            break
    return math.exp(nll_sum / n_scored)


@torch.no_grad()
def prefill_decode_logits(model, ids, cache, steps: int = 8) -> list[torch.Tensor]:
    """Logits of a prefill and ``steps`` greedy decode steps, one tensor per forward."""
    out = model(ids, past_key_values=cache, use_cache=True)
    logits = [out.logits[:, -1].float().clone()]
    for _ in range(steps):
        nxt = logits[-1].argmax(-1, keepdim=True)
        out = model(nxt, past_key_values=cache, use_cache=True)
        logits.append(out.logits[:, -1].float().clone())
    return logits
