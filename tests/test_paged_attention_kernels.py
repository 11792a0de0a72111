"""The paged-attention kernels (cuda/paged_attention.cu) against the float64 definition.

The kernels run on the host emulation (the same .cu built with g++, the same launch
plan) and, marked ``cuda``, on a GPU. They are compared with the float64 definition:
:func:`pagedkv.ops.attention_reference.paged_attention` where it exists, else the same
definition written here (the exact float32 gather, then a masked float64 softmax).

Tolerance (per output row r, element d), stated and justified. The kernels dequantize
each element exactly as the gather does (the same common.cuh code), then work in
float32 with one rounding per operation (no FMA, u = 2^-24):
- a logit is a D-term dot product: |error| <= (D + 2) u |q| |k| sm_scale (the standard
  gamma_D bound, with sum |q_d k_d| <= |q| |k|); a rotated arena adds the rotation of
  q and the gather's unrotation of k, each log2(D) + 1 rounded steps on an orthonormal
  transform: 2 (log2 D + 1) u |q| |k| sm_scale more; the soft cap is 1-Lipschitz and
  tanhf adds a few ulp of the cap. Call the largest over the row's keys delta;
- perturbing every logit by at most delta moves each softmax weight by a factor
  within e^(+-2 delta), so the output moves by at most (e^(2 delta) - 1) max|v|;
- exp, the running sums and the weighted sum of n keys add at most (n + 8) u relative
  to max|v| per term (nonnegative weights summing to 1), and the split merge two
  more exp and three roundings;
- the result is rounded once to q's dtype: half an ulp, eps_out |o| (eps_out 2^-24,
  2^-11, 2^-8 for float32, float16, bfloat16).
The test allows twice the sum, plus 1e-30 absolute (all-zero rows).
"""
from __future__ import annotations

import math

import pytest
import torch
from backend_cases import NO_GPU, ONE_THREAD, SMALL_GRID
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv.errors import DeviceError, DTypeError, InvalidArgumentError, InvalidBlockError, ShapeError
from pagedkv.format import dtypes
from pagedkv.format.quant import quantize_key_block
from pagedkv.format.rotation import rotation_signs
from pagedkv.kernels import attention_plans, sources
from pagedkv.ops import reference as ref

try:  # the public op's float64 definition, where the CPU backend's branch has landed
    from pagedkv.ops.attention_reference import paged_attention as _defined
except ImportError:  # pragma: no cover - depends on the merge order
    _defined = None

U = 2.0 ** -24
EPS_OUT = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
MODEL = (torch.float32, torch.float16, torch.bfloat16)
QUANT = ("fp8_e4m3", "fp8_e5m2", "int8", "int4", "int3")
FORMATS = MODEL + QUANT
GROUPS = (1, 3, 8)


def _fmt_id(f) -> str:
    return str(f).replace("torch.", "")


# ----------------------------------------------------------------------------------
# backends


def _emulated():
    from pagedkv.kernels import emulation

    return emulation


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip(NO_GPU)
    from pagedkv.kernels import ops

    return ops


BACKENDS = ["emulated", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request):
    mod = _emulated() if request.param == "emulated" else _cuda()
    device = torch.device("cuda" if request.param == "cuda" else "cpu")
    return request.param, mod, device


# ----------------------------------------------------------------------------------
# inputs


class Case:
    """A layer holding every slot written (quantized, rotated, block keys as asked),
    CSR tables over shuffled blocks with one spare entry per sequence, and queries."""

    def __init__(self, fmt, layout, d, bs, hkv, group, lens, q_lens, *, q_dtype=torch.float32, rotated=False,
                 block_keys=False, seed=0, group_size=None):
        gen = torch.Generator().manual_seed(seed)
        self.fmt, self.layout, self.d = fmt, layout, d
        need = [-(-n // bs) for n in lens]
        nb = sum(need) + 3
        shape = (nb, 2, bs, hkv) if layout == "NHD" else (nb, 2, hkv, bs)
        k = torch.randn(nb * bs, hkv, d, generator=gen) * 2
        v = torch.randn(nb * bs, hkv, d, generator=gen)
        self.signs = rotation_signs(d, seed) if rotated else None
        self.kw = dict(layout=layout)
        slots = torch.arange(nb * bs)
        if fmt in MODEL:
            self.kv = torch.zeros(shape + (d,), dtype=fmt)
            ref.write_kv(self.kv, slots, k.to(fmt), v.to(fmt), layout=layout)
            self.q_dtype = fmt
        else:
            row = dtypes.lookup(fmt)
            self.kv = torch.zeros(shape + (row.stored_dim(d),), dtype=row.torch_dtype)
            groups = ()
            if row.grouped:
                g = group_size or d
                groups = (d // g,)
            scale = torch.zeros(shape + groups, dtype=row.param_dtype)
            zero = torch.zeros(shape + groups, dtype=row.param_dtype) if row.zero_point else None
            ref.write_kv(self.kv, slots, k, v, layout=layout, kv_scale=scale, kv_zero=zero,
                         rotation_signs=self.signs)
            self.kw.update(kv_scale=scale, kv_zero=zero, rotation_signs=self.signs)
            self.q_dtype = q_dtype
            if block_keys:
                codes, ks, kz = quantize_key_block(k.view(nb, bs, hkv, d))
                sealed = torch.rand(nb, hkv, generator=gen) < 0.5
                plane = self.kv[:, 0] if layout == "NHD" else self.kv[:, 0].transpose(1, 2)
                plane.copy_(torch.where(sealed[:, None, :, None], codes, plane))
                ks[..., 0] = torch.where(sealed, ks[..., 0], torch.zeros((), dtype=torch.bfloat16))
                self.kw.update(key_scale=ks, key_zero=kz)
        blocks = torch.randperm(nb, generator=gen).tolist()
        indices, indptr, at = [], [0], 0
        for n in need:
            indices += blocks[at:at + n] + [blocks[-1]]  # one spare entry: never read past the length
            at += n
            indptr.append(len(indices))
        i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
        self.indptr, self.indices, self.seq_lens = i32(indptr), i32(indices), i32(lens)
        self.q_indptr = i32([0] + list(torch.tensor(q_lens).cumsum(0).tolist()))
        self.q = (torch.randn(sum(q_lens), hkv * group, d, generator=gen)).to(self.q_dtype)

    def tables(self, device):
        return [t.to(device) for t in (self.indptr, self.indices, self.seq_lens, self.q_indptr)]

    def on(self, device):
        return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.kw.items()}


def local_reference(case: Case, *, dot_slack: int = 2, sum_slack: int = 16, affine: bool = False, **opts):
    """The float64 definition: the exact float32 gather, then a masked softmax.
    Returns (output in float64, per-row tolerance). A kernel's tolerance terms:
    ``dot_slack`` roundings per q.k beyond ``d``, ``sum_slack`` per softmax sum beyond its
    keys, and ``affine``: its codes are dequantized in the loop (scale and zero round too)."""
    kw = dict(case.kw)
    out_dtype = torch.float32 if case.fmt not in MODEL else None
    k_all, v_all = ref.gather_kv(case.kv, case.indptr, case.indices, case.seq_lens, out_dtype=out_dtype, **kw)
    k_all, v_all = k_all.double(), v_all.double()
    q = case.q.double()
    nq, hq, d = q.shape
    group = hq // k_all.shape[1]
    sm = opts.get("sm_scale") or 1.0 / math.sqrt(d)
    cap, window, sink = opts.get("soft_cap"), opts.get("window"), opts.get("sink_tokens", 0)
    res = torch.zeros(nq, hq, d, dtype=torch.float64)
    tol = torch.zeros(nq, hq, 1, dtype=torch.float64)
    lens, qp = case.seq_lens.tolist(), case.q_indptr.tolist()
    rot = 2 * (math.log2(d) + 1) if case.signs is not None else 0.0
    base = 0
    for b, n in enumerate(lens):
        k = k_all[base:base + n].repeat_interleave(group, 1).transpose(0, 1)  # [hq, n, d]
        v = v_all[base:base + n].repeat_interleave(group, 1).transpose(0, 1)
        base += n
        m = qp[b + 1] - qp[b]
        if m == 0:
            continue
        qh = q[qp[b]:qp[b + 1]].transpose(0, 1)  # [hq, m, d]
        s = qh @ k.transpose(1, 2) * sm
        if cap is not None:
            s = cap * torch.tanh(s / cap)
        p = torch.arange(n - m, n)[:, None]
        j = torch.arange(n)[None, :]
        seen = j <= p
        if window is not None:
            seen &= (j > p - window) | (j < sink)
        s = s.masked_fill(~seen, float("-inf"))
        res[qp[b]:qp[b + 1]] = (s.softmax(-1) @ v).transpose(0, 1)
        mag = k.norm(dim=-1)[:, None, :]
        if affine:
            mag = mag + 3 * math.sqrt(d) * k.abs().amax(-1)[:, None, :]
        qk = qh.norm(dim=-1)[:, :, None] * mag * abs(sm)  # [hq, m, n]
        delta = ((d + dot_slack + rot) * U * qk.masked_fill(~seen, 0)).amax(-1) + (8 * U * cap if cap else 0.0)
        vmax = v.abs().amax(dim=(1, 2))[:, None] * (3 if affine else 1)  # [hq, 1]
        keys = seen.sum(-1)[None, :].double()
        row = (torch.expm1(2 * delta) + (keys + sum_slack) * U) * vmax
        tol[qp[b]:qp[b + 1]] = row.transpose(0, 1)[:, :, None]
    return res, tol


def check(case: Case, got: torch.Tensor, **opts) -> None:
    want, tol = local_reference(case, **opts)
    if _defined is not None:  # the public definition agrees with this one (both float64)
        d = _defined(case.q, case.kv, case.indptr, case.indices, case.seq_lens, case.q_indptr, **case.kw,
                     **{k: v for k, v in opts.items() if k != "num_splits"})
        assert torch.allclose(d.double(), want.to(d.dtype).double(), rtol=2 * EPS_OUT[d.dtype], atol=1e-12)
    got = got.cpu()
    assert got.dtype == case.q_dtype and got.shape == case.q.shape
    bound = 2 * (tol + EPS_OUT[got.dtype] * want.abs()) + 1e-30
    err = (got.double() - want).abs()
    bad = err > bound
    assert not bool(bad.any()), (f"{int(bad.sum())} of {bad.numel()} elements off; worst err {float(err.max()):.3g}, "
                                 f"bound there {float(bound.flatten()[int((err - bound).argmax())]):.3g}")


def run(backend, case: Case, dims=None, **opts):
    _, mod, device = backend
    extra = dict(dims or {}) if backend[0] == "emulated" else {}
    out = mod.paged_attention(case.q.to(device), case.kv.to(device), *case.tables(device), **case.on(device),
                              **opts, **extra)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out


# ----------------------------------------------------------------------------------
# every format, decode and prefill


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("fmt", FORMATS, ids=_fmt_id)
def test_every_format_decode_and_prefill_match_the_definition(backend, fmt, layout):
    for q_lens, group in (([1, 1, 1], 3), ([1, 4, 13], 8)):  # decode (3 queries, 3 sequences), then prefill
        case = Case(fmt, layout, 16 if fmt == "int3" else 12, 5, 2, group, [1, 23, 41], q_lens, seed=len(q_lens))
        check(case, run(backend, case))


@pytest.mark.parametrize("q_dtype", MODEL, ids=_fmt_id)
@pytest.mark.parametrize("fmt", QUANT, ids=_fmt_id)
def test_rotated_arenas_rotate_the_query_and_unrotate_the_output(backend, fmt, q_dtype):
    case = Case(fmt, "NHD", 24, 7, 1, 3, [50, 9], [1, 9], q_dtype=q_dtype, rotated=True, seed=3)
    check(case, run(backend, case))
    check(case, run(backend, case, num_splits=3), num_splits=3)


@pytest.mark.parametrize("rotated", [False, True])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_int4_block_keys_are_scored_unrotated(backend, layout, rotated):
    case = Case("int4", layout, 16, 4, 2, 3, [37, 5, 16], [1, 2, 16], rotated=rotated, block_keys=True,
                seed=5, group_size=8)
    check(case, run(backend, case))


def test_windows_sinks_and_soft_cap(backend):
    case = Case(torch.float32, "NHD", 32, 8, 2, 3, [200, 64, 9], [1, 20, 9], seed=9)
    for opts in (dict(window=16), dict(window=16, sink_tokens=4), dict(window=1, sink_tokens=100),
                 dict(soft_cap=5.0, sm_scale=0.7), dict(window=40, sink_tokens=3, soft_cap=2.0, num_splits=4)):
        check(case, run(backend, case, **opts), **opts)


def test_split_k_merges_exactly(backend):
    """Every split count gives the definition; and flash-decoding is really taken: the
    plan launches the merge kernel after the splits."""
    case = Case("int8", "HND", 64, 16, 2, 8, [1000, 333], [1, 1], seed=11)
    for kernel in ("tiled", "decode"):  # paged_attention.cu, and decode_attention.cu (the default here)
        for splits in (1, 2, 5, 16, 100):  # 100: more splits than key tiles, most of them empty
            check(case, run(backend, case, num_splits=splits, kernel=kernel))
    launches, _ = attention_plans.plan_paged_attention(case.q, case.kv, *case.tables("cpu"), **case.kw,
                                                       num_splits=5, kernel="tiled")
    assert [ln.kernel for ln in launches] == [sources.attention_name("decode", "hnd", "int8", "f32"),
                                              sources.attention_merge_name("f32")]
    assert launches[0].grid[0] == 5
    launches, _ = attention_plans.plan_paged_attention(case.q, case.kv, *case.tables("cpu"), **case.kw,
                                                       num_splits=5)
    assert [ln.kernel for ln in launches] == [sources.decode_name("hnd", "int8", 64, 8, 1),
                                              sources.decode_merge_name("f32")]
    assert launches[0].grid[0] == 5


def test_auto_splits_follow_the_length_and_the_sm_count():
    assert attention_plans.auto_splits(works=16, avg_keys=4096, num_sms=132) == 16
    assert attention_plans.auto_splits(works=16, avg_keys=300, num_sms=132) == 1
    assert attention_plans.auto_splits(works=10_000, avg_keys=4096, num_sms=132) == 1


def test_long_sequence_with_partial_blocks(backend):
    case = Case(torch.bfloat16, "NHD", 64, 16, 1, 8, [3001, 17], [1, 1], seed=13)
    check(case, run(backend, case))  # auto splits


@pytest.mark.parametrize("dims", [SMALL_GRID, ONE_THREAD, dict(grid=(2, 1, 1), block=(3, 1, 1))],
                         ids=["small", "one-thread", "odd-block"])
def test_grid_stride_loops_with_fewer_threads_than_work(dims):
    mod = _emulated()
    backend = ("emulated", mod, torch.device("cpu"))
    for case in (Case("int4", "NHD", 10, 3, 2, 3, [19, 4], [3, 4], rotated=True, seed=17, group_size=5),
                 Case(torch.float16, "HND", 8, 2, 1, 8, [9, 30], [1, 1], seed=19)):
        for splits in (1, 3):
            check(case, run(backend, case, dims, num_splits=splits))


def test_tiling_fits_the_shared_buffers():
    for decode in (True, False):
        for group in (1, 3, 8, 64, 200):
            for d in (1, 7, 64, 128, 256, 1000):
                for rotated in (False, True):
                    t = attention_plans.tiling(decode, group, d, rotated)
                    assert attention_plans._fits(t.heads_per_cta * t.q_tile, t.kv_tile, d, rotated)
                    if decode:
                        assert t.q_tile == 1
    assert attention_plans.tiling(True, 8, 128, True).heads_per_cta == 8  # a GQA group in one pass


# ----------------------------------------------------------------------------------
# hypothesis-drawn shapes


@st.composite
def cases(draw):
    fmt = draw(st.sampled_from(FORMATS))
    pack = 8 if fmt == "int3" else (2 if fmt == "int4" else 1)
    d = draw(st.sampled_from([64, 128, 8, 24, 40, 72] if pack == 8 else [64, 128, 2, 6, 18, 38] if pack == 2
                             else [64, 128, 1, 5, 17, 33]))
    bs = draw(st.integers(1, 64))
    group = draw(st.sampled_from(GROUPS))
    hkv = draw(st.integers(1, 2))
    batch = draw(st.integers(1, 3))
    long = draw(st.booleans())
    lens = draw(st.lists(st.integers(1, 3000 if long else 200), min_size=batch, max_size=batch))
    prefill = draw(st.booleans())
    q_lens = [draw(st.integers(0 if prefill else 1, min(n, 24 if prefill else 1))) for n in lens]
    rotated = fmt in QUANT and draw(st.booleans())
    block_keys = fmt == "int4" and draw(st.booleans())
    q_dtype = draw(st.sampled_from(MODEL))
    group_size = None
    if fmt in ("int4", "int3"):
        step = pack if fmt == "int3" else 1
        legal = [g for g in range(step, d + 1, step) if d % g == 0]
        group_size = draw(st.sampled_from(legal))
    opts = {}
    if draw(st.booleans()):
        opts["window"] = draw(st.integers(1, 300))
        opts["sink_tokens"] = draw(st.integers(0, 8))
    if draw(st.booleans()):
        opts["soft_cap"] = draw(st.floats(0.5, 50.0))
    if draw(st.booleans()):
        opts["num_splits"] = draw(st.integers(1, 8))
    layout = draw(st.sampled_from(["NHD", "HND"]))
    seed = draw(st.integers(0, 2**16))
    case = Case(fmt, layout, d, bs, hkv, group, lens, q_lens, q_dtype=q_dtype, rotated=rotated,
                block_keys=block_keys, seed=seed, group_size=group_size)
    return case, opts


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(drawn=cases())
def test_hypothesis_shapes_match_the_definition(drawn):
    case, opts = drawn
    backend = ("emulated", _emulated(), torch.device("cpu"))
    check(case, run(backend, case, **opts), **opts)


# ----------------------------------------------------------------------------------
# errors


def _small():
    return Case("int8", "NHD", 8, 4, 2, 3, [5, 9], [1, 2], seed=1)


@pytest.mark.parametrize("change, err, match", [
    (dict(q=torch.zeros(3, 6, 8, dtype=torch.float64)), DTypeError, r"q: expected dtype float32, float16 or bfloat16"),
    (dict(q=torch.zeros(3, 5, 8)), ShapeError, r"q: expected num_q_heads a positive multiple of 2"),
    (dict(q=torch.zeros(3, 6, 4)), ShapeError, r"q: expected \[num_q_tokens, num_q_heads, 8\], got \(3, 6, 4\)"),
    (dict(q_indptr=torch.tensor([0, 1], dtype=torch.int32)), ShapeError, r"q_indptr: expected \[3\] \(len\(indptr\)\)"),
    (dict(q_indptr=torch.tensor([0, 1, 2], dtype=torch.int32)), InvalidArgumentError,
     r"q_indptr: expected offsets from 0 to 3 \(num_q_tokens\), got \[0, ..., 2\]"),
    (dict(q_indptr=torch.tensor([0, 3, 3], dtype=torch.int32), seq_lens=torch.tensor([2, 9], dtype=torch.int32)),
     InvalidArgumentError, r"q_indptr: expected 0 <= q_indptr\[1\] - q_indptr\[0\] <= seq_lens\[0\] = 2"),
    (dict(q_indptr=torch.tensor([0, 1, 3], dtype=torch.int64)), DTypeError, r"q_indptr: expected dtype int32"),
    (dict(seq_lens=torch.tensor([5, 17], dtype=torch.int32)), InvalidArgumentError,
     r"seq_lens: expected 0 <= seq_lens\[1\] <= 16 \(4 blocks\), got 17"),
    (dict(window=0), InvalidArgumentError, r"window: expected None or an int >= 1, got 0"),
    (dict(sink_tokens=-1), InvalidArgumentError, r"sink_tokens: expected an int >= 0, got -1"),
    (dict(soft_cap=0.0), InvalidArgumentError, r"soft_cap: expected None or a float > 0, got 0.0"),
    (dict(sm_scale=float("nan")), InvalidArgumentError, r"sm_scale: expected None or a finite float, got nan"),
    (dict(num_splits=0), InvalidArgumentError, r"num_splits: expected None or an int >= 1, got 0"),
    (dict(out=torch.zeros(3, 6, 8, dtype=torch.float16)), ShapeError, r"out: expected torch.float32 \(3, 6, 8\)"),
    (dict(out=torch.zeros(6, 3, 8).transpose(0, 1)), InvalidArgumentError, r"out: expected a contiguous tensor"),
    (dict(rotation_signs=torch.ones(4)), ShapeError, r"rotation_signs: expected shape \(8,\) \(head_dim\)"),
    (dict(key_scale=torch.zeros(1, 2, 8, dtype=torch.bfloat16), key_zero=torch.zeros(1, 2, 8, dtype=torch.bfloat16)),
     InvalidArgumentError, r"key_scale: expected None unless the kv_layer is int4"),
    (dict(exact_rows=object()), InvalidArgumentError, r"exact_rows: expected None for the CUDA kernels"),
    (dict(layout="XYZ"), InvalidArgumentError, r"layout: expected 'NHD' or 'HND', got 'XYZ'"),
])
def test_bad_arguments_are_typed_errors_that_write_nothing(change, err, match):
    case = _small()
    args = dict(q=case.q, q_indptr=case.q_indptr, seq_lens=case.seq_lens)
    kw = dict(case.kw)
    for k, v in change.items():
        (args if k in args else kw)[k] = v
    out = kw.get("out")
    before = None if out is None else out.clone()
    with pytest.raises(err, match=match):
        _emulated().paged_attention(args["q"], case.kv, case.indptr, case.indices, args["seq_lens"],
                                    args["q_indptr"], **kw)
    if out is not None:
        assert torch.equal(out, before)


def test_model_dtype_arena_needs_queries_of_its_dtype():
    case = Case(torch.float16, "NHD", 8, 4, 1, 1, [5], [1], seed=2)
    with pytest.raises(DTypeError, match=r"q: expected dtype torch.float16 \(the kv_layer dtype\), got torch.float32"):
        _emulated().paged_attention(case.q.float(), case.kv, *case.tables("cpu"), **case.kw)


def test_a_bad_block_id_is_refused_on_the_cpu():
    case = _small()
    indices = case.indices.clone()
    indices[0] = 10_000
    with pytest.raises(InvalidBlockError, match=r"indices: expected block ids in \[0, 8\), got 10000 at sequence 0, block 0"):
        _emulated().paged_attention(case.q, case.kv, case.indptr, indices, case.seq_lens, case.q_indptr, **case.kw)


def test_the_emulation_refuses_tensors_off_the_cpu():
    case = _small()
    with pytest.raises(DeviceError, match=r"kv_layer: expected a CPU tensor \(the emulation runs on the host\)"):
        _emulated().paged_attention(case.q, case.kv.to("meta"), *case.tables("cpu"))


def test_empty_query_batch_returns_an_empty_output():
    case = Case(torch.float32, "NHD", 8, 4, 1, 1, [5, 3], [0, 0], seed=4)
    out = _emulated().paged_attention(case.q, case.kv, *case.tables("cpu"))
    assert out.shape == (0, 1, 8)


def test_a_sequence_without_queries_leaves_the_others_right(backend):
    case = Case("fp8_e4m3", "NHD", 16, 4, 1, 3, [7, 30, 12], [2, 0, 5], seed=21)
    check(case, run(backend, case))


# ----------------------------------------------------------------------------------
# NVRTC: every variant compiles (test_kernels_compile.py, for sm_80/89/90); here the
# kernels take exactly the arguments the plan passes


def test_ptx_kernels_take_the_planned_arguments():
    pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-python (NVRTC) is not installed")
    import re

    from pagedkv.kernels import build
    from pagedkv.kernels.options import CompileOptions

    ptx = build.build("paged_attention.cu", CompileOptions(arch="sm_90")).data.decode(errors="replace")
    names = set(re.findall(r"\.entry\s+(\w+)", ptx))
    assert names == set(sources.entry_points()["paged_attention.cu"])

    def params(kernel):
        body = ptx[ptx.index(f".entry {kernel}("):]
        return body[: body.index(")")].count(".param")

    case = Case("int4", "NHD", 16, 4, 1, 3, [30], [1], q_dtype=torch.float16, rotated=True, seed=1, group_size=8)
    launches, _ = attention_plans.plan_paged_attention(case.q, case.kv, *case.tables("cpu"), **case.kw,
                                                       num_splits=2)
    assert len(launches) == 2
    for ln in launches:
        assert params(ln.kernel) == len(ln.args), ln.kernel
