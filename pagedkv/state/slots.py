"""The state pool's slots: one slot holds one sequence's recurrent state in every state
layer. A slot is free (``ref == 0``) or held by live sequences (their current state, or
a restore point kept for a rollback) and by at most one snapshot; a state is shared by
reference (a fork, a prefix hit, a snapshot of the live state) and copied before a
holder writes it (copy-on-write, like blocks).

The pool has its own budget (``CacheConfig.state_slots``), apart from the blocks: a
state is not a page of tokens, and the attention groups keep their block size.
"""
from __future__ import annotations

import numpy as np

from pagedkv.errors import InternalError

__all__ = ["StateSlots"]


class StateSlots:
    """Reference counts and the free list of ``num_slots`` state slots. The free list is
    a stack: the slot freed last is handed out first (its memory is warm)."""

    def __init__(self, num_slots: int):
        self.ref = np.zeros(num_slots, dtype=np.int32)     # holders per slot
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self.num_allocations = 0       # slots handed out, ever

    @property
    def num_slots(self) -> int:
        return len(self.ref)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_in_use(self) -> int:
        return self.num_slots - len(self._free)

    def allocate(self) -> int:
        """A free slot, held once. The caller checked the room (all or nothing)."""
        if not self._free:
            raise InternalError("a state slot was taken with none free (the room was not checked: a bug)")
        s = self._free.pop()
        self.ref[s] = 1
        self.num_allocations += 1
        return s

    def incref(self, slot: int) -> None:
        if self.ref[slot] < 1:
            raise InternalError(f"state slot {slot} shared while free (a bug)")
        self.ref[slot] += 1

    def decref(self, slot: int) -> bool:
        """Drop one holder; True when the slot became free."""
        r = int(self.ref[slot])
        if r < 1:
            raise InternalError(f"state slot {slot} released while free (a bug)")
        self.ref[slot] = r - 1
        if r == 1:
            self._free.append(slot)
            return True
        return False

    def check_invariants(self, held: np.ndarray) -> None:
        """``held``: holders per slot counted from the owners; each must equal ``ref``,
        and the free list must list exactly the slots no one holds, once each."""
        if not np.array_equal(held, self.ref):
            bad = int(np.flatnonzero(held != self.ref)[0])
            raise InternalError(f"state slot {bad}: ref {self.ref[bad]} but {held[bad]} holders")
        free = sorted(self._free)
        if free != np.flatnonzero(self.ref == 0).tolist():
            raise InternalError("the state free list disagrees with the slots' references")
