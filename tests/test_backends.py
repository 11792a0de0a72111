"""Every data-op backend matches the torch reference bit for bit: one suite over the
``backend`` fixture (the fast CPU ops, the CUDA kernels run on the host by the
emulation, and the CUDA kernels on a GPU, which skip with the reason where there is
none). Outputs are compared as raw bytes; NaN outputs, whose payload bits are not
part of the contract, are compared as "both NaN".

Kernel-only behaviour (values of device-side indices are not read on the host, so
the kernels' own guards must hold) runs over ``kernel_backend``. What only one
backend has lives beside it: test_ops_cpu.py, test_kernels_emulated.py,
test_kernels_cuda.py.
"""
from __future__ import annotations

import re
import types

import pytest
import torch
from backend_cases import (
    BS,
    KV_DTYPES,
    LAYOUTS,
    MODEL,
    NB,
    QUANT,
    H,
    Layer,
    arenas,
    assert_same,
    assert_same_views,
    clones,
    csr,
    layer_shape,
    make_backend,
    name,
    offset_view,
    padded,
    params,
    quant_dim,
    quant_name,
    quant_views,
    quantized_layer,
    rand_kv,
    random_layer,
    raw,
    same,
    same_state,
    slot_mapping,
    special_rows,
    storage,
    tables,
    tokens,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.errors import DTypeError, InvalidArgumentError, InvalidBlockError, KernelUnavailableError, ShapeError
from pagedkv.format import dtypes
from pagedkv.format.rotation import rotation_signs
from pagedkv.kernels import plans, sources
from pagedkv.ops import backends
from pagedkv.ops import reference as ref

CUDA = pytest.param("cuda", marks=pytest.mark.cuda)


@pytest.fixture(scope="module", params=["cpu", "emulated", CUDA])
def backend(request):
    return make_backend(request.param)


@pytest.fixture(scope="module", params=["emulated", CUDA])
def kernel_backend(request):
    return make_backend(request.param)


# ----------------------------------------------------------------------------------
# the protocol and the dispatcher


@pytest.mark.parametrize("backend_name", list(backends.MODULES))
def test_every_registered_backend_implements_the_protocol(backend_name):
    module = backends.load(backend_name)
    assert isinstance(module, backends.DataOpsBackend)
    for op in backends.OP_NAMES:
        assert callable(getattr(module, op))
    assert backends.implementation("write_kv", "reference", torch.device("cuda")) is ref.write_kv


def test_dispatcher_refuses_unknown_and_incomplete_backends(monkeypatch):
    with pytest.raises(InvalidArgumentError, match=r"^backend: expected one of 'reference', 'cpu', 'cuda', 'emulated', got 'gpu'$"):
        backends.load("gpu")
    partial = types.ModuleType("pagedkv_test_partial_backend")
    partial.write_kv = ref.write_kv
    monkeypatch.setitem(__import__("sys").modules, partial.__name__, partial)
    monkeypatch.setitem(backends.MODULES, "partial", partial.__name__)
    monkeypatch.setitem(backends._LABELS, "partial", "a partial backend")
    with pytest.raises(KernelUnavailableError, match=r"provides no seal_key_blocks, gather_kv, gather_kv_padded, copy_blocks, swap_blocks, convert_layout$"):
        backends.load("partial")


def test_kernels_do_not_import_the_ops_package():
    import subprocess
    import sys

    code = ("import sys, pagedkv.kernels.plans, pagedkv.kernels.emulation; "
            "print(sorted(m for m in sys.modules if m == 'pagedkv.ops' or m.startswith('pagedkv.ops.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.strip() == "[]"


# ----------------------------------------------------------------------------------
# write_kv


@pytest.mark.parametrize("kind", ["contiguous", "qkv", "misaligned"])
@pytest.mark.parametrize("d", [3, 17, 80, 128])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", MODEL, ids=name)
def test_write_kv_copies_like_the_reference(backend, dtype, layout, d, kind):
    gen = torch.Generator().manual_seed(d * 7 + len(kind))
    layer = random_layer(layout, dtype, d, gen=gen, offset=1 if kind == "misaligned" else 0)
    key, value = tokens(23, d, dtype, kind, gen, backend.device)
    slots = slot_mapping(23, gen)
    want = layer.clone()
    ref.write_kv(want, slots, key.cpu(), value.cpu(), layout=layout)

    if backend.kernels:
        vector = kind != "misaligned" and (d * key.element_size()) % 16 == 0
        host_key, host_value = (key, value) if key.is_cpu else tokens(23, d, dtype, kind, gen)
        launch = plans.plan_write_kv(layer, slots, host_key, host_value, layout=layout)[0]
        assert launch.kernel.endswith("_v16" if vector else f"_e{key.element_size()}")
    for dims in backend.dims:
        got = backend.copy(layer)
        backend.ops.write_kv(got, slots.to(backend.device), key, value, layout=layout, **dims)
        assert_same(got, want)


@pytest.mark.parametrize("d", [3, 17, 80, 128])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("qdtype", QUANT, ids=quant_name)
@pytest.mark.parametrize("dtype", MODEL, ids=name)
def test_write_kv_quantizes_like_the_reference(backend, dtype, qdtype, layout, d):
    backend.require_quant(qdtype)
    d = quant_dim(qdtype, d)
    gen = torch.Generator().manual_seed(d + 100 * QUANT.index(qdtype))
    shape, sshape, zero_point = quant_views(layout, qdtype, d)
    layer = torch.zeros(shape, dtype=storage(qdtype))
    scale = torch.full(sshape, -7.0, dtype=params(qdtype))
    zero = torch.full(sshape, -9.0, dtype=params(qdtype)) if zero_point else None
    key = special_rows(torch.randn(23, H, d, generator=gen) * 3).to(dtype)
    value = (torch.randn(23, H, d, generator=gen) * 1e3).to(dtype)
    slots = torch.randperm(NB * BS, generator=gen)[:23]
    slots[6::4] = -1  # padding, but never one of the special rows 0..4
    want = clones(layer, scale, zero)
    ref.write_kv(want[0], slots, key, value, layout=layout, kv_scale=want[1], kv_zero=want[2])
    dev = backend.device
    for dims in backend.dims:
        got = [backend.copy(t) for t in (layer, scale, zero)]
        backend.ops.write_kv(got[0], slots.to(dev), key.to(dev), value.to(dev), layout=layout, kv_scale=got[1],
                             kv_zero=got[2], **dims)
        assert_same_views(got, want)


def test_write_kv_skips_slots_past_the_end_instead_of_writing_them(kernel_backend):
    # The reference raises; on a GPU the slots are not read on the host, so the
    # kernel's own guard must keep the write inside the layer.
    gen = torch.Generator().manual_seed(5)
    layer = random_layer("NHD", torch.float32, 16, gen=gen)
    key, value = tokens(6, 16, torch.float32, "contiguous", gen)
    slots = torch.tensor([0, NB * BS, 7, NB * BS + 100, 2**40, 9])
    with pytest.raises(InvalidArgumentError, match=r"slot_mapping: expected slots < 35"):
        ref.write_kv(layer.clone(), slots, key, value)
    want = layer.clone()
    ref.write_kv(want, torch.where(slots >= NB * BS, -1, slots), key, value)
    dev = kernel_backend.device
    got = kernel_backend.copy(layer)
    kernel_backend.ops.write_kv(got, slots.to(dev), key.to(dev), value.to(dev))
    assert_same(got, want)


# ----------------------------------------------------------------------------------
# gather_kv / gather_kv_padded


def _gather(backend, table, layer, table_args, dims, **kw):
    fn = backend.ops.gather_kv if table == "csr" else backend.ops.gather_kv_padded
    dev = {k: backend.copy(v) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    got = fn(backend.copy(layer), *[a.to(backend.device) for a in table_args], **dev, **dims)
    return got, dev


@pytest.mark.parametrize("out", ["fresh", "given", "misaligned"])
@pytest.mark.parametrize("table", ["csr", "padded"])
@pytest.mark.parametrize("d", [3, 17, 64, 80])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", MODEL, ids=name)
def test_gather_copies_like_the_reference(backend, dtype, layout, d, table, out):
    gen = torch.Generator().manual_seed(d * 3 + len(out))
    layer = random_layer(layout, dtype, d, gen=gen)
    indptr, indices, block_table, lens = tables(gen)
    kw = {"layout": layout}
    total = int(lens.sum())
    if out != "fresh":
        offset = 1 if out == "misaligned" else 0
        kw["out_key"] = offset_view(torch.zeros(total, H, d, dtype=dtype), offset)
        kw["out_value"] = offset_view(torch.zeros(total, H, d, dtype=dtype), offset)
    args = (indptr, indices, lens) if table == "csr" else (block_table, lens)
    if backend.kernels:
        if table == "csr":
            launch = plans.plan_gather(layer, lens, indptr=indptr, indices=indices, **kw)[0][0]
        else:
            launch = plans.plan_gather(layer, lens, block_table=block_table, **kw)[0][0]
        vector = out != "misaligned" and (d * layer.element_size()) % 16 == 0
        assert launch.kernel.endswith("_v16" if vector else f"_e{layer.element_size()}")
    fn_ref = ref.gather_kv if table == "csr" else ref.gather_kv_padded
    kw_ref = dict(kw, **{k: kw[k].clone() for k in ("out_key", "out_value") if k in kw})
    want = fn_ref(layer, *args, **kw_ref)  # the zeroed outputs in kw stay for the backend's runs
    for dims in backend.dims:
        got, dev = _gather(backend, table, layer, args, dims, **kw)
        if out != "fresh":
            assert got[0] is dev["out_key"] and got[1] is dev["out_value"]
        for g, w in zip(got, want):
            assert_same(g, w)


@pytest.mark.parametrize("out", ["fresh", "given"])
@pytest.mark.parametrize("table", ["csr", "padded"])
@pytest.mark.parametrize("d", [3, 80])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("out_dtype", MODEL, ids=name)
@pytest.mark.parametrize("qdtype", QUANT, ids=quant_name)
def test_gather_dequantizes_like_the_reference(backend, qdtype, out_dtype, layout, d, table, out):
    backend.require_quant(qdtype)
    d = quant_dim(qdtype, d)
    gen = torch.Generator().manual_seed(d + 11 * MODEL.index(out_dtype))
    layer, scale, zero = quantized_layer(layout, qdtype, d, gen=gen)
    indptr, indices, block_table, lens = tables(gen)
    args = (indptr, indices, lens) if table == "csr" else (block_table, lens)
    kw = dict(layout=layout, out_dtype=out_dtype, kv_scale=scale, kv_zero=zero)
    fn_ref = ref.gather_kv if table == "csr" else ref.gather_kv_padded
    want = fn_ref(layer, *args, **kw)
    if out == "given":
        kw.update(out_key=torch.empty_like(want[0]), out_value=torch.empty_like(want[1]))
    for dims in backend.dims:
        got, dev = _gather(backend, table, layer, args, dims, **kw)
        if out == "given":
            assert got[0] is dev["out_key"] and got[1] is dev["out_value"]
        for g, w in zip(got, want):
            assert_same(g, w)


def test_gather_reads_zeros_for_a_bad_block_id_instead_of_other_memory(kernel_backend):
    gen = torch.Generator().manual_seed(9)
    layer = random_layer("HND", torch.float16, 8, gen=gen)
    indptr, indices, _, lens = tables(gen)
    bad = indices.clone()
    bad[int(indptr[3])] = NB + 4  # the first block of the last sequence
    with pytest.raises(InvalidBlockError, match=r"indices: expected block ids in \[0, 7\)"):
        ref.gather_kv(layer, indptr, bad, lens, layout="HND")
    want_k, want_v = ref.gather_kv(layer, indptr, indices, lens, layout="HND")
    first = int(lens[:3].sum())
    want_k[first : first + BS] = 0
    want_v[first : first + BS] = 0
    got, _ = _gather(kernel_backend, "csr", layer, (indptr, bad, lens), {}, layout="HND")
    assert_same(got[0], want_k)
    assert_same(got[1], want_v)


# ----------------------------------------------------------------------------------
# rotated quantized storage: write_kv / gather with rotation_signs

# (kv_dtype, head_dim, int4 group): powers of two of even and odd exponent (one scale
# constant exact, one not), and head_dims that split into several Hadamard blocks (the
# CPU loops run whole 8- and 4-element chunks in registers, then the blocks of 4, 2, 1)
ROTATION_CASES = [(q, d, None) for q in ("fp8_e4m3", "fp8_e5m2", "int8") for d in (3, 64, 80, 128)]
ROTATION_CASES += [("fp8_e5m2", 7, None), ("int8", 14, None), ("fp8_e4m3", 2047, None)]
ROTATION_CASES += [("int4", d, g) for d, g in ((64, 16), (64, 32), (64, 64), (128, 16), (128, 32), (128, 64),
                                               (96, 16), (96, 32), (80, 16), (14, 7))]
ROTATION_CASES += [("int3", d, g) for d, g in ((64, 8), (64, 32), (64, 64), (128, 32), (128, 128), (96, 32),
                                               (96, 24), (80, 40), (24, 8))]


def _rotation_id(case) -> str:
    q, d, g = case
    return f"{q}-d{d}" + (f"-g{g}" if g else "")


def _rotated_views(layout, kv_dtype, d, group):
    row = dtypes.info(kv_dtype)
    shape = layer_shape(layout, NB, BS, H, row.stored_dim(d))
    sshape = shape[:-1] + ((d // group,) if row.grouped else ())
    layer = torch.zeros(shape, dtype=row.torch_dtype)
    p = row.param_dtype
    return layer, torch.full(sshape, -7.0, dtype=p), torch.full(sshape, -9.0, dtype=p) if row.zero_point else None


def _same_codes(got, want) -> None:
    """Arena views equal byte for byte, except that an fp8 NaN code only needs to be a
    NaN on both sides: a NaN made by the butterflies (inf - inf, NaN + x) carries no
    defined sign (a GPU returns its canonical NaN)."""
    got = [None if t is None else t.cpu() for t in got]
    if want[0].dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        assert_same(got[0].float(), want[0].float())
        got, want = got[1:], want[1:]
        assert_same_views([None] + got, [None] + want)
        return
    assert_same_views(got, want)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", MODEL, ids=name)
@pytest.mark.parametrize("case", ROTATION_CASES, ids=_rotation_id)
def test_rotated_write_then_gather_like_the_reference(backend, case, dtype, layout):
    kv_dtype, d, group = case
    backend.require_quant(kv_dtype)
    gen = torch.Generator().manual_seed(d + 7 * (group or 1))
    signs = rotation_signs(d, d)
    layer, scale, zero = _rotated_views(layout, kv_dtype, d, group or 1)
    key = special_rows(torch.randn(23, H, d, generator=gen) * 3).to(dtype)
    key[5:, :, 0] = 1e3  # an outlier channel: what the rotation is for
    value = (torch.randn(23, H, d, generator=gen) * 1e3).to(dtype)
    slots = torch.randperm(NB * BS, generator=gen)[:23]
    slots[6::4] = -1
    want = clones(layer, scale, zero)
    ref.write_kv(want[0], slots, key, value, layout=layout, kv_scale=want[1], kv_zero=want[2], rotation_signs=signs)
    unrotated = clones(layer, scale, zero)
    ref.write_kv(unrotated[0], slots, key, value, layout=layout, kv_scale=unrotated[1], kv_zero=unrotated[2])
    assert not torch.equal(raw(unrotated[1]), raw(want[1]))  # the rotation changed what is stored
    indptr, indices, _, lens = tables(gen)
    kw = dict(layout=layout, out_dtype=dtype, kv_scale=want[1], kv_zero=want[2], rotation_signs=signs)
    want_k, want_v = ref.gather_kv(want[0], indptr, indices, lens, **kw)
    dev = backend.device
    for dims in backend.dims:
        got = [backend.copy(t) for t in (layer, scale, zero)]
        backend.ops.write_kv(got[0], slots.to(dev), key.to(dev), value.to(dev), layout=layout, kv_scale=got[1],
                             kv_zero=got[2], rotation_signs=signs.to(dev), **dims)
        _same_codes(got, want)
        k, v = backend.ops.gather_kv(got[0], indptr.to(dev), indices.to(dev), lens.to(dev), layout=layout,
                                     out_dtype=dtype, kv_scale=got[1], kv_zero=got[2], rotation_signs=signs.to(dev),
                                     **dims)
        assert_same(k, want_k)
        assert_same(v, want_v)


@pytest.mark.parametrize("out", ["fresh", "given"])
@pytest.mark.parametrize("table", ["csr", "padded"])
@pytest.mark.parametrize("d", [64, 80, 128])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("out_dtype", MODEL, ids=name)
@pytest.mark.parametrize("qdtype", QUANT, ids=quant_name)
def test_rotated_gather_unrotates_like_the_reference(backend, qdtype, out_dtype, layout, d, table, out):
    backend.require_quant(qdtype)
    gen = torch.Generator().manual_seed(d + 13 * MODEL.index(out_dtype))
    layer, scale, zero = quantized_layer(layout, qdtype, d, gen=gen)
    indptr, indices, block_table, lens = tables(gen)
    args = (indptr, indices, lens) if table == "csr" else (block_table, lens)
    signs = rotation_signs(d, 5)
    kw = dict(layout=layout, out_dtype=out_dtype, kv_scale=scale, kv_zero=zero, rotation_signs=signs)
    fn_ref = ref.gather_kv if table == "csr" else ref.gather_kv_padded
    want = fn_ref(layer, *args, **kw)
    plain = fn_ref(layer, *args, **dict(kw, rotation_signs=None))
    assert not torch.equal(raw(want[0]), raw(plain[0]))
    if out == "given":
        kw.update(out_key=torch.empty_like(want[0]), out_value=torch.empty_like(want[1]))
    for dims in backend.dims:
        got, dev = _gather(backend, table, layer, args, dims, **kw)
        if out == "given":
            assert got[0] is dev["out_key"] and got[1] is dev["out_value"]
        for g, w in zip(got, want):
            assert_same(g, w)


@pytest.mark.parametrize("d", [16, 32, 64, 128])
@pytest.mark.parametrize("signs_kind", ["pm1", "last_not_pm1", "first_not_pm1"])
def test_rotated_gather_with_any_sign_values_matches_the_reference(backend, d, signs_kind):
    # The CPU gather holds power-of-two rows of 16..128 floats in registers and folds the
    # 1/sqrt(D) scale into the signs, which is exact only for +-1 signs: other values must
    # take the general path, and the check must not disturb the signs it then uses.
    signs = rotation_signs(d, 3)
    if signs_kind == "last_not_pm1":
        signs[-1] = 0.5
    elif signs_kind == "first_not_pm1":
        signs[0] = -3.0
    gen = torch.Generator().manual_seed(d)
    for qdtype in QUANT:
        backend.require_quant(qdtype)
        for out_dtype in MODEL:
            layer, scale, zero = quantized_layer("NHD", qdtype, d, gen=gen)
            indptr, indices, _, lens = tables(gen)
            kw = dict(out_dtype=out_dtype, kv_scale=scale, kv_zero=zero, rotation_signs=signs)
            want = ref.gather_kv(layer, indptr, indices, lens, **kw)
            got, _ = _gather(backend, "csr", layer, (indptr, indices, lens), backend.dims[0], **kw)
            for g, w in zip(got, want):
                assert_same(g, w)


def test_rotation_round_trip_stays_within_the_quantization_step(backend):
    # Not implied by the comparisons with the reference: the round trip must undo the
    # rotation. int8 rounds each rotated element by at most scale / 2, and the
    # rotation is orthonormal, so a row's L2 error is at most sqrt(D) * scale / 2.
    d = 96
    signs = rotation_signs(d, 1)
    layer, scale, zero = _rotated_views("NHD", "int8", d, 1)
    x = torch.randn(2, BS, H, d, generator=torch.Generator().manual_seed(2))
    x[:, :, :, 7] = 40.0  # an outlier channel
    dev = backend.device
    layer, scale, zero = (backend.copy(t) for t in (layer, scale, zero))
    backend.ops.write_kv(layer, torch.arange(BS).to(dev), x[0].to(dev), x[1].to(dev), kv_scale=scale,
                         kv_zero=zero, rotation_signs=signs.to(dev))
    as32 = lambda v: torch.tensor(v, dtype=torch.int32, device=dev)  # noqa: E731
    out = backend.ops.gather_kv(layer, as32([0, 1]), as32([0]), as32([BS]), out_dtype=torch.float32, kv_scale=scale,
                                kv_zero=zero, rotation_signs=signs.to(dev))
    for kv in (0, 1):
        err = (out[kv].cpu() - x[kv]).norm(dim=-1)  # [BS, H]
        bound = d ** 0.5 * scale[0, kv].cpu() / 2 * 1.001 + 1e-5
        assert bool((err <= bound).all()), (err / bound).max()
        assert float(err.max()) > 0  # quantized: not a copy


def test_rotated_gather_reads_zeros_for_a_bad_block_id_and_skips_tokens_past_the_sequences(kernel_backend):
    # The rotating kernels find each output token's block themselves (the tables'
    # values are not read on the host for a GPU): a bad id reads as a zero row
    # (zero unrotates to +-0), and a given output longer than the sequences keeps
    # the rows past them.
    gen = torch.Generator().manual_seed(9)
    layer, scale, zero = quantized_layer("HND", "int8", 16, gen=gen)
    indptr, indices, _, lens = tables(gen)
    signs = rotation_signs(16, 2)
    bad = indices.clone()
    bad[int(indptr[3])] = NB + 4  # the first block of the last sequence
    kw = dict(layout="HND", out_dtype=torch.float32, kv_scale=scale, kv_zero=zero, rotation_signs=signs)
    want_k, want_v = ref.gather_kv(layer, indptr, indices, lens, **kw)
    first = int(lens[:3].sum())
    want_k[first : first + BS] = 0
    want_v[first : first + BS] = 0
    total = int(lens.sum())
    out_k, out_v = torch.full((total + 2, H, 16), 5.0), torch.full((total + 2, H, 16), 5.0)
    got, _ = _gather(kernel_backend, "csr", layer, (indptr, bad, lens), {}, out_key=out_k, out_value=out_v, **kw)
    for g, w in zip(got, (want_k, want_v)):
        g = g.cpu()
        assert_same(g[:total], w, zero_sign=False)  # a zero row unrotates to the signs' +-0
        assert bool((g[total:] == 5.0).all())


_BAD_SIGNS = [
    (lambda d: torch.ones(d, dtype=torch.float64), DTypeError,
     r"^rotation_signs: expected dtype float32, got torch.float64$"),
    (lambda d: torch.ones(d + 1), ShapeError, r"^rotation_signs: expected shape \(16,\) \(head_dim\), got \(17,\)$"),
    (lambda d: torch.ones(2, d // 2), ShapeError, r"^rotation_signs: expected shape \(16,\) \(head_dim\), got \(2, 8\)$"),
    (lambda d: [1.0] * d, DTypeError, r"^rotation_signs: expected None or a torch.Tensor, got list$"),
]


@pytest.mark.parametrize("bad,error,message", _BAD_SIGNS)
@pytest.mark.parametrize("op", ["write", "gather", "gather_padded"])
@pytest.mark.parametrize("backend_name", ["reference", "cpu", "emulated", CUDA])
def test_bad_rotation_signs_are_refused_before_anything_moves(backend_name, op, bad, error, message):
    b = backends.load("reference") if backend_name == "reference" else make_backend(backend_name).ops
    dev = torch.device("cuda" if backend_name == "cuda" else "cpu")
    d = 16
    layer, scale, zero = (t.to(dev) for t in quantized_layer("NHD", "int8", d, gen=torch.Generator().manual_seed(3)))
    before = clones(layer, scale, zero)
    signs = bad(d)
    signs = signs.to(dev) if isinstance(signs, torch.Tensor) else signs
    key = torch.randn(4, H, d, device=dev)
    indptr, indices, block_table, lens = (t.to(dev) for t in tables(torch.Generator().manual_seed(4)))
    with pytest.raises(error, match=message):
        if op == "write":
            b.write_kv(layer, torch.arange(4, device=dev), key, key, kv_scale=scale, kv_zero=zero,
                       rotation_signs=signs)
        elif op == "gather":
            b.gather_kv(layer, indptr, indices, lens, out_dtype=torch.float32, kv_scale=scale, kv_zero=zero,
                        rotation_signs=signs)
        else:
            b.gather_kv_padded(layer, block_table, lens, out_dtype=torch.float32, kv_scale=scale, kv_zero=zero,
                               rotation_signs=signs)
    assert same_state([layer, scale, zero], before)


@pytest.mark.parametrize("backend_name", ["reference", "cpu", "emulated"])
def test_rotation_signs_need_a_quantized_layer(backend_name):
    b = backends.load("reference") if backend_name == "reference" else make_backend(backend_name).ops
    layer = torch.zeros(layer_shape("NHD", NB, BS, H, 8))
    key = torch.randn(2, H, 8)
    with pytest.raises(InvalidArgumentError, match=r"^rotation_signs: expected None for an unquantized kv_layer, got a tensor$"):
        b.write_kv(layer, torch.arange(2), key, key, rotation_signs=torch.ones(8))
    assert not bool(layer.any())
    indptr, indices, _, lens = tables(torch.Generator().manual_seed(4))
    with pytest.raises(InvalidArgumentError, match=r"^rotation_signs: expected None for an unquantized kv_layer"):
        b.gather_kv(layer, indptr, indices, lens, rotation_signs=torch.ones(8))


def test_rotating_kernels_bound_head_dim_by_their_shared_row():
    # plans.ROT_FLOATS mirrors the kernels' shared buffer size
    text = sources.load("gather_kv.cu").headers["common.cuh"].decode()
    assert re.search(r"#define PKV_ROT_FLOATS (\d+)", text).group(1) == str(plans.ROT_FLOATS)
    d = 2 * plans.ROT_FLOATS
    layer = torch.zeros((1, 2, 1, 1, d), dtype=torch.float8_e4m3fn)
    scale = torch.ones((1, 2, 1, 1))
    key = torch.randn(1, 1, d)
    with pytest.raises(InvalidArgumentError, match=rf"^rotation_signs: expected a head_dim <= {plans.ROT_FLOATS} "
                                                   rf"for the rotating kernels, got {d}$"):
        plans.plan_write_kv(layer, torch.zeros(1, dtype=torch.int64), key, key, kv_scale=scale,
                            rotation_signs=torch.ones(d))
    small = torch.zeros((1, 2, 1, 1, 64), dtype=torch.float8_e4m3fn)
    for launch in plans.plan_write_kv(small, torch.zeros(1, dtype=torch.int64), key[..., :64], key[..., :64],
                                      kv_scale=scale, rotation_signs=torch.ones(64)):
        assert launch.kernel.endswith("_rot") and launch.block[1] * 64 <= plans.ROT_FLOATS


# ----------------------------------------------------------------------------------
# copy_blocks / swap_blocks


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=name)
@pytest.mark.parametrize("d", [3, 16])
@pytest.mark.parametrize("kind", ["f16", "fp8", "int8"])
def test_copy_blocks_like_the_reference(backend, kind, d, index_dtype):
    gen = torch.Generator().manual_seed(d + len(kind))
    src = arenas(kind, d, gen)
    pairs = torch.tensor([[0, 3], [5, 1], [2, 6]], dtype=index_dtype)
    want = clones(*src)
    ref.copy_blocks(want, pairs)
    for pairs_on in backend.pair_devices:
        for dims in backend.dims:
            got = [backend.copy(a) for a in src]
            backend.ops.copy_blocks(got, pairs.to(pairs_on), **dims)
            for g, w in zip(got, want):
                assert_same(g, w)


def test_copy_blocks_rejects_host_pairs_like_the_reference(backend):
    host = arenas("f16", 4, torch.Generator().manual_seed(0))
    for pairs, message in (
        (torch.tensor([[0, 3], [1, 3]]), r"pairs: expected distinct dst block ids, got 3 twice \(row 1\)"),
        (torch.tensor([[0, 3], [3, 1]]), r"pairs: expected dst ids that are not also src ids, got 3 \(row 0\)"),
        (torch.tensor([[0, NB]]), r"pairs: expected block ids in \[0, 7\), got 7 at dst row 0"),
    ):
        for fn, group in ((ref.copy_blocks, host), (backend.ops.copy_blocks, [backend.copy(a) for a in host])):
            before = clones(*group)
            with pytest.raises(InvalidBlockError, match=message):
                fn(group, pairs)
            assert_same(group[0], before[0])  # nothing was written


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=name)
@pytest.mark.parametrize("kind", ["f16", "fp8", "int8"])
def test_swap_blocks_between_arenas_of_different_sizes(backend, kind, index_dtype):
    """Out to host arenas of another size (pinned for CUDA), then back."""
    gen = torch.Generator().manual_seed(len(kind))
    src = arenas(kind, 5, gen, nb=6)
    dst = arenas(kind, 5, gen, nb=9)
    pairs = torch.tensor([[5, 8], [0, 0], [3, 4]], dtype=index_dtype)
    back_pairs = pairs.flip(1)
    want = clones(*dst)
    ref.swap_blocks(src, want, pairs)
    want_back = [torch.zeros_like(a) for a in src]
    ref.swap_blocks(want, want_back, back_pairs)
    for dims in backend.dims:
        device_side = [backend.copy(a) for a in src]
        host_side = [backend.host(a) for a in dst]
        backend.ops.swap_blocks(device_side, host_side, pairs, **dims)
        backend.sync()
        for g, w in zip(host_side, want):
            assert_same(g, w)
        back = [backend.copy(torch.zeros_like(a)) for a in src]
        backend.ops.swap_blocks(host_side, back, back_pairs, **dims)
        for g, w in zip(back, want_back):
            assert_same(g, w)


# ----------------------------------------------------------------------------------
# convert_layout


@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("whole", [True, False], ids=["arena", "layer"])
@pytest.mark.parametrize("d", [3, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
                                   torch.float8_e5m2], ids=name)
def test_convert_layout_like_the_reference(backend, dtype, d, whole, offset):
    gen = torch.Generator().manual_seed(d)
    data = random_layer("NHD", dtype, d, gen=gen)
    if whole:
        data = torch.stack([data, random_layer("NHD", dtype, d, gen=gen)])
    data = offset_view(data, offset) if offset else data
    scale = offset_view(torch.randn(data.shape[:-1], generator=gen), offset)
    for src, dst in (("NHD", "HND"), ("HND", "NHD"), ("NHD", "NHD")):
        for t, is_scale in ((data, False), (scale, True)):
            want = ref.convert_layout(t, src, dst, scale=is_scale)
            for dims in backend.dims:
                assert_same(backend.ops.convert_layout(backend.copy(t), src, dst, scale=is_scale, **dims), want)


def test_convert_layout_round_trip_restores_the_arena(backend):
    data = random_layer("HND", torch.float16, 8, gen=torch.Generator().manual_seed(1))
    there = backend.ops.convert_layout(backend.copy(data), "HND", "NHD")
    assert_same(backend.ops.convert_layout(there, "NHD", "HND"), data)


# ----------------------------------------------------------------------------------
# random shapes (hypothesis)


def _on(backend, *ts):
    return [backend.copy(t) for t in ts]


@settings(max_examples=40, deadline=None)
@given(
    kv_dtype=st.sampled_from(KV_DTYPES),
    layout=st.sampled_from(["NHD", "HND"]),
    nb=st.integers(1, 20),
    bs=st.integers(1, 9),
    h=st.integers(1, 4),
    d=st.integers(1, 70),
    n=st.integers(0, 60),
    seed=st.integers(0, 2**16),
)
def test_write_equals_reference(backend, kv_dtype, layout, nb, bs, h, d, n, seed):
    a = Layer(nb, bs, h, d, kv_dtype, layout, seed=seed, random=True)
    g = torch.Generator().manual_seed(seed)
    n = min(n, nb * bs)
    slots = torch.randperm(nb * bs, generator=g)[:n]
    slots[torch.rand(n, generator=g) < 0.2] = -1  # padding tokens
    k, v = rand_kv(n, h, a.d, a.model_dtype, seed=seed)
    kv, scale, zero = _on(backend, a.kv, a.scale, a.zero)
    ref.write_kv(a.kv, slots, k, v, **a.kw())
    dev = backend.device
    backend.ops.write_kv(kv, slots.to(dev), k.to(dev), v.to(dev), layout=layout, kv_scale=scale, kv_zero=zero)
    assert same_state(a.state(), [t.cpu() for t in (kv, scale, zero) if t is not None])


@settings(max_examples=40, deadline=None)
@given(
    kv_dtype=st.sampled_from(KV_DTYPES),
    layout=st.sampled_from(["NHD", "HND"]),
    bs=st.integers(1, 9),
    h=st.integers(1, 4),
    d=st.integers(1, 40),
    lens=st.lists(st.integers(0, 40), min_size=0, max_size=6),
    seed=st.integers(0, 2**16),
)
def test_gather_equals_reference(backend, kv_dtype, layout, bs, h, d, lens, seed):
    nb = 24
    a = Layer(nb, bs, h, d, kv_dtype, layout, seed=seed, random=True)
    g = torch.Generator().manual_seed(seed)
    tables = []
    for n in lens:
        need = -(-n // bs) + int(torch.randint(0, 2, (1,), generator=g))  # sometimes a spare block
        tables.append(torch.randint(0, nb, (need,), generator=g).tolist())  # repeats allowed on read
    dev = backend.device
    kv, scale, zero = _on(backend, a.kv, a.scale, a.zero)
    kw = dict(layout=layout, kv_scale=scale, kv_zero=zero, out_dtype=a.gather_kw()["out_dtype"])
    r = ref.gather_kv(a.kv, *csr(tables, lens), **a.gather_kw())
    c = backend.ops.gather_kv(kv, *[x.to(dev) for x in csr(tables, lens)], **kw)
    c = [x.cpu() for x in c]
    assert same(r[0], c[0]) and same(r[1], c[1])
    rp = ref.gather_kv_padded(a.kv, *padded(tables, lens), **a.gather_kw())
    cp = backend.ops.gather_kv_padded(kv, *[x.to(dev) for x in padded(tables, lens)], **kw)
    cp = [x.cpu() for x in cp]
    assert same(rp[0], c[0]) and same(cp[0], c[0]) and same(cp[1], c[1])


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("pair_dtype", [torch.int64, torch.int32])
def test_copy_and_swap_equal_reference(backend, kv_dtype, pair_dtype):
    layers, nb = 3, 10
    # all-layer arenas (data, scale, zero) with different garbage in every layer
    arenas = [torch.stack([Layer(nb, 4, 2, 5, kv_dtype, seed=s, random=True, group_seed=1).state()[i]
                           for s in range(layers)])
              for i in range(len(Layer(nb, 4, 2, 5, kv_dtype).state()))]
    pairs = torch.tensor([[1, 4], [2, 5], [1, 9]], dtype=pair_dtype)
    ra, ca = [a.clone() for a in arenas], _on(backend, *arenas)
    ref.copy_blocks(ra, pairs)
    backend.ops.copy_blocks(ca, pairs)
    ca = [a.cpu() for a in ca]
    assert same_state(ra, ca)
    for before, after in zip(arenas, ca):  # every arena, every layer
        assert same(after[:, 4], before[:, 1]) and same(after[:, 9], before[:, 1])
        assert same(after[:, 5], before[:, 2]) and same(after[:, 0], before[:, 0])
    host_r = [torch.zeros((layers, 4) + a.shape[2:], dtype=a.dtype) for a in arenas]
    host_c = [backend.host(h) for h in host_r]
    hp = torch.tensor([[7, 0], [1, 3]], dtype=pair_dtype)
    ref.swap_blocks(arenas, host_r, hp)
    backend.ops.swap_blocks(_on(backend, *arenas), host_c, hp)
    backend.sync()
    assert same_state(host_r, host_c)
    for before, host in zip(arenas, host_c):
        assert same(host[:, 0], before[:, 7]) and same(host[:, 3], before[:, 1])
        assert not bool(host[:, 1].view(torch.uint8).any())  # untouched host blocks stay zero
