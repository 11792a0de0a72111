"""Which block layout vLLM's attention backend gave the KV tensors, detected and checked.

``register_kv_caches`` receives, per layer (or as one tensor stacked over layers), the
tensors the attention backend reads. Their shape depends on the backend and the vLLM
version; the connector must read each one as what it is, never assume:

============== ================================= =======================================
name           per-layer shape                   who
============== ================================= =======================================
``cpu``        ``[NB, H, bs, 2D]``               vLLM's CPU attention (``CPU_ATTN``):
                                                 inside (block, head) the keys transposed
                                                 (``K[t, d]`` at ``d * bs + t``), then V
``kv_last``    ``[NB, H, bs, 2D]``               vLLM's GPU backends with the
                                                 ``KVCacheLayout`` descriptor (FlashAttention,
                                                 FlashInfer, Triton): K and V the halves of
                                                 the last dim; NHD or HND in the strides
``flash_attn`` ``[2, NB, bs, H, D]``             FlashAttention before the descriptor
``nhd``        ``[NB, 2, bs, H, D]``             FlashInfer NHD (also an HND tensor seen
                                                 through a permuted view)
``hnd``        ``[NB, 2, H, bs, D]``             FlashInfer HND as allocated
============== ================================= =======================================

vLLM hands FlashInfer's HND cache over as a permuted view of logical NHD shape, so a
``FLASHINFER`` backend means ``nhd`` (any strides); ``hnd`` is matched only when no
backend is named. A stacked tensor adds a layer axis first (``[L, *per-layer]``) or after the blocks
(``[NB, L, *rest]``, vLLM's cross-layer blocks). ``cpu`` and ``kv_last`` have the same
shape and ``nhd``/``hnd`` do when ``H == bs``: then only the backend's name decides, and
without it the tensors are refused (:class:`~pagedkv.errors.InvalidArgumentError`).

Whatever the layout, a block travels in one form: vLLM's CPU block form (the ``cpu``
layout), the form the codecs (:mod:`.vllm_codec`) and the tiers keep at rest, so blocks
stored by a GPU engine serve a CPU engine of the same model and dtype and back. The
conversions are views and index copies (exact, byte for byte, fp8 included); on a GPU the
gather/scatter runs on the device and crosses to the host through pinned memory.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedkv.errors import ArgumentTypeError, InternalError, InvalidArgumentError, expected

__all__ = ["BACKEND_LAYOUTS", "LAYOUTS", "LayerBlocks", "detect_layout", "from_cpu_form", "raw_bytes", "to_cpu_form"]

#: layout name -> per-layer shape pattern (``N``: blocks, ``2``: K/V, ``H``, ``S``: block size, ``D``, ``C``: 2D)
LAYOUTS = {"cpu": "NHSC", "kv_last": "NHSC", "flash_attn": "2NSHD", "nhd": "N2SHD", "hnd": "N2HSD"}

#: vLLM backend names (``AttentionBackend.get_name()``) -> the layouts they may register
BACKEND_LAYOUTS = {
    "CPU_ATTN": ("cpu",), "TORCH_SDPA": ("cpu",),
    "FLASH_ATTN": ("kv_last", "flash_attn"), "FLASHINFER": ("kv_last", "nhd"),
    "TRITON_ATTN": ("kv_last", "nhd"), "FLEX_ATTENTION": ("kv_last", "flash_attn"),
    "ROCM_ATTN": ("kv_last", "flash_attn"), "ROCM_AITER_FA": ("kv_last", "flash_attn"),
}

_BYTE_FLOATS = (torch.float8_e4m3fn, torch.float8_e5m2)


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """fp8 as bytes: torch's CPU index_copy_/index_select/cat do not take fp8."""
    return t.view(torch.uint8) if t.dtype in _BYTE_FLOATS else t


def _num_blocks(pattern: str, shape: Sequence[int], h: int, bs: int, d: int) -> int | None:
    """The block count ``shape`` has under ``pattern``, or None when it does not fit."""
    if len(shape) != len(pattern):
        return None
    want = {"2": 2, "H": h, "S": bs, "D": d, "C": 2 * d}
    for p, n in zip(pattern, shape):
        if p != "N" and n != want[p]:
            return None
    n = shape[pattern.index("N")]
    return n if n >= 1 else None


def _kv5(name: str, t: torch.Tensor) -> torch.Tensor:
    """A view ``[NB, 2, H, bs, D]`` of one layer's tensor (no copy)."""
    if name == "kv_last":
        return t.unflatten(-1, (2, t.shape[-1] // 2)).permute(0, 3, 1, 2, 4)
    if name == "flash_attn":
        return t.permute(1, 0, 3, 2, 4)
    if name == "nhd":
        return t.permute(0, 1, 3, 2, 4)
    return t          # hnd


def to_cpu_form(kv: torch.Tensor) -> torch.Tensor:
    """``[n, 2, H, bs, D]`` -> vLLM's CPU block form ``[n, H, bs, 2D]`` (keys transposed)."""
    n, _, h, bs, d = kv.shape
    kt = kv[:, 0].transpose(-1, -2).reshape(n, h, d * bs)
    return torch.cat((kt, kv[:, 1].reshape(n, h, bs * d)), dim=-1).reshape(n, h, bs, 2 * d)


def from_cpu_form(x: torch.Tensor) -> torch.Tensor:
    """vLLM's CPU block form ``[n, H, bs, 2D]`` -> ``[n, 2, H, bs, D]``."""
    n, h, bs, c = x.shape
    d = c // 2
    flat = x.reshape(n, h, bs * c)
    k = flat[..., : d * bs].reshape(n, h, d, bs).transpose(-1, -2)
    return torch.stack((k, flat[..., d * bs:].reshape(n, h, bs, d)), dim=1)


class LayerBlocks:
    """One layer's blocks in vLLM's tensor, read and written in the CPU block form."""

    def __init__(self, layout: str, tensor: torch.Tensor, dtype: torch.dtype):
        self.layout, self.dtype = layout, dtype
        self.raw = raw_bytes(tensor)
        self.view = self.raw if layout == "cpu" else _kv5(layout, self.raw)
        self.device = tensor.device
        self._pinned: torch.Tensor | None = None

    @property
    def num_blocks(self) -> int:
        return int(self.view.shape[0])

    def _host(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` on the host; a device tensor crosses through one reused pinned buffer."""
        if x.device.type == "cpu":
            return x
        n = x.numel()
        if self._pinned is None or self._pinned.numel() < n or self._pinned.dtype != x.dtype:
            self._pinned = torch.empty(n, dtype=x.dtype, pin_memory=True)
        buf = self._pinned[:n].view(x.shape)
        buf.copy_(x, non_blocking=True)
        torch.cuda.current_stream(x.device).synchronize()
        return buf

    def gather(self, blocks: torch.Tensor) -> torch.Tensor:
        """Blocks ``blocks`` (int64 ids) as ``[n, H, bs, 2D]`` host bytes of vLLM's dtype.

        The result may share a reused host buffer: use it before the next gather."""
        idx = blocks.to(self.device)
        got = self.view.index_select(0, idx)
        if self.layout != "cpu":
            got = to_cpu_form(got)
        return self._host(got).view(self.dtype)

    def scatter(self, blocks: torch.Tensor, x: torch.Tensor) -> None:
        """Write ``x`` (``[n, H, bs, 2D]``, the CPU block form) into blocks ``blocks``."""
        x = raw_bytes(x.to(self.dtype))
        if self.layout != "cpu":
            x = from_cpu_form(x)
        if self.device.type != "cpu":
            x = x.pin_memory().to(self.device, non_blocking=True)
        self.view.index_copy_(0, blocks.to(self.device), x.contiguous() if self.device.type == "cpu" else x)
        if self.device.type != "cpu":
            torch.cuda.current_stream(self.device).synchronize()


def _candidates(shape: Sequence[int], h: int, bs: int, d: int, stacked_layers: int | None):
    """``[(layout, layer_axis)]`` whose pattern ``shape`` fits (layer_axis None: per layer)."""
    out: list[tuple[str, int | None]] = []
    shape = tuple(shape)
    for name, pat in LAYOUTS.items():
        if stacked_layers is None:
            if _num_blocks(pat, shape, h, bs, d) is not None:
                out.append((name, None))
            continue
        if len(shape) == len(pat) + 1 and shape[0] == stacked_layers and \
                _num_blocks(pat, shape[1:], h, bs, d) is not None:
            out.append((name, 0))
        n_at = pat.index("N")
        if n_at == 0 and len(shape) == len(pat) + 1 and shape[1] == stacked_layers and \
                _num_blocks(pat, shape[:1] + shape[2:], h, bs, d) is not None:
            out.append((name, 1))
    return out


def detect_layout(kv: torch.Tensor | Sequence[torch.Tensor], num_layers: int, kv_heads: int, block_size: int,
                  head_size: int, dtype: torch.dtype, backend: str | None = None) -> list[LayerBlocks]:
    """One :class:`LayerBlocks` per layer of ``kv`` (a list per layer, or one stacked tensor).

    Raises (typed) when the tensors are not KV of this shape and dtype in a known layout,
    when the layers disagree, or when the layout is ambiguous and ``backend`` does not
    settle it."""
    if isinstance(kv, torch.Tensor):
        tensors, stacked = [kv], True
    elif isinstance(kv, Sequence) and all(isinstance(t, torch.Tensor) for t in kv):
        tensors, stacked = list(kv), False
    else:
        raise ArgumentTypeError(expected("kv_caches", "a tensor or a sequence of tensors", type(kv).__name__))
    if not stacked and len(tensors) != num_layers:
        raise InvalidArgumentError(expected("kv_caches", f"{num_layers} layers", f"{len(tensors)} tensors"))
    allowed = None
    if backend is not None:
        allowed = BACKEND_LAYOUTS.get(str(backend))
        if allowed is None:
            raise InvalidArgumentError(expected("attention backend", f"one of {sorted(BACKEND_LAYOUTS)}",
                                                repr(backend)[:80]))
    found = None
    for i, t in enumerate(tensors):
        if t.dtype != dtype:
            raise InvalidArgumentError(expected(f"KV layer {i} dtype", str(dtype), str(t.dtype)))
        if t.device.type not in ("cpu", "cuda"):
            raise InvalidArgumentError(expected(f"KV layer {i} device", "cpu or cuda", str(t.device)))
        shape = tuple(int(n) for n in t.shape)
        cands = _candidates(shape, kv_heads, block_size, head_size, num_layers if stacked else None)
        if allowed is not None:
            cands = [c for c in cands if c[0] in allowed]
        if t.device.type == "cuda":                  # vLLM's CPU attention never runs on a GPU
            cands = [c for c in cands if c[0] != "cpu"]
        per = f"[L, ...] or [NB, L, ...] with L={num_layers} around " if stacked else ""
        if not cands:
            want = "; ".join(f"{n} {p}" for n, p in LAYOUTS.items() if allowed is None or n in allowed)
            raise InvalidArgumentError(expected(
                f"KV layer {i} shape", f"{per}a layout of H={kv_heads}, bs={block_size}, D={head_size} "
                f"(N blocks, C=2D): {want}", str(shape)))
        if len(cands) > 1:
            raise InvalidArgumentError(expected(
                f"KV layer {i} layout", "one layout (name the attention backend to settle it)",
                f"shape {shape} fits {', '.join(n if a is None else f'{n} (layer axis {a})' for n, a in cands)}"))
        if found is not None and cands[0] != found:
            raise InvalidArgumentError(expected(f"KV layer {i} layout", f"layer 0's {found[0]}", cands[0][0]))
        found = cands[0]
    if found is None:
        raise InternalError("detect_layout: no KV tensor was examined")
    name, axis = found
    if stacked:
        layers = [tensors[0].select(axis, i) for i in range(num_layers)]
    else:
        layers = tensors
    out = [LayerBlocks(name, t, dtype) for t in layers]
    if len({lb.num_blocks for lb in out}) != 1:
        raise InvalidArgumentError(expected("KV layers", "one block count", [lb.num_blocks for lb in out][:8]))
    return out
