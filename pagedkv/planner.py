"""Memory planner: how many blocks, tokens and full-length sequences fit a budget.

The ``pagedkv plan`` command line is :mod:`pagedkv.cli.plan`.

KV bytes per token = 2 (K and V) x layers x kv_heads x head_dim x element bytes, plus,
for quantized storage, one float32 scale (and for int8 one float32 zero point) per
(K/V, layer, kv head).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional, Union

from pagedkv.config import CacheConfig, format_bytes
from pagedkv.errors import InvalidArgumentError, expected

__all__ = ["PlanResult", "plan", "plan_config"]


@dataclass(frozen=True)
class PlanResult:
    """What fits a memory budget. All sizes in bytes; sequences are block-rounded."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_attention_heads: Optional[int]
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
    max_seq_len: Optional[int]
    blocks_per_sequence: Optional[int]  # ceil(max_seq_len / block_size)
    bytes_per_sequence: Optional[int]  # blocks_per_sequence * bytes_per_block
    exact_bytes_per_sequence: Optional[int]  # max_seq_len * bytes_per_token (no rounding)
    num_sequences: Optional[int]  # full-length sequences that fit at once

    def to_dict(self) -> dict:
        return asdict(self)

    def format(self) -> str:
        """A short human-readable report."""
        heads = f" ({self.num_attention_heads} attention heads)" if self.num_attention_heads else ""
        kv = self.kv_dtype if self.kv_dtype == self.dtype else f"{self.kv_dtype} (model dtype {self.dtype})"
        lines = [
            f"model           {self.num_layers} layers, {self.num_kv_heads} kv heads x {self.head_dim} head dim{heads}",
            f"cache           {kv}, block size {self.block_size}, layout {self.layout}",
            f"bytes/token     {self.bytes_per_token:,} B ({format_bytes(self.bytes_per_token)})",
            f"bytes/block     {self.bytes_per_block:,} B ({format_bytes(self.bytes_per_block)})",
            f"budget          {self.budget_bytes:,} B ({format_bytes(self.budget_bytes)})",
            f"blocks          {self.num_blocks:,} ({format_bytes(self.arena_bytes)} used)",
            f"tokens          {self.num_tokens:,}",
        ]
        if self.max_seq_len is not None:
            lines += [
                f"one sequence    {self.max_seq_len:,} tokens = {self.blocks_per_sequence:,} blocks = "
                f"{self.bytes_per_sequence:,} B ({format_bytes(self.bytes_per_sequence)})",
                f"sequences       {self.num_sequences:,} full-length sequence(s) fit",
            ]
        return "\n".join(lines)


def plan_config(config: CacheConfig, max_seq_len: Optional[int] = None) -> PlanResult:
    """Plan for an existing config; its budget is ``memory_budget`` or ``num_blocks`` worth."""
    if max_seq_len is not None and (
        isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 1
    ):
        raise InvalidArgumentError(expected("max_seq_len", "an int >= 1", repr(max_seq_len)))
    budget = config.memory_budget if config.memory_budget is not None else config.total_bytes
    nb = config.resolved_num_blocks
    per_seq = blocks = exact = fits = None
    if max_seq_len is not None:
        blocks = config.blocks_for_tokens(max_seq_len)
        per_seq = blocks * config.bytes_per_block
        exact = max_seq_len * config.bytes_per_token
        fits = nb // blocks
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
        max_seq_len=max_seq_len,
        blocks_per_sequence=blocks,
        bytes_per_sequence=per_seq,
        exact_bytes_per_sequence=exact,
        num_sequences=fits,
    )


def plan(
    model_config: Any,
    budget: Union[int, str],
    max_seq_len: Optional[int] = None,
    *,
    block_size: int = 16,
    dtype: Any = "float16",
    kv_dtype: Any = None,
    layout: str = "NHD",
) -> PlanResult:
    """Plan a cache for a model.

    Args:
        model_config: anything :meth:`CacheConfig.from_hf_config` reads (transformers
            config, dict, path to config.json).
        budget: bytes, or a string like ``"4GiB"``.
        max_seq_len: the full sequence length to count sequences of.
    """
    cfg = CacheConfig.from_hf_config(
        model_config, memory_budget=budget, block_size=block_size, dtype=dtype, kv_dtype=kv_dtype, layout=layout
    )
    return plan_config(cfg, max_seq_len)
