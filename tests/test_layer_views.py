"""Per-layer views: a store hands the ops one object per layer (its format, views,
parameters and exact rows), and the ops read the same through it as through the loose
tensors; the manager builds attention from the view, never from the store's internals."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedkv import CacheConfig, PagedKVCache
from pagedkv.errors import InvalidArgumentError
from pagedkv.ops import KVLayerView, gather_kv, paged_attention, write_kv
from pagedkv.ops.views import LatentView

WINDOWED = dict(num_layers=3, num_kv_heads=2, head_dim=16, block_size=4, num_blocks=32, dtype="float32",
                kv_dtype="int4", kv_window=5, kv_sink_tokens=4, kv_full_precision_layers=(2,))


def filled(**cfg) -> PagedKVCache:
    kv = PagedKVCache(CacheConfig(**cfg))
    kv.add_sequence("a", list(range(19)))
    slots = kv.reserve("a", 19)
    g = torch.Generator().manual_seed(0)
    for layer in range(kv.config.num_layers):
        k = torch.randn(19, 2, 16, generator=g)
        kv.write(layer, slots, k, -k)
    kv.commit("a", 19)
    return kv


def test_a_store_view_is_the_layers_parts():
    kv = filled(**WINDOWED)
    store = kv.store
    for layer in range(3):
        view = store.view(layer)
        assert isinstance(view, KVLayerView)
        assert view.data is not None and view.format == store.layer_format(layer)
        scale, zero = store.layer_scales(layer)
        if layer == 2:
            assert view.scale is None and scale is None and view.zero is None
        else:
            assert view.scale.data_ptr() == scale.data_ptr() and view.zero.data_ptr() == zero.data_ptr()
        assert view.layout == "NHD"
        # the window's rows are the quantized layers' only: the full-precision layer reads its arena
        assert (view.exact is None) == (layer == 2)
        assert (view.rotation_signs is None) == (layer == 2)
    kv.free("a")


NONE_PENDING = np.zeros(1, np.int32)     # one row, none of its positions written by this pass


def test_attention_through_a_view_equals_the_loose_tensors():
    kv = filled(**WINDOWED)
    store = kv.store
    indptr, indices, _ = kv.page_table_csr(["a"])
    lens = kv.seq_lens(["a"]).astype(np.int32)
    q = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(1))
    qi = np.array([0, 2], dtype=np.int32)
    for layer in range(3):
        view = store.view(layer)
        loose = paged_attention(q, view.data, indptr, indices, lens, qi, layout=view.layout, kv_scale=view.scale,
                                kv_zero=view.zero, key_scale=view.key_scale, key_zero=view.key_zero,
                                rotation_signs=view.rotation_signs, exact_rows=view.exact, layer_format=view.format)
        assert torch.equal(paged_attention(q, view, indptr, indices, lens, qi), loose)
        # committed rows only (no row of this pass): pending zeros
        assert torch.equal(kv.attention(layer, q, indptr, indices, lens, qi, pending=NONE_PENDING), loose)
        k1, v1 = gather_kv(view, torch.from_numpy(indptr), torch.from_numpy(indices), torch.from_numpy(lens),
                           out_dtype=torch.float32)
        k2, v2 = gather_kv(view.data, torch.from_numpy(indptr), torch.from_numpy(indices), torch.from_numpy(lens),
                           out_dtype=torch.float32, kv_scale=view.scale, kv_zero=view.zero,
                           rotation_signs=view.rotation_signs, layer_format=view.format)
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    kv.free("a")


def test_a_write_through_a_view_stores_the_same_bytes():
    a, b = filled(**WINDOWED), filled(**WINDOWED)
    slots = torch.from_numpy(a.reserve("a", 1))
    b.reserve("a", 1)
    k = torch.randn(1, 2, 16, generator=torch.Generator().manual_seed(5))
    va, vb = a.store.view(0), b.store.view(0)
    write_kv(va, slots, k, k)
    write_kv(vb.data, slots, k, k, kv_scale=vb.scale, kv_zero=vb.zero, rotation_signs=vb.rotation_signs,
             layer_format=vb.format)
    assert torch.equal(va.data, vb.data) and torch.equal(va.scale, vb.scale)
    a.free("a")
    b.free("a")


def test_a_view_and_layer_keywords_together_are_refused():
    kv = filled(**WINDOWED)
    view = kv.store.view(0)
    indptr, indices, _ = kv.page_table_csr(["a"])
    lens = kv.seq_lens(["a"]).astype(np.int32)
    q = torch.randn(1, 4, 16)
    with pytest.raises(InvalidArgumentError, match=r"kv_scale: expected its default with a KVLayerView "
                                                   r"\(paged_attention takes the layer's parts from the view\), "
                                                   r"got Tensor"):
        paged_attention(q, view, indptr, indices, lens, np.array([0, 1], np.int32), kv_scale=view.scale)
    with pytest.raises(InvalidArgumentError, match=r"layout: expected its default with a KVLayerView"):
        gather_kv(view, torch.from_numpy(indptr), torch.from_numpy(indices), torch.from_numpy(lens), layout="HND")
    kv.free("a")


def test_attention_keeps_the_sink_pins_most_recently_used_through_the_store():
    kv = filled(**dict(WINDOWED, kv_window_sequences=2))
    w = kv.store.window
    indptr, indices, _ = kv.page_table_csr(["a"])
    lens = kv.seq_lens(["a"]).astype(np.int32)
    first = int(w.slot_of[indices[0]])
    assert first >= 0 and w.pinned[first]
    before = int(w.stamp[first])
    kv.attention(0, torch.randn(1, 4, 16), indptr, indices, lens, np.array([0, 1], np.int32), pending=NONE_PENDING)
    assert int(w.stamp[first]) > before
    stamp = int(w.stamp[first])
    kv.attention(1, torch.randn(1, 4, 16), indptr, indices, lens, np.array([0, 1], np.int32), pending=NONE_PENDING)
    assert int(w.stamp[first]) == stamp          # once per pass: the first quantized layer
    kv.free("a")


def test_an_mla_store_hands_out_latent_views():
    kv = PagedKVCache(CacheConfig(num_layers=2, num_kv_heads=1, head_dim=160, kv_lora_rank=128, qk_rope_head_dim=32,
                                  num_blocks=4, kv_dtype="int8"))
    view = kv.store.view(1)
    assert isinstance(view, LatentView) and view.data.data_ptr() == kv.store.kv[1].data_ptr()
    view.check()


def test_a_planned_step_runs_every_layer_as_attention_does():
    kv = filled(**WINDOWED)
    indptr, indices, _ = kv.page_table_csr(["a"])
    lens = kv.seq_lens(["a"]).astype(np.int32)
    qi = np.array([0, 2], dtype=np.int32)
    step = kv.plan_attention(indptr, indices, lens, qi, sm_scale=0.3, soft_cap=5.0, pending=NONE_PENDING)
    assert all(t.dtype == torch.int32 for t in step.step.tables())      # moved once, at the plan
    h = kv.config.num_kv_heads
    passed = kv.plan_attention(indptr, indices, lens, qi, sm_scale=0.3, soft_cap=5.0)   # every query's own row
    for layer in range(3):
        q = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(layer))
        want = kv.attention(layer, q, indptr, indices, lens, qi, sm_scale=0.3, soft_cap=5.0, pending=NONE_PENDING)
        assert torch.equal(step.run(layer, q), want)
        out = torch.empty_like(q)
        assert step.run(layer, q, out=out) is out and torch.equal(out, want)
        # the pass's own K/V, given per layer to a step planned once, read as attention() reads them
        k_new, v_new = (torch.randn(2, h, 16, generator=torch.Generator().manual_seed(10 + layer + i))
                        for i in (0, 1))
        want = kv.attention(layer, q, indptr, indices, lens, qi, sm_scale=0.3, soft_cap=5.0, k_new=k_new, v_new=v_new)
        assert torch.equal(passed.run(layer, q, k_new=k_new, v_new=v_new), want)
    kv.free("a")


def test_a_planned_step_runs_mla_layers_and_refuses_what_they_do_not_take():
    kv = PagedKVCache(CacheConfig(num_layers=2, num_kv_heads=1, head_dim=160, kv_lora_rank=128, qk_rope_head_dim=32,
                                  num_blocks=8, block_size=4, dtype="float32", kv_dtype="fp8"))
    kv.add_sequence("a", list(range(9)))
    slots = kv.reserve("a", 9)
    g = torch.Generator().manual_seed(2)
    for layer in range(2):
        kv.write(layer, slots, torch.randn(9, 128, generator=g), torch.randn(9, 32, generator=g))
    kv.commit("a", 9)
    indptr, indices, _ = kv.page_table_csr(["a"])
    lens = kv.seq_lens(["a"]).astype(np.int32)
    qi = np.array([0, 1], dtype=np.int32)
    qn, qp = torch.randn(1, 3, 128, generator=g), torch.randn(1, 3, 32, generator=g)
    step = kv.plan_attention(indptr, indices, lens, qi, sm_scale=0.125)
    for layer in range(2):
        assert torch.equal(step.run(layer, (qn, qp)),
                           kv.mla_attention(layer, qn, qp, indptr, indices, lens, qi, sm_scale=0.125))
    with pytest.raises(InvalidArgumentError, match=r"q: expected \(q_nope, q_pe\) for MLA latent rows, got Tensor"):
        step.run(0, qn)
    with pytest.raises(InvalidArgumentError, match=r"soft_cap: expected unset for MLA latent rows, got 5.0"):
        kv.plan_attention(indptr, indices, lens, qi, sm_scale=0.125, soft_cap=5.0).run(0, (qn, qp))
    kv.free("a")
