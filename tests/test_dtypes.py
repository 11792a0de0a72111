"""The dtype table (pagedkv.dtypes) and every module that reads it agree."""
import pytest
import torch

from pagedkv import dtypes, quant
from pagedkv.config import KV_DTYPE_NAMES, MODEL_DTYPE_NAMES, CacheConfig, dtype_name, kv_dtype_name
from pagedkv.errors import DTypeError
from pagedkv.kernels import plans, sources
from pagedkv.ops import reference as ref

MODEL = [d.name for d in dtypes.MODEL]
QUANT = [d.name for d in dtypes.QUANTIZED]


def test_rows_match_torch():
    for d in dtypes.ALL:
        t = d.torch_dtype
        assert isinstance(t, torch.dtype)
        assert t.itemsize == d.itemsize, d.name
        if d.codes_per_byte > 1:  # packed codes: the top code of 8 / codes_per_byte bits
            limit = 2 ** (8 // d.codes_per_byte) - 1
        else:
            limit = torch.finfo(t).max if t.is_floating_point else torch.iinfo(t).max
        assert float(limit) == d.max_finite, d.name
        assert d.float8 == (t in (torch.float8_e4m3fn, torch.float8_e5m2))


def test_every_spelling_names_one_row():
    seen = {}
    for d in dtypes.ALL:
        for s in d.spellings:
            assert s == s.lower()
            assert seen.setdefault(s, d.name) == d.name, f"{s} names {seen[s]} and {d.name}"
            assert dtypes.lookup(s) is d and dtypes.lookup(s.upper()) is d
        assert dtypes.lookup(d.torch_dtype) is d
    assert dtypes.lookup("float64") is None and dtypes.lookup(torch.float64) is None and dtypes.lookup(3) is None


def test_config_reads_the_table():
    assert MODEL_DTYPE_NAMES == {d.name: d.itemsize for d in dtypes.MODEL}
    assert KV_DTYPE_NAMES == {d.name: d.itemsize / d.codes_per_byte for d in dtypes.QUANTIZED}
    assert KV_DTYPE_NAMES["int4"] == 0.5
    for d in dtypes.MODEL:
        for s in d.spellings + (d.torch_dtype,):
            assert dtype_name(s) == d.name
        with pytest.raises(DTypeError, match="float32/fp32, float16/fp16 or bfloat16/bf16"):
            dtype_name("int8")
    other_model = {"float16": "float32", "float32": "float16", "bfloat16": "float16"}
    for d in dtypes.QUANTIZED:
        for s in d.spellings + (d.torch_dtype,):
            assert kv_dtype_name(s, "float16") == d.name
        c = CacheConfig(num_layers=1, num_kv_heads=1, head_dim=8, num_blocks=2, kv_dtype=d.name)
        assert c.torch_cache_dtype == d.torch_dtype and c.cache_dtype == d.name
    for m in dtypes.MODEL:
        assert kv_dtype_name(m.name, m.name) is None
        with pytest.raises(DTypeError, match="fp8_e4m3/fp8, fp8_e5m2, int8"):
            kv_dtype_name(other_model[m.name], m.name)
        c = CacheConfig(num_layers=1, num_kv_heads=1, head_dim=8, num_blocks=2, dtype=m.name)
        assert c.torch_dtype == m.torch_dtype == c.torch_cache_dtype


def test_quant_reads_the_table():
    assert quant.MODEL_DTYPES == tuple(d.torch_dtype for d in dtypes.MODEL)
    assert quant.QUANT_STORAGE_DTYPES == {d.name: d.torch_dtype for d in dtypes.QUANTIZED}
    for d in dtypes.QUANTIZED:
        for s in d.spellings + (d.torch_dtype,):
            assert quant.storage_dtype(s) == d.torch_dtype
        assert quant.is_quantized(d.torch_dtype)
        if d.float8:
            assert quant.fp8_max(d.torch_dtype) == d.max_finite
    for d in dtypes.MODEL:
        assert not quant.is_quantized(d.torch_dtype)
        with pytest.raises(DTypeError, match="one of fp8_e4m3, fp8_e5m2, int8"):
            quant.storage_dtype(d.name)


def test_kernels_read_the_table():
    assert sources.MODEL_TYPES == tuple(d.kernel_name for d in dtypes.MODEL)
    kernel_rows = list(dtypes.QUANTIZED)  # every storage format has its kernels
    assert sources.QUANT_TYPES == tuple(d.kernel_name for d in kernel_rows)
    names = set(sources.entry_points()["write_kv.cu"])
    for q in kernel_rows:
        assert plans._QUANT_NAMES[q.torch_dtype] == q.kernel_name
        for m in dtypes.MODEL:
            assert plans._MODEL_NAMES[m.torch_dtype] == m.kernel_name
            assert sources.write_kv_name("nhd", in_type=m.kernel_name, quant=q.kernel_name) in names


def test_ops_checks_name_every_table_dtype():
    layer = torch.zeros(2, 2, 4, 1, 8, dtype=torch.float64)
    every = ", ".join(d.torch_name for d in dtypes.ALL[:-1]) + " or " + dtypes.ALL[-1].torch_name
    with pytest.raises(DTypeError, match=f"dtype {every}"):
        ref.check_layer(layer, "NHD")
    for d in dtypes.ALL:
        params = (2, 2, 4, 1) + ((2,) if d.grouped else ())  # int4: 2 groups of 4 along head_dim 8
        geo = ref.check_layer(torch.zeros(2, 2, 4, 1, 8 // d.codes_per_byte, dtype=d.torch_dtype), "NHD",
                              *((torch.zeros(params),) * (1 + d.zero_point) if d.quantized else ()))
        assert geo.quantized == d.quantized and geo.head_dim == 8
