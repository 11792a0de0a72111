"""pagedkv.ops.paged_attention: every backend against the float64 reference.

Tolerances. The reference reads the float32 rows the exact gather produces and computes
in float64; the CPU backend computes in float32 from the same rows (rotated arenas: in
the rotated domain, which differs from the gathered rows by the float32 rounding of two
Hadamard transforms). A float32 dot product over D terms errs by at most ~D * 2^-24
relative to sum |q_i k_i|, the online softmax adds a few ulps per tile rescale, and the
output is a convex combination of V rows: so |out - ref| <= 1e-4 * max|V| covers
float32 with a margin of ~100x over what we measure (~1e-6). A float16/bfloat16 ``q``
gets its output rounded to its dtype once: one ulp of max|V| more (2^-10, 2^-7).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv.errors import DeviceError, DTypeError, InvalidArgumentError, InvalidBlockError, ShapeError
from pagedkv.format import dtypes
from pagedkv.format.layer_format import LayerFormat
from pagedkv.format.rotation import rotation_signs
from pagedkv.ops import ExactRows, paged_attention
from pagedkv.ops import reference as ref
from pagedkv.ops.paged_attention import CPU_AVAILABLE

MODEL_FMTS = ("float32", "float16", "bfloat16")
QUANT_FMTS = ("fp8_e4m3", "fp8_e5m2", "int8", "int4", "int3")
BACKENDS = [pytest.param("cpu", marks=pytest.mark.skipif(not CPU_AVAILABLE, reason="CPU loops not built"))]
ULP = {torch.float32: 0.0, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}


def _groups(fmt: str, d: int) -> int:
    if fmt == "int4":
        return 2 if d % 4 == 0 else 1
    if fmt == "int3":
        return 2 if d % 16 == 0 else 1
    return 1


def build(fmt, layout, d, bs, h, hq, lens, nqs, gen, *, rot=False, block_keys=False, q_dtype=None):
    """A random arena of ``fmt`` holding every sequence, a shuffled CSR table, queries."""
    need = [-(-n // bs) for n in lens]
    nb = sum(need) + 3
    shape = (nb, 2, bs, h, d) if layout == "NHD" else (nb, 2, h, bs, d)
    kw = {}
    k = torch.randn(nb * bs, h, d, generator=gen) * 2
    v = torch.randn(nb * bs, h, d, generator=gen)
    if fmt in MODEL_FMTS:
        dt = getattr(torch, fmt)
        kv = torch.empty(shape, dtype=dt)
        ref.write_kv(kv, torch.arange(nb * bs), k.to(dt), v.to(dt), layout=layout)
    else:
        row = dtypes.info(fmt)
        dt = q_dtype or torch.float32
        g = _groups(fmt, d)
        sshape = shape[:-1] + ((g,) if row.grouped else ())
        kv = torch.zeros(shape[:-1] + (row.stored_dim(d),), dtype=row.torch_dtype)
        kw["kv_scale"] = torch.zeros(sshape, dtype=row.param_dtype)
        kw["kv_zero"] = torch.zeros(sshape, dtype=row.param_dtype) if row.zero_point else None
        if rot:
            kw["rotation_signs"] = rotation_signs(d, 5)
        ref.write_kv(kv, torch.arange(nb * bs), k, v, layout=layout, **kw)
        if block_keys:
            ks = torch.zeros(nb, h, d, dtype=torch.bfloat16)
            kz = torch.zeros(nb, h, d, dtype=torch.bfloat16)
            sealed = torch.arange(0, nb, 2)      # every other block sealed: both kinds of K rows
            ref.seal_key_blocks(kv, sealed, k.view(nb, bs, h, d)[sealed], ks, kz, layout=layout)
            kw.update(key_scale=ks, key_zero=kz)
    perm = torch.randperm(nb, generator=gen)[:sum(need)].to(torch.int32)
    indptr = torch.tensor([0] + np.cumsum(need).tolist(), dtype=torch.int32)
    q = torch.randn(sum(nqs), hq, d, generator=gen).to(dt)
    qp = torch.tensor([0] + np.cumsum(nqs).tolist(), dtype=torch.int32)
    return (q, kv, indptr, perm, torch.tensor(lens, dtype=torch.int32), qp), dict(layout=layout, **kw), v.abs().max()


def check_close(got, want, vmax, dtype):
    tol = 1e-4 * float(vmax) + ULP[dtype] * float(vmax)
    err = float((got.double() - want.double()).abs().max()) if got.numel() else 0.0
    assert err <= tol, (err, tol)


@st.composite
def cases(draw):
    fmt = draw(st.sampled_from(MODEL_FMTS + QUANT_FMTS))
    d = draw(st.sampled_from([64, 128, 8, 24, 40] + ([] if fmt in ("int4", "int3") else [5, 17])))
    if fmt == "int4" and d % 2:
        d += 1
    bs = draw(st.sampled_from([1, 3, 16, 64]))
    ratio = draw(st.sampled_from([1, 3, 8]))
    h = draw(st.integers(1, 2))
    batch = draw(st.integers(1, 3))
    lens = [draw(st.one_of(st.integers(1, 70), st.integers(1000, 5000))) for _ in range(batch)]
    nqs = [draw(st.sampled_from([1, 1, min(n, 2), min(n, 7)])) for n in lens]
    window = draw(st.sampled_from([None, None, 1, 37]))
    sink = draw(st.sampled_from([0, 4])) if window else 0
    return dict(fmt=fmt, d=d, bs=bs, hq=h * ratio, h=h, lens=lens, nqs=nqs, window=window, sink=sink,
                cap=draw(st.sampled_from([None, 3.0])), layout=draw(st.sampled_from(["NHD", "HND"])),
                rot=fmt in QUANT_FMTS and draw(st.booleans()),
                block_keys=fmt == "int4" and draw(st.booleans()),
                splits=draw(st.sampled_from([None, None, 2])))


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(c=cases(), seed=st.integers(0, 2**16))
def test_matches_the_float64_reference(backend, c, seed):
    gen = torch.Generator().manual_seed(seed)
    args, kw, vmax = build(c["fmt"], c["layout"], c["d"], c["bs"], c["h"], c["hq"], c["lens"], c["nqs"], gen,
                           rot=c["rot"], block_keys=c["block_keys"])
    opts = dict(kw, window=c["window"], sink_tokens=c["sink"], soft_cap=c["cap"], num_splits=c["splits"])
    want = paged_attention(*args, backend="reference", **opts)
    got = paged_attention(*args, backend=backend, **opts)
    assert got.dtype == args[0].dtype and got.shape == args[0].shape
    check_close(got, want, vmax, args[0].dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("fmt, d, bs, block_keys", [
    ("float32", 128, 16, False),   # tiles of 8 heads across blocks of 16
    ("int4", 40, 3, True),         # blocks of 3: a tile spans many, sealed and not
    ("int3", 64, 16, False),
    ("bfloat16", 24, 64, False),
])
def test_many_kv_heads_decode_and_prefill_in_one_batch(backend, layout, fmt, d, bs, block_keys):
    """8 KV heads, GQA 4: decode sequences (one item takes all heads, its tile spans
    heads) beside a prefill chunk (one head per item) and a window, split and unsplit."""
    gen = torch.Generator().manual_seed(7)
    args, kw, vmax = build(fmt, layout, d, bs, 8, 32, [1500, 37, 300, 5], [1, 20, 3, 5], gen,
                           rot=fmt == "int3", block_keys=block_keys)
    for opts in (dict(), dict(num_splits=3), dict(window=50, sink_tokens=4)):
        want = paged_attention(*args, backend="reference", **kw, **opts)
        got = paged_attention(*args, backend=backend, **kw, **opts)
        check_close(got, want, vmax, args[0].dtype)


@pytest.mark.skipif(not CPU_AVAILABLE, reason="CPU loops not built")
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("fmt, block_keys", [("float32", False), ("int4", True), ("int8", False),
                                             ("int3", False), ("fp8_e5m2", False)])
def test_every_tuning_of_the_cpu_loops_matches_the_reference(layout, fmt, block_keys):
    """The loops' knobs (prefetch mode; sealed block keys' parameters widened once per
    block or per row; code rows decoded in registers or widened into tiles) change speed only: every setting is within the reference's
    tolerance, and the prefetch modes give identical bits."""
    from pagedkv.ops import _cpu_attention as ca

    gen = torch.Generator().manual_seed(11)
    args, kw, vmax = build(fmt, layout, 128, 16, 4, 16, [700, 40, 1], [1, 3, 1], gen, block_keys=block_keys)
    want = paged_attention(*args, backend="reference", **kw)
    old = ca.tune()
    try:
        by_mode = {}
        for fused in (True, False):
            for key_cache in (True, False):
                for mode in ca.PREFETCH_MODES:
                    ca.tune(prefetch=mode, key_cache=key_cache, fused=fused)
                    got = paged_attention(*args, backend="cpu", **kw)
                    check_close(got, want, vmax, args[0].dtype)
                    by_mode.setdefault((fused, key_cache), []).append(got)
        for outs in by_mode.values():
            for got in outs[1:]:
                assert torch.equal(got, outs[0])
        with pytest.raises(InvalidArgumentError, match=r"prefetch: expected one of \['all', 'auto', 'blocks', "
                                                       r"'none'\], got some$"):
            ca.tune(prefetch="some")
    finally:
        ca.tune(*old)
    assert ca.tune() == old


def test_reference_equals_sdpa_on_gathered_rows():
    """The definition itself: causal chunk, GQA, against torch's SDPA on gathered K/V."""
    gen = torch.Generator().manual_seed(0)
    args, kw, _ = build("float32", "NHD", 16, 4, 2, 6, [10, 14], [1, 3], gen)
    q, kv, indptr, indices, lens, qp = args
    got = paged_attention(*args, backend="reference")
    k, v = ref.gather_kv(kv, indptr, indices, lens)
    outs, base = [], 0
    for b, (n, nq) in enumerate(zip(lens.tolist(), (qp[1:] - qp[:-1]).tolist())):
        kk, vv = k[base:base + n].transpose(0, 1), v[base:base + n].transpose(0, 1)
        qq = q[qp[b]:qp[b + 1]].transpose(0, 1)
        mask = torch.arange(n)[None] <= torch.arange(n - nq, n)[:, None]
        outs.append(torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, enable_gqa=True)
                    .transpose(0, 1))
        base += n
    torch.testing.assert_close(got, torch.cat(outs), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_exact_rows_are_read_instead_of_the_arena(backend):
    """Positions in the sink and recent ranges whose slot row is valid come from ExactRows."""
    gen = torch.Generator().manual_seed(3)
    args, kw, vmax = build("int4", "NHD", 32, 4, 2, 4, [23, 9], [1, 2], gen, rot=True)
    q, kv, indptr, indices, lens, qp = args
    nb = kv.shape[0]
    data = torch.randn(6, 2, 4, 2, 32, generator=gen) * 3      # far from the arena's values
    slot_of = torch.full((nb,), -1, dtype=torch.int64)
    blocks0 = indices[:6].long()
    slot_of[blocks0[0]], slot_of[blocks0[4]], slot_of[blocks0[5]] = 0, 1, 2
    valid = torch.ones(6, 4, dtype=torch.bool)
    valid[2, 2] = False       # one row of a held block not held: read from the arena
    exact = ExactRows(data, slot_of, valid, recent=6, sink=2)
    want = paged_attention(*args, backend="reference", exact_rows=exact, **kw)
    plain = paged_attention(*args, backend="reference", **kw)
    got = paged_attention(*args, backend=backend, exact_rows=exact, **kw)
    assert float((want - plain).abs().max()) > 1e-2           # the overlay changes the answer
    check_close(got, want, max(float(vmax), float(data.abs().max())), torch.float32)


def test_numpy_tables_are_accepted():
    gen = torch.Generator().manual_seed(1)
    args, kw, _ = build("float32", "HND", 8, 4, 1, 2, [9], [2], gen)
    np_args = args[:2] + tuple(a.numpy().astype(np.int64) for a in args[2:])
    torch.testing.assert_close(paged_attention(*np_args, **kw), paged_attention(*args, **kw))


# ---- errors -------------------------------------------------------------------------


def _small(gen=None):
    gen = gen or torch.Generator().manual_seed(0)
    return build("float32", "NHD", 8, 4, 2, 4, [9, 3], [1, 2], gen)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("mutate, error, match", [
    (lambda a, k: (a[0].double(),) + a[1:], DTypeError, "q: expected dtype float32, float16 or bfloat16"),
    (lambda a, k: (a[0][:, :3],) + a[1:], ShapeError, "q: expected num_q_heads a positive multiple of 2"),
    (lambda a, k: (a[0].to(torch.float16),) + a[1:], DTypeError, "q: expected dtype torch.float32 \\(the kv_layer"),
    (lambda a, k: a[:5] + (torch.tensor([0, 1, 2], dtype=torch.int32),), InvalidArgumentError,
     "q_indptr: expected offsets from 0 to 3"),
    (lambda a, k: a[:4] + (torch.tensor([9, 2], dtype=torch.int32), torch.tensor([0, 0, 3], dtype=torch.int32)),
     InvalidArgumentError, "q_indptr: expected 0 <= q_indptr\\[2\\] - q_indptr\\[1\\] <= seq_lens\\[1\\] = 2"),
    (lambda a, k: a[:5] + (a[5].long(),), DTypeError, "q_indptr: expected dtype int32"),
    (lambda a, k: a[:3] + (torch.tensor([0, 1, 99, 3], dtype=torch.int32),) + a[4:], InvalidBlockError,
     "indices: expected block ids in \\[0, "),
    (lambda a, k: a[:4] + (torch.tensor([9, 30], dtype=torch.int32),) + a[5:], InvalidArgumentError,
     "seq_lens: expected 0 <= seq_lens\\[1\\]"),
])
def test_bad_arguments_raise_typed_errors(backend, mutate, error, match):
    args, kw, _ = _small()
    with pytest.raises(error, match=match):
        paged_attention(*mutate(args, kw), backend=backend, **kw)


@pytest.mark.parametrize("option, value, match", [
    ("window", 0, "window: expected None or an int >= 1, got 0"),
    ("sink_tokens", -1, "sink_tokens: expected an int >= 0, got -1"),
    ("soft_cap", 0.0, "soft_cap: expected None or a float > 0, got 0.0"),
    ("sm_scale", float("nan"), "sm_scale: expected None or a finite float, got nan"),
    ("num_splits", 0, "num_splits: expected None or an int >= 1, got 0"),
])
def test_bad_options_raise_typed_errors(option, value, match):
    args, kw, _ = _small()
    with pytest.raises(InvalidArgumentError, match=match):
        paged_attention(*args, **{option: value}, **kw)


def test_bad_out_leaves_it_unchanged():
    args, kw, _ = _small()
    out = torch.full((3, 4, 7), 5.0)
    with pytest.raises(ShapeError, match="out: expected torch.float32 \\(3, 4, 8\\)"):
        paged_attention(*args, out=out, **kw)
    assert bool((out == 5.0).all())
    good = torch.full((3, 4, 8), 5.0)
    bad_args = args[:5] + (torch.tensor([0, 1, 9], dtype=torch.int32),)
    with pytest.raises(InvalidArgumentError):
        paged_attention(*bad_args, out=good, **kw)
    assert bool((good == 5.0).all())
    assert paged_attention(*args, out=good, **kw) is good



# -- the layer's format (LayerFormat), as the data ops take it ---------------------------


def _format_case(fmt, block_keys=False, rot=False):
    gen = torch.Generator().manual_seed(11)
    args, kw, vmax = build(fmt, "NHD", 64, 16, 2, 6, [70, 33], [1, 3], gen, rot=rot, block_keys=block_keys)
    group = 64 // _groups(fmt, 64) if dtypes.info(fmt).grouped else None
    layer_format = LayerFormat(fmt, group, "block" if block_keys else "token", rot)
    return args, kw, vmax, layer_format


@pytest.mark.parametrize("backend", ["reference", "cpu", "emulation"])
@pytest.mark.parametrize("fmt, block_keys, rot", [("int4", True, False), ("int4", False, True),
                                                  ("int3", False, False), ("int8", False, False),
                                                  ("float16", False, False)])
def test_an_explicit_layer_format_reads_what_the_implied_one_does(backend, fmt, block_keys, rot):
    args, kw, vmax, layer_format = _format_case(fmt, block_keys, rot)
    if backend == "emulation":
        from pagedkv.kernels import emulation

        run = emulation.paged_attention
    else:
        def run(*a, **k):
            return paged_attention(*a, backend=backend, **k)
    want = paged_attention(*args, backend="reference", **kw)
    got = run(*args, layer_format=layer_format, **kw)
    check_close(got, want, vmax, args[0].dtype)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_the_group_size_comes_from_the_layer_format(backend):
    """The scale views hold 2 groups (of 32); a format of groups of 16 means 4."""
    args, kw, _, _ = _format_case("int4")
    with pytest.raises(ShapeError, match=r"kv_scale: expected shape \(\d+, 2, 16, 2, 4\)"):
        paged_attention(*args, layer_format=LayerFormat("int4", 16), backend=backend, **kw)
    with pytest.raises(DTypeError, match=r"kv_layer: expected dtype int8 \(layer_format int8\), got torch.uint8"):
        paged_attention(*args, layer_format=LayerFormat("int8"), backend=backend, **kw)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_block_keys_and_rotation_must_agree_with_the_layer_format(backend):
    args, kw, _, fmt = _format_case("int4", block_keys=True)
    token = LayerFormat("int4", fmt.group_size)
    with pytest.raises(InvalidArgumentError, match=r"key_scale: expected None for layer_format int4, group_size=32 "
                                                   r"\(keys per token\), got a tensor"):
        paged_attention(*args, layer_format=token, backend=backend, **kw)
    plain = {k: v for k, v in kw.items() if k not in ("key_scale", "key_zero")}
    with pytest.raises(InvalidArgumentError, match=r"key_scale: expected the block-key parameters for layer_format "
                                                   r"int4, group_size=32, key_quant=block, got None"):
        paged_attention(*args, layer_format=fmt, backend=backend, **plain)
    with pytest.raises(InvalidArgumentError, match=r"rotation_signs: expected None for layer_format int4, "
                                                   r"group_size=32 \(not rotated\), got a tensor"):
        paged_attention(*args, layer_format=token, backend=backend, rotation_signs=rotation_signs(64, 5), **plain)


def test_the_cache_passes_its_layer_format(monkeypatch):
    import pagedkv.ops as ops
    from pagedkv import CacheConfig, PagedKVCache

    seen = []
    real = ops.paged_attention

    def spy(*a, **k):     # the format comes as a keyword, or inside the layer's view (KVLayerView.format)
        seen.append(k.get("layer_format") or getattr(a[1], "format", None))
        return real(*a, **k)

    monkeypatch.setattr(ops, "paged_attention", spy)
    kv = PagedKVCache(CacheConfig(num_layers=1, num_kv_heads=2, head_dim=16, block_size=4, num_blocks=8,
                                  kv_dtype="int4", kv_group_size=8))
    kv.add_sequence("a")
    slots = kv.reserve("a", 5)
    k = torch.randn(5, 2, 16)
    kv.write(0, slots, k, -k)
    kv.commit("a", 5, list(range(5)))
    indptr, indices, _ = kv.page_table_csr(["a"])
    q = torch.randn(1, 2, 16).to(kv.config.torch_dtype)    # the model dtype: q is never cast
    kv.attention(0, q, indptr, indices, np.array([5], np.int32), np.array([0, 1], np.int32))
    assert seen == [kv.store.layer_format(0)] and seen[0].group_size == 8
    kv.free("a")


@pytest.mark.skipif(not CPU_AVAILABLE, reason="the CPU attention loops are not built")
@pytest.mark.parametrize("d", [1, 2, 3, 5, 48, 64, 80, 96, 128, 200, 256])
def test_cpu_rotation_of_q_and_out_is_the_definition_bit_for_bit(d):
    """The CPU backend rotates q and unrotates its output with the C row function; it
    must give exactly what pagedkv.format.rotation defines."""
    from pagedkv.format.rotation import rotate, unrotate
    from pagedkv.ops import attention_cpu

    gen = torch.Generator().manual_seed(d)
    x = torch.randn(7, 3, d, generator=gen) * torch.logspace(-3, 3, d)
    signs = rotation_signs(d, 11)
    got = attention_cpu._hadamard_(x.clone(), signs, inverse=False)
    assert torch.equal(got, rotate(x, signs))
    assert torch.equal(attention_cpu._hadamard_(got.clone(), signs, inverse=True), unrotate(got, signs))


@pytest.mark.skipif(not CPU_AVAILABLE, reason="the CPU attention loops are not built")
def test_a_rotated_arena_leaves_the_callers_q_unchanged():
    """The CPU backend rotates a copy of q (a float32 contiguous q is its own float32
    view) and matches the reference."""
    gen = torch.Generator().manual_seed(3)
    args, kw, vmax = build("int8", "NHD", 64, 16, 2, 6, [40, 9], [1, 3], gen, rot=True)
    q = args[0]
    before = q.clone()
    got = paged_attention(*args, backend="cpu", **kw)
    assert torch.equal(q, before)
    check_close(got, paged_attention(*args, backend="reference", **kw), vmax, torch.float32)
