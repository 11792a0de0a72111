"""What a KV cache costs a model's predictions, per read path: the quality measurements'
shared loop.

:func:`compare_readers` runs the Hugging Face sliding-window perplexity recipe (windows
of ``window`` tokens every ``stride``, each fed in chunks of ``chunk`` so that later
chunks read earlier KV back from the cache) once per :class:`Reader`, window by window
in lockstep, and compares each reader's next-token distributions with the first
reader's (the baseline, e.g. float32 ``DynamicCache``) at every scored position: mean
KL divergence, top-1 agreement, and the perplexity itself. A reader is a cache factory
plus a path: the gather path (``PagedCache`` returns gathered K/V to the model's own
attention) or the paged path (``PagedCache(paged_attention=True)`` with pagedkv's
registered attention reading the pages). Both paths read the same data (one
definition of what a read returns), so for every KV format their figures must agree.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

__all__ = ["Reader", "compare_readers", "text_ids"]


class Reader(NamedTuple):
    """One cache under test: ``make_kv()`` gives a fresh ``PagedKVCache`` for one window
    (None: transformers' ``DynamicCache``); ``paged``: the paged path, else the gather path."""

    name: str
    make_kv: Callable[[], Any] | None
    paged: bool = False


def text_ids(tokenizer, n: int, start: int = 0) -> torch.Tensor:
    """Tokens ``[start, start + n)`` of ``pydoc_data.topics.topics`` joined in sorted key
    order (the measurements' corpus), ``[1, n]``."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][start:start + n]
    if len(ids) < n:
        raise ValueError(f"the pydoc corpus has only {start + len(ids)} tokens, wanted {start + n}")
    return torch.tensor([ids], dtype=torch.long)


def _cache(model, reader: Reader):
    from transformers import DynamicCache

    from pagedkv.integrations.transformers import PagedCache

    if reader.make_kv is None:
        return DynamicCache(config=model.config)
    return PagedCache(reader.make_kv(), paged_attention=reader.paged)


@torch.no_grad()
def compare_readers(model, ids: torch.Tensor, readers: list[Reader], *, window: int = 1024, stride: int = 512,
                    chunk: int = 256, on_window: Callable[[int, int], None] | None = None) -> dict[str, dict]:
    """``{name: {"perplexity", "kl", "top1", "seconds"}}`` of every reader over ``ids``
    ``[1, n]``; ``kl`` (nats per scored token) and ``top1`` are against ``readers[0]``.

    The model runs with pagedkv's registered attention (``hf_attention``) for every
    reader: a call without a paged ticket runs transformers' SDPA unchanged, so the
    gather path and ``DynamicCache`` read exactly as with ``attn_implementation="sdpa"``.
    ``on_window(begin, end)`` is called after each window (progress)."""
    from pagedkv.integrations import hf_attention

    hf_attention.register()
    old = model.config._attn_implementation
    model.set_attn_implementation(hf_attention.NAME)
    try:
        return _compare(model, ids, readers, window, stride, chunk, on_window)
    finally:
        model.set_attn_implementation(old)


def _compare(model, ids, readers, window, stride, chunk, on_window):
    import inspect

    # transformers >= 5.24 names the argument cache= (past_key_values= is deprecated there)
    arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    seq_len = ids.shape[1]
    stats = {r.name: [0.0, 0.0, 0, 0.0] for r in readers}     # nll, kl, top-1 matches, seconds
    scored, prev_end = 0, 0
    for begin in range(0, seq_len, stride):
        end = min(begin + window, seq_len)
        window_ids = ids[:, begin:end]
        targets = window_ids[0, 1:]
        skip = max(0, (end - begin) - (end - prev_end) - 1)    # positions an earlier window scored
        base = None
        for r in readers:
            t0 = time.perf_counter()
            cache = _cache(model, r)
            try:
                logits = torch.cat([model(window_ids[:, s:s + chunk], use_cache=True, **{arg: cache}).logits
                                    for s in range(0, window_ids.shape[1], chunk)], dim=1)[0, skip:-1].float()
            finally:
                if hasattr(cache, "release"):
                    cache.release()
            logp = torch.log_softmax(logits, dim=-1)
            st = stats[r.name]
            st[0] -= float(logp.gather(1, targets[skip:, None]).sum())
            if base is None:
                base = logp
            else:
                st[1] += float((base.exp() * (base - logp)).sum())
                st[2] += int((logp.argmax(-1) == base.argmax(-1)).sum())
            st[3] += time.perf_counter() - t0
        scored += targets.shape[0] - skip
        if on_window is not None:
            on_window(begin, end)
        prev_end = end
        if end == seq_len:
            break
    out = {}
    for i, (name, (nll, kl, top1, sec)) in enumerate(stats.items()):
        out[name] = {"perplexity": math.exp(nll / scored), "kl": kl / scored,
                     "top1": 1.0 if i == 0 else top1 / scored, "seconds": sec}
    return out
