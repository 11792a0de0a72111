"""MLA latent rows: the format's layout and formulas, and the ops on every backend.

The CPU ops and the CUDA kernels (run on the host emulation: the same .cu built with
g++, the same launch plan) are checked against the definition
(:mod:`pagedkv.ops.latent_reference`): writes byte for byte (the arena after a write),
gathers element for element, attention against float64 within a stated bound.

Attention bound (per output element), as tests/test_paged_attention_kernels.py states
it: each logit is a W-term float32 dot product of exactly decoded values (W = R + P),
so |error| <= (W + 2) u |q| |k| sm_scale =: delta (u = 2^-24, any summation order);
perturbing every logit by delta moves each softmax weight by a factor within
e^(+-2 delta), so the output by (e^(2 delta) - 1) max|v|; exp, the running sums and
the n-term weighted sum add (n + 8) u max|v|, the split merge two exp and three
roundings more; the result is rounded once to q's dtype (eps_out |o|). Twice the sum
is allowed, plus 1e-30.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from backend_cases import ONE_THREAD, SMALL_GRID
from pagedkv.errors import DeviceError, DTypeError, InvalidArgumentError, InvalidBlockError, ShapeError
from pagedkv.format.latent import LatentFormat
from pagedkv.kernels import emulation, latent_plans
from pagedkv.ops import gather_latent, mla_attention, write_latent
from pagedkv.ops import latent_reference as ref
from pagedkv.ops.views import LatentView

U = 2.0 ** -24
EPS_OUT = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
MODEL = ("float32", "float16", "bfloat16")
TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# (kv_dtype, model dtype): every row format the kernels have
FORMATS = [(m, m) for m in MODEL] + [("fp8_e4m3", m) for m in MODEL] + \
          [(q, m) for q in ("int8", "int4") for m in MODEL]
R, P, NB, BS = 256, 32, 7, 5     # odd block geometry: partial blocks everywhere


def fid(case) -> str:
    return "-".join(str(x) for x in case)


# ---- the format ------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_dtype, model, group, want", [
    ("bfloat16", "bfloat16", None, 1152),     # (512 + 64) * 2
    ("float16", "float16", None, 1152),
    ("float32", "float32", None, 2304),
    ("fp8_e4m3", "bfloat16", None, 656),      # 512 + 4 * 4 + 64 * 2: vLLM's fp8_ds_mla
    ("fp8_e4m3", "float32", None, 656),       # the positional slice stays bfloat16 in that layout
    ("int8", "bfloat16", None, 648),          # 512 + 8 * 1 + 64 * 2
    ("int8", "float32", 128, 512 + 8 * 4 + 64 * 4),
    ("int4", "bfloat16", None, 448),          # 256 + 8 * 8 + 64 * 2
    ("int4", "float16", 32, 256 + 8 * 16 + 128),
])
def test_bytes_per_token_per_layer_are_the_formulas(kv_dtype, model, group, want):
    f = LatentFormat(kv_dtype, model, 512, 64, group)
    assert f.row_bytes == want
    assert f.rope_offset + 64 * (2 if f.rope_dtype != "float32" else 4) == want if f.quantized else True


@pytest.mark.parametrize("kwargs, err, match", [
    (dict(kv_dtype="fp8_e4m3", kv_lora_rank=200), InvalidArgumentError,
     r"kv_lora_rank: expected a multiple of 128 for fp8_e4m3 latent rows \(one scale per 128 elements\), got 200"),
    (dict(kv_dtype="fp8_e5m2"), InvalidArgumentError, r"kv_dtype: expected one of float32, float16, bfloat16, "
                                                       r"fp8_e4m3, int8, int4 for MLA latent KV, got 'fp8_e5m2'"),
    (dict(kv_dtype="int3"), InvalidArgumentError, r"got 'int3'"),
    (dict(kv_dtype="int8", rope_dim=63), InvalidArgumentError,
     r"qk_rope_head_dim: expected an even size for int8 latent rows \(rows stay 4-byte aligned\), got 63"),
    (dict(kv_dtype="int4", group_size=3), InvalidArgumentError,
     r"kv_group_size: expected an int >= 1 that divides kv_lora_rank \(512\), got 3"),
    (dict(kv_dtype="bfloat16", group_size=64), InvalidArgumentError,
     r"kv_group_size: expected None for bfloat16 latent rows, got 64"),
    (dict(kv_lora_rank=0), InvalidArgumentError, r"kv_lora_rank: expected an int >= 1, got 0"),
])
def test_a_format_latent_rows_cannot_take_is_a_typed_error(kwargs, err, match):
    args = dict(kv_dtype="bfloat16", model_dtype="bfloat16", kv_lora_rank=512, rope_dim=64)
    args.update(kwargs)
    with pytest.raises(err, match=match):
        LatentFormat(**args)


def test_the_fp8_row_is_vllms_layout_byte_for_byte():
    f = LatentFormat("fp8_e4m3", "bfloat16", 256, 64)
    torch.manual_seed(0)
    c = torch.randn(3, 256, dtype=torch.bfloat16) * 3
    pe = torch.randn(3, 64, dtype=torch.bfloat16)
    row = f.encode(c, pe)
    assert row.shape == (3, 256 + 2 * 4 + 128) and row.dtype == torch.uint8
    tiles = c.float().view(3, 2, 128)
    scale = tiles.abs().amax(-1) / 448.0
    codes = (tiles / scale[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(3, 256)
    assert torch.equal(row[:, :256], codes.view(torch.uint8))
    assert torch.equal(row[:, 256:264].contiguous().view(torch.float32), scale)
    assert torch.equal(row[:, 264:].contiguous().view(torch.bfloat16), pe)
    kv, rope = f.decode(row)
    assert torch.equal(rope, pe)
    assert torch.allclose(kv.float(), c.float(), rtol=2 ** -3, atol=1e-6)


@pytest.mark.parametrize("case", FORMATS, ids=fid)
def test_decode_inverts_encode_within_the_format(case):
    kv_dtype, model = case
    f = LatentFormat(kv_dtype, model, R, P)
    torch.manual_seed(1)
    c = torch.randn(9, R, dtype=TORCH[model])
    pe = torch.randn(9, P, dtype=TORCH[model])
    kv, rope = f.decode(f.encode(c, pe))
    assert kv.dtype == TORCH[model] and rope.dtype == TORCH[model]
    if not f.quantized:
        assert torch.equal(kv, c) and torch.equal(rope, pe)
        return
    # the positional slice is never quantized: exact in the model dtype (fp8: bfloat16)
    assert torch.equal(rope, pe.to(torch.bfloat16).to(TORCH[model]) if kv_dtype == "fp8_e4m3" else pe)
    span = {"fp8_e4m3": 2 ** -3, "int8": 1 / 255, "int4": 1 / 15}[kv_dtype]
    g = c.float().view(9, -1, f.group_size)
    width = (g.abs().amax(-1) if kv_dtype == "fp8_e4m3" else g.amax(-1) - g.amin(-1))[..., None]
    err = (kv.float().view_as(g) - g).abs()
    assert (err <= width * span + EPS_OUT[TORCH[model]] * g.abs() + 1e-6).all()


# ---- tables and tensors ------------------------------------------------------------------------


def view_of(case, nb=NB, bs=BS, r=R, p=P) -> LatentView:
    kv_dtype, model = case
    f = LatentFormat(kv_dtype, model, r, p)
    return LatentView(f, torch.zeros(nb, bs, f.row_elems, dtype=f.storage_dtype))


def tables(lens=(7, 1, 13), nb=NB, bs=BS, seed=0):
    """CSR tables over distinct shuffled blocks, one sequence per entry of ``lens``."""
    rng = np.random.default_rng(seed)
    need = [-(-n // bs) for n in lens]
    blocks = rng.permutation(nb)[:sum(need)]
    indptr = np.concatenate([[0], np.cumsum(need)]).astype(np.int32)
    return (torch.from_numpy(indptr), torch.from_numpy(blocks.astype(np.int32)),
            torch.tensor(lens, dtype=torch.int32))


def fill(view, lens=(7, 1, 13), seed=0, scale=2.0):
    """Write random rows for every position of ``tables(lens)``; returns the tables."""
    indptr, indices, seq_lens = tables(lens, view.num_blocks, view.block_size, seed)
    t = ref._tables(indptr, indices, seq_lens, torch.device("cpu"), view.block_size, view.num_blocks, True)
    slots = torch.from_numpy(ref.token_slots(t, view.block_size))
    g = torch.Generator().manual_seed(seed)
    dt = view.format_dtype()
    c = (torch.randn(len(slots), view.format.kv_lora_rank, generator=g) * scale).to(dt)
    pe = torch.randn(len(slots), view.format.rope_dim, generator=g).to(dt)
    write_latent(view, slots, c, pe, backend="reference")
    return indptr, indices, seq_lens, c, pe


# ---- write and gather: every backend against the definition ---------------------------------------


@pytest.mark.parametrize("in_dtype", MODEL)
@pytest.mark.parametrize("case", FORMATS, ids=fid)
def test_writes_are_the_definitions_bytes_on_every_backend(case, in_dtype):
    want = view_of(case)
    g = torch.Generator().manual_seed(3)
    n = 11
    slots = torch.tensor([3, -1, 0, 34, 17, 5, -7, 20, 21, 22, 9], dtype=torch.int64)
    c = (torch.randn(n, R, generator=g) * 4).to(TORCH[in_dtype])
    pe = torch.randn(n, P, generator=g).to(TORCH[in_dtype])
    write_latent(want, slots, c, pe, backend="reference")
    assert want.data.view(NB * BS, -1)[1].eq(0).all()          # an unwritten slot stays zero
    for run in ("cpu", "emulated", "emulated-small", "emulated-one"):
        got = view_of(case)
        if run == "cpu":
            write_latent(got, slots, c, pe, backend="cpu")
        else:
            dims = {"emulated": {}, "emulated-small": SMALL_GRID, "emulated-one": ONE_THREAD}[run]
            emulation.write_latent(got, slots, c, pe, **dims)
        assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8)), run


@pytest.mark.parametrize("out", [None] + list(MODEL))
@pytest.mark.parametrize("case", FORMATS, ids=fid)
def test_gathers_decode_exactly_on_every_backend(case, out):
    view = view_of(case)
    indptr, indices, seq_lens, c, pe = fill(view)
    out_dtype = None if out is None else TORCH[out]
    kv, rope = gather_latent(view, indptr, indices, seq_lens, out_dtype=out_dtype, backend="reference")
    dt = out_dtype or TORCH[case[1]]
    assert kv.shape == (21, R) and rope.shape == (21, P) and kv.dtype == dt
    want_kv, want_pe = view.format.decode(view.format.encode(c, pe), dt)
    assert torch.equal(kv, want_kv) and torch.equal(rope, want_pe)
    for run in ("cpu", "emulated", "emulated-small"):
        if run == "cpu":
            k2, p2 = gather_latent(view, indptr, indices, seq_lens, out_dtype=out_dtype, backend="cpu")
        else:
            dims = SMALL_GRID if run == "emulated-small" else {}
            k2, p2 = emulation.gather_latent(view, indptr, indices, seq_lens, out_dtype=out_dtype, **dims)
        assert torch.equal(k2, kv) and torch.equal(p2, rope), run


def test_block_sizes_64_and_256_hold_latent_rows():
    for bs in (64, 256):
        view = view_of(("fp8_e4m3", "bfloat16"), nb=4, bs=bs, r=128, p=64)
        indptr, indices, seq_lens, c, pe = fill(view, lens=(bs + 3, 2 * bs - 1), seed=bs)
        kv, rope = gather_latent(view, indptr, indices, seq_lens)
        k2, p2 = emulation.gather_latent(view, indptr, indices, seq_lens)
        assert torch.equal(kv, k2) and torch.equal(rope, p2)
        assert torch.equal(rope, pe)    # the positional slice: bfloat16, unquantized


# ---- attention ---------------------------------------------------------------------------------


def bound(view, q_nope, q_pe, indptr, indices, seq_lens, q_indptr, sm_scale, want):
    """The per-element bound of the module docstring, over each query's keys."""
    kv, rope = (x.double() for x in gather_latent(view, indptr, indices, seq_lens, out_dtype=torch.float32))
    keys = torch.cat([kv, rope], dim=1)
    q = torch.cat([q_nope, q_pe], dim=2).double()
    lens, qp = seq_lens.tolist(), q_indptr.tolist()
    w = keys.shape[1]
    out = torch.zeros_like(want, dtype=torch.float64)
    start = 0
    for b, n in enumerate(lens):
        k, v = keys[start:start + n], kv[start:start + n]
        for i in range(qp[b], qp[b + 1]):
            seen = n - (qp[b + 1] - qp[b]) + (i - qp[b]) + 1
            if seen <= 0:
                continue
            qk = q[i].norm(dim=1)[:, None] * k[:seen].norm(dim=1)[None, :]
            delta = (w + 2) * U * qk.amax(dim=1) * sm_scale
            vmax = v[:seen].abs().max()
            out[i] = ((torch.exp(2 * delta) - 1) * vmax + (seen + 16) * U * vmax)[:, None]
        start += n
    return 2 * (out + EPS_OUT[want.dtype] * want.double().abs()) + 1e-30


def attention_case(case, lens=(7, 1, 13), nq=(1, 1, 3), heads=5, seed=0):
    view = view_of(case)
    indptr, indices, seq_lens, _, _ = fill(view, lens, seed)
    dt = TORCH[case[1]] if case[0] != "fp8_e4m3" else TORCH[case[1]]
    g = torch.Generator().manual_seed(seed + 7)
    total = sum(nq)
    q_nope = torch.randn(total, heads, R, generator=g).to(dt) / 4
    q_pe = torch.randn(total, heads, P, generator=g).to(dt)
    q_indptr = torch.tensor(np.concatenate([[0], np.cumsum(nq)]), dtype=torch.int32)
    return view, q_nope, q_pe, indptr, indices, seq_lens, q_indptr


@pytest.mark.parametrize("case", FORMATS, ids=fid)
def test_attention_is_the_float64_definition_within_its_bound(case):
    view, q_nope, q_pe, indptr, indices, seq_lens, q_indptr = attention_case(case)
    scale = 1 / math.sqrt(192)
    want = mla_attention(view, q_nope, q_pe, indptr, indices, seq_lens, q_indptr, sm_scale=scale,
                         backend="reference")
    assert want.shape == (5, 5, R) and want.dtype == q_nope.dtype
    exact = ref.attention(view, q_nope, q_pe, indptr, indices, seq_lens, q_indptr, sm_scale=scale)
    assert torch.equal(exact, want)
    f64 = ref.check_attention(view, q_nope, q_pe, indptr, indices, seq_lens, q_indptr, scale, None, None,
                              read_values=True)
    ideal = ref.attend(f64, q_nope, q_pe, torch.float64)   # float64 before the output rounding
    ideal = ideal if ideal.dtype == torch.float64 else ideal.double()
    lim = bound(view, q_nope, q_pe, indptr, indices, seq_lens, q_indptr, scale, want)
    for run, kw in (("cpu", {}), ("emulated", {}), ("emulated-split3", dict(num_splits=3)),
                    ("emulated-threads", dict(block=(7, 1, 1)))):
        if run == "cpu":
            got = mla_attention(view, q_nope, q_pe, indptr, indices, seq_lens, q_indptr, sm_scale=scale,
                                backend="cpu")
        else:
            got = emulation.mla_attention(view, q_nope, q_pe, indptr, indices, seq_lens, q_indptr, sm_scale=scale,
                                          **kw)
        assert got.shape == want.shape and got.dtype == want.dtype, run
        err = (got.double() - want.double()).abs()
        assert (err <= lim).all(), (run, float((err - lim).max()))


def test_attention_of_a_query_sees_only_the_keys_up_to_its_position():
    case = ("bfloat16", "bfloat16")
    view, q_nope, q_pe, indptr, indices, seq_lens, q_indptr = attention_case(case, lens=(9,), nq=(3,), heads=2)
    scale = 0.1
    full = mla_attention(view, q_nope, q_pe, indptr, indices, seq_lens, q_indptr, sm_scale=scale)
    for j in range(3):      # query j at position 6 + j equals a decode over the first 7 + j keys
        one = mla_attention(view, q_nope[j:j + 1], q_pe[j:j + 1], indptr, indices,
                            torch.tensor([7 + j], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
                            sm_scale=scale)
        assert torch.equal(one[0], full[j])


def test_the_tiling_fits_the_shared_buffer_for_deepseek_rows():
    ht, kt = latent_plans.latent_tiling(128, 576, 512)
    assert kt * 576 + ht * (kt + 512 + 3) <= latent_plans.LATENT_FLOATS
    assert (ht, kt) == (16, 4)
    assert latent_plans.latent_tiling(1, 8, 4) == (1, 16)


# ---- errors --------------------------------------------------------------------------------------


def test_bad_inputs_are_typed_errors_with_the_arena_unchanged():
    view = view_of(("int8", "bfloat16"))
    before = view.data.clone()
    slots = torch.tensor([0, 35], dtype=torch.int64)
    c, pe = torch.randn(2, R, dtype=torch.bfloat16), torch.randn(2, P, dtype=torch.bfloat16)
    for backend in ("cpu", "reference"):
        with pytest.raises(InvalidArgumentError, match=r"slot_mapping"):
            write_latent(view, slots, c, pe, backend=backend)
    with pytest.raises(InvalidArgumentError, match=r"slot_mapping"):
        emulation.write_latent(view, slots, c, pe)
    assert torch.equal(view.data, before)
    ok = torch.tensor([0, 1], dtype=torch.int64)
    with pytest.raises(ShapeError, match=r"kv_c: expected shape \[2, 256\], got \(2, 255\)"):
        write_latent(view, ok, c[:, :255], pe)
    with pytest.raises(DTypeError, match=r"k_pe: expected dtype torch.bfloat16 \(as kv_c\), got torch.float32"):
        write_latent(view, ok, c, pe.float())
    with pytest.raises(DTypeError, match=r"slot_mapping: expected a 1-D int64 tensor"):
        write_latent(view, ok.int(), c, pe)
    with pytest.raises(InvalidArgumentError, match=r"view: expected a LatentView"):
        write_latent(view.data, ok, c, pe)
    with pytest.raises(DTypeError, match=r"view.data: expected dtype torch.uint8"):
        write_latent(LatentView(view.format, torch.zeros(NB, BS, view.format.row_elems)), ok, c, pe)
    with pytest.raises(InvalidArgumentError, match=r"backend: expected one of"):
        write_latent(view, ok, c, pe, backend="tpu")
    assert torch.equal(view.data, before)
    indptr, indices, seq_lens = tables()
    with pytest.raises(InvalidArgumentError, match=r"seq_lens"):
        gather_latent(view, indptr, indices, torch.tensor([7, 1, 16], dtype=torch.int32))
    with pytest.raises(InvalidBlockError, match=r"indices"):
        gather_latent(view, indptr, torch.full_like(indices, 99), seq_lens)
    q = torch.randn(3, 2, R, dtype=torch.bfloat16)
    qpe = torch.randn(3, 2, P, dtype=torch.bfloat16)
    qp = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    with pytest.raises(InvalidArgumentError, match=r"sm_scale: expected a finite float > 0"):
        mla_attention(view, q, qpe, indptr, indices, seq_lens, qp, sm_scale=float("nan"))
    with pytest.raises(InvalidArgumentError, match=r"q_indptr: expected 0 <= q_indptr\[2\] - q_indptr\[1\] <= "
                                                   r"seq_lens\[1\] = 1"):
        mla_attention(view, q, qpe, indptr, indices, seq_lens, torch.tensor([0, 0, 2, 3], dtype=torch.int32),
                      sm_scale=0.1)
    with pytest.raises(ShapeError, match=r"q_pe: expected shape \[3, 2, 32\]"):
        mla_attention(view, q, qpe[:, :1], indptr, indices, seq_lens, qp, sm_scale=0.1)
    with pytest.raises(DTypeError, match=r"q_nope: expected dtype bfloat16 \(the model dtype of the int8 rows\)"):
        emulation.mla_attention(view, q.float(), qpe.float(), indptr, indices, seq_lens, qp, sm_scale=0.1)
    with pytest.raises(DeviceError, match=r"view.data: expected a CUDA tensor"):
        from pagedkv.kernels import ops as kops

        kops.write_latent(view, ok, c, pe)
