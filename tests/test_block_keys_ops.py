"""int4 block keys on the fast CPU gathers: ``key_scale``/``key_zero`` (pagedkv/format/quant.py,
"block keys") give each sealed (block, head) per-channel bfloat16 parameters for its K
rows. The Cython loops must equal pagedkv.ops.reference bit for bit (NaN positions
equal) with sealed and unsealed blocks and heads mixed in one gather, rotation on
(sealed K rows are not unrotated), -0.0 first scales (unsealed), non-finite and extreme
parameters, every head_dim from 2 up, both layouts and tables; and refuse bad
parameters with the reference's typed errors before anything is written.
"""
from __future__ import annotations

import os

import pytest
import torch
from backend_cases import (
    BS,
    LAYOUTS,
    MODEL,
    NB,
    H,
    Layer,
    assert_same,
    csr,
    name,
    offset_view,
    padded,
    run_on_baseline_build,
    same_state,
    tables,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.errors import DTypeError, InvalidArgumentError, InvalidBlockError, ShapeError
from pagedkv.format.quant import dequantize_key_channels, quantize_key_block
from pagedkv.format.rotation import rotation_signs
from pagedkv.ops import backends
from pagedkv.ops import reference as ref

cpu = pytest.importorskip("pagedkv.ops.cpu")
if not backends.cpu_ops_built():
    pytest.skip("the fast CPU ops are not built", allow_module_level=True)

# parameter values the row loops must treat as torch does (1e-39: a bfloat16 subnormal)
SPECIAL = (float("nan"), float("inf"), float("-inf"), 1e30, -1e30, 1e-30, 1e-39, 0.0, -0.0)


def key_channels(nb, h, d, gen, *, sealed_share=0.6, special=False, offset=0):
    """``(key_scale, key_zero, sealed)``: the parameters of reference-quantized random
    blocks, with each (block, head) sealed at random (at least one of each kind when
    there are two) and the unsealed ones' first scale +0.0 or -0.0 (the rest of their
    row stays nonzero garbage: only the first scale decides)."""
    _, ks, kz = quantize_key_block(torch.randn(nb, BS, h, d, generator=gen) * 3)
    sealed = torch.rand(nb, h, generator=gen) < sealed_share
    if nb * h > 1:
        sealed.view(-1)[0], sealed.view(-1)[-1] = True, False
    zeros = torch.where(torch.rand(nb, h, generator=gen) < 0.5, -0.0, 0.0).to(torch.bfloat16)
    ks[..., 0] = torch.where(sealed, ks[..., 0], zeros)
    if special:
        flat_s, flat_z = ks.view(-1), kz.view(-1)
        picks = torch.randint(0, flat_s.numel(), (2 * len(SPECIAL),), generator=gen)
        for i, v in enumerate(SPECIAL):
            flat_s[picks[i]] = v
            flat_z[picks[len(SPECIAL) + i]] = v
        # first scales that seal: NaN and tiny or huge values count as nonzero
        for j, v in enumerate((float("nan"), 1e-39, -1e30, float("inf"))):
            b, hh = divmod(j % (nb * h), h)
            ks[b, hh, 0] = v
            sealed[b, hh] = True
    if offset:  # contiguous, but not 16-byte aligned
        ks, kz = offset_view(ks, offset), offset_view(kz, offset)
    return ks, kz, sealed


def int4_layer(layout, d, seed, nb=NB, h=H):
    """``(data, scale, zero)`` of an int4 layer of random codes and parameters (a group
    size drawn from ``seed`` among the divisors of ``d``)."""
    layer = Layer(nb, BS, h, d, "int4", layout, seed=seed, random=True)
    return layer.kv, layer.scale, layer.zero


def token_slots(indptr, indices, lens):
    """Per gathered token, its block id and offset (CSR tables), as int64 tensors."""
    blk, off = [], []
    for b, n in enumerate(lens.tolist()):
        row = indices[int(indptr[b]) : int(indptr[b + 1])].tolist()
        for j in range(n):
            blk.append(row[j // BS])
            off.append(j % BS)
    return torch.tensor(blk, dtype=torch.int64), torch.tensor(off, dtype=torch.int64)


def both(table, layer, table_args, **kw):
    """The reference's and the cpu backend's gather of the same inputs (fresh copies of
    any given outputs for each)."""
    fns = (ref.gather_kv, cpu.gather_kv) if table == "csr" else (ref.gather_kv_padded, cpu.gather_kv_padded)
    outs = []
    for fn in fns:
        # copies at the same storage offset: a misaligned output stays misaligned
        kw_i = {k: offset_view(v, v.storage_offset()) if k in ("out_key", "out_value") and v is not None else v
                for k, v in kw.items()}
        got = fn(layer, *table_args, **kw_i)
        if kw_i.get("out_key") is not None:
            assert got[0] is kw_i["out_key"] and got[1] is kw_i["out_value"]
        outs.append(got)
    return outs


def assert_outputs_equal(want, got):
    for w, g in zip(want, got):
        assert_same(g, w)


@pytest.mark.parametrize("out", ["fresh", "given", "misaligned"])
@pytest.mark.parametrize("table", ["csr", "padded"])
@pytest.mark.parametrize("rotated", [False, True], ids=["plain", "rotated"])
@pytest.mark.parametrize("d", [2, 6, 16, 18, 64, 80, 128, 256])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("out_dtype", MODEL, ids=name)
def test_block_key_gather_equals_the_reference(out_dtype, layout, d, rotated, table, out):
    gen = torch.Generator().manual_seed(d * 7 + MODEL.index(out_dtype) + 3 * rotated)
    layer, scale, zero = int4_layer(layout, d, seed=d + 3 * rotated)
    ks, kz, sealed = key_channels(NB, H, d, gen, special=out == "misaligned", offset=int(out == "misaligned"))
    indptr, indices, block_table, lens = tables(gen)
    args = (indptr, indices, lens) if table == "csr" else (block_table, lens)
    kw = dict(layout=layout, out_dtype=out_dtype, kv_scale=scale, kv_zero=zero, key_scale=ks, key_zero=kz,
              rotation_signs=rotation_signs(d, 5) if rotated else None)
    if out != "fresh":
        total = int(lens.sum())
        off = int(out == "misaligned")
        kw["out_key"] = offset_view(torch.full((total, H, d), 7.0, dtype=out_dtype), off)
        kw["out_value"] = offset_view(torch.full((total, H, d), 7.0, dtype=out_dtype), off)
    before = [t.clone() for t in (layer, scale, zero, ks, kz)]
    want, got = both(table, layer, args, **kw)
    assert_outputs_equal(want, got)
    assert same_state([layer, scale, zero, ks, kz], before)  # a gather writes only its outputs


@pytest.mark.parametrize("rotated", [False, True], ids=["plain", "rotated"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_sealed_rows_use_the_block_parameters_and_the_rest_the_per_token_path(layout, rotated):
    # What the comparison with the reference cannot say alone: the parameters matter
    # exactly where they should. Unsealed K rows and every V row equal the gather
    # without block keys (unrotated when rotated); sealed K rows equal
    # dequantize_key_channels of their codes, not unrotated.
    d = 64
    gen = torch.Generator().manual_seed(11 + rotated)
    layer, scale, zero = int4_layer(layout, d, seed=4)
    ks, kz, sealed = key_channels(NB, H, d, gen)
    indptr, indices, _, lens = tables(gen)
    signs = rotation_signs(d, 2) if rotated else None
    kw = dict(layout=layout, out_dtype=torch.float32, kv_scale=scale, kv_zero=zero, rotation_signs=signs)
    k, v = cpu.gather_kv(layer, indptr, indices, lens, key_scale=ks, key_zero=kz, **kw)
    k_tok, v_tok = cpu.gather_kv(layer, indptr, indices, lens, **kw)
    blk, off = token_slots(indptr, indices, lens)
    rows = sealed[blk]                                   # [tokens, H]
    assert bool(rows.any()) and bool((~rows).any())
    assert_same(v, v_tok)
    assert_same(k[~rows], k_tok[~rows])
    codes = layer[blk, 0, off] if layout == "NHD" else layer[blk, 0, :, off]  # [tokens, H, D / 2]
    chan = dequantize_key_channels(codes, ks[blk], kz[blk], torch.float32)
    assert_same(k[rows], chan[rows])
    assert not torch.equal(k[rows], k_tok[rows])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_block_quantized_per_channel_reads_back_within_half_a_step(layout):
    # quantize_key_block's codes stored at the per-token int4 byte positions of a block's
    # K plane, gathered by the cpu loops: each key within half its channel's step.
    d, h = 32, 2
    gen = torch.Generator().manual_seed(5)
    layer = Layer(4, BS, h, d, "int4", layout, seed=1)
    keys = torch.randn(4, BS, h, d, generator=gen) * 2
    codes, ks, kz = quantize_key_block(keys)
    for b in range(4):
        if layout == "NHD":
            layer.kv[b, 0] = codes[b]
        else:
            layer.kv[b, 0] = codes[b].transpose(0, 1)
    indptr, indices, lens = csr([[2, 0], [3]], [2 * BS - 1, BS])
    k, _ = cpu.gather_kv(layer.kv, indptr, indices, lens, layout=layout, out_dtype=torch.float32,
                         kv_scale=layer.scale, kv_zero=layer.zero, key_scale=ks, key_zero=kz)
    want = torch.cat([keys[2], keys[0, : BS - 1], keys[3]])
    step = torch.cat([ks[2].expand(BS, h, d), ks[0].expand(BS - 1, h, d), ks[3].expand(BS, h, d)]).float()
    err = (k - want).abs()
    assert bool((err <= step / 2 * 1.0001 + 1e-6).all()), float((err / step).max())


def test_a_large_gather_runs_threaded_and_equals_the_reference():
    # 2 * tokens * H * D well above the loops' one-thread threshold
    d, h, nb, bs = 128, 4, 40, 16
    gen = torch.Generator().manual_seed(3)
    layer = Layer(nb, bs, h, d, "int4", "HND", seed=2, random=True)
    ks, kz, _ = key_channels(nb, h, d, gen)
    tabs = [torch.randperm(nb, generator=gen)[:12].tolist(), torch.randperm(nb, generator=gen)[:20].tolist()]
    lens = [12 * bs - 3, 20 * bs]
    for table, args in (("csr", csr(tabs, lens)), ("padded", padded(tabs, lens))):
        for signs in (None, rotation_signs(d, 1)):
            want, got = both(table, layer.kv, args, layout="HND", out_dtype=torch.bfloat16, kv_scale=layer.scale,
                             kv_zero=layer.zero, key_scale=ks, key_zero=kz, rotation_signs=signs)
            assert_outputs_equal(want, got)


@pytest.mark.parametrize("table", ["csr", "padded"])
def test_a_non_contiguous_arena_takes_the_reference_path_with_its_block_keys(table):
    # the loops take contiguous arenas only; the fallback must still apply key_scale/key_zero
    d = 16
    layer, scale, zero = int4_layer("NHD", d, seed=6)
    wide = torch.zeros(layer.shape[:-1] + (layer.shape[-1] + 4,), dtype=layer.dtype)
    wide[..., : layer.shape[-1]] = layer
    strided = wide[..., : layer.shape[-1]]
    assert not strided.is_contiguous()
    gen = torch.Generator().manual_seed(6)
    ks, kz, _ = key_channels(NB, H, d, gen)
    indptr, indices, block_table, lens = tables(gen)
    args = (indptr, indices, lens) if table == "csr" else (block_table, lens)
    kw = dict(out_dtype=torch.float16, kv_scale=scale, kv_zero=zero, key_scale=ks, key_zero=kz)
    want, _ = both(table, layer, args, **kw)
    got = (cpu.gather_kv if table == "csr" else cpu.gather_kv_padded)(strided, *args, **kw)
    plain = (cpu.gather_kv if table == "csr" else cpu.gather_kv_padded)(strided, *args, **dict(kw, key_scale=None,
                                                                                                key_zero=None))
    assert_outputs_equal(want, got)
    assert not torch.equal(got[0], plain[0])


@settings(max_examples=60, deadline=None)
@given(
    layout=st.sampled_from(LAYOUTS),
    out_dtype=st.sampled_from(MODEL),
    bs=st.integers(1, 9),
    h=st.integers(1, 4),
    d=st.integers(1, 128).map(lambda x: 2 * x),
    lens=st.lists(st.integers(0, 40), min_size=0, max_size=5),
    share=st.sampled_from([0.0, 0.3, 0.7, 1.0]),
    rotated=st.booleans(),
    special=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_block_key_gather_equals_the_reference_for_random_shapes(layout, out_dtype, bs, h, d, lens, share,
                                                                 rotated, special, seed):
    nb = 12
    layer = Layer(nb, bs, h, d, "int4", layout, seed=seed, random=True)  # a group size from seed
    g = torch.Generator().manual_seed(seed)
    ks, kz, _ = key_channels(nb, h, d, g, sealed_share=share, special=special)
    if share == 0.0:  # every (block, head) unsealed: the first scale is a zero
        ks[..., 0] = 0.0
    tabs = [torch.randint(0, nb, (-(-n // bs) + int(torch.randint(0, 2, (1,), generator=g)),),
                          generator=g).tolist() for n in lens]  # repeats allowed on read, sometimes a spare
    kw = dict(layout=layout, out_dtype=out_dtype, kv_scale=layer.scale, kv_zero=layer.zero, key_scale=ks,
              key_zero=kz, rotation_signs=rotation_signs(d, seed) if rotated else None)
    for table, args in (("csr", csr(tabs, lens)), ("padded", padded(tabs, lens))):
        want, got = both(table, layer.kv, args, **kw)
        assert_outputs_equal(want, got)


# ----------------------------------------------------------------------------------
# refusals: the reference's checks, in its order, before anything is written


def _bad_cases():
    ok = torch.zeros(NB, H, 16, dtype=torch.bfloat16)
    return [
        ("dtype", dict(key_scale=ok.float(), key_zero=ok), DTypeError,
         r"^key_scale: expected dtype bfloat16, got torch.float32$"),
        ("shape", dict(key_scale=ok, key_zero=ok[:, :, :8]), ShapeError,
         r"^key_zero: expected shape \(7, 3, 16\) \[num_blocks, H, head_dim\], got \(7, 3, 8\)$"),
        ("head_shape", dict(key_scale=ok[:, :1].contiguous(), key_zero=ok), ShapeError,
         r"^key_scale: expected shape \(7, 3, 16\) \[num_blocks, H, head_dim\], got \(7, 1, 16\)$"),
        ("strided", dict(key_scale=torch.zeros(NB, H, 32, dtype=torch.bfloat16)[:, :, ::2], key_zero=ok),
         InvalidArgumentError, r"^key_scale: expected a contiguous tensor, got strides \(96, 32, 2\)$"),
        ("no_zero", dict(key_scale=ok), InvalidArgumentError,
         r"^key_zero: expected a tensor when the other block-key parameter is given, got None$"),
        ("no_scale", dict(key_zero=ok), InvalidArgumentError,
         r"^key_scale: expected a tensor when the other block-key parameter is given, got None$"),
        ("not_a_tensor", dict(key_scale=[0.0] * 16, key_zero=ok), DTypeError,
         r"^key_scale: expected a torch.Tensor, got list$"),
    ]


@pytest.mark.parametrize("out", ["fresh", "given"])
@pytest.mark.parametrize("op", ["gather", "gather_padded"])
@pytest.mark.parametrize("backend_name", ["reference", "cpu"])
@pytest.mark.parametrize("case,bad,error,message", _bad_cases(), ids=[c[0] for c in _bad_cases()])
def test_bad_block_key_parameters_are_refused_before_anything_moves(case, bad, error, message, backend_name, op,
                                                                      out):
    b = backends.load(backend_name)
    layer, scale, zero = int4_layer("NHD", 16, seed=3)
    indptr, indices, block_table, lens = tables(torch.Generator().manual_seed(4))
    kw = dict(out_dtype=torch.float32, kv_scale=scale, kv_zero=zero, rotation_signs=rotation_signs(16, 1), **bad)
    if out == "given":
        total = int(lens.sum())
        kw.update(out_key=torch.full((total, H, 16), 3.0), out_value=torch.full((total, H, 16), 3.0))
    views = [t for t in (layer, scale, zero, kw.get("out_key"), kw.get("out_value")) if t is not None]
    before = [t.clone() for t in views]
    with pytest.raises(error, match=message):
        if op == "gather":
            b.gather_kv(layer, indptr, indices, lens, **kw)
        else:
            b.gather_kv_padded(layer, block_table, lens, **kw)
    assert same_state(views, before)


@pytest.mark.parametrize("backend_name", ["reference", "cpu"])
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3", "int3", torch.float16], ids=str)
def test_block_keys_need_an_int4_layer(backend_name, kv_dtype):
    b = backends.load(backend_name)
    layer = Layer(NB, BS, H, 16, kv_dtype, seed=1, random=True)
    indptr, indices, _, lens = tables(torch.Generator().manual_seed(4))
    ks = torch.ones(NB, H, 16, dtype=torch.bfloat16)
    before = layer.state()
    got = "model-dtype" if kv_dtype == torch.float16 else kv_dtype
    with pytest.raises(InvalidArgumentError, match=rf"^key_scale: expected None unless the kv_layer is int4 or int2 "
                                                   rf"\(block keys\), got a tensor for a {got} kv_layer$"):
        b.gather_kv(layer.kv, indptr, indices, lens, key_scale=ks, key_zero=ks, **layer.gather_kw())
    assert same_state(layer.state(), before)


@pytest.mark.parametrize("backend_name", ["reference", "cpu"])
def test_bad_block_keys_are_named_before_a_bad_block_id(backend_name):
    # the reference's order: the key parameters are checked before the tables' values
    b = backends.load(backend_name)
    layer, scale, zero = int4_layer("HND", 16, seed=3)
    indptr, indices, _, lens = tables(torch.Generator().manual_seed(4))
    bad_ids = indices.clone()
    bad_ids[int(indptr[3])] = NB + 4
    ks = torch.zeros(NB, H, 16, dtype=torch.bfloat16)
    kw = dict(layout="HND", out_dtype=torch.float16, kv_scale=scale, kv_zero=zero)
    with pytest.raises(DTypeError, match=r"^key_zero: expected dtype bfloat16"):
        b.gather_kv(layer, indptr, bad_ids, lens, key_scale=ks, key_zero=ks.half(), **kw)
    with pytest.raises(InvalidBlockError, match=r"^indices: expected block ids in \[0, 7\)"):
        b.gather_kv(layer, indptr, bad_ids, lens, key_scale=ks, key_zero=ks, **kw)


# ----------------------------------------------------------------------------------
# the baseline (SSE) build of the row functions


_BASELINE_SCRIPT = """
import sys
sys.path.insert(0, sys.argv[1])
from pagedkv.ops import _cpu_quant
assert _cpu_quant.ROW_ISA == "baseline", _cpu_quant.ROW_ISA
import test_block_keys_ops as t
n = 0
for out_dtype in t.MODEL:
    for layout in t.LAYOUTS:
        for d in (2, 6, 16, 18, 64, 80, 128):
            for rotated in (False, True):
                t.test_block_key_gather_equals_the_reference(out_dtype, layout, d, rotated, "csr", "misaligned")
                n += 1
print(n)
"""


def test_baseline_row_build_matches_the_reference_too():
    # This machine may pick the AVX2 build: PAGEDKV_CPU_BASELINE makes a fresh process
    # run the baseline one against the reference.
    here = os.path.dirname(os.path.abspath(__file__))
    assert run_on_baseline_build(_BASELINE_SCRIPT, here) == str(3 * 2 * 7 * 2)
