"""Launch plan of the decode kernel (cuda/decode_attention.cu), the fast path of
:func:`pagedkv.kernels.attention_plans.plan_paged_attention`.

The decode kernel serves one query token per CTA row of work, streaming its sequence's
K/V once through a cp.async ring; it is compiled one variant at a time, specialized on
the storage format, head_dim, the query heads a CTA serves (a divisor of the GQA
group) and the scale groups one lane holds. :func:`decode_variant` says whether a call
is covered, :func:`plan_decode` builds the two launches (the splits, then their merge),
and everything here mirrors the kernel's compile-time geometry
(``decode_attention.cuh``): a lane holds ``E`` consecutive channels
(:func:`lane_elems`), ``D / E`` lanes a key.

What the fast path does not cover goes to the tiled kernel (paged_attention.cu):
prefill tiles (more than one query per sequence in a call), int4 block keys, head_dim
other than 64, 128 or 256, float32 K/V at head_dim 256, scale groups that a lane's
channels do not tile, and arenas whose rows or parameters are not aligned for the
ring's vector copies.

Splits are sized to whole waves: ``num_sms * CTAS_PER_SM`` CTAs run at once, and the
split count (at most one per :data:`SPLIT_MIN_KEYS` keys of the longest sequence the
tables can hold) is the one that wastes the least of the last wave.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from pagedkv.errors import InvalidArgumentError, ShapeError, expected
from pagedkv.kernels import sources
from pagedkv.kernels.plans import MAX_GRID_X, MAX_GRID_Y, Launch, _i64, _ptr

__all__ = ["BITS", "HEAD_DIMS", "DecodeVariant", "lane_elems", "decode_variant", "auto_splits", "fastdiv",
           "workspace_floats", "plan_decode"]

#: bits per stored element of each K/V storage name
BITS = {"f32": 32, "f16": 16, "bf16": 16, "e4m3": 8, "e5m2": 8, "int8": 8, "int4": 4, "int3": 3}
HEAD_DIMS = (64, 128, 256)
HEADS = (8, 4, 3, 2, 1)  # query heads per CTA, the largest that divides the group first
QREGS = 32               # PKV_DEC_QREGS: at most G * E query floats per thread
WARPS = 4                # PKV_DEC_WARPS
THREADS = 128            # PKV_DEC_THREADS
CTAS_PER_SM = 3          # PKV_DEC_MIN_CTAS: the register cap keeps room for three CTAs
SPLIT_MIN_KEYS = 256
MAX_SPLITS = 64
MERGE_THREADS = 128
_QUANT = ("e4m3", "e5m2", "int8", "int4", "int3")
_Q_KIND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


class DecodeVariant(NamedTuple):
    """One compiled variant: the storage name, head_dim, heads per CTA, lane scale groups."""

    kv_type: str
    head_dim: int
    heads: int
    lane_groups: int

    @property
    def lane_elems(self) -> int:
        return lane_elems(self.kv_type, self.heads)

    @property
    def vector_bytes(self) -> int:
        """The bytes one lane copies per row (int3: three 4-byte words)."""
        return 12 if self.kv_type == "int3" else self.lane_elems * BITS[self.kv_type] // 8

    def defines(self, layout: str) -> tuple[tuple[str, str], ...]:
        return _defines(self, layout.lower())

    def name(self, layout: str) -> str:
        return sources.decode_name(layout.lower(), self.kv_type, self.head_dim, self.heads, self.lane_groups)


@functools.lru_cache(maxsize=256)
def _defines(variant: DecodeVariant, lo: str) -> tuple[tuple[str, str], ...]:
    return (("PKV_DEC_F", sources.KV_MACROS[variant.kv_type]), ("PKV_DEC_D", str(variant.head_dim)),
            ("PKV_DEC_G", str(variant.heads)), ("PKV_DEC_NGL", str(variant.lane_groups)),
            ("PKV_DEC_LAYOUT", "PKV_NHD" if lo == "nhd" else "PKV_HND"), ("PKV_DEC_NAME", variant.name(lo)))


def lane_elems(kv_type: str, heads: int) -> int:
    """pkv_dec_lane_elems: a 16-byte vector, halved while ``heads * E`` query floats
    exceed QREGS (down to 4 bytes); int3 always 32 codes."""
    if kv_type == "int3":
        return 32
    bits = BITS[kv_type]
    e = 128 // bits
    while e * heads > QREGS and e * bits > 32:
        e //= 2
    return e


def _fits(kv_type: str, d: int, heads: int, g_len: int) -> int | None:
    """The lane scale groups of a covered (format, head_dim, heads, group length), else None."""
    e = lane_elems(kv_type, heads)
    lanes = d // e
    if d % e or lanes > 32 or lanes & (lanes - 1) or heads * e > QREGS:
        return None
    ngl = 1
    if kv_type in ("int4", "int3"):
        if g_len % e == 0:
            ngl = 1
        elif e % g_len == 0 and e // g_len in (2, 4):
            ngl = e // g_len
        else:
            return None
    return ngl


@functools.lru_cache(maxsize=1024)
def decode_variant(kv_type: str, head_dim: int, group: int, groups: int = 1) -> DecodeVariant | None:
    """The variant that serves a GQA ``group`` at ``head_dim`` (``groups`` scale groups a
    row), or None when the decode kernel does not cover it."""
    if head_dim not in HEAD_DIMS or kv_type not in BITS or groups < 1 or head_dim % groups:
        return None
    g_len = head_dim // groups
    for heads in HEADS:
        if group % heads == 0:
            ngl = _fits(kv_type, head_dim, heads, g_len)
            if ngl is not None:
                return DecodeVariant(kv_type, head_dim, heads, ngl)
    return None


@functools.lru_cache(maxsize=1024)
def auto_splits(works: int, max_keys: int, num_sms: int) -> int:
    """Splits per work item: the count in [1, max_keys / SPLIT_MIN_KEYS] whose CTAs fill the
    last of their waves best (``num_sms * CTAS_PER_SM`` CTAs a wave), the fewest on a tie."""
    slots = max(1, num_sms * CTAS_PER_SM)
    top = max(1, min(MAX_SPLITS, max_keys // SPLIT_MIN_KEYS))
    best, best_fill = 1, -1.0
    for s in range(1, top + 1):
        ctas = works * s
        fill = ctas / (math.ceil(ctas / slots) * slots)
        if fill > best_fill + 1e-9:
            best, best_fill = s, fill
    return best


def fastdiv(d: int) -> tuple[int, int]:
    """(mul, shift) of pkv_fastdiv for a divisor 1 <= d < 2^31 (shift -1: d == 1)."""
    if d == 1:
        return 0, -1
    p = 31 + (d - 1).bit_length()  # 31 + ceil(log2 d)
    return -(-(1 << p) // d), p - 32


def workspace_floats(num_splits: int, num_q_tokens: int, num_q_heads: int, head_dim: int) -> int:
    """Float32 elements of the workspace a decode call needs: each split's rows, D + 2 each."""
    return num_splits * num_q_tokens * num_q_heads * (head_dim + 2)


def _aligned(t: torch.Tensor | None, a: int) -> bool:
    return t is None or t.data_ptr() % a == 0


def covers(geo, kv_layer, kv_scale, kv_zero, kv_type: str, group: int) -> DecodeVariant | None:
    """The variant for this layer when its tensors are aligned for the ring's copies."""
    v = decode_variant(kv_type, geo.head_dim, group, geo.groups if kv_type in ("int4", "int3") else 1)
    if v is None:
        return None
    row_bytes = geo.head_dim * 3 // 8 if kv_type == "int3" else geo.head_dim * BITS[kv_type] // 8
    vb = 4 if kv_type == "int3" else v.vector_bytes
    if row_bytes % vb or not _aligned(kv_layer, vb):
        return None
    if kv_type == "int3":  # each bfloat16 parameter is copied as the aligned word holding it
        for t in (kv_scale, kv_zero):
            if t is None or not _aligned(t, 4) or t.numel() % 2:
                return None
    return v


def plan_decode(variant: DecodeVariant, *, q, kv_layer, layout, kv_scale, kv_zero, signs, out, indptr, indices,
                seq_lens, q_indptr, geo, batch: int, sm_scale: float, soft_cap: float | None, window: int | None,
                sink_tokens: int, num_splits: int | None, num_sms: int, workspace=None,
                keep=()) -> list[Launch]:
    """The decode launches of a validated call (see plan_paged_attention)."""
    num_q, hq, d = q.shape
    group = hq // geo.num_heads
    chunks = group // variant.heads
    works = num_q * geo.num_heads * chunks
    if num_splits is None:
        longest = indices.shape[0] * geo.block_size  # no sync: the tables' capacity bounds the keys
        if window is not None:
            longest = min(longest, window + sink_tokens)
        num_splits = auto_splits(works, longest, num_sms)
    need = workspace_floats(num_splits, num_q, hq, d)
    if workspace is None:
        workspace = torch.empty(need, dtype=torch.float32, device=kv_layer.device)
    elif (not isinstance(workspace, torch.Tensor) or workspace.dtype != torch.float32
          or workspace.device != kv_layer.device or not workspace.is_contiguous()):
        raise InvalidArgumentError(expected("workspace", f"a contiguous float32 tensor on {kv_layer.device}",
                                            f"{getattr(workspace, 'dtype', type(workspace).__name__)}"))
    elif workspace.numel() < need:
        raise ShapeError(expected("workspace", f"at least {need} float32 elements "
                                  f"(decode_plans.workspace_floats)", workspace.numel()))
    mul, shift = fastdiv(geo.block_size)
    args = [_ptr(kv_layer), _ptr(kv_scale), _ptr(kv_zero), _ptr(signs), _ptr(q), ("i32", _Q_KIND[q.dtype]),
            _ptr(workspace), _ptr(indptr), _ptr(indices), _ptr(seq_lens), _ptr(q_indptr), _i64(batch),
            _i64(indices.shape[0]), _i64(geo.num_blocks), _i64(geo.block_size), _i64(geo.num_heads),
            _i64(geo.groups), _i64(num_q), _i64(hq), _i64(q.stride(0)), _i64(q.stride(1)), _i64(num_splits),
            ("f32", sm_scale), ("f32", soft_cap or 0.0), _i64(window or 0), _i64(sink_tokens), _i64(mul),
            _i64(shift)]
    keep = tuple(keep) + (workspace,)
    defines = variant.defines(layout)
    grid = (min(num_splits, MAX_GRID_X), min(works, MAX_GRID_Y), 1)
    rows = num_q * hq
    merge_grid = (max(1, min(-(-rows // (MERGE_THREADS // 32)), MAX_GRID_X)), 1, 1)
    from pagedkv.kernels.plans import _MODEL_NAMES

    margs = [_ptr(workspace), _ptr(signs), _ptr(out), _i64(rows), _i64(num_splits)]
    return [Launch("decode_attention.cu", variant.name(layout), grid, (THREADS, 1, 1), tuple(args), keep, defines),
            Launch("decode_attention.cu", sources.decode_merge_name(_MODEL_NAMES[q.dtype]), merge_grid,
                   (MERGE_THREADS, 1, 1), tuple(margs), keep, defines)]
