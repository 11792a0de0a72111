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
from typing import Any

import numpy as np
import torch

from pagedkv.config.options import CacheConfig
from pagedkv.errors import ArgumentTypeError, InvalidArgumentError, ShapeError, expected
from pagedkv.format import dtypes

__all__ = ["layer_sensitivity", "choose_full_precision_layers"]


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
