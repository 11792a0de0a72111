"""What only the CUDA launchers on a real GPU have: pinned-memory swaps, the
caller's stream, DLPack inputs, cubin loading. That every op matches the torch
reference bit for bit runs for every backend in test_backends.py (the 'cuda'
backend there). Marked ``cuda``; skipped with the reason where no GPU exists.
"""
from __future__ import annotations

import pytest
import torch

from backend_cases import NO_GPU, assert_same
from pagedkv.errors import DeviceError, InvalidArgumentError
from pagedkv.ops import reference as ref

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason=NO_GPU,
    ),
]

NB, BS, H = 13, 16, 4


@pytest.fixture(scope="module")
def ops():
    from pagedkv.kernels import ops as kernel_ops

    return kernel_ops


def shape_of(layout, d):
    return (NB, 2, BS, H, d) if layout == "NHD" else (NB, 2, H, BS, d)


def inputs(n, d, dtype, gen):
    k = (torch.randn(n, H, d, generator=gen) * 3).to(dtype)
    v = torch.randn(n, H, d, generator=gen).to(dtype)
    return k, v, k.cuda(), v.cuda()


def test_swap_blocks_refuses_pageable_host_memory(ops):
    dev = [torch.zeros(1, 4, 2, BS, H, 8, device="cuda")]
    host = [torch.zeros(1, 4, 2, BS, H, 8)]
    with pytest.raises(DeviceError, match=r"dst_arenas\[0\]: expected pinned host memory \(tensor.pin_memory\(\)\), got pageable host memory"):
        ops.swap_blocks(dev, host, torch.tensor([[0, 1]]))


class _DLPackOnly:
    """A foreign tensor: only the DLPack protocol."""

    def __init__(self, t):
        self._t = t

    def __dlpack__(self, **kw):
        return self._t.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._t.__dlpack_device__()


class _Stream:
    def __init__(self, s):
        self._s = s

    def __cuda_stream__(self):
        return (0, self._s.cuda_stream)


@pytest.mark.parametrize("how", ["torch", "int", "protocol"])
def test_launches_go_to_the_callers_stream_and_accept_dlpack(ops, how):
    gen = torch.Generator().manual_seed(6)
    layer = torch.zeros(shape_of("NHD", 128), dtype=torch.float16, device="cuda")
    k, v, dk, dv = inputs(200, 128, torch.float16, gen)
    slots = torch.arange(200)
    dslots = slots.cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # the inputs above are ready
    stream = {"torch": side, "int": side.cuda_stream, "protocol": _Stream(side)}[how]
    ops.write_kv(_DLPackOnly(layer), _DLPackOnly(dslots), _DLPackOnly(dk), _DLPackOnly(dv), stream=stream)
    side.synchronize()
    want = torch.zeros(shape_of("NHD", 128), dtype=torch.float16)
    ref.write_kv(want, slots, k, v)
    assert_same(layer, want)


def test_bad_stream_is_refused(ops):
    layer = torch.zeros(shape_of("NHD", 8), device="cuda")
    x = torch.zeros(1, H, 8, device="cuda")
    with pytest.raises(InvalidArgumentError, match=r"stream: expected None, a torch.cuda.Stream, an int handle"):
        ops.write_kv(layer, torch.tensor([0], device="cuda"), x, x, stream="default")


def test_module_loads_as_cubin_for_this_device():
    from pagedkv.kernels import build, driver

    major, minor = driver.compute_capability(torch.cuda.current_device())
    module = build.build_and_load("copy_blocks.cu", torch.cuda.current_device())
    assert module.function("pkv_copy_blocks_v16_i64") is not None
    assert (major, minor) >= (8, 0)
