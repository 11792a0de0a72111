"""What peers ship, rebuilt here as baselines for ``benchmarks/kv_quality.py``: each format is a
quantize-then-dequantize applied to K/V before they are written into a float32
``PagedKVCache``, so the model reads exactly the values that format would give it.

- ``fp16`` / ``bf16``: a model-precision cache (the usual serving default).
- ``vllm_fp8_scale1``: vLLM's ``kv_cache_dtype="fp8"`` without calibrated scales: one
  per-tensor scale of 1.0, values saturated to +-448 and rounded to e4m3.
- ``vllm_fp8_dynamic``: vLLM's ``calculate_kv_scales``: one per-tensor scale per layer
  and K/V, set from the amax of the first batch written (amax / 448), fixed afterwards.
- ``kivi4`` / ``kivi2``: KIVI without rotation: keys per channel (min/max over groups of
  32 consecutive tokens of one write), values per token (groups of 32 along
  ``head_dim``), asymmetric, fp16 scale and zero point. A write shorter than a group
  (decode, one token at a time) stays exact, as KIVI's full-precision residual does.

Bits per element count the scales the way each peer stores them.
"""
from __future__ import annotations

import torch

from pagedkv import PagedKVCache

__all__ = ["PEERS", "FakeQuantCache"]

KIVI_GROUP = 32


class FakeQuantCache(PagedKVCache):
    """A float32 ``PagedKVCache`` whose writes pass through ``fn(layer, k, v) -> (k, v)``."""

    def __init__(self, config, fn):
        super().__init__(config)
        self._fn = fn

    def write(self, layer, slot_mapping, key, value):
        k, v = self._fn(layer, key, value)
        super().write(layer, slot_mapping, k, v)


def _cast(dtype):
    def fn(layer, k, v):
        return k.to(dtype).to(k.dtype), v.to(dtype).to(v.dtype)
    return lambda: fn


def _fp8(x, scale):
    return (x / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(x.dtype) * scale


def _vllm_scale1():
    return lambda layer, k, v: (_fp8(k, 1.0), _fp8(v, 1.0))


def _vllm_dynamic():
    scales = {}

    def fn(layer, k, v):
        if layer not in scales:
            scales[layer] = tuple(max(float(x.abs().amax()) / 448.0, 1e-12) for x in (k, v))
        ks, vs = scales[layer]
        return _fp8(k, ks), _fp8(v, vs)
    return fn


def _minmax(x, bits, dim):
    """Asymmetric min/max fake quantization over ``dim``, fp16 scale and zero point."""
    levels = 2 ** bits - 1
    mn = x.amin(dim=dim, keepdim=True).half().float()
    s = ((x.amax(dim=dim, keepdim=True) - mn) / levels).half().float()
    s = torch.where(s == 0, torch.ones_like(s), s)
    return (torch.clamp(torch.round((x - mn) / s), 0, levels) * s + mn).to(x.dtype)


def _kivi(bits):
    def fn(layer, k, v):
        n, h, d = k.shape
        if n < KIVI_GROUP:
            return k, v  # KIVI's full-precision residual
        full = n // KIVI_GROUP * KIVI_GROUP
        kq = k.clone()  # per channel: min/max over each group of 32 tokens (a tail stays exact)
        kq[:full] = _minmax(k[:full].reshape(-1, KIVI_GROUP, h, d), bits, 1).reshape(full, h, d)
        g = min(KIVI_GROUP, d)
        return kq, _minmax(v.reshape(n, h, d // g, g), bits, -1).reshape(n, h, d)
    return lambda: fn


#: name -> (factory of a fresh write hook, bits per element incl. scales, what it stands for)
PEERS = {
    "fp16": (_cast(torch.float16), 16.0, "model-precision fp16 KV"),
    "bf16": (_cast(torch.bfloat16), 16.0, "model-precision bf16 KV"),
    "vllm_fp8_scale1": (_vllm_scale1, 8.0, "vLLM fp8 e4m3, per-tensor scale 1.0 (uncalibrated default)"),
    "vllm_fp8_dynamic": (_vllm_dynamic, 8.0, "vLLM fp8 e4m3, per-tensor scale per layer from the first batch"),
    "kivi4": (_kivi(4), 4.0 + 2 * 16 / KIVI_GROUP, "KIVI-4: per-channel K, per-token V, group 32, no rotation"),
    "kivi2": (_kivi(2), 2.0 + 2 * 16 / KIVI_GROUP, "KIVI-2: per-channel K, per-token V, group 32, no rotation"),
}
