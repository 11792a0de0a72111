"""KVStore: arenas, views, quantized scales, host tier, fp8 fallback."""
import logging

import pytest
import torch

from pagedkv.config.options import CacheConfig
from pagedkv.errors import InvalidArgumentError, InvalidBlockError
from pagedkv.format.quant import dequantize, quantize
from pagedkv.store.kvstore import KVStore, fp8_supported


def make(**kw):
    base = dict(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=6)
    base.update(kw)
    return KVStore(CacheConfig(**base))


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("kv_dtype,storage", [(None, torch.float16), ("fp8", torch.float8_e4m3fn),
                                              ("fp8_e5m2", torch.float8_e5m2), ("int8", torch.int8)])
def test_one_allocation_per_arena_with_config_shapes(layout, kv_dtype, storage):
    s = make(layout=layout, kv_dtype=kv_dtype)
    c = s.config
    assert s.kv.shape == c.arena_shape and s.kv.dtype == storage and s.kv.is_contiguous()
    assert not bool(s.kv.view(torch.uint8).any())  # starts zeroed
    if kv_dtype is None:
        assert s.kv_scale is None and s.kv_zero is None and s.arenas == [s.kv]
    else:
        assert s.kv_scale.shape == c.scale_arena_shape and s.kv_scale.dtype == torch.float32
        assert (s.kv_zero is not None) == (kv_dtype == "int8")
    assert s.nbytes == c.total_bytes
    # per-layer views share the one allocation
    for layer in range(c.num_layers):
        view = s.layer(layer)
        assert view.shape == c.kv_cache_shape
        assert view.data_ptr() == s.kv.data_ptr() + layer * view.numel() * view.element_size()
    assert s.host_kv is None and s.host_arenas == [] and s.host_nbytes == 0


def test_budget_sized_store_matches_budget():
    s = KVStore(CacheConfig(num_layers=2, num_kv_heads=2, head_dim=16, memory_budget="1MiB", kv_dtype="int8"))
    assert s.nbytes == s.config.total_bytes <= 1024**2
    assert s.num_blocks == s.config.resolved_num_blocks


def test_layer_index_is_checked():
    s = make()
    for bad in (-1, 3, 1.0, True):
        with pytest.raises(InvalidArgumentError, match=r"^layer: expected an int in \[0, 3\), got"):
            s.layer(bad)
    with pytest.raises(InvalidArgumentError, match=r"^config: expected a CacheConfig, got dict$"):
        KVStore({"num_layers": 1})


@pytest.mark.parametrize("kv_dtype", [None, "fp8", "int8"])
def test_write_and_gather_round_trip_per_layer(kv_dtype):
    s = make(kv_dtype=kv_dtype, dtype="bf16")
    g = torch.Generator().manual_seed(0)
    k = torch.randn(6, 2, 8, generator=g).bfloat16()
    v = torch.randn(6, 2, 8, generator=g).bfloat16()
    slots = torch.tensor([4 * 5 + 0, 4 * 5 + 1, 4 * 5 + 2, 4 * 5 + 3, 4 * 2 + 0, 4 * 2 + 1])
    s.write(1, slots, k, v)
    gk, gv = s.gather(1, torch.tensor([0, 2], dtype=torch.int32), torch.tensor([5, 2], dtype=torch.int32),
                      torch.tensor([6], dtype=torch.int32))
    pk, pv = s.gather_padded(1, torch.tensor([[5, 2, -1]], dtype=torch.int32), torch.tensor([6], dtype=torch.int32))
    want_k = k if kv_dtype is None else dequantize(*quantize(k, kv_dtype), torch.bfloat16)
    want_v = v if kv_dtype is None else dequantize(*quantize(v, kv_dtype), torch.bfloat16)
    assert gk.dtype == torch.bfloat16
    assert torch.equal(gk, want_k) and torch.equal(gv, want_v) and torch.equal(pk, gk) and torch.equal(pv, gv)
    # other layers untouched
    assert not bool(s.kv[0].view(torch.uint8).any()) and not bool(s.kv[2].view(torch.uint8).any())
    if kv_dtype is not None:
        scale, zero = s.layer_scales(1)
        assert scale.shape == (6, 2, 4, 2) and bool((scale[5, 0] != 0).all())
        assert (zero is not None) == (kv_dtype == "int8")


def test_copy_blocks_moves_data_and_scales_in_every_layer():
    s = make(kv_dtype="int8")
    for t in s.arenas:
        t.view(torch.uint8).copy_(torch.randint(0, 255, t.view(torch.uint8).shape, dtype=torch.uint8))
    before = [t.clone() for t in s.arenas]
    ptrs = [t.data_ptr() for t in s.arenas]
    s.copy_blocks(torch.tensor([[0, 3], [1, 4]]))
    for b, t in zip(before, s.arenas):
        assert torch.equal(t[:, 3].view(torch.uint8), b[:, 0].view(torch.uint8))
        assert torch.equal(t[:, 4].view(torch.uint8), b[:, 1].view(torch.uint8))
        assert torch.equal(t[:, 5].view(torch.uint8), b[:, 5].view(torch.uint8))
    assert [t.data_ptr() for t in s.arenas] == ptrs  # nothing reallocated


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_host_tier_offload_and_load(kv_dtype):
    s = make(kv_dtype=kv_dtype, host_num_blocks=3)
    assert [h.shape[1] for h in s.host_arenas] == [3] * len(s.arenas)
    assert all(h.device.type == "cpu" for h in s.host_arenas)
    assert s.host_nbytes == 3 * s.config.bytes_per_block
    for t in s.arenas:
        t.view(torch.uint8).copy_(torch.randint(1, 255, t.view(torch.uint8).shape, dtype=torch.uint8))
    original = [t.clone() for t in s.arenas]
    s.offload(torch.tensor([[4, 0], [2, 2]]))
    for t in s.arenas:
        t.zero_()
    s.load(torch.tensor([[0, 1], [2, 5]]))
    for o, t in zip(original, s.arenas):
        assert torch.equal(t[:, 1].view(torch.uint8), o[:, 4].view(torch.uint8))
        assert torch.equal(t[:, 5].view(torch.uint8), o[:, 2].view(torch.uint8))
        assert not bool(t[:, 0].view(torch.uint8).any())


def test_offload_errors_change_nothing():
    s = make(host_num_blocks=2)
    s.kv.fill_(1)
    before = (s.kv.clone(), s.host_kv.clone())
    with pytest.raises(InvalidBlockError, match=r"^pairs: expected block ids in \[0, 2\), got 2 at dst row 1$"):
        s.offload(torch.tensor([[0, 0], [1, 2]]))
    with pytest.raises(InvalidBlockError, match=r"^pairs: expected block ids in \[0, 2\), got 5 at src row 0$"):
        s.load(torch.tensor([[5, 0]]))
    assert torch.equal(s.kv, before[0]) and torch.equal(s.host_kv, before[1])
    no_host = make()
    with pytest.raises(InvalidArgumentError, match=r"^host_num_blocks: expected > 0 for offload/load, got 0$"):
        no_host.offload(torch.tensor([[0, 0]]))


def test_fp8_falls_back_to_int8_without_fp8_support(caplog):
    cfg = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=8, memory_budget="1MiB", kv_dtype="fp8")
    seen = []

    def no_fp8(device):
        seen.append(device)
        return False

    with caplog.at_level(logging.WARNING, logger="pagedkv.store.kvstore"):
        with pytest.warns(RuntimeWarning, match=r"kv_dtype=fp8_e4m3 needs fp8 support .* falling back to int8"):
            s = KVStore(cfg, fp8_check=no_fp8)
    assert seen == [torch.device("cpu")]
    assert "falling back to int8" in caplog.text
    assert s.requested_config.kv_dtype == "fp8_e4m3" and s.config.kv_dtype == "int8"
    assert s.kv.dtype == torch.int8 and s.kv_zero is not None
    # int8 stores a zero point too, so the same budget holds fewer blocks
    assert s.config.resolved_num_blocks < cfg.resolved_num_blocks
    assert s.nbytes == s.config.total_bytes <= 1024**2
    # and it keeps working
    k = torch.randn(2, 2, 8).half()
    s.write(0, torch.tensor([0, 1]), k, k)
    gk, _ = s.gather_padded(0, torch.tensor([[0]], dtype=torch.int32), torch.tensor([2], dtype=torch.int32))
    assert (gk.float() - k.float()).abs().max().item() < 0.05


def test_fp8_kept_when_supported_and_int8_never_checked():
    calls = []
    s = KVStore(
        CacheConfig(num_layers=1, num_kv_heads=1, head_dim=4, num_blocks=2, kv_dtype="fp8"),
        fp8_check=lambda d: calls.append(d) or True,
    )
    assert s.kv.dtype == torch.float8_e4m3fn and len(calls) == 1
    KVStore(CacheConfig(num_layers=1, num_kv_heads=1, head_dim=4, num_blocks=2, kv_dtype="int8"),
            fp8_check=lambda d: calls.append(d) or False)
    assert len(calls) == 1


def test_fp8_supported_by_capability(monkeypatch):
    assert fp8_supported(torch.device("cpu"))
    for cap, ok in (((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, cap=cap: cap)
        assert fp8_supported(torch.device("cuda", 0)) is ok


def test_repr_names_the_geometry():
    text = repr(make(host_num_blocks=1))
    assert "layers=3" in text and "blocks=6" in text and "dtype=float16" in text and "host_blocks=1" in text
