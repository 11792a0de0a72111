"""Launch plan of paged attention (cuda/paged_attention.cu).

:func:`plan_paged_attention` validates a call of :func:`pagedkv.ops.paged_attention`
(the public op's checks, :func:`pagedkv.format.attention_checks.check_attention_args`,
plus what the kernels add: a contiguous arena, a dense head_dim in ``q``, aligned
pointers), picks the kernel
and its tiling, and returns the :class:`~pagedkv.kernels.plans.Launch` records that
the CUDA launcher (:mod:`pagedkv.kernels.ops`) and the host emulation
(:mod:`pagedkv.kernels.emulation`) both run.

Tiling. A CTA holds, in PKV_ATTN_FLOATS shared floats, its R query rows (once as
given, once rotated when the arena is, and their float32 accumulators), one tile of
T keys and values, and the R x T logits. R = q_tile tokens x heads_per_cta query
heads of one KV head: the decode kernel takes one token and the whole GQA group; the
prefill kernel a tile of tokens. T and the tile shrink until the buffers fit.

Splits (flash-decoding). Each tile's visible keys are cut into ``num_splits`` ranges,
one CTA each; with more than one, every split writes its float32 (acc, max, sum)
and a merge kernel combines them exactly. ``num_splits=None`` picks enough splits
to give the GPU about four CTAs per SM, at most one per 256 keys of the average
sequence (estimated from the table sizes, so nothing is read from the device).

Index values that live on a GPU are not read (that would sync): the kernel reads a
bad entry as zeros and skips a query tile it cannot place. Index tensors on the CPU
are checked like the public op checks them (and copied first, so the checks and the
kernel see the same values; a GPU's are neither read nor copied).

One query per sequence goes to the decode kernel (cuda/decode_attention.cu,
:mod:`pagedkv.kernels.decode_plans`) wherever it covers the call; this module's tiled
kernel serves the rest (``kernel=`` picks one explicitly).
"""
from __future__ import annotations

import torch

from pagedkv.errors import InvalidArgumentError, ShapeError, expected
from pagedkv.format.attention_checks import check_attention_args
from pagedkv.kernels import decode_plans, sources
from pagedkv.kernels.plans import (
    _MODEL_NAMES,
    _QUANT_NAMES,
    MAX_GRID_X,
    MAX_GRID_Y,
    Launch,
    _check_aligned,
    _check_contiguous,
    _check_kernel_dtype,
    _check_rows,
    _check_signs,
    _i64,
    _ptr,
    _rot_dims,
)

__all__ = ["ATTN_FLOATS", "ATTN_MAX_TILE", "ATTN_MAX_ROWS", "ATTN_THREADS", "DEFAULT_SMS", "Tiling",
           "tiling", "auto_splits", "plan_paged_attention"]

ATTN_FLOATS = 11264  # cuda/paged_attention.cu PKV_ATTN_FLOATS
ATTN_MAX_TILE = 64   # PKV_ATTN_MAX_TILE: keys per tile
ATTN_MAX_ROWS = 64   # PKV_ATTN_MAX_ROWS: query rows per CTA
ATTN_THREADS = 128
DEFAULT_SMS = 108    # the SM count a plan assumes off a GPU (an A100's): the emulation runs GPU plans
SPLIT_MIN_KEYS = 256  # auto splits: no split gets fewer keys of the average sequence than this
MAX_SPLITS = 64
PREFILL_ROWS = 16    # prefill: query rows per CTA to aim for
#: the K/V storage name of an entry point -> its format macro in paged_attention.cu
_KV_MACROS = sources.KV_MACROS


class Tiling(tuple):
    """``(mode, heads_per_cta, q_tile, kv_tile)``."""

    __slots__ = ()

    def __new__(cls, mode: str, heads_per_cta: int, q_tile: int, kv_tile: int):
        return super().__new__(cls, (mode, heads_per_cta, q_tile, kv_tile))

    mode = property(lambda self: self[0])
    heads_per_cta = property(lambda self: self[1])
    q_tile = property(lambda self: self[2])
    kv_tile = property(lambda self: self[3])


def _fits(rows: int, tile: int, head_dim: int, rotated: bool) -> bool:
    ks = head_dim | 1
    need = (3 if rotated else 2) * rows * head_dim + 2 * tile * ks + rows * tile + 3 * rows
    return need <= ATTN_FLOATS and rows <= ATTN_MAX_ROWS and tile <= ATTN_MAX_TILE


def tiling(decode: bool, group: int, head_dim: int, rotated: bool) -> Tiling:
    """The largest tiling whose buffers fit the CTA's shared memory (see the module)."""
    heads = min(group, ATTN_MAX_ROWS)
    q_tile = 1 if decode else max(1, PREFILL_ROWS // heads)
    tile = 32
    while not _fits(heads * q_tile, tile, head_dim, rotated):
        if tile > 8:
            tile //= 2
        elif q_tile > 1:
            q_tile //= 2
        elif heads > 1:
            heads = -(-heads // 2)
        elif tile > 1:
            tile //= 2
        else:
            raise ShapeError(expected("q", f"a head_dim the attention kernels hold in shared memory "
                                      f"(<= {max_head_dim(rotated)})", head_dim))
    return Tiling("decode" if decode else "prefill", heads, q_tile, tile)


def max_head_dim(rotated: bool) -> int:
    d = 1
    while _fits(1, 1, d + 1, rotated):
        d += 1
    return d


def auto_splits(works: int, avg_keys: int, num_sms: int) -> int:
    """Splits per tile: about four CTAs per SM (as many as fit one SM's shared memory at
    ~46 KiB each, so that their loads overlap), at most one per SPLIT_MIN_KEYS keys."""
    want = -(-4 * num_sms // max(1, works))
    return max(1, min(want, avg_keys // SPLIT_MIN_KEYS, MAX_SPLITS))


# ----------------------------------------------------------------------------------
# the plan


def plan_paged_attention(q, kv_layer, indptr, indices, seq_lens, q_indptr, *, layout="NHD", kv_scale=None,
                         kv_zero=None, key_scale=None, key_zero=None, rotation_signs=None, sm_scale=None,
                         soft_cap=None, window=None, sink_tokens=0, num_splits=None, out=None, exact_rows=None,
                         layer_format=None, num_sms: int = DEFAULT_SMS, kernel: str = "auto",
                         workspace=None) -> tuple[list[Launch], torch.Tensor]:
    """Plan :func:`pagedkv.ops.paged_attention` (same arguments); returns ``(launches, out)``.

    ``num_sms``: the device's SM count, for the automatic ``num_splits``. ``kernel``:
    ``"auto"`` takes the decode kernel (:mod:`pagedkv.kernels.decode_plans`) where it
    covers the call, else the tiled one; ``"decode"`` insists on it (an error where it
    does not cover the call); ``"tiled"`` takes paged_attention.cu. ``workspace``: the
    decode kernel's float32 scratch (``decode_plans.workspace_floats``), allocated when None.
    """
    if kernel not in ("auto", "decode", "tiled"):
        raise InvalidArgumentError(expected("kernel", "'auto', 'decode' or 'tiled'", repr(kernel)))
    a = check_attention_args(q, kv_layer, indptr, indices, seq_lens, q_indptr, layout=layout, kv_scale=kv_scale,
                             kv_zero=kv_zero, key_scale=key_scale, key_zero=key_zero,
                             rotation_signs=rotation_signs, sm_scale=sm_scale, soft_cap=soft_cap, window=window,
                             sink_tokens=sink_tokens, num_splits=num_splits, out=out, layer_format=layer_format,
                             snapshot_on_cpu=False)   # a GPU's table values are not read (that would sync)
    geo, q, out, batch, sm_scale, soft_cap = a.geo, a.q, a.out, a.batch, a.sm_scale, a.soft_cap
    window, sink_tokens, num_splits = a.window, a.sink_tokens, a.num_splits
    indptr, indices, seq_lens, q_indptr = a.indptr, a.indices, a.seq_lens, a.q_indptr
    num_q, hq, d = q.shape
    device = kv_layer.device
    # what the kernels add: the rotating kernels' head_dim bound, aligned pointers, the grid
    signs = _check_signs(rotation_signs, geo, device, explicit=layer_format is not None)
    if a.key_channels:
        _check_aligned("key_scale", key_scale)
        _check_aligned("key_zero", key_zero)
    if num_splits is not None and num_splits > MAX_GRID_X:
        raise InvalidArgumentError(expected("num_splits", f"None or an int in [1, {MAX_GRID_X}]", num_splits))
    if exact_rows is not None:
        raise InvalidArgumentError(expected("exact_rows", "None for the CUDA kernels (the model-precision window "
                                            "overlay runs on the 'cpu' and 'reference' backends)", "an ExactRows"))
    _check_kernel_dtype(geo)
    _check_contiguous("kv_layer", kv_layer)
    if geo.quantized:
        _check_contiguous("kv_scale", kv_scale)
        if kv_zero is not None:
            _check_contiguous("kv_zero", kv_zero)
    _check_rows("q", q)
    _check_aligned("q", q)
    if out is None:
        out = torch.empty((num_q, hq, d), dtype=q.dtype, device=device)
    else:
        _check_aligned("out", out)
    if num_q == 0 or batch == 0:
        return [], out

    group = hq // geo.num_heads
    decode = num_q == batch  # one query per sequence (any split of them is still served right)
    kv_type = _QUANT_NAMES[geo.kv_dtype] if geo.quantized else _MODEL_NAMES[kv_layer.dtype]  # type: ignore[index]  # quantized: named
    fast = None
    if kernel != "tiled" and decode and key_scale is None:
        fast = decode_plans.covers(geo, kv_layer, kv_scale, kv_zero, kv_type, group)
    if fast is not None:
        return decode_plans.plan_decode(
            fast, q=q, kv_layer=kv_layer, layout=layout, kv_scale=kv_scale, kv_zero=kv_zero, signs=signs, out=out,
            indptr=indptr, indices=indices, seq_lens=seq_lens, q_indptr=q_indptr, geo=geo, batch=batch,
            sm_scale=sm_scale, soft_cap=soft_cap, window=window, sink_tokens=sink_tokens, num_splits=num_splits,
            num_sms=num_sms, workspace=workspace, keep=(indptr, indices, seq_lens, q_indptr, signs)), out
    if kernel == "decode":
        raise InvalidArgumentError(expected(
            "kernel", "'auto' or 'tiled' for this call (the decode kernel covers one query per sequence, "
            "head_dim 64/128/256, no block keys, aligned rows: see pagedkv.kernels.decode_plans)", "'decode'"))
    tl = tiling(decode, group, d, signs is not None)
    chunks = -(-group // tl.heads_per_cta)
    keep = [indptr, indices, seq_lens, q_indptr]
    if decode:
        tiles, tile_ends = num_q, None
    else:
        q_lens = (q_indptr[1:] - q_indptr[:-1]).clamp(min=0).to(torch.int64)
        tile_ends = torch.cumsum(-(-q_lens // tl.q_tile), 0)  # inclusive; on the tables' device, no sync
        tiles = min(num_q, -(-num_q // tl.q_tile) + batch)
        keep.append(tile_ends)
    works = tiles * geo.num_heads * chunks
    if num_splits is None:
        avg = indices.shape[0] * geo.block_size // batch
        if window is not None:
            avg = min(avg, window + sink_tokens)
        num_splits = auto_splits(works, avg, num_sms)
    part_o = part_ml = None
    if num_splits > 1:
        part_o = torch.empty((num_splits, num_q, hq, d), dtype=torch.float32, device=device)
        part_ml = torch.empty((num_splits, num_q, hq, 2), dtype=torch.float32, device=device)
        keep += [part_o, part_ml]
    if signs is not None:
        keep.append(signs)
    q_type = _MODEL_NAMES[q.dtype]
    name = sources.attention_name(tl.mode, layout.lower(), kv_type, q_type)
    args = [_ptr(kv_layer), _ptr(kv_scale), _ptr(kv_zero), _ptr(key_scale), _ptr(key_zero), _ptr(signs), _ptr(q),
            _ptr(out), _ptr(part_o), _ptr(part_ml), _ptr(indptr), _ptr(indices), _ptr(seq_lens), _ptr(q_indptr),
            _ptr(tile_ends), _i64(batch), _i64(indices.shape[0]), _i64(geo.num_blocks), _i64(geo.block_size),
            _i64(geo.num_heads), _i64(d), _i64(geo.groups), _i64(num_q),
            _i64(hq), _i64(q.stride(0)), _i64(q.stride(1)), _i64(tl.heads_per_cta), _i64(tl.q_tile),
            _i64(tl.kv_tile), _i64(num_splits), _i64(tiles), ("f32", sm_scale), ("f32", soft_cap or 0.0),
            _i64(window or 0), _i64(sink_tokens)]
    grid = (min(num_splits, MAX_GRID_X), min(works, MAX_GRID_Y), 1)
    # one storage format's entries at a time (paged_attention.cu, PKV_ATTN_KV); the merge
    # kernels are in every part
    defines = (("PKV_ATTN_KV", _KV_MACROS[kv_type]),)
    launches = [Launch("paged_attention.cu", name, grid, (ATTN_THREADS, 1, 1), tuple(args), tuple(keep), defines)]
    if num_splits > 1:
        rows = num_q * hq
        mgrid, mblock = _rot_dims(rows, d, d)
        margs = [_ptr(part_o), _ptr(part_ml), _ptr(signs), _ptr(out), _i64(rows), _i64(d), _i64(num_splits)]
        launches.append(Launch("paged_attention.cu", sources.attention_merge_name(q_type), mgrid, mblock,
                               tuple(margs), tuple(keep), defines))
    return launches, out
