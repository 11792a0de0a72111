"""Which layers lose the most to quantized KV: a short calibration pass.

Quantizing KV hurts some layers far more than others (a layer whose keys carry large
outlier channels, for instance). :func:`layer_sensitivity` measures each layer on a
short text: for every layer ``l`` it runs the model with only layer ``l`` stored in the
quantized ``kv_dtype`` (every other layer in model precision) and reports the mean KL
divergence of the next-token distributions from those of a model-precision cache.
:func:`choose_full_precision_layers` picks the most sensitive layers; passing them as
``kv_full_precision_layers`` keeps them in model precision. Every pass goes through a
real :class:`~pagedkv.manager.cache.PagedKVCache` via the transformers
:class:`~pagedkv.integrations.transformers.PagedCache`, fed in chunks so that most
tokens attend to KV read back from the arena, as in serving.

The pass costs ``num_layers + 1`` forward passes over the text; a few hundred tokens
are enough to rank the layers.
"""
from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagedkv.config.options import CacheConfig
from pagedkv.errors import ArgumentTypeError, DTypeError, InvalidArgumentError, ShapeError, expected
from pagedkv.format import dtypes

__all__ = ["Calibration", "calibrate", "layer_sensitivity", "choose_full_precision_layers", "kv_divergence"]


def _check_ids(input_ids: Any) -> torch.Tensor:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype != torch.long:
        got = input_ids.dtype if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise InvalidArgumentError(expected("input_ids", "an int64 (long) torch.Tensor", got))
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] < 2:
        raise ShapeError(expected("input_ids", "shape [1, n] with n >= 2", tuple(input_ids.shape)))
    return input_ids


def _check_count(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError(expected(name, f"an int >= {minimum}", repr(value)))
    if value < minimum:
        raise InvalidArgumentError(expected(name, f"an int >= {minimum}", repr(value)))
    return int(value)


#: CacheConfig options the pass sets itself: a caller's value would collide with them
_OWN_OPTIONS = ("num_blocks", "memory_budget", "dtype", "kv_window_sequences")


def _check_model(model: Any) -> torch.dtype:
    """The model's parameter dtype; a typed error for anything that is not a model."""
    params = getattr(model, "parameters", None)
    if not callable(params) or getattr(model, "config", None) is None:
        raise ArgumentTypeError(expected("model", "a transformers causal LM (with .config and .parameters())",
                                         type(model).__name__))
    first = next(iter(params()), None)
    if not isinstance(first, torch.Tensor):
        raise InvalidArgumentError(expected("model", "a model with parameters", "one without"))
    return first.dtype


def _vocab_size(model: Any) -> Any:
    emb = model.get_input_embeddings() if callable(getattr(model, "get_input_embeddings", None)) else None
    n = getattr(emb, "num_embeddings", None)
    return n if n is not None else getattr(model.config, "vocab_size", None)


def _check_vocab(ids: torch.Tensor, vocab: Any) -> None:
    # an id outside the embedding table would index past it: refused before any pass
    if isinstance(vocab, bool) or not isinstance(vocab, numbers.Integral):
        return
    bad = ((ids < 0) | (ids >= vocab)).nonzero()
    if bad.numel():
        pos = int(bad[0, 1])
        raise InvalidArgumentError(expected("input_ids", f"token ids in [0, {vocab}) (the model's vocabulary)",
                                            f"{int(ids[0, pos])} at position {pos}"))


def _check_lowbit(lowbit: dict) -> None:
    """Refuse options the pass sets itself, and a kv_dtype that is not quantized."""
    if "kv_full_precision_layers" in lowbit:
        raise InvalidArgumentError(expected("kv_full_precision_layers", "not given (the pass sets it per layer)",
                                            repr(lowbit["kv_full_precision_layers"])))
    for name in _OWN_OPTIONS:
        if name in lowbit:
            raise InvalidArgumentError(expected(name, "not given (the calibration pass sets it)", repr(lowbit[name])))
    row = dtypes.lookup(lowbit.get("kv_dtype"))
    if row is None or not row.quantized:
        names = ", ".join(dtypes.quantized_names())
        raise InvalidArgumentError(expected("kv_dtype", f"a quantized kv dtype ({names})", repr(lowbit.get("kv_dtype"))))


@torch.no_grad()
def _log_probs(model, input_ids: torch.Tensor, config: CacheConfig, chunk: int) -> torch.Tensor:
    from pagedkv.integrations.transformers import PagedCache
    from pagedkv.manager.cache import PagedKVCache

    kv = PagedKVCache(config)
    with PagedCache(kv) as cache:
        logits = torch.cat([model(input_ids[:, s:s + chunk], past_key_values=cache, use_cache=True).logits
                            for s in range(0, input_ids.shape[1], chunk)], dim=1)
    return torch.log_softmax(logits[0].float(), dim=-1)


@torch.no_grad()
def layer_sensitivity(model: Any, input_ids: torch.Tensor, *, chunk: int = 128, block_size: int = 16,
                      **lowbit: Any) -> list[float]:
    """Mean KL (nats per token) added by quantizing each layer's KV alone.

    Args:
        model: a transformers causal LM (its ``config`` sizes the cache).
        input_ids: ``[1, n]`` int64 calibration tokens (``n >= 2``).
        chunk: tokens fed per forward pass (later chunks read earlier KV back from the
            arena).
        block_size: the cache's block size.
        **lowbit: the quantized cache's options: ``kv_dtype`` (required, quantized) and
            any of ``kv_group_size``, ``kv_rotation``, ``kv_rotation_seed``,
            ``kv_window``. ``kv_full_precision_layers`` is set by the pass itself.

    Returns:
        ``[num_layers]`` floats: entry ``l`` is the KL divergence from the
        model-precision cache's next-token distributions when only layer ``l`` is
        quantized, averaged over the ``n`` positions.
    """
    dtype = _check_model(model)
    ids = _check_ids(input_ids)
    _check_vocab(ids, _vocab_size(model))
    chunk = _check_count("chunk", chunk, 1)
    _check_lowbit(lowbit)
    num_blocks = -(-ids.shape[1] // _check_count("block_size", block_size, 1)) + 2
    base_cfg = CacheConfig.from_hf_config(model.config, num_blocks=num_blocks, block_size=block_size, dtype=dtype)
    base = _log_probs(model, ids, base_cfg, chunk)
    p = base.exp()
    out = []
    for layer in range(base_cfg.num_layers):
        others = tuple(i for i in range(base_cfg.num_layers) if i != layer)
        cfg = CacheConfig.from_hf_config(model.config, num_blocks=num_blocks, block_size=block_size, dtype=dtype,
                                         kv_window_sequences=1, kv_full_precision_layers=others, **lowbit)
        logq = _log_probs(model, ids, cfg, chunk)
        # KL >= 0; float32 rounding can leave a tiny negative for a near-lossless layer
        out.append(max(0.0, float((p * (base - logq)).sum(-1).mean())))
    return out


def choose_full_precision_layers(sensitivity: Sequence[float], count: int) -> tuple[int, ...]:
    """The ``count`` most sensitive layers (ties: the lower index), sorted, for
    ``kv_full_precision_layers``. ``count`` must leave at least one quantized layer."""
    if isinstance(sensitivity, torch.Tensor):
        sensitivity = sensitivity.tolist()
    want = "a sequence of floats (one per layer)"
    if isinstance(sensitivity, (str, bytes)) or not hasattr(sensitivity, "__iter__"):
        raise InvalidArgumentError(expected("sensitivity", want, type(sensitivity).__name__))
    values = list(sensitivity)
    for v in values:       # "1" is no score: nothing is converted silently
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (numbers.Real, np.integer, np.floating)):
            got = f"a sequence holding {type(v).__name__} {v!r}"
            raise InvalidArgumentError(expected("sensitivity", want, got[:120]))
    values = [float(v) for v in values]
    if not values or any(v != v for v in values):
        raise InvalidArgumentError(expected("sensitivity", "a non-empty sequence of floats without NaN",
                                            values[:8]))
    count = _check_count("count", count, 0)
    if count >= len(values):
        raise InvalidArgumentError(expected("count", f"an int in [0, {len(values)}) (one layer must stay quantized)",
                                            count))
    order = sorted(range(len(values)), key=lambda i: (-values[i], i))
    return tuple(sorted(order[:count]))


# ---- end-to-end calibration ---------------------------------------------------------------
#
# The sensitivity above quantizes one layer alone; what a user keeps is the opposite: every
# layer quantized but the chosen ones. Errors compound through the layers after them, so a
# layer's share of the end-to-end loss is not its loss alone (on SmolLM2, keeping layer 18
# saves twice the KL it adds alone, and the layer that adds the most alone can save little).
# calibrate() therefore ranks each candidate by the KL of the configuration it would give.


@dataclass(frozen=True)
class Calibration:
    """The layers :func:`calibrate` keeps in model precision, and the figures it chose by.

    Attributes:
        layers: the chosen layers, sorted (``kv_full_precision_layers``).
        order: the same layers in the order they were chosen.
        kl: mean KL (nats per token, over every scored calibration position) from a
            model-precision cache, with ``layers`` kept in model precision.
        kl_quantized: the same with every layer quantized.
        steps: ``steps[i][l]``: the mean KL with ``order[:i]`` and layer ``l`` kept (None
            for a layer not tried: already chosen, or not a candidate).
        wins: ``wins[i]``: on how many of the texts, taken alone, ``order[i]`` was also the
            best choice of step ``i`` (``texts`` when they all agree).
        texts: calibration texts; tokens: positions scored over all of them.
        options: the low-bit options calibrated (``(name, value)`` pairs).
    """

    layers: tuple[int, ...]
    order: tuple[int, ...]
    kl: float
    kl_quantized: float
    steps: tuple[tuple[float | None, ...], ...]
    wins: tuple[int, ...]
    texts: int
    tokens: int
    options: tuple[tuple[str, Any], ...]

    @property
    def margins(self) -> tuple[float, ...]:
        """Per step, how much more KL the runner-up leaves than the chosen layer
        (relative: 0.1 = 10% more; inf when there was no runner-up)."""
        out = []
        for i, row in enumerate(self.steps):
            tried = sorted(v for v in row if v is not None)
            best = tried[0]
            out.append((tried[1] - best) / best if len(tried) > 1 and best > 0 else float("inf"))
        return tuple(out)

    def overrides(self) -> dict[str, Any]:
        """The options calibrated, with ``kv_full_precision_layers`` set: pass them to
        :class:`~pagedkv.config.options.CacheConfig`."""
        return dict(self.options, kv_full_precision_layers=self.layers)


def _check_texts(texts: Any, vocab: Any) -> list[torch.Tensor]:
    """``texts`` as a list of ``[1, n]`` int64 tensors (one tensor is one text)."""
    items = [texts] if isinstance(texts, torch.Tensor) else texts
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence) or not len(items):
        raise ArgumentTypeError(expected("texts", "a [1, n] int64 tensor or a non-empty sequence of them",
                                         type(texts).__name__))
    out = []
    for i, t in enumerate(items):
        if not isinstance(t, torch.Tensor):
            raise ArgumentTypeError(expected(f"texts[{i}]", "an int64 (long) torch.Tensor", type(t).__name__))
        if t.dtype != torch.long:
            raise DTypeError(expected(f"texts[{i}]", "an int64 (long) torch.Tensor", t.dtype))
        if t.dim() != 2 or t.shape[0] != 1 or t.shape[1] < 2:
            raise ShapeError(expected(f"texts[{i}]", "shape [1, n] with n >= 2", tuple(t.shape)))
        try:
            _check_vocab(t, vocab)
        except InvalidArgumentError as e:
            raise InvalidArgumentError(str(e).replace("input_ids:", f"texts[{i}]:", 1)) from None
        out.append(t)
    return out


def _check_layers(name: str, layers: Any, num_layers: int) -> tuple[int, ...]:
    """Distinct layer indices in ``[-num_layers, num_layers)``, normalized and sorted."""
    what = f"a sequence of distinct layer indices in [-{num_layers}, {num_layers})"
    if isinstance(layers, (str, bytes)) or not isinstance(layers, (Sequence, set, frozenset)):
        raise ArgumentTypeError(expected(name, what, type(layers).__name__))
    out: set[int] = set()
    for i in layers:
        if isinstance(i, bool) or not isinstance(i, numbers.Integral):
            raise ArgumentTypeError(expected(name, what, repr(i)))
        k = int(i)
        if not -num_layers <= k < num_layers or k % num_layers in out:
            raise InvalidArgumentError(expected(name, what, repr(i)))
        out.add(k % num_layers)
    return tuple(sorted(out))


class _Pass:
    """Model-precision and quantized passes over the calibration texts, KL per text."""

    def __init__(self, model: Any, texts: list[torch.Tensor], chunk: int, block_size: int,
                 options: dict[str, Any]):
        dtype = _check_model(model)
        self.model, self.texts, self.chunk = model, texts, chunk
        nb = -(-max(t.shape[1] for t in texts) // block_size) + 2
        self.make = lambda **kw: CacheConfig.from_hf_config(model.config, num_blocks=nb, block_size=block_size,
                                                            dtype=dtype, **kw)
        self.options = options
        # a bad option or layer index fails here, before any pass
        self.num_layers = self.make(kv_window_sequences=1, **options).num_layers

    def divergences(self, keeps: list[tuple[int, ...]]) -> list[list[float]]:
        """``out[j][t]``: summed KL over text ``t``'s positions with ``keeps[j]`` kept
        in model precision (each text's model-precision pass runs once)."""
        out = [[0.0] * len(self.texts) for _ in keeps]
        for t, ids in enumerate(self.texts):
            base = _log_probs(self.model, ids, self.make(), self.chunk)
            p = base.exp()
            for j, keep in enumerate(keeps):
                cfg = self.make(kv_window_sequences=1, kv_full_precision_layers=keep, **self.options)
                logq = _log_probs(self.model, ids, cfg, self.chunk)
                out[j][t] = float((p * (base - logq)).sum())
        return out


@torch.no_grad()
def calibrate(model: Any, texts: Any, count: int = 1, *, candidates: Sequence[int] | None = None,
              shortlist: int | None = None, chunk: int = 128, block_size: int = 16, **lowbit: Any) -> Calibration:
    """Choose ``count`` layers to keep in model precision by end-to-end KL.

    Greedy: step ``i`` tries each candidate layer with the ``i`` layers chosen before,
    every other layer quantized, and keeps the one whose configuration's next-token
    distributions are closest (mean KL over every position of every text) to a
    model-precision cache's. Each pass goes through a real cache, fed in chunks, as in
    :func:`layer_sensitivity`; deterministic for the same model, texts and options.

    Cost: ``count * (len(candidates) + 1)`` forward passes over the texts (one more
    when ``count`` is 0); with ``shortlist``, the steps after the first try only the
    ``shortlist`` candidates the first step ranked best (a layer that saves little alone
    seldom saves the most later), for ``len(candidates) + 1 + (count - 1) * shortlist``.
    Several pieces of varied text (a few thousand tokens in all) rank the layers more
    stably than one: check the choice on text it did not see (:func:`kv_divergence`).

    Args:
        model: a transformers causal LM (its ``config`` sizes the cache).
        texts: a ``[1, n]`` int64 tensor (``n >= 2``), or a sequence of them.
        count: layers to choose (``0 <= count < num_layers``, at most the candidates).
        candidates: the layer indices to choose from (default: every layer).
        shortlist: after the first step, try only this many of its best candidates
            (``>= count``; default: every candidate at every step).
        chunk: tokens per forward pass.
        block_size: the cache's block size.
        **lowbit: the quantized cache's options (``kv_dtype`` required, quantized), as
            for :func:`layer_sensitivity`.

    Returns:
        a :class:`Calibration` (its :meth:`~Calibration.overrides` configure the cache).
    """
    _check_model(model)
    pieces = _check_texts(texts, _vocab_size(model))
    count = _check_count("count", count, 0)
    chunk = _check_count("chunk", chunk, 1)
    block_size = _check_count("block_size", block_size, 1)
    _check_lowbit(lowbit)
    run = _Pass(model, pieces, chunk, block_size, lowbit)
    n = run.num_layers
    cands = tuple(range(n)) if candidates is None else _check_layers("candidates", candidates, n)
    if count > len(cands) or count >= n:
        raise InvalidArgumentError(expected("count", f"an int in [0, {min(len(cands) + 1, n)}) (at most the "
                                            f"{len(cands)} candidates; one layer must stay quantized)", count))
    if shortlist is not None and _check_count("shortlist", shortlist, 1) < count:
        raise InvalidArgumentError(expected("shortlist", f"None or an int >= count ({count})", shortlist))
    tokens = sum(t.shape[1] for t in pieces)
    order: list[int] = []
    steps: list[tuple[float | None, ...]] = []
    wins: list[int] = []
    kl_q = kl = float("nan")
    for step in range(max(count, 1)):
        tried = [c for c in cands if c not in order] if count else []
        keeps = [tuple(sorted(order + [c])) for c in tried]
        if step == 0:
            keeps.append(())
        per_text = run.divergences(keeps)
        if step == 0:
            kl_q = kl = max(0.0, sum(per_text.pop()) / tokens)
        if not tried:
            break
        means = [max(0.0, sum(row) / tokens) for row in per_text]
        if step == 0 and shortlist is not None:     # later steps try the first step's best only
            cands = tuple(sorted(sorted(tried, key=lambda c: (means[tried.index(c)], c))[:shortlist]))
        best = min(range(len(tried)), key=lambda j: (means[j], tried[j]))
        order.append(tried[best])
        kl = means[best]
        row: list[float | None] = [None] * n
        for c, m in zip(tried, means):
            row[c] = m
        steps.append(tuple(row))
        wins.append(sum(1 for t in range(len(pieces))
                        if min(range(len(tried)), key=lambda j: (per_text[j][t], tried[j])) == best))
    return Calibration(layers=tuple(sorted(order)), order=tuple(order), kl=kl, kl_quantized=kl_q,
                       steps=tuple(steps), wins=tuple(wins), texts=len(pieces), tokens=tokens,
                       options=tuple(sorted(lowbit.items())))


@torch.no_grad()
def kv_divergence(model: Any, texts: Any, *, chunk: int = 128, block_size: int = 16, **options: Any) -> float:
    """Mean KL (nats per position, over every position of ``texts``) of a cache with
    ``options`` (``kv_dtype`` required and quantized; ``kv_full_precision_layers``
    allowed) from a model-precision cache: how a calibration's choice does on other text."""
    _check_model(model)
    pieces = _check_texts(texts, _vocab_size(model))
    chunk = _check_count("chunk", chunk, 1)
    block_size = _check_count("block_size", block_size, 1)
    keep = options.pop("kv_full_precision_layers", ())
    _check_lowbit(options)
    run = _Pass(model, pieces, chunk, block_size, options)
    keep = _check_layers("kv_full_precision_layers", keep, run.num_layers)
    return max(0.0, sum(run.divergences([keep])[0]) / sum(t.shape[1] for t in pieces))
