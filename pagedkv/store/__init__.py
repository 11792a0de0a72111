"""The KV store and its formats: arenas (``kvstore``), dtypes and the format fingerprint
(``dtypes``, ``format``), quantization and rotation (``quant``, ``rotation``), the recent-token
window (``window``), block keys (``block_keys``), layer calibration (``calibration``) and the
checks every data op makes of its tensors against the format (``op_checks``).

``from pagedkv.store import KVStore`` keeps working: names of the ``kvstore`` module are looked
up lazily, so importing ``pagedkv.store.dtypes`` does not import the arenas.
"""
from __future__ import annotations

import importlib
from typing import Any


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    try:  # a submodule not imported yet (``from pagedkv.store import ...`` asks here first)
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{name}":
            raise
    try:
        return getattr(importlib.import_module("pagedkv.store.kvstore"), name)
    except AttributeError:
        raise AttributeError(f"module 'pagedkv.store' has no attribute {name!r}") from None
