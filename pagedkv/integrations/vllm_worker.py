"""BlockMover: the connector's worker side; copies vLLM blocks to and from shared-arena slots.

It never decides anything: the step's metadata names the arena, the ``(slot, block)``
loads and the ``(block, slot)`` saves the scheduler side chose. It maps each arena once
(by name, :class:`.vllm_shm.SharedArena`), builds the arena's codec from its header, and
checks the header's KV shape against the tensors vLLM registered before the first copy;
a mismatch refuses that arena (its loads are reported failed, its saves abandoned).

Under tensor parallelism each worker holds its rank's shard of the KV heads (vLLM
splits them contiguously by rank). An arena block holds every rank's heads, rank 0's
first; a worker reads and writes only its slice, encoded with a codec of its own heads
(each head is quantized on its own, so a shard's bytes are the full block's slice). The
header names the TP size, which must be this engine's.

With vLLM's hybrid allocator (several KV cache groups, e.g. full-attention and
sliding-window layers) each group has its own block table: a stored block then names
one vLLM block per group (a tuple), each layer copies from or to its group's block, and
a load skips a group that holds no block there (``-1``: a sliding window's null block,
outside the window, which attention never reads).

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
from pagedkv.integrations.vllm_layout import LayerBlocks, detect_layout, raw_bytes
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


def check_kv(spec: KVSpec, kv: torch.Tensor | list[torch.Tensor], backend: str | None = None) -> str | None:
    """Why vLLM's tensors ``kv`` (per layer, or one stacked) are not ``spec``'s KV in a
    layout :mod:`.vllm_layout` knows (None: they are)."""
    try:
        detect_layout(kv, spec.num_layers, spec.kv_heads, spec.block_size, spec.head_size, spec.dtype, backend)
    except PagedKVError as e:
        return str(e)
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


def _is_int(v) -> bool:
    return not isinstance(v, (bool, np.bool_)) and isinstance(v, (int, np.integer))


def _pairs(pairs: Sequence[tuple], src: tuple[str, int], dst: tuple[str, int], groups: int | None = None,
           vllm_side: int = 0, absent_ok: bool = False):
    """``pairs`` as two int64 index tensors, each value in range and no destination twice;
    checked whole before any copy (a typed error otherwise). With ``groups`` the vLLM
    side (``vllm_side``: 0 or 1) of each pair is a tuple of one block per group, ``-1``
    for none where ``absent_ok``; its tensor is then ``[n, groups]``."""
    names = (src[0], dst[0])
    want = f"a sequence of ({src[0]}, {dst[0]}) pairs" + (f" ({names[vllm_side]}: {groups} ints)" if groups else "")
    if isinstance(pairs, (str, bytes)) or not hasattr(pairs, "__len__"):
        raise ArgumentTypeError(expected("pairs", want, type(pairs).__name__))
    cols: tuple[list, list] = ([], [])
    for p in pairs:
        if isinstance(p, (str, bytes)) or not hasattr(p, "__len__") or len(p) != 2:
            raise ArgumentTypeError(expected("pairs", want, repr(p)[:80]))
        for side, v in enumerate(p):
            if groups and side == vllm_side:
                ok = not isinstance(v, (str, bytes)) and hasattr(v, "__len__") and len(v) == groups and \
                    all(_is_int(x) for x in v)
                if not ok:
                    raise ArgumentTypeError(expected("pairs", want, f"{v!r} in {p!r}"[:120]))
                cols[side].append([int(x) for x in v])
            elif not _is_int(v):
                raise ArgumentTypeError(expected("pairs", want, f"a {type(v).__name__} in {p!r}"[:120]))
            else:
                cols[side].append(int(v))
    for side, (name, n) in enumerate((src, dst)):
        vals = cols[side]
        flat = [x for v in vals for x in v] if groups and side == vllm_side else vals
        lo = -1 if groups and side == vllm_side and absent_ok else 0
        bad = [v for v in flat if not lo <= v < n]
        if bad:
            raise InvalidArgumentError(expected(f"pairs: {name}", f"ids in [{lo}, {n})", bad[0]))
    b = cols[1]
    per = [[v[g] for v in b if v[g] >= 0] for g in range(groups or 1)] if groups and vllm_side == 1 else [b]
    for ids in per:
        if len(set(ids)) != len(ids):
            raise InvalidArgumentError(expected(f"pairs: {dst[0]}", "each destination once", sorted(ids)[:16]))
    return tuple(torch.tensor(c, dtype=torch.int64).reshape(len(c), groups) if groups and side == vllm_side
                 else torch.tensor(c, dtype=torch.int64) for side, c in enumerate(cols))


class BlockMover:
    def __init__(self):
        self.kv: list[LayerBlocks] | None = None
        self.layout: str | None = None
        self.rank, self.tp_size = 0, 1                   # this worker's tensor-parallel shard
        self.layer_groups: list[int] | None = None       # each layer's KV cache group (hybrid allocator)
        self.num_groups: int | None = None               # then: copies name one vLLM block per group
        self.num_absent_skipped = 0                      # (layer, block) loads whose group held no block
        self.copies = None                               # the connector's LayerCopies, when layer-wise
        self.spec: KVSpec | None = None
        self.refused: str | None = None                  # the worker's own KV is unusable
        self._arenas: dict[str, tuple[SharedArena, Codec] | str] = {}   # name -> mapped, or why refused
        # Tests only (the negative control): load each layer's blocks into the next layer.
        # (Reversing whole blocks would not do: attention sums over (K, V) pairs whose
        # positions RoPE already baked in, so a block order is invisible to the suffix.)
        self.debug_shuffle_loads = False

    def register(self, spec: KVSpec, kv: torch.Tensor | list[torch.Tensor], backend: str | None = None,
                 rank: int = 0, tp_size: int = 1, layer_groups: Sequence[int] | None = None) -> str | None:
        """Take vLLM's KV (per layer, or one stacked tensor) in the layout detected from
        it. Returns why it is refused (None: usable).

        Args:
            spec: this worker's KV shape (its own heads: a shard under tensor parallelism).
            kv: vLLM's KV tensors, one per layer or one stacked over the layers.
            backend: the attention backend's name, which settles an ambiguous shape.
            rank: this worker's tensor-parallel rank, in ``[0, tp_size)``.
            tp_size: the engine's tensor-parallel size (how many shards an arena block holds).
            layer_groups: each layer's KV cache group (vLLM's hybrid allocator, or a
                sliding-window group, whose blocks may be absent); the copies then name one
                vLLM block per group, ``-1`` for none. None: plain block ids.
        """
        if type(tp_size) is not int or not 1 <= tp_size <= 2**16:
            raise InvalidArgumentError(expected("tp_size", "an int in [1, 65536]", repr(tp_size)[:80]))
        if type(rank) is not int or not 0 <= rank < tp_size:
            raise InvalidArgumentError(expected("rank", f"an int in [0, {tp_size})", repr(rank)[:80]))
        if layer_groups is not None:
            lg = list(layer_groups)
            if len(lg) != spec.num_layers or not all(_is_int(g) and 0 <= g < len(lg) for g in lg) or \
                    sorted(set(lg)) != list(range(len(set(lg)))):
                raise InvalidArgumentError(expected("layer_groups", f"{spec.num_layers} group numbers 0..G-1, "
                                                    "each group used", repr(lg)[:80]))
            self.layer_groups, self.num_groups = [int(g) for g in lg], len(set(lg))
        self.rank, self.tp_size = rank, tp_size
        try:
            layers = detect_layout(kv, spec.num_layers, spec.kv_heads, spec.block_size, spec.head_size,
                                   spec.dtype, backend)
        except PagedKVError as e:
            why = str(e)
            self.refused = why
            log.warning("pagedkv connector: serving nothing: %s", why)
            return why
        self.spec, self.kv, self.layout = spec, layers, layers[0].layout
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
                tp = lay.get("tp_size", 1)
                mine = self.full_spec()
                if type(tp) is not int or tp != self.tp_size:
                    why = f"arena tensor-parallel size {str(tp)[:20]} differs from this engine's {self.tp_size}"
                elif theirs != mine:
                    why = f"arena KV shape {theirs} differs from vLLM's {mine}"
                else:
                    seed = lay.get("rotation_seed") or 0
                    codec = make_codec(lay["storage"], theirs.kv_heads, theirs.block_size, theirs.head_size,
                                       theirs.dtype, seed)
                    want = [[str(dt).replace("torch.", ""), list(shape)] for shape, dt in codec.arenas]
                    if want != lay["arenas"]:
                        why = f"arena blocks {lay['arenas']} differ from storage {lay['storage']!r}'s {want}"
                    else:
                        if self.tp_size > 1:        # this rank's heads: a codec of its shard
                            codec = make_codec(lay["storage"], self.spec.kv_heads, theirs.block_size,
                                               theirs.head_size, theirs.dtype, seed)
                        self._arenas[name] = (sa, codec)
                        return (sa, codec), None, True
            except PagedKVError as e:        # everything below raises typed errors (see the module)
                why = f"cannot map the shared arena {str(name)[:80]}: {e}"
        log.warning("pagedkv connector: arena %s refused: %s", name, why)
        self._arenas[name] = why
        return None, why, True

    def full_spec(self) -> KVSpec | None:
        """The KV shape of an arena block: every rank's heads (this worker's spec when TP is 1)."""
        sp = self.spec
        if sp is None or self.tp_size == 1:
            return sp
        return KVSpec(sp.num_layers, sp.kv_heads * self.tp_size, sp.block_size, sp.head_size, sp.dtype)

    def _shard(self, arena_layer: torch.Tensor, codec: Codec, a: int) -> torch.Tensor:
        """This rank's heads of one arena's ``[capacity, *shape]`` layer (a view)."""
        if self.tp_size == 1:
            return arena_layer
        h = codec.h
        return arena_layer.narrow(1 + codec.head_axes[a], self.rank * h, h)

    def _kv(self) -> list[LayerBlocks]:
        if self.kv is None:
            raise InternalError("pagedkv connector: a copy before the worker registered its KV")
        return self.kv

    def save_pairs(self, sa: SharedArena, pairs: Sequence[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """``[(block, slot)]`` checked whole: ``(blocks, slots)`` index tensors."""
        return _pairs(pairs, ("vLLM block", self._kv()[0].num_blocks), ("slot", sa.layout["capacity"]),
                      self.num_groups, vllm_side=0)

    def load_pairs(self, sa: SharedArena, pairs: Sequence[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """``[(slot, block)]`` checked whole: ``(slots, blocks)`` index tensors."""
        return _pairs(pairs, ("slot", sa.layout["capacity"]), ("vLLM block", self._kv()[0].num_blocks),
                      self.num_groups, vllm_side=1, absent_ok=True)

    def _group_ids(self, layer: int, blocks: torch.Tensor) -> torch.Tensor:
        """This layer's column of per-group block ids (the ids themselves with one group)."""
        if blocks.dim() == 1:
            return blocks
        return blocks[:, self.layer_groups[layer] if self.layer_groups is not None else 0]

    def save_layer(self, sa: SharedArena, codec: Codec, layer: int, blocks: torch.Tensor, slots: torch.Tensor) -> None:
        """One layer's vLLM blocks -> arena slots (indices from :meth:`save_pairs`)."""
        for a, part in enumerate(codec.encode(self._kv()[layer].gather(self._group_ids(layer, blocks)))):
            raw_bytes(self._shard(sa.tensors[a][layer], codec, a)).index_copy_(0, slots, raw_bytes(part))

    def load_layer(self, sa: SharedArena, codec: Codec, layer: int, slots: torch.Tensor, blocks: torch.Tensor) -> None:
        """Arena slots -> one layer's vLLM blocks (indices from :meth:`load_pairs`)."""
        kv = self._kv()
        blocks = self._group_ids(layer, blocks)
        held = blocks >= 0                   # -1: this layer's group holds no block there
        if not bool(held.all()):
            self.num_absent_skipped += int(held.numel() - held.sum())
            slots, blocks = slots[held], blocks[held]
            if blocks.numel() == 0:
                return
        src = (layer + 1) % len(kv) if self.debug_shuffle_loads else layer
        parts = [raw_bytes(self._shard(arena[src], codec, a)).index_select(0, slots).view(arena.dtype)
                 for a, arena in enumerate(sa.tensors)]
        kv[layer].scatter(blocks, codec.decode(parts))

    def save(self, sa: SharedArena, codec: Codec, pairs: Sequence[tuple[int, int]]) -> None:
        """vLLM blocks -> arena slots: ``[(block, slot)]``, every layer."""
        blocks, slots = self.save_pairs(sa, pairs)
        for layer in range(len(self._kv())):
            self.save_layer(sa, codec, layer, blocks, slots)

    def load(self, sa: SharedArena, codec: Codec, pairs: Sequence[tuple[int, int]]) -> None:
        """Arena slots -> vLLM blocks: ``[(slot, block)]``, every layer."""
        slots, blocks = self.load_pairs(sa, pairs)
        for layer in range(len(self._kv())):
            self.load_layer(sa, codec, layer, slots, blocks)

    def close(self) -> None:
        self._arenas.clear()
        self.kv = None
