"""Launch plans of the MLA latent kernels (``cuda/latent_rows.cu``, ``cuda/latent_attention.cu``).

Each plan runs the public op's checks (:mod:`pagedkv.format.latent_checks`: the same
errors on every backend), then what the kernels add (contiguous arena, aligned
tensors, a variant for the dtypes), and returns :class:`~pagedkv.kernels.plans.Launch`
records that the CUDA launchers (:mod:`pagedkv.kernels.ops`) and the host emulation
(:mod:`pagedkv.kernels.emulation`) both execute. Index values on a GPU are not read
(no sync): the kernels skip or zero-fill what is out of range. CPU tensors (the
emulation) are checked like the reference.
"""
from __future__ import annotations

import torch

from pagedkv.errors import DTypeError, expected
from pagedkv.format import dtypes
from pagedkv.format import latent_checks as ref
from pagedkv.kernels import sources
from pagedkv.kernels.attention_plans import DEFAULT_SMS, auto_splits
from pagedkv.kernels.plans import (
    MAX_GRID_X,
    MAX_GRID_Y,
    ROT_FLOATS,
    Launch,
    _check_aligned,
    _i64,
    _launch,
    _ptr,
    _rot_dims,
)

__all__ = ["LATENT_FLOATS", "LATENT_THREADS", "plan_write_latent", "plan_gather_latent", "plan_mla_attention",
           "latent_tiling"]

LATENT_FLOATS = 11264  # cuda/latent_attention.cu PKV_LATENT_FLOATS
LATENT_THREADS = 256
MAX_HEADS_PER_CTA = 16
MAX_KV_TILE = 16

_MODEL = {d.torch_dtype: d.kernel_name for d in dtypes.MODEL}


def _format_name(view) -> str:
    f = view.format
    return sources.latent_format_name(f.row.kernel_name, dtypes.info(f.rope_dtype).kernel_name)


def _layout(view) -> list:
    f = view.format
    return [_i64(f.kv_lora_rank), _i64(f.rope_dim), _i64(f.group_size or 1), _i64(f.row_bytes),
            _i64(f.scale_offset), _i64(f.zero_offset), _i64(f.rope_offset)]


def plan_write_latent(view, slot_mapping, kv_c, k_pe) -> list[Launch]:
    """Plan :func:`pagedkv.ops.latent.write_latent`: one thread per (token, unit)."""
    host = view.data.device.type == "cpu" if hasattr(view, "data") and isinstance(view.data, torch.Tensor) else True
    view = ref.check_write(view, slot_mapping, kv_c, k_pe, read_values=host)
    f = view.format
    n = slot_mapping.shape[0]
    _check_aligned("kv_c", kv_c)
    _check_aligned("k_pe", k_pe)
    if n == 0:
        return []
    units = f.groups + f.rope_dim if f.quantized else f.width
    name = sources.latent_write_name(_MODEL[kv_c.dtype], _format_name(view))
    slots = slot_mapping.contiguous()
    args = [_ptr(view.data), _ptr(slots), _ptr(kv_c), _ptr(k_pe), _i64(n), _i64(kv_c.stride(0)),
            _i64(k_pe.stride(0))] + _layout(view) + [_i64(view.num_slots)]
    return [_launch("latent_rows.cu", name, n, units, args, (slots,))]


def plan_gather_latent(view, indptr, indices, seq_lens, *, out_dtype=None):
    """Plan :func:`pagedkv.ops.latent.gather_latent`; returns ``(launches, kv_c, k_pe)``.
    The output size is ``seq_lens.sum()``, a sync when the tables are on a GPU."""
    host = isinstance(getattr(view, "data", None), torch.Tensor) and view.data.device.type == "cpu"
    view, tables, out_dtype = ref.check_gather(view, indptr, indices, seq_lens, out_dtype, read_values=host)
    f, device = view.format, view.data.device
    lens = tables.seq_lens.contiguous()
    total = tables.total if tables.total is not None else int(lens.sum())
    kv_c = torch.empty((total, f.kv_lora_rank), dtype=out_dtype, device=device)
    k_pe = torch.empty((total, f.rope_dim), dtype=out_dtype, device=device)
    if total == 0 or tables.batch == 0:
        return [], kv_c, k_pe
    cu = torch.zeros(tables.batch + 1, dtype=torch.int64, device=device)
    torch.cumsum(lens, 0, dtype=torch.int64, out=cu[1:])
    indptr_c, indices_c = tables.indptr.contiguous(), tables.indices.contiguous()
    name = sources.latent_gather_name(_format_name(view), _MODEL[out_dtype])
    args = [_ptr(view.data), _ptr(indptr_c), _ptr(indices_c), _ptr(cu), _ptr(kv_c), _ptr(k_pe), _i64(tables.batch),
            _i64(total)] + _layout(view) + [_i64(view.block_size), _i64(indices_c.shape[0]), _i64(view.num_blocks)]
    return [_launch("latent_rows.cu", name, total, f.width, args, (indptr_c, indices_c, cu, lens))], kv_c, k_pe


def latent_tiling(heads: int, width: int, rank: int) -> tuple[int, int]:
    """``(heads_per_cta, kv_tile)``: the most heads (then keys) whose buffers fit the
    CTA's shared floats: ``kv_tile * width + heads * (kv_tile + rank + 3)``."""
    ht = min(heads, MAX_HEADS_PER_CTA)
    while True:
        kt = MAX_KV_TILE
        while kt > 1 and kt * width + ht * (kt + rank + 3) > LATENT_FLOATS:
            kt //= 2
        if kt * width + ht * (kt + rank + 3) <= LATENT_FLOATS:
            return ht, kt
        if ht == 1:
            raise DTypeError(expected("view", f"a latent row the attention kernel holds in shared memory "
                                      f"(kv_lora_rank + rope_dim <= {LATENT_FLOATS // 2})", width))
        ht = -(-ht // 2)


def plan_mla_attention(view, q_nope, q_pe, indptr, indices, seq_lens, q_indptr, *, sm_scale, num_splits=None,
                       out=None, num_sms: int = DEFAULT_SMS) -> tuple[list[Launch], torch.Tensor]:
    """Plan :func:`pagedkv.ops.latent.mla_attention`; returns ``(launches, out)``."""
    host = isinstance(getattr(view, "data", None), torch.Tensor) and view.data.device.type == "cpu"
    a = ref.check_attention(view, q_nope, q_pe, indptr, indices, seq_lens, q_indptr, sm_scale, num_splits, out,
                            read_values=host)
    view, f, device = a.view, a.view.format, a.view.data.device
    q_type = _MODEL[q_nope.dtype]
    if not f.quantized and q_nope.dtype != f.storage_dtype:
        raise DTypeError(expected("q_nope", f"dtype {f.storage_dtype} (the latent rows' dtype)", q_nope.dtype))
    if f.quantized and f.kv_dtype != "fp8_e4m3" and q_nope.dtype != dtypes.info(f.rope_dtype).torch_dtype:
        raise DTypeError(expected("q_nope", f"dtype {f.rope_dtype} (the model dtype of the {f.kv_dtype} rows)",
                                  q_nope.dtype))
    for name, t in (("q_nope", q_nope), ("q_pe", q_pe)):
        _check_aligned(name, t)
    out = a.out
    if out is None:
        out = torch.empty((a.num_q, a.heads, f.kv_lora_rank), dtype=q_nope.dtype, device=device)
    else:
        _check_aligned("out", out)
    batch = a.tables.batch
    if a.num_q == 0 or batch == 0:
        return [], out
    ht, kt = latent_tiling(a.heads, f.width, f.kv_lora_rank)
    works = a.num_q * -(-a.heads // ht)
    splits = a.num_splits
    if splits is None:
        avg = a.tables.indices.shape[0] * view.block_size // batch
        splits = auto_splits(works, avg, num_sms)
    if f.kv_lora_rank > ROT_FLOATS:      # the merge holds a whole output row in shared memory
        splits = 1
    splits = min(splits, MAX_GRID_X)
    t = a.tables
    indptr_c, indices_c, lens_c, qp_c = (x.contiguous() for x in (t.indptr, t.indices, t.seq_lens, a.q_indptr))
    keep: list = [indptr_c, indices_c, lens_c, qp_c]
    part_o = part_ml = None
    if splits > 1:
        part_o = torch.empty((splits, a.num_q, a.heads, f.kv_lora_rank), dtype=torch.float32, device=device)
        part_ml = torch.empty((splits, a.num_q, a.heads, 2), dtype=torch.float32, device=device)
        keep += [part_o, part_ml]
    name = sources.latent_attention_name(_format_name(view), q_type)
    args = [_ptr(view.data), _ptr(q_nope), _ptr(q_pe), _ptr(out), _ptr(part_o), _ptr(part_ml), _ptr(indptr_c),
            _ptr(indices_c), _ptr(lens_c), _ptr(qp_c), _i64(a.num_q), _i64(a.heads), _i64(batch)] + _layout(view)
    args += [_i64(view.block_size), _i64(indices_c.shape[0]), _i64(view.num_blocks), _i64(q_nope.stride(0)),
             _i64(q_nope.stride(1)), _i64(q_pe.stride(0)), _i64(q_pe.stride(1)), _i64(ht), _i64(kt), _i64(splits),
             ("f32", a.sm_scale)]
    grid = (splits, min(works, MAX_GRID_Y), 1)
    launches = [Launch("latent_attention.cu", name, grid, (LATENT_THREADS, 1, 1), tuple(args), tuple(keep))]
    if splits > 1:
        rows, r = a.num_q * a.heads, f.kv_lora_rank
        mgrid, mblock = _rot_dims(rows, r, r)
        margs = [_ptr(part_o), _ptr(part_ml), _ptr(None), _ptr(out), _i64(rows), _i64(r), _i64(splits)]
        launches.append(Launch("paged_attention.cu", sources.attention_merge_name(q_type), mgrid, mblock,
                               tuple(margs), tuple(keep), (("PKV_ATTN_KV", "PKV_F_F32"),)))
    return launches, out
