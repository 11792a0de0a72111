"""One definition of what a read returns (DESIGN.md), at the attention op.

During a forward pass the rows that pass wrote are read at model precision (``k_new``,
``v_new``, ``pending``); older rows from their stored format, except the window and sink
rows kept exact, which are the ``kv_window`` rows *before* the pending ones. Every
backend (the CPU loops, the CUDA kernels in host emulation) is compared element for
element with the float64 definition over every format, layout, window, sink, rotation
and block-key combination the attention tests cover; the definition itself is checked
against torch's SDPA over rows assembled by hand.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv.errors import DeviceError, DTypeError, InvalidArgumentError, ShapeError
from pagedkv.ops import ExactRows, paged_attention
from pagedkv.ops import reference as ref
from pagedkv.ops.paged_attention import CPU_AVAILABLE
from test_paged_attention import build, cases, check_close

CPU = pytest.mark.skipif(not CPU_AVAILABLE, reason="CPU loops not built")


def new_rows(args, h, gen, scale=3.0):
    """The pass's own K/V for every query token, far from the arena's values."""
    q = args[0]
    k = (torch.randn(q.shape[0], h, q.shape[2], generator=gen) * scale).to(q.dtype)
    v = (torch.randn(q.shape[0], h, q.shape[2], generator=gen) * scale).to(q.dtype)
    return k, v


def some_pending(args, gen):
    """A count per sequence in [0, its queries], as an int32 tensor."""
    qp = args[5].tolist()
    return torch.tensor([int(torch.randint(0, qp[b + 1] - qp[b] + 1, (1,), generator=gen))
                         for b in range(len(qp) - 1)], dtype=torch.int32)


@CPU
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(c=cases(), seed=st.integers(0, 2**16), all_queries=st.booleans())
def test_cpu_reads_the_pass_rows_as_the_definition_does(c, seed, all_queries):
    gen = torch.Generator().manual_seed(seed)
    args, kw, vmax = build(c["fmt"], c["layout"], c["d"], c["bs"], c["h"], c["hq"], c["lens"], c["nqs"], gen,
                           rot=c["rot"], block_keys=c["block_keys"])
    k_new, v_new = new_rows(args, c["h"], gen)
    pending = None if all_queries else some_pending(args, gen)
    opts = dict(kw, window=c["window"], sink_tokens=c["sink"], soft_cap=c["cap"], num_splits=c["splits"],
                k_new=k_new, v_new=v_new, pending=pending)
    want = paged_attention(*args, backend="reference", **opts)
    got = paged_attention(*args, backend="cpu", **opts)
    check_close(got, want, max(float(vmax), float(v_new.abs().max())), args[0].dtype)


@pytest.mark.parametrize("backend", ["reference", pytest.param("cpu", marks=CPU)])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_the_pass_rows_replace_the_arenas_rows(backend, layout):
    """An arena holding anything at the pass's positions, plus ``k_new``/``v_new``, reads
    as the same arena with those rows written there: the pass's rows come from the caller."""
    gen = torch.Generator().manual_seed(4)
    lens, bs = [40, 9, 3], 4
    args, kw, vmax = build("float32", layout, 16, bs, 2, 4, lens, [5, 9, 1], gen)
    q, kv, indptr, indices, seq_lens, qp = args
    k_new, v_new = new_rows(args, 2, gen)
    pending = torch.tensor([3, 9, 0], dtype=torch.int32)
    got = paged_attention(*args, backend=backend, k_new=k_new, v_new=v_new, pending=pending, **kw)
    slots, rows = [], []
    for b, (n, p) in enumerate(zip(lens, pending.tolist())):
        for pos in range(n - p, n):
            slots.append(int(indices[int(indptr[b]) + pos // bs]) * bs + pos % bs)
            rows.append(int(qp[b + 1]) - n + pos)
    written = kv.clone()
    ref.write_kv(written, torch.tensor(slots), k_new[rows], v_new[rows], layout=layout)
    want = paged_attention(q, written, indptr, indices, seq_lens, qp, backend="reference", layout=layout)
    check_close(got, want, max(float(vmax), float(v_new.abs().max())), q.dtype)
    # and without the pass's rows the arena's are read: a different answer
    assert float((paged_attention(*args, backend=backend, **kw) - got).abs().max()) > 1e-2


def test_the_definition_equals_sdpa_over_rows_assembled_by_hand():
    gen = torch.Generator().manual_seed(0)
    args, kw, _ = build("int8", "NHD", 16, 4, 2, 6, [10, 14], [3, 4], gen)
    q, kv, indptr, indices, lens, qp = args
    k_new, v_new = new_rows(args, 2, gen)
    pending = torch.tensor([3, 2], dtype=torch.int32)
    got = paged_attention(*args, backend="reference", k_new=k_new, v_new=v_new, pending=pending, **kw)
    k, v = ref.gather_kv(kv, indptr, indices, lens, out_dtype=torch.float32, kv_scale=kw["kv_scale"],
                         kv_zero=kw["kv_zero"])
    outs, base = [], 0
    for b, (n, nq) in enumerate(zip(lens.tolist(), (qp[1:] - qp[:-1]).tolist())):
        kk, vv = k[base:base + n].clone(), v[base:base + n].clone()
        p = int(pending[b])
        kk[n - p:], vv[n - p:] = k_new[qp[b + 1] - p:qp[b + 1]], v_new[qp[b + 1] - p:qp[b + 1]]
        qq = q[qp[b]:qp[b + 1]].transpose(0, 1)
        mask = torch.arange(n)[None] <= torch.arange(n - nq, n)[:, None]
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            qq, kk.transpose(0, 1), vv.transpose(0, 1), attn_mask=mask, enable_gqa=True).transpose(0, 1))
        base += n
    torch.testing.assert_close(got, torch.cat(outs), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["reference", pytest.param("cpu", marks=CPU)])
def test_the_window_is_the_rows_before_the_pending_ones(backend):
    """ExactRows' recent rows end where the pass's rows begin (as gather_pages(pending=))."""
    gen = torch.Generator().manual_seed(3)
    args, kw, vmax = build("int4", "NHD", 32, 4, 2, 4, [23, 9], [4, 2], gen, rot=True)
    q, kv, indptr, indices, lens, qp = args
    nb = kv.shape[0]
    data = torch.randn(nb, 2, 4, 2, 32, generator=gen) * 3
    slot_of = torch.arange(nb, dtype=torch.int64)          # every block held
    exact = ExactRows(data, slot_of, torch.ones(nb, 4, dtype=torch.bool), recent=5, sink=2)
    k_new, v_new = new_rows(args, 2, gen)
    pending = torch.tensor([4, 1], dtype=torch.int32)
    got = paged_attention(*args, backend=backend, exact_rows=exact, k_new=k_new, v_new=v_new, pending=pending, **kw)
    # by hand: the gathered rows, the exact rows of [end - 5, end) and the sinks, then the pass's rows
    k_all, v_all = ref.gather_kv(kv, indptr, indices, lens, out_dtype=torch.float32,
                                 **{k: v for k, v in kw.items() if k != "layout"})
    rows_k, rows_v, base = [], [], 0
    for b, n in enumerate(lens.tolist()):
        kk, vv = k_all[base:base + n].clone(), v_all[base:base + n].clone()
        base += n
        p = int(pending[b])
        end = n - p
        lo = max(0, end - 5)
        blocks = indices[indptr[b]:indptr[b + 1]].long()
        for pos in list(range(min(2, lo))) + list(range(lo, end)):
            kk[pos], vv[pos] = data[blocks[pos // 4], 0, pos % 4], data[blocks[pos // 4], 1, pos % 4]
        kk[end:], vv[end:] = k_new[qp[b + 1] - p:qp[b + 1]], v_new[qp[b + 1] - p:qp[b + 1]]
        rows_k.append(kk)
        rows_v.append(vv)
    flat = torch.zeros(nb, 2, 4, 2, 32)
    slots = torch.cat([(indices[indptr[b]:indptr[b + 1]].long()[:, None] * 4 + torch.arange(4)).flatten()[:n]
                       for b, n in enumerate(lens.tolist())])
    ref.write_kv(flat, slots, torch.cat(rows_k), torch.cat(rows_v))
    want = paged_attention(q, flat, indptr, indices, lens, qp, backend="reference")
    check_close(got, want, max(float(vmax), 3 * float(data.abs().max())), torch.float32)


# ---- the CUDA kernels (host emulation) ---------------------------------------------------


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("fmt, rot, block_keys", [
    ("float32", False, False), ("bfloat16", False, False), ("int8", False, False), ("int8", True, False),
    ("int4", True, True), ("int4", False, True), ("int3", True, False), ("fp8_e4m3", False, False),
])
def test_the_cuda_kernels_read_the_pass_rows_as_the_definition_does(layout, fmt, rot, block_keys):
    from pagedkv.kernels import emulation

    gen = torch.Generator().manual_seed(5)
    args, kw, vmax = build(fmt, layout, 16, 4, 2, 6, [1, 23, 41, 9], [1, 4, 13, 1], gen, rot=rot,
                           block_keys=block_keys)
    k_new, v_new = new_rows(args, 2, gen)
    bound = max(float(vmax), float(v_new.abs().max()))
    for opts in (dict(), dict(pending=torch.tensor([1, 2, 13, 0], dtype=torch.int32)),
                 dict(window=6, sink_tokens=2, soft_cap=4.0, num_splits=3)):
        opts = dict(kw, k_new=k_new, v_new=v_new, **opts)
        want = paged_attention(*args, backend="reference", **opts)
        check_close(emulation.paged_attention(*args, **opts), want, bound, args[0].dtype)


# ---- errors ---------------------------------------------------------------------------


def _small():
    gen = torch.Generator().manual_seed(0)
    args, kw, _ = build("int8", "NHD", 8, 4, 2, 4, [9, 3], [1, 2], gen)
    return args, kw, new_rows(args, 2, gen)


@pytest.mark.parametrize("backend", ["reference", "cpu", "emulation"])
@pytest.mark.parametrize("change, error, match", [
    (dict(v_new=None), InvalidArgumentError, r"v_new: expected a tensor \(k_new and v_new go together\), got None"),
    (dict(k_new=None, v_new=None, pending=np.array([1, 1])), InvalidArgumentError,
     r"pending: expected None without k_new and v_new"),
    (dict(k_new="k"), DTypeError, r"k_new: expected a torch.Tensor, got str"),
    (dict(k_new=torch.zeros(3, 2, 8, dtype=torch.float16)), DTypeError,
     r"k_new: expected dtype torch.float32 \(q's: the model's K/V as computed\), got torch.float16"),
    (dict(v_new=torch.zeros(3, 1, 8)), ShapeError,
     r"v_new: expected \[num_q_tokens, num_kv_heads, head_dim\] = \[3, 2, 8\], got \(3, 1, 8\)"),
    (dict(k_new=torch.zeros(3, 2, 8, device="meta")), DeviceError, r"k_new: expected device cpu"),
    (dict(pending=np.array([1, 3])), InvalidArgumentError,
     r"pending: expected 0 <= pending\[1\] <= 2 \(the sequence's queries"),
    (dict(pending=np.array([-1, 0])), InvalidArgumentError, r"pending: expected 0 <= pending\[0\] <= 1"),
    (dict(pending=np.array([1])), ShapeError, r"pending: expected \[2\] \(one count per sequence\), got \(1,\)"),
    (dict(pending=torch.tensor([1, 1])), DTypeError, r"pending: expected dtype int32"),
])
def test_bad_pass_rows_raise_typed_errors(backend, change, error, match):
    args, kw, (k_new, v_new) = _small()
    opts = dict(kw, k_new=k_new, v_new=v_new)
    opts.update(change)
    if backend == "emulation":
        from pagedkv.kernels import emulation

        def run():
            return emulation.paged_attention(*args, **opts)
    else:
        def run():
            return paged_attention(*args, backend=backend, **opts)
    with pytest.raises(error, match=match):
        run()
