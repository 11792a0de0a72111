"""A few-second smoke test of an installed pagedkv (run by .ci/package_check.sh from
outside the source tree): import, allocate, write, gather, prefix hit, free."""
import os

import numpy as np
import torch

import pagedkv
from pagedkv import CacheConfig, PagedKVCache
from pagedkv.ops import cpu as cpu_ops

here = os.path.dirname(os.path.abspath(pagedkv.__file__))
assert "site-packages" in here, f"pagedkv imported from {here}, not an install"
assert cpu_ops.AVAILABLE, "the compiled CPU loops are missing"

cfg = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, num_blocks=64, dtype="float32",
                  kv_dtype="int8")
with PagedKVCache(cfg) as cache:
    prompt = np.arange(40, dtype=np.int32)
    assert cache.add_sequence("a", prompt) == 0
    slots = cache.reserve("a", 40)
    k, v = torch.randn(40, 2, 16), torch.randn(40, 2, 16)
    for layer in range(2):
        cache.write(layer, slots, k, v)
    cache.commit("a", 40)
    got_k, got_v = cache.gather("a", layer=1)
    assert got_k.shape == (40, 2, 16) and (got_k - k).abs().max() < 0.05 * k.abs().max()
    indptr, indices, _ = cache.page_table_csr(["a"])
    pk, _ = cache.gather_pages(1, indptr, indices, cache.seq_lens(["a"]))
    assert torch.equal(pk, got_k)
    assert cache.add_sequence("b", prompt) == 32          # two full blocks from the prefix cache
    cache.free(["a", "b"])
    assert cache.stats().allocated_blocks == 0
print(f"smoke OK: pagedkv {pagedkv.__version__} from {here}")
