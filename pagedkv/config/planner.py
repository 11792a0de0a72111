"""Memory planner: how many blocks, tokens and full-length sequences fit a budget.

The ``pagedkv plan`` command line is :mod:`pagedkv.cli.plan`.

KV bytes per token = layers x the layer group spec's bytes per token per layer
(:meth:`pagedkv.groups.spec.KVSpec.token_bytes`): for K/V attention 2 (K and V) x
kv_heads x head_dim x element bytes, plus, for quantized storage, one float32 scale
(and for int8 one float32 zero point) per (K/V, layer, kv head); for an MLA latent
row the formulas of :mod:`pagedkv.format.latent` (bfloat16 R = 512, P = 64: 1,152 B;
fp8_e4m3: 656 B; int8: 648 B; int4: 448 B).

Sliding-window layers (see :mod:`pagedkv.groups.layers`): a block holds one layer
group's layer slots, and a sequence holds blocks in every group. A full-attention group
grows with the context; a sliding one stops at its window (plus sinks). So a sequence
of L tokens costs ``context_bytes_per_token * L`` (full groups) plus at most
``constant_bytes_per_sequence`` (sliding groups), block-rounded.

Recurrent-state layers (Mamba2, Gated DeltaNet, ...; see :mod:`pagedkv.state`): a
sequence also holds one state slot (``state_bytes_per_sequence``: every state tensor
of every state layer, at the state dtype), whatever its length, and prefix caching
keeps snapshots of the same size (a periodic one every ``state_checkpoint_every``
blocks: ``snapshots_per_sequence`` over ``max_seq_len``). The state pool is a budget
of its own: ``state_budget`` (or ``state_slots``); without either, :func:`plan`
splits ``budget`` so that each full-length sequence gets its blocks, its live state
and its periodic snapshots.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from pagedkv.config.options import CacheConfig, format_bytes, parse_bytes, show
from pagedkv.errors import InvalidArgumentError, expected

__all__ = ["PlanResult", "plan", "plan_config", "plan_cache_config"]


@dataclass(frozen=True)
class PlanResult:
    """What fits a memory budget. All sizes in bytes; sequences are block-rounded."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_attention_heads: int | None
    block_size: int
    dtype: str
    kv_dtype: str  # stored element type: the model dtype or a quantized name
    layout: str
    budget_bytes: int
    bytes_per_token: int
    bytes_per_block: int
    num_blocks: int  # whole blocks that fit the budget
    num_tokens: int  # num_blocks * block_size
    arena_bytes: int  # num_blocks * bytes_per_block (<= budget_bytes)
    max_seq_len: int | None
    blocks_per_sequence: int | None  # ceil(max_seq_len / block_size)
    bytes_per_sequence: int | None  # blocks_per_sequence * bytes_per_block
    exact_bytes_per_sequence: int | None  # max_seq_len * bytes_per_token (no rounding)
    num_sequences: int | None  # full-length sequences that fit at once
    layer_groups: tuple = ()  # per group: "full x N layers" / "sliding(window=W) x N layers"
    context_bytes_per_token: int = 0  # bytes a sequence adds per token of context (full-attention groups)
    constant_bytes_per_sequence: int = 0  # most bytes a sequence's sliding groups hold, at any length
    window_bytes: int = 0  # the window arena (model-precision rows of kv_window / sinks), in arena_bytes
    quantization_saving_bytes: int = 0  # what the quantized blocks save against the model dtype
    note: str | None = None  # set when the window arena costs more than quantization saves
    attention: str = "full"  # the layer group's spec ("full", "mla(kv_lora_rank=..., rope_dim=...)"), or "hybrid"
    layer_bytes_per_token: int = 0  # one token in one layer of kv_dtype: its rows, scales included
    state: str | None = None  # recurrent-state layers: their spec ("state(conv [...] float32, ...)"), else None
    state_layers: int = 0  # layers that keep a recurrent state
    state_bytes_per_sequence: int = 0  # one sequence's state in every state layer (also one snapshot's size)
    state_slots: int = 0  # live states and snapshots the state pool holds
    state_pool_bytes: int = 0  # state_slots * state_bytes_per_sequence (beside arena_bytes)
    snapshots_per_sequence: int | None = None  # periodic snapshots of a max_seq_len sequence

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_groups", tuple(self.layer_groups))   # to_dict() gives a list

    def to_dict(self) -> dict:
        d = asdict(self)
        d["layer_groups"] = list(self.layer_groups)    # as JSON reads it back
        return d

    def format(self) -> str:
        """A short human-readable report."""
        heads = f" ({self.num_attention_heads} attention heads)" if self.num_attention_heads else ""
        kv = self.kv_dtype if self.kv_dtype == self.dtype else f"{self.kv_dtype} (model dtype {self.dtype})"
        lines = [
            f"model           {self.num_layers} layers, {self.num_kv_heads} kv heads x {self.head_dim} head dim{heads}",
            f"cache           {kv}, block size {self.block_size}, layout {self.layout}",
            f"attention       {self.attention}, {self.layer_bytes_per_token:,} B per token per layer",
            f"bytes/token     {self.bytes_per_token:,} B ({format_bytes(self.bytes_per_token)})"
            + (" per block slot" if self.layer_groups else ""),
            f"bytes/block     {self.bytes_per_block:,} B ({format_bytes(self.bytes_per_block)})",
            f"budget          {self.budget_bytes:,} B ({format_bytes(self.budget_bytes)})",
            f"blocks          {self.num_blocks:,} ({format_bytes(self.arena_bytes)} used)",
            f"tokens          {self.num_tokens:,}",
        ]
        if self.layer_groups:
            lines += [f"layer groups    {', '.join(self.layer_groups)}",
                      f"per sequence    {self.context_bytes_per_token:,} B per token of context "
                      f"({format_bytes(self.context_bytes_per_token)}) + at most "
                      f"{self.constant_bytes_per_sequence:,} B ({format_bytes(self.constant_bytes_per_sequence)}) "
                      "in sliding windows"]
        if self.window_bytes:
            lines.append(f"window arena    {self.window_bytes:,} B ({format_bytes(self.window_bytes)}), in the "
                         f"blocks' bytes above; quantization saves {format_bytes(self.quantization_saving_bytes)}")
        if self.note:
            lines.append(f"warning         {self.note}")
        if self.state is not None:
            lines += [f"state layers    {self.state_layers} x {self.state}",
                      f"state/sequence  {self.state_bytes_per_sequence:,} B "
                      f"({format_bytes(self.state_bytes_per_sequence)}) at any length, and as much per snapshot",
                      f"state pool      {self.state_slots:,} slots = {self.state_pool_bytes:,} B "
                      f"({format_bytes(self.state_pool_bytes)}), beside the blocks"]
        if self.max_seq_len is not None:
            lines += [
                f"one sequence    {self.max_seq_len:,} tokens = {self.blocks_per_sequence:,} blocks = "
                f"{self.bytes_per_sequence:,} B ({format_bytes(self.bytes_per_sequence)})",  # type: ignore[arg-type]
                f"sequences       {self.num_sequences:,} full-length sequence(s) fit",
            ]
        return "\n".join(lines)


def plan_config(config: CacheConfig, max_seq_len: int | None = None) -> PlanResult:
    """Plan for an existing config; its budget is ``memory_budget`` or ``num_blocks`` worth."""
    if max_seq_len is not None and (
        isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or not 1 <= max_seq_len < 2**63
    ):
        want = "an int >= 1" if not isinstance(max_seq_len, int) or max_seq_len < 1 else "an int in [1, 2**63)"
        raise InvalidArgumentError(expected("max_seq_len", want, show(max_seq_len)))
    budget = config.memory_budget if config.memory_budget is not None else config.total_bytes
    nb = config.resolved_num_blocks
    per_seq = blocks = exact = fits = None
    specs = config.kv_specs
    bpb, bpt = config.bytes_per_block, config.bytes_per_token
    # each group's spec says what a sequence keeps: a group that releases blocks stops
    # at its window, the others grow with the context
    described = tuple(f"{s.kind} x {len(s.layers)} layers" for s in specs) if config.layer_groups else ()
    per_token = sum(1 for s in specs if not s.releases_blocks) * bpt
    constant = sum(s.blocks_held(2**62) for s in specs if s.releases_blocks) * bpb
    if max_seq_len is not None:
        blocks = sum(s.blocks_held(max_seq_len) for s in specs)
        exact = sum(s.kept_tokens(max_seq_len) for s in specs) * bpt
        per_seq = blocks * bpb
        fits = nb // blocks if blocks else None
    spec = config.state_spec
    state: dict[str, Any] = {}
    if spec is not None:
        one = spec.slot_bytes()
        slots = config.resolved_state_slots
        snaps = None
        if max_seq_len is not None:
            snaps = max_seq_len // (config.state_checkpoint_every * config.block_size)
            by_state = slots // (1 + snaps)       # a live state and its periodic snapshots each
            fits = by_state if fits is None else min(fits, by_state)
        state = dict(state=spec.kind, state_layers=len(spec.layers), state_bytes_per_sequence=one,
                     state_slots=slots, state_pool_bytes=slots * one, snapshots_per_sequence=snaps)
    return PlanResult(
        num_layers=config.num_layers,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        num_attention_heads=config.num_attention_heads,
        block_size=config.block_size,
        dtype=config.dtype,
        kv_dtype=config.cache_dtype,
        layout=config.layout,
        budget_bytes=int(budget),
        bytes_per_token=config.bytes_per_token,
        bytes_per_block=config.bytes_per_block,
        num_blocks=nb,
        num_tokens=nb * config.block_size,
        arena_bytes=config.total_bytes,
        window_bytes=config.window_bytes,
        quantization_saving_bytes=config.quantization_saving_bytes,
        note=config.window_note,
        max_seq_len=max_seq_len,
        blocks_per_sequence=blocks,
        bytes_per_sequence=per_seq,
        exact_bytes_per_sequence=exact,
        num_sequences=fits,
        layer_groups=described,
        context_bytes_per_token=per_token,
        constant_bytes_per_sequence=constant,
        attention=("none" if not config.num_layers else specs[0].kind if len(specs) == 1 else "hybrid"),
        layer_bytes_per_token=specs[0].token_bytes() if specs else 0,
        **state,
    )


def plan(
    model_config: Any,
    budget: int | str,
    max_seq_len: int | None = None,
    *,
    block_size: int = 16,
    dtype: Any = "float16",
    kv_dtype: Any = None,
    layout: str = "NHD",
    attention_sinks: int = 0,
    kv_key_quant: Any = None,
    kv_sink_tokens: Any = None,
    state_budget: int | str | None = None,
    state_slots: int | None = None,
    state_checkpoint_every: int | None = None,
) -> PlanResult:
    """Plan a cache for a model.

    Args:
        model_config: anything :meth:`CacheConfig.from_hf_config` reads (transformers
            config, dict, path to config.json).
        budget: bytes, or a string like ``"4GiB"``.
        max_seq_len: the full sequence length to count sequences of.
        kv_key_quant: int4 only: ``"block"`` for per-channel keys (see :class:`CacheConfig`).
        kv_sink_tokens: leading tokens per sequence kept in model precision (quantized
            caches; default 4 for int4/int3). Their pinned blocks count in the arena bytes.
        state_budget: recurrent-state layers: the state pool's bytes, beside ``budget``.
        state_slots: recurrent-state layers: the state pool's slots (instead of ``state_budget``).
        state_checkpoint_every: recurrent-state layers: blocks between periodic snapshots.
    """
    return plan_config(plan_cache_config(
        model_config, budget, max_seq_len, block_size=block_size, dtype=dtype, kv_dtype=kv_dtype, layout=layout,
        attention_sinks=attention_sinks, kv_key_quant=kv_key_quant, kv_sink_tokens=kv_sink_tokens,
        state_budget=state_budget, state_slots=state_slots, state_checkpoint_every=state_checkpoint_every),
        max_seq_len)


def plan_cache_config(model_config: Any, budget: int | str, max_seq_len: int | None = None, *,
                      state_budget: int | str | None = None, state_slots: int | None = None,
                      state_checkpoint_every: int | None = None, **opts: Any) -> CacheConfig:
    """The config :func:`plan` plans (``opts``: :meth:`CacheConfig.from_hf_config`
    overrides). A model with recurrent-state layers and neither ``state_budget`` nor
    ``state_slots`` gets ``budget`` split: each full-length sequence its blocks, its
    live state and its periodic snapshots (``max_seq_len`` is then required).

    Args:
        model_config: anything :meth:`CacheConfig.from_hf_config` reads.
        budget: bytes, or a string like ``"4GiB"``.
        max_seq_len: the full sequence length to plan for.
        state_budget: the state pool's bytes, beside ``budget``.
        state_slots: the state pool's slots (instead of ``state_budget``).
        state_checkpoint_every: blocks between periodic snapshots.
        opts: further :class:`CacheConfig` fields.
    """
    if state_checkpoint_every is not None:
        opts["state_checkpoint_every"] = state_checkpoint_every
    if state_budget is not None or state_slots is not None:
        state = dict(state_memory_budget=state_budget) if state_slots is None else dict(state_slots=state_slots)
        probe = CacheConfig.from_hf_config(model_config, num_blocks=1, **state, **opts)
        if probe.num_layers:
            return CacheConfig.from_hf_config(model_config, memory_budget=budget, **state, **opts)
        # a model without attention layers: its blocks only count tokens, a max_seq_len per state
        per = -(-max_seq_len // probe.block_size) if max_seq_len is not None else 1
        return CacheConfig.from_hf_config(model_config, num_blocks=max(1, probe.resolved_state_slots * per),
                                          **state, **opts)
    try:
        return CacheConfig.from_hf_config(model_config, memory_budget=budget, **opts)
    except InvalidArgumentError as e:
        if "state_slots" not in str(e):
            raise
    # a model with recurrent-state layers: its shape, then the split
    probe = CacheConfig.from_hf_config(model_config, num_blocks=1, state_slots=1, **opts)
    if max_seq_len is None:
        raise InvalidArgumentError(expected("state_budget", "state_budget or state_slots (or max_seq_len, to split "
                                            "the budget) for a model with recurrent-state layers", None))
    total = parse_bytes(budget, "memory_budget")
    blocks = sum(s.blocks_held(max_seq_len) for s in probe.kv_specs)
    slots = 1 + max_seq_len // (probe.state_checkpoint_every * probe.block_size)
    one = probe.state_spec.slot_bytes()     # type: ignore[union-attr]
    per_seq = blocks * probe.bytes_per_block + slots * one
    n = total // per_seq
    if n < 1:
        raise InvalidArgumentError(expected("budget", f"at least one {max_seq_len}-token sequence "
                                            f"({per_seq:,} B with its states)", f"{total:,} bytes"))
    kv = dict(memory_budget=total - n * slots * one) if probe.num_layers else \
        dict(num_blocks=max(1, n * blocks))     # a model without attention layers: its blocks only count tokens
    return CacheConfig.from_hf_config(model_config, state_slots=n * slots, **kv, **opts)
