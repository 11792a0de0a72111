"""int4 block keys (pagedkv/format/quant.py, "block keys") in the CUDA gather kernels: the
kernels read a K row per channel from ``key_scale``/``key_zero`` where
``key_scale[block, head, 0]`` is nonzero, and never unrotate it; every other row
takes the per-token path. Compared bit for bit with the torch reference on the host
emulation (planned launch dims and grids far smaller than the work) and, marked
``cuda``, on a GPU; the PTX of every variant still compiles for sm_80/89/90 without
FMA contraction, with the parameters the launch plans pass.
"""
from __future__ import annotations

import re

import pytest
import torch
from backend_cases import (
    LAYOUTS,
    MODEL,
    ONE_THREAD,
    QUANT,
    SMALL_GRID,
    assert_same,
    csr,
    layer_shape,
    make_backend,
    padded,
    quantized_layer,
    raw,
    tables,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.errors import DTypeError, InvalidArgumentError, ShapeError
from pagedkv.format import dtypes
from pagedkv.format.quant import quantize_key_block
from pagedkv.format.rotation import rotation_signs
from pagedkv.kernels import plans
from pagedkv.ops import reference as ref

CUDA = pytest.param("cuda", marks=pytest.mark.cuda)
NB, BS, H = 7, 5, 3  # odd sizes: partial blocks everywhere; head 0 sealed, head 1 not, head 2 either

# (head_dim, int4 group size): tiny, odd groups, non-powers of two, and up to 256
CASES = [(2, 2), (2, 1), (6, 3), (14, 7), (14, 14), (64, 16), (80, 16), (96, 32), (128, 64), (128, 128),
         (254, 127), (256, 32), (256, 256)]
# beyond the backend's own dims: rows wider than a CTA row, and a rotating CTA whose
# rows fill the shared row buffer (16 * 256 floats) exactly
EXTRA_DIMS = (dict(grid=(1, 1, 1), block=(32, 4, 1)), dict(grid=(5, 3, 1), block=(8, 16, 1)))


@pytest.fixture(scope="module", params=["emulated", CUDA])
def backend(request):
    return make_backend(request.param)


def _dims(backend):
    return backend.dims + (EXTRA_DIMS if backend.name == "emulated" else ())


def block_key_layer(layout, d, group, gen, *, nb=NB, bs=BS, h=H, signs=None, sealed=None):
    """An int4 layer whose every slot holds per-token keys and values (rotated when
    ``signs`` is given) and whose sealed (block, head) pairs hold block keys instead:
    their codes in the K plane, their parameters in ``key_scale``/``key_zero``.
    ``sealed`` ``[nb, h]`` bool defaults to head 0 sealed, head 1 not, the rest at
    random. Unsealed pairs keep nonzero garbage in ``key_scale[..., 1:]`` and
    ``key_zero``, and a zero of either sign at ``key_scale[..., 0]``: only that one
    value may decide.

    Returns ``(kv, scale, zero, key_scale, key_zero, sealed)``."""
    shape = layer_shape(layout, nb, bs, h, d // 2)
    sshape = shape[:-1] + (d // group,)
    kv = torch.zeros(shape, dtype=torch.uint8)
    scale, zero = torch.zeros(sshape), torch.zeros(sshape)
    k = torch.randn(nb * bs, h, d, generator=gen) * 4
    v = torch.randn(nb * bs, h, d, generator=gen)
    ref.write_kv(kv, torch.arange(nb * bs), k, v, layout=layout, kv_scale=scale, kv_zero=zero,
                 rotation_signs=signs)
    codes, key_scale, key_zero = quantize_key_block(k.view(nb, bs, h, d))
    if sealed is None:
        sealed = torch.rand(nb, h, generator=gen) < 0.5
        sealed[:, 0] = True
        if h > 1:
            sealed[:, 1] = False
    plane = kv[:, 0] if layout == "NHD" else kv[:, 0].transpose(1, 2)  # [nb, bs, h, d/2] view
    plane.copy_(torch.where(sealed[:, None, :, None], codes, plane))
    signed_zero = torch.where(torch.rand(nb, h, generator=gen) < 0.5, 0.0, -0.0).to(torch.bfloat16)
    key_scale[..., 0] = torch.where(sealed, key_scale[..., 0], signed_zero)
    return kv, scale, zero, key_scale, key_zero, sealed


def _gather(backend, table, kv, table_args, dims, **kw):
    fn = backend.ops.gather_kv if table == "csr" else backend.ops.gather_kv_padded
    dev = {k: backend.copy(v) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    got = fn(backend.copy(kv), *[a.to(backend.device) for a in table_args], **dev, **dims)
    backend.sync()
    return got


def _check_all(backend, kv, scale, zero, key_scale, key_zero, signs, layout, gen, out_dtypes=MODEL):
    """Every out dtype, both table kinds and every launch shape against the reference;
    and the block keys must change K (not V) from what the per-token path reads."""
    indptr, indices, block_table, lens = tables(gen)
    for table, args in (("csr", (indptr, indices, lens)), ("padded", (block_table, lens))):
        fn_ref = ref.gather_kv if table == "csr" else ref.gather_kv_padded
        for out_dtype in out_dtypes:
            kw = dict(layout=layout, out_dtype=out_dtype, kv_scale=scale, kv_zero=zero, rotation_signs=signs)
            want = fn_ref(kv, *args, key_scale=key_scale, key_zero=key_zero, **kw)
            plain = fn_ref(kv, *args, **kw)
            assert not torch.equal(raw(want[0]), raw(plain[0]))
            assert_same(want[1], plain[1])
            for dims in _dims(backend):
                got = _gather(backend, table, kv, args, dims, key_scale=key_scale, key_zero=key_zero, **kw)
                assert_same(got[0], want[0])
                assert_same(got[1], want[1])


@pytest.mark.parametrize("rotated", [False, True], ids=["plain", "rotated"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"d{c[0]}-g{c[1]}")
def test_block_keys_gather_like_the_reference(backend, case, layout, rotated):
    d, group = case
    gen = torch.Generator().manual_seed(d * 31 + group)
    signs = rotation_signs(d, d) if rotated else None
    kv, scale, zero, key_scale, key_zero, _ = block_key_layer(layout, d, group, gen, signs=signs)
    _check_all(backend, kv, scale, zero, key_scale, key_zero, signs, layout, gen)


@pytest.mark.parametrize("rotated", [False, True], ids=["plain", "rotated"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_block_key_parameters_of_any_value_read_like_the_reference(backend, layout, rotated):
    # NaN, infinities and magnitudes far from the data in scale and zero; a NaN, an
    # infinite, a tiny and a subnormal first scale still mark a sealed pair, a zero
    # of either sign does not.
    d, group = 16, 8
    gen = torch.Generator().manual_seed(5)
    signs = rotation_signs(d, 2) if rotated else None
    sealed = torch.ones(NB, H, dtype=torch.bool)
    kv, scale, zero, key_scale, key_zero, _ = block_key_layer(layout, d, group, gen, signs=signs, sealed=sealed)
    specials = [float("nan"), float("inf"), -float("inf"), 1e30, -1e30, 1e-30, -1e-30, 0.0, -0.0]
    for t in (key_scale, key_zero):
        flat = t.view(-1)
        where = torch.randperm(flat.numel(), generator=gen)[: 4 * len(specials)]
        flat[where] = torch.tensor(specials * 4, dtype=torch.bfloat16)
    firsts = [float("nan"), float("inf"), -float("inf"), 1e-30, 1e-39, -3.0, 0.0, -0.0]
    for i, s in enumerate(firsts):  # block i % NB, head i // NB
        key_scale[i % NB, i // NB, 0] = s
    assert (key_scale[..., 0].float() == 0).sum() >= 2
    _check_all(backend, kv, scale, zero, key_scale, key_zero, signs, layout, gen)


@settings(max_examples=25, deadline=None)
@given(
    layout=st.sampled_from(LAYOUTS),
    rotated=st.booleans(),
    out_dtype=st.sampled_from(MODEL),
    nb=st.integers(1, 10),
    bs=st.integers(1, 9),
    h=st.integers(1, 4),
    half_d=st.integers(1, 128),
    group_pick=st.integers(0, 2**16),
    lens=st.lists(st.integers(0, 30), min_size=0, max_size=5),
    seed=st.integers(0, 2**16),
)
def test_block_keys_random_shapes_equal_reference(layout, rotated, out_dtype, nb, bs, h, half_d, group_pick, lens,
                                                  seed):
    backend = make_backend("emulated")
    d = 2 * half_d
    legal = [g for g in range(1, d + 1) if d % g == 0]
    group = legal[group_pick % len(legal)]
    gen = torch.Generator().manual_seed(seed)
    signs = rotation_signs(d, seed) if rotated else None
    sealed = torch.rand(nb, h, generator=gen) < 0.5
    kv, scale, zero, key_scale, key_zero, _ = block_key_layer(layout, d, group, gen, nb=nb, bs=bs, h=h, signs=signs,
                                                              sealed=sealed)
    seq_tables = []
    for n in lens:
        need = -(-n // bs) + int(torch.randint(0, 2, (1,), generator=gen))  # sometimes a spare block
        seq_tables.append(torch.randint(0, nb, (need,), generator=gen).tolist())  # repeats allowed on read
    kw = dict(layout=layout, out_dtype=out_dtype, kv_scale=scale, kv_zero=zero, rotation_signs=signs,
              key_scale=key_scale, key_zero=key_zero)
    for table, args in (("csr", csr(seq_tables, lens)), ("padded", padded(seq_tables, lens))):
        want = (ref.gather_kv if table == "csr" else ref.gather_kv_padded)(kv, *args, **kw)
        for dims in ({}, SMALL_GRID, ONE_THREAD):
            got = _gather(backend, table, kv, args, dims, **kw)
            assert_same(got[0], want[0])
            assert_same(got[1], want[1])


def test_bad_block_key_parameters_are_refused_by_the_kernel_path():
    b = make_backend("emulated")
    gen = torch.Generator().manual_seed(1)
    kv, scale, zero, key_scale, key_zero, _ = block_key_layer("NHD", 8, 4, gen)
    indptr, indices, _, lens = tables(gen)
    kw = dict(out_dtype=torch.float16, kv_scale=scale, kv_zero=zero)

    def gather(**more):
        return b.ops.gather_kv(kv, indptr, indices, lens, **kw, **more)

    with pytest.raises(DTypeError, match=r"^key_scale: expected dtype bfloat16, got torch.float32$"):
        gather(key_scale=key_scale.float(), key_zero=key_zero)
    with pytest.raises(ShapeError, match=r"^key_zero: expected shape \(7, 3, 8\) \[num_blocks, H, head_dim\]"):
        gather(key_scale=key_scale, key_zero=key_zero[:, :, :4])
    with pytest.raises(InvalidArgumentError, match=r"^key_zero: expected a tensor when the other block-key parameter"):
        gather(key_scale=key_scale)
    with pytest.raises(InvalidArgumentError, match=r"^key_scale: expected a contiguous tensor"):
        gather(key_scale=key_scale.transpose(0, 1).contiguous().transpose(0, 1), key_zero=key_zero)
    fp8, fp8_scale, _ = quantized_layer("NHD", "fp8_e4m3", 8, gen=gen)
    with pytest.raises(InvalidArgumentError, match=r"^key_scale: expected None unless the kv_layer is int4"):
        b.ops.gather_kv(fp8, indptr, indices, lens, out_dtype=torch.float16, kv_scale=fp8_scale,
                        key_scale=key_scale, key_zero=key_zero)


# ----------------------------------------------------------------------------------
# NVRTC: the PTX of every variant, with the parameters the plans pass


ARCHS = ("sm_80", "sm_89", "sm_90")
_ENTRY = r"\.entry\s+{}\s*\(([^)]*)\)"


@pytest.fixture(scope="module")
def gather_ptx():
    pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-python (NVRTC) is not installed")
    from pagedkv.kernels import build
    from pagedkv.kernels.options import CompileOptions

    return {arch: build.build("gather_kv.cu", CompileOptions(arch=arch)).data.decode() for arch in ARCHS}


def _param_count(ptx: str, kernel: str) -> int:
    m = re.search(_ENTRY.format(re.escape(kernel)), ptx)
    assert m is not None, f"{kernel} is not in the PTX"
    return len(re.findall(r"\.param\b", m.group(1)))


@pytest.mark.parametrize("arch", ARCHS)
def test_gather_ptx_compiles_without_fma_and_takes_the_planned_arguments(gather_ptx, arch):
    ptx = gather_ptx[arch]
    assert f".target {arch}" in ptx
    assert "fma.rn.f32" not in ptx  # the reference rounds after the multiply and after the add
    gen = torch.Generator().manual_seed(0)
    indptr, indices, block_table, lens = tables(gen)
    checked = set()
    compiled = [q for q in QUANT if dtypes.info(q).compiled]     # int2 has no kernels (refused by type)
    for qdtype in compiled:
        d = 16
        kv, scale, zero = quantized_layer("NHD", qdtype, d, gen=gen)
        more = {}
        if qdtype == "int4":
            more = dict(zip(("key_scale", "key_zero"), block_key_layer("NHD", d, 8, gen)[3:5]))
        for signs in (None, rotation_signs(d, 1)):
            for extra in ({}, more):
                for table_kw in (dict(indptr=indptr, indices=indices), dict(block_table=block_table)):
                    (launch,), _, _ = plans.plan_gather(kv, lens, out_dtype=torch.float16, kv_scale=scale,
                                                         kv_zero=zero, rotation_signs=signs, **table_kw, **extra)
                    assert _param_count(ptx, launch.kernel) == len(launch.args), launch.kernel
                    # the block keys' parameters, then their high bits' width (0: no layer_format
                    # names wider keys)
                    if extra:
                        assert launch.args[-3:] == (("ptr", extra["key_scale"].data_ptr()),
                                                    ("ptr", extra["key_zero"].data_ptr()), ("i64", 0))
                    else:
                        assert launch.args[-3:] == (("ptr", 0), ("ptr", 0), ("i64", 0))
                    checked.add(launch.kernel)
    assert len(checked) == len(compiled) * 2 * 2
