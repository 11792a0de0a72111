"""The layer format is one object passed to the data ops (issue 23): the store builds it
once, the ops verify the tensors against it instead of reading the format off them, and
block keys are unsealed through an op (no private helper of ops.reference outside it).
The scalar quantization helpers are one C header shared by the CPU and CUDA sources."""
import re
from pathlib import Path

import pytest
import torch

from pagedkv import CacheConfig, ops
from pagedkv.errors import DTypeError, InvalidArgumentError, InvalidBlockError, ShapeError
from pagedkv.format.layer_format import LayerFormat
from pagedkv.format.quant import dequantize, dequantize_key_channels, quantize
from pagedkv.format.rotation import rotate, rotation_signs
from pagedkv.kernels import sources
from pagedkv.store.kvstore import KVStore

ROOT = Path(__file__).resolve().parents[1]
NB, BS, H, D = 4, 4, 2, 16
BACKENDS = ["reference", "cpu"]


def layer(fmt: LayerFormat, seed=0):
    """Zeroed int4/int3/fp8/model-dtype layer views ``(kv, scale, zero)`` for ``fmt``."""
    kv = torch.zeros((NB, 2, BS, H, fmt.stored_dim(D)), dtype=fmt.data_dtype)
    if not fmt.quantized:
        return kv, None, None
    pshape = fmt.param_shape((NB, 2, BS, H), D)
    scale = torch.zeros(pshape, dtype=fmt.param_dtype)
    return kv, scale, (torch.zeros_like(scale) if fmt.zero_point else None)


def kv_rows(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, H, D, generator=g), torch.randn(n, H, D, generator=g)


# -- the object -------------------------------------------------------------------------


def test_the_store_builds_each_layer_format_once_from_its_config():
    cfg = CacheConfig(num_layers=3, num_kv_heads=H, head_dim=D, block_size=BS, num_blocks=8, dtype="float16",
                      kv_dtype="int3", kv_group_size=8, kv_full_precision_layers=(1,), kv_sink_tokens=0)
    store = KVStore(cfg)
    assert store.format == LayerFormat("int3", 8, "token", True)
    assert store.format.param_layout == "group" and store.format.param_dtype == torch.bfloat16
    assert store.full_format == LayerFormat("float16")
    assert store.layer_format(0) is store.format and store.layer_format(1) is store.full_format
    scale, _ = store.layer_scales(0)
    assert tuple(scale.shape) == store.format.param_shape(tuple(store.layer(0).shape[:-1]), D)


def test_an_fp8_store_without_fp8_support_formats_its_layers_int8():
    cfg = CacheConfig(num_layers=1, num_kv_heads=H, head_dim=D, block_size=BS, num_blocks=8, kv_dtype="fp8_e4m3")
    with pytest.warns(RuntimeWarning, match="falling back to int8"):
        store = KVStore(cfg, fp8_check=lambda device: False)
    assert store.format == LayerFormat("int8") and store.format.param_layout == "row"


@pytest.mark.parametrize("kw, match", [
    (dict(kv_dtype="int5"), r"kv_dtype: expected one of 'float32'.*got 'int5'"),
    (dict(kv_dtype="int4"), r"group_size: expected a positive int for int4, got None"),
    (dict(kv_dtype="int3", group_size=12), r"group_size: expected a positive multiple of 8 for int3, got 12"),
    (dict(kv_dtype="int8", group_size=8), r"group_size: expected None for int8 \(not grouped\), got 8"),
    (dict(kv_dtype="int8", key_quant="block"), r"key_quant: expected 'token' for int8 \('block' is int4 and int2 only\)"),
    (dict(kv_dtype="int4", group_size=8, key_quant="row"), r"key_quant: expected 'token' or 'block', got 'row'"),
    (dict(kv_dtype="float16", rotation=True), r"rotation: expected False for unquantized float16, got True"),
])
def test_a_format_that_cannot_be_is_refused(kw, match):
    with pytest.raises(InvalidArgumentError, match=match):
        LayerFormat(**kw)


# -- the ops read the format from it and verify the tensors --------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_int3_and_int4_come_from_the_format_not_from_the_scale_dtype(backend):
    fmt = LayerFormat("int4", 8)
    kv, scale, zero = layer(fmt)
    k, v = kv_rows(2)
    slots = torch.tensor([0, 5])
    with pytest.raises(DTypeError, match=r"kv_scale: expected dtype float32, got torch.bfloat16"):
        ops.write_kv(kv, slots, k, v, kv_scale=scale.bfloat16(), kv_zero=zero.bfloat16(), layer_format=fmt,
                     backend=backend)
    with pytest.raises(DTypeError, match=r"kv_layer: expected dtype float16 \(layer_format float16\), got torch.uint8"):
        ops.write_kv(kv, slots, k, v, kv_scale=scale, kv_zero=zero, layer_format=LayerFormat("float16"),
                     backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_group_size_comes_from_the_format(backend):
    fmt = LayerFormat("int4", 8)              # 2 groups of the 16 elements
    kv, _, _ = layer(fmt)
    four = torch.zeros((NB, 2, BS, H, 4))     # a scale view of 4 groups: the tensors alone would accept it
    k, v = kv_rows(1)
    with pytest.raises(ShapeError, match=r"kv_scale: expected shape \(4, 2, 4, 2, 2\), got \(4, 2, 4, 2, 4\)"):
        ops.write_kv(kv, torch.tensor([0]), k, v, kv_scale=four, kv_zero=four.clone(), layer_format=fmt,
                     backend=backend)
    with pytest.raises(ShapeError, match=r"kv_layer: expected a head_dim that is a multiple of group_size 32"):
        ops.gather_kv(kv, torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
                      torch.tensor([1], dtype=torch.int32), out_dtype=torch.float32, kv_scale=four,
                      kv_zero=four.clone(), layer_format=LayerFormat("int4", 32), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name, group", [("int4", 8), ("int3", 8), ("int8", None), ("fp8_e4m3", None)])
def test_an_explicit_format_stores_and_reads_what_the_implied_one_does(backend, name, group):
    fmt = LayerFormat(name, group)
    k, v = kv_rows(6, seed=1)
    slots = torch.tensor([0, 1, 2, 5, 9, 14])
    a, b = layer(fmt), layer(fmt)
    ops.write_kv(a[0], slots, k, v, kv_scale=a[1], kv_zero=a[2], backend=backend)
    ops.write_kv(b[0], slots, k, v, kv_scale=b[1], kv_zero=b[2], layer_format=fmt, backend=backend)
    for x, y in zip(a, b):
        assert (x is None and y is None) or torch.equal(x.view(torch.uint8), y.view(torch.uint8))
    table = (torch.tensor([0, 4], dtype=torch.int32), torch.tensor([0, 1, 2, 3], dtype=torch.int32),
             torch.tensor([15], dtype=torch.int32))
    got = ops.gather_kv(b[0], *table, out_dtype=torch.float32, kv_scale=b[1], kv_zero=b[2], layer_format=fmt,
                        backend=backend)
    want = ops.gather_kv(a[0], *table, out_dtype=torch.float32, kv_scale=a[1], kv_zero=a[2], backend=backend)
    assert all(torch.equal(x, y) for x, y in zip(got, want))


@pytest.mark.parametrize("backend", BACKENDS)
def test_rotation_signs_must_agree_with_the_format(backend):
    plain, rotated = LayerFormat("int4", 8), LayerFormat("int4", 8, rotation=True)
    kv, scale, zero = layer(plain)
    k, v = kv_rows(1)
    signs = rotation_signs(D, 0)
    with pytest.raises(InvalidArgumentError, match=r"rotation_signs: expected None for layer_format int4, "
                                                   r"group_size=8 \(not rotated\), got a tensor"):
        ops.write_kv(kv, torch.tensor([0]), k, v, kv_scale=scale, kv_zero=zero, rotation_signs=signs,
                     layer_format=plain, backend=backend)
    with pytest.raises(InvalidArgumentError, match=r"rotation_signs: expected the float32 \[16\] signs for a write "
                                                   r"to layer_format int4, group_size=8, rotated, got None"):
        ops.write_kv(kv, torch.tensor([0]), k, v, kv_scale=scale, kv_zero=zero, layer_format=rotated,
                     backend=backend)
    assert not kv.any() and not scale.any()      # refused before any write
    # a gather without the signs reads the rotated domain, as stored
    ops.write_kv(kv, torch.tensor([0]), k, v, kv_scale=scale, kv_zero=zero, rotation_signs=signs,
                 layer_format=rotated, backend=backend)
    got, _ = ops.gather_kv(kv, torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
                           torch.tensor([1], dtype=torch.int32), out_dtype=torch.float32, kv_scale=scale,
                           kv_zero=zero, layer_format=rotated, backend=backend)
    q, s, z = quantize(rotate(k, signs), "int4", group_size=8)
    assert torch.equal(got, dequantize(q, s, z, torch.float32))


@pytest.mark.parametrize("backend", BACKENDS)
def test_block_key_parameters_must_agree_with_the_format(backend):
    token, block = LayerFormat("int4", 8), LayerFormat("int4", 8, "block")
    kv, scale, zero = layer(token)
    ks = torch.zeros((NB, H, D), dtype=torch.bfloat16)
    table = (torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
             torch.tensor([1], dtype=torch.int32))
    with pytest.raises(InvalidArgumentError, match=r"key_scale: expected the block-key parameters for "
                                                   r"layer_format int4, group_size=8, key_quant=block, got None"):
        ops.gather_kv(kv, *table, out_dtype=torch.float32, kv_scale=scale, kv_zero=zero, layer_format=block,
                      backend=backend)
    with pytest.raises(InvalidArgumentError, match=r"key_scale: expected None for layer_format int4, group_size=8 "
                                                   r"\(keys per token\), got a tensor"):
        ops.gather_kv(kv, *table, out_dtype=torch.float32, kv_scale=scale, kv_zero=zero, key_scale=ks,
                      key_zero=ks.clone(), layer_format=token, backend=backend)
    with pytest.raises(InvalidArgumentError, match=r"layer_format: expected an int4 or int2 format with key_quant='block', "
                                                   r"got int4, group_size=8"):
        ops.seal_key_blocks(kv, torch.tensor([0]), torch.zeros((1, BS, H, D)), ks, ks.clone(), layer_format=token,
                            backend=backend)


def test_a_format_that_is_not_a_layer_format_is_refused():
    kv, scale, zero = layer(LayerFormat("int8"))
    k, v = kv_rows(1)
    with pytest.raises(InvalidArgumentError, match=r"layer_format: expected None or a "
                                                   r"pagedkv.format.layer_format.LayerFormat, got str"):
        ops.write_kv(kv, torch.tensor([0]), k, v, kv_scale=scale, kv_zero=zero, layer_format="int8",
                     backend="reference")


# -- unsealing block keys is an op -------------------------------------------------------


def sealed_block(fmt, seed=3):
    """An int4 layer whose block 1 is sealed from ``keys`` (its V and other blocks untouched)."""
    kv, scale, zero = layer(fmt)
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, BS, H, D, generator=g)
    ks = torch.zeros((NB, H, D), dtype=torch.bfloat16)
    kz = torch.zeros_like(ks)
    ops.seal_key_blocks(kv, torch.tensor([1]), keys, ks, kz, layer_format=fmt, backend="reference")
    return kv, scale, zero, ks, kz, keys


@pytest.mark.parametrize("with_exact", [False, True])
def test_unseal_puts_the_live_rows_back_per_token_and_clears_the_seal(with_exact):
    fmt = LayerFormat("int4", 8, "block")
    kv, scale, zero, ks, kz, keys = sealed_block(fmt)
    channels = dequantize_key_channels(kv[1, 0, :3], ks[1], kz[1], torch.float32)
    before = kv.clone()
    exact = valid = None
    want = channels.clone()
    if with_exact:      # rows 0 and 2 held in model precision
        exact = keys.clone()
        valid = torch.tensor([[True, False, True, False]])
        want[0], want[2] = keys[0, 0], keys[0, 2]
    ops.unseal_key_blocks(kv, torch.tensor([1]), torch.tensor([3]), scale, zero, ks, kz, exact=exact,
                          exact_valid=valid, layer_format=fmt)
    q, s, z = quantize(want, "int4", group_size=8)
    assert torch.equal(kv[1, 0, :3], q) and torch.equal(scale[1, 0, :3], s) and torch.equal(zero[1, 0, :3], z)
    assert torch.equal(kv[1, 0, 3], before[1, 0, 3]) and torch.equal(kv[1, 1], before[1, 1])
    assert not ks[1].any() and not kz[1].any()


def test_unseal_with_no_live_row_only_clears_the_seal():
    fmt = LayerFormat("int4", 8, "block")
    kv, scale, zero, ks, kz, _ = sealed_block(fmt)
    before = kv.clone()
    ops.unseal_key_blocks(kv, torch.tensor([1]), torch.tensor([0]), scale, zero, ks, kz, layer_format=fmt)
    assert torch.equal(kv, before) and not scale.any() and not ks.any() and not kz.any()


def test_unseal_refuses_bad_input_before_any_change():
    fmt = LayerFormat("int4", 8, "block")
    kv, scale, zero, ks, kz, _ = sealed_block(fmt)
    saved = [t.clone() for t in (kv, scale, zero, ks, kz)]
    with pytest.raises(InvalidArgumentError, match=r"live: expected row counts in \[0, 4\] \(block_size\), "
                                                   r"got 5 at row 0"):
        ops.unseal_key_blocks(kv, torch.tensor([1]), torch.tensor([5]), scale, zero, ks, kz, layer_format=fmt)
    with pytest.raises(InvalidBlockError, match=r"blocks: expected block ids in \[0, 4\), got 4 at row 1"):
        ops.unseal_key_blocks(kv, torch.tensor([1, 4]), torch.tensor([1, 1]), scale, zero, ks, kz,
                              layer_format=fmt)
    with pytest.raises(InvalidArgumentError, match=r"layer_format: expected an int4 or int2 format with "
                                                   r"key_quant='block', got int4, group_size=8"):
        ops.unseal_key_blocks(kv, torch.tensor([1]), torch.tensor([1]), scale, zero, ks, kz,
                              layer_format=LayerFormat("int4", 8))
    assert all(torch.equal(a, b) for a, b in zip((kv, scale, zero, ks, kz), saved))


def test_the_store_modules_use_no_private_helper_of_the_reference_ops():
    for mod in ("block_keys.py", "window.py", "kvstore.py"):
        text = (ROOT / "pagedkv" / "store" / mod).read_text()
        assert not re.search(r"ops\.reference import|ops import reference|reference\._", text), mod


# -- one C header of scalar helpers ------------------------------------------------------

SHARED = ("pkv_f32_to_f16", "pkv_f16_to_f32", "pkv_f32_to_bf16", "pkv_bf16_to_f32", "pkv_f32_to_e4m3",
          "pkv_f32_to_e5m2", "pkv_e4m3_to_f32", "pkv_e5m2_to_f32", "pkv_f32_to_bf16_directed", "pkv_fix_scale",
          "pkv_int_code", "pkv_rint_small", "pkv_int4_pack", "pkv_int3_load")


def _defines(text: str, fn: str) -> bool:
    # a definition: a return type, the name, its parameters, a body
    return re.search(rf"\b(?:float|int|void|pkv_u\d+|pkv_i\d+|u?int\d+_t)\s+{fn}\s*\([^;{{]*\)\s*\{{", text) is not None


def test_the_scalar_helpers_are_defined_once_for_the_cpu_and_the_cuda_sources():
    header = (ROOT / "cuda" / "quant_scalar.h").read_text()
    assert all(_defines(header, fn) for fn in SHARED)
    for path in [ROOT / "cuda" / "common.cuh", *sorted((ROOT / "cuda").glob("*.cu")),
                 *sorted((ROOT / "pagedkv" / "ops").glob("*.h"))]:
        text = path.read_text()
        again = [fn for fn in SHARED if _defines(text, fn)]
        assert not again, f"{path.name} defines {again} again"
    assert '#include "quant_scalar.h"' in (ROOT / "pagedkv" / "ops" / "quant_rows.h").read_text()


def test_nvrtc_finds_the_shared_header_in_the_package_data():
    for name in ("write_kv.cu", "gather_kv.cu", "seal_keys.cu"):
        src = sources.load(name)
        assert src.headers["quant_scalar.h"] == (ROOT / "cuda" / "quant_scalar.h").read_bytes()
