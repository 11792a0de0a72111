"""KVStore: the arenas that hold every layer's K/V blocks.

One allocation holds all layers (``[num_layers] + kv_cache_shape``), plus float32
scale (and int8 zero-point) arenas when the cache is quantized, and optionally a
host-tier copy of the same arenas with ``host_num_blocks`` blocks for offload. The
store allocates once, at construction; nothing is allocated per block at run time.
The store moves bytes; which block goes where is the caller's decision.
"""
from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import Callable, List, Optional, Tuple

import torch

from pagedkv import dtypes, ops
from pagedkv.config import CacheConfig
from pagedkv.errors import InvalidArgumentError, expected

__all__ = ["KVStore", "fp8_supported"]

_log = logging.getLogger("pagedkv.store")

#: First CUDA compute capability with fp8 support (Ada, sm_89).
FP8_MIN_CAPABILITY = (8, 9)


def fp8_supported(device: torch.device) -> bool:
    """Whether ``device`` can use fp8 KV storage: CPU yes; CUDA from sm_89 (Ada/Hopper)."""
    if device.type != "cuda":
        return True
    return tuple(torch.cuda.get_device_capability(device)) >= FP8_MIN_CAPABILITY


class KVStore:
    """Device arenas (and an optional host tier) for one :class:`CacheConfig`.

    Attributes:
        config: the effective config. It differs from ``requested_config`` only when
            fp8 storage fell back to int8 on a GPU without fp8 (seed 004); size the
            bookkeeping from ``config.resolved_num_blocks``.
        requested_config: the config passed in.
        kv: data arena ``config.arena_shape`` (NHD ``[L, NB, 2, bs, H, D]``).
        kv_scale, kv_zero: float32 ``config.scale_arena_shape`` arenas, or None.
        host_kv, host_kv_scale, host_kv_zero: the host tier (``host_num_blocks``
            blocks; pinned when the device is CUDA), or None.
    """

    def __init__(self, config: CacheConfig, *, fp8_check: Callable[[torch.device], bool] = fp8_supported):
        if not isinstance(config, CacheConfig):
            raise InvalidArgumentError(expected("config", "a CacheConfig", type(config).__name__))
        self.requested_config = config
        self.device = torch.device(config.device)
        if config.quantized and dtypes.info(config.kv_dtype).float8 and not fp8_check(self.device):
            msg = (
                f"pagedkv: kv_dtype={config.kv_dtype} needs fp8 support (CUDA compute capability "
                f">= {FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]}), which {self.device} lacks; "
                "falling back to int8 KV storage (scale + zero point)"
            )
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
            _log.warning(msg)
            config = dataclasses.replace(config, kv_dtype="int8")
        self.config = config
        self.kv, self.kv_scale, self.kv_zero = self._allocate(config.resolved_num_blocks, self.device, pin=False)
        self.host_kv = self.host_kv_scale = self.host_kv_zero = None
        if config.host_num_blocks:
            pin = self.device.type == "cuda"
            self.host_kv, self.host_kv_scale, self.host_kv_zero = self._allocate(
                config.host_num_blocks, torch.device("cpu"), pin=pin
            )

    def _allocate(self, num_blocks: int, device: torch.device, pin: bool):
        cfg = self.config
        shape = (cfg.num_layers,) + cfg.layer_shape(num_blocks)
        kw = dict(device=device, pin_memory=pin) if pin else dict(device=device)
        kv = torch.zeros(shape, dtype=cfg.torch_cache_dtype, **kw)
        scale = zero = None
        if cfg.quantized:
            scale = torch.zeros(shape[:-1], dtype=torch.float32, **kw)
            if dtypes.info(cfg.kv_dtype).zero_point:
                zero = torch.zeros(shape[:-1], dtype=torch.float32, **kw)
        return kv, scale, zero

    # -- views --------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        """Layer slots of the arena (``config.arena_layers``: the layers, or a layer group's size)."""
        return self.config.arena_layers

    @property
    def num_blocks(self) -> int:
        return self.config.resolved_num_blocks

    @property
    def layout(self) -> str:
        return self.config.layout

    def _layer_index(self, layer: int) -> int:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise InvalidArgumentError(expected("layer", f"an int in [0, {self.num_layers})", repr(layer)))
        return layer

    def layer(self, layer: int) -> torch.Tensor:
        """Per-layer data view ``config.kv_cache_shape`` (no copy)."""
        return self.kv[self._layer_index(layer)]

    def layer_scales(self, layer: int) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Per-layer ``(scale, zero)`` views (NHD ``[NB, 2, bs, H]``); None where not stored."""
        i = self._layer_index(layer)
        scale = self.kv_scale[i] if self.kv_scale is not None else None
        zero = self.kv_zero[i] if self.kv_zero is not None else None
        return scale, zero

    @property
    def arenas(self) -> List[torch.Tensor]:
        """The device arenas: data, then scale and zero when stored."""
        return [t for t in (self.kv, self.kv_scale, self.kv_zero) if t is not None]

    @property
    def host_arenas(self) -> List[torch.Tensor]:
        """The host-tier arenas (empty without a host tier)."""
        return [t for t in (self.host_kv, self.host_kv_scale, self.host_kv_zero) if t is not None]

    @property
    def nbytes(self) -> int:
        """Bytes of the device arenas (equals ``config.total_bytes``)."""
        return sum(t.numel() * t.element_size() for t in self.arenas)

    @property
    def host_nbytes(self) -> int:
        """Bytes of the host-tier arenas."""
        return sum(t.numel() * t.element_size() for t in self.host_arenas)

    # -- data ops -----------------------------------------------------------------

    def write(self, layer: int, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store ``[num_tokens, H, D]`` K/V at ``slot_mapping`` (int64) in ``layer``."""
        scale, zero = self.layer_scales(layer)
        ops.write_kv(self.layer(layer), slot_mapping, key, value, layout=self.layout, kv_scale=scale, kv_zero=zero)

    def gather(
        self,
        layer: int,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        out_key: Optional[torch.Tensor] = None,
        out_value: Optional[torch.Tensor] = None,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Contiguous ``[sum(seq_lens), H, D]`` K/V of ``layer`` in the model dtype (CSR tables)."""
        scale, zero = self.layer_scales(layer)
        return ops.gather_kv(self.layer(layer), indptr, indices, seq_lens, layout=self.layout,
                             out_dtype=self._out_dtype(), kv_scale=scale, kv_zero=zero,
                             out_key=out_key, out_value=out_value)

    def gather_padded(
        self,
        layer: int,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        out_key: Optional[torch.Tensor] = None,
        out_value: Optional[torch.Tensor] = None,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`gather` with a padded ``[B, max_blocks]`` int32 table."""
        scale, zero = self.layer_scales(layer)
        return ops.gather_kv_padded(self.layer(layer), block_table, seq_lens, layout=self.layout,
                                    out_dtype=self._out_dtype(), kv_scale=scale, kv_zero=zero,
                                    out_key=out_key, out_value=out_value)

    def _out_dtype(self) -> Optional[torch.dtype]:
        return self.config.torch_dtype if self.config.quantized else None

    def copy_blocks(self, pairs: torch.Tensor) -> None:
        """Copy block ``src`` to ``dst`` for each ``[P, 2]`` row, all layers (copy-on-write)."""
        ops.copy_blocks(self.arenas, pairs)

    def _require_host(self) -> None:
        if not self.config.host_num_blocks:
            raise InvalidArgumentError(expected("host_num_blocks", "> 0 for offload/load", 0))

    def offload(self, pairs: torch.Tensor) -> None:
        """Copy device blocks to host blocks: rows ``(device_block, host_block)``."""
        self._require_host()
        ops.swap_blocks(self.arenas, self.host_arenas, pairs)

    def load(self, pairs: torch.Tensor) -> None:
        """Copy host blocks back to device blocks: rows ``(host_block, device_block)``."""
        self._require_host()
        ops.swap_blocks(self.host_arenas, self.arenas, pairs)

    def __repr__(self) -> str:
        c = self.config
        host = f", host_blocks={c.host_num_blocks}" if c.host_num_blocks else ""
        return (
            f"KVStore(layers={c.num_layers}, blocks={c.resolved_num_blocks}, block_size={c.block_size}, "
            f"kv_heads={c.num_kv_heads}, head_dim={c.head_dim}, dtype={c.cache_dtype}, layout={c.layout}, "
            f"device={self.device}, nbytes={self.nbytes}{host})"
        )
