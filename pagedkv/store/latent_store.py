"""LatentStore: the arenas of an MLA model's latent rows (see :class:`~pagedkv.groups.spec.MLASpec`).

One allocation holds every layer's rows, ``[num_layers, num_blocks, block_size, row]``
(:class:`~pagedkv.format.latent.LatentFormat`: the model dtype's R + P elements, or a
quantized row's bytes with its scales inline), plus an optional host copy of the same
shape with ``host_num_blocks`` blocks for offload. A block is one contiguous run of
``block_size`` rows per layer, scales included, so a block copy, a tier, a transfer and
a swap move it whole, as they move the K/V store's arenas.

It answers the store interface the manager, the tiers and the transfers use
(``arenas``, ``write``, ``gather``, ``copy_blocks``, ``offload``/``load``, ...); what a
latent row does not have (a recent-token window, rotation, scale arenas) is absent
(None), and a K/V-only call (:meth:`gather_padded`) is refused.

Under tensor parallelism every rank holds the same latent (it is not split by head):
the format fingerprint of every rank is the same, so a tier or a transfer filled by
one rank serves any other.
"""
from __future__ import annotations

import numpy as np
import torch

from pagedkv.config.memory import arena_bytes, check_device, check_fits
from pagedkv.config.options import CacheConfig
from pagedkv.config.support import ROW_ONLY_FORMATS, require
from pagedkv.errors import InvalidArgumentError, expected
from pagedkv.format import op_checks
from pagedkv.ops import copy_blocks as _copy_blocks
from pagedkv.ops import swap_blocks as _swap_blocks
from pagedkv.ops.latent import LatentView, gather_latent, write_latent

__all__ = ["LatentStore"]


class LatentStore:
    """Device arenas (and an optional host tier) of latent rows for one MLA :class:`CacheConfig`.

    Attributes:
        config, requested_config: the config (the same: a latent row needs no fallback,
            its fp8 codes are converted in software on every device).
        spec: the layer group's :class:`~pagedkv.groups.spec.MLASpec`.
        format: the :class:`~pagedkv.format.latent.LatentFormat` of every layer's rows.
        kv: the arena ``[num_layers, num_blocks, block_size, row_elems]``.
        host_kv: the host tier's arena (``host_num_blocks`` blocks), or None.
    """

    window = None            # no model-precision rows beside the blocks: a row keeps its RoPE slice exact
    host_window = None
    rotation_signs = None

    def __init__(self, config: CacheConfig):
        if not isinstance(config, CacheConfig):
            raise InvalidArgumentError(expected("config", "a CacheConfig", type(config).__name__))
        spec = config.kv_specs[0]
        if spec.arena != "latent":
            raise InvalidArgumentError(expected("config", "an MLA config (kv_lora_rank)", spec.kind))
        self.config = self.requested_config = config
        self.spec = spec
        self.format = spec.latent  # type: ignore[attr-defined]  # an MLASpec
        self.device = torch.device(config.device)
        check_device(self.device)
        self._check_sizes()
        self.kv = self._allocate(config.resolved_num_blocks, self.device, pin=False)
        self.host_kv = None
        if config.host_num_blocks:
            self.host_kv = self._allocate(config.host_num_blocks, torch.device("cpu"),
                                          pin=self.device.type == "cuda")

    def _shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.config.num_layers,) + self.config.layer_shape(num_blocks)

    def _check_sizes(self) -> None:
        cfg = self.config
        option, value = (("memory_budget", cfg.memory_budget) if cfg.memory_budget is not None
                         else ("num_blocks", cfg.resolved_num_blocks))
        item = self.format.storage_dtype.itemsize
        device = [(option, value, arena_bytes(option, value, self._shape(cfg.resolved_num_blocks), item))]
        host = []
        if cfg.host_num_blocks:
            host = [("host_num_blocks", cfg.host_num_blocks,
                     arena_bytes("host_num_blocks", cfg.host_num_blocks, self._shape(cfg.host_num_blocks), item))]
        if self.device.type == "cpu":
            check_fits(self.device, device + host)
        else:
            check_fits(self.device, device)
            check_fits("cpu", host)

    def _allocate(self, num_blocks: int, device: torch.device, pin: bool) -> torch.Tensor:
        kw = dict(device=device, pin_memory=True) if pin else dict(device=device)
        return torch.zeros(self._shape(num_blocks), dtype=self.format.storage_dtype, **kw)

    # -- views ------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    @property
    def num_blocks(self) -> int:
        return self.config.resolved_num_blocks

    @property
    def layout(self) -> str:
        return self.config.layout

    def _layer_index(self, layer: int) -> int:
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not 0 <= layer < self.num_layers:
            raise InvalidArgumentError(expected("layer", f"an int in [0, {self.num_layers})", repr(layer)))
        return int(layer)

    def layer(self, layer: int) -> torch.Tensor:
        """The layer's arena ``[num_blocks, block_size, row_elems]`` (no copy)."""
        return self.kv[self._layer_index(layer)]

    def view(self, layer: int) -> LatentView:
        """The layer as the latent ops take it."""
        return LatentView(self.format, self.layer(layer))

    def layer_format(self, layer: int):
        """The layer group's :class:`~pagedkv.format.layer_format.LayerFormat`."""
        self._layer_index(layer)
        return self.spec.format

    def is_quantized_layer(self, layer: int) -> bool:
        self._layer_index(layer)
        return self.format.quantized

    def layer_scales(self, layer: int) -> tuple[None, None]:
        """No scale arenas: a quantized latent row carries its scales."""
        self._layer_index(layer)
        return None, None

    def layer_key_params(self, layer: int) -> tuple[None, None]:
        self._layer_index(layer)
        return None, None

    @property
    def arenas(self) -> list[torch.Tensor]:
        return [self.kv]

    @property
    def host_arenas(self) -> list[torch.Tensor]:
        return [] if self.host_kv is None else [self.host_kv]

    @property
    def nbytes(self) -> int:
        """Bytes of the device arena (equals ``config.total_bytes``)."""
        return self.kv.numel() * self.kv.element_size()

    @property
    def host_nbytes(self) -> int:
        return 0 if self.host_kv is None else self.host_kv.numel() * self.host_kv.element_size()

    def tier_window(self, num_blocks: int) -> None:
        """No sink or window rows for a prefix tier to keep (see :class:`RecentWindow`)."""
        return None

    # -- data ops ---------------------------------------------------------------------
    def write(self, layer: int, slot_mapping: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor) -> None:
        """Store ``kv_c`` ``[N, R]`` and ``k_pe`` ``[N, P]`` at ``slot_mapping`` in ``layer``
        (``[N, 1, R]`` and ``[N, 1, P]``, one latent "head", are taken as those)."""
        view = self.view(layer)
        kv_c, k_pe = (x[:, 0] if isinstance(x, torch.Tensor) and x.dim() == 3 and x.shape[1] == 1 else x
                      for x in (kv_c, k_pe))
        write_latent(view, slot_mapping, kv_c, k_pe)

    def gather(self, layer: int, indptr: torch.Tensor, indices: torch.Tensor, seq_lens: torch.Tensor, *,
               out_key=None, out_value=None, pending=None, rotated: bool = False, sink: int | None = None):
        """``(kv_c [T, R], k_pe [T, P])`` of ``layer`` in the model dtype (CSR tables).
        ``pending`` and ``sink`` change nothing (no rows are kept apart from the blocks)."""
        if rotated:
            require(ROW_ONLY_FORMATS, self.config)
        kv_c, k_pe = gather_latent(self.view(layer), indptr, indices, seq_lens)
        if out_key is not None:
            out_key.copy_(kv_c)
            out_value.copy_(k_pe)
            return out_key, out_value
        return kv_c, k_pe

    def gather_padded(self, layer: int, block_table, seq_lens, **kw):
        require("write / gather / gather_pages (every kv_dtype, kv_window, kv_sink_tokens)", self.config)

    def pin_sinks(self, blocks: np.ndarray, held_only: bool = False) -> None:
        """No sink rows to pin (MLA has no ``kv_sink_tokens``)."""

    def replaced(self, blocks) -> None:
        """Blocks written by other means: nothing kept beside them to forget."""

    def copy_blocks(self, pairs: torch.Tensor) -> None:
        """Copy block ``src`` to ``dst`` for each ``[P, 2]`` row, every layer (copy-on-write)."""
        op_checks.validate_copy_blocks([self.kv], pairs)
        _copy_blocks([self.kv], pairs)

    def _require_host(self) -> None:
        if self.host_kv is None:
            raise InvalidArgumentError(expected("host_num_blocks", "> 0 for offload/load", 0))

    def offload(self, pairs: torch.Tensor) -> None:
        """Copy device blocks to host blocks: rows ``(device_block, host_block)``."""
        self._require_host()
        _swap_blocks([self.kv], [self.host_kv], pairs)

    def load(self, pairs: torch.Tensor) -> None:
        """Copy host blocks back to device blocks: rows ``(host_block, device_block)``."""
        self._require_host()
        _swap_blocks([self.host_kv], [self.kv], pairs)

    def __repr__(self) -> str:
        c = self.config
        host = f", host_blocks={c.host_num_blocks}" if c.host_num_blocks else ""
        return (f"LatentStore(layers={c.num_layers}, blocks={c.resolved_num_blocks}, block_size={c.block_size}, "
                f"format={self.format.describe()}, device={self.device}, nbytes={self.nbytes}{host})")
