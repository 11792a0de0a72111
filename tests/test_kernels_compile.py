"""NVRTC compiles every kernel variant for sm_80/sm_89/sm_90; the build caches work.

No GPU or driver is needed: NVRTC compiles to PTX on its own. Each source is
compiled once per arch (all its entry points at once) into a session-scoped
cache dir, and the per-variant tests look their entry up in that PTX.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-python (NVRTC) is not installed")

from pagedkv.errors import InvalidArgumentError, KernelCompileError  # noqa: E402
from pagedkv.kernels import build, sources  # noqa: E402
from pagedkv.kernels.options import CompileOptions  # noqa: E402
from pagedkv.kernels.sources import KernelSource  # noqa: E402

ARCHS = ("sm_80", "sm_89", "sm_90")
ENTRY = re.compile(rb"\.(?:visible\s+)?\.?entry\s+(\w+)")

TINY = b'extern "C" __global__ void pkv_tiny(int* p) { p[threadIdx.x] = 1; }\n'


@contextlib.contextmanager
def _cache_dir(path):
    old = os.environ.get("PAGEDKV_CACHE_DIR")
    os.environ["PAGEDKV_CACHE_DIR"] = str(path)
    try:
        yield path
    finally:
        if old is None:
            os.environ.pop("PAGEDKV_CACHE_DIR", None)
        else:
            os.environ["PAGEDKV_CACHE_DIR"] = old


@pytest.fixture(scope="session")
def ptx(tmp_path_factory):
    """(source, arch) -> PTX bytes. Everything is compiled up front into a fresh
    cache dir, two at a time (NVRTC releases the GIL), so the run is hermetic."""
    jobs = [(s, a) for s in sources.SOURCE_FILES for a in ARCHS]
    with _cache_dir(tmp_path_factory.mktemp("kernel-cache")), ThreadPoolExecutor(max_workers=2) as pool:
        arts = pool.map(lambda job: build.build(job[0], CompileOptions(arch=job[1])), jobs)
        compiled = dict(zip(jobs, (a.data for a in arts)))
    return lambda source, arch: compiled[(source, arch)]


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty cache dir and an empty in-process cache, restored afterwards."""
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path))
    build.clear_memory_cache()
    yield tmp_path
    build.clear_memory_cache()


# ----------------------------------------------------------------------------------
# every variant compiles


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("source", sources.SOURCE_FILES)
def test_source_defines_exactly_its_registered_entry_points(ptx, source, arch):
    code = ptx(source, arch)
    assert f".target {arch}".encode() in code
    assert set(n.decode() for n in ENTRY.findall(code)) == set(sources.entry_points()[source])


def test_attention_compiles_one_storage_format_at_a_time(tmp_path):
    """A launch compiles paged_attention.cu for its K/V format only (PKV_ATTN_KV): each
    part holds exactly that format's entries (both modes, layouts and query dtypes) and the
    merges, and the parts together are the whole file."""
    from pagedkv.kernels import attention_plans

    names = sources.entry_points()["paged_attention.cu"]
    jobs = sorted(attention_plans._KV_MACROS.items())
    with _cache_dir(tmp_path), ThreadPoolExecutor(max_workers=2) as pool:
        parts = list(pool.map(lambda job: build.build("paged_attention.cu", CompileOptions(
            arch="sm_90", defines={"PKV_ATTN_KV": job[1]})).data, jobs))
    seen = set()
    for (kv, _), code in zip(jobs, parts):
        got = set(n.decode() for n in ENTRY.findall(code))
        want = {n for n in names if n.startswith("pkv_attn_merge_") or n.split("_")[4] == kv}
        assert got == want, kv
        assert len(want) > 3, kv
        seen |= got
    assert seen == set(names)


@pytest.mark.parametrize("source", ["write_kv.cu", "gather_kv.cu", "seal_keys.cu", "latent_rows.cu"])
def test_quantization_math_is_not_contracted_into_fma(ptx, source):
    # The torch reference rounds after every multiply and add; an FMA would not.
    # (The attention sources call expf, whose libdevice body is made of FMAs: they are
    # checked against the float64 reference within a bound instead.)
    assert b"fma.rn.f32" not in ptx(source, "sm_90")


def test_cubin_target_is_machine_code(fresh_cache):
    art = build.build("convert_layout.cu", CompileOptions(arch="sm_90", target="cubin"))
    assert art.data[:4] == b"\x7fELF"
    assert art.target == "cubin"


def test_sources_carry_their_headers_transitively():
    src = sources.load("write_kv.cu")
    assert set(src.headers) == {"common.cuh", "emulate.h", "emulate_fibers.h", "quant_scalar.h"}   # common.cuh includes the scalar header, emulate.h the fiber scheduler
    assert b"pkv_write_kv_copy" in src.text


def test_unknown_source_name_is_rejected():
    with pytest.raises(InvalidArgumentError, match=r"name: expected one of write_kv.cu, .*, got 'nope.cu'"):
        sources.load("nope.cu")


# ----------------------------------------------------------------------------------
# options


def test_options_translate_to_nvrtc_flags():
    opts = CompileOptions(
        arch="sm_90a", target="cubin", defines={"B": "2", "A": None}, line_info=True,
        max_registers=64, include_dirs=("/inc",),
    )
    assert opts.nvrtc_flags() == (
        "--gpu-architecture=sm_90a",
        "--std=c++17",
        "--fmad=false",
        "--generate-line-info",
        "--maxrregcount=64",
        "-DA",
        "-DB=2",
        "--include-path=/inc",
    )
    assert CompileOptions(arch="sm_89").nvrtc_flags()[0] == "--gpu-architecture=compute_89"
    assert CompileOptions(arch="sm_89").compute_capability == (8, 9)


def test_define_order_does_not_change_the_options():
    assert CompileOptions(defines={"A": "1", "B": "2"}) == CompileOptions(defines=(("B", "2"), ("A", "1")))


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"arch": "compute_80"}, r"arch: expected 'sm_XY' such as 'sm_80' or 'sm_90a', got 'compute_80'"),
        ({"target": "fatbin"}, r"target: expected 'ptx' or 'cubin', got 'fatbin'"),
        ({"std": "c++11"}, r"std: expected 'c\+\+17' or 'c\+\+20', got 'c\+\+11'"),
        ({"defines": {"1X": None}}, r"defines: expected C identifiers as names, got '1X'"),
        ({"max_registers": 0}, r"max_registers: expected a positive int or None, got 0"),
    ],
)
def test_invalid_options_are_rejected(kwargs, message):
    with pytest.raises(InvalidArgumentError, match=message):
        CompileOptions(**kwargs)


# ----------------------------------------------------------------------------------
# caches


def test_second_build_hits_memory_then_disk_without_recompiling(fresh_cache):
    src, opts = KernelSource("tiny.cu", TINY), CompileOptions(arch="sm_80")
    before = build.stats.compiles
    first = build.build(src, opts)
    assert build.stats.compiles == before + 1
    assert (fresh_cache / f"{first.key}.ptx").read_bytes() == first.data

    mem = build.stats.memory_hits
    assert build.build(src, opts) is first
    assert build.stats.memory_hits == mem + 1

    build.clear_memory_cache()
    disk = build.stats.disk_hits
    again = build.build(src, opts)
    assert again.data == first.data
    assert build.stats.disk_hits == disk + 1
    assert build.stats.compiles == before + 1  # never compiled a second time


@pytest.mark.parametrize(
    "change",
    ["source", "header", "arch", "define"],
)
def test_any_input_change_recompiles(fresh_cache, change):
    header = {"tiny.cuh": b"#define PKV_VALUE 1\n"}
    text = b'#include "tiny.cuh"\n' + TINY.replace(b"= 1", b"= PKV_VALUE")
    base_src, base_opts = KernelSource("tiny.cu", text, header), CompileOptions(arch="sm_80")
    base = build.build(base_src, base_opts)
    src, opts = base_src, base_opts
    if change == "source":
        src = KernelSource("tiny.cu", text + b"// edited\n", header)
    elif change == "header":
        src = KernelSource("tiny.cu", text, {"tiny.cuh": b"#define PKV_VALUE 2\n"})
    elif change == "arch":
        opts = CompileOptions(arch="sm_90")
    else:
        opts = CompileOptions(arch="sm_80", defines={"PKV_EXTRA": None})
    before = build.stats.compiles
    other = build.build(src, opts)
    assert build.stats.compiles == before + 1
    assert other.key != base.key
    if change == "header":  # the header's value reaches the code
        assert other.data != base.data


def test_lock_holder_compiling_first_is_rechecked_not_recompiled(fresh_cache, monkeypatch):
    src, opts = KernelSource("tiny.cu", TINY), CompileOptions(arch="sm_80")
    key = build.cache_key(src, opts)
    real_lock = build._file_lock
    waiting = threading.Event()

    @contextlib.contextmanager
    def spying_lock(path):
        waiting.set()
        with real_lock(path):
            yield

    monkeypatch.setattr(build, "_file_lock", spying_lock)
    result = []
    before = (build.stats.compiles, build.stats.recheck_hits)
    with real_lock(fresh_cache / f"{key}.lock"):  # "another process" holds the lock
        worker = threading.Thread(target=lambda: result.append(build.build(src, opts)))
        worker.start()
        assert waiting.wait(30), "build() never reached the lock"
        build._write_entry(fresh_cache / f"{key}.ptx", b"// compiled elsewhere\0")
    worker.join(30)
    assert result and result[0].data == b"// compiled elsewhere\0"
    assert (build.stats.compiles, build.stats.recheck_hits) == (before[0], before[1] + 1)


_RACE = """
import json, sys
from pagedkv.kernels import build
from pagedkv.kernels.options import CompileOptions
from pagedkv.kernels.sources import KernelSource
art = build.build(KernelSource("race.cu", sys.argv[1].encode()), CompileOptions(arch="sm_80"))
print(json.dumps({"compiles": build.stats.compiles, "size": len(art.data)}))
"""


def test_two_processes_compile_a_kernel_once(fresh_cache):
    root = Path(build.__file__).resolve().parents[2]
    env = dict(os.environ, PAGEDKV_CACHE_DIR=str(fresh_cache))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(root)) if p)
    text = TINY.decode() + "// race\n"
    procs = [subprocess.Popen([sys.executable, "-c", _RACE, text], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
    reports = [json.loads(out) for out, _ in outs]
    assert sum(r["compiles"] for r in reports) == 1
    assert reports[0]["size"] == reports[1]["size"] > 0


def test_unusable_cache_dir_warns_and_still_compiles(fresh_cache, monkeypatch):
    blocker = fresh_cache / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(blocker))
    before = build.stats.compiles
    with pytest.warns(RuntimeWarning, match=r"kernel cache .*not-a-dir is unusable"):
        art = build.build(KernelSource("tiny.cu", TINY), CompileOptions(arch="sm_80"))
    assert b".entry pkv_tiny" in art.data
    assert build.stats.compiles == before + 1


def test_compile_error_carries_log_and_file_name(fresh_cache):
    broken = KernelSource("broken_kernel.cu", b'extern "C" __global__ void k() { this is not cuda; }\n')
    before = build.stats.compiles
    with pytest.raises(KernelCompileError, match=r"NVRTC failed to compile broken_kernel\.cu") as info:
        build.build(broken, CompileOptions(arch="sm_80"))
    assert info.value.filename == "broken_kernel.cu"
    assert "error" in info.value.log and "broken_kernel.cu" in info.value.log
    assert info.value.options == CompileOptions(arch="sm_80")
    assert build.stats.compiles == before
    assert not list(fresh_cache.glob("*.ptx"))  # failures are not cached
