"""The per-layer objects of a :class:`~pagedkv.integrations.transformers.PagedCache`:
transformers' ``Cache`` holds one per model layer and calls it; every call goes to the
parent, which holds all the state (rows, plan, columns) for every layer at once."""
from __future__ import annotations

from typing import TYPE_CHECKING

from pagedkv.errors import InvalidArgumentError, expected

try:
    from transformers.cache_utils import CacheLayerMixin, DummyLayer
except ImportError as exc:  # pragma: no cover - transformers < 4.56
    raise ImportError(
        "pagedkv.integrations.transformers needs transformers >= 4.56 (the layered Cache API); "
        f"importing transformers.cache_utils.CacheLayerMixin failed: {exc}"
    ) from exc

if TYPE_CHECKING:
    from pagedkv.integrations.transformers import PagedCache

__all__ = ["PagedLayer", "model_layers"]


class PagedLayer(CacheLayerMixin):
    """One model layer's view of a :class:`PagedCache`; all state lives in the parent."""

    is_sliding = False
    is_compileable = False
    is_croppable = True
    # generate/export may pre-allocate layers with fake tensors; a paged layer has
    # nothing to pre-allocate, so early_initialization must skip it.
    supports_early_init = False

    def __init__(self, parent: PagedCache, layer_idx: int, window: int = 0):
        super().__init__()
        self.parent = parent
        self.layer_idx = layer_idx
        self.is_sliding = window > 0     # a sliding-window layer (see hf_windows)
        self.sliding_window = window if window else None

    def lazy_initialization(self, key_states, value_states=None) -> None:
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        return self.parent.update(key_states, value_states, self.layer_idx)

    def get_mask_sizes(self, query_length, *args) -> tuple:
        return self.parent.get_mask_sizes(query_length, self.layer_idx)

    def get_seq_length(self) -> int:
        return self.parent.get_seq_length()

    @property
    def record_past(self) -> bool:
        return self.parent._holding

    @record_past.setter
    def record_past(self, value: bool) -> None:
        # generate() turns recording off layer by layer when it hands the cache back
        if not value:
            self.parent._stop_holding()

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:  # transformers 4.56/4.57 name
        return -1

    def reset(self) -> None:
        self.parent.reset()

    def crop(self, tokens_to_remove: int) -> None:
        # Rows are shared by every layer: cropping one layer would crop them all.
        raise InvalidArgumentError(expected("crop", "PagedCache.crop (all layers at once)",
                                            f"PagedLayer.crop on layer {self.layer_idx}"))

    def reorder_cache(self, beam_idx) -> None:
        self.parent.reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.parent.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices) -> None:
        self.parent.batch_select_indices(indices)

    def offload(self):  # the arena is the cache's; nothing per layer to move
        pass

    def prefetch(self):
        pass


def model_layers(parent: PagedCache, kinds, windows) -> list:
    """One layer object per model layer of a cache with recurrent-state layers: a
    :class:`PagedLayer` (K/V), a state layer, both (a hybrid layer) or a dummy."""
    from pagedkv.integrations.hf_states import PagedStateLayer

    # Falcon-H1, Zamba2: a state and K/V in one layer (the state mixin's read-only flags win)
    class PagedHybridLayer(PagedStateLayer, PagedLayer):  # type: ignore[override]
        def __init__(self, parent, layer_idx: int, window: int = 0):
            PagedLayer.__init__(self, parent, layer_idx, window)
            PagedStateLayer.__init__(self, parent, layer_idx)

        def lazy_initialization(self, *args, **kwargs) -> None:
            self.is_initialized = True

    out: list = []
    kv_layer = 0
    for i, k in enumerate(kinds):
        if k == "attention":
            out.append(PagedLayer(parent, i, windows[kv_layer]))
        elif k == "hybrid":
            out.append(PagedHybridLayer(parent, i, windows[kv_layer]))
        elif k == "state":
            out.append(PagedStateLayer(parent, i))
        else:
            out.append(DummyLayer())
        kv_layer += k in ("attention", "hybrid")
    return out
