"""gather_pages takes the NumPy arrays page_table_csr and seq_lens return (issue 27)."""
import numpy as np
import pytest
import torch

from pagedkv import CacheConfig, PagedKVCache
from pagedkv.errors import DTypeError, InvalidArgumentError


@pytest.fixture
def cache():
    kv = PagedKVCache(CacheConfig(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=32,
                                  dtype="float32"))
    for sid, n in (("a", 9), ("b", 5)):
        kv.add_sequence(sid, np.arange(n, dtype=np.int32) + 100 * len(sid + "x" * n))
        slots = kv.reserve(sid, n)
        for layer in range(2):
            kv.write(layer, slots, torch.randn(n, 2, 8), torch.randn(n, 2, 8))
        kv.commit(sid, n)
    yield kv
    kv.free(["a", "b"])


def test_numpy_page_table_reads_what_tensors_read(cache):
    indptr, indices, _ = cache.page_table_csr(["a", "b"])
    lens = cache.seq_lens(["a", "b"])
    assert isinstance(indptr, np.ndarray) and lens.dtype == np.int64
    got = cache.gather_pages(1, indptr, indices, lens)
    want = cache.gather_pages(1, torch.from_numpy(indptr), torch.from_numpy(indices),
                              torch.from_numpy(lens.astype(np.int32)))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    ka, va = cache.gather("a", layer=1)
    assert torch.equal(got[0][:9], ka) and torch.equal(got[1][:9], va)


def test_numpy_values_outside_int32_are_refused(cache):
    indptr, indices, _ = cache.page_table_csr(["a"])
    with pytest.raises(InvalidArgumentError, match=r"seq_lens: expected values within int32, got 9\.\.4294967296"):
        cache.gather_pages(0, indptr, indices, np.array([9, 2**32], dtype=np.int64))


def test_numpy_floats_are_still_refused(cache):
    indptr, indices, _ = cache.page_table_csr(["a"])
    with pytest.raises(DTypeError, match="indices"):
        cache.gather_pages(0, indptr, indices.astype(np.float32), cache.seq_lens(["a"]))
