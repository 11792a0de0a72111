"""How one vLLM CPU block is kept at rest: its bf16 bytes, or quantized.

vLLM's CPU attention keeps, per layer, one tensor ``[num_blocks, kv_heads, block_size,
2 * head_size]``; inside one (block, head) the keys are stored transposed (``K[t, d]``
at ``d * block_size + t``) and the values row-major after them. ``bf16`` copies whole
blocks and needs none of that. The quantized formats read K and V per token through
that layout, quantize with :mod:`pagedkv.format.quant`, and write the same layout back:

- ``int8``: per (token, head) scale and zero point, K and V;
- ``fp8``: a randomized Hadamard rotation over the head dim (:mod:`pagedkv.format.rotation`),
  then e4m3 with a per (token, head) scale;
- ``int4``: keys as "block keys" (per-channel scale/zero over the block's tokens,
  :func:`pagedkv.format.quant.quantize_key_block`), values int4 per group of 64 channels;
- ``int2``: KIVI-2: keys as 2-bit block keys, values int2 (float16 scale and zero per
  group of 64 channels).

A codec's ``arenas`` are the per-block shapes and dtypes it stores; the tiers keep one
``[num_layers, capacity, *shape]`` arena per entry.
"""
from __future__ import annotations

import torch

from pagedkv.errors import InvalidArgumentError, expected
from pagedkv.format import quant
from pagedkv.format.rotation import rotate, rotation_signs, unrotate

__all__ = ["Codec", "make_codec"]


class Codec:
    name = "bf16"

    def __init__(self, kv_heads: int, block_size: int, head_size: int, dtype: torch.dtype):
        self.h, self.bs, self.d, self.dtype = kv_heads, block_size, head_size, dtype

    @property
    def arenas(self) -> list[tuple[tuple, torch.dtype]]:
        return [((self.h, self.bs, 2 * self.d), self.dtype)]

    def encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        """``x``: ``[n, H, bs, 2D]`` blocks as vLLM holds them -> one tensor per arena."""
        return [x]

    def decode(self, parts: list[torch.Tensor]) -> torch.Tensor:
        return parts[0]

    # ---- vLLM CPU layout -----------------------------------------------------------
    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K ``[n, H, bs, D]`` and V ``[n, H, bs, D]`` of blocks ``x``."""
        n = x.shape[0]
        flat = x.reshape(n, self.h, 2 * self.d * self.bs)
        k = flat[..., : self.d * self.bs].reshape(n, self.h, self.d, self.bs).transpose(-1, -2)
        v = flat[..., self.d * self.bs:].reshape(n, self.h, self.bs, self.d)
        return k, v

    def join(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n = k.shape[0]
        kt = k.transpose(-1, -2).reshape(n, self.h, self.d * self.bs)
        flat = torch.cat((kt, v.reshape(n, self.h, self.d * self.bs)), dim=-1)
        return flat.reshape(n, self.h, self.bs, 2 * self.d).to(self.dtype)


class Int8Codec(Codec):
    name = "int8"

    @property
    def arenas(self):
        return [((2, self.h, self.bs, self.d), torch.int8), ((2, self.h, self.bs), torch.float32),
                ((2, self.h, self.bs), torch.float32)]

    def encode(self, x):
        q, s, z = quant.quantize(torch.stack(self.split(x), dim=1), "int8")
        return [q, s, z]

    def decode(self, parts):
        y = quant.dequantize(parts[0], parts[1], parts[2], torch.float32)
        return self.join(y[:, 0], y[:, 1])


class Fp8Codec(Codec):
    name = "fp8"

    def __init__(self, *args, seed: int):
        super().__init__(*args)
        self.signs = rotation_signs(self.d, seed)

    @property
    def arenas(self):
        return [((2, self.h, self.bs, self.d), torch.float8_e4m3fn), ((2, self.h, self.bs), torch.float32)]

    def encode(self, x):
        kv = torch.stack(self.split(x), dim=1).to(torch.float32)
        q, s, _ = quant.quantize(rotate(kv, self.signs), "fp8_e4m3")
        return [q, s]

    def decode(self, parts):
        y = unrotate(quant.dequantize(parts[0], parts[1], None, torch.float32), self.signs)
        return self.join(y[:, 0], y[:, 1])


class Int4Codec(Codec):
    name = "int4"

    @property
    def arenas(self):
        g = quant.int4_group(self.d, None)
        return [((self.bs, self.h, self.d // 2), torch.uint8), ((self.h, self.d), torch.bfloat16),
                ((self.h, self.d), torch.bfloat16), ((self.h, self.bs, self.d // 2), torch.uint8),
                ((self.h, self.bs, self.d // g), torch.float32), ((self.h, self.bs, self.d // g), torch.float32)]

    def encode(self, x):
        k, v = self.split(x)
        kc, ks, kz = quant.quantize_key_block(k.transpose(1, 2))      # [n, bs, H, D]
        vq, vs, vz = quant.quantize(v, "int4")
        return [kc, ks, kz, vq, vs, vz]

    def decode(self, parts):
        kc, ks, kz, vq, vs, vz = parts
        k = quant.dequantize_key_channels(kc, ks.unsqueeze(1), kz.unsqueeze(1), torch.float32)
        v = quant.dequantize(vq, vs, vz, torch.float32)
        return self.join(k.transpose(1, 2), v)


class Int2Codec(Codec):
    name = "int2"

    @property
    def arenas(self):
        g = quant.int2_group(self.d, None)
        return [((self.bs, self.h, self.d // 4), torch.uint8), ((self.h, self.d), torch.bfloat16),
                ((self.h, self.d), torch.bfloat16), ((self.h, self.bs, self.d // 4), torch.uint8),
                ((self.h, self.bs, self.d // g), torch.float16), ((self.h, self.bs, self.d // g), torch.float16)]

    def encode(self, x):
        k, v = self.split(x)
        kc, ks, kz = quant.quantize_key_block(k.transpose(1, 2), bits=2)      # [n, bs, H, D]
        vq, vs, vz = quant.quantize(v, "int2")
        return [kc, ks, kz, vq, vs, vz]

    def decode(self, parts):
        kc, ks, kz, vq, vs, vz = parts
        k = quant.dequantize_key_channels(kc, ks.unsqueeze(1), kz.unsqueeze(1), torch.float32)
        v = quant.dequantize(vq, vs, vz, torch.float32)
        return self.join(k.transpose(1, 2), v)


def make_codec(storage: str, kv_heads: int, block_size: int, head_size: int, dtype: torch.dtype,
               rotation_seed: int = 0) -> Codec:
    args = (kv_heads, block_size, head_size, dtype)
    if storage != "bf16" and dtype not in (torch.bfloat16, torch.float16, torch.float32):
        # vLLM's fp8 KV (fp8 or uint8 bytes) is kept as it is: quantizing it again would
        # read bytes as numbers without the layer's scales
        raise InvalidArgumentError(expected("storage", f"'bf16' (vLLM's bytes as they are) for {dtype} KV",
                                            repr(storage)))
    if storage == "bf16":
        return Codec(*args)
    if storage == "int8":
        return Int8Codec(*args)
    if storage == "fp8":
        return Fp8Codec(*args, seed=rotation_seed)
    if storage == "int2":
        return Int2Codec(*args)
    return Int4Codec(*args)


def bytes_per_token(codec: Codec, num_layers: int) -> float:
    """Bytes at rest per cached token (all layers, K and V, with scales)."""
    per_block = sum(torch.empty(shape, dtype=dt).numel() * torch.empty(0, dtype=dt).element_size()
                    for shape, dt in codec.arenas)
    return per_block * num_layers / codec.bs
