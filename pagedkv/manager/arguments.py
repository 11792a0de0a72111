"""Argument checks for the manager's public calls: one place decides what an int, a
count, a batch of counts and a list of token ids may be.

Wrong Python types (a str, a float, None, a bool where an int is meant) raise
:class:`~pagedkv.errors.ArgumentTypeError` (a ``TypeError``); right types with values
out of range raise :class:`~pagedkv.errors.InvalidArgumentError` (a ``ValueError``).
Nothing is converted silently: ``2.5`` is not ``2``, and ``2**64 - 1`` is not ``-1``.
Counts are int64 in the core, so every count is checked against ``[0, 2**63)`` here,
before anything changes.
"""
from __future__ import annotations

import operator
import sys
from typing import Any

import numpy as np

from pagedkv.errors import ArgumentTypeError, DeviceError, DTypeError, InvalidArgumentError, expected

__all__ = ["as_int", "as_count", "as_counts", "as_row_counts", "as_token_ids", "optional_int", "INT64_MAX",
           "check_attention_call"]

INT64_MAX = 2**63 - 1
#: what ``PagedKVCache.attention`` passes on to the op (the arena's own arguments are the cache's)
ATTENTION_OPTIONS = frozenset({"sm_scale", "soft_cap", "window", "sink_tokens", "num_splits", "out", "backend"})
_INT32_MIN, _INT32_MAX = -2**31, 2**31 - 1


def as_int(value: Any, argument: str, lo: int = 0, hi: int = INT64_MAX) -> int:
    """An int in ``[lo, hi]``: Python and NumPy ints only (not bool, float or str)."""
    if type(value) is not int:
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise ArgumentTypeError(expected(argument, "an int", _describe(value)))
        value = operator.index(value)
    if not lo <= value <= hi:
        raise InvalidArgumentError(expected(argument, _range(lo, hi), value))
    return value


def as_count(value: Any, argument: str = "num_tokens") -> int:
    """A token or block count: an int in ``[0, 2**63)``."""
    if type(value) is int and 0 <= value <= INT64_MAX:
        return value
    return as_int(value, argument)


def as_counts(value: Any, argument: str = "num_tokens") -> np.ndarray:
    """Counts as an int64 array (an int, a flat sequence of ints, an integer array),
    each in ``[0, 2**63)``. Returns a fresh array: later changes by the caller (or
    another thread) to ``value`` cannot reach the core."""
    if type(value) is int or isinstance(value, np.integer):
        return np.array([as_count(value, argument)], dtype=np.int64)
    if _is_tensor(value):
        value = tensor_values(value, argument)
    if not isinstance(value, np.ndarray):
        if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
            raise ArgumentTypeError(expected(argument, "an int or a flat sequence of ints", _describe(value)))
        for v in value:          # object lists: refuse floats and bools before NumPy converts them
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
                raise ArgumentTypeError(expected(argument, "an int or a flat sequence of ints",
                                                 f"a sequence holding {_describe(v)}"))
        try:
            value = np.array(value, dtype=np.int64)
        except OverflowError:
            raise InvalidArgumentError(expected(argument, "counts in [0, 2**63)", "a count out of range")) from None
    else:
        if value.ndim > 1 or value.dtype.kind not in "iu":
            raise ArgumentTypeError(expected(argument, "an int or a flat sequence of ints",
                                             f"{value.dtype} values of shape {value.shape}"))
        if value.dtype.kind == "u" and value.size and int(value.max()) > INT64_MAX:
            raise InvalidArgumentError(expected(argument, "counts in [0, 2**63)", int(value.max())))
        value = np.array(value.reshape(-1), dtype=np.int64)
    if value.size and int(value.min()) < 0:
        i = int(np.argmin(value))
        raise InvalidArgumentError(expected(argument, "counts >= 0", f"{int(value[i])} at index {i}"))
    return value


def as_row_counts(value: Any, rows: int, argument: str, lo: int, hi: int) -> np.ndarray:
    """One count for every one of ``rows`` rows (an int) or one per row (a flat sequence
    or integer array of ``rows`` ints), each in ``[lo, hi]``, as a fresh int64 array.
    Checked whole before the caller sizes anything from it."""
    if type(value) is int or isinstance(value, np.integer):
        return np.full(rows, as_int(value, argument, lo, hi), dtype=np.int64)
    if isinstance(value, (bool, np.bool_, float, np.floating)) or value is None:
        raise ArgumentTypeError(expected(argument, f"an int or {rows} ints (one per row)", _describe(value)))
    counts = as_counts(value, argument)
    if counts.shape != (rows,):
        from pagedkv.errors import ShapeError
        raise ShapeError(expected(argument, f"an int or {rows} counts (one per row)", f"{counts.shape[0]} counts"))
    if rows and int(counts.min()) < lo:
        raise InvalidArgumentError(expected(argument, f"counts >= {lo}", counts.tolist()[:16]))
    if rows and int(counts.max()) > hi:
        raise InvalidArgumentError(expected(argument, f"counts <= {hi}", counts.tolist()[:16]))
    return counts


def as_token_ids(token_ids: Any, argument: str = "token_ids") -> np.ndarray:
    """Token ids as a flat int32 array (lists, arrays, tensors); typed errors otherwise."""
    if type(token_ids) is np.ndarray and token_ids.dtype == np.int32 and token_ids.ndim == 1:
        return token_ids
    if _is_tensor(token_ids):
        if token_ids.dtype.is_floating_point or token_ids.dtype.is_complex or str(token_ids.dtype) == "torch.bool":
            raise ArgumentTypeError(expected(argument, "integer token ids", f"a {token_ids.dtype} tensor"))
        token_ids = tensor_values(token_ids, argument).reshape(-1)
    if isinstance(token_ids, (str, bytes)) or not (isinstance(token_ids, np.ndarray) or hasattr(token_ids, "__iter__")):
        raise ArgumentTypeError(expected(argument, "a flat sequence of integer token ids", _describe(token_ids)))
    arr = np.asarray(list(token_ids) if not isinstance(token_ids, np.ndarray) else token_ids)
    if arr.size == 0:
        return np.empty(0, dtype=np.int32)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise InvalidArgumentError(expected(argument, "a flat sequence of integer token ids",
                                            f"{arr.dtype} values of shape {arr.shape}"))
    if int(arr.min()) < _INT32_MIN or int(arr.max()) > _INT32_MAX:
        raise InvalidArgumentError(expected(argument, "token ids fitting int32", "an out-of-range id"))
    return arr.astype(np.int32, copy=False)


def check_attention_call(options: dict, q: Any, model_dtype: Any) -> None:
    """``PagedKVCache.attention``'s own checks: only the op's keywords that are the
    caller's (``layout``, the scales, the rotation are the arena's: a typed error, not
    Python's "multiple values"), and ``q`` in the cache's model dtype whatever the
    arena's format: a quantized arena dequantizes to that dtype, and a float16 ``q`` on
    a float32 cache is refused as on an unquantized one (nothing is cast silently)."""
    unknown = sorted(set(options) - ATTENTION_OPTIONS)
    if unknown:
        raise ArgumentTypeError(expected("attention", f"keywords among {sorted(ATTENTION_OPTIONS)} (the cache "
                                         "passes the arena's own)", f"{unknown[0]}="))
    dtype = getattr(q, "dtype", None)
    if _is_tensor(q) and dtype != model_dtype:
        raise DTypeError(expected("q", f"dtype {model_dtype} (the cache's model dtype)", dtype))


def optional_int(value: Any | None, argument: str, lo: int = 0, hi: int = INT64_MAX) -> int | None:
    return None if value is None else as_int(value, argument, lo, hi)


def _range(lo: int, hi: int) -> str:
    if hi == INT64_MAX:
        return f"an int >= {lo}" if lo else "an int in [0, 2**63)"
    return f"an int in [{lo}, {hi}]"


def _describe(value: Any) -> str:
    if isinstance(value, (int, float, str, bool, type(None), np.generic)):
        return f"{type(value).__name__} {value!r}"
    return type(value).__name__


def _is_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def tensor_values(t: Any, argument: str) -> np.ndarray:
    """A tensor argument's values as a host array. Sparse and meta tensors are refused
    by name: they have no dense data to read (torch would raise its own errors)."""
    torch = sys.modules["torch"]
    if t.layout != torch.strided:
        raise ArgumentTypeError(expected(argument, "a dense (strided) tensor", f"a {t.layout} tensor"))
    if t.device.type == "meta":
        raise DeviceError(expected(argument, "a tensor with data (cpu or cuda)", "a meta tensor"))
    return t.detach().cpu().resolve_conj().resolve_neg().numpy()
