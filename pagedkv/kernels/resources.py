"""What a compiled kernel uses, read off its cubin without a GPU.

NVRTC builds machine code (cubin) for any architecture with no driver; the CUDA binary
utilities from PyPI (``nvidia-cuda-cuobjdump``, ``nvidia-cuda-nvdisasm``, in the ``cuda``
extra) read it: ``cuobjdump -res-usage`` gives registers, stack and local memory (a
spill shows as stack or local bytes), ``nvdisasm`` the SASS. :func:`decode_facts` finds
the decode kernel's main loop in the SASS (the innermost loop around its
``cp.async.wait_group``, with the bodies of the subroutines it calls) and counts what
matters there: 128-bit copies and shared loads, shuffles, barriers, int->float
conversions.

    python -m pagedkv.kernels.resources            # the facts of the checked variants, JSON lines
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from pagedkv.errors import KernelUnavailableError
from pagedkv.kernels import build, decode_plans
from pagedkv.kernels.decode_plans import DecodeVariant
from pagedkv.kernels.options import CompileOptions

__all__ = ["tool", "compile_cubin", "resource_usage", "function_sass", "main_loop", "decode_facts",
           "CHECKED_VARIANTS", "REGISTER_CAP"]

#: registers a decode thread may use: 65536 / (3 CTAs x 128 threads), rounded to the allocation unit
REGISTER_CAP = 168
_INSN = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^(\.L_x_\d+|\$[\w$]+):")
_TARGET = re.compile(r"`\((\.L_x_\d+|\$[\w$]+)\)")


def tool(name: str) -> str | None:
    """The path of a CUDA binary utility: the PyPI wheel's copy, else one on PATH."""
    try:
        import nvidia

        for root in getattr(nvidia, "__path__", []):
            for sub in ("cu13", "cu12", "cuda_cuobjdump", "cuda_nvdisasm"):
                p = Path(root) / sub / "bin" / name
                if p.is_file() and os.access(p, os.X_OK):
                    return str(p)
    except ImportError:
        pass
    return shutil.which(name)


def _run(name: str, *args: str) -> str:
    exe = tool(name)
    if exe is None:
        raise KernelUnavailableError(f"{name} is not installed: pip install nvidia-cuda-{name} (the cuda extra)")
    return subprocess.run([exe, *args], capture_output=True, text=True, check=True).stdout


def compile_cubin(variant: DecodeVariant, layout: str = "NHD", arch: str = "sm_90") -> bytes:
    """The cubin of one decode variant (through the kernel caches)."""
    opts = CompileOptions(arch=arch, target="cubin", defines=variant.defines(layout))
    return build.build("decode_attention.cu", opts).data


def _with_file(cubin: bytes, fn):
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return fn(f.name)


def resource_usage(cubin: bytes) -> dict[str, dict[str, int]]:
    """``{function: {"REG": n, "STACK": bytes, "SHARED": bytes, "LOCAL": bytes, ...}}``."""
    text = _with_file(cubin, lambda p: _run("cuobjdump", "-res-usage", p))
    out: dict[str, dict[str, int]] = {}
    name = None
    for line in text.splitlines():
        m = re.match(r"\s*Function (\S+):", line)
        if m:
            name = m.group(1)
        elif name and "REG:" in line:
            out[name] = {k: int(v) for k, v in re.findall(r"(\w+(?:\[\d+\])?):(\d+)", line)}
            name = None
    return out


def function_sass(cubin: bytes, function: str) -> list[str]:
    """The SASS lines (instructions and labels) of ``function`` and its subroutines."""
    text = _with_file(cubin, lambda p: _run("nvdisasm", "-c", p))
    lines, inside = [], False
    for line in text.splitlines():
        if line.startswith("//---") and ".text." in line:
            inside = f".text.{function} " in line + " "
        elif inside:
            lines.append(line)
    return lines


def main_loop(sass: list[str], anchor: str) -> list[str]:
    """The opcodes of the innermost loop whose body holds the instruction ``anchor`` (a
    prefix such as ``"DEPBAR.LE SB0, 0x2"``), plus the bodies of the subroutines it calls."""
    insns: list[tuple[int, str]] = []
    labels: dict[str, int] = {}
    for line in sass:
        lab = _LABEL.match(line.strip())
        if lab:
            labels[lab.group(1)] = len(insns)
            continue
        m = _INSN.match(line)
        if m:
            insns.append((int(m.group(1), 16), m.group(2).split("@")[-1].strip()))
    at = next((i for i, (_, op) in enumerate(insns) if anchor in op), None)
    if at is None:
        return []
    best = None
    for i, (_, op) in enumerate(insns):
        t = _TARGET.search(op)
        if i >= at and t and "BRA" in op and labels.get(t.group(1), 10**9) <= at:
            lo = labels[t.group(1)]
            if best is None or i - lo < best[1] - best[0]:
                best = (lo, i)
    if best is None:
        return []
    body = [op for _, op in insns[best[0]:best[1] + 1]]
    for op in list(body):  # subroutines called from the loop run in it
        t = _TARGET.search(op)
        if "CALL" in op and t and t.group(1) in labels:
            j = labels[t.group(1)]
            while j < len(insns) and not insns[j][1].startswith("RET"):
                body.append(insns[j][1])
                j += 1
    return body


def _opcode(op: str) -> str:
    return op.split()[0] if op.split() else ""


def decode_facts(variant: DecodeVariant, layout: str = "NHD", arch: str = "sm_90") -> dict:
    """Registers, spills and the main loop's instruction counts of one decode variant."""
    cubin = compile_cubin(variant, layout, arch)
    name = variant.name(layout)
    use = resource_usage(cubin)[name]
    loop = main_loop(function_sass(cubin, name), "DEPBAR.LE SB0")  # cp.async.wait_group
    ops = Counter(_opcode(op) for op in loop)

    def count(pred) -> int:
        return sum(n for o, n in ops.items() if pred(o))

    return dict(
        kernel=name, arch=arch, registers=use["REG"], stack=use.get("STACK", 0), local=use.get("LOCAL", 0),
        shared=use.get("SHARED", 0), vector_bytes=variant.vector_bytes, loop_instructions=len(loop),
        cp_async_128=count(lambda o: o.startswith("LDGSTS") and ".128" in o),
        cp_async=count(lambda o: o.startswith("LDGSTS")),
        shared_loads_128=count(lambda o: o.startswith("LDS") and ".128" in o),
        shuffles=count(lambda o: o.startswith("SHFL")), barriers=count(lambda o: o.startswith("BAR")),
        int_to_float=count(lambda o: o.startswith(("I2F", "I2FP"))), ffma=count(lambda o: o == "FFMA"),
        global_loads=count(lambda o: o.startswith("LDG") and not o.startswith("LDGSTS") and o != "LDGDEPBAR"),
    )


#: the variants the resource check compiles (tests/test_decode_resources.py): every format at
#: head_dim 128 with one and four heads a CTA, the extremes of head_dim and heads, the lane
#: scale-group counts of int4/int3, and the HND layout
def _checked() -> tuple[tuple[DecodeVariant, str], ...]:
    v = decode_plans.decode_variant
    picks = [(v(f, 128, g, 4 if f in ("int4", "int3") else 1), "NHD") for f in decode_plans.BITS for g in (1, 4)]
    picks += [(v("f16", 64, 8), "NHD"), (v("bf16", 256, 2), "NHD"), (v("int4", 128, 1, 16), "NHD"),
              (v("int4", 64, 1, 8), "NHD"), (v("int3", 128, 2, 8), "NHD"), (v("e4m3", 128, 3), "HND"),
              (v("int8", 64, 3), "HND")]
    return tuple(dict.fromkeys((x, lo) for x, lo in picks if x is not None))


CHECKED_VARIANTS: tuple[tuple[DecodeVariant, str], ...] = _checked()


def main(argv=None) -> int:
    for variant, layout in CHECKED_VARIANTS:
        print(json.dumps(decode_facts(variant, layout)))
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
