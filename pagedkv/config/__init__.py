"""Configuration: the cache's options (``options``), what combines (``support``), sizes and
the memory check (``memory``), the planner (``planner``) and GGUF metadata (``gguf``).

``from pagedkv.config import CacheConfig`` keeps working: names of the options module are
looked up lazily, so importing a sibling module does not import the whole configuration.
"""
from __future__ import annotations

import importlib
from typing import Any


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    try:  # a submodule not imported yet (``from pagedkv.config import ...`` asks here first)
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{name}":
            raise
    try:
        return getattr(importlib.import_module("pagedkv.config.options"), name)
    except AttributeError:
        raise AttributeError(f"module 'pagedkv.config' has no attribute {name!r}") from None
