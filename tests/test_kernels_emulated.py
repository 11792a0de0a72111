"""What only the host emulation of the CUDA kernels has: its number conversions
against torch's casts, 64-bit offsets, the plans' own checks, the CUDA launchers'
refusals without a GPU, and an AddressSanitizer run.

The emulation compiles the unchanged .cu sources with g++ (see
pagedkv/kernels/emulation.py) and runs the launch plans the CUDA launchers would
run, over the whole grid. That every op matches the reference bit for bit, with the
planned dims and with grids far smaller than the work, is tested for every backend
at once in test_backends.py (the 'emulated' backend).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from backend_cases import BS, LAYOUTS, NB, H, assert_same, layer_shape, name, random_layer, tokens

from pagedkv.errors import (
    DeviceError,
    DTypeError,
    InvalidArgumentError,
    ShapeError,
)
from pagedkv.kernels import emulation as emu
from pagedkv.kernels import plans
from pagedkv.ops import reference as ref

pytestmark = pytest.mark.skipif(shutil.which(emu.CXX) is None, reason=f"the host emulation needs {emu.CXX}")

FMAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


# ----------------------------------------------------------------------------------
# number conversions (common.cuh) against torch's casts


def _structured_floats() -> torch.Tensor:
    """Every sign/exponent/top-11-mantissa pattern (bits 12..31) with the low 12 bits
    0, 1, 0x7ff, 0x800, 0x801, 0xfff: all round-down/tie/round-up cases of a cast to
    any format that keeps at most 11 mantissa bits (fp8, fp16, bf16)."""
    high = torch.arange(1 << 20, dtype=torch.int64) << 12
    low = torch.tensor([0, 1, 0x7FF, 0x800, 0x801, 0xFFF], dtype=torch.int64)
    bits = (high[:, None] | low[None, :]).view(-1)
    return bits.to(torch.int32).view(torch.float32)  # int64 -> int32 keeps the low 32 bits


@pytest.fixture(scope="module")
def floats():
    return _structured_floats()


@pytest.mark.parametrize("qdtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=name)
def test_float_to_fp8_equals_torch_cast_of_clamped_value(floats, qdtype):
    conv = "f32_to_e4m3" if qdtype == torch.float8_e4m3fn else "f32_to_e5m2"
    want = torch.clamp(floats, -FMAX[qdtype], FMAX[qdtype]).to(qdtype).view(torch.uint8)
    assert torch.equal(emu.conversion(conv, floats, torch.uint8), want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=name)
def test_float_to_half_types_equals_torch_cast(floats, dtype):
    conv = "f32_to_f16" if dtype == torch.float16 else "f32_to_bf16"
    got = emu.conversion(conv, floats, torch.int16).view(dtype)
    assert_same(got, floats.to(dtype))


@pytest.mark.parametrize("qdtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=name)
def test_every_fp8_code_decodes_like_torch(qdtype):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    conv = "e4m3_to_f32" if qdtype == torch.float8_e4m3fn else "e5m2_to_f32"
    got = emu.conversion(conv, codes, torch.float32)
    assert torch.equal(got.view(torch.int32), codes.view(qdtype).to(torch.float32).view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=name)
def test_every_half_pattern_widens_like_torch(dtype):
    bits = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
    conv = "f16_to_f32" if dtype == torch.float16 else "bf16_to_f32"
    got = emu.conversion(conv, bits, torch.float32)
    assert torch.equal(got.view(torch.int32), bits.view(dtype).to(torch.float32).view(torch.int32))


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("PAGEDKV_EXHAUSTIVE") != "1", reason="all 2**32 floats: set PAGEDKV_EXHAUSTIVE=1")
@pytest.mark.parametrize("qdtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=name)
def test_float_to_fp8_over_every_float32(qdtype):
    conv = "f32_to_e4m3" if qdtype == torch.float8_e4m3fn else "f32_to_e5m2"
    chunk = 1 << 26
    base = torch.arange(chunk, dtype=torch.int32)
    for start in range(-(1 << 31), 1 << 31, chunk):  # no int32 overflow: start + base < 2**31
        x = (base + start).view(torch.float32)
        want = torch.clamp(x, -FMAX[qdtype], FMAX[qdtype]).to(qdtype).view(torch.uint8)
        got = emu.conversion(conv, x, torch.uint8)
        assert torch.equal(got, want), f"mismatch in chunk starting at bits {start & 0xFFFFFFFF:#010x}"


# ----------------------------------------------------------------------------------
# 64-bit offsets


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn], ids=name)
def test_offsets_beyond_the_int32_range(dtype, layout):
    # A layer of more than 2**31 elements (byte offsets past 2**32). torch.empty
    # only reserves it: pages are committed where the kernels actually touch.
    nb, bs, h, d = 66_000, 16, 8, 128
    layer = torch.empty(layer_shape(layout, nb, bs, h, d), dtype=dtype)
    assert layer.numel() > 2**31
    scale = torch.zeros(layer.shape[:-1]) if dtype != torch.float16 else None
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(3, h, d, generator=gen).half()
    value = torch.randn(3, h, d, generator=gen).half()
    slots = torch.tensor([(nb - 1) * bs + 15, (nb - 2) * bs, 5])
    emu.write_kv(layer, slots, key, value, layout=layout, kv_scale=scale)
    table = torch.tensor([[nb - 1], [nb - 2], [0]], dtype=torch.int32)
    lens = torch.tensor([16, 1, 6], dtype=torch.int32)
    out = {"out_dtype": torch.float16} if scale is not None else {}
    got = emu.gather_kv_padded(layer, table, lens, layout=layout, kv_scale=scale, **out)
    want = ref.gather_kv_padded(layer, table, lens, layout=layout, kv_scale=scale, **out)
    for g, w in zip(got, want):
        assert_same(g, w)
    if scale is None:  # the written rows read back exactly where torch indexing finds them
        assert_same(got[0][15], key[0])
        assert_same(got[1][16], value[1])
        assert_same(got[0][22], key[2])


# ----------------------------------------------------------------------------------
# validation: the kernels' own checks, and the reference's passed through


def test_non_contiguous_layer_is_rejected():
    layer = random_layer("NHD", torch.float32, 8).transpose(2, 3)
    k, v = tokens(2, 8, torch.float32, "contiguous", None)
    with pytest.raises(InvalidArgumentError, match=r"kv_layer: expected a contiguous tensor, got strides"):
        plans.plan_write_kv(layer, torch.tensor([0, 1]), k[:, :BS], v[:, :BS], layout="HND")


def test_strided_head_dim_is_rejected():
    layer = random_layer("NHD", torch.float32, 4)
    k = torch.randn(2, H, 8)[:, :, ::2]
    with pytest.raises(InvalidArgumentError, match=r"key: expected unit stride in the last dim \(head_dim\), got strides \(24, 8, 2\)"):
        plans.plan_write_kv(layer, torch.tensor([0, 1]), k, k.contiguous())


def test_reference_checks_come_first_with_their_messages():
    layer = random_layer("NHD", torch.float16, 4)
    k = torch.randn(2, H, 4)
    with pytest.raises(DTypeError, match=r"key: expected dtype torch.float16 \(the kv_layer dtype\), got torch.float32"):
        emu.write_kv(layer, torch.tensor([0, 1]), k, k)
    with pytest.raises(ShapeError, match=r"slot_mapping: expected \[2\] \(one slot per token\), got \(3,\)"):
        emu.write_kv(layer, torch.tensor([0, 1, 2]), k.half(), k.half())


def test_quantized_write_needs_a_head_dim():
    layer = torch.zeros(NB, 2, BS, H, 0, dtype=torch.int8)
    scale, zero = torch.zeros(NB, 2, BS, H), torch.zeros(NB, 2, BS, H)
    k = torch.zeros(1, H, 0)
    with pytest.raises(ShapeError, match=r"key: expected a non-empty head_dim for a quantized kv_layer"):
        plans.plan_write_kv(layer, torch.tensor([0]), k, k, kv_scale=scale, kv_zero=zero)


def test_emulation_refuses_non_host_tensors():
    layer = torch.empty(layer_shape("NHD", NB, BS, H, 4), device="meta")
    with pytest.raises(DeviceError, match=r"kv_layer: expected a CPU tensor \(the emulation runs on the host\), got meta"):
        emu.write_kv(layer, torch.tensor([0]), torch.empty(1, H, 4, device="meta"), torch.empty(1, H, 4, device="meta"))


def test_launch_dims_beyond_the_hardware_are_rejected():
    layer = random_layer("NHD", torch.float32, 4)
    k, v = tokens(2, 4, torch.float32, "contiguous", None)
    with pytest.raises(InvalidArgumentError, match=r"block: expected at most 1024 threads"):
        emu.write_kv(layer, torch.tensor([0, 1]), k, v, grid=(1, 1, 1), block=(64, 32, 1))
    with pytest.raises(InvalidArgumentError, match=r"grid: expected 1 <= x"):
        emu.write_kv(layer, torch.tensor([0, 1]), k, v, grid=(1, 70000, 1), block=(1, 1, 1))


@pytest.mark.parametrize("rows,cols", [(1, 1), (5, 3), (10**6, 16), (3, 10**5), (10**9, 10**9)])
def test_planned_dims_are_valid_and_cover_a_row(rows, cols):
    grid, block = plans.launch_dims(rows, cols)
    plans.check_dims(grid, block)
    assert block[0] * block[1] <= plans.THREADS
    assert block[0] >= min(cols, plans.THREADS) or block[0] == plans.THREADS


def test_empty_work_plans_no_launch():
    layer = random_layer("NHD", torch.float32, 4)
    k = torch.zeros(0, H, 4)
    assert plans.plan_write_kv(layer, torch.zeros(0, dtype=torch.int64), k, k) == []
    assert plans.plan_copy_blocks([layer[None]], torch.zeros(0, 2, dtype=torch.int64)) == []


# ----------------------------------------------------------------------------------
# the CUDA launchers' first checks run (and must refuse) without a GPU


class _HostDLPack:
    """A foreign host tensor that only speaks DLPack."""

    def __init__(self, t):
        self._t = t

    def __dlpack__(self, **kw):
        return self._t.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._t.__dlpack_device__()


@pytest.mark.parametrize("wrap", [lambda t: t, _HostDLPack], ids=["torch", "dlpack"])
def test_cuda_launchers_refuse_host_tensors_before_any_gpu_work(wrap):
    from pagedkv.kernels import ops

    layer = wrap(torch.zeros(layer_shape("NHD", NB, BS, H, 4)))
    x = torch.zeros(1, H, 4)
    calls = [
        (lambda: ops.write_kv(layer, torch.tensor([0]), x, x), "kv_layer"),
        (lambda: ops.gather_kv(layer, torch.zeros(1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32),
                               torch.zeros(0, dtype=torch.int32)), "kv_layer"),
        (lambda: ops.gather_kv_padded(layer, torch.zeros(0, 1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32)),
         "kv_layer"),
        (lambda: ops.copy_blocks([layer], torch.zeros(0, 2, dtype=torch.int64)), r"arenas\[0\]"),
        (lambda: ops.convert_layout(layer, "NHD", "HND"), "arena"),
    ]
    for call, arg in calls:
        with pytest.raises(DeviceError, match=rf"^{arg}: expected a CUDA tensor, got cpu$"):
            call()
    with pytest.raises(DeviceError, match=r"src_arenas: expected a CUDA tensor on one side of the swap, got cpu"):
        ops.swap_blocks([layer], [layer], torch.zeros(0, 2, dtype=torch.int64))


def test_cuda_launchers_refuse_non_tensors():
    from pagedkv.kernels import ops

    with pytest.raises(DTypeError, match=r"kv_layer: expected a torch.Tensor or a DLPack tensor, got list"):
        ops.write_kv([1.0], torch.tensor([0]), None, None)
    with pytest.raises(InvalidArgumentError, match=r"arenas: expected a tensor or a non-empty list of tensors"):
        ops.copy_blocks([], torch.zeros(0, 2, dtype=torch.int64))


# ----------------------------------------------------------------------------------
# AddressSanitizer: the emulation library rebuilt with -fsanitize=address, loaded
# into a child Python with libasan preloaded, runs one case of every kernel family
# (vector and scalar paths, guards; the decode kernel's fibers too); torch's CPU tensors come from the intercepted
# allocator, so every out-of-bounds kernel access would be reported. Result so far:
# clean, and the negative control below is reported as a heap-buffer-overflow.


_ASAN_DRIVER = r"""
import dataclasses, sys, torch
sys.path[:0] = [sys.argv[1]]
import backend_cases as c
import test_backends as t
import test_block_keys_kernels as bk
import test_seal_keys_kernels as sk
from pagedkv.kernels import emulation as emu, plans

B = c.Backend("emulated")

if sys.argv[2:] == ["overflow"]:  # negative control: one token more than key/value hold
    layer = c.random_layer("NHD", torch.float32, 4)
    k, v = c.tokens(2, 4, torch.float32, "contiguous", None)
    ln = plans.plan_write_kv(layer, torch.tensor([0, 1]), k, v)[0]
    args = list(ln.args)
    args[4] = ("i64", 3)
    emu.run([dataclasses.replace(ln, args=tuple(args))])
    print("NOT-CAUGHT", flush=True)
    sys.exit(0)
# one small case of every kernel family, incl. vector and scalar paths and the guards
for layout in c.LAYOUTS:
    for d, kind in ((16, "contiguous"), (3, "misaligned")):
        t.test_write_kv_copies_like_the_reference(B, torch.float16, layout, d, kind)
        t.test_gather_copies_like_the_reference(B, torch.float32, layout, d, "csr", "fresh")
        t.test_gather_copies_like_the_reference(B, torch.bfloat16, layout, d, "padded", "misaligned")
    for q in B.quant:
        t.test_write_kv_quantizes_like_the_reference(B, torch.bfloat16, q, layout, 17)
        t.test_gather_dequantizes_like_the_reference(B, q, torch.float16, layout, 3, "padded", "fresh")
        t.test_gather_dequantizes_like_the_reference(B, q, torch.float32, layout, 17, "csr", "given")
t.test_write_kv_skips_slots_past_the_end_instead_of_writing_them(B)
t.test_gather_reads_zeros_for_a_bad_block_id_instead_of_other_memory(B)
for kind in ("f16", "fp8", "int8"):
    t.test_copy_blocks_like_the_reference(B, kind, 3, torch.int32)
    t.test_swap_blocks_between_arenas_of_different_sizes(B, kind, torch.int64)
for dtype in (torch.float32, torch.float8_e4m3fn):
    t.test_convert_layout_like_the_reference(B, dtype, 3, True, 1)
for rotated in (False, True):  # int4 block keys: the per-channel parameters' reads
    bk.test_block_keys_gather_like_the_reference(B, (14, 7), "HND", rotated)
for layout in c.LAYOUTS:  # int4 block keys: the seal, and its guard on block ids
    sk.test_sealed_blocks_equal_the_reference_bit_for_bit(B, (10, 7), layout, torch.bfloat16)
sk.test_kernel_skips_ids_outside_the_layer()
# the decode kernel as fibers (ucontext under ASan): int3's parameters are copied as the
# aligned words holding them, up to the scale arena's last element; int4 groups of 8
import test_decode_attention as da
for fmt, d, layout, g_len in (("int3", 128, "HND", 32), ("int4", 64, "NHD", 8)):
    case = da.make(fmt, d, 1, layout, g_len, [40, 300, 9], rotated=True, seed=3)
    da.check(case, da.run(case, kernel="decode", num_splits=3))
print("ASAN-CLEAN", flush=True)
"""


def _run_under_asan(tmp_path, *extra):
    libasan = subprocess.run([emu.CXX, "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    if not libasan or not Path(libasan).is_file():
        pytest.skip(f"{emu.CXX} has no libasan.so")
    env = dict(os.environ, LD_PRELOAD=libasan, ASAN_OPTIONS="detect_leaks=0:abort_on_error=0",
               PAGEDKV_EMULATION_SANITIZE="address")
    package_root = str(Path(emu.__file__).resolve().parents[2])  # the pagedkv under test
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    root = str(Path(__file__).resolve().parent)
    script = tmp_path / "asan_driver.py"
    script.write_text(_ASAN_DRIVER)
    return subprocess.run([sys.executable, str(script), root, *extra], env=env, capture_output=True, text=True,
                          timeout=600)


def test_emulation_is_clean_under_address_sanitizer(tmp_path):
    proc = _run_under_asan(tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "ASAN-CLEAN" in proc.stdout
    assert "AddressSanitizer" not in proc.stderr


def test_address_sanitizer_catches_an_out_of_bounds_launch(tmp_path):
    # Proves the ASan run above could fail: a launch told of one token more than
    # the inputs hold must be reported, not pass silently.
    proc = _run_under_asan(tmp_path, "overflow")
    assert "NOT-CAUGHT" not in proc.stdout
    assert "ERROR: AddressSanitizer: heap-buffer-overflow" in proc.stderr
    assert proc.returncode != 0


# ----------------------------------------------------------------------------------
# the cooperative quantizing write


@pytest.mark.parametrize("kv_dtype, d, groups, block", [
    ("fp8_e4m3", 128, None, (128, 2, 1)),
    ("int8", 80, None, (128, 2, 1)),
    ("int4", 128, 2, (64, 4, 1)),
    ("int4", 18, 2, (16, 16, 1)),
    ("int3", 128, 4, (32, 8, 1)),
    ("int3", 24, 3, (8, 32, 1)),
])
def test_quantizing_write_shares_each_scale_group_among_a_cta_row(kv_dtype, d, groups, block):
    # A CTA row of threads reduces one scale group together; the grid's CTAs stride
    # over the (token, K/V, head) rows, so its x is 1.
    from pagedkv.format import dtypes

    row = dtypes.info(kv_dtype)
    shape = layer_shape("NHD", NB, BS, H, row.stored_dim(d))
    sshape = shape[:-1] + ((groups,) if row.grouped else ())
    layer = torch.zeros(shape, dtype=torch.uint8).view(row.torch_dtype)
    p = row.param_dtype
    scale, zero = torch.zeros(sshape, dtype=p), torch.zeros(sshape, dtype=p) if kv_dtype != "fp8_e4m3" else None
    gen = torch.Generator().manual_seed(d)
    key, value = tokens(9, d, torch.float32, "contiguous", gen)
    slots = torch.arange(9) * 3
    (launch,) = plans.plan_write_kv(layer, slots, key, value, kv_scale=scale, kv_zero=zero)
    assert launch.grid[0] == 1 and launch.block == block
    want = [layer.clone(), scale.clone(), None if zero is None else zero.clone()]
    ref.write_kv(want[0], slots, key, value, kv_scale=want[1], kv_zero=want[2])
    # more threads than a group has elements, fewer, and rows that outnumber the grid
    for dims in ({}, dict(grid=(1, 1, 1), block=(256, 4, 1)), dict(grid=(3, 1, 1), block=(2, 3, 1))):
        got = [layer.clone(), scale.clone(), None if zero is None else zero.clone()]
        emu.write_kv(got[0], slots, key, value, kv_scale=got[1], kv_zero=got[2], **dims)
        for i, (g, w) in enumerate(zip(got, want)):
            if w is not None:
                assert_same(g, w, zero_sign=i != 2)
