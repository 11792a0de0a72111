"""The data-op backend protocol and the one dispatcher that picks a backend.

A backend is any object (in practice a module) with the six data ops of
:class:`DataOpsBackend`, each taking the arguments of its
:mod:`pagedkv.ops.reference` twin; a backend may add keyword-only options of its own
(the CUDA launchers take ``stream``, the emulation ``grid``/``block``). Every op that
reads or writes a layer's K/V takes ``layer_format``
(:class:`~pagedkv.format.layer_format.LayerFormat`): the store passes the format it
built, and the backend verifies the tensors against it instead of reading the format
off them (None: the compatibility path, the format the tensors imply,
:func:`pagedkv.format.op_checks.check_layer`). The backends:

- ``"reference"``: :mod:`pagedkv.ops.reference`, plain torch on any device;
- ``"cpu"``: :mod:`pagedkv.ops.cpu`, the Cython loops for CPU tensors;
- ``"cuda"``: :mod:`pagedkv.kernels.ops`, the NVRTC kernels on CUDA tensors;
- ``"emulated"``: :mod:`pagedkv.kernels.emulation`, the same kernels built with g++
  and run on CPU tensors (tests on machines without a GPU).

Backends load on first use, so importing :mod:`pagedkv.ops` needs neither
cuda-python nor a compiler. ``pagedkv.kernels`` does not import ``pagedkv.ops``
(both validate through :mod:`pagedkv.format.op_checks`), so the dependency runs one way.
"""
from __future__ import annotations

import importlib
import logging
import warnings
from typing import Protocol, runtime_checkable

import torch

from pagedkv.errors import InvalidArgumentError, KernelUnavailableError, expected

__all__ = ["DataOpsBackend", "OP_NAMES", "BACKENDS", "MODULES", "load", "resolve_backend", "implementation"]

OP_NAMES = ("write_kv", "seal_key_blocks", "gather_kv", "gather_kv_padded", "copy_blocks", "swap_blocks",
            "convert_layout")

#: backend name -> module implementing :class:`DataOpsBackend`
MODULES: dict[str, str] = {
    "reference": "pagedkv.ops.reference",
    "cpu": "pagedkv.ops.cpu",
    "cuda": "pagedkv.kernels.ops",
    "emulated": "pagedkv.kernels.emulation",
}

#: what the ops' ``backend=`` accepts: ``"auto"`` picks by device (see :func:`resolve_backend`).
#: The emulation is for tests: they call it through :func:`load`, with its grid overrides.
BACKENDS: tuple[str, ...] = ("auto", "cpu", "cuda", "reference")


@runtime_checkable
class DataOpsBackend(Protocol):
    """The six KV data ops; see :mod:`pagedkv.ops.reference` for their arguments."""

    def write_kv(self, kv_layer, slot_mapping, key, value, *, layout="NHD", kv_scale=None, kv_zero=None,
                 rotation_signs=None, layer_format=None) -> None: ...

    def seal_key_blocks(self, kv_layer, blocks, keys, key_scale, key_zero, *, layout="NHD",
                        layer_format=None) -> None: ...

    def gather_kv(self, kv_layer, indptr, indices, seq_lens, *, layout="NHD", out_dtype=None, kv_scale=None,
                  kv_zero=None, out_key=None, out_value=None, rotation_signs=None, key_scale=None, key_zero=None,
                  layer_format=None): ...

    def gather_kv_padded(self, kv_layer, block_table, seq_lens, *, layout="NHD", out_dtype=None, kv_scale=None,
                         kv_zero=None, out_key=None, out_value=None, rotation_signs=None, key_scale=None, key_zero=None,
                         layer_format=None): ...

    def copy_blocks(self, arenas, pairs) -> None: ...

    def swap_blocks(self, src_arenas, dst_arenas, pairs) -> None: ...

    def convert_layout(self, arena, src_layout, dst_layout, *, scale=False): ...


_log = logging.getLogger("pagedkv.ops")
_checked: dict[str, object] = {}  # name -> module already checked against the protocol
_cpu_missing_warned = False

_LABELS = {
    "reference": "the torch reference",
    "cpu": "the fast CPU ops",
    "cuda": "the CUDA kernels",
    "emulated": "the host emulation of the CUDA kernels",
}
_UNAVAILABLE_HINT = {
    "cuda": ". Install the 'cuda' extra (cuda-python with NVRTC) or move the tensors to the CPU",
    "emulated": ". The host emulation needs torch and a C++ compiler (g++)",
}


def load(name: str) -> DataOpsBackend:
    """The backend module ``name`` (one of :data:`MODULES`), imported on first use.

    Raises:
        InvalidArgumentError: ``name`` is not a backend.
        KernelUnavailableError: the backend's module cannot be imported here.
    """
    if name not in MODULES:
        raise InvalidArgumentError(expected("backend", "one of " + ", ".join(map(repr, MODULES)), repr(name)))
    where = f"{_LABELS[name]} ({MODULES[name]})"
    try:  # a sys.modules lookup after the first call
        mod = importlib.import_module(MODULES[name])
    except Exception as e:  # ImportError, or a driver/cuda-python failure at import
        raise KernelUnavailableError(
            f"{where} cannot be loaded: {type(e).__name__}: {e}{_UNAVAILABLE_HINT.get(name, '')}"
        ) from e
    if _checked.get(name) is not mod:
        if not isinstance(mod, DataOpsBackend):
            missing = [op for op in OP_NAMES if not callable(getattr(mod, op, None))]
            raise KernelUnavailableError(f"{where} provides no {', '.join(missing)}")
        _checked[name] = mod
    return mod


def cpu_ops_built() -> bool:
    """True when the fast CPU loops are compiled into this install."""
    return bool(load("cpu").AVAILABLE)  # type: ignore[attr-defined]  # the cpu module's own flag


def resolve_backend(backend: str, *devices: torch.device) -> str:
    """The concrete backend for tensors on ``devices``: ``"auto"`` means ``"cuda"`` when
    any is a CUDA device, ``"cpu"`` when all are CPU devices and the fast CPU ops are
    built, else ``"reference"`` (with one warning when the CPU ops are missing)."""
    global _cpu_missing_warned
    if backend not in BACKENDS:
        raise InvalidArgumentError(expected("backend", "one of " + ", ".join(map(repr, BACKENDS)), repr(backend)))
    if backend != "auto":
        return backend
    if any(d.type == "cuda" for d in devices):
        return "cuda"
    if all(d.type == "cpu" for d in devices):
        if cpu_ops_built():
            return "cpu"
        if not _cpu_missing_warned:
            _cpu_missing_warned = True
            msg = "pagedkv.ops: the fast CPU ops are not built; using the (slow) torch reference"
            warnings.warn(msg, RuntimeWarning, stacklevel=4)
            _log.warning(msg)
    return "reference"


def implementation(op: str, backend: str, *devices: torch.device):
    """The function implementing data op ``op`` for ``backend`` and tensors on ``devices``."""
    return getattr(load(resolve_backend(backend, *devices)), op)
