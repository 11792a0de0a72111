"""Kernel sources and the entry points each one defines.

The ``.cu``/``.cuh``/``.h`` files live in the top-level ``cuda/`` folder, which the
wheel installs as the package data ``pagedkv._cuda_src``; they are read through
:mod:`importlib.resources` so a non-editable install finds them. A source tree that
was never installed (``PYTHONPATH=repo``) has no ``pagedkv._cuda_src`` package, so
there the repo's ``cuda/`` folder is used.

Entry-point names are generated here from the same variant axes the ``.cu`` macros
expand; the compile tests check that the two agree in both directions.
"""
from __future__ import annotations

import functools
import importlib.resources
import re
from dataclasses import dataclass, field
from pathlib import Path

from pagedkv.errors import InvalidArgumentError, expected
from pagedkv.format import dtypes

__all__ = [
    "KernelSource",
    "SOURCE_FILES",
    "LAYOUTS",
    "CHUNKS",
    "MODEL_TYPES",
    "QUANT_TYPES",
    "TABLES",
    "load",
    "entry_points",
    "write_kv_name",
    "gather_name",
    "copy_blocks_name",
    "transpose_name",
    "seal_keys_name",
    "ATTENTION_MODES",
    "attention_name",
    "attention_merge_name",
    "LATENT_FORMATS",
    "latent_format_name",
    "latent_write_name",
    "latent_gather_name",
    "latent_attention_name",
    "VARIANT_SOURCES",
    "decode_name",
    "decode_merge_name",
    "KV_MACROS",
]

SOURCE_FILES = ("write_kv.cu", "gather_kv.cu", "copy_blocks.cu", "convert_layout.cu", "seal_keys.cu",
                "paged_attention.cu", "latent_rows.cu", "latent_attention.cu")
#: sources compiled one variant at a time (their defines pick it and name its entry point;
#: pagedkv.kernels.decode_plans): not in the emulation's shared library nor SOURCE_FILES' tests
VARIANT_SOURCES = ("decode_attention.cu",)

#: variant axes, in the spelling of the entry-point names
LAYOUTS = ("nhd", "hnd")
CHUNKS = {"v16": 16, "e4": 4, "e2": 2, "e1": 1}  # copy unit -> bytes
MODEL_TYPES = tuple(d.kernel_name for d in dtypes.MODEL)
QUANT_TYPES = tuple(d.kernel_name for d in dtypes.QUANTIZED if d.compiled)
TABLES = ("csr", "pad")
#: the K/V storage name of an attention entry point -> its format macro (the tiled kernel's
#: PKV_ATTN_KV, the decode kernel's PKV_DEC_F); both attention plans read it here
KV_MACROS = {"f32": "PKV_F_F32", "f16": "PKV_F_F16", "bf16": "PKV_F_BF16", "e4m3": "PKV_Q_E4M3",
             "e5m2": "PKV_Q_E5M2", "int8": "PKV_Q_INT8", "int4": "PKV_Q_INT4", "int3": "PKV_Q_INT3"}
INDEX_TYPES = ("i32", "i64")

_INCLUDE = re.compile(rb'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


@dataclass(frozen=True)
class KernelSource:
    """One translation unit: its file name, text and every quoted header it pulls in
    (transitively), as ``{include name: bytes}``."""

    name: str
    text: bytes
    headers: dict[str, bytes] = field(default_factory=dict)

    def all_bytes(self) -> bytes:
        """Everything that determines the compiled code, in a stable order."""
        parts = [self.name.encode(), b"\0", self.text]
        for hname in sorted(self.headers):
            parts += [b"\0", hname.encode(), b"\0", self.headers[hname]]
        return b"".join(parts)


def _source_root():
    try:
        return importlib.resources.files("pagedkv._cuda_src")
    except ModuleNotFoundError:
        # Uninstalled source tree: the package maps to the repo's cuda/ folder.
        root = Path(__file__).resolve().parents[2] / "cuda"
        if not root.is_dir():
            raise
        return root


@functools.cache
def _read(name: str) -> bytes:
    return _source_root().joinpath(name).read_bytes()


def load(name: str) -> KernelSource:
    """The packaged source ``name`` (e.g. ``"write_kv.cu"``) with its headers."""
    if name not in SOURCE_FILES + VARIANT_SOURCES:
        raise InvalidArgumentError(expected("name", f"one of {', '.join(SOURCE_FILES + VARIANT_SOURCES)}", repr(name)))
    text = _read(name)
    headers: dict[str, bytes] = {}
    pending = [text]
    while pending:
        for inc in _INCLUDE.findall(pending.pop()):
            hname = inc.decode()
            if hname not in headers:
                headers[hname] = _read(hname)
                pending.append(headers[hname])
    return KernelSource(name, text, headers)


def write_kv_name(layout: str, chunk: str = "", in_type: str = "", quant: str = "", rotated: bool = False) -> str:
    """``pkv_write_kv_{layout}_{chunk}`` or ``pkv_write_kv_{layout}_{in}_to_{quant}[_rot]``."""
    if quant:
        return f"pkv_write_kv_{layout}_{in_type}_to_{quant}" + ("_rot" if rotated else "")
    return f"pkv_write_kv_{layout}_{chunk}"


def gather_name(table: str, layout: str, chunk: str = "", quant: str = "", out_type: str = "",
                rotated: bool = False, vec: bool = False) -> str:
    """``pkv_gather_{table}_{layout}_{chunk}`` or ``..._{quant}_to_{out}[_rot | _v16]``
    (``vec``: one thread per 16 output bytes)."""
    if quant:
        return f"pkv_gather_{table}_{layout}_{quant}_to_{out_type}" + ("_rot" if rotated else "_v16" if vec else "")
    return f"pkv_gather_{table}_{layout}_{chunk}"


def copy_blocks_name(chunk: str, index_type: str) -> str:
    return f"pkv_copy_blocks_{chunk}_{index_type}"


def transpose_name(chunk: str) -> str:
    return f"pkv_transpose_{chunk}"


def seal_keys_name(layout: str, in_type: str) -> str:
    """``pkv_seal_keys_{layout}_{in}``: int4 block keys from keys of model dtype ``in``."""
    return f"pkv_seal_keys_{layout}_{in_type}"


#: paged attention: decode (one query token per CTA) and prefill (query tiles)
ATTENTION_MODES = ("decode", "prefill")


def attention_name(mode: str, layout: str, kv_type: str, q_type: str) -> str:
    """``pkv_attn_{mode}_{layout}_{kv}`` (model-dtype K/V, q of that dtype) or
    ``pkv_attn_{mode}_{layout}_{quant}_q{q}``."""
    if kv_type in MODEL_TYPES:
        return f"pkv_attn_{mode}_{layout}_{kv_type}"
    return f"pkv_attn_{mode}_{layout}_{kv_type}_q{q_type}"


def attention_merge_name(out_type: str) -> str:
    return f"pkv_attn_merge_{out_type}"


def decode_name(layout: str, kv_type: str, head_dim: int, heads: int, lane_groups: int) -> str:
    """``pkv_decode_{layout}_{kv}_d{D}_g{G}_n{NGL}``: one variant of decode_attention.cu."""
    return f"pkv_decode_{layout}_{kv_type}_d{head_dim}_g{heads}_n{lane_groups}"


def decode_merge_name(out_type: str) -> str:
    """``pkv_decode_merge_{out}`` (in every variant of decode_attention.cu, for its head_dim)."""
    return f"pkv_decode_merge_{out_type}"


_COPY_CHUNKS_MODEL = ("v16", "e4", "e2")  # model dtypes are 4 or 2 bytes wide

#: MLA latent row formats with kernels: the model dtypes, fp8 (positional slice
#: bfloat16) and int8/int4 with the positional slice in each model dtype (latent_rows.cu,
#: latent_attention.cu)
LATENT_FORMATS = MODEL_TYPES + ("e4m3",) + tuple(f"{q}_r{t}" for q in ("int8", "int4") for t in MODEL_TYPES)


def latent_format_name(kv_dtype: str, rope_type: str) -> str:
    """The kernels' spelling of a latent row format (``kv_dtype`` a kernel name, e.g.
    ``"bf16"``, ``"e4m3"``, ``"int4"``; ``rope_type`` the positional slice's)."""
    if kv_dtype in MODEL_TYPES or kv_dtype == "e4m3":
        return kv_dtype
    return f"{kv_dtype}_r{rope_type}"


def latent_write_name(in_type: str, fmt: str) -> str:
    return f"pkv_latent_write_{in_type}_to_{fmt}"


def latent_gather_name(fmt: str, out_type: str) -> str:
    return f"pkv_latent_gather_{fmt}_to_{out_type}"


def latent_attention_name(fmt: str, q_type: str) -> str:
    return f"pkv_latent_attn_{fmt}_q{q_type}"


def _latent_attention_entries() -> list[str]:
    out = [latent_attention_name(t, t) for t in MODEL_TYPES]
    out += [latent_attention_name("e4m3", t) for t in MODEL_TYPES]
    out += [latent_attention_name(f"{q}_r{t}", t) for q in ("int8", "int4") for t in MODEL_TYPES]
    return out


@functools.cache
def entry_points() -> dict[str, tuple[str, ...]]:
    """``{source file: every extern "C" kernel it defines}``."""
    write = [write_kv_name(lo, chunk=c) for lo in LAYOUTS for c in _COPY_CHUNKS_MODEL]
    write += [write_kv_name(lo, in_type=t, quant=q, rotated=r) for lo in LAYOUTS for t in MODEL_TYPES
              for q in QUANT_TYPES for r in (False, True)]
    gather = []
    for tb in TABLES:
        for lo in LAYOUTS:
            gather += [gather_name(tb, lo, chunk=c) for c in _COPY_CHUNKS_MODEL]
            gather += [gather_name(tb, lo, quant=q, out_type=o, rotated=r) for q in QUANT_TYPES
                       for o in MODEL_TYPES for r in (False, True)]
            gather += [gather_name(tb, lo, quant=q, out_type=o, vec=True) for q in QUANT_TYPES for o in MODEL_TYPES]
    copy = [copy_blocks_name(c, i) for c in CHUNKS for i in INDEX_TYPES]
    transpose = [transpose_name(c) for c in CHUNKS]
    seal = [seal_keys_name(lo, t) for lo in LAYOUTS for t in MODEL_TYPES]
    attn = [attention_name(m, lo, t, t) for m in ATTENTION_MODES for lo in LAYOUTS for t in MODEL_TYPES]
    attn += [attention_name(m, lo, k, t) for m in ATTENTION_MODES for lo in LAYOUTS for k in QUANT_TYPES
             for t in MODEL_TYPES]
    attn += [attention_merge_name(t) for t in MODEL_TYPES]
    return {
        "write_kv.cu": tuple(write),
        "gather_kv.cu": tuple(gather),
        "copy_blocks.cu": tuple(copy),
        "convert_layout.cu": tuple(transpose),
        "seal_keys.cu": tuple(seal),
        "paged_attention.cu": tuple(attn),
        "latent_rows.cu": tuple([latent_write_name(i, f) for f in LATENT_FORMATS for i in MODEL_TYPES]
                                + [latent_gather_name(f, o) for f in LATENT_FORMATS for o in MODEL_TYPES]),
        "latent_attention.cu": tuple(_latent_attention_entries()),
    }
