"""Run the CUDA kernels on the CPU, for tests on machines without a GPU.

The unchanged ``.cu`` sources are compiled by g++ with ``emulate.h``
(``-DPAGEDKV_EMULATE``) into one shared library, cached under the kernel cache
dir by a hash of the sources, the generated wrappers, the flags and the compiler
version. Each kernel gets an ``extern "C"`` wrapper ``pkv_emu_<kernel>(dims, argv)``
that runs it over its whole grid with the same ``void**`` argument array a GPU
launch gets. The functions below mirror :mod:`pagedkv.kernels.ops` on CPU tensors
and take optional ``grid``/``block`` overrides, so tests can run the grid-stride
loops with fewer threads than there is work.

``PAGEDKV_EMULATION_SANITIZE=address`` builds and loads an AddressSanitizer
variant instead; the process must then run with libasan preloaded
(``LD_PRELOAD=$(g++ -print-file-name=libasan.so)``), see tests/test_kernels_emulated.py.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from pagedkv.errors import DeviceError, KernelCompileError, KernelUnavailableError, expected
from pagedkv.kernels import attention_plans, build, latent_plans, plans, sources

__all__ = [
    "library",
    "variant_library",
    "run",
    "conversion",
    "write_kv",
    "seal_key_blocks",
    "gather_kv",
    "gather_kv_padded",
    "copy_blocks",
    "swap_blocks",
    "convert_layout",
    "paged_attention",
    "write_latent",
    "gather_latent",
    "mla_attention",
]

CXX = os.environ.get("CXX", "g++")
FLAGS = ("-std=c++17", "-O2", "-fPIC", "-ffp-contract=off", "-fno-fast-math", "-Wall", "-Wextra", "-Werror",
         "-DPAGEDKV_EMULATE")
SANITIZE_FLAGS = {"address": ("-fsanitize=address", "-fno-omit-frame-pointer", "-g")}

Dims = tuple[int, int, int] | None

# Element-wise number conversions of common.cuh, exported for the exhaustive tests.
_CONVERSIONS = {
    "f32_to_e4m3": ("float", "pkv_u8", "pkv_f32_to_e4m3"),
    "f32_to_e5m2": ("float", "pkv_u8", "pkv_f32_to_e5m2"),
    "f32_to_f16": ("float", "pkv_u16", "pkv_f32_to_f16"),
    "f32_to_bf16": ("float", "pkv_u16", "pkv_f32_to_bf16"),
    "e4m3_to_f32": ("pkv_u8", "float", "pkv_e4m3_to_f32"),
    "e5m2_to_f32": ("pkv_u8", "float", "pkv_e5m2_to_f32"),
    "f16_to_f32": ("pkv_u16", "float", "pkv_f16_to_f32"),
    "bf16_to_f32": ("pkv_u16", "float", "pkv_bf16_to_f32"),
}


def _wrapper_text(source_name: str) -> str:
    lines = [f'#include "{source_name}"', ""]
    for kernel in sources.entry_points()[source_name]:
        lines.append(
            f'extern "C" int pkv_emu_{kernel}(const unsigned int* dims, void** argv) '
            f"{{ return pkv_emu::launch(&{kernel}, dims, argv); }}"
        )
    return "\n".join(lines) + "\n"


def _conversions_text() -> str:
    lines = ['#include "common.cuh"', "", _LAST_ERROR]
    for name, (src, dst, fn) in _CONVERSIONS.items():
        lines.append(
            f'extern "C" void pkv_emu_convert_{name}(const {src}* in, {dst}* out, long long n) '
            f"{{ for (long long i = 0; i < n; ++i) out[i] = {fn}(in[i]); }}"
        )
    return "\n".join(lines) + "\n"


_LAST_ERROR = 'extern "C" const char* pkv_emu_last_error() { return pkv_emu::last_error(); }'


def _variant_text(source_name: str, kernels: Sequence[str]) -> str:
    """One variant of a warp-level source: its kernels run as fibers (emulate_fibers.h)."""
    lines = [f'#include "{source_name}"', "", _LAST_ERROR]
    for kernel in kernels:
        lines.append(f'extern "C" int pkv_emu_{kernel}(const unsigned int* dims, void** argv) '
                     f"{{ return pkv_emu::launch_fibers(&{kernel}, dims, argv); }}")
    return "\n".join(lines) + "\n"


def _units() -> dict:
    """{translation unit file name: text} of the library's wrappers."""
    units = {f"emu_{s[:-3]}.cpp": _wrapper_text(s) for s in sources.SOURCE_FILES}
    units["emu_conversions.cpp"] = _conversions_text()
    return units


@functools.lru_cache(maxsize=1)
def _compiler_version() -> str:
    try:
        out = subprocess.run([CXX, "--version"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        raise KernelUnavailableError(f"the host emulation needs a C++ compiler ({CXX}): {exc}") from exc
    return out.stdout


def _flags(sanitize: str | None) -> tuple[str, ...]:
    if sanitize is None:
        return FLAGS
    if sanitize not in SANITIZE_FLAGS:
        raise KernelUnavailableError(f"unknown sanitizer {sanitize!r}: expected one of {sorted(SANITIZE_FLAGS)}")
    return FLAGS + SANITIZE_FLAGS[sanitize]


def _library_path(sanitize: str | None) -> Path:
    srcs = [sources.load(s) for s in sources.SOURCE_FILES]
    h = hashlib.sha256()
    for part in [_compiler_version(), " ".join(_flags(sanitize))]:
        h.update(part.encode() + b"\0")
    for src in srcs:
        h.update(src.all_bytes() + b"\0")
    for name, text in sorted(_units().items()):
        h.update(name.encode() + b"\0" + text.encode() + b"\0")
    key = h.hexdigest()[:32]
    root = build.cache_dir() / "emulation"
    path = root / f"libpagedkv_emu_{key}.so"
    if path.exists():
        return path
    root.mkdir(parents=True, exist_ok=True)
    with build._file_lock(root / f"{key}.lock"):
        if not path.exists():
            _compile_library(srcs, _flags(sanitize), path)
    return path


@functools.cache
def variant_library(source_name: str, defines: tuple[tuple[str, str | None], ...],
                    sanitize: str | None = None) -> ctypes.CDLL:
    """The emulation library of one variant of a :data:`~pagedkv.kernels.sources.VARIANT_SOURCES`
    file (``defines`` as a launch carries them), built on first use and cached on disk."""
    if sanitize is None:
        sanitize = os.environ.get("PAGEDKV_EMULATION_SANITIZE") or None
    src = sources.load(source_name)
    kernels = [v for n, v in defines if n == "PKV_DEC_NAME" and v]
    kernels += [sources.decode_merge_name(t) for t in sources.MODEL_TYPES]
    text = _variant_text(source_name, kernels)
    flags = _flags(sanitize) + tuple(f"-D{n}" if v is None else f"-D{n}={v}" for n, v in defines)
    h = hashlib.sha256()
    for part in [_compiler_version(), " ".join(flags), text]:
        h.update(part.encode() + b"\0")
    h.update(src.all_bytes())
    key = h.hexdigest()[:32]
    root = build.cache_dir() / "emulation"
    path = root / f"libpagedkv_emu_variant_{key}.so"
    if not path.exists():
        root.mkdir(parents=True, exist_ok=True)
        with build._file_lock(root / f"{key}.lock"):
            if not path.exists():
                _compile_units([src], {"emu_variant.cpp": text}, flags, path)
    return ctypes.CDLL(str(path))


def _compile_library(srcs, flags: Sequence[str], path: Path) -> None:
    _compile_units(srcs, _units(), flags, path)


def _compile_units(srcs, units: dict, flags: Sequence[str], path: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="pagedkv-emu-") as tmp:
        tmpdir = Path(tmp)
        for src in srcs:
            (tmpdir / src.name).write_bytes(src.text)
            for hname, data in src.headers.items():
                (tmpdir / hname).write_bytes(data)
        for name, text in units.items():
            (tmpdir / name).write_text(text)
        procs = []
        for name in units:  # compile the units in parallel, then link
            cmd = [CXX, *flags, "-c", name, "-o", name + ".o"]
            procs.append((name, subprocess.Popen(cmd, cwd=tmpdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)))
        for name, proc in procs:
            out, _ = proc.communicate()
            if proc.returncode != 0:
                raise KernelCompileError(name, out.decode(errors="replace"), list(flags))
        objs = [name + ".o" for name in units]
        link = subprocess.run([CXX, *flags, "-shared", *objs, "-o", "lib.so"], cwd=tmpdir, capture_output=True, text=True)
        if link.returncode != 0:
            raise KernelCompileError("libpagedkv_emu.so", link.stdout + link.stderr, list(flags))
        staged = path.with_name(path.name + ".tmp")
        shutil.copyfile(tmpdir / "lib.so", staged)
        os.replace(staged, path)


@functools.cache
def library(sanitize: str | None = None) -> ctypes.CDLL:
    """The emulation library (built on first use; ``sanitize="address"`` for ASan)."""
    if sanitize is None:
        sanitize = os.environ.get("PAGEDKV_EMULATION_SANITIZE") or None
    return ctypes.CDLL(str(_library_path(sanitize)))


def _check_cpu(name: str, t: object) -> None:
    # The emulation dereferences raw pointers on the host: a GPU pointer would crash.
    if isinstance(t, torch.Tensor) and t.device.type != "cpu":
        raise DeviceError(expected(name, "a CPU tensor (the emulation runs on the host)", t.device))


def run(launches: Iterable[plans.Launch], *, grid: Dims = None, block: Dims = None) -> None:
    """Run each launch over its whole grid on the CPU (``grid``/``block`` override
    the planned dims)."""
    for ln in launches:
        variant = ln.source in sources.VARIANT_SOURCES
        lib = variant_library(ln.source, ln.defines) if variant else library()
        # a warp-level kernel's CTA shape is part of its code: only its grid is overridden
        g, b = tuple(grid or ln.grid), tuple(ln.block if variant else (block or ln.block))
        plans.check_dims(g, b)
        fn = getattr(lib, f"pkv_emu_{ln.kernel}")
        fn.argtypes = [ctypes.POINTER(ctypes.c_uint), ctypes.c_void_p]
        fn.restype = ctypes.c_int
        dims = (ctypes.c_uint * 6)(*g, *b)
        argv, values = ln.pack_args()
        failed = fn(dims, argv)
        del values
        if failed:
            lib.pkv_emu_last_error.restype = ctypes.c_char_p
            raise RuntimeError(f"the emulated kernel {ln.kernel} broke a CUDA rule (a kernel bug): "
                               f"{lib.pkv_emu_last_error().decode(errors='replace')}")


def conversion(name: str, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Apply one of common.cuh's conversions (``"f32_to_e4m3"``...) element-wise to a
    contiguous CPU tensor of raw bits/floats; returns a new tensor of ``out_dtype``."""
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=out_dtype)
    fn = getattr(library(), f"pkv_emu_convert_{name}")
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_longlong]
    fn.restype = None
    fn(x.data_ptr(), out.data_ptr(), x.numel())
    return out


def write_kv(kv_layer, slot_mapping, key, value, *, layout="NHD", kv_scale=None, kv_zero=None, rotation_signs=None,
             layer_format=None, grid: Dims = None, block: Dims = None) -> None:
    _check_cpu("kv_layer", kv_layer)
    launches = plans.plan_write_kv(kv_layer, slot_mapping, key, value, layout=layout, kv_scale=kv_scale, kv_zero=kv_zero,
                                   rotation_signs=rotation_signs, layer_format=layer_format)
    run(launches, grid=grid, block=block)


def gather_kv(kv_layer, indptr, indices, seq_lens, *, layout="NHD", out_dtype=None, kv_scale=None, kv_zero=None,
              out_key=None, out_value=None, rotation_signs=None, key_scale=None, key_zero=None, layer_format=None,
              grid: Dims = None, block: Dims = None):
    _check_cpu("kv_layer", kv_layer)
    launches, k, v = plans.plan_gather(kv_layer, seq_lens, indptr=indptr, indices=indices, layout=layout,
                                       out_dtype=out_dtype, kv_scale=kv_scale, kv_zero=kv_zero,
                                       out_key=out_key, out_value=out_value, rotation_signs=rotation_signs,
                                       key_scale=key_scale, key_zero=key_zero, layer_format=layer_format)
    run(launches, grid=grid, block=block)
    return k, v


def gather_kv_padded(kv_layer, block_table, seq_lens, *, layout="NHD", out_dtype=None, kv_scale=None, kv_zero=None,
                     out_key=None, out_value=None, rotation_signs=None, key_scale=None, key_zero=None,
                     layer_format=None, grid: Dims = None, block: Dims = None):
    _check_cpu("kv_layer", kv_layer)
    launches, k, v = plans.plan_gather(kv_layer, seq_lens, block_table=block_table, layout=layout,
                                       out_dtype=out_dtype, kv_scale=kv_scale, kv_zero=kv_zero,
                                       out_key=out_key, out_value=out_value, rotation_signs=rotation_signs,
                                       key_scale=key_scale, key_zero=key_zero, layer_format=layer_format)
    run(launches, grid=grid, block=block)
    return k, v


def copy_blocks(arenas, pairs, *, grid: Dims = None, block: Dims = None) -> None:
    for i, a in enumerate(arenas if isinstance(arenas, (list, tuple)) else [arenas]):
        _check_cpu(f"arenas[{i}]", a)
    run(plans.plan_copy_blocks(arenas, pairs), grid=grid, block=block)


def swap_blocks(src_arenas, dst_arenas, pairs, *, grid: Dims = None, block: Dims = None) -> None:
    for name, group in (("src_arenas", src_arenas), ("dst_arenas", dst_arenas)):
        for i, a in enumerate(group if isinstance(group, (list, tuple)) else [group]):
            _check_cpu(f"{name}[{i}]", a)
    run(plans.plan_swap_blocks(src_arenas, dst_arenas, pairs), grid=grid, block=block)


def convert_layout(arena, src_layout, dst_layout, *, scale=False, grid: Dims = None, block: Dims = None):
    _check_cpu("arena", arena)
    launches, out = plans.plan_convert_layout(arena, src_layout, dst_layout, scale=scale)
    run(launches, grid=grid, block=block)
    return out


def seal_key_blocks(kv_layer, blocks, keys, key_scale, key_zero, *, layout="NHD", layer_format=None,
                    grid: Dims = None, block: Dims = None) -> None:
    _check_cpu("kv_layer", kv_layer)
    launches = plans.plan_seal_key_blocks(kv_layer, blocks, keys, key_scale, key_zero, layout=layout,
                                          layer_format=layer_format)
    run(launches, grid=grid, block=block)


def paged_attention(q, kv_layer, indptr, indices, seq_lens, q_indptr, *, layout="NHD", kv_scale=None, kv_zero=None,
                    key_scale=None, key_zero=None, rotation_signs=None, sm_scale=None, soft_cap=None, window=None,
                    sink_tokens=0, num_splits=None, out=None, exact_rows=None, layer_format=None,
                    num_sms=attention_plans.DEFAULT_SMS, kernel="auto", workspace=None,
                    grid: Dims = None, block: Dims = None):
    """:func:`pagedkv.ops.paged_attention` through the CUDA kernels' plan, on the CPU.
    ``num_sms`` stands in for the GPU's SM count (it sets the automatic splits);
    ``kernel`` and ``workspace`` as :func:`pagedkv.kernels.ops.paged_attention` takes them."""
    _check_cpu("kv_layer", kv_layer)
    launches, out = attention_plans.plan_paged_attention(
        q, kv_layer, indptr, indices, seq_lens, q_indptr, layout=layout, kv_scale=kv_scale, kv_zero=kv_zero,
        key_scale=key_scale, key_zero=key_zero, rotation_signs=rotation_signs, sm_scale=sm_scale, soft_cap=soft_cap,
        window=window, sink_tokens=sink_tokens, num_splits=num_splits, out=out, exact_rows=exact_rows,
        layer_format=layer_format, num_sms=num_sms, kernel=kernel, workspace=workspace)
    run(launches, grid=grid, block=block)
    return out


def write_latent(view, slot_mapping, kv_c, k_pe, *, grid: Dims = None, block: Dims = None) -> None:
    """:func:`pagedkv.ops.latent.write_latent` through the kernels' plan, on the CPU."""
    _check_cpu("view.data", getattr(view, "data", None))
    run(latent_plans.plan_write_latent(view, slot_mapping, kv_c, k_pe), grid=grid, block=block)


def gather_latent(view, indptr, indices, seq_lens, *, out_dtype=None, grid: Dims = None, block: Dims = None):
    _check_cpu("view.data", getattr(view, "data", None))
    launches, kv_c, k_pe = latent_plans.plan_gather_latent(view, indptr, indices, seq_lens, out_dtype=out_dtype)
    run(launches, grid=grid, block=block)
    return kv_c, k_pe


def mla_attention(view, q_nope, q_pe, indptr, indices, seq_lens, q_indptr, *, sm_scale, num_splits=None, out=None,
                  num_sms=attention_plans.DEFAULT_SMS, grid: Dims = None, block: Dims = None):
    """:func:`pagedkv.ops.latent.mla_attention` through the kernels' plan, on the CPU
    (``grid``/``block`` override only the attention launch's dims, not the merge's)."""
    _check_cpu("view.data", getattr(view, "data", None))
    launches, out = latent_plans.plan_mla_attention(view, q_nope, q_pe, indptr, indices, seq_lens, q_indptr,
                                                    sm_scale=sm_scale, num_splits=num_splits, out=out,
                                                    num_sms=num_sms)
    run(launches[:1], grid=grid, block=block)
    run(launches[1:])
    return out
