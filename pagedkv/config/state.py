"""What recurrent-state layers add to a config (see :class:`pagedkv.groups.spec.RecurrentStateSpec`).

A hybrid model's layers are of four kinds (``CacheConfig.layer_kinds``, one per model
layer): ``"attention"`` (K/V rows, a layer of the KV store), ``"state"`` (a recurrent
state: Mamba, Mamba2, Gated DeltaNet, a short convolution), ``"hybrid"`` (both in one
layer: Falcon-H1, Zamba2's shared-attention layers) and ``"none"`` (an MLP or MoE
layer that caches nothing). The KV store holds the attention layers only, in model
order: KV layer ``i`` is the ``i``-th layer with attention (``kv_layer_of``), and state
layer ``j`` the ``j``-th layer with a state (``state_layer_of``).

Every state layer holds the same ``state_tensors`` (name, shape for one sequence,
dtype). The states live in ``state_slots`` slots (or as many as ``state_memory_budget``
bytes hold), each one sequence's state in every state layer: the live state of each
running sequence, and the snapshots kept for prefix hits.
"""
from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

from pagedkv.config.values import parse_bytes
from pagedkv.errors import ArgumentTypeError, InvalidArgumentError, expected
from pagedkv.format import dtypes
from pagedkv.groups.spec import RecurrentStateSpec, StateTensor

__all__ = ["LAYER_KINDS", "validate_state", "kv_layers", "state_layers"]

#: the kinds a model layer may be (``CacheConfig.layer_kinds``)
LAYER_KINDS = ("attention", "state", "hybrid", "none")
_KV = ("attention", "hybrid")
_STATE = ("state", "hybrid")
#: checkpoint interval when none is given, in attention blocks
DEFAULT_CHECKPOINT_EVERY = 16


def kv_layers(kinds: Sequence[str]) -> tuple[int, ...]:
    """Model layers with K/V rows, in order (KV layer i is the i-th)."""
    return tuple(i for i, k in enumerate(kinds) if k in _KV)


def state_layers(kinds: Sequence[str]) -> tuple[int, ...]:
    """Model layers with a recurrent state, in order (state layer j is the j-th)."""
    return tuple(i for i, k in enumerate(kinds) if k in _STATE)


def _tensor(entry: Any, i: int) -> StateTensor:
    if isinstance(entry, StateTensor):
        name, shape, dt = entry.name, entry.shape, entry.dtype
    elif isinstance(entry, Sequence) and not isinstance(entry, (str, bytes)) and len(entry) in (2, 3):
        name, shape = entry[0], entry[1]
        dt = entry[2] if len(entry) == 3 else "float32"
    else:
        raise ArgumentTypeError(expected("state_tensors", "(name, shape[, dtype]) entries or StateTensor",
                                         f"{entry!r} at index {i}"))
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError(expected("state_tensors", "a non-empty name per tensor", f"{name!r} at index {i}"))
    if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence) or not shape or any(
            isinstance(d, bool) or not isinstance(d, numbers.Integral) or d < 1 for d in shape):
        raise InvalidArgumentError(expected("state_tensors", "a shape of ints >= 1 per tensor",
                                            f"{shape!r} for {name!r}"))
    row = dtypes.lookup(dt)
    if row is None or row.quantized:
        raise InvalidArgumentError(expected("state_tensors", "a model dtype (float32, bfloat16, float16) per tensor",
                                            f"{dt!r} for {name!r}"))
    return StateTensor(name, tuple(int(d) for d in shape), row.name)


def _kinds(cfg: Any) -> tuple[str, ...] | None:
    kinds = cfg.layer_kinds
    if kinds is None:
        return None
    if isinstance(kinds, (str, bytes)) or not isinstance(kinds, Sequence) or not kinds:
        raise ArgumentTypeError(expected("layer_kinds", "one kind per model layer (a list)", repr(kinds)))
    for i, k in enumerate(kinds):
        if k not in LAYER_KINDS:
            raise InvalidArgumentError(expected("layer_kinds", "'" + "', '".join(LAYER_KINDS) + "' entries",
                                                f"{k!r} at index {i}"))
    return tuple(kinds)


def validate_state(cfg: Any, put) -> tuple[RecurrentStateSpec | None, int]:
    """Check and complete the state fields of ``cfg``: the state group's spec (None for
    a model without recurrent-state layers) and the state slots the budget gives."""
    kinds = _kinds(cfg)
    put("layer_kinds", kinds)
    tensors = tuple(_tensor(t, i) for i, t in enumerate(cfg.state_tensors or ()))
    put("state_tensors", tensors)
    every = cfg.state_checkpoint_every
    if isinstance(every, bool) or not isinstance(every, numbers.Integral) or every < 1:
        raise InvalidArgumentError(expected("state_checkpoint_every", "an int >= 1 (blocks)", repr(every)))
    kv = kv_layers(kinds) if kinds is not None else None
    if kv is not None and len(kv) != cfg.num_layers:
        raise InvalidArgumentError(expected("num_layers", f"the {len(kv)} layers with attention in layer_kinds "
                                            "(the KV store holds those)", cfg.num_layers))
    layers = state_layers(kinds) if kinds is not None else ()
    if bool(layers) != bool(tensors):
        raise InvalidArgumentError(expected(
            "state_tensors", "tensors exactly when layer_kinds has 'state' or 'hybrid' layers",
            f"{len(tensors)} tensors for {len(layers)} state layers"))
    slots, budget = cfg.state_slots, cfg.state_memory_budget
    if not layers:
        if slots is not None or budget is not None:
            raise InvalidArgumentError(expected("state_slots", "None without recurrent-state layers",
                                                f"state_slots={slots!r}, state_memory_budget={budget!r}"))
        return None, 0
    spec = RecurrentStateSpec(0, layers, block_size=cfg.block_size, tensors=tensors,
                              checkpoint_every=int(every))
    if (slots is None) == (budget is None):
        raise InvalidArgumentError(expected(
            "state_slots", "exactly one of state_slots or state_memory_budget with recurrent-state layers",
            "both" if slots is not None else "neither"))
    if slots is not None:
        if isinstance(slots, bool) or not isinstance(slots, numbers.Integral) or slots < 1:
            raise InvalidArgumentError(expected("state_slots", "an int >= 1", repr(slots)))
        put("state_slots", int(slots))
        return spec, int(slots)

    b = parse_bytes(budget, "state_memory_budget")
    n = b // spec.slot_bytes()
    if n < 1:
        raise InvalidArgumentError(expected("state_memory_budget", f"at least one state slot "
                                            f"({spec.slot_bytes()} bytes)", f"{b} bytes"))
    put("state_memory_budget", b)
    return spec, int(n)
