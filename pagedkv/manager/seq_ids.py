"""Sequence ids: what the caller names a sequence, and the int64 key the core uses.

**The rule for one id and a batch.** A *batch* of ids is a ``list``, a ``range`` or a
1-D NumPy array. Anything else is *one* id, tuples included: ``("req", 1)`` names one
sequence everywhere, in ``add_sequence`` as in ``reserve``, ``free``... Lists and arrays
are unhashable, so they can never be ids; a ``range`` is hashable, so admission refuses
it (it would read as a batch later), and so it refuses the other ids no later call
could name unambiguously: bools (``True == 1``), NaN (never equal to itself), tensors
(hashed by identity) and negative ints.

**Keys.** A non-negative int (or NumPy integer) *is* its key, so a lone int or an int64
array batch goes to the core with no per-id Python work. Every other id is interned
to a private negative key. Interning is strict about types: ``"1"``, ``1.0`` and
``("a", 1.0)`` never name the sequence of ``1`` or ``("a", 1)``, even though Python's
``==`` says some of them are equal.

**Errors** name the caller's id: the manager installs :meth:`SequenceIds.name` as the
core's ``BlockTables.namer``, so even the core's messages never show an interned key.
"""
from __future__ import annotations

import math
import sys
from collections.abc import Hashable
from typing import Any

import numpy as np

from pagedkv.errors import InvalidArgumentError, SequenceNotFoundError, ShapeError, expected
from pagedkv.manager.arguments import tensor_values

__all__ = ["SequenceIds", "strict_key", "BATCH_TYPES"]

_INT64_MAX = 2**63 - 1

#: the types read as a batch of ids (every other value is one id)
BATCH_TYPES = (list, range, np.ndarray)

_ONE_ID = "a hashable sequence id (one id: lists, ranges and arrays are batches)"


def strict_key(value: Any) -> Hashable:
    """A dict key equal only for values of the same type and value, recursively
    through tuples and frozensets (so ``1``, ``True`` and ``1.0`` differ, and so do
    ``("a", 1)`` and ``("a", True)``). Floats compare by bit pattern (``-0.0`` differs
    from ``0.0``; every NaN with the same bits is one key). Raises ``TypeError`` for an
    unhashable value, as ``hash`` does."""
    t = type(value)
    if t is str:
        return value            # a str equals only a str: no tag needed (the common case)
    if t is tuple:
        return (tuple, tuple(strict_key(v) for v in value))
    if t is frozenset:
        return (frozenset, frozenset(strict_key(v) for v in value))
    if t is float:
        return (float, value.hex())
    hash(value)
    return (t, value)


class SequenceIds:
    """Interns caller ids to core keys and back (see the module docstring)."""

    __slots__ = ("_keys", "_names", "_next")

    def __init__(self) -> None:
        self._keys: dict[Hashable, int] = {}   # strict_key(id) -> negative key
        self._names: dict[int, Any] = {}       # negative key -> the caller's id
        self._next = -1

    def __len__(self) -> int:
        """Interned ids held (non-int ids of live or swapped-out sequences)."""
        return len(self._names)

    # ---- one id ---------------------------------------------------------------------
    def key(self, seq_id: Any, argument: str = "seq_id") -> int:
        """The key of a known id; :class:`SequenceNotFoundError` otherwise."""
        if type(seq_id) is int and 0 <= seq_id <= _INT64_MAX:
            return seq_id
        if isinstance(seq_id, (int, np.integer)) and not isinstance(seq_id, bool):
            n = int(seq_id)
            if 0 <= n <= _INT64_MAX:
                return n
            raise InvalidArgumentError(expected(argument, "an int id in [0, 2**63) or another hashable", n))
        try:
            k = self._keys.get(seq_id if type(seq_id) is str else strict_key(seq_id))
        except TypeError:
            raise InvalidArgumentError(expected(argument, _ONE_ID, type(seq_id).__name__)) from None
        if k is None:
            raise SequenceNotFoundError(seq_id, argument)
        return k

    def intern(self, seq_id: Any, argument: str = "seq_id") -> tuple[int, bool]:
        """``(key, fresh)`` for an id being admitted; ``fresh`` when interned just now
        (call :meth:`forget` if the admission then fails). Refuses ambiguous ids."""
        if type(seq_id) is int and 0 <= seq_id <= _INT64_MAX:
            return seq_id, False
        if isinstance(seq_id, (bool, np.bool_)):
            raise InvalidArgumentError(expected(argument, "a sequence id that is not a bool (True == 1)", repr(seq_id)))
        if isinstance(seq_id, (int, np.integer)):
            n = int(seq_id)
            if not 0 <= n <= _INT64_MAX:
                raise InvalidArgumentError(expected(argument, "an int id in [0, 2**63) or another hashable", n))
            return n, False
        if isinstance(seq_id, BATCH_TYPES) or _is_tensor(seq_id):
            raise InvalidArgumentError(expected(argument, _ONE_ID, type(seq_id).__name__))
        if isinstance(seq_id, float) and math.isnan(seq_id):
            raise InvalidArgumentError(expected(argument, "a sequence id equal to itself (not NaN)", seq_id))
        try:
            sk = seq_id if type(seq_id) is str else strict_key(seq_id)
            k = self._keys.get(sk)
        except TypeError:
            raise InvalidArgumentError(expected(argument, _ONE_ID, type(seq_id).__name__)) from None
        if k is not None:
            return k, False
        k = self._next
        self._next -= 1
        self._keys[sk] = k
        self._names[k] = seq_id
        return k, True

    def forget(self, key: int) -> None:
        """Drop an interned id (its sequence is gone); ints are never interned."""
        if key < 0:
            name = self._names.pop(key, None)
            if name is not None:
                self._keys.pop(name if type(name) is str else strict_key(name), None)

    def interned_keys(self) -> list[int]:
        """Keys of every interned id (for leak audits)."""
        return list(self._names)

    def name(self, key: int) -> Any:
        """The caller's id of a key."""
        return self._names.get(key, key) if key < 0 else key

    # ---- batches --------------------------------------------------------------------
    def batch(self, seq_ids: Any) -> tuple[int | np.ndarray, bool]:
        """Keys for a batch call: one int, or an int64 array; and whether they may hold
        interned (negative) keys, which the core accepts only when told so."""
        t = type(seq_ids)
        if t is int and 0 <= seq_ids <= _INT64_MAX:
            return seq_ids, False                  # a lone int goes to the core as is
        if t is np.ndarray:
            if seq_ids.dtype == np.int64 and seq_ids.ndim == 1:
                return seq_ids, False              # straight to the core (it rejects negatives)
            return self._array(seq_ids), True
        if t is list or t is range or isinstance(seq_ids, (list, range)):
            keys = np.fromiter((self.key(s, "seq_ids") for s in seq_ids), dtype=np.int64, count=len(seq_ids))
            return keys, True
        if _is_tensor(seq_ids):
            return self._array(tensor_values(seq_ids, "seq_ids")), True
        return self.key(seq_ids), True             # one id (tuples included)

    def _array(self, arr: np.ndarray) -> np.ndarray:
        if arr.ndim != 1:
            raise ShapeError(expected("seq_ids", "a 1-D batch of ids", f"an array of shape {arr.shape}"))
        if arr.dtype.kind == "i":
            return arr.astype(np.int64)            # negatives stay negative: the core refuses them
        if arr.dtype.kind == "u":
            if arr.size and int(arr.max()) > _INT64_MAX:
                raise SequenceNotFoundError(int(arr.max()), "seq_ids")
            return arr.astype(np.int64)
        if arr.dtype.kind == "O":
            return np.fromiter((self.key(s, "seq_ids") for s in arr.tolist()), dtype=np.int64, count=len(arr))
        raise InvalidArgumentError(expected("seq_ids", "sequence ids (ints or other hashables)",
                                            f"a {arr.dtype} array"))


def _is_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")      # never imported here: a cache without torch has no tensors
    return torch is not None and isinstance(value, torch.Tensor)
