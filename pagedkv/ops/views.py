"""Per-layer views: what a data op takes instead of loose tensors.

A view is one layer of a store as the ops see it: the layer's format and its
tensors, so an op's signature names the view, the tables and the inputs, never the
parts of a format. A store builds them (``store.view(layer)``): only it knows where a
layer's parts live.

- :class:`KVLayerView`: a layer of K and V rows: its
  :class:`~pagedkv.format.layer_format.LayerFormat`, data view, layout, scale and zero
  views, block-key parameters, rotation signs and the model-precision rows read instead
  of the arena's (:class:`~pagedkv.ops.attention_reference.ExactRows`, a store's window).
  :func:`pagedkv.ops.write_kv`, :func:`~pagedkv.ops.gather_kv` and
  :func:`~pagedkv.ops.paged_attention` take one in place of their ``kv_layer`` and
  layer keywords.
- :class:`LatentView`: an MLA layer: a :class:`~pagedkv.format.latent.LatentFormat` and
  its ``[num_blocks, block_size, row]`` arena view (the row carries its own scales),
  checked against each other (:meth:`LatentView.check`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pagedkv.errors import InvalidArgumentError, expected
from pagedkv.format.latent_checks import LatentView
from pagedkv.format.layer_format import LayerFormat
from pagedkv.ops.attention_reference import ExactRows

__all__ = ["KVLayerView", "LatentView", "unpack"]

#: the layer keywords of the K/V ops a KVLayerView stands for, with their defaults
_LAYER_KEYWORDS = {"layout": "NHD", "kv_scale": None, "kv_zero": None, "key_scale": None, "key_zero": None,
                   "rotation_signs": None, "layer_format": None, "exact_rows": None}


@dataclass(frozen=True)
class KVLayerView:
    """One layer of K and V rows, as the data ops take it (built by ``KVStore.view``).

    ``data``: NHD ``[NB, 2, bs, H, D']`` or HND ``[NB, 2, H, bs, D']`` (the stored row
    width); ``scale``/``zero``: its quantization parameters (None unquantized);
    ``key_scale``/``key_zero``: int4 block keys' per-channel parameters;
    ``rotation_signs``: a rotated layer's signs; ``exact``: the rows a read takes in model
    precision instead of the arena's (the window and sink rows), or None."""

    format: LayerFormat
    data: torch.Tensor
    layout: str = "NHD"
    scale: torch.Tensor | None = None
    zero: torch.Tensor | None = None
    key_scale: torch.Tensor | None = None
    key_zero: torch.Tensor | None = None
    rotation_signs: torch.Tensor | None = None
    exact: ExactRows | None = None

    def keywords(self, attention: bool = False) -> dict:
        """The op keywords this view stands for (``exact_rows`` only for attention: a
        gather overlays the window itself)."""
        out: dict[str, Any] = dict(layout=self.layout, kv_scale=self.scale, kv_zero=self.zero, key_scale=self.key_scale,
                   key_zero=self.key_zero, rotation_signs=self.rotation_signs, layer_format=self.format)
        if attention:
            out["exact_rows"] = self.exact
        return out


def unpack(op: str, kv_layer: object, given: dict, attention: bool = False, write: bool = False):
    """``(data, keywords)`` of an op's ``kv_layer`` argument: a :class:`KVLayerView`
    stands for the data view and the layer keywords, which must then not be given too
    (a typed error naming the first); a tensor passes through with ``given``."""
    if not isinstance(kv_layer, KVLayerView):
        return kv_layer, given
    for k, default in _LAYER_KEYWORDS.items():
        v = given.get(k, default)
        if v is not None and not (isinstance(v, str) and v == default):
            raise InvalidArgumentError(expected(k, f"its default with a KVLayerView ({op} takes the layer's "
                                                "parts from the view)", v if isinstance(v, str) else type(v).__name__))
    out = {k: v for k, v in given.items() if k not in _LAYER_KEYWORDS}
    kw = kv_layer.keywords(attention)
    if write:
        kw.pop("key_scale")
        kw.pop("key_zero")
    out.update(kw)
    return kv_layer.data, out
