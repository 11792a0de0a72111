"""The peer formats that benchmarks/kv_quality.py compares against, checked element for
element against loop references (a wrong baseline would flatter or shame pagedkv)."""
import numpy as np
import pytest
import torch

from pagedkv import CacheConfig
from pagedkv.testing.kv_peers import KIVI_GROUP, PEERS, FakeQuantCache


def minmax_loop(x: np.ndarray, bits: int) -> np.ndarray:
    """Asymmetric fake quantization of one 1-D group, fp16 scale and zero point."""
    levels = 2 ** bits - 1
    mn = np.float32(np.float16(x.min()))
    s = np.float32(np.float16(np.float32(x.max() - mn) / np.float32(levels)))
    s = np.float32(1.0) if s == 0 else s
    return np.array([np.float32(min(levels, max(0, np.rint(np.float32(e - mn) / s))) * s) + mn for e in x],
                    dtype=np.float32)


@pytest.mark.parametrize("bits", [2, 4])
def test_kivi_keys_per_channel_values_per_token_against_a_loop(bits):
    g = torch.Generator().manual_seed(bits)
    k, v = torch.randn(2 * KIVI_GROUP + 5, 2, 64, generator=g), torch.randn(2 * KIVI_GROUP + 5, 2, 64, generator=g)
    kq, vq = PEERS[f"kivi{bits}"][0]()(0, k, v)
    kn, vn = k.numpy(), v.numpy()
    want_k, want_v = kn.copy(), vn.copy()
    for t0 in range(0, 2 * KIVI_GROUP, KIVI_GROUP):  # the 5-token tail stays exact (residual)
        for h in range(2):
            for c in range(64):
                want_k[t0:t0 + KIVI_GROUP, h, c] = minmax_loop(kn[t0:t0 + KIVI_GROUP, h, c], bits)
    for t in range(k.shape[0]):
        for h in range(2):
            for j in range(0, 64, KIVI_GROUP):
                want_v[t, h, j:j + KIVI_GROUP] = minmax_loop(vn[t, h, j:j + KIVI_GROUP], bits)
    np.testing.assert_allclose(kq.numpy(), want_k, rtol=0, atol=1e-6)
    np.testing.assert_allclose(vq.numpy(), want_v, rtol=0, atol=1e-6)
    assert not np.array_equal(kq.numpy(), kn)
    one_k, one_v = PEERS[f"kivi{bits}"][0]()(0, k[:1], v[:1])  # decode: the residual is exact
    assert torch.equal(one_k, k[:1]) and torch.equal(one_v, v[:1])


def test_vllm_fp8_scales():
    x = torch.tensor([[[0.3, -500.0, 1e-3, 2.0]]])
    k1, _ = PEERS["vllm_fp8_scale1"][0]()(0, x, x)
    assert torch.equal(k1, x.clamp(-448, 448).to(torch.float8_e4m3fn).float())  # saturates at 448
    fn = PEERS["vllm_fp8_dynamic"][0]()
    k2, _ = fn(3, x, x)
    s = 500.0 / 448.0
    assert torch.allclose(k2, (x / s).to(torch.float8_e4m3fn).float() * s, rtol=0, atol=0)
    k3, _ = fn(3, 4 * x, 4 * x)  # the layer's scale is fixed by its first write
    assert float(k3.abs().max()) == pytest.approx(448 * s)


def test_fake_quant_cache_stores_what_the_hook_returns():
    cfg = CacheConfig(num_layers=1, num_kv_heads=1, head_dim=4, block_size=4, num_blocks=2, dtype="float32")
    cache = FakeQuantCache(cfg, lambda layer, k, v: (k.round(), v * 0))
    cache.add_sequence("a")
    slots = cache.reserve("a", 2)
    k = torch.tensor([[[0.4, 1.6, -2.2, 3.0]], [[5.5, 0.0, 0.1, -0.6]]])
    cache.write(0, slots, k, k)
    cache.commit("a", 2)
    gk, gv = cache.gather("a", 0)
    assert torch.equal(gk, k.round()) and torch.equal(gv, torch.zeros_like(k))
    cache.free("a")
