"""The disk tier's header (``meta.json``): what it must say for a cache to use the tier.

A header that is not pagedkv's, of another version, with a field of the wrong type,
written for another KV format (every differing setting is named, both values), for
other sink and window rows, another record size, block size or hash, refuses the
directory with a :class:`~pagedkv.errors.TierFileError`; the directory is left as it is.

``capacity`` is the tier's limit in blocks: the files grow up to it on demand. A cache
may open a tier with a larger limit (the header is updated); one smaller than the slots
the files already hold is refused.
"""
from __future__ import annotations

from typing import Any

from pagedkv.errors import TierFileError, expected
from pagedkv.format.fingerprint import differences, shown

__all__ = ["MAGIC", "FORMAT_VERSION", "ROWS_VERSION", "check_meta"]

MAGIC = "pagedkv-prefix-tier"
FORMAT_VERSION = 1
ROWS_VERSION = 2          # records carry sink and window rows (meta.json names their format)
_JSON_NAMES = {str: "string", int: "integer", bool: "boolean", dict: "object"}
_META_TYPES = {"magic": str, "version": int, "capacity": int, "record_bytes": int, "block_size": int,
               "weak_hash": bool, "kv_format": dict}


def check_meta(name: str, mine: dict, meta: Any) -> None:
    """Refuse ``meta`` (read from file ``name``) unless this cache (``mine``) may use it."""
    if not isinstance(meta, dict) or meta.get("magic") != MAGIC:
        raise TierFileError(expected(name, "a pagedkv prefix-tier header",
                                     f"magic {meta.get('magic') if isinstance(meta, dict) else meta!r}"))
    if meta.get("version") not in (FORMAT_VERSION, ROWS_VERSION):
        raise TierFileError(expected(name, f"version={mine['version']}", f"version={meta.get('version')!r}"))
    _check_types(name, meta)
    diff = differences(mine["kv_format"], meta.get("kv_format"))
    if diff:     # every differing setting, both values: the directory is left as it is
        raise TierFileError(expected(
            name, "a tier written for this model shape and settings ("
            + ", ".join(f"{k}={shown(m)}" for k, _, m in diff) + ")",
            ", ".join(f"{k}={shown(t)}" for k, t, _ in diff)))
    _check_rows(name, mine, meta)
    for key in ("record_bytes", "block_size", "weak_hash"):
        if meta.get(key) != mine[key]:
            raise TierFileError(expected(name, f"{key}={mine[key]!r} (this cache)", f"{key}={meta.get(key)!r}"))


def _check_types(name: str, meta: dict) -> None:
    # Before any comparison: a field of the wrong type is a foreign header, not a crash.
    for key, kind in _META_TYPES.items():
        v = meta.get(key)
        if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
            raise TierFileError(expected(name, f"{key} as a JSON {_JSON_NAMES[kind]}",
                                         f"{type(v).__name__} {v!r}"[:200]))


def _check_rows(name: str, mine_meta: dict, meta: dict) -> None:
    """The sink and window rows: a tier is used only with the rows this cache keeps,
    for the same ``kv_window`` and ``kv_sink_tokens``. A tier without rows (version 1:
    an older pagedkv, or a cache that kept none) would serve a prefix without them,
    and one with rows to a cache without them would keep them stale: both refused."""
    mine = mine_meta.get("rows")
    theirs = meta.get("rows") if meta["version"] == ROWS_VERSION else None
    if mine is None and theirs is None:
        if meta["version"] != mine_meta["version"]:    # version 2 that names no rows: not ours
            raise TierFileError(expected(name, f"version={mine_meta['version']}",
                                         f"version={meta['version']} without rows"))
        return
    if theirs is None:
        raise TierFileError(expected(name, "a tier whose records carry sink and window rows (" + _settings(mine)
                                     + ": this cache keeps them in model precision)",
                                     f"version={meta['version']}, no rows (written by an older pagedkv or by "
                                     "a cache without kv_window/kv_sink_tokens)"))
    if mine is None:
        raise TierFileError(expected(name, "a tier without sink and window rows (this cache keeps none)",
                                     "rows for " + (_settings(theirs) if isinstance(theirs, dict) else shown(theirs))))
    diff = differences(mine, theirs) if isinstance(theirs, dict) else [("rows", theirs, mine)]
    if diff:
        raise TierFileError(expected(name, "a tier whose rows were written for this cache ("
                                     + ", ".join(f"{k}={shown(m)}" for k, _, m in diff) + ")",
                                     ", ".join(f"{k}={shown(t)}" for k, t, _ in diff)))


def _settings(rows: Any) -> str:
    return f"kv_window={shown(rows.get('kv_window'))}, kv_sink_tokens={shown(rows.get('kv_sink_tokens'))}"
