"""The CPU backend of :func:`pagedkv.ops.paged_attention`: a checked call to the C loops.

The loops (:mod:`pagedkv.ops._cpu_attention`) take contiguous arenas; a strided arena
(or parameter view), or an int2 arena (no C decoder yet), goes to the float64 reference
after the same checks. ``q`` is
widened to float32 once (and rotated once for a rotated arena); the float32 output is
unrotated once and narrowed to ``q.dtype`` once. The pass's own K/V (``k_new``/``v_new``)
are widened to float32 once and, for a rotated arena, rotated once, so that the loops
read them as they read the arena's rows.
"""
from __future__ import annotations

from typing import cast

import torch

from pagedkv.format import op_checks
from pagedkv.ops import _cpu_attention as _ca
from pagedkv.ops import _cpu_quant as _q
from pagedkv.ops.attention_reference import AttentionPlan, attend_reference

__all__ = ["attend"]

_MODEL_CODES = {torch.float32: _q.MODEL_CODES["float32"], torch.float16: _q.MODEL_CODES["float16"],
                torch.bfloat16: _q.MODEL_CODES["bfloat16"]}


def _hadamard_(y: torch.Tensor, signs: torch.Tensor, *, inverse: bool) -> torch.Tensor:
    """Rotate (or unrotate) the contiguous float32 rows of ``y`` in place with the C row
    function (bit for bit :mod:`pagedkv.format.rotation`; ``signs`` as check_rotation
    checked them: float32 ``[head_dim]`` on the CPU). The torch definition's butterfly
    stages cost ~30 small tensor ops per call, 8% of a decode step of the int4 demo."""
    d = y.shape[-1]
    _ca.hadamard_rows(y.data_ptr(), y.numel() // d, d, signs.data_ptr(), inverse)
    return y


def _widen_new(t: torch.Tensor, signs: torch.Tensor | None) -> torch.Tensor:
    """The pass's own rows as contiguous float32, rotated as the arena's rows are."""
    x = t.detach().to(torch.float32).contiguous()
    if signs is None:
        return x
    return _hadamard_(x.clone() if x.data_ptr() == t.data_ptr() else x, signs, inverse=False)


def _contig(*ts) -> bool:
    return all(t is None or t.is_contiguous() for t in ts)


def attend(plan: AttentionPlan, q, kv_layer, layout, kv_scale, kv_zero, key_scale, key_zero, rotation_signs, out,
           split_tokens: int):
    """Run a checked call (``plan`` from :func:`~pagedkv.ops.attention_reference.check_attention`),
    cutting sequences into splits of ``split_tokens`` keys unless the plan fixes ``num_splits``."""
    geo = plan.geo
    exact = plan.exact
    extra = op_checks.key_extra_bits(geo, key_scale)
    # a strided arena, a format the loops do not decode (int2), or more high bits than
    # the loops' buffer: the float64 reference
    if (not _contig(kv_layer, kv_scale, kv_zero) or (exact is not None and not _contig(exact.data, exact.valid))
            or (geo.quantized and geo.kv_dtype not in _q.QUANT_CODES)
            or geo.head_dim * extra > 8 * _ca.KEY_HIGH_MAX):
        return attend_reference(plan, q, kv_layer, layout, kv_scale, kv_zero, key_scale, key_zero,
                                rotation_signs, out)
    qf = q.detach().to(torch.float32).contiguous()
    qrot = None
    signs = None
    if rotation_signs is not None:
        signs = rotation_signs.contiguous()
        qrot = _hadamard_(qf.clone(), signs, inverse=False)   # qf may be q itself
    new_args = {}
    if plan.k_new is not None:
        nk, nv = _widen_new(plan.k_new, signs), _widen_new(cast(torch.Tensor, plan.v_new), signs)  # both, checked
        new_args = dict(new_k_ptr=nk.data_ptr(), new_v_ptr=nv.data_ptr(),
                        pending_ptr=0 if plan.pending is None else plan.pending.data_ptr())
    res = torch.empty(q.shape, dtype=torch.float32)
    if geo.quantized:
        kv_type = _q.QUANT_CODES[cast(str, geo.kv_dtype)]     # quantized: the name is set
    else:
        kv_type = _MODEL_CODES[kv_layer.dtype]
    groups = geo.groups     # the caller's layer_format's, or the one the tensors imply
    ex_args = {}
    if exact is not None:
        valid = exact.valid if exact.valid.dtype == torch.bool else exact.valid.bool()
        ex_args = dict(exact_data_ptr=exact.data.data_ptr(), exact_type=_MODEL_CODES[exact.data.dtype],
                       exact_slot_ptr=cast(torch.Tensor, exact.slot_of).data_ptr(), exact_valid_ptr=valid.data_ptr(),
                       exact_recent=exact.recent, exact_sink=exact.sink,
                       signs_ptr=0 if signs is None else signs.data_ptr())
    _ca.attend(
        qf.data_ptr(), 0 if qrot is None else qrot.data_ptr(), res.data_ptr(), q.shape[0], q.shape[1],
        kv_layer.data_ptr(), 0 if kv_scale is None else kv_scale.data_ptr(),
        0 if kv_zero is None else kv_zero.data_ptr(), 0 if key_scale is None else key_scale.data_ptr(),
        0 if key_zero is None else key_zero.data_ptr(), geo.quantized, kv_type, kv_layer.element_size(),
        plan.indptr.data_ptr(), plan.indices.data_ptr(), plan.seq_lens.data_ptr(), plan.q_indptr.data_ptr(),
        plan.batch, geo.block_size, geo.num_heads, geo.head_dim, groups, layout == "HND",
        plan.sm_scale, 0.0 if plan.soft_cap is None else plan.soft_cap, plan.window or 0, plan.sink_tokens,
        plan.num_splits or 0, split_tokens, **ex_args, **new_args, key_extra=extra,
    )
    if signs is not None:
        _hadamard_(res, signs, inverse=True)    # res is this call's own
    if out is not None:
        out.copy_(res)
        return out
    return res if q.dtype == torch.float32 else res.to(q.dtype)
