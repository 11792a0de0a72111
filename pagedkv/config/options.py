"""CacheConfig: the model shape, block geometry, dtypes and options of one KV cache.

torch is optional here (the bookkeeping core needs only numpy): dtypes are held as
canonical names (``"float16"``, ``"fp8_e4m3"``, ...), and torch is imported only when a
torch dtype is passed in or asked for (:attr:`CacheConfig.torch_dtype`).
"""
from __future__ import annotations

import json
import numbers
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from pagedkv.config import support
from pagedkv.config.gguf import GGUF_MAGIC, hf_fields_from_gguf, open_regular, read_gguf_metadata
from pagedkv.config.remote import RemoteTierConfig
from pagedkv.config.specs import build_specs, mla_from_hf, validate_mla
from pagedkv.config.state import validate_state
from pagedkv.config.state_hf import state_from_hf
from pagedkv.config.values import INT64_MAX, parse_bytes, show
from pagedkv.errors import ArgumentTypeError, DTypeError, InvalidArgumentError, expected
from pagedkv.format import dtypes
from pagedkv.format.layer_format import key_spare_bits
from pagedkv.groups.layers import GroupPlan, layer_windows_from_hf, plan_groups
from pagedkv.groups.spec import KVSpec, RecurrentStateSpec

__all__ = [
    "CacheConfig",
    "MODEL_DTYPE_NAMES",
    "KV_DTYPE_NAMES",
    "EVICTION_POLICIES",
    "parse_bytes",
    "format_bytes",
    "dtype_name",
    "kv_dtype_name",
    "TIER_EVICTION_POLICIES",
    "TIER_WRITE_POLICIES",
]

#: canonical model dtype name -> bytes per element
MODEL_DTYPE_NAMES: dict[str, int] = {d.name: d.itemsize for d in dtypes.MODEL}
#: canonical quantized kv dtype name -> bytes per element
KV_DTYPE_NAMES: dict[str, float] = {d.name: d.element_bytes for d in dtypes.QUANTIZED}
#: default recent window (tokens kept in model precision) per quantized kv dtype
DEFAULT_KV_WINDOW: dict[str, int] = {"int4": 128, "int3": 128, "int2": 128}
#: Leading tokens of each sequence kept in model precision, by kv_dtype (see ``kv_sink_tokens``).
DEFAULT_KV_SINK: dict[str, int] = {"int4": 4, "int3": 4, "int2": 4}
#: ``kv_key_quant`` when none is given, by kv_dtype ("token" otherwise): int2 keys go per
#: channel over each block (KIVI-2; per-token 2-bit keys lose most of the signal)
DEFAULT_KEY_QUANT: dict[str, str] = {"int2": "block"}
#: ``kv_key_quant`` values: keys quantized per token (as values), or per channel over each full block.
KEY_QUANT_MODES = ("token", "block")
#: int4 group size along head_dim when none is given (chosen by measurement; README)
DEFAULT_INT4_GROUP = 64
#: int3 group size along head_dim when none is given and it divides head_dim (else the
#: largest multiple of 8 below it that does; README)
DEFAULT_INT3_GROUP = 32
EVICTION_POLICIES = ("lru", "priority", "adaptive", "frequency")
#: eviction policies of the host and disk prefix tiers
TIER_EVICTION_POLICIES = ("lru", "frequency")
#: when a prefix tier receives a block: on device eviction ("back") or on registration too ("through")
TIER_WRITE_POLICIES = ("back", "through")
LAYOUTS = ("NHD", "HND")


def format_bytes(n: int) -> str:
    """Human-readable binary size, e.g. ``'4.00 GiB'``."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def _short(row: dtypes.DTypeInfo) -> str:
    return row.name + (f"/{row.aliases[0]}" if row.aliases else "")


def _choices(rows) -> str:
    """``"float32/fp32, float16/fp16 or bfloat16/bf16"``: each name with its short alias."""
    names = [_short(d) for d in rows]
    return ", ".join(names[:-1]) + " or " + names[-1]


def dtype_name(value: Any, name: str = "dtype") -> str:
    """Canonical model dtype name of a torch dtype or alias string."""
    row = dtypes.lookup(value)
    if row is None or row.quantized:
        raise DTypeError(expected(name, _choices(dtypes.MODEL), repr(value)))
    return row.name


def kv_dtype_name(value: Any, dtype: str, name: str = "kv_dtype") -> str | None:
    """Canonical kv dtype: None when it equals the model dtype, else a quantized name."""
    if value is None:
        return None
    row = dtypes.lookup(value)
    if row is not None and row.name == dtype:
        return None
    if row is None or not row.quantized:
        quant = ", ".join(_short(d) for d in dtypes.QUANTIZED)
        raise DTypeError(expected(name, f"None, the model dtype ({dtype}), or one of {quant}", repr(value)))
    return row.name


def _check_int(name: str, value: Any, minimum: int, maximum: int = INT64_MAX) -> int:
    """An int (not a bool) in ``[minimum, maximum]`` (default: below 2**63): a wrong
    type is an ArgumentTypeError (a TypeError, as the core says), a value out of range
    an InvalidArgumentError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError(expected(name, f"an int >= {minimum}", show(value)))
    if int(value) < minimum:
        raise InvalidArgumentError(expected(name, f"an int >= {minimum}", show(value)))
    if int(value) > maximum:
        top = "2**63)" if maximum == INT64_MAX else f"{maximum}]"
        raise InvalidArgumentError(expected(name, f"an int in [{minimum}, {top}", show(value)))
    return int(value)


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ArgumentTypeError(expected(name, "True or False", show(value)))
    return value


def _device_name(value: Any) -> str:
    text = str(value) if type(value).__name__ == "device" else value
    if not isinstance(text, str) or not re.fullmatch(r"cpu|cuda(:[0-9]+)?", text):
        raise InvalidArgumentError(expected("device", "'cpu', 'cuda' or 'cuda:N'", repr(value)))
    return text


@dataclass(frozen=True)
class CacheConfig:
    """Everything needed to size and allocate one paged KV cache.

    Exactly one of ``num_blocks`` and ``memory_budget`` is given. A budget (bytes, or a
    string like ``"4GiB"``) counts the device arena: data plus, for quantized
    ``kv_dtype``, the scale (and zero-point) arenas and the window arena.

    After validation, ``dtype`` holds a canonical name (``"float16"``), ``kv_dtype`` is
    ``None`` (store in ``dtype``) or a quantized name (``"fp8_e4m3"``, ``"fp8_e5m2"``,
    ``"int8"``, ``"int4"``, ``"int3"``), ``memory_budget`` is an int and ``device`` a string.

    Low-bit options (quantized ``kv_dtype`` only; see README "Low-bit KV"):

    - ``kv_group_size``: int4/int3 elements per scale/zero group along ``head_dim``
      (int4: default the largest divisor of ``head_dim`` up to 64 that is a multiple of
      8, or even where ``head_dim`` is no multiple of 8: 64 for 128, 24 for 72, 40 for
      80, 48 for 96, 56 for 112, ``head_dim`` itself up to 64; int3: a multiple of 8, default 32 or
      the largest multiple of 8 below it that divides ``head_dim``, which int3 needs to
      be a multiple of 8; int2: a multiple of 4, default as int4's).
    - ``kv_rotation``: store K/V rotated by a randomized Hadamard transform of
      ``head_dim`` (fixed per cache by ``kv_rotation_seed``; undone on read). Default:
      on for int4/int3, off for fp8/int8/int2.
    - ``kv_window``: the newest ``kv_window`` tokens of each sequence are read back in
      model precision (default 128 for int4/int3/int2, 0 otherwise), from a window arena that
      holds ``kv_window_sequences`` sequences' windows (least recently written blocks
      give way first). Its bytes count in ``total_bytes`` and the budget. A reader
      that holds its pass's tokens in flight (``gather_pages(pending=)``, as
      ``PagedCache`` does) gets the ``kv_window`` tokens before the pass exact.
    - ``kv_sink_tokens``: the first ``kv_sink_tokens`` tokens of each sequence are read
      back in model precision too (default 4 for int4/int3/int2, 0 otherwise). Attention
      sinks, the first tokens most heads attend to heavily, carry an outsized share of
      the error a low-bit cache makes (StreamingLLM, IntactKV, KVQuant). Their blocks are
      pinned in the window arena, which gets ``ceil(kv_sink_tokens / block_size)`` more
      blocks per ``kv_window_sequences``; past that many sequences, the least recently
      pinned lose their exact copies and read back quantized.
    - ``kv_key_quant``: int4 and int2: ``"token"`` (int4's default: keys quantized per
      token, as values) or ``"block"`` (int2's default, KIVI-2's keys): once a block's ``block_size`` keys are all written, they
      are requantized per channel over the block (KIVI's per-channel keys, aligned to
      blocks; :func:`pagedkv.format.quant.quantize_key_block`), from the model-precision
      copies the window arena holds. A block that never fills, or whose copies left the
      window arena first (more than ``kv_window_sequences`` sequences writing at once),
      keeps its per-token keys. The window arena exists even with ``kv_window=0``.
      Costs ``32 / block_size`` bits per key element for the bfloat16 parameters.
    - ``kv_key_bits``: with int4 and ``kv_key_quant="block"``, the code width of a sealed
      block's keys: 4, or 5, 6 or 8 where the K rows' per-token parameters (a float32 scale and
      zero per group, which a sealed row no longer needs) hold the high bits: at most
      ``4 + 64 // kv_group_size`` (rounded down to 5, 6 or 8). Default: the most they hold
      (5 for groups of 64): twice the precision for no byte more. 4 (no widening) for token
      keys and for every other kv_dtype: int2's sealed keys stay 2-bit codes, and any other
      value is an ``InvalidArgumentError`` naming int4.
    - ``kv_full_precision_layers``: layer indices (negative counts from the end) kept
      in model precision (no scales, no window), or in ``kv_full_precision_dtype``.
    - ``kv_full_precision_dtype``: None (the model dtype) or ``"int8"``: the
      ``kv_full_precision_layers`` are then stored in int8 (per-token scale and zero point,
      no rotation, no window: 9 bits per element), which loses about 1/30 of what int4
      loses, for a quarter of a float32 layer's bytes.

    Tensor parallelism: ``num_kv_heads`` is the model's KV head count; a rank
    (``tp_rank`` of ``tp_size``) stores :attr:`kv_heads_per_rank` of them
    (:attr:`kv_head_indices`), replicating heads when there are fewer than ranks, as
    vLLM does. All sizes (arena shapes, bytes per block, budgets) are per rank.

    Prefix tiers below the device (see :mod:`pagedkv.tiers`): ``prefix_host_blocks``
    blocks in host memory, ``prefix_disk_blocks`` blocks in a file-backed arena under
    ``prefix_disk_dir`` (reused across restarts when ``prefix_disk_tag``, the model
    shape and the settings match); ``prefix_tier_write`` is ``"back"`` (copy a block
    down when the device evicts it) or ``"through"`` (also when it is registered);
    ``prefix_tier_eviction`` is ``"lru"`` or ``"frequency"``; ``prefix_remote`` (a URL or a
    :class:`~pagedkv.config.remote.RemoteTierConfig`) adds a Redis / Redis Cluster tier
    that several hosts share, below the others. ``prefix_disk_tag`` names the weights for
    both persistent tiers.

    Sliding-window layers (see :mod:`pagedkv.groups.layers`): ``layer_windows`` gives
    each layer's window in tokens (0 = full attention; ``from_hf_config`` reads it from
    the model), ``attention_sinks`` the leading tokens every sliding layer keeps. Layers
    then form groups, a block holds :attr:`arena_layers` layer slots of one group, and
    all sizes count those slots.

    Recurrent-state layers (Mamba2, Gated DeltaNet, ...; see :mod:`pagedkv.config.state`):
    ``layer_kinds`` gives each model layer's kind (``"attention"``, ``"state"``,
    ``"hybrid"``, ``"none"``); ``num_layers`` then counts the layers with attention (the KV
    store's layers; 0 for a model without any, which then needs ``num_blocks``: its
    blocks only track tokens). Each state layer holds ``state_tensors`` (name, shape,
    dtype) per sequence, in ``state_slots`` slots (or as many as
    ``state_memory_budget`` holds), apart from the blocks; a snapshot is taken every
    ``state_checkpoint_every`` blocks (see :mod:`pagedkv.state`).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_attention_heads: int | None = None
    block_size: int = 16
    num_blocks: int | None = None
    memory_budget: int | str | None = None
    dtype: Any = "float16"
    kv_dtype: Any = None
    device: Any = "cpu"
    layout: str = "NHD"
    # bookkeeping options (semantics live in the manager and the core)
    enable_prefix_caching: bool = True
    eviction: str = "lru"
    priority_classes: int = 3
    low_watermark: float = 0.05
    high_watermark: float = 0.15
    hash_seed: int | None = None
    host_num_blocks: int = 0
    shuffle_free_blocks: int | None = None
    enable_kv_events: bool = False
    kv_group_size: int | None = None
    kv_rotation: bool | None = None
    kv_rotation_seed: int = 0
    kv_window: int | None = None
    kv_window_sequences: int = 16
    kv_sink_tokens: int | None = None
    kv_key_quant: str | None = None
    kv_key_bits: int | None = None
    kv_full_precision_layers: tuple[int, ...] = ()
    kv_full_precision_dtype: str | None = None
    tp_size: int = 1
    tp_rank: int = 0
    prefix_host_blocks: int = 0
    prefix_disk_dir: str | None = None
    prefix_disk_blocks: int = 0
    prefix_disk_tag: str = ""
    prefix_tier_write: str = "back"
    prefix_tier_eviction: str = "lru"
    prefix_remote: Any = None
    layer_windows: tuple[int, ...] | None = None
    attention_sinks: int = 0
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    layer_kinds: tuple[str, ...] | None = None
    state_tensors: tuple = ()
    state_slots: int | None = None
    state_memory_budget: int | str | None = None
    state_checkpoint_every: int = 16
    _state: RecurrentStateSpec | None = field(default=None, init=False, repr=False, compare=False)
    _state_slots: int = field(default=0, init=False, repr=False, compare=False)
    _groups: GroupPlan | None = field(default=None, init=False, repr=False, compare=False)
    _specs: tuple[KVSpec, ...] = field(default=(), init=False, repr=False, compare=False)
    _resolved_blocks: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        put = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        # a model without attention layers (pure Mamba) has no KV layer: its blocks track tokens
        put("num_layers", _check_int("num_layers", self.num_layers, 0 if self.layer_kinds is not None else 1))
        put("num_kv_heads", _check_int("num_kv_heads", self.num_kv_heads, 1))
        put("head_dim", _check_int("head_dim", self.head_dim, 1))
        self._validate_tp(put)
        if self.num_attention_heads is not None:
            nh = _check_int("num_attention_heads", self.num_attention_heads, 1)
            if nh % self.num_kv_heads:
                raise InvalidArgumentError(
                    expected("num_attention_heads", f"a multiple of num_kv_heads ({self.num_kv_heads})", nh)
                )
            put("num_attention_heads", nh)
        put("block_size", _check_int("block_size", self.block_size, 1))
        put("dtype", dtype_name(self.dtype))
        put("kv_dtype", kv_dtype_name(self.kv_dtype, self.dtype))
        put("device", _device_name(self.device))
        if self.layout not in LAYOUTS:
            raise InvalidArgumentError(expected("layout", "'NHD' or 'HND'", repr(self.layout)))
        self._validate_options(put)
        self._validate_lowbit(put)
        self._validate_groups(put)
        state, slots = validate_state(self, put)
        put("_state", state)
        put("_state_slots", slots)
        put("_specs", build_specs(self))
        if self._groups is not None:       # the plan's groups are the placed specs: one truth
            put("_groups", GroupPlan(self._specs, self._groups.layer_group, self._groups.layer_slot))
        if (self.num_blocks is None) == (self.memory_budget is None):
            raise InvalidArgumentError(
                expected(
                    "num_blocks",
                    "exactly one of num_blocks or memory_budget",
                    "both" if self.num_blocks is not None else "neither",
                )
            )
        if self.num_blocks is not None:
            put("num_blocks", _check_int("num_blocks", self.num_blocks, 1))
            put("_resolved_blocks", self.num_blocks)
        elif self.memory_budget is not None:     # always, by the exactly-one check above
            if self.num_layers == 0:
                raise InvalidArgumentError(expected("memory_budget", "None without attention layers (blocks hold "
                                                    "no KV: give num_blocks; state_slots sizes the states)",
                                                    self.memory_budget))
            budget = parse_bytes(self.memory_budget)
            put("memory_budget", budget)
            blocks = (budget - self.window_bytes) // self.bytes_per_block
            if blocks < 1:
                raise InvalidArgumentError(
                    expected(
                        "memory_budget",
                        f"at least one block ({self.bytes_per_block} bytes)"
                        + (f" plus the window arena ({self.window_bytes} bytes)" if self.window_bytes else ""),
                        f"{budget} bytes",
                    )
                )
            put("_resolved_blocks", blocks)

    def _validate_groups(self, put) -> None:
        _check_int("attention_sinks", self.attention_sinks, 0)
        if self.layer_windows is None:
            support.require(support.ATTENTION_SINKS, self)
            return
        windows = _layer_windows(self.layer_windows, self.num_layers)
        plan = plan_groups(list(windows), self.attention_sinks)
        put("layer_windows", tuple(windows) if plan is not None else None)
        put("_groups", plan)
        if plan is not None and self.quantized and not self.quantized_slots:
            raise InvalidArgumentError(expected("kv_full_precision_layers", "at least one quantized layer slot "
                                                "(with layer groups a slot holds one layer of each group; use "
                                                "kv_dtype=None for none)", list(self.kv_full_precision_layers)))

    @property
    def kv_specs(self) -> tuple[KVSpec, ...]:
        """One spec per layer group (:mod:`pagedkv.groups.spec`): its attention type, block
        geometry and format; every size below derives from it."""
        return self._specs

    @property
    def layer_groups(self) -> GroupPlan | None:
        """The layer groups, or None when every layer is full attention."""
        return self._groups

    @property
    def state_spec(self) -> RecurrentStateSpec | None:
        """The recurrent-state group's spec (its layers are model layer indices), or None
        for a model without recurrent-state layers."""
        return self._state

    @property
    def resolved_state_slots(self) -> int:
        """State slots (``state_slots``, or what ``state_memory_budget`` holds); 0 without
        state layers."""
        return self._state_slots

    @property
    def state_bytes(self) -> int:
        """Bytes of the state arena (every slot, every state layer)."""
        return 0 if self._state is None else self._state_slots * self._state.slot_bytes()

    def kv_layer_of(self, model_layer: int) -> int | None:
        """The KV layer of a model layer (its index among the layers with attention), or
        None for a layer without K/V rows. Without ``layer_kinds`` every layer is one."""
        if self.layer_kinds is None:
            return model_layer if 0 <= model_layer < self.num_layers else None
        if not 0 <= model_layer < len(self.layer_kinds) or self.layer_kinds[model_layer] not in ("attention", "hybrid"):
            return None
        return sum(1 for k in self.layer_kinds[:model_layer] if k in ("attention", "hybrid"))

    def state_layer_of(self, model_layer: int) -> int | None:
        """The state layer of a model layer (its index among the layers with a recurrent
        state), or None for a layer without one."""
        if self._state is None or model_layer not in self._state.layers:
            return None
        return self._state.layers.index(model_layer)

    @property
    def arena_layers(self) -> int:
        """Layer slots per block: ``num_layers``, or the layer-group size with sliding layers."""
        return self.num_layers if self._groups is None else self._groups.slots_per_block

    def _validate_tp(self, put) -> None:
        size = _check_int("tp_size", self.tp_size, 1)
        put("tp_size", size)
        rank = _check_int("tp_rank", self.tp_rank, 0)
        if rank >= size:
            raise InvalidArgumentError(expected("tp_rank", f"an int in [0, {size})", rank))
        put("tp_rank", rank)
        heads = self.num_kv_heads
        if heads % size and size % heads:
            raise InvalidArgumentError(expected(
                "tp_size", f"a divisor or a multiple of num_kv_heads ({heads})", size))

    def _validate_tiers(self, put) -> None:
        put("prefix_host_blocks", _check_int("prefix_host_blocks", self.prefix_host_blocks, 0))
        put("prefix_disk_blocks", _check_int("prefix_disk_blocks", self.prefix_disk_blocks, 0))
        if self.prefix_disk_dir is not None:
            if not isinstance(self.prefix_disk_dir, (str, os.PathLike)):
                raise ArgumentTypeError(expected("prefix_disk_dir", "None or a directory path",
                                                 type(self.prefix_disk_dir).__name__))
            path = os.fspath(self.prefix_disk_dir)
            if not isinstance(path, str) or "\0" in path:
                raise InvalidArgumentError(expected("prefix_disk_dir", "a directory path (a str without NUL bytes)",
                                                    show(path)))
            put("prefix_disk_dir", path)
        if (self.prefix_disk_dir is None) != (self.prefix_disk_blocks == 0):
            raise InvalidArgumentError(expected(
                "prefix_disk_dir", "a directory together with prefix_disk_blocks > 0 (or neither)",
                f"prefix_disk_dir={self.prefix_disk_dir!r}, prefix_disk_blocks={self.prefix_disk_blocks}"))
        if not isinstance(self.prefix_disk_tag, str):
            raise InvalidArgumentError(expected("prefix_disk_tag", "a str", type(self.prefix_disk_tag).__name__))
        if self.prefix_tier_write not in TIER_WRITE_POLICIES:
            raise InvalidArgumentError(expected("prefix_tier_write", "'back' or 'through'",
                                                repr(self.prefix_tier_write)))
        if self.prefix_tier_eviction not in TIER_EVICTION_POLICIES:
            raise InvalidArgumentError(expected("prefix_tier_eviction", "'lru' or 'frequency'",
                                                repr(self.prefix_tier_eviction)))
        put("prefix_remote", RemoteTierConfig.of(self.prefix_remote))
        support.require(support.PREFIX_TIERS, self)

    def _validate_options(self, put) -> None:
        put("enable_prefix_caching", _check_bool("enable_prefix_caching", self.enable_prefix_caching))
        put("enable_kv_events", _check_bool("enable_kv_events", self.enable_kv_events))
        if self.eviction not in EVICTION_POLICIES:
            raise InvalidArgumentError(expected("eviction", "one of " + ", ".join(EVICTION_POLICIES), repr(self.eviction)))
        put("priority_classes", _check_int("priority_classes", self.priority_classes, 1))
        for name in ("low_watermark", "high_watermark"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise ArgumentTypeError(expected(name, "a fraction in [0, 1]", show(v)))
            if not 0.0 <= float(v) <= 1.0:
                raise InvalidArgumentError(expected(name, "a fraction in [0, 1]", show(v)))
            put(name, float(v))
        if self.low_watermark > self.high_watermark:
            raise InvalidArgumentError(
                expected("low_watermark", f"<= high_watermark ({self.high_watermark})", self.low_watermark)
            )
        if self.hash_seed is not None:
            seed = _check_int("hash_seed", self.hash_seed, 0, 2**64)
            if seed >= 2**64:
                raise InvalidArgumentError(expected("hash_seed", "an int in [0, 2**64)", show(seed)))
            put("hash_seed", seed)
        put("host_num_blocks", _check_int("host_num_blocks", self.host_num_blocks, 0))
        if self.shuffle_free_blocks is not None:
            put("shuffle_free_blocks", _check_int("shuffle_free_blocks", self.shuffle_free_blocks, 0))
        # Every rank must take the same prefix decisions; a per-process hash root
        # could (on a 64-bit collision) differ between ranks.
        support.require(support.TP_PREFIX, self)
        self._validate_tiers(put)

    def _validate_lowbit(self, put) -> None:
        q = self.kv_dtype
        put("kv_window_sequences", _check_int("kv_window_sequences", self.kv_window_sequences, 1))
        for name, low in (("kv_group_size", 1), ("kv_window", 0), ("kv_sink_tokens", 0)):
            if getattr(self, name) is not None:   # a wrong type first, whatever kv_dtype
                _check_int(name, getattr(self, name), low)
        if self.kv_lora_rank is not None or self.qk_rope_head_dim is not None:
            _check_int("kv_rotation_seed", self.kv_rotation_seed, 0)
            validate_mla(self, put)      # latent rows: their own formats and options
            return
        if q is None:
            if not isinstance(self.kv_rotation, (bool, type(None))):
                _check_bool("kv_rotation", self.kv_rotation)
            _check_int("kv_rotation_seed", self.kv_rotation_seed, 0)
            support.require(support.LOW_BIT, self)
            put("kv_rotation", False)
            put("kv_window", 0)
            put("kv_sink_tokens", 0)
            put("kv_key_quant", "token")
            put("kv_key_bits", 4)
            put("kv_full_precision_layers", ())
            return
        kq = DEFAULT_KEY_QUANT.get(q, "token") if self.kv_key_quant is None else self.kv_key_quant
        if kq not in KEY_QUANT_MODES:
            raise InvalidArgumentError(expected("kv_key_quant", "'token' or 'block'", repr(kq)))
        support.require(support.BLOCK_KEYS, self)
        put("kv_key_quant", kq)
        if q == "int4":
            if self.head_dim % 2:
                raise InvalidArgumentError(expected("head_dim", "an even head_dim for int4 (two codes per byte)",
                                                    self.head_dim))
            g = dtypes.default_int4_group(self.head_dim) if self.kv_group_size is None else self.kv_group_size
            g = _check_int("kv_group_size", g, 1)
            if self.head_dim % g:
                raise InvalidArgumentError(expected("kv_group_size", f"a divisor of head_dim ({self.head_dim})", g))
            put("kv_group_size", g)
        elif q == "int3":
            put("kv_group_size", self._int3_group())
        elif q == "int2":
            put("kv_group_size", self._int2_group())
        else:
            support.require(support.GROUP_SIZE, self)
        self._validate_key_bits(put, q, kq)
        # rotation by default for int4/int3; int2 keeps KIVI's unrotated per-channel keys and values
        rot = (dtypes.info(q).grouped and q != "int2") if self.kv_rotation is None else \
            _check_bool("kv_rotation", self.kv_rotation)
        put("kv_rotation", rot)
        seed = _check_int("kv_rotation_seed", self.kv_rotation_seed, 0)
        if seed >= 2**63:
            raise InvalidArgumentError(expected("kv_rotation_seed", "an int in [0, 2**63)", seed))
        put("kv_rotation_seed", seed)
        w = DEFAULT_KV_WINDOW.get(q, 0) if self.kv_window is None else self.kv_window
        put("kv_window", _check_int("kv_window", w, 0))
        sink = DEFAULT_KV_SINK.get(q, 0) if self.kv_sink_tokens is None else self.kv_sink_tokens
        put("kv_sink_tokens", _check_int("kv_sink_tokens", sink, 0))
        layers = self.kv_full_precision_layers
        if isinstance(layers, (str, bytes)) or not isinstance(layers, (tuple, list, set, frozenset)):
            raise ArgumentTypeError(expected("kv_full_precision_layers", "a tuple of layer indices", show(layers)))
        norm: set[int] = set()
        for i in layers:
            if isinstance(i, bool) or not isinstance(i, numbers.Integral):
                raise ArgumentTypeError(expected("kv_full_precision_layers",
                                                 f"layer indices in [-{self.num_layers}, {self.num_layers})", show(i)))
            if not -self.num_layers <= i < self.num_layers:
                raise InvalidArgumentError(expected("kv_full_precision_layers",
                                                    f"layer indices in [-{self.num_layers}, {self.num_layers})", repr(i)))
            norm.add(int(i) % self.num_layers)
        if len(norm) == self.num_layers:
            raise InvalidArgumentError(expected("kv_full_precision_layers", "at least one quantized layer "
                                                "(use kv_dtype=None for none)", sorted(norm)))
        put("kv_full_precision_layers", tuple(sorted(norm)))
        fd = self.kv_full_precision_dtype
        if fd is not None:
            if not isinstance(fd, str):
                raise ArgumentTypeError(expected("kv_full_precision_dtype", "None or 'int8'", show(fd)))
            if fd != "int8":
                raise InvalidArgumentError(expected("kv_full_precision_dtype", "None (the model dtype) or 'int8'",
                                                    repr(fd)))

    def _validate_key_bits(self, put, kv_dtype: str, key_quant: str) -> None:
        # wider block keys are int4's: its sealed rows' per-token parameter bytes hold the
        # high bits. Every other format keeps 4, the no-widening value (int2's sealed keys
        # are 2-bit codes, LayerFormat.key_code_bits).
        kb = self.kv_key_bits
        wide = key_quant == "block" and kv_dtype == "int4"
        room = 4 + key_spare_bits(self.kv_group_size or 0) if wide else 4
        if kb is None:
            put("kv_key_bits", room)
            return
        if isinstance(kb, bool) or not isinstance(kb, numbers.Integral):
            raise ArgumentTypeError(expected("kv_key_bits", "an int (4, 5, 6 or 8)", show(kb)))
        if kb not in (4, 5, 6, 8) or kb > room:
            if wide:
                what = (f"4, or up to {room} for kv_group_size {self.kv_group_size} "
                        "(its parameters hold the high bits)")
            elif key_quant == "block":
                what = f"4 for kv_dtype {kv_dtype!r} (wider block keys are int4 only)"
            else:
                what = "4 (token keys)"
            raise InvalidArgumentError(expected("kv_key_bits", what, repr(kb)))
        put("kv_key_bits", int(kb))

    def _int3_group(self) -> int:
        if self.head_dim % 8:
            raise InvalidArgumentError(expected("head_dim", "a multiple of 8 for int3 (8 codes per 3 bytes)",
                                                self.head_dim))
        g = self.kv_group_size
        if g is None:
            g = max(k for k in range(8, DEFAULT_INT3_GROUP + 1, 8) if self.head_dim % k == 0)
        g = _check_int("kv_group_size", g, 1)
        if g % 8 or self.head_dim % g:
            raise InvalidArgumentError(expected("kv_group_size", f"a multiple of 8 that divides head_dim "
                                                f"({self.head_dim}) for int3", g))
        return g

    def _int2_group(self) -> int:
        if self.head_dim % 4:
            raise InvalidArgumentError(expected("head_dim", "a multiple of 4 for int2 (4 codes per byte)",
                                                self.head_dim))
        g = self.kv_group_size
        if g is None:
            g = dtypes.default_int4_group(self.head_dim)
            g = g if g % 4 == 0 else self.head_dim
        g = _check_int("kv_group_size", g, 1)
        if g % 4 or self.head_dim % g:
            raise InvalidArgumentError(expected("kv_group_size", f"a multiple of 4 that divides head_dim "
                                                f"({self.head_dim}) for int2", g))
        return g

    # -- derived sizes ------------------------------------------------------------

    @property
    def quantized_layers(self) -> tuple[int, ...]:
        """Indices of the layers stored in ``kv_dtype`` (all but ``kv_full_precision_layers``)."""
        if not self.quantized:
            return ()
        return tuple(i for i in range(self.num_layers) if i not in self.kv_full_precision_layers)

    @property
    def full_precision_slots(self) -> tuple[int, ...]:
        """Arena layer slots stored in the model dtype: ``kv_full_precision_layers``, or
        with layer groups the slots those layers occupy. A slot holds one layer of each
        group, so with groups every layer sharing a full-precision layer's slot is stored
        in model precision too (more exact, never less; counted in the sizes)."""
        if not self.quantized:
            return ()
        if self._groups is None:
            return self.kv_full_precision_layers
        return tuple(sorted({self._groups.layer_slot[i] for i in self.kv_full_precision_layers}))

    @property
    def quantized_slots(self) -> tuple[int, ...]:
        """Arena layer slots stored in ``kv_dtype`` (the quantized layers without groups)."""
        if not self.quantized:
            return ()
        full = self.full_precision_slots
        return tuple(i for i in range(self.arena_layers) if i not in full)

    @property
    def quant_head_bytes(self) -> int:
        """Bytes of one quantized (token, head, K or V) row: codes plus scale/zero."""
        row, d = dtypes.info(self.kv_dtype), self.head_dim
        params = self.param_groups if row.grouped else 1
        return row.stored_dim(d) * row.itemsize + row.param_bytes * params * (2 if row.zero_point else 1)

    @property
    def bits_per_element(self) -> float:
        """Stored bits per K/V element of a quantized layer, scales included (model bits if none;
        MLA: per latent element, the positional slice included)."""
        if not self.quantized:
            return 8.0 * MODEL_DTYPE_NAMES[self.dtype]
        spec = self._specs[0]
        per_row = spec.token_bytes() / (spec.rows_per_token * self.kv_heads_per_rank)
        return 8.0 * per_row / self.head_dim + (16.0 / self.block_size if self.block_keys else 0.0)

    @property
    def block_keys(self) -> bool:
        """Whether full blocks' keys are requantized per channel (``kv_key_quant="block"``)."""
        return self.kv_key_quant == "block"

    @property
    def key_param_bytes_per_block(self) -> int:
        """Bytes of one block's per-channel key parameters across the quantized layer
        slots (bfloat16 scale and zero per head and channel), 0 without block keys."""
        if not self.block_keys:
            return 0
        lq = len(self.quantized_slots)
        return lq * self.kv_heads_per_rank * self.head_dim * 4

    @property
    def window_blocks(self) -> int:
        """Blocks in the window arena: ``kv_window_sequences * (ceil(kv_window / block_size) + 1)``
        (block keys stage each sequence's newest block there, so it exists with
        ``kv_window=0`` too), plus :attr:`precise_sink_blocks` per sequence; with layer groups,
        that many per group (a sequence has a block table per group)."""
        recent = 0
        if self.kv_window or self.block_keys:
            recent = -(-(self.kv_window or 0) // self.block_size) + 1
        return self.kv_window_sequences * self.table_groups * recent + self.pinned_blocks

    @property
    def pinned_blocks(self) -> int:
        """Window arena blocks that sink tokens may pin: :attr:`precise_sink_blocks` per table of
        ``kv_window_sequences`` sequences."""
        return self.kv_window_sequences * self.table_groups * self.precise_sink_blocks

    @property
    def table_groups(self) -> int:
        """Block tables per sequence: one, or one per layer group."""
        return 1 if self._groups is None else len(self._groups.groups)

    @property
    def precise_sink_blocks(self) -> int:
        """Leading blocks of a sequence pinned in the window arena for ``kv_sink_tokens``
        (kept in model precision). Not the sliding-window tables' ``sink_blocks``, which are
        the blocks of ``attention_sinks`` a window never releases."""
        return -(-(self.kv_sink_tokens or 0) // self.block_size)

    @property
    def sink_blocks(self) -> int:
        """Deprecated 0.1 name of :attr:`precise_sink_blocks`."""
        return self.precise_sink_blocks

    @property
    def window_bytes(self) -> int:
        """Bytes of the window arena (model-precision K/V plus a validity byte per token)."""
        per_block = 2 * self.block_size * self.kv_heads_per_rank * self.head_dim * MODEL_DTYPE_NAMES[self.dtype]
        layers = len(self.quantized_slots)
        return layers * self.window_blocks * (per_block + self.block_size)

    @property
    def quantized(self) -> bool:
        """True when K/V are stored quantized (fp8 or int8) with scale arenas."""
        return self.kv_dtype is not None

    @property
    def cache_dtype(self) -> str:
        """Name of the element type stored in the data arena."""
        return self.kv_dtype or self.dtype

    @property
    def kv_heads_per_rank(self) -> int:
        """KV heads this rank stores: ``num_kv_heads // tp_size``, at least 1 (replicated)."""
        return max(1, self.num_kv_heads // self.tp_size)

    @property
    def kv_head_indices(self) -> tuple[int, ...]:
        """The model's KV heads this rank stores, in order.

        With at least as many heads as ranks, rank ``r`` holds a contiguous slice;
        with fewer, each head is replicated on ``tp_size // num_kv_heads`` consecutive
        ranks (vLLM's rule), so rank ``r`` holds head ``r * num_kv_heads // tp_size``.
        """
        k = self.kv_heads_per_rank
        if self.num_kv_heads >= self.tp_size:
            return tuple(range(self.tp_rank * k, (self.tp_rank + 1) * k))
        return (self.tp_rank * self.num_kv_heads // self.tp_size,)

    @property
    def has_prefix_tiers(self) -> bool:
        """True when a host, disk or remote prefix tier is configured."""
        return bool(self.prefix_host_blocks or self.prefix_disk_blocks or self.prefix_remote is not None)

    @property
    def element_bytes(self) -> float:
        """Bytes per stored K/V element, without scales (0.5 for int4, 0.375 for int3)."""
        return KV_DTYPE_NAMES[self.kv_dtype] if self.quantized else MODEL_DTYPE_NAMES[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token across all layers (with sliding layers: across a block's
        :attr:`arena_layers` layer slots), K and V, including quantization scales (block
        keys' per-block parameters as a per-token share, rounded up)."""
        return self._row_bytes_per_token + -(-self.key_param_bytes_per_block // self.block_size)

    @property
    def _row_bytes_per_token(self) -> int:
        spec = self._specs[0]        # the groups of one pool share a geometry (groups.spec.check_pool)
        full = spec.model_token_bytes()
        if self.quantized and self.kv_full_precision_dtype == "int8":
            # the precise layers' K and V rows: int8 codes plus a float32 scale and zero point each
            full = 2 * self.kv_heads_per_rank * (self.head_dim + 8)
        lq = len(self.quantized_slots)
        return lq * spec.token_bytes() + (self.arena_layers - lq) * full

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block (``block_size`` tokens) across all layers."""
        return self._row_bytes_per_token * self.block_size + self.key_param_bytes_per_block

    @property
    def resolved_num_blocks(self) -> int:
        """``num_blocks``, or the number of whole blocks that fit ``memory_budget``."""
        return self._resolved_blocks

    @property
    def total_bytes(self) -> int:
        """Bytes of the device arenas (data plus scales, plus the window arena)."""
        return self.resolved_num_blocks * self.bytes_per_block + self.window_bytes

    @property
    def quantization_saving_bytes(self) -> int:
        """Bytes the quantized block arenas save against the same blocks in the model
        dtype (0 when not quantized); the window arena is not counted here."""
        if not self.quantized:
            return 0
        plain = self.arena_layers * self._specs[0].model_token_bytes()
        return max(0, self.resolved_num_blocks * (plain * self.block_size - self.bytes_per_block))

    @property
    def window_note(self) -> str | None:
        """A warning when the window arena (``kv_window``, ``kv_sink_tokens``, block
        keys' staging) costs more than quantizing the blocks saves; None otherwise."""
        saved, window = self.quantization_saving_bytes, self.window_bytes
        if not window or window <= saved:
            return None
        return (f"the window arena ({format_bytes(window)} for kv_window={self.kv_window}, "
                f"kv_sink_tokens={self.kv_sink_tokens}, kv_window_sequences={self.kv_window_sequences}) costs more "
                f"than {self.kv_dtype} saves on {self.resolved_num_blocks} blocks ({format_bytes(saved)}): lower "
                "kv_window_sequences or kv_window, or use a smaller kv_dtype saving")

    @property
    def num_slots(self) -> int:
        """Token slots in the cache: ``resolved_num_blocks * block_size``."""
        return self.resolved_num_blocks * self.block_size

    @property
    def kv_cache_shape(self) -> tuple[int, int, int, int, int]:
        """Per-layer data shape: NHD ``[NB, 2, bs, H, D]``, HND ``[NB, 2, H, bs, D]``."""
        return self.layer_shape(self.resolved_num_blocks)

    @property
    def arena_shape(self) -> tuple[int, ...]:
        """All-layer data arena shape: ``[arena_layers] + kv_cache_shape``."""
        return (self.arena_layers,) + self.kv_cache_shape

    @property
    def scale_arena_shape(self) -> tuple[int, ...] | None:
        """Scale (and int8/int4/int3 zero) arena shape: ``arena_shape`` without ``head_dim``
        (int4/int3: with ``head_dim / kv_group_size`` groups instead); None unquantized.
        Its dtype is :attr:`torch_scale_dtype`."""
        if not self.quantized or self.kv_lora_rank is not None:     # a latent row carries its scales
            return None
        groups = (self.param_groups,) if dtypes.info(self.kv_dtype).grouped else ()
        return self.arena_shape[:-1] + groups

    @property
    def param_groups(self) -> int:
        """Scale/zero groups along ``head_dim``: ``head_dim // kv_group_size`` for a grouped
        format (int4/int3, whose group size ``__post_init__`` resolved), else 1."""
        g = self.kv_group_size
        return 1 if g is None else self.head_dim // g

    def layer_shape(self, num_blocks: int) -> tuple[int, int, int, int, int]:
        """Per-layer data shape for ``num_blocks`` blocks in this layout (host tier uses it too);
        int4 packs two codes per byte, so its last dim is ``head_dim / 2``; int3 packs eight
        codes in three bytes (``3 * head_dim / 8``)."""
        bs, h = self.block_size, self.kv_heads_per_rank
        spec = self._specs[0]
        if spec.rows_per_token == 1:      # a latent row per token: [NB, bs, row elements]
            return (num_blocks, bs, spec.latent.row_elems)  # type: ignore[attr-defined, return-value]
        d = dtypes.info(self.cache_dtype).stored_dim(self.head_dim)
        return (num_blocks, 2, bs, h, d) if self.layout == "NHD" else (num_blocks, 2, h, bs, d)

    def sequence_bits_per_element(self, num_tokens: int) -> float:
        """Stored bits per K/V element of one sequence of ``num_tokens`` tokens, every
        byte counted: its blocks (codes, scales and zero points, block keys' parameters,
        the layers kept in model precision) and its share of the window arena (the
        recent, staging and sink blocks of one of ``kv_window_sequences`` sequences, in
        model precision, with their validity bytes). The window share is fixed per
        sequence, so short sequences pay more per element: :attr:`bits_per_element`
        counts the quantized layers' blocks alone. Caches with layer groups are refused
        (their sliding groups hold fewer blocks than the sequence has tokens)."""
        n = _check_int("num_tokens", num_tokens, 1)
        if self._groups is not None:
            raise InvalidArgumentError(expected("config", "a cache without layer groups (layer_windows all 0)",
                                                "layer groups"))
        stored = self.blocks_for_tokens(n) * self.bytes_per_block + self.window_bytes // self.kv_window_sequences
        return 8.0 * stored / (n * 2 * self.num_layers * self.kv_heads_per_rank * self.head_dim)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens (``ceil(num_tokens / block_size)``)."""
        n = _check_int("num_tokens", num_tokens, 0)
        return -(-n // self.block_size)

    # -- torch views ---------------------------------------------------------------

    @property
    def torch_dtype(self):
        """The model dtype as a torch dtype (imports torch)."""
        return dtypes.info(self.dtype).torch_dtype

    @property
    def torch_cache_dtype(self):
        """The data arena's torch dtype (imports torch; a quantized latent row is uint8 bytes)."""
        spec = self._specs[0]
        if spec.rows_per_token == 1:
            return spec.latent.storage_dtype  # type: ignore[attr-defined]
        return dtypes.info(self.cache_dtype).torch_dtype

    @property
    def torch_scale_dtype(self):
        """The scale and zero-point arenas' torch dtype (float32; bfloat16 for int3), or
        None unquantized (imports torch)."""
        return dtypes.info(self.kv_dtype).param_dtype if self.quantized else None

    # -- construction from a model config -----------------------------------------

    @classmethod
    def from_hf_config(cls, config: Any, **overrides: Any) -> CacheConfig:
        """Build a config from a Hugging Face model config.

        Args:
            config: a ``transformers`` config object, a plain dict, or a path to a
                ``config.json`` (or to a directory holding one), or to a GGUF model
                file (its metadata header is read, see :mod:`pagedkv.config.gguf`;
                no ``gguf`` package needed). Multimodal configs use
                their language model's ``text_config`` (also ``llm_config``,
                ``language_config``).
            overrides: any CacheConfig field (``num_blocks`` or ``memory_budget`` is
                required; ``dtype``, ``kv_dtype``, ... as usual). They win over values
                read from ``config``.

        Reads ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``
        (absent or None: MHA, so ``num_attention_heads``) and ``head_dim`` (absent or
        None: ``hidden_size // num_attention_heads``), and each layer's attention window
        (see :func:`pagedkv.groups.layers.layer_windows_from_hf`). An MLA model
        (``kv_lora_rank``: DeepSeek V2/V3, Kimi K2, GLM-4-MoE-Lite) gets its latent rows
        (``kv_lora_rank``, ``qk_rope_head_dim``; see :func:`pagedkv.config.specs.mla_from_hf`,
        which refuses DeepSeek-V3.2's sparse-attention indexer). A recurrent or hybrid
        model (Mamba2, Bamba, Granite 4, Falcon-H1, Jamba, Nemotron-H, Zamba2, Qwen3-Next,
        Qwen3.5, Kimi-Linear, LFM2, ...) gets its ``layer_kinds`` and ``state_tensors``
        (:func:`pagedkv.config.state_hf.state_from_hf`); ``num_layers`` then counts its
        attention layers, and ``state_slots`` or ``state_memory_budget`` is required.
        """
        src = _text_config(_as_mapping(config))
        get = lambda *names: _first(src, names)  # noqa: E731
        layers = get("num_hidden_layers", "n_layer", "num_layers")
        if layers is None:
            raise InvalidArgumentError(expected("config", "a 'num_hidden_layers' field", _keys(src)))
        layers = _check_int("num_hidden_layers", layers, 1)
        model_type = src.get("model_type")
        if model_type is not None and not isinstance(model_type, str):
            raise ArgumentTypeError(expected("model_type", "a str", show(model_type)))
        state = state_from_hf(src, layers)      # recurrent-state layers (Mamba2, Gated DeltaNet, ...)
        kv_count = layers if state is None else len(state["windows"])
        heads = get("num_attention_heads", "n_head")
        if heads is None and kv_count == 0:     # a pure state model: no K/V, no attention heads
            heads = 1
        if heads is None:
            raise InvalidArgumentError(expected("config", "a 'num_attention_heads' field", _keys(src)))
        # every field is checked as read: a model's config is input like any other
        heads = _check_int("num_attention_heads", heads, 1)
        kv_heads = get("num_key_value_heads", "num_kv_heads", "n_head_kv") if kv_count else 1
        kv_heads = heads if kv_heads is None else _check_int("num_key_value_heads", kv_heads, 1)
        head_dim = get("head_dim") if kv_count else 1
        if head_dim is None:
            hidden = get("hidden_size", "n_embd", "d_model")
            if hidden is None:
                raise InvalidArgumentError(expected("config", "a 'head_dim' or 'hidden_size' field", _keys(src)))
            head_dim = _check_int("hidden_size", hidden, 1) // heads
        values: dict[str, Any] = dict(num_layers=kv_count, num_kv_heads=kv_heads, head_dim=head_dim,
                                      num_attention_heads=heads)
        mla = mla_from_hf(src)
        if mla is not None:     # one latent row per token: a single "head" of c_kv and k_pe
            values.update(mla, num_kv_heads=1, head_dim=mla["kv_lora_rank"] + mla["qk_rope_head_dim"])
        if state is not None:
            values.update(layer_kinds=state["layer_kinds"], state_tensors=state["state_tensors"])
            if any(state["windows"]):
                values["layer_windows"] = state["windows"]
        else:
            windows = layer_windows_from_hf(src, layers)
            if windows is not None:
                values["layer_windows"] = windows
        names = {f.name for f in fields(cls) if f.init}
        for key in overrides:
            if key not in names:
                raise InvalidArgumentError(expected("overrides", "CacheConfig field names", repr(key)))
        values.update(overrides)
        return cls(**values)


#: largest config.json read (real ones are a few KiB); a GGUF file is mapped, not read
MAX_CONFIG_BYTES = 16 * 1024**2


def _as_mapping(config: Any) -> Mapping[str, Any]:
    if isinstance(config, Mapping):
        return config
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if not isinstance(path, str) or "\0" in path:
            raise InvalidArgumentError(expected("config", "a path (a str without NUL bytes)", show(path)))
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open_regular(path, "config", "a readable config.json") as f:   # a FIFO or device is refused, never read
            raw = f.read(len(GGUF_MAGIC))
            if raw != GGUF_MAGIC:
                raw += f.read(MAX_CONFIG_BYTES + 1 - len(raw))
        if raw == GGUF_MAGIC:   # a llama.cpp model file: its metadata holds the shape
            return hf_fields_from_gguf(read_gguf_metadata(path), path)
        if len(raw) > MAX_CONFIG_BYTES:
            raise InvalidArgumentError(expected("config", f"a config.json of at most {MAX_CONFIG_BYTES} bytes",
                                                f"{path!r} (larger)"))
        try:
            data = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise InvalidArgumentError(expected("config", "a config.json (UTF-8 JSON) or a GGUF file",
                                                f"{path!r} (not UTF-8 text: {e.reason} at byte {e.start})")) from None
        except json.JSONDecodeError as e:
            raise InvalidArgumentError(expected("config", "a JSON object", f"{path!r} ({e})")) from None
        except RecursionError:   # the decoder's own depth guard: nesting no config has
            raise InvalidArgumentError(expected("config", "a JSON object nested as a model config is",
                                                f"{path!r} (nested too deep to decode)")) from None
        except ValueError as e:  # Python's int-conversion limit: a number of thousands of digits
            raise InvalidArgumentError(expected("config", "a JSON object with numbers a model config has",
                                                f"{path!r} ({str(e)[:80]})")) from None
        if not isinstance(data, dict):
            raise InvalidArgumentError(expected("config", "a JSON object", f"{type(data).__name__} in {path!r}"))
        return data
    if hasattr(config, "to_dict"):  # transformers.PretrainedConfig
        return _ObjectView(config)
    raise InvalidArgumentError(
        expected("config", "a transformers config, a dict or a path to config.json", type(config).__name__)
    )


def _layer_windows(windows: Any, num_layers: int) -> tuple[Any, ...]:
    """``layer_windows`` as one entry per layer, in layer order: a list or tuple, or a
    mapping keyed by every layer index (``{0: 4, 1: 0}`` is ``(4, 0)``). Sets and other
    unordered or partial forms are refused: their order is not the layers' order."""
    want = f"{num_layers} windows (one per layer)"
    if isinstance(windows, Mapping):
        keys = list(windows)
        if any(isinstance(k, bool) or not isinstance(k, numbers.Integral) for k in keys) or \
                sorted(int(k) for k in keys) != list(range(num_layers)):
            raise InvalidArgumentError(expected("layer_windows", f"{want[:-1]}: a dict keyed by every layer "
                                                f"0..{num_layers - 1})", f"a dict keyed by {show(sorted(keys, key=str))}"))
        out = tuple(windows[k] for k in sorted(keys))
    else:
        if isinstance(windows, (str, bytes)) or not isinstance(windows, Sequence):
            raise ArgumentTypeError(expected("layer_windows", want, show(windows)))
        if len(windows) != num_layers:
            raise InvalidArgumentError(expected("layer_windows", want, show(windows)))
        out = tuple(windows)
    for i, w in enumerate(out):      # a wrong type is a TypeError, as for every int option
        if isinstance(w, bool) or not isinstance(w, numbers.Integral):
            raise ArgumentTypeError(expected("layer_windows", "ints >= 0 (0 = full attention)",
                                             f"{show(w)} at layer {i}"))
    return out


class _ObjectView(Mapping):
    """Read a transformers config by attribute, so its ``attribute_map`` aliases work."""

    def __init__(self, obj: Any):
        self._obj = obj
        self._keys = list(obj.to_dict())

    def __getitem__(self, key: str) -> Any:
        try:
            value = getattr(self._obj, key)
        except AttributeError:
            raise KeyError(key) from None
        return _ObjectView(value) if hasattr(value, "to_dict") and not isinstance(value, Mapping) else value

    def __iter__(self):
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


_TEXT_KEYS = ("text_config", "llm_config", "language_config")


def _text_config(src: Mapping[str, Any]) -> Mapping[str, Any]:
    # A multimodal config nests its language model; the KV cache belongs to that model.
    # Only a nested config is taken: a string there is data, never a path to open.
    for key in _TEXT_KEYS:
        sub = src.get(key)
        if sub is not None:
            if not isinstance(sub, Mapping):
                raise ArgumentTypeError(expected(key, "a nested config (a JSON object)", show(sub)))
            return sub
    return src


def _first(src: Mapping[str, Any], names) -> Any:
    for name in names:
        value = src.get(name)
        if value is not None:
            return value
    return None


def _keys(src: Mapping[str, Any]) -> str:
    keys = sorted(str(k) for k in src)
    shown = ", ".join(keys[:12]) + (", ..." if len(keys) > 12 else "")
    return f"keys [{shown}]"

