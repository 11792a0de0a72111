"""The few CUDA driver calls the kernels need (cuda-python's ``cuda.bindings``).

Modules are loaded into each device's *primary* context, the one torch's runtime
uses, so tensors and kernels share one address space. Kernel parameters are passed
as a ``void**`` array address, the same array the host emulation receives.
"""
from __future__ import annotations

import functools
import threading
from typing import Any

from pagedkv.errors import KernelUnavailableError

__all__ = ["Module", "compute_capability", "load_module", "launch", "make_current"]

_guard = threading.Lock()
_contexts: dict[int, Any] = {}   # cuda-python CUcontext handles


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError as exc:  # pragma: no cover - the test environment has it
        raise KernelUnavailableError(
            'the CUDA driver bindings are not available: install the CUDA extra (pip install "pagedkv[cuda]")'
        ) from exc
    return driver


def _check(result, what: str):
    """Unpack a ``(CUresult, *values)`` tuple, raising on an error."""
    driver = _driver()
    err = result[0]
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        label = name.decode() if isinstance(name, bytes) else str(err)
        raise KernelUnavailableError(f"CUDA driver call {what} failed: {label}")
    rest = result[1:]
    return rest[0] if len(rest) == 1 else rest


@functools.lru_cache(maxsize=1)
def _init() -> None:
    try:
        result = _driver().cuInit(0)
    except Exception as exc:  # the bindings raise when libcuda itself is missing
        raise KernelUnavailableError(f"no CUDA driver: {exc}") from exc
    _check(result, "cuInit")


def make_current(device: int) -> None:
    """Make ``device``'s primary context current on this thread (retained once)."""
    _init()
    driver = _driver()
    with _guard:
        ctx = _contexts.get(device)
        if ctx is None:
            dev = _check(driver.cuDeviceGet(device), "cuDeviceGet")
            ctx = _check(driver.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
            _contexts[device] = ctx
    current = _check(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if int(current) != int(ctx):
        _check(driver.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


@functools.cache
def compute_capability(device: int) -> tuple[int, int]:
    _init()
    driver = _driver()
    dev = _check(driver.cuDeviceGet(device), "cuDeviceGet")
    attr = driver.CUdevice_attribute
    major = _check(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev), "cuDeviceGetAttribute")
    minor = _check(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev), "cuDeviceGetAttribute")
    return int(major), int(minor)


class Module:
    """A loaded module and its kernels, looked up by name once."""

    def __init__(self, handle, device: int, source_name: str):
        self.handle = handle
        self.device = device
        self.source_name = source_name
        self._functions: dict[str, object] = {}

    def function(self, name: str):
        fn = self._functions.get(name)
        if fn is None:
            fn = _check(_driver().cuModuleGetFunction(self.handle, name.encode()), f"cuModuleGetFunction({name})")
            self._functions[name] = fn
        return fn


def load_module(image: bytes, device: int, source_name: str) -> Module:
    make_current(device)
    handle = _check(_driver().cuModuleLoadData(image), f"cuModuleLoadData({source_name})")
    return Module(handle, device, source_name)


def launch(function, grid: tuple[int, int, int], block: tuple[int, int, int], stream: int, argv_address: int) -> None:
    """cuLaunchKernel on ``stream`` (a raw handle) with a ``void**`` parameter array."""
    driver = _driver()
    _check(
        driver.cuLaunchKernel(function, *grid, *block, 0, driver.CUstream(stream), argv_address, 0),
        "cuLaunchKernel",
    )
