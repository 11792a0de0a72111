"""The connector's worker side on vLLM's GPU block layouts, with CPU tensors (no vLLM needed).

Each layout's tensor is built from one truth ``[L, NB, 2, H, bs, D]`` by an explicit
index formula (not by the module's views), blocks go from one engine's tensors through
the shared arena into another's (of the same or another layout), and every element is
compared as bytes (fp8 included)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from backend_cases import NO_GPU

from pagedkv.integrations.vllm_config import ConnectorConfig
from pagedkv.integrations.vllm_layout import detect_layout
from pagedkv.integrations.vllm_store import KVSpec, PrefixStore
from pagedkv.integrations.vllm_worker import BlockMover

L, NB, H, BS, D = 3, 6, 2, 4, 8
BACKEND = {"cpu": "CPU_ATTN", "kv_last": "FLASH_ATTN", "flash_attn": "FLASH_ATTN", "nhd": "FLASHINFER", "hnd": None}
DTYPES = [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.uint8]   # uint8: vLLM's fp8 cache bytes


def truth(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (L, NB, 2, H, BS, D, 2), dtype=np.uint8)


def _index(layout: str, b, kv, h, t, d):
    """Where element (block b, K/V kv, head h, token t, dim d) sits in a layer's tensor."""
    if layout == "cpu":        # [NB, H, bs, 2D] flat per (block, head): K transposed, then V
        off = np.where(kv == 0, d * BS + t, D * BS + t * D + d)
        return b, h, off // (2 * D), off % (2 * D)
    if layout == "kv_last":    # [NB, H, bs, 2D]: K | V along the last dim
        return b, h, t, kv * D + d
    if layout == "flash_attn":  # [2, NB, bs, H, D]
        return kv, b, t, h, d
    if layout == "nhd":        # [NB, 2, bs, H, D]
        return b, kv, t, h, d
    return b, kv, h, t, d      # hnd [NB, 2, H, bs, D]


SHAPES = {"cpu": (NB, H, BS, 2 * D), "kv_last": (NB, H, BS, 2 * D), "flash_attn": (2, NB, BS, H, D),
          "nhd": (NB, 2, BS, H, D), "hnd": (NB, 2, H, BS, D)}


def build(layout: str, tr: np.ndarray, dtype: torch.dtype, stacking: str):
    """vLLM's tensors for ``tr`` (element bytes) in ``layout``: per layer, stacked ``[L, ...]``
    or ``[NB, L, ...]``, or strided (HND memory seen through a logical NHD view)."""
    size = torch.empty(0, dtype=dtype).element_size()
    grid = np.indices((NB, 2, H, BS, D)).reshape(5, -1)
    layers = []
    for layer in range(L):
        a = np.zeros(SHAPES[layout] + (size,), dtype=np.uint8)
        a[_index(layout, *grid)] = tr[layer].reshape(-1, 2)[:, :size]
        layers.append(torch.from_numpy(a).view(dtype).squeeze(-1))
    if stacking == "layers":
        return layers
    if stacking == "L_first":
        return torch.stack(layers)
    if stacking == "NB_first":
        return torch.stack(layers, dim=1)
    # strided: the same logical tensor over memory in another physical order
    out = []
    for t in layers:
        perm = (0, 2, 1, 3) if layout == "kv_last" else (0, 1, 3, 2, 4)   # swap heads and tokens
        phys = t.permute(*perm).contiguous()
        out.append(phys.permute(*perm))
        assert not out[-1].is_contiguous()
        assert torch.equal(out[-1].contiguous().view(torch.uint8), t.view(torch.uint8))
    return out


def element_bytes(layout: str, kv, layer: int) -> np.ndarray:
    """``[NB, 2, H, bs, D, size]`` bytes of one layer, read back through the explicit formula."""
    if isinstance(kv, list):
        t = kv[layer]
    else:
        t = kv[layer] if kv.shape[0] == L and kv.dim() == len(SHAPES[layout]) + 1 and \
            tuple(kv.shape[1:]) == SHAPES[layout] else kv[:, layer]
    arr = t.cpu().contiguous().view(torch.uint8).reshape(*t.shape, -1).numpy()
    grid = np.indices((NB, 2, H, BS, D)).reshape(5, -1)
    return arr[_index(layout, *grid)].reshape(NB, 2, H, BS, D, -1)


def store_for(dtype):
    return PrefixStore(ConnectorConfig.from_extra({"host_blocks": 8}), KVSpec(L, H, BS, D, dtype), "model")


STACKINGS = ["layers", "L_first", "NB_first", "strided"]


def on(device: str, kv):
    """``kv`` moved to ``device``, strides kept (a dense permuted view stays one)."""
    return [t.to(device) for t in kv] if isinstance(kv, list) else kv.to(device)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", list(SHAPES))
def test_round_trip_through_the_arena_element_for_element(layout, dtype, device):
    """On CUDA tensors (benchmarks/gpu_check.sh runs the tests marked cuda) the same
    round trip goes through the device gather/scatter and pinned host memory."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip(NO_GPU)
    spec = KVSpec(L, H, BS, D, dtype)
    if device == "cuda" and layout == "cpu":
        got = BlockMover().register(spec, on(device, build(layout, truth(1), dtype, "layers")), None)
        assert got is not None and "shape" in got      # vLLM's CPU layout never comes from a GPU
        return
    store = store_for(dtype)
    try:
        for stacking in STACKINGS:
            if stacking == "NB_first" and layout == "flash_attn":
                continue                         # blocks are not its first axis
            if stacking == "strided" and layout in ("cpu", "flash_attn", "hnd"):
                continue                         # vLLM hands these over as allocated
            src, dst = BlockMover(), BlockMover()
            tr = truth(1)
            src_kv = on(device, build(layout, tr, dtype, stacking))
            dst_kv = on(device, build(layout, np.zeros_like(tr), dtype, stacking))
            assert src.register(spec, src_kv, BACKEND[layout]) is None
            assert dst.register(spec, dst_kv, BACKEND[layout]) is None
            assert src.layout == layout
            assert all(lb.raw.device.type == device for lb in src.kv)
            sa_codec = src.arena(store.arena.name)[0]
            src.save(*sa_codec, [(4, 0), (1, 1), (5, 2)])        # (vLLM block, slot)
            dst.load(*dst.arena(store.arena.name)[0], [(0, 2), (1, 3), (2, 0)])   # (slot, vLLM block)
            for layer in range(L):
                want = np.zeros_like(element_bytes(layout, src_kv, layer))
                got_src = element_bytes(layout, src_kv, layer)
                want[[2, 3, 0]] = got_src[[4, 1, 5]]
                got = element_bytes(layout, dst_kv, layer)
                np.testing.assert_array_equal(got, want, err_msg=f"{stacking} layer {layer}")
                size = dtype.itemsize
                np.testing.assert_array_equal(got_src, tr[layer][..., :size])   # the source is untouched
    finally:
        store.close()


@pytest.mark.parametrize("a,b", [("flash_attn", "cpu"), ("cpu", "nhd"), ("kv_last", "hnd")])
def test_blocks_stored_in_one_layout_load_into_another(a, b):
    """The arena keeps one block form: a GPU engine's blocks serve a CPU engine and back."""
    dtype = torch.bfloat16
    spec, store = KVSpec(L, H, BS, D, dtype), store_for(dtype)
    try:
        src, dst = BlockMover(), BlockMover()
        tr = truth(2)
        src_kv, dst_kv = build(a, tr, dtype, "layers"), build(b, np.zeros_like(tr), dtype, "layers")
        assert src.register(spec, src_kv, BACKEND[a]) is None and dst.register(spec, dst_kv, BACKEND[b]) is None
        src.save(*src.arena(store.arena.name)[0], [(3, 5)])
        dst.load(*dst.arena(store.arena.name)[0], [(5, 1)])
        for layer in range(L):
            np.testing.assert_array_equal(element_bytes(b, dst_kv, layer)[1], tr[layer][3])
            assert not element_bytes(b, dst_kv, layer)[[0, 2, 3, 4, 5]].any()
    finally:
        store.close()


def test_unknown_or_ambiguous_layouts_are_refused_with_the_reason():
    spec = KVSpec(L, H, BS, D, torch.bfloat16)
    tr = truth(3)
    cases = [
        ([torch.zeros(NB, H, BS, 3 * D, dtype=torch.bfloat16)] * L, None, "shape"),     # no layout
        (build("cpu", tr, torch.bfloat16, "layers"), None, "fits cpu, kv_last"),         # same shape
        (build("flash_attn", tr, torch.bfloat16, "layers"), "CPU_ATTN", "shape"),        # not CPU_ATTN's
        (build("nhd", tr, torch.float16, "layers"), "FLASHINFER", "dtype"),
        (build("nhd", tr, torch.bfloat16, "layers")[:2], "FLASHINFER", "3 layers"),
        (build("nhd", tr, torch.bfloat16, "layers"), "MY_BACKEND", "attention backend"),
        ([*build("nhd", tr, torch.bfloat16, "layers")[:2], build("hnd", tr, torch.bfloat16, "layers")[2]],
         None, "layer 0's nhd"),
    ]
    for kv, backend, why in cases:
        m = BlockMover()
        got = m.register(spec, kv, backend)
        assert got is not None and why in got, (why, got)
        assert m.kv is None and m.refused == got
    # H == bs: nhd and hnd have one shape; the backend's name decides, or it is refused
    sq = KVSpec(L, 4, 4, D, torch.bfloat16)
    kv = [torch.zeros(NB, 2, 4, 4, D, dtype=torch.bfloat16) for _ in range(L)]
    assert "fits nhd, hnd" in BlockMover().register(sq, kv, None)
    assert [lb.layout for lb in detect_layout(kv, L, 4, 4, D, torch.bfloat16, "FLASHINFER")] == ["nhd"] * L


def test_fp8_kv_is_kept_as_bytes_and_refuses_requantizing():
    from pagedkv.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="storage"):
        PrefixStore(ConnectorConfig.from_extra({"host_blocks": 8, "storage": "int8"}),
                    KVSpec(L, H, BS, D, torch.uint8), "model")
