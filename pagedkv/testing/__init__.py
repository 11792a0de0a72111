"""Test support shipped with pagedkv, kept out of the runtime modules.

- :mod:`pagedkv.testing.models`: the test-model loader (SmolLM2-135M from a pinned
  wheel, and a tiny random Llama that needs no network);
- :mod:`pagedkv.testing.core_model`: a pure-Python model of the Cython core (the
  oracle of the stateful tests, the fuzzer and the core benchmark's baseline);
- :mod:`pagedkv.testing.quality`: perplexity, KL and top-1 of caches and read paths
  against a baseline on held-out text (the quality measurements' shared loop);
- :func:`~pagedkv.testing.batches.left_pad` (:mod:`pagedkv.testing.batches`): a
  left-padded ``(input_ids, attention_mask)`` batch, as generate() callers build one;
- :func:`weak_hash_cache` (:mod:`pagedkv.testing.caches`): a ``PagedKVCache`` whose
  block hash collides on purpose, to prove that collisions cost misses, never wrong KV.

Submodules load on first use, so ``import pagedkv.testing`` imports neither torch nor
transformers.
"""
from __future__ import annotations

import importlib

__all__ = ["models", "batches", "caches", "core_model", "quality", "weak_hash_cache"]

_LAZY = {"weak_hash_cache": "caches"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
