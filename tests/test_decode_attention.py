"""The decode kernel (cuda/decode_attention.cu) against the float64 definition and the
tiled kernel, in the host emulation (fibers: emulate_fibers.h) and, marked ``cuda``, on a
GPU, where it must equal the emulation bit for bit.

Tolerance (per output row), as test_paged_attention_kernels.py states it for the tiled
kernel, with what the decode kernel does differently: it scores the codes of the
asymmetric formats with the scale and zero point factored out of the dot product,
s * sum(q c) + z * sum(q), whose rounding is bounded by the magnitudes of s c and z
(each at most 2 max|k| of the row's group, so 3 sqrt(D) max|k| |q| for the row), and
weighs values the same way (3 max|v|); its exp2 and tanh are polynomials within a few
ulp; FMAs round once where the tiled kernel rounds twice. So a logit may be off by
delta = (D + 8 + rot) u sm (|q| |k| + [affine] 3 sqrt(D) |q| max|k|) (+ 8 u cap), and
the row by (e^(2 delta) - 1 + (n + 32) u) max|v| ([affine] x3), plus the output
rounding; the test allows twice that, as the tiled kernel's test does.
"""
from __future__ import annotations

import math
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from backend_cases import NO_GPU
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_paged_attention_kernels import EPS_OUT, MODEL, QUANT, Case, local_reference

from pagedkv.errors import InvalidArgumentError, ShapeError
from pagedkv.kernels import attention_plans, decode_plans
from pagedkv.kernels import emulation as emu

pytestmark = pytest.mark.skipif(shutil.which(emu.CXX) is None, reason=f"the host emulation needs {emu.CXX}")

AFFINE = ("int8", "int4", "int3")
# (format, head_dim, GQA group, layout, scale group length): the variants the tests run
PER_FORMAT = [(f, 128, 4, "NHD", 32) for f in MODEL + QUANT] + [(f, 64, 3, "HND", 16) for f in MODEL + QUANT]
POOL = [(torch.float32, 64, 3, "NHD", None), (torch.float16, 128, 4, "HND", None), (torch.bfloat16, 64, 8, "NHD", None),
        ("fp8_e4m3", 128, 1, "HND", None), ("fp8_e5m2", 64, 2, "NHD", None), ("int8", 128, 3, "NHD", None),
        ("int4", 128, 4, "HND", 32), ("int4", 64, 1, "NHD", 8), ("int3", 64, 2, "NHD", 16),
        ("int3", 128, 1, "HND", 32)]


def _fmt_id(f) -> str:
    return str(f).replace("torch.", "")


def make(fmt, d, group, layout, g_len, lens, *, rotated=False, q_dtype=torch.float32, seed=0, hkv=2, bs=16):
    grouped = fmt in ("int4", "int3")
    return Case(fmt, layout, d, bs, hkv, group, lens, [1] * len(lens), q_dtype=q_dtype,
                rotated=rotated and fmt in QUANT, seed=seed, group_size=g_len if grouped else None)


def plan(case, **opts):
    return attention_plans.plan_paged_attention(case.q, case.kv, *case.tables("cpu"), **case.kw, **opts)[0]


@pytest.fixture(scope="module", autouse=True)
def prebuilt():
    """Compile the emulated variants the module runs, two at a time (g++ in parallel)."""
    defines = set()
    for fmt, d, group, layout, g_len in PER_FORMAT + POOL:
        launches = plan(make(fmt, d, group, layout, g_len, [20]))
        assert launches[0].source == "decode_attention.cu", launches[0].kernel
        defines.add(launches[0].defines)
    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(lambda df: emu.variant_library("decode_attention.cu", df), sorted(defines)))


def decode_reference(case: Case, **opts):
    """The float64 definition and the decode kernel's per-row tolerance (module docstring):
    its dots round a few more times, and quantized codes are dequantized in its loop."""
    return local_reference(case, dot_slack=8, sum_slack=32, affine=case.fmt in AFFINE, **opts)


def check(case: Case, got: torch.Tensor, **opts) -> torch.Tensor:
    want, tol = decode_reference(case, **opts)
    got = got.cpu()
    assert got.dtype == case.q_dtype and got.shape == case.q.shape
    bound = 2 * (tol + EPS_OUT[got.dtype] * want.abs()) + 1e-30
    err = (got.double() - want).abs()
    bad = err > bound
    assert not bool(bad.any()), (f"{int(bad.sum())} of {bad.numel()} elements off; worst err {float(err.max()):.3g}, "
                                 f"bound there {float(bound.flatten()[int((err - bound).argmax())]):.3g}")
    return bound


def run(case: Case, **opts):
    return emu.paged_attention(case.q, case.kv, *case.tables("cpu"), **case.kw, **opts)


def check_both(case: Case, **opts) -> None:
    """The decode kernel meets the definition, and so differs from the tiled kernel by no
    more than the two bounds together (the tiled kernel's own within its test's)."""
    fast = run(case, kernel="decode", **opts)
    bound = check(case, fast, **opts)
    tiled = run(case, kernel="tiled", **opts)
    assert torch.all((fast.double() - tiled.double()).abs() <= 2 * bound)


# ----------------------------------------------------------------------------------
# every format, every query dtype, rotation, windows, splits


@pytest.mark.parametrize("fmt, d, group, layout, g_len", PER_FORMAT,
                         ids=[f"{_fmt_id(p[0])}-d{p[1]}-g{p[2]}-{p[3]}" for p in PER_FORMAT])
def test_every_format_matches_the_definition_and_the_tiled_kernel(fmt, d, group, layout, g_len):
    case = make(fmt, d, group, layout, g_len, [1, 37, 300], rotated=True, seed=d + group)
    assert plan(case)[0].kernel.startswith("pkv_decode_")
    check_both(case)
    if fmt in QUANT:  # the query dtypes of a quantized arena
        for q_dtype in (torch.float16, torch.bfloat16):
            check_both(make(fmt, d, group, layout, g_len, [50, 9], q_dtype=q_dtype, seed=1))


def test_windows_sinks_soft_cap_and_splits():
    case = make(torch.float32, 64, 3, "NHD", None, [200, 64, 9, 1000], seed=9)
    for opts in (dict(window=16), dict(window=16, sink_tokens=4), dict(window=1, sink_tokens=100),
                 dict(soft_cap=5.0, sm_scale=0.7), dict(window=40, sink_tokens=3, soft_cap=2.0, num_splits=4),
                 dict(num_splits=1), dict(num_splits=7), dict(num_splits=300)):
        check_both(case, **opts)


def test_several_queries_of_one_sequence_and_strided_queries():
    """One query per sequence on average is enough: each query token is its own work item,
    causal at its own position; q may be a strided view (a slice of a fused qkv)."""
    case = Case(torch.float32, "NHD", 64, 16, 2, 3, [40, 9, 70], [2, 0, 1], seed=12)
    assert plan(case)[0].kernel.startswith("pkv_decode_")
    check_both(case)
    wide = torch.randn(case.q.shape[0], case.q.shape[1], 3 * 64)
    wide[:, :, 64:128] = case.q
    case.q = wide[:, :, 64:128]
    assert not case.q.is_contiguous()
    check_both(case)


def test_more_block_table_entries_than_a_cta_stages_at_once():
    """Past PKV_DEC_PAGES entries a split restages its block ids (block size 1: 600 entries)."""
    case = make("int8", 128, 3, "NHD", None, [1300, 600], seed=4, hkv=1, bs=1)
    check_both(case, num_splits=1)
    check_both(case, num_splits=1, window=700, sink_tokens=5)


def test_block_keys_prefill_and_other_head_dims_take_the_tiled_kernel():
    bk = Case("int4", "NHD", 64, 16, 2, 3, [40, 9], [1, 1], block_keys=True, seed=5, group_size=32)
    prefill = Case("int8", "NHD", 64, 16, 2, 3, [40, 9], [3, 1], seed=5)
    odd = Case("int8", "NHD", 96, 16, 2, 3, [40, 9], [1, 1], seed=5)
    for case in (bk, prefill, odd):
        assert plan(case)[0].kernel.startswith("pkv_attn_")
        with pytest.raises(InvalidArgumentError, match=r"kernel: expected 'auto' or 'tiled' for this call"):
            plan(case, kernel="decode")


@st.composite
def drawn(draw):
    fmt, d, group, layout, g_len = draw(st.sampled_from(POOL))
    batch = draw(st.integers(1, 3))
    long = draw(st.booleans())
    lens = draw(st.lists(st.integers(1, 3000 if long else 200), min_size=batch, max_size=batch))
    case = make(fmt, d, group, layout, g_len, lens, rotated=draw(st.booleans()),
                q_dtype=draw(st.sampled_from(MODEL)) if fmt in QUANT else torch.float32,
                seed=draw(st.integers(0, 2**16)), hkv=draw(st.integers(1, 2)), bs=draw(st.integers(1, 64)))
    opts = {}
    if draw(st.booleans()):
        opts["window"] = draw(st.integers(1, 300))
        opts["sink_tokens"] = draw(st.integers(0, 8))
    if draw(st.booleans()):
        opts["soft_cap"] = draw(st.floats(0.5, 50.0))
    if draw(st.booleans()):
        opts["num_splits"] = draw(st.integers(1, 8))
    return case, opts


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(drawn=drawn())
def test_hypothesis_shapes_match_the_definition_and_the_tiled_kernel(drawn):
    case, opts = drawn
    check_both(case, **opts)


# ----------------------------------------------------------------------------------
# the plan


def test_variants_cover_the_common_shapes():
    v = decode_plans.decode_variant
    assert v("f16", 128, 4) == (("f16", 128, 4, 1))
    assert v("f16", 128, 4).vector_bytes == 16  # 16-byte lanes for a GQA group of 4
    assert v("f32", 64, 3).vector_bytes == 16
    assert v("int8", 128, 1).vector_bytes == 16
    assert v("int4", 128, 1, 4).vector_bytes == 16 and v("int4", 128, 1, 4).lane_groups == 1
    assert v("int4", 128, 1, 16).lane_groups == 4  # groups of 8: four per 32-code lane
    assert v("int3", 128, 8, 4) == ("int3", 128, 1, 1)  # int3 lanes hold 32 codes: one head a CTA
    assert v("f32", 256, 1) is None  # 64 float32 lanes a key: more than a warp
    assert v("f16", 96, 4) is None and v("int4", 128, 1, 128 // 12) is None


def test_splits_fill_whole_waves():
    # 8 x 8 work items on 132 SMs (396 CTA slots): 6 splits fill 384 of them
    assert decode_plans.auto_splits(64, 4096, 132) == 6
    assert decode_plans.auto_splits(64, 300, 132) == 1  # one split per 256 keys at most
    fill = lambda w, s: w * s / (math.ceil(w * s / 396) * 396)  # noqa: E731
    for works in (1, 7, 64, 500):
        s = decode_plans.auto_splits(works, 1 << 20, 132)
        assert all(fill(works, s) >= fill(works, t) - 1e-9 for t in range(1, decode_plans.MAX_SPLITS + 1))


def test_fastdiv_divides_like_integers():
    for d in (1, 2, 3, 5, 16, 17, 1000, 2**31 - 1):
        mul, shift = decode_plans.fastdiv(d)
        for n in (0, 1, d - 1, d, d + 1, 12345, 2**31 - 1):
            assert (n if shift < 0 else ((n * mul) >> 32) >> shift) == n // d


def test_a_caller_workspace_is_used_and_checked():
    case = make("int8", 64, 3, "NHD", None, [100, 7], seed=2)
    need = decode_plans.workspace_floats(3, 2, 6, 64)
    ws = torch.full((need,), float("nan"))
    launches = plan(case, num_splits=3, workspace=ws)
    assert launches[0].args[6] == ("ptr", ws.data_ptr()) and launches[1].args[0] == ("ptr", ws.data_ptr())
    check(case, run(case, num_splits=3, workspace=ws))
    with pytest.raises(ShapeError, match=rf"workspace: expected at least {need} float32 elements"):
        plan(case, num_splits=3, workspace=torch.zeros(need - 1))
    with pytest.raises(InvalidArgumentError, match=r"workspace: expected a contiguous float32 tensor on cpu"):
        plan(case, num_splits=3, workspace=torch.zeros(need, dtype=torch.float64))
    with pytest.raises(InvalidArgumentError, match=r"kernel: expected 'auto', 'decode' or 'tiled', got 'fast'"):
        plan(case, kernel="fast")


# ----------------------------------------------------------------------------------
# on a GPU: bit for bit the emulation; a CUDA graph captures the call


def _gpu():
    if not torch.cuda.is_available():
        pytest.skip(NO_GPU)
    from pagedkv.kernels import ops

    return ops


@pytest.mark.cuda
@pytest.mark.parametrize("fmt, d, group, layout, g_len", POOL, ids=[f"{_fmt_id(p[0])}-d{p[1]}" for p in POOL])
def test_gpu_equals_the_emulation_bit_for_bit(fmt, d, group, layout, g_len):
    ops = _gpu()
    for opts in (dict(num_splits=3), dict(window=50, sink_tokens=4, soft_cap=8.0)):
        case = make(fmt, d, group, layout, g_len, [700, 33, 1], rotated=True, seed=7,
                    q_dtype=torch.bfloat16 if fmt in QUANT else torch.float32)
        want = run(case, kernel="decode", num_sms=torch.cuda.get_device_properties(0).multi_processor_count, **opts)
        got = ops.paged_attention(case.q.cuda(), case.kv.cuda(), *case.tables("cuda"), **case.on("cuda"),
                                  kernel="decode", **opts)
        torch.cuda.synchronize()
        assert torch.equal(got.cpu().view(torch.int16 if got.element_size() == 2 else torch.int32),
                           want.view(torch.int16 if want.element_size() == 2 else torch.int32))


@pytest.mark.cuda
def test_decode_is_captured_by_a_cuda_graph():
    ops = _gpu()
    case = make("int4", 128, 4, "NHD", 32, [900, 300], seed=3)
    q, kv = case.q.cuda(), case.kv.cuda()
    tables, kw = case.tables("cuda"), case.on("cuda")
    out = torch.empty_like(q)
    ws = torch.empty(decode_plans.workspace_floats(4, 2, 8, 128), device="cuda")
    ops.paged_attention(q, kv, *tables, **kw, out=out, num_splits=4, workspace=ws)  # compile and load first
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.paged_attention(q, kv, *tables, **kw, out=out, num_splits=4, workspace=ws)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    check(case, out)
