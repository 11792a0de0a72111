"""The tensors that hold recurrent states: one arena per state tensor kind, shaped
``[state_layers, state_slots, *shape]`` in the tensor's dtype (float32 by default), on
the cache's device. Slot ``s`` of every arena is one sequence's state (the state pool's
slot); the bookkeeping decides which slot, this store only moves bytes.
"""
from __future__ import annotations

from typing import Any

import torch

from pagedkv.errors import DeviceError, DTypeError, InvalidArgumentError, ShapeError, expected
from pagedkv.format import dtypes
from pagedkv.groups.spec import RecurrentStateSpec

__all__ = ["StateStore"]


class StateStore:
    """The state arenas of one cache.

    Args:
        spec: the state group's spec (its tensors and layers).
        num_slots: slots per arena.
        device: torch device of the arenas.
    """

    def __init__(self, spec: RecurrentStateSpec, num_slots: int, device: Any):
        self.spec = spec
        self.num_slots = num_slots
        self.device = torch.device(device)
        self.num_layers = len(spec.layers)
        self.arenas: dict[str, torch.Tensor] = {
            t.name: torch.zeros((self.num_layers, num_slots, *t.shape), dtype=dtypes.info(t.dtype).torch_dtype,
                                device=self.device)
            for t in spec.tensors}

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() for a in self.arenas.values())

    def _index(self, slots) -> torch.Tensor:
        return torch.as_tensor(slots, dtype=torch.int64).to(self.device)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Copy slot ``src`` to slot ``dst`` in every arena, for each ``(src, dst)``."""
        if not pairs:
            return
        src = self._index([p[0] for p in pairs])
        dst = self._index([p[1] for p in pairs])
        for a in self.arenas.values():
            a.index_copy_(1, dst, a.index_select(1, src))

    def zero(self, slots: list[int]) -> None:
        """The initial (all-zero) state in ``slots``."""
        if not slots:
            return
        idx = self._index(slots)
        for a in self.arenas.values():
            a.index_fill_(1, idx, 0)

    def _layer(self, layer) -> int:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise InvalidArgumentError(expected("layer", f"a state layer in [0, {self.num_layers})", repr(layer)))
        return layer

    def read(self, layer: int, slots) -> dict[str, torch.Tensor]:
        """Copies of the states in ``slots`` of state layer ``layer``: name ->
        ``[len(slots), *shape]``."""
        idx = self._index(slots)
        li = self._layer(layer)
        return {name: a[li].index_select(0, idx) for name, a in self.arenas.items()}

    def write(self, layer: int, slots, tensors: dict[str, torch.Tensor]) -> None:
        """Store ``tensors`` (name -> ``[len(slots), *shape]``, every tensor of the spec)
        into ``slots`` of state layer ``layer``; checked before anything is written."""
        li = self._layer(layer)
        n = len(slots)
        if set(tensors) != set(self.arenas):
            raise InvalidArgumentError(expected("states", f"the tensors {sorted(self.arenas)}", sorted(tensors)))
        for name, t in tensors.items():
            a = self.arenas[name]
            if not isinstance(t, torch.Tensor):
                raise DTypeError(expected(name, "a torch.Tensor", type(t).__name__))
            if tuple(t.shape) != (n, *a.shape[2:]):
                raise ShapeError(expected(name, f"[{n}, {', '.join(map(str, a.shape[2:]))}] (one state per "
                                          "sequence)", tuple(t.shape)))
            if t.device.type != self.device.type:
                raise DeviceError(expected(name, f"a tensor on {self.device}", t.device))
            if not t.dtype.is_floating_point:
                raise DTypeError(expected(name, f"a floating-point tensor (stored as {a.dtype})", t.dtype))
        idx = self._index(slots)
        for name, t in tensors.items():
            self.arenas[name][li].index_copy_(0, idx, t.to(self.arenas[name].dtype))

    def slot_nbytes(self) -> int:
        """Bytes of one slot in every arena (a snapshot at rest)."""
        return sum(a[:, 0].numel() * a.element_size() for a in self.arenas.values())

    def export_slot(self, slot: int) -> bytes:
        """Slot ``slot``'s state in every arena, as bytes (arenas in the spec's order, each
        ``[state_layers, *shape]``)."""
        return b"".join(a[:, slot].contiguous().cpu().view(torch.uint8).numpy().tobytes()
                        for a in self.arenas.values())

    def import_slot(self, slot: int, data: bytes) -> None:
        """The inverse of :meth:`export_slot` (``data`` must be :meth:`slot_nbytes` long)."""
        if len(data) != self.slot_nbytes():
            raise InvalidArgumentError(expected("data", f"{self.slot_nbytes()} bytes (one state slot)", len(data)))
        at = 0
        for a in self.arenas.values():
            part = a[:, slot]
            n = part.numel() * a.element_size()
            src = torch.frombuffer(bytearray(data[at:at + n]), dtype=torch.uint8).view(a.dtype).view(part.shape)
            part.copy_(src.to(self.device))
            at += n
