"""KV specs: what one layer group stores, and the rules its attention type brings.

A spec is the single source of what a layer group is (vLLM's ``KVCacheSpec``, one per
group): its layers, its attention type, its block geometry (tokens per block, rows per
token, row shape, bytes per token) and its :class:`~pagedkv.format.layer_format.LayerFormat`.
The rest of pagedkv derives from it and never re-derives the type from a window or a
dtype:

- the block tables class, chosen by the spec's type (``pagedkv.groups.tables.TABLES_FOR``);
- the prefix-hit rule (:meth:`KVSpec.longest_hit`) and the out-of-window rule
  (:meth:`KVSpec.blocks_held`, :attr:`KVSpec.releases_blocks`), per type;
- the arenas (:attr:`KVSpec.arena`: which store holds the group's blocks), the
  planner's bytes and the format fingerprint (:meth:`KVSpec.fingerprint`).

The types today:

- :class:`FullAttentionSpec`: K and V rows of ``num_kv_heads`` heads per token; a query
  sees every earlier position, so a sequence holds all its blocks;
- :class:`SlidingWindowSpec`: the same rows; a query at position p sees (p - W, p] plus
  the first ``sinks`` positions, so the blocks that left the window are released;
- :class:`MLASpec`: Multi-head Latent Attention (DeepSeek V2/V3, Kimi K2): one latent
  row per token, K only (``kv_lora_rank`` compressed elements, then ``rope_dim``
  positional ones; V is the first ``kv_lora_rank`` elements of the same row). The
  row's byte layout per format is :class:`~pagedkv.format.latent.LatentFormat`'s.

- :class:`RecurrentStateSpec`: a recurrent state per sequence (Mamba2's conv and SSM
  state, Gated DeltaNet's conv and delta-rule state), not rows per token: its slots
  live in a pool of their own (:mod:`pagedkv.state`), and its prefix hit is "a
  snapshot at exactly this block boundary".

A new type is a subclass that overrides the hooks, plus one entry in the tables map.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from pagedkv.errors import InvalidArgumentError, expected
from pagedkv.format import dtypes
from pagedkv.format.latent import LatentFormat
from pagedkv.format.layer_format import LayerFormat

__all__ = ["KVSpec", "FullAttentionSpec", "SlidingWindowSpec", "MLASpec", "StateTensor", "RecurrentStateSpec",
           "SPEC_TYPES", "check_pool"]


@dataclass(frozen=True)
class KVSpec:
    """One layer group: its layers (model order) and its block geometry.

    ``block_size``, ``format``, ``model_dtype``, ``num_kv_heads`` and ``head_dim`` are the
    geometry the config gives the group (:meth:`placed`); a spec built from the layer
    partition alone (``format=None``) knows only its layers and its attention rule.
    """

    index: int
    #: the group's layers in model order (a ``range`` for a one-group cache: a config of any
    #: layer count is checked for size before anything per layer is built)
    layers: Sequence[int]
    block_size: int = 16
    format: LayerFormat | None = None
    model_dtype: str = "float16"
    num_kv_heads: int = 1       # heads a block stores (this rank's)
    head_dim: int = 1           # elements of one head's row

    #: the attention type's name: picks the block tables class and the arena
    attention: ClassVar[str] = "full"
    #: the store kind that holds the group's blocks (``pagedkv.store.stores``)
    arena: ClassVar[str] = "kv"
    #: rows stored per token and head: 2 (K and V) or 1 (a latent row, K only)
    rows_per_token: ClassVar[int] = 2
    #: True when the tables release blocks a sequence's next query no longer sees
    releases_blocks: ClassVar[bool] = False
    #: True when every tensor-parallel rank stores the same rows (not split by head): a
    #: tier or a transfer of one rank serves all, and a TP group needs to move them once
    replicated: ClassVar[bool] = False

    # -- the attention rule's parameters, 0 for a type without them ----------------------
    @property
    def window(self) -> int:
        """Tokens a query sees: 0 for every earlier position."""
        return 0

    @property
    def sinks(self) -> int:
        """Leading tokens a windowed type never releases (0 otherwise)."""
        return 0

    @property
    def is_sliding(self) -> bool:
        return self.releases_blocks

    @property
    def kind(self) -> str:
        """A short description (stats, the planner's report)."""
        return self.attention

    # -- geometry --------------------------------------------------------------------------
    def placed(self, **geometry: Any) -> KVSpec:
        """This spec with the config's geometry (``block_size``, ``format``, ...)."""
        return dataclasses.replace(self, **geometry)

    @property
    def row_shape(self) -> tuple[int, int]:
        """``(heads, elements)`` of one stored row."""
        return (self.num_kv_heads, self.head_dim)

    def token_bytes(self, fmt: LayerFormat | None = None) -> int:
        """Bytes one token takes in one layer stored in ``fmt`` (default: the group's
        format): its rows, codes plus their scale and zero parameters."""
        f = fmt or self._format()
        row = f.row
        per_head = row.stored_dim(self.head_dim) * row.itemsize
        if row.quantized:
            params = self.head_dim // f.group_size if f.group_size else 1
            per_head += row.param_bytes * params * (2 if row.zero_point else 1)
        return self.rows_per_token * self.num_kv_heads * per_head

    def model_token_bytes(self) -> int:
        """:meth:`token_bytes` at model precision (what quantization saves against)."""
        return self.token_bytes(LayerFormat(self.model_dtype))

    def _format(self) -> LayerFormat:
        if self.format is None:
            raise InvalidArgumentError(expected("spec", f"layer group {self.index} placed by a CacheConfig "
                                                "(its format known)", "a spec without a format"))
        return self.format

    # -- the attention type's rules ------------------------------------------------------------
    def longest_hit(self, tables: Any, matched: int, cap: int) -> int:
        """Of a prompt whose first ``matched`` full blocks this group's prefix index holds,
        the most blocks an admission may reuse, at most ``cap`` (a hit every group agrees
        on is found by calling this per group until no group lowers it). Full and
        sliding attention: the blocks from the start, each group's own chain (a sliding
        group's index keeps the blocks that left its windows, until evicted). A type whose
        reuse needs something at exactly the boundary (a recurrent state's snapshot)
        answers the largest boundary at most ``cap`` where it has one; ``tables`` is the
        group's block tables, for such a lookup."""
        return matched if matched < cap else cap

    def blocks_held(self, tokens: int) -> int:
        """Blocks a sequence of ``tokens`` tokens holds at most in this group."""
        return -(-tokens // self.block_size)

    def kept_tokens(self, tokens: int) -> int:
        """Tokens whose rows a sequence of ``tokens`` tokens keeps (the planner's exact bytes)."""
        return tokens

    def tracks_restored(self) -> bool:
        """Whether a sequence restored from elsewhere (a transfer) is tracked here by its
        token ids: a type that keeps every position can register its blocks as prefixes."""
        return not self.releases_blocks

    def fingerprint(self) -> Any:
        """What of the group changes a stored block's meaning (format fingerprint)."""
        return [self.window, self.sinks, list(self.layers)]


@dataclass(frozen=True)
class FullAttentionSpec(KVSpec):
    """Full attention: K and V per head; a sequence keeps every block."""

    attention: ClassVar[str] = "full"


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """Sliding-window attention: a query at p sees (p - window, p] and the first
    ``sinks`` positions; the blocks wholly outside that are released."""

    window_tokens: int = 1
    sink_tokens: int = 0

    attention: ClassVar[str] = "sliding"
    releases_blocks: ClassVar[bool] = True

    @property
    def window(self) -> int:
        return self.window_tokens

    @property
    def sinks(self) -> int:
        return self.sink_tokens

    @property
    def kind(self) -> str:
        return f"sliding(window={self.window}" + (f", sinks={self.sinks})" if self.sinks else ")")

    def blocks_held(self, tokens: int) -> int:
        """The sink blocks, the window's blocks and one partial block at each end."""
        bs = self.block_size
        cap = -(-self.sinks // bs) + -(-(self.window - 1) // bs) + 1
        return min(-(-tokens // bs), cap)

    def kept_tokens(self, tokens: int) -> int:
        return min(tokens, self.window - 1 + self.sinks)


@dataclass(frozen=True)
class MLASpec(KVSpec):
    """Multi-head Latent Attention: one latent row per token (``kv_lora_rank`` + ``rope_dim``
    elements, one "head"), K only: V is the row's first ``kv_lora_rank`` elements. The
    tables are full attention's (vLLM's ``MLAAttentionSpec`` reuses that manager);
    the row's bytes are :class:`~pagedkv.format.latent.LatentFormat`'s."""

    kv_lora_rank: int = 512
    rope_dim: int = 64

    attention: ClassVar[str] = "mla"
    arena: ClassVar[str] = "latent"
    rows_per_token: ClassVar[int] = 1
    replicated: ClassVar[bool] = True     # the latent is not split by head

    @property
    def kind(self) -> str:
        return f"mla(kv_lora_rank={self.kv_lora_rank}, rope_dim={self.rope_dim})"

    @property
    def latent(self) -> LatentFormat:
        """The byte layout of one latent row in the group's format."""
        f = self._format()
        return LatentFormat(f.kv_dtype, self.model_dtype, self.kv_lora_rank, self.rope_dim, f.group_size)

    @property
    def row_shape(self) -> tuple[int, int]:
        return (1, self.kv_lora_rank + self.rope_dim)

    def token_bytes(self, fmt: LayerFormat | None = None) -> int:
        f = fmt or self._format()
        return LatentFormat(f.kv_dtype, self.model_dtype, self.kv_lora_rank, self.rope_dim, f.group_size).row_bytes

    def model_token_bytes(self) -> int:
        return (self.kv_lora_rank + self.rope_dim) * dtypes.info(self.model_dtype).itemsize

    def fingerprint(self) -> Any:
        return {"attention": self.attention, "kv_lora_rank": self.kv_lora_rank, "rope_dim": self.rope_dim,
                "layers": list(self.layers)}


@dataclass(frozen=True)
class StateTensor:
    """One tensor of a layer's recurrent state: its name (``"conv"``, ``"ssm"``), its
    shape for one sequence and its dtype (float32 by default: a state accumulates over
    the whole context, so rounding it to the model dtype compounds)."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"

    @property
    def nbytes(self) -> int:
        n = dtypes.info(self.dtype).itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class RecurrentStateSpec(KVSpec):
    """Recurrent-state layers (Mamba, Mamba2, Gated DeltaNet, short convolutions): one
    state per sequence and layer, whatever its length, made of ``tensors`` (each with its
    own shape and dtype). The state is held in slots of a pool of its own
    (:mod:`pagedkv.state`), with its own budget and eviction, not in blocks: the
    attention groups keep their block size, and a state is not a page of tokens.

    Its prefix-hit rule: a request may resume only where a snapshot of the state was
    taken at exactly that block boundary (``longest_hit``); a snapshot is taken every
    ``checkpoint_every`` blocks, at the end of each prefill chunk that ends on a block
    boundary, and where a prefix shared with an earlier request ends."""

    tensors: tuple[StateTensor, ...] = ()
    checkpoint_every: int = 16      # blocks between two periodic snapshots

    attention: ClassVar[str] = "state"
    arena: ClassVar[str] = "state"
    rows_per_token: ClassVar[int] = 0

    @property
    def kind(self) -> str:
        parts = ", ".join(f"{t.name} {list(t.shape)} {t.dtype}" for t in self.tensors)
        return f"state({parts})"

    @property
    def row_shape(self) -> tuple[int, int]:
        return (0, 0)

    def layer_bytes(self) -> int:
        """Bytes of one layer's state for one sequence (every tensor)."""
        return sum(t.nbytes for t in self.tensors)

    def slot_bytes(self) -> int:
        """Bytes of one state slot: every layer of the group, for one sequence."""
        return self.layer_bytes() * len(self.layers)

    def token_bytes(self, fmt: LayerFormat | None = None) -> int:
        return 0

    def model_token_bytes(self) -> int:
        return 0

    def longest_hit(self, tables: Any, matched: int, cap: int) -> int:
        """The largest block boundary at most ``min(matched, cap)`` at which a snapshot
        of this prompt's state exists: ``tables.boundaries``, ascending (what a lookup of
        the prompt found; :meth:`pagedkv.state.tables.StateTables.lookup`)."""
        top = matched if matched < cap else cap
        best = 0
        for b in tables.boundaries:
            if b > top:
                break
            best = b
        return best

    def blocks_held(self, tokens: int) -> int:
        return 0

    def kept_tokens(self, tokens: int) -> int:
        return 0

    def tracks_restored(self) -> bool:
        return False

    def fingerprint(self) -> Any:
        return {"attention": self.attention, "layers": list(self.layers),
                "tensors": [[t.name, list(t.shape), t.dtype] for t in self.tensors]}


#: every spec type, by its attention name
SPEC_TYPES: dict[str, type[KVSpec]] = {s.attention: s for s in (FullAttentionSpec, SlidingWindowSpec, MLASpec,
                                                                 RecurrentStateSpec)}


def check_pool(specs: tuple[KVSpec, ...]) -> None:
    """Groups that share one block pool need one block geometry: a block id names the
    same bytes in every group's view. The groups of one arena kind share a pool; a kind
    of its own (a recurrent state's slots, the next spec type) has its own. Refuses,
    naming the first group that differs, and several arena kinds in one cache (one
    store per kind is not built yet)."""
    first = specs[0]
    for s in specs[1:]:
        if s.arena != first.arena:
            raise InvalidArgumentError(expected(
                "layer groups", f"one arena kind per cache (group 0: {first.kind}, arena {first.arena!r})",
                f"group {s.index}: {s.kind}, arena {s.arena!r}"))
        if s.block_size != first.block_size or s.row_shape != first.row_shape:
            raise InvalidArgumentError(expected(
                "layer groups", f"one block geometry in a shared block pool (group 0: {first.kind}, "
                f"{first.block_size} tokens of {first.row_shape} rows)",
                f"group {s.index}: {s.kind}, {s.block_size} tokens of {s.row_shape} rows"))
