"""KV data ops: the fast CPU backend against the torch reference and a dense model.

Every behaviour test runs on both CPU backends ("reference" and "cpu") through the
dispatch layer. Equality with the reference over random shapes runs for every
backend in test_backends.py; here only what the CPU loops add (the parallel path,
threads rewriting the slot mapping) is compared element for element.
"""

import pytest
import torch

import pagedkv.ops as ops
from backend_cases import (KV_DTYPES, MODEL_DTYPES, Layer, calls_while_flipping, csr, expected_rows, padded, rand_kv, same,
                           same_state)
from pagedkv.errors import (
    DeviceError,
    DTypeError,
    InvalidArgumentError,
    InvalidBlockError,
    KernelUnavailableError,
    ShapeError,
)
from pagedkv.ops import cpu as cpu_ops
from pagedkv.ops import reference as ref

needs_cpu_ops = pytest.mark.skipif(not cpu_ops.AVAILABLE, reason="pagedkv.ops._cpu_copy is not built")

BACKENDS = ["reference", pytest.param("cpu", marks=needs_cpu_ops)]


# -- round trips against a dense model -------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("h,d", [(3, 64), (2, 7), (1, 1)])
def test_write_then_gather_matches_dense_model(backend, layout, kv_dtype, h, d):
    nb, bs = 12, 4
    L = Layer(nb, bs, h, d, kv_dtype, layout)
    d = L.d  # grouped formats round head_dim up to a whole pack
    # three sequences with non-contiguous blocks; partial last blocks
    tables = [[7, 2, 9], [0], [11, 4, 5, 1]]
    lens = [10, 3, 13]
    k, v = rand_kv(sum(lens), h, d, L.model_dtype)
    slots = []
    for t, n in zip(tables, lens):
        slots += [t[i // bs] * bs + i % bs for i in range(n)]
    # prefill in two steps with padding (-1) mixed in
    slot_t = torch.tensor(slots, dtype=torch.int64)
    half = len(slots) // 2
    pad = torch.tensor([-1, -7], dtype=torch.int64)
    zk = torch.zeros(2, h, d, dtype=L.model_dtype)
    ops.write_kv(L.kv, torch.cat([slot_t[:half], pad]), torch.cat([k[:half], zk]), torch.cat([v[:half], zk]),
                 backend=backend, **L.kw())
    ops.write_kv(L.kv, torch.cat([pad, slot_t[half:]]), torch.cat([zk, k[half:]]), torch.cat([zk, v[half:]]),
                 backend=backend, **L.kw())
    out_dtype = L.model_dtype
    want_k = expected_rows(k, L.quant, out_dtype, L.group)
    want_v = expected_rows(v, L.quant, out_dtype, L.group)
    gk, gv = ops.gather_kv(L.kv, *csr(tables, lens), backend=backend, **L.gather_kw())
    assert gk.shape == (sum(lens), h, d) and gk.dtype == out_dtype and gk.is_contiguous()
    assert same(gk, want_k) and same(gv, want_v)
    pk, pv = ops.gather_kv_padded(L.kv, *padded(tables, lens, width=6), backend=backend, **L.gather_kw())
    assert same(pk, want_k) and same(pv, want_v)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gather_reads_only_needed_blocks_and_empty_sequences(backend):
    L = Layer(6, 4, 2, 8, torch.float32, random=True)
    # sequence 0 lists a spare block past its tokens; sequence 1 is empty
    tables, lens = [[3, 1, 5], [], [2]], [5, 0, 4]
    k, v = ops.gather_kv(L.kv, *csr(tables, lens), backend=backend)
    want_k = torch.cat([L.kv[3, 0], L.kv[1, 0, :1], L.kv[2, 0]])
    want_v = torch.cat([L.kv[3, 1], L.kv[1, 1, :1], L.kv[2, 1]])
    assert same(k, want_k) and same(v, want_v)
    # padding may hold anything past the needed blocks (here: -1 and out-of-range ids)
    table = torch.tensor([[3, 1, 99], [-1, -1, -1], [2, 77, -1]], dtype=torch.int32)
    pk, pv = ops.gather_kv_padded(L.kv, table, torch.tensor(lens, dtype=torch.int32), backend=backend)
    assert same(pk, want_k) and same(pv, want_v)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch_and_zero_tokens(backend):
    L = Layer(4, 4, 2, 8, torch.float16, random=True)
    before = L.state()
    e = torch.zeros(0, dtype=torch.int64)
    ops.write_kv(L.kv, e, torch.zeros(0, 2, 8, dtype=torch.float16), torch.zeros(0, 2, 8, dtype=torch.float16),
                 backend=backend)
    assert same_state(L.state(), before)
    k, v = ops.gather_kv(L.kv, torch.zeros(1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32),
                         torch.zeros(0, dtype=torch.int32), backend=backend)
    assert k.shape == (0, 2, 8) and v.shape == (0, 2, 8)
    k, v = ops.gather_kv_padded(L.kv, torch.zeros(2, 0, dtype=torch.int32), torch.zeros(2, dtype=torch.int32),
                                backend=backend)
    assert k.shape == (0, 2, 8)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gather_into_given_outputs(backend):
    L = Layer(6, 4, 2, 8, torch.bfloat16, random=True)
    tables, lens = [[4, 0]], [6]
    ok = torch.empty(6, 2, 8, dtype=torch.bfloat16)
    ov = torch.empty(6, 2, 8, dtype=torch.bfloat16)
    k, v = ops.gather_kv(L.kv, *csr(tables, lens), out_key=ok, out_value=ov, backend=backend)
    assert k.data_ptr() == ok.data_ptr() and v.data_ptr() == ov.data_ptr()
    assert same(ok, torch.cat([L.kv[4, 0], L.kv[0, 0, :2]]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_strided_sources_are_read_correctly(backend, layout):
    # key/value as slices of a fused qkv projection: token stride != H * D
    L = Layer(8, 4, 3, 16, torch.float32, layout)
    qkv = torch.randn(10, 3, 3 * 16)
    k, v = qkv[:, :, 16:32], qkv[:, :, 32:]
    slots = torch.arange(10, dtype=torch.int64) * 3
    ops.write_kv(L.kv, slots, k, v, backend=backend, layout=layout)
    table, lens = padded([list(range(8))], [32])
    gk, gv = ops.gather_kv_padded(L.kv, table, lens, backend=backend, layout=layout)
    assert same(gk[slots], k.contiguous()) and same(gv[slots], v.contiguous())
    # a strided head_dim (every other element) is legal too
    k2 = torch.randn(10, 3, 32)[:, :, ::2]
    ops.write_kv(L.kv, slots, k2, v, backend=backend, layout=layout)
    gk, _ = ops.gather_kv_padded(L.kv, table, lens, backend=backend, layout=layout)
    assert same(gk[slots], k2.contiguous())


# -- the fast path equals the reference, bit for bit --------------------------------------


def _both(kv_dtype, layout, nb, bs, h, d, seed):
    a = Layer(nb, bs, h, d, kv_dtype, layout, seed=seed, random=True)
    return a, a.clone()


@needs_cpu_ops
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_large_calls_parallel_path_equals_reference(threads, layout):
    # above the 64 KiB threshold the loops split work over OpenMP threads; the explicit
    # pagedkv setting forces them even on a busy machine (the automatic one goes serial)
    import pagedkv

    old, old_pkv = torch.get_num_threads(), pagedkv.get_num_threads()
    torch.set_num_threads(threads)
    pagedkv.set_num_threads(threads)
    try:
        a, b = _both(torch.float16, layout, 300, 16, 8, 64, seed=threads)
        slots = torch.randperm(300 * 16)[:1500]
        k, v = rand_kv(1500, 8, 64, torch.float16)
        ops.write_kv(a.kv, slots, k, v, backend="reference", layout=layout)
        ops.write_kv(b.kv, slots, k, v, backend="cpu", layout=layout)
        assert same(a.kv, b.kv)
        tables = [torch.randperm(300)[:70].tolist(), torch.randperm(300)[:3].tolist(), [5]]
        lens = [70 * 16 - 9, 40, 16]
        for gather, args in ((ops.gather_kv, csr(tables, lens)), (ops.gather_kv_padded, padded(tables, lens))):
            r = gather(a.kv, *args, backend="reference", layout=layout)
            c = gather(a.kv, *args, backend="cpu", layout=layout)
            assert same(r[0], c[0]) and same(r[1], c[1])
        arenas_a = [torch.randn(4, 300, 2, 16, 8, 64).half()]
        arenas_b = [arenas_a[0].clone()]
        perm = torch.randperm(300)
        pairs = torch.stack([perm[:100], perm[100:200]], 1)
        ops.copy_blocks(arenas_a, pairs, backend="reference")
        ops.copy_blocks(arenas_b, pairs, backend="cpu")
        assert same(arenas_a[0], arenas_b[0])
    finally:
        torch.set_num_threads(old)
        pagedkv.set_num_threads(old_pkv)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_arena_views_still_work(backend):
    # a per-layer view of an HND arena taken by slicing blocks is not contiguous
    base = Layer(8, 4, 2, 6, torch.float32, random=True)
    view = base.kv[::2]
    slots = torch.tensor([0, 5, 15], dtype=torch.int64)
    k, v = rand_kv(3, 2, 6, torch.float32)
    want = view.clone()
    ref.write_kv(want, slots, k, v)
    ops.write_kv(view, slots, k, v, backend=backend)
    assert same(view, want)
    arena = torch.randn(2, 8, 2, 4, 2, 6)[:, ::2]
    copy = arena.clone()
    ops.copy_blocks([arena], torch.tensor([[0, 3]]), backend=backend)
    assert same(arena[:, 3], copy[:, 0])


# -- layouts ---------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS + ["auto"])
def test_convert_layout_round_trip_and_equivalence(backend):
    nhd = Layer(5, 4, 3, 8, torch.float16, "NHD")
    hnd = Layer(5, 4, 3, 8, torch.float16, "HND")
    slots = torch.randperm(20)[:13]
    k, v = rand_kv(13, 3, 8, torch.float16)
    ops.write_kv(nhd.kv, slots, k, v, layout="NHD")
    ops.write_kv(hnd.kv, slots, k, v, layout="HND")
    assert same(ops.convert_layout(nhd.kv, "NHD", "HND", backend=backend), hnd.kv)
    assert same(ops.convert_layout(hnd.kv, "HND", "NHD", backend=backend), nhd.kv)
    whole = torch.stack([nhd.kv, nhd.kv * 2])
    back = ops.convert_layout(ops.convert_layout(whole, "NHD", "HND", backend=backend), "HND", "NHD", backend=backend)
    assert same(back, whole)
    same_layout = ops.convert_layout(whole, "NHD", "NHD", backend=backend)
    assert same(same_layout, whole) and same_layout.data_ptr() != whole.data_ptr()
    scale = torch.rand(2, 5, 2, 4, 3)
    s_hnd = ops.convert_layout(scale, "NHD", "HND", scale=True, backend=backend)
    assert s_hnd.shape == (2, 5, 2, 3, 4) and same(s_hnd, scale.transpose(-1, -2).contiguous())


# -- errors: typed, identical across backends, nothing written ------------------------------


def _err(backend, exc, pattern, fn, *args, **kw):
    with pytest.raises(exc, match=pattern):
        fn(*args, backend=backend, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_out_of_range_slot_writes_nothing(backend, layout):
    L = Layer(4, 4, 2, 8, torch.float16, layout, random=True)
    before = L.state()
    k, v = rand_kv(3, 2, 8, torch.float16)
    slots = torch.tensor([1, 2, 16], dtype=torch.int64)  # last one is past 4 * 4
    _err(backend, InvalidArgumentError,
         r"^slot_mapping: expected slots < 16 \(num_blocks \* block_size\), or negative to skip, got 16 at index 2$",
         ops.write_kv, L.kv, slots, k, v, layout=layout)
    assert same_state(L.state(), before)


@pytest.mark.parametrize("backend", BACKENDS)
def test_quantized_out_of_range_slot_writes_nothing(backend):
    L = Layer(4, 4, 2, 8, "int8", random=True)
    before = L.state()
    k, v = rand_kv(2, 2, 8, torch.float16)
    _err(backend, InvalidArgumentError, r"got 99 at index 0", ops.write_kv, L.kv,
         torch.tensor([99, 0], dtype=torch.int64), k, v, **L.kw())
    assert same_state(L.state(), before)


def _write_cases():
    f16 = torch.float16
    k = torch.zeros(2, 2, 8, dtype=f16)
    s = torch.tensor([0, 1], dtype=torch.int64)
    layer = torch.zeros(4, 2, 4, 2, 8, dtype=f16)
    q8 = torch.zeros(4, 2, 4, 2, 8, dtype=torch.int8)
    sc = torch.zeros(4, 2, 4, 2)
    return [
        ((layer, s, k.float(), k.float()), {}, DTypeError,
         r"^key: expected dtype torch.float16 \(the kv_layer dtype\), got torch.float32$"),
        ((layer, s, k, k.bfloat16()), {}, DTypeError, r"^value: expected dtype torch.float16 \(the kv_layer dtype\)"),
        ((layer, s, torch.zeros(2, 3, 8, dtype=f16), k), {}, ShapeError, r"^key: expected \[num_tokens, 2, 8\], got \(2, 3, 8\)$"),
        ((layer, s, k, k[:1]), {}, ShapeError, r"^value: expected shape \(2, 2, 8\) \(as key\), got \(1, 2, 8\)$"),
        ((layer, s.int(), k, k), {}, DTypeError, r"^slot_mapping: expected dtype int64, got torch.int32$"),
        ((layer, s[:1], k, k), {}, ShapeError, r"^slot_mapping: expected \[2\] \(one slot per token\), got \(1,\)$"),
        ((layer, s.view(2, 1), k, k), {}, ShapeError, r"^slot_mapping: expected a 1-D tensor, got \(2, 1\)$"),
        ((layer[0], s, k, k), {}, ShapeError, r"^kv_layer: expected a NHD layer view \[num_blocks, 2, block_size, H, D\]"),
        ((layer, s, k, k), dict(layout="nhd"), InvalidArgumentError, r"^layout: expected 'NHD' or 'HND', got 'nhd'$"),
        ((layer.int(), s, k, k), {}, DTypeError, r"^kv_layer: expected dtype float32, float16, bfloat16, float8_e4m3fn"),
        ((layer, s, k.numpy(), k), {}, DTypeError, r"^key: expected a torch.Tensor, got ndarray$"),
        ((layer, s, k, k), dict(kv_scale=sc), InvalidArgumentError,
         r"^kv_scale: expected None for an unquantized torch.float16 kv_layer, got a tensor$"),
        ((q8, s, k, k), dict(kv_scale=sc), InvalidArgumentError,
         r"^kv_zero: expected a float32 tensor of shape \(4, 2, 4, 2\) for a quantized kv_layer, got None$"),
        ((q8, s, k, k), dict(kv_scale=sc.half(), kv_zero=sc), DTypeError, r"^kv_scale: expected dtype float32, got torch.float16$"),
        ((q8, s, k, k), dict(kv_scale=sc[:2], kv_zero=sc), ShapeError, r"^kv_scale: expected shape \(4, 2, 4, 2\), got \(2, 2, 4, 2\)$"),
        ((q8, s, k.to(torch.int8), k.to(torch.int8)), dict(kv_scale=sc, kv_zero=sc), DTypeError,
         r"^key: expected dtype float32, float16 or bfloat16, got torch.int8$"),
        ((layer.to(torch.float8_e4m3fn), s, k, k), dict(kv_scale=sc, kv_zero=sc), InvalidArgumentError,
         r"^kv_zero: expected None for an fp8 kv_layer, got a tensor$"),
        ((layer, s.to("meta"), k, k), {}, DeviceError, r"^slot_mapping: expected device cpu, got meta$"),
    ]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", range(len(_write_cases())))
def test_write_argument_errors(backend, case):
    args, kw, exc, pattern = _write_cases()[case]
    before = args[0].clone()
    _err(backend, exc, pattern, ops.write_kv, *args, **kw)
    assert same(args[0], before)


def _gather_cases():
    i32 = torch.int32
    t = lambda *x: torch.tensor(x, dtype=i32)  # noqa: E731
    layer = torch.zeros(4, 2, 4, 2, 8, dtype=torch.float16)
    q8 = torch.zeros(4, 2, 4, 2, 8, dtype=torch.int8)
    sc = torch.zeros(4, 2, 4, 2)
    return [
        (layer, (t(0, 2), t(1, 2), t(9)), {}, InvalidArgumentError,
         r"^seq_lens: expected 0 <= seq_lens\[0\] <= 8 \(2 blocks\), got 9$"),
        (layer, (t(0, 2), t(1, 2), t(-1)), {}, InvalidArgumentError, r"^seq_lens: expected 0 <= seq_lens\[0\] <= 8"),
        (layer, (t(0, 3), t(1, 2), t(5)), {}, InvalidArgumentError,
         r"^indptr: expected non-decreasing offsets in \[0, 2\], got indptr\[0:2\] = \[0, 3\]$"),
        (layer, (t(0, 2, 1), t(1, 2), t(5, 0)), {}, InvalidArgumentError,
         r"^indptr: expected non-decreasing offsets in \[0, 2\], got indptr\[1:3\] = \[2, 1\]$"),
        (layer, (t(0, 1, 3), t(1, 2, 4), t(4, 5)), {}, InvalidBlockError,
         r"^indices: expected block ids in \[0, 4\), got 4 at sequence 1, block 1$"),
        (layer, (t(0, 1), t(-2), t(1)), {}, InvalidBlockError,
         r"^indices: expected block ids in \[0, 4\), got -2 at sequence 0, block 0$"),
        (layer, (t(0, 1), t(1), t(1, 1)), {}, ShapeError, r"^seq_lens: expected \[1\] \(len\(indptr\) - 1\), got \(2,\)$"),
        (layer, (torch.tensor([0, 1]), t(1), t(1)), {}, DTypeError, r"^indptr: expected dtype int32, got torch.int64$"),
        (layer, (t(0, 1), t(1), t(1)), dict(out_dtype=torch.float32), DTypeError,
         r"^out_dtype: expected None or torch.float16 \(the kv_layer dtype\), got torch.float32$"),
        (q8, (t(0, 1), t(1), t(1)), dict(kv_scale=sc, kv_zero=sc), DTypeError,
         r"^out_dtype: expected float32, float16 or bfloat16 for a quantized torch.int8 kv_layer, got None$"),
        (layer, (t(0, 1), t(1), t(3)), dict(out_key=torch.empty(2, 2, 8, dtype=torch.float16),
                                           out_value=torch.empty(3, 2, 8, dtype=torch.float16)), ShapeError,
         r"^out_key: expected shape \(3, 2, 8\), got \(2, 2, 8\)$"),
        (layer, (t(0, 1), t(1), t(3)), dict(out_key=torch.empty(3, 2, 8, dtype=torch.float16)), InvalidArgumentError,
         r"^out_value: expected a tensor when the other output is given, got None$"),
        (layer, (t(0, 1), t(1), t(3)), dict(out_key=torch.empty(3, 2, 8), out_value=torch.empty(3, 2, 8)), DTypeError,
         r"^out_key: expected dtype torch.float16, got torch.float32$"),
        (layer, (t(0, 1), t(1), t(3)), dict(out_key=torch.empty(2, 3, 8, dtype=torch.float16).transpose(0, 1),
                                           out_value=torch.empty(3, 2, 8, dtype=torch.float16)),
         InvalidArgumentError, r"^out_key: expected a contiguous tensor, got strides"),
    ]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", range(len(_gather_cases())))
def test_gather_argument_errors(backend, case):
    layer, args, kw, exc, pattern = _gather_cases()[case]
    _err(backend, exc, pattern, ops.gather_kv, layer, *args, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
def test_padded_gather_errors(backend):
    layer = torch.zeros(4, 2, 4, 2, 8)
    t = lambda rows: torch.tensor(rows, dtype=torch.int32)  # noqa: E731
    _err(backend, InvalidArgumentError,
         r"^seq_lens: expected 0 <= seq_lens\[1\] <= 8 \(max_blocks \* block_size\), got 9$",
         ops.gather_kv_padded, layer, t([[0, 1], [2, 3]]), torch.tensor([8, 9], dtype=torch.int32))
    _err(backend, InvalidBlockError, r"^block_table: expected block ids in \[0, 4\), got -1 at row 1, column 1$",
         ops.gather_kv_padded, layer, t([[0, 1], [2, -1]]), torch.tensor([8, 5], dtype=torch.int32))
    _err(backend, ShapeError, r"^block_table: expected \[batch_size, max_blocks\], got \(4,\)$",
         ops.gather_kv_padded, layer, t([0, 1, 2, 3]), torch.tensor([8], dtype=torch.int32))
    _err(backend, ShapeError, r"^seq_lens: expected \[2\] \(block_table rows\), got \(1,\)$",
         ops.gather_kv_padded, layer, t([[0], [1]]), torch.tensor([1], dtype=torch.int32))


@pytest.mark.parametrize("backend", BACKENDS)
def test_copy_blocks_errors_leave_arenas_unchanged(backend):
    a = [torch.randn(2, 6, 2, 4, 2, 8), torch.randn(2, 6, 2, 4, 2)]
    before = [x.clone() for x in a]
    cases = [
        (torch.tensor([[0, 1], [2, 1]]), InvalidBlockError, r"^pairs: expected distinct dst block ids, got 1 twice \(row 1\)$"),
        (torch.tensor([[0, 1], [1, 2]]), InvalidBlockError,
         r"^pairs: expected dst ids that are not also src ids, got 1 \(row 0\)$"),
        (torch.tensor([[0, 1], [6, 2]]), InvalidBlockError, r"^pairs: expected block ids in \[0, 6\), got 6 at src row 1$"),
        (torch.tensor([[0, -1]]), InvalidBlockError, r"^pairs: expected block ids in \[0, 6\), got -1 at dst row 0$"),
        (torch.tensor([0, 1]), ShapeError, r"^pairs: expected \[num_pairs, 2\] \(src, dst\), got \(2,\)$"),
        (torch.tensor([[0.0, 1.0]]), DTypeError, r"^pairs: expected dtype int64 or int32, got torch.float32$"),
        (torch.tensor([[0, 1]], device="meta"), DeviceError, r"^pairs: expected device cpu, got meta$"),
    ]
    for pairs, exc, pattern in cases:
        _err(backend, exc, pattern, ops.copy_blocks, a, pairs)
        assert same_state(a, before)
    _err(backend, ShapeError, r"^arenas\[1\]: expected 6 blocks in dim 1 \(as arenas\[0\]\), got \(2, 5\)$",
         ops.copy_blocks, [a[0], a[1][:, :5]], torch.tensor([[0, 1]]))
    _err(backend, InvalidArgumentError, r"^arenas: expected a tensor or a non-empty list of tensors, got list$",
         ops.copy_blocks, [], torch.tensor([[0, 1]]))
    ops.copy_blocks(a, torch.zeros(0, 2, dtype=torch.int64), backend=backend)  # no pairs: a no-op
    assert same_state(a, before)


@pytest.mark.parametrize("backend", BACKENDS)
def test_swap_blocks_errors_leave_arenas_unchanged(backend):
    dev = torch.randn(2, 6, 2, 4, 2, 8)
    host = torch.zeros(2, 3, 2, 4, 2, 8)
    before = (dev.clone(), host.clone())
    _err(backend, InvalidBlockError, r"^pairs: expected block ids in \[0, 3\), got 3 at dst row 1$",
         ops.swap_blocks, dev, host, torch.tensor([[0, 0], [1, 3]]))
    _err(backend, InvalidBlockError, r"^pairs: expected distinct dst block ids, got 0 twice \(row 1\)$",
         ops.swap_blocks, dev, host, torch.tensor([[0, 0], [1, 0]]))
    _err(backend, DTypeError, r"^dst_arenas\[0\]: expected dtype torch.float32 \(as src_arenas\[0\]\), got torch.float16$",
         ops.swap_blocks, dev, host.half(), torch.tensor([[0, 0]]))
    _err(backend, ShapeError, r"^dst_arenas\[0\]: expected shape \(2, 'num_blocks', 2, 4, 2, 8\)",
         ops.swap_blocks, dev, torch.zeros(2, 3, 2, 4, 2, 4), torch.tensor([[0, 0]]))
    _err(backend, InvalidArgumentError, r"^dst_arenas: expected 1 tensors \(as src_arenas\), got 2$",
         ops.swap_blocks, [dev], [host, host], torch.tensor([[0, 0]]))
    # the same arena on both sides behaves like copy_blocks
    _err(backend, InvalidBlockError, r"^pairs: expected dst ids that are not also src ids, got 1 \(row 1\)$",
         ops.swap_blocks, dev, dev, torch.tensor([[1, 2], [3, 1]]))
    assert same(dev, before[0]) and same(host, before[1])


def test_convert_layout_errors():
    with pytest.raises(InvalidArgumentError, match=r"^dst_layout: expected 'NHD' or 'HND', got 'NCHW'$"):
        ops.convert_layout(torch.zeros(2, 2, 4, 2, 8), "NHD", "NCHW")
    with pytest.raises(ShapeError, match=r"^arena: expected arena \[L, NB, 2, a, b, D\] or layer \[NB, 2, a, b, D\]"):
        ops.convert_layout(torch.zeros(2, 3, 4, 2, 8), "NHD", "HND")
    with pytest.raises(ShapeError, match=r"^arena: expected scale arena"):
        ops.convert_layout(torch.zeros(2, 3, 4), "NHD", "HND", scale=True)


# -- dispatch --------------------------------------------------------------------------------


def test_resolve_backend():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert ops.resolve_backend("auto", cpu) == ("cpu" if cpu_ops.AVAILABLE else "reference")
    assert ops.resolve_backend("auto", cuda) == "cuda"
    assert ops.resolve_backend("auto", cpu, cuda) == "cuda"  # host <-> device swap
    assert ops.resolve_backend("auto", torch.device("meta")) == "reference"
    assert ops.resolve_backend("reference", cuda) == "reference"
    with pytest.raises(InvalidArgumentError, match=r"^backend: expected one of 'auto', 'cpu', 'cuda', 'reference', got 'gpu'$"):
        ops.resolve_backend("gpu", cpu)


@needs_cpu_ops
def test_auto_dispatch_uses_the_fast_path(monkeypatch):
    calls = []
    real = cpu_ops.write_kv
    monkeypatch.setattr(cpu_ops, "write_kv", lambda *a, **k: (calls.append(1), real(*a, **k)))
    L = Layer(2, 4, 1, 4, torch.float32)
    ops.write_kv(L.kv, torch.tensor([1]), torch.ones(1, 1, 4), torch.ones(1, 1, 4))
    assert calls == [1] and L.kv[0, 0, 1].sum().item() == 4.0


@needs_cpu_ops
def test_cpu_backend_rejects_non_cpu_tensors():
    layer = torch.zeros(2, 2, 4, 1, 4, device="meta")
    k = torch.zeros(1, 1, 4, device="meta")
    with pytest.raises(DeviceError, match=r"^kv_layer: expected a CPU tensor for the 'cpu' backend, got meta$"):
        ops.write_kv(layer, torch.tensor([0], device="meta"), k, k, backend="cpu")


def test_missing_cuda_path_raises_kernel_unavailable(monkeypatch):
    import importlib

    real_import = importlib.import_module

    def fake_import(name, *a, **k):
        if name == "pagedkv.kernels.ops":
            raise ImportError("No module named 'cuda'")
        return real_import(name, *a, **k)

    monkeypatch.setattr(importlib, "import_module", fake_import)
    L = Layer(2, 4, 1, 4, torch.float32)
    with pytest.raises(KernelUnavailableError, match=r"the CUDA kernels \(pagedkv.kernels.ops\) cannot be loaded"):
        ops.write_kv(L.kv, torch.tensor([1]), torch.ones(1, 1, 4), torch.ones(1, 1, 4), backend="cuda")


@needs_cpu_ops
def test_fast_path_accepts_all_model_dtypes_without_casting():
    for dt in MODEL_DTYPES:
        L = Layer(2, 4, 2, 3, dt)
        k, v = rand_kv(3, 2, 3, dt)
        ops.write_kv(L.kv, torch.tensor([0, 5, 7]), k, v, backend="cpu")
        assert same(L.kv[1, 0, 1], k[1]) and same(L.kv[1, 1, 3], v[2])


@pytest.mark.parametrize("backend", BACKENDS)
def test_partly_overlapping_outputs_are_refused(backend):
    L = Layer(6, 4, 2, 8, torch.float32, random=True)
    tables, lens = [[4, 0]], [6]
    buf = torch.full((12, 2, 8), 7.0)
    _err(backend, InvalidArgumentError, r"^out_value: expected memory disjoint from out_key, got bytes",
         ops.gather_kv, L.kv, *csr(tables, lens), out_key=buf[0:6], out_value=buf[3:9])
    assert torch.equal(buf, torch.full((12, 2, 8), 7.0))       # nothing written
    k, v = ops.gather_kv(L.kv, *csr(tables, lens), out_key=buf[0:6], out_value=buf[6:12], backend=backend)
    assert same(k, torch.cat([L.kv[4, 0], L.kv[0, 0, :2]])) and same(v, torch.cat([L.kv[4, 1], L.kv[0, 1, :2]]))


@needs_cpu_ops
@pytest.mark.parametrize("backend", ["cpu", "auto"])
def test_slots_rewritten_by_another_thread_never_store_out_of_range(backend):
    # The arena is a view of a larger buffer: a slot past the view lands in the canary
    # region, so a check-then-reread race shows up as changed canaries (or a crash).
    nb, bs, h, d = 4, 4, 2, 8
    whole = torch.zeros(nb + 4, 2, bs, h, d)
    kv = whole[:nb]
    k, v = rand_kv(8, h, d, torch.float32)
    slots = torch.arange(8, dtype=torch.int64)
    calls_while_flipping(slots, 5, nb * bs + 3, 5, lambda: ops.write_kv(kv, slots, k, v, backend=backend),
                         3000, InvalidArgumentError, "got 19 at index 5")
    assert torch.count_nonzero(whole[nb:]) == 0


def _sparse(t):
    return t.to_sparse()


def _meta(t):
    return t.to("meta")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("make, exc, got", [(_sparse, InvalidArgumentError, "a torch.sparse_coo tensor"),
                                            (_meta, DeviceError, "device")], ids=["sparse", "meta"])
@pytest.mark.parametrize("arg", ["kv_layer", "slot_mapping", "key", "indices", "pairs"])
def test_sparse_and_meta_tensors_get_typed_errors_and_change_nothing(backend, make, exc, got, arg):
    L = Layer(4, 4, 2, 8, torch.float32, random=True)
    before = L.state()
    k, v = rand_kv(3, 2, 8, torch.float32)
    args = dict(kv_layer=L.kv, slot_mapping=torch.tensor([0, 5, 9]), key=k)
    indptr, indices, lens = csr([[1, 2]], [6])
    pairs = torch.tensor([[0, 1]])
    if arg in args:
        args[arg] = make(args[arg])
        call = lambda: ops.write_kv(args["kv_layer"], args["slot_mapping"], args["key"], v, backend=backend)
    elif arg == "indices":
        call = lambda: ops.gather_kv(L.kv, indptr, make(indices), lens, backend=backend)
    else:
        call = lambda: ops.copy_blocks([L.kv[None]], make(pairs), backend=backend)
    with pytest.raises(exc, match=r"expected device \S+, got (meta|cpu)$" if exc is DeviceError
                       else f"expected a dense \\(strided\\) tensor, got {got}"):
        call()
    assert same_state(L.state(), before)
