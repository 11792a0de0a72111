"""The seal_key_blocks kernel (cuda/seal_keys.cu): int4 block keys requantized per
channel, compared bit for bit with the torch reference (pagedkv.ops.reference.
seal_key_blocks) on the host emulation, under the planned launch dims and grids far
smaller than the work, and, marked ``cuda``, on a GPU. Inputs cover both layouts, the
three key dtypes, even head dims from 2 to 256 (non-powers of two too), block sizes 1
to 32, and the channels whose scale takes the fix-up paths (NaN, infinities, huge,
tiny, all equal). Bad input is a typed error that changes nothing; the block ids are
read once; the PTX compiles for sm_80/89/90 without FMA contraction.
"""
from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backend_cases import LAYOUTS, MODEL, ONE_THREAD, SMALL_GRID, assert_same, calls_while_flipping, make_backend, name
from pagedkv.errors import DeviceError, DTypeError, InvalidArgumentError, InvalidBlockError, ShapeError
from pagedkv.kernels import emulation, plans, sources
from pagedkv.ops import reference as ref

CUDA = pytest.param("cuda", marks=pytest.mark.cuda)

# (head_dim, block_size): the smallest head, non-powers of two, one token per block,
# and up to 256 channels and 32 tokens
CASES = [(2, 1), (2, 5), (6, 3), (10, 7), (14, 16), (64, 16), (80, 5), (96, 32), (126, 9), (128, 17), (254, 2),
         (256, 8), (256, 32)]
# beyond the backend's own dims: a CTA row wider than a head's channel pairs, a
# CTA of one column, and grids that stride over both rows and columns
EXTRA_DIMS = (dict(grid=(1, 1, 1), block=(32, 4, 1)), dict(grid=(5, 3, 1), block=(8, 16, 1)),
              dict(grid=(3, 1, 1), block=(1, 7, 1)))


@pytest.fixture(scope="module", params=["emulated", CUDA])
def backend(request):
    return make_backend(request.param)


def _dims(backend):
    return backend.dims + (EXTRA_DIMS if backend.name == "emulated" else ())


def layer(layout, nb, bs, h, d, gen):
    """An int4 layer and its block-key parameters full of garbage, so every byte the
    op must leave alone is checked too."""
    shape = (nb, 2, bs, h, d // 2) if layout == "NHD" else (nb, 2, h, bs, d // 2)
    kv = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    ks = (torch.randn(nb, h, d, generator=gen) * 3).to(torch.bfloat16)
    kz = (torch.randn(nb, h, d, generator=gen) * 3).to(torch.bfloat16)
    return kv, ks, kz


# what a (block, head, channel) of keys may hold, beyond plain random values: each
# drives z, s or the codes down another path of the definition
SPECIALS = {
    "nan": lambda c, gen: c.index_fill(0, torch.randint(0, c.shape[0], (1,), generator=gen), float("nan")),
    "all_nan": lambda c, gen: torch.full_like(c, float("nan")),
    "inf": lambda c, gen: c.index_fill(0, torch.randint(0, c.shape[0], (1,), generator=gen), float("inf")),
    "-inf": lambda c, gen: c.index_fill(0, torch.randint(0, c.shape[0], (1,), generator=gen), float("-inf")),
    "all_inf": lambda c, gen: torch.full_like(c, float("inf")),  # z = inf, inf - inf = NaN
    "both_infs": lambda c, gen: c.index_fill(0, torch.tensor([0]), float("inf")).index_fill(
        0, torch.tensor([c.shape[0] - 1]), float("-inf")),
    "equal": lambda c, gen: torch.full_like(c, 2.75),
    "zeros": lambda c, gen: torch.zeros_like(c),
    "signed_zeros": lambda c, gen: torch.where(torch.rand(c.shape, generator=gen) < 0.5, 0.0, -0.0),
    "huge": lambda c, gen: c * 3e38,            # max - min overflows; bf16_down of -3e38 is -inf
    "near_max": lambda c, gen: torch.full_like(c, -3.389e38),
    "tiny": lambda c, gen: c * 1e-39,            # subnormal spreads: the scale rounds up to a tiny bf16
    # min 0 and max 15 make s = 1: every other token is then an exact tie for rint
    "ties": lambda c, gen: torch.tensor([0.0, 15.0] + [k % 15 + 0.5 for k in range(c.shape[0])])[: c.shape[0]],
}


def keys_with_specials(m, bs, h, d, dtype, gen):
    """``[m, bs, h, d]`` keys: per-channel random magnitudes, and each special kind in
    a few random (block, head, channel) columns."""
    k = torch.randn(m, bs, h, d, generator=gen) * torch.exp(torch.randn(m, 1, h, d, generator=gen) * 3)
    if m:
        for kind in SPECIALS.values():
            for _ in range(2):
                i, hh, c = (int(torch.randint(0, n, (1,), generator=gen)) for n in (m, h, d))
                k[i, :, hh, c] = kind(k[i, :, hh, c].clone(), gen)
    return k.to(dtype)


def run_case(backend, layout, kv, ks, kz, blocks, keys, dims):
    """Seal on ``backend`` from copies of the state; compare every byte with the
    reference's result (which also leaves every untouched byte as it was)."""
    want = [t.clone() for t in (kv, ks, kz)]
    ref.seal_key_blocks(want[0], blocks, keys, want[1], want[2], layout=layout)
    got = [backend.copy(t) for t in (kv, ks, kz)]
    backend.ops.seal_key_blocks(got[0], backend.copy(blocks), backend.copy(keys), got[1], got[2], layout=layout,
                                **dims)
    backend.sync()
    assert_same(got[0], want[0])
    assert_same(got[1], want[1])
    # a zero point is min's bf16_down: torch.amin returns either zero's sign for
    # +-0 (position and vector width decide), which changes no code and no value
    assert_same(got[2], want[2], zero_sign=False)
    return want


def untouched(before, after, blocks):
    """Every block not in ``blocks`` and every V plane equal to ``before``."""
    keep = torch.ones(before[0].shape[0], dtype=torch.bool)
    keep[blocks] = False
    for b, a in zip(before, after):
        assert torch.equal(b[keep].view(torch.uint8), a[keep].view(torch.uint8))
    assert torch.equal(before[0][:, 1], after[0][:, 1])


@pytest.mark.parametrize("dtype", MODEL, ids=name)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"d{c[0]}-bs{c[1]}")
def test_sealed_blocks_equal_the_reference_bit_for_bit(backend, case, layout, dtype):
    d, bs = case
    nb, h = 9, 3
    gen = torch.Generator().manual_seed(d * 97 + bs)
    kv, ks, kz = layer(layout, nb, bs, h, d, gen)
    blocks = torch.randperm(nb, generator=gen)[:5]
    keys = keys_with_specials(5, bs, h, d, dtype, gen)
    for dims in _dims(backend):
        want = run_case(backend, layout, kv, ks, kz, blocks, keys, dims)
    untouched((kv, ks, kz), want, blocks)
    assert not torch.equal(want[0][blocks, 0], kv[blocks, 0])  # the case does write


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_channel_of_one_special_kind(backend, layout):
    # a whole block of each special kind: every channel pair of it takes one path
    nb, bs, h, d = len(SPECIALS), 6, 2, 12
    gen = torch.Generator().manual_seed(3)
    kv, ks, kz = layer(layout, nb, bs, h, d, gen)
    keys = torch.randn(nb, bs, h, d, generator=gen)
    for i, kind in enumerate(SPECIALS.values()):
        for hh in range(h):
            for c in range(d):
                keys[i, :, hh, c] = kind(keys[i, :, hh, c].clone(), gen)
    blocks = torch.randperm(nb, generator=gen)
    for dtype in MODEL:
        for dims in _dims(backend):
            want = run_case(backend, layout, kv, ks, kz, blocks, keys.to(dtype), dims)
        # the fix-up paths were taken: NaN and infinite zero points, scales set to 1
        zero, scale = want[2][blocks].float(), want[1][blocks].float()
        assert torch.isnan(zero).any() and (zero == -float("inf")).any() and (zero == float("inf")).any()
        assert (scale == 1).sum() >= 4 * h * d


def test_strided_keys_equal_contiguous_ones(backend):
    # keys may be any [M, bs, H] view with a dense head_dim (e.g. a slice of a wider tensor)
    nb, bs, h, d = 5, 4, 3, 16
    gen = torch.Generator().manual_seed(11)
    kv, ks, kz = layer("HND", nb, bs, h, d, gen)
    wide = torch.randn(bs, 3, h + 1, d + 6, generator=gen)
    keys = wide[:, 1:, :h, 2 : 2 + d].permute(1, 0, 2, 3)  # [2, bs, h, d], strides everywhere but d
    assert not keys.is_contiguous() and keys.stride(-1) == 1
    blocks = torch.tensor([3, 0])
    want = [t.clone() for t in (kv, ks, kz)]
    ref.seal_key_blocks(want[0], blocks, keys.contiguous(), want[1], want[2], layout="HND")
    for dims in _dims(backend):
        got = [backend.copy(t) for t in (kv, ks, kz)]
        dev_keys = wide.to(backend.device)[:, 1:, :h, 2 : 2 + d].permute(1, 0, 2, 3)
        backend.ops.seal_key_blocks(got[0], backend.copy(blocks), dev_keys, got[1], got[2], layout="HND", **dims)
        backend.sync()
        for g, w in zip(got, want):
            assert_same(g, w, zero_sign=False)


def test_no_blocks_is_a_no_op(backend):
    gen = torch.Generator().manual_seed(2)
    kv, ks, kz = layer("NHD", 4, 3, 2, 8, gen)
    before = [t.clone() for t in (kv, ks, kz)]
    got = [backend.copy(t) for t in (kv, ks, kz)]
    empty = torch.empty(0, dtype=torch.int64, device=backend.device)
    backend.ops.seal_key_blocks(got[0], empty, torch.empty(0, 3, 2, 8, device=backend.device), got[1], got[2])
    backend.sync()
    assert all(torch.equal(a.cpu().view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, before))
    assert plans.plan_seal_key_blocks(kv, empty.cpu(), torch.empty(0, 3, 2, 8), ks, kz) == []


@settings(max_examples=40, deadline=None)
@given(
    layout=st.sampled_from(LAYOUTS),
    dtype=st.sampled_from(MODEL),
    nb=st.integers(1, 10),
    bs=st.integers(1, 32),
    h=st.integers(1, 4),
    half_d=st.integers(1, 128),
    m_pick=st.integers(0, 10),
    dims=st.sampled_from(({}, SMALL_GRID, ONE_THREAD) + EXTRA_DIMS),
    seed=st.integers(0, 2**16),
)
def test_random_shapes_equal_the_reference(layout, dtype, nb, bs, h, half_d, m_pick, dims, seed):
    backend = make_backend("emulated")
    d = 2 * half_d
    gen = torch.Generator().manual_seed(seed)
    m = m_pick % (nb + 1)
    kv, ks, kz = layer(layout, nb, bs, h, d, gen)
    blocks = torch.randperm(nb, generator=gen)[:m]  # distinct ids
    keys = keys_with_specials(m, bs, h, d, dtype, gen)
    want = run_case(backend, layout, kv, ks, kz, blocks, keys, dims)
    untouched((kv, ks, kz), want, blocks)


# ----------------------------------------------------------------------------------
# the block ids: checked once, and guarded in the kernel


def test_ids_flipped_by_another_thread_are_refused_or_never_seen():
    # The plan copies the ids before it checks them and the kernel reads that copy: an
    # id flipped out of range meanwhile is refused by the value checked, or never seen.
    # The layer and its parameters are views of larger buffers whose tails must not change.
    nb, bs, h, d = 4, 4, 2, 8
    gen = torch.Generator().manual_seed(7)
    whole = list(layer("NHD", nb + 3, bs, h, d, gen))
    tails = [t[nb:].clone() for t in whole]
    views = [t[:nb] for t in whole]
    blocks = torch.tensor([2, 0, 3])
    keys = torch.randn(3, bs, h, d, generator=gen)
    calls_while_flipping(blocks, 1, nb + 2, 0,
                         lambda: emulation.seal_key_blocks(views[0], blocks, keys, views[1], views[2]),
                         2000, InvalidBlockError, "got 6")
    for whole_t, tail in zip(whole, tails):
        assert torch.equal(whole_t[nb:].view(torch.uint8), tail.view(torch.uint8))


def test_kernel_skips_ids_outside_the_layer():
    # device-resident ids are not read by the launcher (a sync): the kernel itself must
    # skip a bad one and seal the rest. Planned from good ids, then the plan's own copy
    # is spoiled, as a GPU caller's bad ids would reach the kernel.
    nb, bs, h, d = 5, 3, 2, 10
    gen = torch.Generator().manual_seed(8)
    whole = list(layer("HND", nb + 2, bs, h, d, gen))
    before = [t.clone() for t in whole]
    views = [t[:nb] for t in whole]
    keys = torch.randn(4, bs, h, d, generator=gen)
    (launch,) = plans.plan_seal_key_blocks(views[0], torch.tensor([1, 4, 0, 2]), keys, views[1], views[2],
                                          layout="HND")
    ids = launch.keep[0]
    ids[1], ids[3] = nb, -1
    emulation.run([launch], grid=(1, 1, 1), block=(2, 2, 1))
    want = [t.clone() for t in before]
    ref.seal_key_blocks(want[0][:nb], torch.tensor([1, 0]), keys[[0, 2]], want[1][:nb], want[2][:nb],
                        layout="HND")
    for g, w in zip(whole, want):
        assert_same(g, w, zero_sign=False)


# ----------------------------------------------------------------------------------
# typed errors, state unchanged


def _bad_cases():
    gen = torch.Generator().manual_seed(4)
    kv, ks, kz = layer("NHD", 6, 4, 2, 8, gen)
    keys = torch.randn(2, 4, 2, 8, generator=gen)
    good = dict(kv_layer=kv, blocks=torch.tensor([1, 2]), keys=keys, key_scale=ks, key_zero=kz)
    raw = bytearray(keys.numel() * 4 + 4)
    misaligned = torch.frombuffer(raw, dtype=torch.float32, offset=1, count=keys.numel()).view(keys.shape)
    hnd_like = torch.zeros(6, 2, 2, 4, 4, dtype=torch.uint8).transpose(2, 3)  # NHD shape, not contiguous
    return [
        (dict(blocks=torch.tensor([1, 6])), InvalidBlockError, r"^blocks: expected block ids in \[0, 6\), got 6"),
        (dict(blocks=torch.tensor([-1, 2])), InvalidBlockError, r"^blocks: expected block ids in \[0, 6\), got -1"),
        (dict(blocks=torch.tensor([1, 2], dtype=torch.int32)), DTypeError, r"^blocks: expected dtype int64"),
        (dict(keys=keys[:1]), ShapeError, r"^keys: expected shape \(2, 4, 2, 8\)"),
        (dict(keys=keys.double()), DTypeError, r"^keys: expected dtype float32, float16 or bfloat16"),
        (dict(key_scale=ks.float()), DTypeError, r"^key_scale: expected dtype bfloat16"),
        (dict(key_zero=None), InvalidArgumentError, r"^key_zero: expected a tensor when the other"),
        (dict(kv_layer=kv.view(torch.int8)), ShapeError, r"^kv_layer: expected an int4 \(uint8\) NHD layer view"),
        (dict(kv_layer=hnd_like), InvalidArgumentError, r"^kv_layer: expected a contiguous tensor, got strides"),
        (dict(keys=keys.transpose(2, 3).contiguous().transpose(2, 3)), InvalidArgumentError,
         r"^keys: expected unit stride in the last dim \(head_dim\)"),
        (dict(keys=misaligned), InvalidArgumentError, r"^keys: expected a data pointer aligned to its 4-byte elements"),
        (dict(blocks=torch.tensor([1]), keys=torch.empty(1, 0, 2, 8), kv_layer=torch.zeros(6, 2, 0, 2, 4,
                                                                                             dtype=torch.uint8)),
         ShapeError, r"^kv_layer: expected a non-empty block_size, H and head_dim"),
        (dict(kv_layer=torch.zeros(6, 2, 4, 2, 4, dtype=torch.uint8, device="meta")), DeviceError,
         r"^kv_layer: expected a CPU tensor \(the emulation runs on the host\), got meta"),
    ], good


@pytest.mark.parametrize("i", range(13))
def test_bad_input_is_a_typed_error_and_changes_nothing(i):
    make_backend("emulated")
    cases, good = _bad_cases()
    change, err, match = cases[i]
    args = dict(good, **change)
    state = [t.clone() for t in (good["kv_layer"], good["key_scale"], good["key_zero"])]
    with pytest.raises(err, match=match):
        emulation.seal_key_blocks(args["kv_layer"], args["blocks"], args["keys"], args["key_scale"], args["key_zero"])
    assert all(torch.equal(a, b) for a, b in zip(state, (good["kv_layer"], good["key_scale"], good["key_zero"])))


def test_the_cuda_launcher_refuses_host_tensors_before_any_gpu_work():
    from pagedkv.kernels import ops as cuda_ops

    kv, ks, kz = layer("NHD", 3, 2, 1, 4, torch.Generator().manual_seed(0))
    with pytest.raises(DeviceError, match=r"^kv_layer: expected a CUDA tensor, got cpu$"):
        cuda_ops.seal_key_blocks(kv, torch.tensor([0]), torch.zeros(1, 2, 1, 4), ks, kz)


# ----------------------------------------------------------------------------------
# NVRTC: every variant's PTX, with the parameters the plans pass


ARCHS = ("sm_80", "sm_89", "sm_90")


@pytest.fixture(scope="module")
def seal_ptx():
    pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-python (NVRTC) is not installed")
    from pagedkv.kernels import build
    from pagedkv.kernels.options import CompileOptions

    return {arch: build.build("seal_keys.cu", CompileOptions(arch=arch)).data.decode() for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_seal_ptx_compiles_without_fma_and_takes_the_planned_arguments(seal_ptx, arch):
    ptx = seal_ptx[arch]
    assert f".target {arch}" in ptx
    assert "fma.rn.f32" not in ptx  # the reference rounds after every operation
    gen = torch.Generator().manual_seed(0)
    checked = set()
    for layout in LAYOUTS:
        kv, ks, kz = layer(layout, 3, 4, 2, 8, gen)
        for dtype in MODEL:
            (launch,) = plans.plan_seal_key_blocks(kv, torch.tensor([2]), torch.zeros(1, 4, 2, 8, dtype=dtype), ks,
                                                   kz, layout=layout)
            m = re.search(r"\.entry\s+{}\s*\(([^)]*)\)".format(re.escape(launch.kernel)), ptx)
            assert m is not None, f"{launch.kernel} is not in the PTX"
            assert len(re.findall(r"\.param\b", m.group(1))) == len(launch.args), launch.kernel
            checked.add(launch.kernel)
    assert checked == set(sources.entry_points()["seal_keys.cu"])
