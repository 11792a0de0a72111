"""Randomized Hadamard rotation of ``head_dim`` (torch reference).

Quantizing a rotated vector loses less than quantizing the vector itself: the
orthonormal transform spreads an outlier channel's energy over every channel, so the
per-token (or per-group) range shrinks towards the typical magnitude. The rotation is
fixed per cache and undone on read, so a model never sees it.

The data ops apply it inside the quantized write and gather (``rotation_signs=`` of
:func:`pagedkv.ops.write_kv` / :func:`pagedkv.ops.gather_kv`): this module is their
torch reference, and the CPU loops (``pagedkv/ops/quant_rows.h``) and the CUDA kernels
(``cuda/common.cuh``) reproduce it bit for bit.

Definition (float32 throughout)::

    rotate(x)   = H(signs * x)          # signs: +-1 per channel, fixed per cache
    unrotate(y) = signs * H(y)          # H is symmetric and orthonormal: H^-1 = H

``H`` is block-diagonal over the binary decomposition of ``D`` (largest power-of-two
block first: D = 96 -> blocks 64 and 32). On a block of size ``n = 2**k`` it is the
normalized Walsh-Hadamard transform, computed by ``k`` butterfly stages with half-width
``h = 1, 2, 4, ...``: for each pair ``(a, b) = (x[i], x[i + h])`` in a ``2h`` chunk,
``x[i] = a + b`` and ``x[i + h] = a - b``; then every element is multiplied by the
float32 ``1 / sqrt(n)`` once. Each step rounds once; nothing is fused.
"""
from __future__ import annotations

import torch

from pagedkv.errors import DTypeError, InvalidArgumentError, ShapeError, expected

__all__ = ["hadamard_blocks", "rotation_signs", "rotate", "unrotate"]


def hadamard_blocks(head_dim: int) -> list[int]:
    """Sizes of the power-of-two Hadamard blocks covering ``head_dim``, largest first."""
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
        raise InvalidArgumentError(expected("head_dim", "an int >= 1", repr(head_dim)))
    return [1 << b for b in range(head_dim.bit_length() - 1, -1, -1) if head_dim >> b & 1]


def rotation_signs(head_dim: int, seed: int) -> torch.Tensor:
    """The cache's fixed +-1 float32 sign vector ``[head_dim]`` (deterministic in ``seed``)."""
    hadamard_blocks(head_dim)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise InvalidArgumentError(expected("seed", "an int in [0, 2**63)", repr(seed)))
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 2, (head_dim,), generator=g)
    return (bits * 2 - 1).to(torch.float32)


def _check(x: object, signs: torch.Tensor) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise DTypeError(expected("x", "a float32 tensor", got))
    if x.dim() < 1 or x.shape[-1] != signs.shape[0]:
        raise ShapeError(expected("x", f"[..., {signs.shape[0]}] (head_dim)", tuple(x.shape)))
    return x


def _hadamard(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1]
    lead = x.shape[:-1]
    parts = []
    start = 0
    for n in hadamard_blocks(d):
        y = x[..., start:start + n].reshape(-1, n)
        h = 1
        while h < n:
            y = y.reshape(-1, n // (2 * h), 2, h)
            a, b = y[:, :, 0, :], y[:, :, 1, :]
            y = torch.stack((a + b, a - b), dim=2)
            h *= 2
        y = y.reshape(lead + (n,)) * torch.tensor(1.0 / n ** 0.5, dtype=torch.float32, device=x.device)
        parts.append(y)
        start += n
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def rotate(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """``H(signs * x)`` over the last dim of float32 ``x``."""
    x = _check(x, signs)
    return _hadamard(x * signs.to(x.device))


def unrotate(y: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`rotate`: ``signs * H(y)``."""
    y = _check(y, signs)
    return _hadamard(y) * signs.to(y.device)
