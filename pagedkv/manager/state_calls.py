"""The recurrent-state calls of :class:`~pagedkv.manager.cache.PagedKVCache`: each
sequence's state slot, reads and writes of states, the next checkpoint (a mixin of the
facade, as :mod:`~pagedkv.manager.data_calls` is). See :mod:`pagedkv.state`.

An engine's step over recurrent-state layers: :meth:`reserve` (each sequence gets a
state slot of its own, copied from a shared snapshot or zeroed for a first state), then
per state layer either :meth:`state_slots` + :meth:`state_arena` for a kernel that
updates the states in place, or :meth:`read_state` / :meth:`write_state`; then
:meth:`commit`, which files snapshots where they are due. :meth:`next_checkpoint` says
where to end a prefill chunk so that a snapshot is taken there.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from pagedkv.errors import InvalidArgumentError, expected

__all__ = ["StateCalls"]


class StateCalls:
    """The recurrent-state calls of a :class:`~pagedkv.manager.cache.PagedKVCache`."""

    _groups: Any
    _ids: Any
    _lock: Any
    config: Any
    state_store: Any

    def _states(self):
        states = getattr(self._groups, "states", None)
        if states is None:
            raise InvalidArgumentError(expected("config.layer_kinds", "recurrent-state layers ('state' or 'hybrid')",
                                                "a cache without them"))
        return states

    def _state_store(self):
        self._states()
        if self.state_store is None:
            raise InvalidArgumentError(expected("allocate_store", "True to hold states", False))
        return self.state_store

    def _state_keys(self, seq_ids) -> list[int]:
        keys, internal = self._ids.batch(seq_ids)
        return self._groups._known(keys, internal)

    def state_slots(self, seq_ids) -> np.ndarray:
        """Each sequence's state slot (int64; -1: the initial state, before its first
        :meth:`reserve`). After a reserve the slot is the sequence's own, to update in place
        in :meth:`state_arena`."""
        with self._lock:
            return self._states().live_slots(self._state_keys(seq_ids))

    def state_positions(self, seq_ids) -> np.ndarray:
        """Tokens each sequence's state covers (int64; its committed tokens)."""
        with self._lock:
            return self._states().positions(self._state_keys(seq_ids))

    def next_checkpoint(self, seq_id) -> int:
        """The position at which the sequence's next periodic (or shared-prefix junction)
        snapshot is due: end a prefill chunk there so that it is taken."""
        with self._lock:
            return self._states().next_checkpoint(self._state_keys(seq_id)[0])

    def state_arena(self, name: str):
        """The arena of state tensor ``name``: ``[state_layers, state_slots, *shape]``."""
        store = self._state_store()
        if name not in store.arenas:
            raise InvalidArgumentError(expected("name", f"a state tensor of the config ({sorted(store.arenas)})",
                                                repr(name)))
        return store.arenas[name]

    def read_state(self, seq_ids, layer: int) -> dict:
        """Copies of the sequences' states in state layer ``layer``: name ->
        ``[B, *shape]`` (zeros for the initial state)."""
        store = self._state_store()
        with self._lock:
            slots = self._states().live_slots(self._state_keys(seq_ids))
        out = store.read(layer, np.maximum(slots, 0))
        fresh = np.flatnonzero(slots < 0)
        if len(fresh):
            for t in out.values():
                t[fresh] = 0
        return out

    def write_state(self, seq_ids, layer: int, states: dict) -> None:
        """Store the sequences' new states of state layer ``layer`` (name -> ``[B,
        *shape]``, every tensor of the config). Each sequence must hold its slot alone:
        :meth:`reserve` first (a shared state is copied there, never written)."""
        store = self._state_store()
        with self._lock:
            st = self._states()
            keys = self._state_keys(seq_ids)
            slots = st.live_slots(keys)
            ref = st.slots.ref
            for k, s in zip(keys, slots.tolist()):
                if s < 0 or ref[s] != 1:
                    raise InvalidArgumentError(expected(
                        "seq_ids", "sequences reserved this step (each holding its state slot alone)",
                        f"{self._ids.name(k)!r} with {'no state slot' if s < 0 else 'a shared state'}"))
            store.write(layer, slots, states)
            st.mark_written(keys)

    def take_state_copies(self) -> tuple[list, list]:
        """``(copies, zeroed)``: the state slot copies ``(src, dst)`` and zero fills a
        bookkeeping-only cache owes its own state store."""
        with self._lock:
            self._states()
            return self._groups.take_state_copies()

    def state_nbytes(self) -> int:
        """Bytes of one sequence's state in every state layer (:meth:`export_state`'s size)."""
        return self._state_store().slot_nbytes()

    def export_state(self, seq_id) -> bytes:
        """The sequence's state in every state layer as bytes (zeros for the initial
        state), covering exactly its committed tokens: what a transfer or a swap carries.
        A state written by a step not yet committed is refused (commit or unreserve first)."""
        self._state_store()
        with self._lock:
            return self._groups.export_state_of(self._state_keys(seq_id)[0])

    def import_state(self, seq_id, data: bytes) -> None:
        """Set the sequence's state to ``data`` (:meth:`export_state`'s bytes of the same
        format), as :meth:`write_state` does for every state layer: after :meth:`reserve`,
        before the :meth:`commit` it is the state of."""
        store = self._state_store()
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidArgumentError(expected("data", "bytes (export_state's)", type(data).__name__))
        data = bytes(data)
        if len(data) != store.slot_nbytes():
            raise InvalidArgumentError(expected("data", f"{store.slot_nbytes()} bytes (one state)", len(data)))
        with self._lock:
            st = self._states()
            key = self._state_keys(seq_id)[0]
            s = st.seqs[key]
            if s.slot < 0 or st.slots.ref[s.slot] != 1:
                raise InvalidArgumentError(expected(
                    "seq_id", "a sequence reserved this step (holding its state slot alone)",
                    f"{self._ids.name(key)!r} with {'no state slot' if s.slot < 0 else 'a shared state'}"))
            self._groups.import_state_of(key, data)
