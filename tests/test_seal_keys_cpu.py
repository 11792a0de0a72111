"""ops.cpu.seal_key_blocks: the C loop (pagedkv/ops/key_seal.h) that requantizes whole
blocks' keys per channel must equal pagedkv.ops.reference.seal_key_blocks byte for byte
(codes, key scales, key zeros, and everything it must not touch): both layouts, every
key dtype, head_dim from 2 to 256, block sizes 1 to 32, channels that hit every scale
fix-up (NaN, infinities, huge, tiny, denormal, all equal, signed zeros), strided and
misaligned inputs, the threaded path, and the baseline (non-AVX2) build. Bad input gets
the reference's typed error before any write; block ids are read once.
"""
from __future__ import annotations

import os

import pytest
import torch
from backend_cases import LAYOUTS, MODEL, assert_same, calls_while_flipping, name, offset_view, run_on_baseline_build
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.errors import DeviceError, DTypeError, InvalidArgumentError, InvalidBlockError, ShapeError
from pagedkv.ops import backends
from pagedkv.ops import reference as ref

cpu = pytest.importorskip("pagedkv.ops.cpu")
if not backends.cpu_ops_built():
    pytest.skip("the fast CPU ops are not built", allow_module_level=True)

# what a channel of a block holds (hostile_keys)
KINDS = ("plain", "equal", "nan", "pinf", "ninf", "huge", "bf16_edge", "small", "tiny", "zeros", "offset")
D_VALUES = (2, 4, 6, 8, 10, 14, 16, 18, 24, 64, 80, 96, 128, 130, 256)


def hostile_keys(m, bs, h, d, dtype, gen):
    """``[m, bs, h, d]`` keys whose channels (per block and head) each draw a kind from
    KINDS: ordinary values, one constant (the zero-scale fix-up), a NaN, +inf or -inf at
    one token, +-3e38 (max - min overflows), values just past bfloat16's largest (the
    outward rounding reaches infinity), float16 and float32 denormals, signed zeros, and
    a large offset with a small spread."""
    shape = (m, bs, h, d)
    base = torch.randn(shape, generator=gen) * 3
    kind = torch.randint(0, len(KINDS), (m, 1, h, d), generator=gen).expand(shape)
    one_token = torch.randint(0, bs, (m, 1, h, d), generator=gen) == torch.arange(bs).view(1, bs, 1, 1)
    sign = torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0)
    cases = {
        "equal": torch.randn((m, 1, h, d), generator=gen).expand(shape),
        "nan": torch.where(one_token, float("nan"), base),
        "pinf": torch.where(one_token, float("inf"), base),
        "ninf": torch.where(one_token, float("-inf"), base),
        "huge": sign * 3e38,
        "bf16_edge": sign * 3.3961e38 + base,
        "small": base * 1e-6,        # float16 subnormals
        "tiny": base * 1e-40,        # float32 (and bfloat16) denormals
        "zeros": sign * 0.0,
        "offset": 1000.0 + base * 1e-3,
    }
    x = base
    for i, k in enumerate(KINDS):
        if k in cases:
            x = torch.where(kind == i, cases[k], x)
    return x.to(dtype)


def int4_layer(layout, nb, bs, h, d, gen):
    """A random int4 layer view and random (nonzero garbage) key scale and zero views."""
    shape = (nb, 2, bs, h, d // 2) if layout == "NHD" else (nb, 2, h, bs, d // 2)
    kv = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    ks = torch.randn(nb, h, d, generator=gen).to(torch.bfloat16)
    kz = torch.randn(nb, h, d, generator=gen).to(torch.bfloat16)
    return kv, ks, kz


def assert_same_state(got, want):
    """Codes and scales byte for byte; zeros too but for a zero's sign (torch.amin returns
    either zero of a channel holding both; the sign changes no code and no read-back)."""
    assert_same(got[0], want[0])
    assert_same(got[1], want[1])
    assert_same(got[2], want[2], zero_sign=False)


def seal_both(layout, dtype, bs, h, d, m, nb, gen, *, prepare=lambda kv, blocks, keys: (kv, blocks, keys)):
    """Seal ``m`` random distinct blocks of hostile keys with the reference and with the
    cpu backend (on copies of one random state); assert the states equal."""
    kv, ks, kz = int4_layer(layout, nb, bs, h, d, gen)
    keys = hostile_keys(m, bs, h, d, dtype, gen)
    blocks = torch.randperm(nb, generator=gen)[:m]
    want = [kv.clone(), ks.clone(), kz.clone()]
    _ref_seal(want[0], blocks, keys, want[1], want[2], layout=layout)
    got_kv, got_blocks, got_keys = prepare(kv.clone(), blocks.clone(), keys.clone())
    got = [got_kv, ks.clone(), kz.clone()]
    cpu.seal_key_blocks(got_kv, got_blocks, got_keys, got[1], got[2], layout=layout)
    assert_same_state(got, want)
    return got, want


@pytest.fixture
def no_fallback(monkeypatch):
    """Fail if the cpu backend hands the call to the torch definition."""
    monkeypatch.setattr(ref, "seal_key_blocks", lambda *a, **k: pytest.fail("the cpu backend fell back"))


# the reference itself, taken before no_fallback replaces the module attribute
_ref_seal = ref.seal_key_blocks


@pytest.mark.parametrize("d", D_VALUES)
@pytest.mark.parametrize("dtype", MODEL, ids=name)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_sealing_equals_the_reference(layout, dtype, d):
    gen = torch.Generator().manual_seed(d)
    for bs in (1, 2, 3, 16, 32):
        seal_both(layout, dtype, bs, 3, d, 4, 7, gen)


@settings(max_examples=80, deadline=None)
@given(
    layout=st.sampled_from(LAYOUTS),
    dtype=st.sampled_from(MODEL),
    bs=st.integers(1, 32),
    h=st.integers(1, 4),
    half_d=st.integers(1, 128),
    nb=st.integers(1, 9),
    share=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**31 - 1),
)
def test_sealing_equals_the_reference_for_random_shapes(layout, dtype, bs, h, half_d, nb, share, seed):
    m = round(share * nb)
    seal_both(layout, dtype, bs, h, 2 * half_d, m, nb, torch.Generator().manual_seed(seed))


def test_the_loop_runs_without_the_reference(no_fallback):
    gen = torch.Generator().manual_seed(5)
    kv, ks, kz = int4_layer("HND", 6, 8, 2, 16, gen)
    keys = hostile_keys(3, 8, 2, 16, torch.float16, gen)
    blocks = torch.tensor([5, 0, 2])
    want = [kv.clone(), ks.clone(), kz.clone()]
    _ref_seal(want[0], blocks, keys, want[1], want[2], layout="HND")
    cpu.seal_key_blocks(kv, blocks, keys, ks, kz, layout="HND")
    assert_same_state([kv, ks, kz], want)


def test_every_fix_up_reads_back_as_the_reference_defines():
    # one block, one head, channels chosen by hand: the codes and parameters of each
    # fix-up path, checked against values worked out from pagedkv/format/quant.py's definition
    nan, inf = float("nan"), float("inf")
    cols = [
        [1.5, 1.5, 1.5, 1.5],            # all equal: s = 0 -> 1, z = 1.5, codes 0
        [0.0, nan, 1.0, 2.0],            # a NaN: z NaN, s 1, codes 0
        [0.0, 1.0, inf, 2.0],            # +inf max: s inf -> 1, codes rint(x - 0) capped at 15
        [-inf, 1.0, 0.0, 2.0],           # -inf min: z -inf, s inf -> 1, codes 0 (x + inf = inf -> 15)
        [-3e38, 3e38, 0.0, 1.0],         # max - min overflows: s -> 1
        [0.0, 15.0, 7.5, 8.5],           # s = 1 exactly: 7.5 and 8.5 round half to even
    ]
    x = torch.tensor(cols, dtype=torch.float32).t().reshape(1, 4, 1, 6)
    kv = torch.zeros(2, 2, 4, 1, 3, dtype=torch.uint8)
    ks, kz = torch.zeros(2, 1, 6, dtype=torch.bfloat16), torch.zeros(2, 1, 6, dtype=torch.bfloat16)
    cpu.seal_key_blocks(kv, torch.tensor([1]), x, ks, kz)
    codes = torch.stack([kv[1, 0, :, 0] & 15, kv[1, 0, :, 0] >> 4], dim=-1).reshape(4, 6)
    assert ks[1, 0].tolist() == [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    z = kz[1, 0].float()
    assert z[0] == 1.5 and torch.isnan(z[1]) and z[3] == -inf and z[5] == 0.0
    assert codes[:, 0].tolist() == [0, 0, 0, 0]
    assert codes[:, 1].tolist() == [0, 0, 0, 0]
    assert codes[:, 2].tolist() == [0, 1, 15, 2]
    assert codes[:, 3].tolist() == [0, 15, 15, 15]
    assert codes[:, 5].tolist() == [0, 15, 8, 8]
    assert not kv[0].any() and not kv[1, 1].any() and not ks[0].float().any() and not kz[0].float().any()


def test_no_blocks_change_nothing(no_fallback):
    gen = torch.Generator().manual_seed(1)
    kv, ks, kz = int4_layer("NHD", 4, 4, 2, 8, gen)
    before = [t.clone() for t in (kv, ks, kz)]
    cpu.seal_key_blocks(kv, torch.empty(0, dtype=torch.int64), torch.empty(0, 4, 2, 8), ks, kz)
    assert_same_state([kv, ks, kz], before)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_strided_and_misaligned_inputs_equal_the_reference(layout, no_fallback):
    gen = torch.Generator().manual_seed(7)
    nb, bs, h, d = 6, 4, 3, 20

    def strided_keys(kv, blocks, keys):
        # keys with head_dim strided (copied densely first) and every other block id
        wide = torch.empty(keys.shape + (2,), dtype=keys.dtype)
        wide[..., 0] = keys
        spread = torch.empty(2 * blocks.shape[0], dtype=torch.int64)
        spread[::2] = blocks
        return kv, spread[::2], wide[..., 0]

    def arena_of_layers(kv, blocks, keys):
        # the layer as a view of a [num_blocks, layers, ...] arena: block stride 3 layers
        arena = torch.zeros((kv.shape[0], 3) + kv.shape[1:], dtype=torch.uint8)
        arena[:, 1] = kv
        return arena[:, 1], blocks, keys

    def misaligned(kv, blocks, keys):
        # keys not 16-byte aligned, sliced along blocks and heads (strided tokens)
        big = torch.zeros((keys.shape[0], keys.shape[1], keys.shape[2] + 1, keys.shape[3]), dtype=keys.dtype)
        big[:, :, 1:] = keys
        return offset_view(kv, 1), offset_view(blocks, 1), offset_view(big, 1)[:, :, 1:]

    for dtype in MODEL:
        for prepare in (strided_keys, arena_of_layers, misaligned):
            seal_both(layout, dtype, bs, h, d, 4, nb, gen, prepare=prepare)


def test_strided_code_bytes_take_the_reference_and_still_match():
    # a layer whose code bytes are strided is not the loop's: the torch definition runs
    gen = torch.Generator().manual_seed(9)

    def strided_codes(kv, blocks, keys):
        wide = torch.zeros(kv.shape + (2,), dtype=torch.uint8)
        wide[..., 1] = kv
        return wide[..., 1], blocks, keys

    got, want = seal_both("NHD", torch.float32, 4, 2, 8, 3, 5, gen, prepare=strided_codes)
    assert got[0].stride(4) == 2


def test_a_large_call_runs_threaded_and_duplicates_seal_whole_from_their_last_row(no_fallback):
    # 64 blocks of [16, 3, 64]: far past the one-thread threshold; block 9 given three
    # times, block 2 twice: each is sealed from its last row, whole
    gen = torch.Generator().manual_seed(11)
    nb, bs, h, d = 80, 16, 3, 64
    kv, ks, kz = int4_layer("NHD", nb, bs, h, d, gen)
    keys = hostile_keys(64, bs, h, d, torch.bfloat16, gen)
    blocks = torch.randperm(nb, generator=gen)[:64]
    blocks[[3, 40, 50]] = 9
    blocks[[5, 63]] = 2
    last = {}
    for i, b in enumerate(blocks.tolist()):
        last[b] = i
    rows = torch.tensor(sorted(last.values()))
    want = [kv.clone(), ks.clone(), kz.clone()]
    _ref_seal(want[0], blocks[rows], keys[rows], want[1], want[2])
    cpu.seal_key_blocks(kv, blocks, keys, ks, kz)
    assert_same_state([kv, ks, kz], want)


# ----------------------------------------------------------------------------------
# refusals


def _bad_cases():
    gen = torch.Generator().manual_seed(2)
    nb, bs, h, d = 5, 4, 2, 8
    kv, ks, kz = int4_layer("NHD", nb, bs, h, d, gen)
    keys = hostile_keys(2, bs, h, d, torch.float32, gen)
    good = dict(kv_layer=kv, blocks=torch.tensor([1, 3]), keys=keys, key_scale=ks, key_zero=kz, layout="NHD")
    sparse = torch.tensor([1, 3]).to_sparse()
    cases = [
        ("id past the end", dict(blocks=torch.tensor([1, 5])), InvalidBlockError,
         r"^blocks: expected block ids in \[0, 5\), got 5 at row 1$"),
        ("negative id", dict(blocks=torch.tensor([-1, 3])), InvalidBlockError,
         r"^blocks: expected block ids in \[0, 5\), got -1 at row 0$"),
        ("int32 ids", dict(blocks=torch.tensor([1, 3], dtype=torch.int32)), DTypeError, r"^blocks: expected dtype int64"),
        ("2-D ids", dict(blocks=torch.tensor([[1, 3]])), ShapeError, r"^blocks: expected a 1-D tensor"),
        ("sparse ids", dict(blocks=sparse), InvalidArgumentError, r"^blocks: expected a dense \(strided\) tensor"),
        ("list ids", dict(blocks=[1, 3]), DTypeError, r"^blocks: expected a torch.Tensor"),
        ("float64 keys", dict(keys=keys.double()), DTypeError, r"^keys: expected dtype float32, float16 or bfloat16"),
        ("short keys", dict(keys=keys[:1]), ShapeError, r"^keys: expected shape \(2, 4, 2, 8\)"),
        ("wrong head_dim", dict(keys=keys[..., :6]), ShapeError, r"^keys: expected shape \(2, 4, 2, 8\)"),
        ("float key_scale", dict(key_scale=ks.float()), DTypeError, r"^key_scale: expected dtype bfloat16"),
        ("strided key_zero", dict(key_zero=torch.zeros(nb, h, 2 * d, dtype=torch.bfloat16)[..., ::2]),
         InvalidArgumentError, r"^key_zero: expected a contiguous tensor"),
        ("short key_zero", dict(key_zero=kz[:4]), ShapeError, r"^key_zero: expected shape \(5, 2, 8\)"),
        ("no key_zero", dict(key_zero=None), InvalidArgumentError, r"^key_zero: expected a tensor when the other"),
        ("int8 layer", dict(kv_layer=kv.view(torch.int8)), ShapeError, r"^kv_layer: expected an int4 \(uint8\) NHD"),
        ("4-D layer", dict(kv_layer=kv[0]), ShapeError, r"^kv_layer: expected an int4 \(uint8\) NHD"),
        ("bad layout", dict(layout="NDH"), InvalidArgumentError, r"^layout: expected 'NHD' or 'HND', got 'NDH'$"),
        ("keys on meta", dict(keys=keys.to("meta")), DeviceError, r"^keys: expected device cpu"),
    ]
    return cases, good


@pytest.mark.parametrize("case", range(len(_bad_cases()[0])), ids=[c[0] for c in _bad_cases()[0]])
def test_bad_input_is_the_references_typed_error_and_changes_nothing(case):
    cases, good = _bad_cases()
    _, change, error, message = cases[case]
    args = dict(good, **change)
    state = [good[k].clone() for k in ("kv_layer", "key_scale", "key_zero")]
    for fn in (ref.seal_key_blocks, cpu.seal_key_blocks):
        with pytest.raises(error, match=message):
            fn(args["kv_layer"], args["blocks"], args["keys"], args["key_scale"], args["key_zero"],
               layout=args["layout"])
        assert_same_state([good[k] for k in ("kv_layer", "key_scale", "key_zero")], state)


def test_block_ids_rewritten_by_another_thread_are_read_once():
    # The loop snapshots the ids before it checks them: an id flipped out of range
    # meanwhile is refused by the value the loop saw, or never seen. The layer and its
    # key parameters are views of larger buffers whose tails must stay zero.
    nb, bs, h, d = 4, 4, 2, 8
    data = torch.zeros(nb + 4, 2, bs, h, d // 2, dtype=torch.uint8)
    params = [torch.zeros(nb + 4, h, d, dtype=torch.bfloat16) for _ in range(2)]
    keys = torch.randn(2, bs, h, d, generator=torch.Generator().manual_seed(3)) + 5
    blocks = torch.tensor([0, 2])
    calls_while_flipping(blocks, 1, nb + 1, 2,
                         lambda: cpu.seal_key_blocks(data[:nb], blocks, keys, params[0][:nb], params[1][:nb]),
                         2000, InvalidBlockError, "got 5 at row 1")
    for whole in [data] + params:
        assert not bool(whole[nb:].view(torch.uint8).any())
    assert bool(data[2, 0].any()) and bool(params[0][2].float().all())   # the good calls sealed block 2


# ----------------------------------------------------------------------------------
# the baseline (non-AVX2) build


_BASELINE_SCRIPT = """
import sys
sys.path.insert(0, sys.argv[1])
import torch
from pagedkv.ops import _cpu_quant
assert _cpu_quant.ROW_ISA == "baseline", _cpu_quant.ROW_ISA
import test_seal_keys_cpu as t
n = 0
for layout in t.LAYOUTS:
    for dtype in t.MODEL:
        for d in t.D_VALUES:
            t.test_sealing_equals_the_reference(layout, dtype, d)
            n += 1
t.test_a_large_call_runs_threaded_and_duplicates_seal_whole_from_their_last_row(None)
print(n)
"""


def test_baseline_build_matches_the_reference_too():
    # This machine may pick the AVX2 build: PAGEDKV_CPU_BASELINE makes a fresh process
    # run the baseline one against the reference.
    here = os.path.dirname(os.path.abspath(__file__))
    assert run_on_baseline_build(_BASELINE_SCRIPT, here) == str(len(LAYOUTS) * len(MODEL) * len(D_VALUES))
