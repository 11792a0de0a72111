"""The dtype table (pagedkv.format.dtypes) and every module that reads it agree."""
import pytest
import torch

from pagedkv.config.options import KV_DTYPE_NAMES, MODEL_DTYPE_NAMES, CacheConfig, dtype_name, kv_dtype_name
from pagedkv.errors import DTypeError
from pagedkv.format import dtypes, quant
from pagedkv.kernels import plans, sources
from pagedkv.ops import reference as ref

MODEL = [d.name for d in dtypes.MODEL]
QUANT = [d.name for d in dtypes.QUANTIZED]


def test_rows_match_torch():
    for d in dtypes.ALL:
        t = d.torch_dtype
        assert isinstance(t, torch.dtype)
        assert t.itemsize == d.itemsize, d.name
        if d.code_bits:  # packed codes: the top code of code_bits bits
            limit = 2**d.code_bits - 1
            assert d.stored_dim(d.pack) * 8 == d.pack * d.code_bits and d.head_dim_of(d.stored_dim(64)) == 64
        else:
            limit = torch.finfo(t).max if t.is_floating_point else torch.iinfo(t).max
        assert float(limit) == d.max_finite, d.name
        assert d.float8 == (t in (torch.float8_e4m3fn, torch.float8_e5m2))


def test_every_spelling_names_one_row():
    seen = {}
    for d in dtypes.ALL:
        for s in d.spellings:
            assert s == s.lower()
            if s == d.torch_name and d.name in ("int3", "int2"):
                continue  # its storage dtype's name, uint8, spells int4 (above)
            assert seen.setdefault(s, d.name) == d.name, f"{s} names {seen[s]} and {d.name}"
            assert dtypes.lookup(s) is d and dtypes.lookup(s.upper()) is d
        # a torch dtype names its first row: uint8 stays int4; int3 is told by its bfloat16
        # params, int2 by its float16 ones
        assert dtypes.lookup(d.torch_dtype) is (dtypes.info("int4") if d.name in ("int3", "int2") else d)
        assert dtypes.layer_row(d.torch_dtype, d.param_dtype) is d
    assert dtypes.lookup("uint8") is dtypes.info("int4")
    assert dtypes.layer_row(torch.uint8, torch.float32) is dtypes.info("int4")
    assert dtypes.layer_row(torch.uint8, None) is dtypes.info("int4")
    assert dtypes.layer_row(torch.uint8, torch.float16) is dtypes.info("int2")
    assert dtypes.layer_row(torch.int8, torch.bfloat16) is dtypes.info("int8")  # only packed formats share a dtype
    assert dtypes.lookup("float64") is None and dtypes.lookup(torch.float64) is None and dtypes.lookup(3) is None


def test_config_reads_the_table():
    assert MODEL_DTYPE_NAMES == {d.name: d.itemsize for d in dtypes.MODEL}
    assert KV_DTYPE_NAMES == {d.name: d.code_bits / 8 if d.code_bits else d.itemsize for d in dtypes.QUANTIZED}
    assert KV_DTYPE_NAMES["int4"] == 0.5 and KV_DTYPE_NAMES["int3"] == 0.375
    for d in dtypes.MODEL:
        for s in d.spellings + (d.torch_dtype,):
            assert dtype_name(s) == d.name
        with pytest.raises(DTypeError, match="float32/fp32, float16/fp16 or bfloat16/bf16"):
            dtype_name("int8")
    other_model = {"float16": "float32", "float32": "float16", "bfloat16": "float16"}
    for d in dtypes.QUANTIZED:
        for s in d.spellings + (d.torch_dtype,):
            assert kv_dtype_name(s, "float16") == (d.name if s not in ("uint8", torch.uint8) else "int4")
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
            assert quant.storage_dtype(s) == d.torch_dtype  # int3's torch name uint8 is int4's storage too
        assert quant.is_quantized(d.torch_dtype)
        if d.float8:
            assert quant.fp8_max(d.torch_dtype) == d.max_finite
    for d in dtypes.MODEL:
        assert not quant.is_quantized(d.torch_dtype)
        with pytest.raises(DTypeError, match="one of fp8_e4m3, fp8_e5m2, int8"):
            quant.storage_dtype(d.name)


def test_kernels_read_the_table():
    assert sources.MODEL_TYPES == tuple(d.kernel_name for d in dtypes.MODEL)
    kernel_rows = [d for d in dtypes.QUANTIZED if d.compiled]  # every compiled format has its kernels
    assert [d.name for d in dtypes.QUANTIZED if not d.compiled] == ["int2"]   # the torch definition only
    assert sources.QUANT_TYPES == tuple(d.kernel_name for d in kernel_rows)
    names = set(sources.entry_points()["write_kv.cu"])
    for q in kernel_rows:
        assert plans._QUANT_NAMES[q.name] == q.kernel_name
        for m in dtypes.MODEL:
            assert plans._MODEL_NAMES[m.torch_dtype] == m.kernel_name
            assert sources.write_kv_name("nhd", in_type=m.kernel_name, quant=q.kernel_name) in names


def test_ops_checks_name_every_table_dtype():
    layer = torch.zeros(2, 2, 4, 1, 8, dtype=torch.float64)
    names = list(dict.fromkeys(d.torch_name for d in dtypes.ALL))  # uint8 once: int4 and int3
    every = ", ".join(names[:-1]) + " or " + names[-1]
    with pytest.raises(DTypeError, match=f"dtype {every}, got torch.float64$"):
        ref.check_layer(layer, "NHD")
    for d in dtypes.ALL:
        groups = 1 if d.name == "int3" else 2  # int4: 2 groups of 4 along head_dim 8; int3: one of 8
        params = (2, 2, 4, 1) + ((groups,) if d.grouped else ())
        p = torch.zeros(params, dtype=d.param_dtype)
        geo = ref.check_layer(torch.zeros(2, 2, 4, 1, d.stored_dim(8), dtype=d.torch_dtype), "NHD",
                              *((p,) * (1 + d.zero_point) if d.quantized else ()))
        assert geo.quantized == d.quantized and geo.head_dim == 8
        assert geo.kv_dtype == (d.name if d.quantized else None)
