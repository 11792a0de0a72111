"""The store that holds a config's blocks, chosen by its layer groups' spec.

A spec names its arena kind (:attr:`pagedkv.groups.spec.KVSpec.arena`): ``"kv"``, K and
V rows per head (:class:`~pagedkv.store.kvstore.KVStore`, with scale arenas, the recent
window and block keys), or ``"latent"``, one MLA latent row per token
(:class:`~pagedkv.store.latent_store.LatentStore`). A new kind is one entry here.
"""
from __future__ import annotations

from typing import Any

__all__ = ["STORE_FOR", "make_store"]


def _kv(config: Any) -> Any:
    from pagedkv.store.kvstore import KVStore

    return KVStore(config)


def _latent(config: Any) -> Any:
    from pagedkv.store.latent_store import LatentStore

    return LatentStore(config)


#: arena kind -> how its store is built from a CacheConfig (torch imported on use)
STORE_FOR = {"kv": _kv, "latent": _latent}


def make_store(config: Any) -> Any:
    """The store of ``config``'s layer groups (one arena kind per pool)."""
    return STORE_FOR[config.kv_specs[0].arena](config)
