"""KVStore: the arenas that hold every layer's K/V blocks.

One allocation holds all layers (``[num_layers] + kv_cache_shape``), plus scale (and
zero-point) arenas when the cache is quantized (float32; int3 bfloat16), and optionally a
host-tier copy of the same arenas with ``host_num_blocks`` blocks for offload. The
store allocates once, at construction; nothing is allocated per block at run time.
The store moves bytes; which block goes where is the caller's decision.

Low-bit options (see :class:`~pagedkv.config.options.CacheConfig`): layers named in
``kv_full_precision_layers`` live in a second, model-dtype (or int8) arena; a rotated cache
stores ``rotate(K)``, ``rotate(V)`` (:mod:`pagedkv.format.rotation`) and unrotates on read,
both inside the data ops (``rotation_signs``, fused into the CPU loops and kernels); a
cache with ``kv_window`` also keeps each sequence's newest tokens in model precision
(:mod:`pagedkv.store.window`).
"""
from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Callable

import numpy as np
import torch

from pagedkv import ops
from pagedkv.config.memory import arena_bytes, check_device, check_fits
from pagedkv.config.options import CacheConfig
from pagedkv.errors import InvalidArgumentError, expected
from pagedkv.format import dtypes, op_checks
from pagedkv.format.layer_format import LayerFormat
from pagedkv.format.rotation import rotate, rotation_signs
from pagedkv.ops.attention_reference import ExactRows
from pagedkv.ops.views import KVLayerView
from pagedkv.store.block_keys import BlockKeys
from pagedkv.store.window import RecentWindow, blocks_of_csr, blocks_of_padded

__all__ = ["KVStore", "fp8_supported"]

_log = logging.getLogger("pagedkv.store.kvstore")

#: First CUDA compute capability with fp8 support (Ada, sm_89).
FP8_MIN_CAPABILITY = (8, 9)


def fp8_supported(device: torch.device) -> bool:
    """Whether ``device`` can use fp8 KV storage: CPU yes; CUDA from sm_89 (Ada/Hopper)."""
    if device.type != "cuda":
        return True
    return tuple(torch.cuda.get_device_capability(device)) >= FP8_MIN_CAPABILITY


def _window_option(cfg: CacheConfig):
    """The option to name when the window arena does not fit: whichever of the
    sequences it holds, the window or the sink tokens asks for the most."""
    window, sink = cfg.kv_window or 0, cfg.kv_sink_tokens or 0    # ints once the config is made
    per_seq = -(-window // cfg.block_size) + 1 + cfg.precise_sink_blocks
    if cfg.kv_window_sequences > per_seq:
        return "kv_window_sequences", cfg.kv_window_sequences
    if window >= sink:
        return "kv_window", window
    return "kv_sink_tokens", sink


#: past this many layer slots the layer count alone is checked first (no model has so many)
_MANY_LAYERS = 1 << 16


class KVStore:
    """Device arenas (and an optional host tier) for one :class:`CacheConfig`.

    Attributes:
        config: the effective config. It differs from ``requested_config`` only when
            fp8 storage fell back to int8 on a GPU without fp8 (seed 004); size the
            bookkeeping from ``config.resolved_num_blocks``.
        requested_config: the config passed in.
        kv: data arena (NHD ``[L, NB, 2, bs, H, D]``; int4: ``D / 2`` bytes). With
            ``kv_full_precision_layers`` it holds only the quantized layers, in order.
        kv_scale, kv_zero: ``config.scale_arena_shape``-like arenas (float32; int3
            bfloat16), or None.
        kv_full: model-dtype arena of ``kv_full_precision_layers`` (int8 with
            ``kv_full_precision_dtype="int8"``), or None.
        kv_full_scale, kv_full_zero: the int8 full-precision layers' per-token float32
            scale and zero point arenas (``[L_full, NB, 2, bs, H]``), or None.
        window: the :class:`~pagedkv.store.window.RecentWindow`, or None.
        format, full_format: the :class:`~pagedkv.format.layer_format.LayerFormat` of the
            main arena's layers (``kv_dtype``; the model dtype when not quantized) and of
            the model-precision layers (``kv_full_precision_layers``).
        rotation_signs: float32 ``[head_dim]`` signs of the rotation, or None.
        host_kv, host_kv_scale, host_kv_zero, host_kv_full: the host tier
            (``host_num_blocks`` blocks; pinned when the device is CUDA), or None.
    """

    def __init__(self, config: CacheConfig, *, fp8_check: Callable[[torch.device], bool] = fp8_supported):
        if not isinstance(config, CacheConfig):
            raise InvalidArgumentError(expected("config", "a CacheConfig", type(config).__name__))
        self.requested_config = config
        self.device = torch.device(config.device)
        check_device(self.device)   # before anything asks CUDA (the fp8 check below does)
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
        # The layer formats, built once and passed to every data op, which verify the
        # arenas against them instead of reading the format off the tensors.
        self.format = LayerFormat.of_config(config)
        self.full_format = (LayerFormat("int8") if config.quantized and config.kv_full_precision_dtype == "int8"
                            else LayerFormat.of_config(config, quantized=False))
        self._check_layers()      # before anything is built per layer slot
        # With layer groups the "layers" here are a block's layer slots (pagedkv.groups.layers).
        full = config.full_precision_slots
        quant = config.quantized_slots if config.quantized else tuple(range(config.arena_layers))
        # layer slot -> (quantized?, index in its arena)
        self._where = {}
        for i, layer in enumerate(quant):
            self._where[layer] = (config.quantized, i)
        for i, layer in enumerate(sorted(full)):
            self._where[layer] = (False, i)
        self._num_main, self._num_full = len(quant), len(full)
        self._check_sizes()
        (self.kv, self.kv_scale, self.kv_zero, self.key_scale, self.key_zero, self.kv_full, self.kv_full_scale,
         self.kv_full_zero) = self._allocate(config.resolved_num_blocks, self.device, pin=False)
        self.host_kv = self.host_kv_scale = self.host_kv_zero = self.host_kv_full = None
        self.host_key_scale = self.host_key_zero = self.host_kv_full_scale = self.host_kv_full_zero = None
        if config.host_num_blocks:
            pin = self.device.type == "cuda"
            (self.host_kv, self.host_kv_scale, self.host_kv_zero, self.host_key_scale, self.host_key_zero,
             self.host_kv_full, self.host_kv_full_scale, self.host_kv_full_zero) = self._allocate(
                config.host_num_blocks, torch.device("cpu"), pin=pin)
        self.rotation_signs = None
        if config.kv_rotation:
            self.rotation_signs = rotation_signs(config.head_dim, config.kv_rotation_seed).to(self.device)
        self.window = self.host_window = None
        if config.window_blocks:
            self.window = self._window(config.resolved_num_blocks, self.device)
            if config.host_num_blocks:      # one lock: offload and load read one window and claim in the other
                self.host_window = self._window(config.host_num_blocks, torch.device("cpu"), self.window.lock)
        self._block_keys = BlockKeys(self) if config.block_keys else None

    def _window(self, num_blocks: int, device: torch.device, lock=None) -> RecentWindow:
        c = self.config
        return RecentWindow(self._num_main, num_blocks, c.window_blocks, c.block_size, c.kv_heads_per_rank, c.head_dim,
                            c.kv_window or 0, c.torch_dtype, device, sink=c.kv_sink_tokens or 0,
                            pin_capacity=c.pinned_blocks, lock=lock)

    def tier_window(self, num_blocks: int) -> RecentWindow | None:
        """A host window arena over ``num_blocks`` prefix-tier slots, shaped like the
        device's and sharing its lock (None without one): where the host tier keeps its
        blocks' sink and window rows, so a promoted prefix reads them as in place."""
        if self.window is None:
            return None
        return self._window(num_blocks, torch.device("cpu"), self.window.lock)

    def _arena_specs(self, num_blocks: int):
        """``(field, shape, torch dtype)`` of every arena :meth:`_allocate` makes, in its
        order (None where the arena does not exist)."""
        cfg = self.config
        shape = (self._num_main,) + cfg.layer_shape(num_blocks)
        scale = zero = kscale = kzero = full = full_scale = None
        if cfg.quantized:
            groups = (cfg.param_groups,) if dtypes.info(cfg.kv_dtype).grouped else ()
            scale = (shape[:-1] + groups, cfg.torch_scale_dtype)
            if dtypes.info(cfg.kv_dtype).zero_point:
                zero = scale
        if cfg.block_keys:   # a zero scale marks a block whose keys are still per token
            kscale = kzero = ((self._num_main, num_blocks, cfg.kv_heads_per_rank, cfg.head_dim), torch.bfloat16)
        if self._num_full:
            rows = (self._num_full,) + cfg.layer_shape(num_blocks)[:-1]
            full = (rows + (cfg.head_dim,), self.full_format.data_dtype)
            if self.full_format.quantized:      # int8: a float32 scale and zero point per row
                full_scale = (rows, torch.float32)
        return [(shape, cfg.torch_cache_dtype), scale, zero, kscale, kzero, full, full_scale, full_scale]

    def _arena_needs(self, option: str, value, num_blocks: int):
        """Size-check entries (see :mod:`pagedkv.config.memory`) of the arenas for ``num_blocks``."""
        return [(option, value, arena_bytes(option, value, spec[0], spec[1].itemsize))
                for spec in self._arena_specs(num_blocks) if spec is not None]

    def _check_layers(self) -> None:
        """The size a layer count implies, checked from the count alone (no per-layer
        structure is built first: ``num_layers=10**9`` is an OutOfMemoryError, not a
        billion-entry tuple): every layer slot of every block holds at least its K and V
        rows in the smallest format (int3, 3 bits an element), and each slot costs the
        host about 256 bytes of bookkeeping. :meth:`_check_sizes` then sizes exactly."""
        cfg = self.config
        slots = cfg.arena_layers
        if slots <= _MANY_LAYERS:      # a real model's count: the exact check below names the option
            return
        rows = arena_bytes("num_layers", cfg.num_layers, (slots, cfg.resolved_num_blocks, 2 * cfg.block_size,
                                                          cfg.kv_heads_per_rank), max(1, cfg.head_dim * 3 // 8))
        host = [("num_layers", cfg.num_layers, arena_bytes("num_layers", cfg.num_layers, (slots,), 256))]
        if self.device.type == "cpu":
            check_fits(self.device, [("num_layers", cfg.num_layers, rows)] + host)
        else:
            check_fits(self.device, [("num_layers", cfg.num_layers, rows)])
            check_fits("cpu", host)

    def _check_sizes(self) -> None:
        """Every arena this store allocates, sized and compared with its device's free
        memory before the first allocation (host arenas count on the host)."""
        cfg = self.config
        option, value = (("memory_budget", cfg.memory_budget) if cfg.memory_budget is not None
                         else ("num_blocks", cfg.resolved_num_blocks))
        device = self._arena_needs(option, value, cfg.resolved_num_blocks)
        host = []
        if cfg.host_num_blocks:
            host = self._arena_needs("host_num_blocks", cfg.host_num_blocks, cfg.host_num_blocks)
        if cfg.window_blocks:
            wopt, wval = _window_option(cfg)
            device += RecentWindow.needs(wopt, wval, self._num_main, cfg.resolved_num_blocks, cfg.window_blocks,
                                         cfg.block_size, cfg.kv_heads_per_rank, cfg.head_dim, cfg.torch_dtype)
            if cfg.host_num_blocks:
                host += RecentWindow.needs("host_num_blocks", cfg.host_num_blocks, self._num_main,
                                           cfg.host_num_blocks, cfg.window_blocks, cfg.block_size,
                                           cfg.kv_heads_per_rank, cfg.head_dim, cfg.torch_dtype)
        if self.device.type == "cpu":
            check_fits(self.device, device + host)
        else:
            check_fits(self.device, device)
            check_fits("cpu", host)

    def _allocate(self, num_blocks: int, device: torch.device, pin: bool):
        kw = dict(device=device, pin_memory=pin) if pin else dict(device=device)
        return tuple(None if spec is None else torch.zeros(spec[0], dtype=spec[1], **kw)
                     for spec in self._arena_specs(num_blocks))

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

    def is_quantized_layer(self, layer: int) -> bool:
        """Whether ``layer`` is stored in ``kv_dtype`` (False for model-precision layers)."""
        return self._where[self._layer_index(layer)][0]

    def layer(self, layer: int) -> torch.Tensor:
        """Per-layer data view ``config.kv_cache_shape`` (no copy; model-precision layers:
        ``head_dim`` wide in the model dtype)."""
        main, i = self._where[self._layer_index(layer)]
        return self.kv_full[i] if (self.config.quantized and not main) else self.kv[i]

    def layer_format(self, layer: int) -> LayerFormat:
        """The format of ``layer`` (what the data ops are told about its views)."""
        main, _ = self._where[self._layer_index(layer)]
        return self.format if main else self.full_format

    def view(self, layer: int, sink: int | None = None) -> KVLayerView:
        """``layer`` as the data ops take it (:class:`~pagedkv.ops.views.KVLayerView`): its
        format, data and parameter views, rotation signs, and the window's model-precision
        rows a read takes instead of the arena's (read them under ``window.lock``).
        ``sink``: the sink tokens the tables read through this view start with, when not
        every sequence's ``kv_sink_tokens`` (a sliding-window group's; see
        :meth:`RecentWindow.overlay <pagedkv.store.window.RecentWindow.overlay>`)."""
        main, i = self._where[self._layer_index(layer)]
        scale, zero = self.layer_scales(layer)
        kscale, kzero = self.layer_key_params(layer)
        w, exact = self.window, None
        if main and w is not None and (w.window or w.sink):
            exact = ExactRows(w.data[i], w.slot_of, w.valid[i], w.window, w.sink if sink is None else sink)
        return KVLayerView(self.layer_format(layer), self.layer(layer), self.layout, scale, zero, kscale, kzero,
                           self.rotation_signs if main else None, exact)

    def attended(self, layer: int, indptr, indices, seq_lens, sink: int | None = None) -> None:
        """``layer`` was read in place through its view's exact rows (paged attention,
        under ``window.lock``; ``sink`` as for :meth:`view`). Once per pass (at the first
        quantized layer), as a gather does: the reads that found a window or sink row gone
        are counted, and the sequences' sink pins stay the most recently used."""
        main, i = self._where[self._layer_index(layer)]
        w = self.window
        if not main or i != 0 or w is None or not (w.window or w.sink):
            return
        ptr, idx, lens = (np.asarray(t.cpu() if hasattr(t, "cpu") else t) for t in (indptr, indices, seq_lens))
        lens = lens.astype(np.int64)
        w.count_fallbacks(blocks_of_csr(ptr, idx), lens, sink)
        if w.sink if sink is None else sink:
            w.touch_sinks(ptr, idx, lens, sink)

    def layer_scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Per-layer ``(scale, zero)`` views (NHD ``[NB, 2, bs, H]``, int4/int3 ``[NB, 2, bs, H, groups]``);
        None where not stored."""
        main, i = self._where[self._layer_index(layer)]
        if not main:
            if self.kv_full_scale is None or not self.config.quantized:
                return None, None
            return self.kv_full_scale[i], self.kv_full_zero[i]     # int8 full layers
        scale = self.kv_scale[i] if self.kv_scale is not None else None
        zero = self.kv_zero[i] if self.kv_zero is not None else None
        return scale, zero

    def layer_key_params(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Per-layer block-key ``(scale, zero)`` views ``[NB, H, D]`` (bfloat16; see
        :func:`pagedkv.format.quant.quantize_key_block`), or ``(None, None)``."""
        main, i = self._where[self._layer_index(layer)]
        if not main or self.key_scale is None:
            return None, None
        return self.key_scale[i], self.key_zero[i]

    def _groups(self, host: bool = False) -> list[list[torch.Tensor]]:
        """Arena groups that share a leading ``num_layers`` dim (for block copies)."""
        if host:
            main = [self.host_kv, self.host_kv_scale, self.host_kv_zero, self.host_key_scale, self.host_key_zero]
            full = [self.host_kv_full, self.host_kv_full_scale, self.host_kv_full_zero]
        else:
            main = [self.kv, self.kv_scale, self.kv_zero, self.key_scale, self.key_zero]
            full = [self.kv_full, self.kv_full_scale, self.kv_full_zero]
        groups = [[t for t in main if t is not None and t.shape[0]], [t for t in full if t is not None]]
        return [g for g in groups if g]

    @property
    def arenas(self) -> list[torch.Tensor]:
        """The device arenas: data, then scale and zero when stored, block-key scale and
        zero when stored, then the model-precision layers (and their int8 scale and zero)."""
        return [t for t in (self.kv, self.kv_scale, self.kv_zero, self.key_scale, self.key_zero, self.kv_full,
                            self.kv_full_scale, self.kv_full_zero) if t is not None]

    @property
    def host_arenas(self) -> list[torch.Tensor]:
        """The host-tier arenas (empty without a host tier)."""
        return [t for t in (self.host_kv, self.host_kv_scale, self.host_kv_zero, self.host_key_scale,
                            self.host_key_zero, self.host_kv_full, self.host_kv_full_scale, self.host_kv_full_zero)
                if t is not None]

    @property
    def nbytes(self) -> int:
        """Bytes of the device arenas and the window arena (equals ``config.total_bytes``)."""
        window = self.window.nbytes if self.window is not None else 0
        return sum(t.numel() * t.element_size() for t in self.arenas) + window

    @property
    def host_nbytes(self) -> int:
        """Bytes of the host-tier arenas (and the host window arena)."""
        window = self.host_window.nbytes if self.host_window is not None else 0
        return sum(t.numel() * t.element_size() for t in self.host_arenas) + window

    # -- data ops -----------------------------------------------------------------

    def write(self, layer: int, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store ``[num_tokens, H, D]`` K/V at ``slot_mapping`` (int64) in ``layer``."""
        view = self.layer(layer)
        scale, zero = self.layer_scales(layer)
        main, i = self._where[layer]
        if not main:    # model precision, or int8 (unrotated, no window)
            ops.write_kv(view, slot_mapping, key, value, layout=self.layout, kv_scale=scale, kv_zero=zero,
                         layer_format=self.full_format)
            return
        # a rotated cache's rows are rotated inside the quantizing write (every backend)
        ops.write_kv(view, slot_mapping, key, value, layout=self.layout, kv_scale=scale, kv_zero=zero,
                     rotation_signs=self.rotation_signs, layer_format=self.format)
        if self.window is not None:
            slots = slot_mapping.cpu().numpy()
            with self.window.lock:      # a seal reads window rows: no other claim may move them between
                # before the window's claim can take a block's slot (block keys are int4: scale and zero exist)
                if self._block_keys is not None and scale is not None and zero is not None:
                    self._block_keys.on_write(i, view, scale, zero, slots, key)
                self.window.write(i, slot_mapping, key, value, slots)

    def pin_sinks(self, blocks: np.ndarray, held_only: bool = False) -> None:
        """Pin sequences' first blocks (their ``kv_sink_tokens``) in the window arena
        (``held_only``: see :meth:`RecentWindow.pin`)."""
        if self.window is not None and self.window.sink:
            self.window.pin(blocks, held_only=held_only)

    def _read(self, layer, read, blocks_of, seq_lens, out_key, out_value, pending=None, rotated=False, sink=None):
        """Dequantize and unrotate (``read(out_dtype, signs, out_key, out_value)``: both
        inside the data op), overlay the window, fill outputs.

        ``pending``: int64 numpy ``[B]``, trailing tokens per sequence that the caller
        holds in flight and has not written yet (see :meth:`RecentWindow.overlay`).
        ``rotated`` (a rotated cache only, checked by the caller): return K/V in the
        rotated domain, as stored: the quantized rows skip the unrotation, and the rows
        kept in model precision (window, full-precision layers) are rotated here."""
        view = self.layer(layer)
        scale, zero = self.layer_scales(layer)
        main, i = self._where[layer]
        signs = None if rotated else self.rotation_signs
        rot = self.rotation_signs if rotated else None      # rotated: a rotated cache, which has signs
        to_rotated = None if rot is None else (lambda x: rotate(x.float(), rot))
        window = self.window
        if not main and not rotated:
            return read(self._out_dtype(main), None, out_key, out_value)
        if main and (window is None or not (window.window or window.sink)):   # nothing to overlay
            return read(self._out_dtype(main), signs, out_key, out_value)
        model = self.config.torch_dtype
        geo, _ = op_checks.check_gather(view, self.layout, model, scale, zero, self.layer_format(layer))
        total = int(seq_lens.sum()) if isinstance(seq_lens, torch.Tensor) and seq_lens.numel() else 0
        op_checks.check_out(out_key, out_value, total, geo, model, view.device)
        k, v = read(model, signs, None, None)
        if main and window is not None:     # main: the early return above left only a window to overlay
            window.overlay(i, blocks_of(), seq_lens.cpu().numpy(), k, v, pending, to_rotated, sink)
        elif to_rotated is not None:        # a model-precision layer read in the rotated domain
            k, v = to_rotated(k).to(model), to_rotated(v).to(model)
        if out_key is not None:
            out_key.copy_(k)
            out_value.copy_(v)
            return out_key, out_value
        return k, v

    def gather(
        self,
        layer: int,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        out_key: torch.Tensor | None = None,
        out_value: torch.Tensor | None = None,
        pending: np.ndarray | None = None,
        rotated: bool = False,
        sink: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous ``[sum(seq_lens), H, D]`` K/V of ``layer`` in the model dtype (CSR tables).

        ``pending``, ``rotated`` (validated by the caller): see :meth:`_read`; ``sink``:
        see :meth:`RecentWindow.overlay`."""
        view = self.layer(layer)
        scale, zero = self.layer_scales(layer)

        kscale, kzero = self.layer_key_params(layer)
        fmt = self.layer_format(layer)

        def read(out_dtype, signs, ok, ov):
            return ops.gather_kv(view, indptr, indices, seq_lens, layout=self.layout, out_dtype=out_dtype,
                                 kv_scale=scale, kv_zero=zero, out_key=ok, out_value=ov, rotation_signs=signs,
                                 key_scale=kscale, key_zero=kzero, layer_format=fmt)

        def blocks():
            return blocks_of_csr(indptr.cpu().numpy(), indices.cpu().numpy())

        return self._read(layer, read, blocks, seq_lens, out_key, out_value, pending, rotated, sink)

    def gather_padded(
        self,
        layer: int,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        out_key: torch.Tensor | None = None,
        out_value: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`gather` with a padded ``[B, max_blocks]`` int32 table."""
        view = self.layer(layer)
        scale, zero = self.layer_scales(layer)

        kscale, kzero = self.layer_key_params(layer)
        fmt = self.layer_format(layer)

        def read(out_dtype, signs, ok, ov):
            return ops.gather_kv_padded(view, block_table, seq_lens, layout=self.layout, out_dtype=out_dtype,
                                        kv_scale=scale, kv_zero=zero, out_key=ok, out_value=ov,
                                        rotation_signs=signs, key_scale=kscale, key_zero=kzero, layer_format=fmt)

        def blocks():
            return blocks_of_padded(block_table.cpu().numpy())

        return self._read(layer, read, blocks, seq_lens, out_key, out_value)

    def _out_dtype(self, main: bool = True) -> torch.dtype | None:
        quantized = self.format.quantized if main else self.full_format.quantized
        return self.config.torch_dtype if quantized else None

    def replaced(self, blocks) -> None:
        """Blocks whose bytes were written into the arenas by other means (a prefix tier's
        load, a transfer from another process): forget their window copies, which hold
        the previous occupant's tokens."""
        if self.window is not None and len(blocks):
            self.window.drop(np.asarray(blocks, dtype=np.int64))

    def copy_blocks(self, pairs: torch.Tensor) -> None:
        """Copy block ``src`` to ``dst`` for each ``[P, 2]`` row, all layers (copy-on-write):
        codes, scales, model-precision layers and window copies."""
        groups = self._groups()
        if not groups:   # no K/V layers (a pure Mamba model): its blocks hold no bytes to copy
            return
        op_checks.validate_copy_blocks(groups[0], pairs)  # all checks before any copy
        for g in groups:
            ops.copy_blocks(g, pairs)
        if self.window is not None and pairs.shape[0]:
            p = pairs.cpu().numpy().astype(np.int64)
            self.window.copy(p[:, 0], p[:, 1])

    def _require_host(self) -> None:
        if not self.config.host_num_blocks:
            raise InvalidArgumentError(expected("host_num_blocks", "> 0 for offload/load", 0))

    def offload(self, pairs: torch.Tensor) -> None:
        """Copy device blocks to host blocks: rows ``(device_block, host_block)``: codes,
        scales, model-precision layers and window copies (to the host window)."""
        self._require_host()
        src, dst = self._groups(), self._groups(host=True)
        op_checks.validate_swap_blocks(src[0], dst[0], pairs)
        for s, d in zip(src, dst):
            ops.swap_blocks(s, d, pairs)
        if self.window is not None and self.host_window is not None and pairs.shape[0]:   # one exists with the other
            p = pairs.cpu().numpy().astype(np.int64)
            self.host_window.copy(p[:, 0], p[:, 1], source=self.window)

    def load(self, pairs: torch.Tensor) -> None:
        """Copy host blocks back to device blocks: rows ``(host_block, device_block)``, with
        their window copies (a device block's previous window copy is dropped)."""
        self._require_host()
        src, dst = self._groups(host=True), self._groups()
        op_checks.validate_swap_blocks(src[0], dst[0], pairs)
        for s, d in zip(src, dst):
            ops.swap_blocks(s, d, pairs)
        if self.window is not None and pairs.shape[0]:
            p = pairs.cpu().numpy().astype(np.int64)
            self.window.copy(p[:, 0], p[:, 1], source=self.host_window)

    def __repr__(self) -> str:
        c = self.config
        host = f", host_blocks={c.host_num_blocks}" if c.host_num_blocks else ""
        extra = ""
        if c.quantized:
            extra = (f", bits_per_element={c.bits_per_element:g}, rotation={c.kv_rotation}, window={c.kv_window}"
                     f", full_precision_layers={list(c.kv_full_precision_layers)}")
        return (
            f"KVStore(layers={c.num_layers}, blocks={c.resolved_num_blocks}, block_size={c.block_size}, "
            f"kv_heads={c.num_kv_heads}, head_dim={c.head_dim}, dtype={c.cache_dtype}, layout={c.layout}, "
            f"device={self.device}, nbytes={self.nbytes}{extra}{host})"
        )
