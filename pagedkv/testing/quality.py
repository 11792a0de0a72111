"""What a KV format costs a real model, through both read paths.

:func:`evaluate` runs the Hugging Face sliding-window perplexity recipe (windows of
``window`` tokens, ``stride`` apart, each scoring only the tokens the previous window
did not) and feeds each window in chunks of ``chunk`` tokens, so that later chunks
attend to K/V read back from the cache. The baseline is transformers' float32
``DynamicCache`` fed the same chunks. Every variant runs, window by window in lockstep
with the baseline, through each path asked for:

- ``"gather"``: :class:`~pagedkv.integrations.transformers.PagedCache` gathers the
  context into a K/V tensor and the model's own attention reads it;
- ``"paged"``: ``PagedCache(paged_attention=True)`` with the ``"pagedkv"`` attention
  (:mod:`pagedkv.integrations.hf_attention`), which reads the pages.

Per (variant, path) it keeps, for every scored position: the change in negative
log-likelihood of the true next token (for perplexity and its standard error, paired
with the baseline), the KL divergence of the next-token distribution from the
baseline's, and whether the top-1 token agrees. :class:`Stats` pools them over slices.

:func:`compare_readers` is the lighter loop of ``benchmarks/read_paths.py``: one
:class:`Reader` per cache and path, mean KL, top-1 and perplexity against the first
reader (issue 33's read-path design comparison).
"""
from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from pagedkv.config.options import CacheConfig
from pagedkv.errors import InvalidArgumentError, expected
from pagedkv.manager.cache import PagedKVCache

__all__ = ["PATHS", "Reader", "Stats", "Variant", "compare_readers", "evaluate", "greedy", "text_ids"]

#: the read paths :func:`evaluate` measures
PATHS = ("gather", "paged")


@dataclass
class Variant:
    """One KV format under test.

    ``overrides``: :class:`~pagedkv.config.options.CacheConfig` options of a pagedkv
    cache (``{}``: float32, unquantized). ``peer``: instead, a format of
    :mod:`pagedkv.testing.kv_peers` (quantized then dequantized into a float32 cache).
    ``goal``: the perplexity increase (%) the format must stay within, if any.
    """

    name: str
    overrides: dict[str, Any] = field(default_factory=dict)
    peer: str | None = None
    goal: float | None = None

    def config(self, model: Any, num_blocks: int) -> CacheConfig:
        extra = dict(kv_window_sequences=1, **self.overrides) if self.overrides else {}   # one sequence at a time
        return CacheConfig.from_hf_config(model.config, num_blocks=num_blocks, dtype=torch.float32, **extra)

    def cache(self, model: Any, num_blocks: int) -> PagedKVCache:
        cfg = self.config(model, num_blocks)
        if self.peer:
            from pagedkv.testing.kv_peers import PEERS, FakeQuantCache

            return FakeQuantCache(cfg, PEERS[self.peer][0]())
        return PagedKVCache(cfg)

    def sizes(self, model: Any, lengths: Sequence[int] = (1024, 8192)) -> dict[str, Any]:
        """Stored bits per element: of the quantized blocks alone (``bits_per_element``),
        and of one whole sequence of each length, every byte counted
        (``bits_per_element_at``: see :meth:`CacheConfig.sequence_bits_per_element`)."""
        cfg = self.config(model, 1)
        if self.peer:
            from pagedkv.testing.kv_peers import PEERS

            bits = PEERS[self.peer][1]
            return {"bits_per_element": bits, "bits_per_element_at": {str(n): bits for n in lengths}}
        return {"bits_per_element": round(cfg.bits_per_element, 3),
                "bits_per_element_at": {str(n): round(cfg.sequence_bits_per_element(n), 3) for n in lengths}}


@dataclass
class Stats:
    """Per-position figures of one (variant, path) against the baseline."""

    dnll: list[torch.Tensor] = field(default_factory=list)   # variant NLL - baseline NLL, float64
    kl: list[torch.Tensor] = field(default_factory=list)     # KL(baseline || variant), float64
    top1: list[torch.Tensor] = field(default_factory=list)   # top-1 tokens agree (bool)

    def __add__(self, other: Stats) -> Stats:
        return Stats(self.dnll + other.dnll, self.kl + other.kl, self.top1 + other.top1)

    def summary(self) -> dict[str, Any]:
        """``perplexity_increase_pct`` (from the mean NLL change) with its standard error
        ``..._se`` (paired, per position), mean ``kl_nats`` and its standard error, and the
        ``top1_agreement`` over ``positions``."""
        d, k = torch.cat(self.dnll), torch.cat(self.kl)
        n = d.numel()
        se = (lambda x: float(x.std() / math.sqrt(n)) if n > 1 else float("nan"))  # noqa: E731
        return {"perplexity_increase_pct": round(100 * math.expm1(float(d.mean())), 4),
                "perplexity_increase_se_pct": round(100 * se(d), 4),
                "kl_nats": float(f"{float(k.mean()):.4g}"), "kl_se": float(f"{se(k):.2g}"),
                "top1_agreement": round(float(torch.cat(self.top1).float().mean()), 5), "positions": n}


class _PagedAttention:
    """Within the block: the model's attention is pagedkv's (SDPA for a call without a
    ticket, so the baseline and the gather path are unchanged), and back after."""

    def __init__(self, model: Any):
        self.model = model

    def __enter__(self) -> None:
        from pagedkv.integrations import hf_attention

        self.before = self.model.config._attn_implementation
        hf_attention.register()
        self.model.set_attn_implementation(hf_attention.NAME)

    def __exit__(self, *exc: Any) -> None:
        self.model.set_attn_implementation(self.before)


def _forward(model: Any, ids: torch.Tensor, cache: Any, chunk: int) -> torch.Tensor:
    return torch.cat([model(ids[:, s:s + chunk], past_key_values=cache, use_cache=True).logits
                      for s in range(0, ids.shape[1], chunk)], dim=1)


@torch.no_grad()
def evaluate(model: Any, ids: torch.Tensor, variants: Sequence[Variant], *, window: int = 1024,
             stride: int = 512, chunk: int = 256, paths: Sequence[str] = PATHS,
             progress: Callable[[str], None] | None = None) -> dict[tuple[str, str], Stats]:
    """``{(variant name, path): Stats}`` over ``ids`` ``[1, n]`` (see the module docstring)."""
    from transformers import DynamicCache

    from pagedkv.integrations.transformers import PagedCache

    for p in paths:
        if p not in PATHS:
            raise InvalidArgumentError(expected("paths", f"names among {PATHS}", repr(p)))
    out = {(v.name, p): Stats() for v in variants for p in paths}
    seq_len, prev_end = ids.shape[1], 0
    with _PagedAttention(model):
        for begin in range(0, seq_len, stride):
            end = min(begin + window, seq_len)
            w = ids[:, begin:end]
            skip = max(0, (end - begin) - (end - prev_end) - 1)   # positions an earlier window scored
            targets = w[0, 1 + skip:, None]
            base = torch.log_softmax(_forward(model, w, DynamicCache(), chunk)[0, skip:-1].float(), dim=-1)
            base_nll = -base.gather(1, targets)[:, 0].double()
            p_base = base.exp()
            for v in variants:
                for p in paths:
                    with PagedCache(v.cache(model, window // 16 + 8), paged_attention=p == "paged") as cache:
                        logp = torch.log_softmax(_forward(model, w, cache, chunk)[0, skip:-1].float(), dim=-1)
                    st = out[(v.name, p)]
                    st.dnll.append(-logp.gather(1, targets)[:, 0].double() - base_nll)
                    st.kl.append((p_base * (base - logp)).sum(-1).double())
                    st.top1.append(logp.argmax(-1) == base.argmax(-1))
            if progress is not None:
                progress(f"window {begin}:{end} of {seq_len} done")
            prev_end = end
            if end == seq_len:
                break
    return out


@torch.no_grad()
def greedy(model: Any, prompts: Sequence[torch.Tensor], variant: Variant | None, new_tokens: int,
           path: str = "gather") -> torch.Tensor:
    """Greedy continuations ``[len(prompts), new_tokens]`` with KV in ``variant``'s cache
    through ``path`` (``variant=None``: the float32 ``DynamicCache`` baseline)."""
    from transformers import DynamicCache

    from pagedkv.integrations.transformers import PagedCache

    out = []
    with _PagedAttention(model):
        for prompt in prompts:
            if variant is None:
                holder: Any = contextlib.nullcontext(DynamicCache())
            else:
                holder = PagedCache(variant.cache(model, (prompt.shape[1] + new_tokens) // 16 + 4),
                                    paged_attention=path == "paged")
            toks = []
            with holder as cache:
                nxt = model(prompt, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
                while True:
                    toks.append(nxt)
                    if len(toks) == new_tokens:
                        break
                    nxt = model(nxt, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
            out.append(torch.cat(toks, dim=1))
    return torch.cat(out)


def log(message: str) -> None:
    print(f"kv_quality: {message}", file=sys.stderr, flush=True)

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
