"""Shared helpers of the data-op backend tests (test_backends.py and the
backend-specific files): the :class:`Backend` under test, byte-exact comparison, and
small layers, tokens, tables and arenas in odd sizes (partial blocks everywhere).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from typing import Optional

import pytest
import torch

from pagedkv.format import dtypes
from pagedkv.format.quant import dequantize, quantize
from pagedkv.ops import backends
from pagedkv.ops import reference as ref

MODEL = tuple(d.torch_dtype for d in dtypes.MODEL)
# storage formats by kv_dtype name: int4 and int3 share the uint8 storage dtype (int3's
# bfloat16 scale/zero views tell them apart)
QUANT = tuple(d.name for d in dtypes.QUANTIZED)
# int4 cases: head_dim (made even) -> group size; 9 makes a byte span two groups
INT4_GROUPS = {4: 2, 16: 4, 18: 9, 32: 8, 64: 32, 80: 16, 128: 64}
# int3 cases: head_dim (made a multiple of 8) -> group size (a multiple of 8)
INT3_GROUPS = {8: 8, 16: 8, 24: 24, 32: 16, 64: 32, 80: 40, 128: 32}
# int2 cases: head_dim (made a multiple of 4) -> group size (a multiple of 4)
INT2_GROUPS = {4: 4, 8: 4, 16: 8, 20: 4, 32: 16, 64: 32, 80: 20, 128: 64}
GROUPS = {"int4": INT4_GROUPS, "int3": INT3_GROUPS, "int2": INT2_GROUPS}
LAYOUTS = ("NHD", "HND")
SMALL_GRID = dict(grid=(2, 3, 1), block=(4, 2, 1))  # 48 threads for hundreds of items
ONE_THREAD = dict(grid=(1, 1, 1), block=(1, 1, 1))
NB, BS, H = 7, 5, 3  # odd sizes: partial blocks everywhere

NO_GPU = ("no CUDA GPU here (torch.cuda.is_available() is False); the kernels are compiled by "
          "test_kernels_compile.py and run on the CPU by the 'emulated' backend")


def name(x) -> str:
    return str(x).replace("torch.", "")


def quant_name(qdtype: str) -> str:
    """Test id of a storage format (its kv_dtype name)."""
    return qdtype


def storage(qdtype: str) -> torch.dtype:
    """The data arena's torch dtype of a storage format (int4, int3: uint8)."""
    return dtypes.info(qdtype).torch_dtype


def params(qdtype: str) -> torch.dtype:
    """The scale/zero views' torch dtype of a storage format (int3: bfloat16)."""
    return dtypes.info(qdtype).param_dtype


def quant_dim(qdtype: str, d: int) -> int:
    """The head_dim a case of ``qdtype`` runs with (int4 needs an even one, int3 a multiple of 8)."""
    pack = dtypes.info(qdtype).pack
    return -(-d // pack) * pack


def quant_views(layout, qdtype, d, *, nb=NB, bs=BS, h=H):
    """``(data shape, scale/zero shape, has zero point)`` of a quantized layer of head_dim
    ``d``: int4 packs two codes per byte, int3 eight per three bytes, and both keep
    ``d / group`` scales per row."""
    row = dtypes.info(qdtype)
    shape = layer_shape(layout, nb, bs, h, row.stored_dim(d))
    sshape = shape[:-1] + ((d // GROUPS[qdtype][d],) if row.grouped else ())
    return shape, sshape, row.zero_point


class Backend:
    """One data-op backend under test: its module, the device its tensors live on, and
    the launch-dim overrides to run each case with (the emulation also runs every
    grid-stride loop with far fewer threads than work)."""

    def __init__(self, backend: str):
        self.name = backend
        self.ops = backends.load(backend)
        self.device = torch.device("cuda" if backend == "cuda" else "cpu")
        self.kernels = backend in ("emulated", "cuda")
        self.dims = ({}, SMALL_GRID, ONE_THREAD) if backend == "emulated" else ({},)
        if self.kernels:
            from pagedkv.kernels import sources

            self.quant = tuple(q for q in QUANT if dtypes.info(q).kernel_name in sources.QUANT_TYPES)
        else:
            self.quant = QUANT
        # where copy_blocks pairs may live: the CUDA path takes them on either side
        self.pair_devices = ("cpu", "cuda") if backend == "cuda" else ("cpu",)

    def __repr__(self) -> str:
        return self.name

    def copy(self, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """A fresh copy of a contiguous ``t`` on this backend's device, at the same
        element offset into its storage (a misaligned input stays misaligned)."""
        if t is None:
            return None
        return offset_view(t, t.storage_offset(), self.device)

    def host(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy the backend can swap into (pinned for CUDA)."""
        t = t.clone()
        return t.pin_memory() if self.device.type == "cuda" else t

    def require_quant(self, qdtype) -> None:
        """Skip a case of a storage format this backend has no implementation of."""
        if qdtype not in self.quant:
            pytest.skip(f"the {self.name} backend has no {quant_name(qdtype)} kernel")

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def make_backend(backend: str) -> Backend:
    """The backend, or a skip with the reason it cannot run here."""
    if backend == "cuda" and not torch.cuda.is_available():
        pytest.skip(NO_GPU)
    if backend == "emulated":
        from pagedkv.kernels import emulation

        if shutil.which(emulation.CXX) is None:
            pytest.skip(f"the host emulation needs {emulation.CXX}")
    if backend == "cpu" and not backends.cpu_ops_built():
        pytest.skip("the fast CPU ops are not built")
    return Backend(backend)


# ----------------------------------------------------------------------------------
# comparison


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def assert_same(got: torch.Tensor, want: torch.Tensor, *, zero_sign: bool = True) -> None:
    """Byte-for-byte equal (``got`` may be on a GPU); NaNs of float tensors only need
    to be NaN on both sides (their payload bits are not part of the contract).

    ``zero_sign=False`` also takes -0.0 for 0.0: for zero-point views, whose minimum
    torch.amin returns with either zero's sign depending on the zero's position and
    the CPU's vector width (the sign changes no code and no dequantized value).
    """
    got, want = got.cpu(), want.cpu()
    if not zero_sign:
        got, want = got + 0.0, want + 0.0  # -0.0 + 0.0 == +0.0; NaN stays NaN
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    if got.dtype.is_floating_point and got.element_size() > 1:
        gn, wn = torch.isnan(got.float()), torch.isnan(want.float())
        assert torch.equal(gn, wn), "NaN positions differ"
        got, want = got.masked_fill(gn, 0), want.masked_fill(wn, 0)
    same = raw(got) == raw(want)
    assert bool(same.all()), f"{int((~same).sum())} of {same.numel()} bytes differ"


def assert_same_views(got, want) -> None:
    """:func:`assert_same` over ``[data, scale, zero]`` (zero may be None; see zero_sign)."""
    for i, (g, w) in enumerate(zip(got, want)):
        if w is not None:
            assert_same(g, w, zero_sign=i != 2)


def clones(*ts):
    return [None if t is None else t.clone() for t in ts]


# ----------------------------------------------------------------------------------
# inputs


def layer_shape(layout: str, nb: int, bs: int, h: int, d: int):
    return (nb, 2, bs, h, d) if layout == "NHD" else (nb, 2, h, bs, d)


def offset_view(t: torch.Tensor, offset: int, device=None) -> torch.Tensor:
    """A copy of ``t`` (on ``device``, default its own) whose data starts ``offset``
    elements into its storage, so the pointer is not 16-byte aligned for offset 1."""
    buf = torch.empty(t.numel() + offset, dtype=t.dtype, device=device if device is not None else t.device)
    view = buf[offset:].view(t.shape)
    view.copy_(t)
    return view


def random_layer(layout, dtype, d, *, nb=NB, bs=BS, h=H, offset=0, gen=None):
    shape = layer_shape(layout, nb, bs, h, d)
    if dtype in MODEL:
        t = torch.randn(shape, generator=gen).to(dtype)
    else:
        t = torch.randint(0, 256, shape, dtype=torch.int32, generator=gen).to(torch.uint8).view(dtype)
    return offset_view(t, offset) if offset else t


def quantized_layer(layout, qdtype, d, *, gen, nb=NB, bs=BS, h=H):
    """A quantized layer whose every slot holds reference-quantized data."""
    shape, sshape, zero_point = quant_views(layout, qdtype, d, nb=nb, bs=bs, h=h)
    kv = torch.zeros(shape, dtype=storage(qdtype))
    scale = torch.zeros(sshape, dtype=params(qdtype))
    zero = torch.zeros(sshape, dtype=params(qdtype)) if zero_point else None
    slots = torch.arange(nb * bs)
    k = torch.randn(nb * bs, h, d, generator=gen) * 4
    v = torch.randn(nb * bs, h, d, generator=gen)
    ref.write_kv(kv, slots, k, v, layout=layout, kv_scale=scale, kv_zero=zero)
    return kv, scale, zero


def tokens(n, d, dtype, kind, gen, device="cpu"):
    """key/value inputs [n, H, d] on ``device``: contiguous, a slice of a fused qkv
    row (token stride 3*H*d), or an element-offset copy (pointer misaligned for vectors)."""
    if kind == "qkv":
        qkv = torch.randn(n, 3 * H * d, generator=gen).to(dtype).to(device)
        return qkv[:, H * d : 2 * H * d].view(n, H, d), qkv[:, 2 * H * d :].view(n, H, d)
    k = torch.randn(n, H, d, generator=gen).to(dtype).to(device)
    v = torch.randn(n, H, d, generator=gen).to(dtype).to(device)
    if kind == "misaligned":
        return offset_view(k, 1), offset_view(v, 1)
    return k, v


def slot_mapping(n, gen, nb=NB, bs=BS):
    """n distinct slots, every fourth one padding (-1)."""
    slots = torch.randperm(nb * bs, generator=gen)[:n].to(torch.int64)
    slots[::4] = -1
    return slots


def special_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows the quantizer must handle: zeros (scale 0 -> 1), a constant, +-inf, NaN
    of both signs, huge and tiny magnitudes."""
    x = x.clone()
    x[0, 0] = 0.0
    x[1, 0] = 2.5
    x[2, 0, 0] = float("inf")
    x[2, 1, 1 % x.shape[2]] = float("-inf")
    x[3, 0, 0] = float("nan")
    x[3, 1, 0] = -float("nan")
    x[4, 0] = x[4, 0] * 1e30
    x[4, 1] = x[4, 1] * 1e-30
    return x


def tables(gen, bs=BS, nb=NB):
    """Sequences of 0, 1, bs (one full block) and 2*bs+3 tokens over distinct blocks,
    as ``(indptr, indices, block_table, seq_lens)`` int32. CSR rows list one spare
    block past what each sequence needs and the padded table pads with -1: neither
    may be read."""
    lens = [0, 1, bs, 2 * bs + 3]
    blocks = torch.randperm(nb, generator=gen).tolist()
    need = [-(-n // bs) for n in lens]
    rows, k = [], 0
    for n in need:
        rows.append(blocks[k : k + n])
        k += n
    spare = [999, -3, 12345, -1]  # out of range on purpose: never read
    indices, indptr = [], [0]
    for row, extra in zip(rows, spare):
        indices += row + [extra]
        indptr.append(len(indices))
    width = max(need) + 1
    table = torch.full((len(lens), width), -1, dtype=torch.int32)
    for b, row in enumerate(rows):
        table[b, : len(row)] = torch.tensor(row, dtype=torch.int32)
    as32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    return as32(indptr), as32(indices), table, as32(lens)


def arenas(kind: str, d: int, gen, nb=NB, layers=3):
    """All-layer arenas: [data] or [data, scale] or [data, scale, zero]."""
    if kind == "f16":
        return [torch.randn(layers, nb, 2, BS, H, d, generator=gen).to(torch.float16)]
    qdtype = torch.float8_e5m2 if kind == "fp8" else torch.int8
    data = torch.randint(0, 256, (layers, nb, 2, BS, H, d), dtype=torch.int32, generator=gen)
    out = [data.to(torch.uint8).view(qdtype), torch.randn(layers, nb, 2, BS, H, generator=gen)]
    if kind == "int8":
        out.append(torch.randn(layers, nb, 2, BS, H, generator=gen))
    return out


# ----------------------------------------------------------------------------------
# a layer with a dense model of its contents (random shapes; test_ops_cpu.py too)


MODEL_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
#: the grouped formats: head_dim is rounded up to what they pack (Layer.d), and the
#: scale/zero views gain a groups dim
GROUPED = ["int4", "int3"]
KV_DTYPES = MODEL_DTYPES + ["fp8_e4m3", "fp8_e5m2", "int8"] + GROUPED
STORAGE = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "int8": torch.int8,
           "int4": torch.uint8, "int3": torch.uint8}


def layer_dim(kv_dtype, d: int) -> int:
    """The head_dim a Layer of ``kv_dtype`` uses for a requested ``d``: ``d`` rounded up
    to a whole pack (2 for int4, 8 for int3)."""
    pack = {"int4": 2, "int3": 8}.get(kv_dtype, 1) if isinstance(kv_dtype, str) else 1
    return -(-max(d, 1) // pack) * pack


class Layer:
    """A per-layer view plus its scale/zero views, and a dense model of what it holds.

    Grouped formats take head_dim ``layer_dim(kv_dtype, d)`` and a group size drawn
    from ``group_seed`` (default ``seed``) among the legal ones (``self.group``)."""

    def __init__(self, nb, bs, h, d, kv_dtype, layout="NHD", seed=0, random=False, group_seed=None):
        self.quant = kv_dtype if isinstance(kv_dtype, str) else None
        d = layer_dim(kv_dtype, d)
        self.nb, self.bs, self.h, self.d, self.layout = nb, bs, h, d, layout
        self.model_dtype = torch.float16 if self.quant else kv_dtype
        storage = STORAGE[self.quant] if self.quant else kv_dtype
        row = dtypes.lookup(self.quant) if self.quant else None
        stored = row.stored_dim(d) if row is not None else d
        shape = (nb, 2, bs, h, stored) if layout == "NHD" else (nb, 2, h, bs, stored)
        g = torch.Generator().manual_seed(seed)
        self.group = None
        groups = ()
        if self.quant in GROUPED:
            step = 8 if self.quant == "int3" else 1
            legal = [k for k in range(step, d + 1, step) if d % k == 0]
            self.group = legal[(seed if group_seed is None else group_seed) % len(legal)]
            groups = (d // self.group,)
        if random:  # start from garbage so untouched slots are checked too
            lo, hi = (0, 256) if storage == torch.uint8 else (-100, 100)
            self.kv = torch.randint(lo, hi, shape, generator=g).to(storage)
        else:
            self.kv = torch.zeros(shape, dtype=storage)
        pdt = row.param_dtype if row is not None else torch.float32
        self.scale = torch.rand(shape[:-1] + groups, generator=g).to(pdt) if self.quant else None
        self.zero = torch.rand(shape[:-1] + groups, generator=g).to(pdt) if row is not None and row.zero_point else None

    def kw(self):
        return dict(layout=self.layout, kv_scale=self.scale, kv_zero=self.zero)

    def gather_kw(self):
        return dict(self.kw(), out_dtype=self.model_dtype if self.quant else None)

    def clone(self):
        c = object.__new__(Layer)
        c.__dict__.update(self.__dict__)
        c.kv = self.kv.clone()
        c.scale = None if self.scale is None else self.scale.clone()
        c.zero = None if self.zero is None else self.zero.clone()
        return c

    def state(self):
        return [t.clone() for t in (self.kv, self.scale, self.zero) if t is not None]


def bits(t):
    """Bit pattern of a tensor (NaN-safe, -0.0-safe equality)."""
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8):
        return t.view(torch.uint8)
    if t.is_floating_point():
        return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])
    return t


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def same_state(xs, ys):
    return len(xs) == len(ys) and all(same(x, y) for x, y in zip(xs, ys))


def rand_kv(n, h, d, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, h, d, generator=g) * 3).to(dtype), (torch.randn(n, h, d, generator=g) * 3).to(dtype)


def expected_rows(x, quant, out_dtype, group=None):
    """What a gather returns for rows written from ``x``: exact, or quantize->dequantize."""
    if quant is None:
        return x
    return dequantize(*quantize(x, quant, group_size=group), out_dtype)


def csr(tables, seq_lens):
    indptr = [0]
    for t in tables:
        indptr.append(indptr[-1] + len(t))
    return (
        torch.tensor(indptr, dtype=torch.int32),
        torch.tensor([b for t in tables for b in t], dtype=torch.int32),
        torch.tensor(seq_lens, dtype=torch.int32),
    )


def padded(tables, seq_lens, width=None):
    width = width or max([len(t) for t in tables] + [0])
    table = torch.full((len(tables), width), -1, dtype=torch.int32)
    for i, t in enumerate(tables):
        table[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    return table, torch.tensor(seq_lens, dtype=torch.int32)


def calls_while_flipping(tensor, index, bad, good, call, times, error, message, on_result=None) -> int:
    """Make ``call()`` ``times`` times while another thread flips ``tensor[index]``
    between ``bad`` and ``good``: the check-then-reread race of an op that reads a
    caller's array twice. Each refusal must be ``error`` with ``message`` in it; each
    result goes to ``on_result``. Then, the flipping stopped at ``good``, one more call
    must succeed (so the op is not refusing everything: how many racing calls saw
    ``bad`` is up to the scheduler, all of them on a loaded machine). Returns the
    number refused."""
    stop = threading.Event()

    def flip():
        while not stop.is_set():
            tensor[index] = bad
            tensor[index] = good

    t = threading.Thread(target=flip)
    t.start()
    refused = 0
    try:
        for _ in range(times):
            try:
                out = call()
            except error as e:
                assert message in str(e), str(e)
                refused += 1
            else:
                if on_result is not None:
                    on_result(out)
    finally:
        stop.set()
        t.join()
    tensor[index] = good
    out = call()
    if on_result is not None:
        on_result(out)
    return refused


def run_on_baseline_build(script: str, *args: str) -> str:
    """Run ``script`` in a fresh process with ``PAGEDKV_CPU_BASELINE=1`` (the CPU loops
    pick their baseline build, whatever this machine supports); returns its stdout,
    after asserting it exited cleanly."""
    env = dict(os.environ, PAGEDKV_CPU_BASELINE="1")
    out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, cwd="/", env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()
