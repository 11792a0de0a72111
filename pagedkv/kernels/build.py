"""Compile kernel sources with NVRTC, cached in process and on disk.

:func:`build` looks a compiled source up in this order:

1. the in-process cache;
2. the disk cache (``$PAGEDKV_CACHE_DIR``, else ``~/.cache/pagedkv/kernels``);
3. then it takes an exclusive ``fcntl`` lock on the entry, looks at the disk again
   (another process may have compiled it while we waited), and only then compiles
   and writes the entry atomically (temp file + ``os.replace``).

The key hashes :data:`SCHEMA_VERSION`, the NVRTC version, the arch and target, the
NVRTC flags and the bytes of the source and of every header it includes, so any
change to any of them compiles afresh. :func:`build_and_load` adds loading the
result into a device's primary context (cached per device).
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import tempfile
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pagedkv.errors import KernelCompileError, KernelUnavailableError
from pagedkv.kernels import sources
from pagedkv.kernels.options import CompileOptions
from pagedkv.kernels.sources import KernelSource

__all__ = [
    "SCHEMA_VERSION",
    "Artifact",
    "BuildStats",
    "stats",
    "cache_dir",
    "cache_key",
    "nvrtc_version",
    "build",
    "build_and_load",
    "clear_memory_cache",
]

#: Bump when the meaning of a cache entry changes (its format or what the key covers).
SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Artifact:
    """A compiled source: PTX text (NUL-terminated, as the driver wants it) or a cubin."""

    source_name: str
    key: str
    target: str
    data: bytes


@dataclass
class BuildStats:
    """Counters for tests and diagnostics (process-wide)."""

    compiles: int = 0  #: NVRTC invocations that succeeded
    memory_hits: int = 0  #: served from the in-process cache
    disk_hits: int = 0  #: served from disk before taking the lock
    recheck_hits: int = 0  #: served from disk after waiting for the lock


stats = BuildStats()

_memory: dict[str, Artifact] = {}
_memory_guard = threading.Lock()
_key_locks: dict[str, threading.Lock] = {}


def cache_dir() -> Path:
    """``$PAGEDKV_CACHE_DIR`` or ``~/.cache/pagedkv/kernels`` (read on every call)."""
    env = os.environ.get("PAGEDKV_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "pagedkv" / "kernels"


def _nvrtc():
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:  # pragma: no cover - the test environment has it
        raise KernelUnavailableError(
            'NVRTC is not available: install the CUDA extra (pip install "pagedkv[cuda]")'
        ) from exc
    return nvrtc


@functools.lru_cache(maxsize=1)
def nvrtc_version() -> tuple[int, int]:
    nvrtc = _nvrtc()
    try:
        err, major, minor = nvrtc.nvrtcVersion()
    except Exception as exc:  # the bindings load libnvrtc lazily and raise their own errors
        raise KernelUnavailableError(
            f'the NVRTC library cannot be loaded ({exc}): install the CUDA extra (pip install "pagedkv[cuda]")'
        ) from exc
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:  # pragma: no cover
        raise KernelUnavailableError(f"nvrtcVersion failed: {err!r}")
    return int(major), int(minor)


def cache_key(source: KernelSource, options: CompileOptions) -> str:
    h = hashlib.sha256()
    for part in (
        f"pagedkv-kernel-schema={SCHEMA_VERSION}",
        "nvrtc={}.{}".format(*nvrtc_version()),
        f"arch={options.arch}",
        f"target={options.target}",
        "flags=" + "\x1f".join(options.nvrtc_flags()),
    ):
        h.update(part.encode() + b"\0")
    h.update(source.all_bytes())
    return h.hexdigest()


def clear_memory_cache() -> None:
    """Forget in-process artifacts (the disk cache stays); for tests."""
    with _memory_guard:
        _memory.clear()
        _named.clear()


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Exclusive advisory lock: flock() conflicts across processes and across
    separately opened descriptors in one process."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _read_entry(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def _write_entry(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)  # readers see the old state or the whole entry
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _compile(source: KernelSource, options: CompileOptions) -> bytes:
    nvrtc = _nvrtc()
    ok = nvrtc.nvrtcResult.NVRTC_SUCCESS
    names = sorted(source.headers)
    err, prog = nvrtc.nvrtcCreateProgram(
        source.text, source.name.encode(), len(names), [source.headers[n] for n in names], [n.encode() for n in names]
    )
    if err != ok:
        raise KernelCompileError(source.name, f"nvrtcCreateProgram failed: {err!r}", options)
    try:
        flags = [f.encode() for f in options.nvrtc_flags()]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(flags), flags)
        if err != ok:
            raise KernelCompileError(source.name, _program_log(nvrtc, prog), options)
        if options.target == "ptx":
            size_fn, get_fn = nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX
        else:
            size_fn, get_fn = nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN
        err, size = size_fn(prog)
        if err != ok:  # pragma: no cover
            raise KernelCompileError(source.name, f"{size_fn.__name__} failed: {err!r}", options)
        data = b" " * size
        (err,) = get_fn(prog, data)
        if err != ok:  # pragma: no cover
            raise KernelCompileError(source.name, f"{get_fn.__name__} failed: {err!r}", options)
        return data
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _program_log(nvrtc, prog) -> str:
    err, size = nvrtc.nvrtcGetProgramLogSize(prog)
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS or size <= 1:
        return "(no compile log)"
    log = b" " * size
    nvrtc.nvrtcGetProgramLog(prog, log)
    return log.rstrip(b"\0").decode(errors="replace")


def _lock_for(key: str) -> threading.Lock:
    with _memory_guard:
        return _key_locks.setdefault(key, threading.Lock())


def build(source: str | KernelSource, options: CompileOptions) -> Artifact:
    """Compile ``source`` (a packaged file name or a :class:`KernelSource`) with
    ``options``, through the caches.

    Raises:
        KernelCompileError: NVRTC rejected the source; carries the log and file name.
        KernelUnavailableError: cuda-python (NVRTC) is not installed.
    """
    if isinstance(source, str):
        source = sources.load(source)
    key = cache_key(source, options)
    with _lock_for(key):  # threads of this process compile a key once
        hit = _memory.get(key)
        if hit is not None:
            stats.memory_hits += 1
            return hit
        data = _build_on_disk(source, options, key)
        artifact = Artifact(source.name, key, options.target, data)
        _memory[key] = artifact
        return artifact


def _build_on_disk(source: KernelSource, options: CompileOptions, key: str) -> bytes:
    root = cache_dir()
    path = root / f"{key}.{options.target}"
    data = None
    try:
        root.mkdir(parents=True, exist_ok=True)
        data = _read_entry(path)
        if data is not None:
            stats.disk_hits += 1
            return data
        with _file_lock(root / f"{key}.lock"):
            data = _read_entry(path)
            if data is not None:  # another process compiled it while we waited
                stats.recheck_hits += 1
                return data
            data = _compile(source, options)
            stats.compiles += 1
            _write_entry(path, data)
            return data
    except OSError as exc:  # an unusable cache must not stop a compile
        warnings.warn(f"pagedkv: kernel cache {root} is unusable ({exc}); compiling without it", RuntimeWarning)
        if data is None:
            data = _compile(source, options)
            stats.compiles += 1
        return data


_loaded: dict[tuple[str, int], object] = {}
_named: dict[tuple, object] = {}  # (packaged file, device, defines) -> module, default options


def build_and_load(source: str | KernelSource, device: int, options: CompileOptions | None = None,
                   defines: tuple[tuple[str, str | None], ...] = ()):
    """Compile (through the caches) and load ``source`` into ``device``'s primary
    context; returns a :class:`pagedkv.kernels.driver.Module` (cached per device).

    ``options`` defaults to a cubin for the device's own architecture, compiled with
    ``defines`` (a launch's :attr:`~pagedkv.kernels.plans.Launch.defines`).
    """
    from pagedkv.kernels import driver

    # A launch names a packaged file with the default options; those files do not change
    # in a process, so the module is looked up without re-reading, re-hashing or asking the
    # driver again (about 0.5 ms per call otherwise, as much as a whole decode kernel).
    named = (source, int(device), tuple(defines)) if isinstance(source, str) and options is None else None
    if named is not None:
        module = _named.get(named)
        if module is not None:
            return module
    if options is None:
        major, minor = driver.compute_capability(device)
        options = CompileOptions(arch=f"sm_{major}{minor}", target="cubin", defines=tuple(defines))
    artifact = build(source, options)
    slot = (artifact.key, int(device))
    with _lock_for(artifact.key):
        module = _loaded.get(slot)
        if module is None:
            module = driver.load_module(artifact.data, int(device), artifact.source_name)
            _loaded[slot] = module
    if named is not None:
        _named[named] = module
    return module
