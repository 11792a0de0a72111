"""BlockMover: the connector's worker side; copies vLLM blocks to and from shared-arena slots.

It never decides anything: the step's metadata names the arena, the ``(slot, block)``
loads and the ``(block, slot)`` saves the scheduler side chose. It maps each arena once
(by name, :class:`.vllm_shm.SharedArena`), builds the arena's codec from its header, and
checks the header's KV shape against the tensors vLLM registered before the first copy;
a mismatch refuses that arena (its loads are reported failed, its saves abandoned).

``/dev/shm`` is world-writable and the arena's name comes through the step's metadata,
so everything read from a header is checked before it sizes or selects anything: every
failure below :meth:`BlockMover.arena` is a typed pagedkv error, which it turns into a
logged refusal of that arena (a miss), never an exception in vLLM's worker step. A copy
checks all its ``(block, slot)`` pairs before it moves a byte.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from pagedkv.errors import ArgumentTypeError, InternalError, InvalidArgumentError, PagedKVError, TierFileError, expected
from pagedkv.integrations.vllm_codec import Codec, make_codec
from pagedkv.integrations.vllm_config import STORAGE_FORMATS
from pagedkv.integrations.vllm_shm import _DTYPES, SharedArena

__all__ = ["BlockMover", "KVSpec", "check_kv"]

log = logging.getLogger("pagedkv.vllm")


class KVSpec:
    """The shape of one engine's KV: what a stored block must match to be served."""

    def __init__(self, num_layers: int, kv_heads: int, block_size: int, head_size: int, dtype: torch.dtype):
        self.num_layers, self.kv_heads, self.block_size = num_layers, kv_heads, block_size
        self.head_size, self.dtype = head_size, dtype

    def block_shape(self) -> tuple:
        return (self.kv_heads, self.block_size, 2 * self.head_size)

    def as_dict(self) -> dict:
        return {"num_layers": self.num_layers, "kv_heads": self.kv_heads, "block_size": self.block_size,
                "head_size": self.head_size, "dtype": str(self.dtype).replace("torch.", "")}

    def __eq__(self, other):
        return isinstance(other, KVSpec) and self.as_dict() == other.as_dict()

    def __repr__(self):
        return (f"KVSpec(layers={self.num_layers}, kv_heads={self.kv_heads}, block_size={self.block_size}, "
                f"head_size={self.head_size}, dtype={self.dtype})")


def check_kv(spec: KVSpec, kv: list[torch.Tensor]) -> str | None:
    """Why vLLM's per-layer tensors ``kv`` do not match ``spec`` (None: they do)."""
    want = spec.block_shape()
    if len(kv) != spec.num_layers:
        return f"vLLM registered {len(kv)} KV layers, the store was built for {spec.num_layers}"
    for i, t in enumerate(kv):
        if t.dtype != spec.dtype:
            return f"layer {i}: KV dtype {t.dtype}, expected {spec.dtype}"
        if t.dim() != 4 or tuple(t.shape[1:]) != want:
            return f"layer {i}: KV shape {tuple(t.shape)}, expected [num_blocks, *{want}] (vLLM's CPU layout)"
        if t.device.type != "cpu":
            return f"layer {i}: KV on {t.device}, this connector copies CPU tensors"
    return None


def _spec_of_layout(layout: dict) -> KVSpec:
    """The KV spec a (size-checked) header describes; a field that is missing or of
    another type is a TierFileError."""
    for key in ("num_layers", "kv_heads", "block_size", "head_size"):
        v = layout.get(key)
        if type(v) is not int or not 1 <= v <= 2**31 - 1:
            raise TierFileError(expected(f"shared arena header: {key}", "an int in [1, 2**31)", repr(v)[:80]))
    if layout.get("dtype") not in _DTYPES or not isinstance(layout.get("dtype"), str):
        raise TierFileError(expected("shared arena header: dtype", f"one of {sorted(_DTYPES)}",
                                     repr(layout.get("dtype"))[:80]))
    if not isinstance(layout.get("storage"), str) or layout["storage"] not in STORAGE_FORMATS:
        raise TierFileError(expected("shared arena header: storage", f"one of {STORAGE_FORMATS}",
                                     repr(layout.get("storage"))[:80]))
    seed = layout.get("rotation_seed")
    if seed is not None and (type(seed) is not int or not 0 <= seed < 2**63):
        raise TierFileError(expected("shared arena header: rotation_seed", "None or an int in [0, 2**63)",
                                     repr(seed)[:80]))
    return KVSpec(layout["num_layers"], layout["kv_heads"], layout["block_size"], layout["head_size"],
                  _DTYPES[layout["dtype"]])


def _pairs(pairs: Sequence[tuple[int, int]], src: tuple[str, int], dst: tuple[str, int]):
    """``pairs`` as two int64 index tensors, each value in range and no destination twice;
    checked whole before any copy (a typed error otherwise)."""
    want = f"a sequence of ({src[0]}, {dst[0]}) int pairs"
    if isinstance(pairs, (str, bytes)) or not hasattr(pairs, "__len__"):
        raise ArgumentTypeError(expected("pairs", want, type(pairs).__name__))
    a, b = [], []
    for p in pairs:
        if isinstance(p, (str, bytes)) or not hasattr(p, "__len__") or len(p) != 2:
            raise ArgumentTypeError(expected("pairs", want, repr(p)[:80]))
        for v in p:
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
                raise ArgumentTypeError(expected("pairs", want, f"a {type(v).__name__} in {p!r}"[:120]))
        a.append(int(p[0]))
        b.append(int(p[1]))
    for name, n, vals in ((src[0], src[1], a), (dst[0], dst[1], b)):
        bad = [v for v in vals if not 0 <= v < n]
        if bad:
            raise InvalidArgumentError(expected(f"pairs: {name}", f"ids in [0, {n})", bad[0]))
    if len(set(b)) != len(b):
        raise InvalidArgumentError(expected(f"pairs: {dst[0]}", "each destination once", sorted(b)[:16]))
    return torch.tensor(a, dtype=torch.int64), torch.tensor(b, dtype=torch.int64)


_BYTE_FLOATS = (torch.float8_e4m3fn, torch.float8_e5m2)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """fp8 as bytes: torch's CPU index_copy_/index_select do not take fp8."""
    return t.view(torch.uint8) if t.dtype in _BYTE_FLOATS else t


class BlockMover:
    def __init__(self):
        self.kv: list[torch.Tensor] | None = None
        self.spec: KVSpec | None = None
        self.refused: str | None = None                  # the worker's own KV is unusable
        self._arenas: dict[str, tuple[SharedArena, Codec] | str] = {}   # name -> mapped, or why refused
        # Tests only (the negative control): load each layer's blocks into the next layer.
        # (Reversing whole blocks would not do: attention sums over (K, V) pairs whose
        # positions RoPE already baked in, so a block order is invisible to the suffix.)
        self.debug_shuffle_loads = False

    def register(self, spec: KVSpec, kv: list[torch.Tensor]) -> str | None:
        why = check_kv(spec, kv)
        if why is not None:
            self.refused = why
            log.warning("pagedkv connector: serving nothing: %s", why)
            return why
        self.spec, self.kv = spec, list(kv)
        return None

    def arena(self, name: str) -> tuple[tuple[SharedArena, Codec] | None, str | None, bool]:
        """``(arena and codec, why refused, newly opened)``."""
        got = self._arenas.get(name)
        if isinstance(got, tuple):
            return got, None, False
        if isinstance(got, str):
            return None, got, False
        if self.kv is None or self.spec is None:
            why = self.refused or "the worker has no registered KV"
        else:
            try:
                sa = SharedArena.open(name)
                lay = sa.layout
                theirs = _spec_of_layout(lay)
                if theirs != self.spec:
                    why = f"arena KV shape {theirs} differs from vLLM's {self.spec}"
                else:
                    codec = make_codec(lay["storage"], theirs.kv_heads, theirs.block_size, theirs.head_size,
                                       theirs.dtype, lay.get("rotation_seed") or 0)
                    want = [[str(dt).replace("torch.", ""), list(shape)] for shape, dt in codec.arenas]
                    if want != lay["arenas"]:
                        why = f"arena blocks {lay['arenas']} differ from storage {lay['storage']!r}'s {want}"
                    else:
                        self._arenas[name] = (sa, codec)
                        return (sa, codec), None, True
            except PagedKVError as e:        # everything below raises typed errors (see the module)
                why = f"cannot map the shared arena {str(name)[:80]}: {e}"
        log.warning("pagedkv connector: arena %s refused: %s", name, why)
        self._arenas[name] = why
        return None, why, True

    def save(self, sa: SharedArena, codec: Codec, pairs: Sequence[tuple[int, int]]) -> None:
        """vLLM blocks -> arena slots: ``[(block, slot)]``."""
        kv = self.kv
        if kv is None:
            raise InternalError("pagedkv connector: a copy before the worker registered its KV")
        blocks, slots = _pairs(pairs, ("vLLM block", kv[0].shape[0]), ("slot", sa.layout["capacity"]))
        for layer, t in enumerate(kv):
            for a, part in enumerate(codec.encode(t.index_select(0, blocks))):
                _raw(sa.tensors[a][layer]).index_copy_(0, slots, _raw(part))

    def load(self, sa: SharedArena, codec: Codec, pairs: Sequence[tuple[int, int]]) -> None:
        """Arena slots -> vLLM blocks: ``[(slot, block)]``."""
        kv = self.kv
        if kv is None:
            raise InternalError("pagedkv connector: a copy before the worker registered its KV")
        slots, blocks = _pairs(pairs, ("slot", sa.layout["capacity"]), ("vLLM block", kv[0].shape[0]))
        n = len(kv)
        for layer, t in enumerate(kv):
            src = (layer + 1) % n if self.debug_shuffle_loads else layer
            parts = [_raw(arena[src]).index_select(0, slots).view(arena.dtype) for arena in sa.tensors]
            t.index_copy_(0, blocks, codec.decode(parts))

    def close(self) -> None:
        self._arenas.clear()
        self.kv = None
