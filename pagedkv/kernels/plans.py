"""Launch plans: validation, variant choice and kernel arguments.

A plan function checks its inputs (the reference's structural checks first, so
every backend raises the same messages, then what the kernels add: contiguity,
unit last-dim strides, element alignment), picks the kernel variant (16-byte
vectors when every size and pointer allows, else per element), and returns
:class:`Launch` records. The CUDA launchers (:mod:`pagedkv.kernels.ops`) and the
host emulation (:mod:`pagedkv.kernels.emulation`) run the very same records, so
the emulation tests cover this module too. Plans never touch a device stream
themselves: the caller wraps them in the launch stream's context, which is where
the few helper tensors (uploaded pairs, prefix sums, outputs) are made.

Index *values* that live on a GPU (slots, block tables, pairs) are not read here:
that would cost a device sync per call. The kernels guard every access instead, so
a bad id is skipped (writes, copies) or reads as zeros (gathers), and never touches
memory outside the tensors. Pairs given on the CPU are checked like the reference.
"""
from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pagedkv.errors import DeviceError, DTypeError, InvalidArgumentError, ShapeError, expected
from pagedkv.format import dtypes
from pagedkv.format import op_checks as checks
from pagedkv.kernels import sources

__all__ = [
    "Launch",
    "launch_dims",
    "check_dims",
    "as_tensor",
    "plan_write_kv",
    "plan_seal_key_blocks",
    "plan_gather",
    "plan_copy_blocks",
    "plan_swap_blocks",
    "plan_convert_layout",
]

THREADS = 256  # per CTA: enough to hide latency, small enough to fill every SM
ROT_FLOATS = 4096  # cuda/common.cuh PKV_ROT_FLOATS: shared floats for the rows a rotating CTA holds
MAX_GRID_X = 2**31 - 1
MAX_GRID_Y = 65535

_MODEL_NAMES = {d.torch_dtype: d.kernel_name for d in dtypes.MODEL}
#: storage format name -> kernel spelling, for the formats with kernels (int4 and int3
#: share the uint8 data dtype, so formats are keyed by name: LayerGeometry.kv_dtype)
_QUANT_NAMES = {d.name: d.kernel_name for d in dtypes.QUANTIZED if d.kernel_name in sources.QUANT_TYPES}
_CHUNK_NAMES = {16: "v16", 4: "e4", 2: "e2", 1: "e1"}

Arg = tuple[str, object]  # ("ptr" | "i64" | "i32", int) or ("f32", float)


@dataclass(frozen=True)
class Launch:
    """One kernel launch: source file, entry point, dims and typed arguments.

    ``keep`` holds helper tensors the arguments point into, so they outlive the plan.
    """

    source: str
    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    args: tuple[Arg, ...]
    keep: tuple[object, ...] = field(default=(), compare=False, repr=False)
    #: preprocessor macros the source is compiled with for this launch (``(name, value)``
    #: pairs): a source that instantiates many entries can be compiled a part at a time
    defines: tuple[tuple[str, str | None], ...] = ()

    def pack_args(self):
        """``(argv, values)``: a ``void*[]`` pointing at each argument's C value, in
        cuLaunchKernel's ``kernelParams`` form; keep ``values`` alive while in use."""
        values = [_CTYPES[kind](value) for kind, value in self.args]  # type: ignore[arg-type]  # ints by kind
        argv = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        return argv, values


_CTYPES = {"ptr": ctypes.c_void_p, "i64": ctypes.c_int64, "i32": ctypes.c_int32, "f32": ctypes.c_float}


def check_dims(grid: Sequence[int], block: Sequence[int]) -> None:
    """Reject launch dims a GPU would refuse (the emulation enforces them too)."""
    gx, gy, gz = grid
    bx, by, bz = block
    if not (1 <= gx <= MAX_GRID_X and 1 <= gy <= MAX_GRID_Y and 1 <= gz <= MAX_GRID_Y):
        raise InvalidArgumentError(expected("grid", f"1 <= x <= {MAX_GRID_X}, 1 <= y, z <= {MAX_GRID_Y}", tuple(grid)))
    if not (1 <= bx <= 1024 and 1 <= by <= 1024 and 1 <= bz <= 64 and bx * by * bz <= 1024):
        raise InvalidArgumentError(expected("block", "at most 1024 threads (x, y <= 1024, z <= 64)", tuple(block)))


def launch_dims(rows: int, cols: int, threads: int = THREADS):
    """(grid, block) for a rows x cols grid-stride loop nest: x covers a row's
    columns (rounded up to a power of two), y packs as many rows as fill the CTA.
    Grids are capped at the hardware limits; the loops stride over the rest."""
    bx = 1
    while bx < cols and bx < threads:
        bx *= 2
    by = max(1, threads // bx)
    while by > 1 and by // 2 >= rows:
        by //= 2
    gx = min(max(1, -(-cols // bx)), MAX_GRID_X)
    gy = min(max(1, -(-rows // by)), MAX_GRID_Y)
    return (gx, gy, 1), (bx, by, 1)


def _launch(source: str, kernel: str, rows: int, cols: int, args: Sequence[Arg], keep=()) -> Launch:
    grid, block = launch_dims(rows, cols)
    return Launch(source, kernel, grid, block, tuple(args), tuple(keep))


def as_tensor(x: object) -> object:
    """A torch view of any DLPack tensor (zero-copy); other objects pass through for
    the checks to reject."""
    if isinstance(x, torch.Tensor) or x is None or not hasattr(x, "__dlpack__"):
        return x
    return torch.from_dlpack(x)


# ----------------------------------------------------------------------------------
# checks the kernels add to the reference's


def _check_kernel_dtype(geo: checks.LayerGeometry) -> None:
    if geo.quantized and geo.kv_dtype not in _QUANT_NAMES:
        row = dtypes.info(geo.kv_dtype)  # type: ignore[arg-type]  # quantized: named
        raise DTypeError(expected("kv_layer", f"a kv dtype with a CUDA kernel ({', '.join(sources.QUANT_TYPES)} "
                                  "or a model dtype)", f"{row.name} ({row.torch_name})"))


def _check_contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise InvalidArgumentError(expected(name, "a contiguous tensor", f"strides {tuple(t.stride())}"))


def _check_rows(name: str, t: torch.Tensor) -> None:
    """[num_tokens, H, D] inputs may have any token/head strides, but D is dense."""
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise InvalidArgumentError(expected(name, "unit stride in the last dim (head_dim)", f"strides {tuple(t.stride())}"))


def _check_aligned(name: str, t: torch.Tensor) -> None:
    if t.data_ptr() % t.element_size():
        raise InvalidArgumentError(
            expected(name, f"a data pointer aligned to its {t.element_size()}-byte elements", hex(t.data_ptr()))
        )


def _vector_ok(byte_sizes: Sequence[int], tensors: Sequence[torch.Tensor]) -> bool:
    return all(b % 16 == 0 for b in byte_sizes) and all(t.data_ptr() % 16 == 0 for t in tensors)


def _chunk_for(nbytes: int, *ptrs: int) -> int:
    """The widest copy unit that divides ``nbytes`` and every pointer."""
    for c in (16, 4, 2, 1):
        if nbytes % c == 0 and all(p % c == 0 for p in ptrs):
            return c
    return 1  # unreachable: 1 divides everything


def _ptr(t: torch.Tensor | None) -> Arg:
    return ("ptr", 0 if t is None else t.data_ptr())


def _i64(v: int) -> Arg:
    return ("i64", int(v))


def _check_signs(rotation_signs, geo, device, write: bool = False, explicit: bool = False) -> torch.Tensor | None:
    """The rotation signs a kernel reads (contiguous), after the shared checks and the
    kernels' own bound: a CTA row holds a whole head_dim row in shared memory."""
    checks.check_rotation(rotation_signs, geo, device, write=write, explicit=explicit)
    if rotation_signs is None:
        return None
    if geo.head_dim > ROT_FLOATS:
        raise InvalidArgumentError(expected("rotation_signs", f"a head_dim <= {ROT_FLOATS} for the rotating kernels",
                                            geo.head_dim))
    signs = rotation_signs.contiguous()
    _check_aligned("rotation_signs", signs)
    return signs


def _rot_dims(rows: int, cols: int, head_dim: int):
    """(grid, block) of a cooperative rotating kernel: x shares a row's ``cols``, y packs
    as many rows as the shared row buffer holds; the CTAs stride over the rows."""
    _, block = launch_dims(rows, cols)
    by = max(1, min(block[1], ROT_FLOATS // head_dim))
    return (1, min(max(1, -(-rows // by)), MAX_GRID_Y), 1), (block[0], by, 1)


# ----------------------------------------------------------------------------------
# write_kv


def plan_write_kv(kv_layer, slot_mapping, key, value, *, layout="NHD", kv_scale=None, kv_zero=None,
                  rotation_signs=None, layer_format=None) -> list[Launch]:
    """Plan :func:`pagedkv.ops.reference.write_kv` (same arguments)."""
    geo = checks.check_write_kv(kv_layer, slot_mapping, key, value, layout, kv_scale, kv_zero, layer_format)
    signs = _check_signs(rotation_signs, geo, kv_layer.device, write=True, explicit=layer_format is not None)
    _check_kernel_dtype(geo)
    _check_contiguous("kv_layer", kv_layer)
    if geo.quantized:
        _check_contiguous("kv_scale", kv_scale)
        if kv_zero is not None:
            _check_contiguous("kv_zero", kv_zero)
        if geo.head_dim == 0:
            raise ShapeError(expected("key", "a non-empty head_dim for a quantized kv_layer", tuple(key.shape)))
    for name, t in (("key", key), ("value", value)):
        _check_rows(name, t)
        _check_aligned(name, t)
    tokens, heads, dim = key.shape
    if tokens == 0 or heads == 0 or dim == 0:
        return []
    slots = slot_mapping.contiguous()
    lo = layout.lower()
    tail = [_i64(tokens), _i64(geo.num_blocks * geo.block_size), _i64(geo.block_size), _i64(heads)]
    if geo.quantized:
        name = sources.write_kv_name(lo, in_type=_MODEL_NAMES[key.dtype], quant=_QUANT_NAMES[geo.kv_dtype],  # type: ignore[index]
                                     rotated=signs is not None)
        groups = geo.groups
        args = [_ptr(kv_layer), _ptr(kv_scale), _ptr(kv_zero), _ptr(key), _ptr(value), _ptr(slots)]
        args += tail + [_i64(dim), _i64(groups)]
        args += [_i64(key.stride(0)), _i64(key.stride(1)), _i64(value.stride(0)), _i64(value.stride(1))]
        if signs is not None:
            grid, block = _rot_dims(tokens * 2 * heads, dim // groups, dim)
            return [Launch("write_kv.cu", name, grid, block, tuple(args + [_ptr(signs)]), (slots, signs))]
        # cooperative: a CTA row of threads shares each (token, K/V, head) row, so
        # the grid's x is 1 and its CTAs stride over the rows (see write_kv.cu)
        grid, block = launch_dims(tokens * 2 * heads, dim // groups)
        return [Launch("write_kv.cu", name, (1, grid[1], 1), block, tuple(args), (slots,))]
    elt = key.element_size()
    strides = [key.stride(0), key.stride(1), value.stride(0), value.stride(1)]
    unit = 16 if _vector_ok([dim * elt] + [s * elt for s in strides], [kv_layer, key, value]) else elt
    per = unit // elt  # elements per copy unit
    name = sources.write_kv_name(lo, chunk=_CHUNK_NAMES[unit])
    head_chunks = dim // per
    args = [_ptr(kv_layer), _ptr(key), _ptr(value), _ptr(slots)] + tail + [_i64(head_chunks)]
    args += [_i64(s // per) for s in strides]
    return [_launch("write_kv.cu", name, tokens, heads * head_chunks, args, (slots,))]


# ----------------------------------------------------------------------------------
# seal_key_blocks


def plan_seal_key_blocks(kv_layer, blocks, keys, key_scale, key_zero, *, layout="NHD",
                         layer_format=None) -> list[Launch]:
    """Plan :func:`pagedkv.ops.reference.seal_key_blocks` (same arguments).

    The ids are read once, from a copy the kernel then reads too: on the CPU they are
    checked like the reference (InvalidBlockError before any write); on a GPU they are
    not read (no sync), and the kernel skips an id outside the layer. A repeated id
    leaves each of its bytes from one of its rows (unspecified which).
    """
    geo = checks.check_seal_key_blocks(kv_layer, blocks, keys, key_scale, key_zero, layout, layer_format)
    ids = blocks.clone(memory_format=torch.contiguous_format)  # the one read of the caller's tensor
    if ids.device.type == "cpu":
        checks.check_block_ids("blocks", ids.tolist(), geo.num_blocks)
    _check_contiguous("kv_layer", kv_layer)
    _check_rows("keys", keys)
    for name, t in (("keys", keys), ("key_scale", key_scale), ("key_zero", key_zero)):
        _check_aligned(name, t)
    seals = ids.shape[0]
    if seals == 0:
        return []
    name = sources.seal_keys_name(layout.lower(), _MODEL_NAMES[keys.dtype])
    args = [_ptr(kv_layer), _ptr(key_scale), _ptr(key_zero), _ptr(keys), _ptr(ids), _i64(seals)]
    args += [_i64(geo.num_blocks), _i64(geo.block_size), _i64(geo.num_heads), _i64(geo.head_dim)]
    args += [_i64(keys.stride(0)), _i64(keys.stride(1)), _i64(keys.stride(2))]
    return [_launch("seal_keys.cu", name, seals * geo.num_heads, geo.head_dim // 2, args, (ids,))]


# ----------------------------------------------------------------------------------
# gather_kv / gather_kv_padded


def plan_gather(
    kv_layer,
    seq_lens,
    *,
    indptr=None,
    indices=None,
    block_table=None,
    layout="NHD",
    out_dtype=None,
    kv_scale=None,
    kv_zero=None,
    out_key=None,
    out_value=None,
    rotation_signs=None,
    key_scale=None,
    key_zero=None,
    layer_format=None,
):
    """Plan a CSR (``indptr``/``indices``) or padded (``block_table``) gather.

    Returns ``(launches, out_key, out_value)``; the outputs are allocated here when
    not given. Without given outputs the total token count is ``seq_lens.sum()``,
    which syncs when ``seq_lens`` is on a GPU; pass ``out_key``/``out_value`` to
    avoid that. ``key_scale``/``key_zero`` (int4 block keys) are passed to the
    dequantizing kernels as two more pointers; null pointers mean no block keys.
    """
    geo, out_dtype = checks.check_gather(kv_layer, layout, out_dtype, kv_scale, kv_zero, layer_format)
    explicit = layer_format is not None
    signs = _check_signs(rotation_signs, geo, kv_layer.device, explicit=explicit)
    if checks.check_key_channels(key_scale, key_zero, geo, kv_layer.device, explicit):  # int4 block keys
        _check_aligned("key_scale", key_scale)
        _check_aligned("key_zero", key_zero)
    _check_kernel_dtype(geo)
    device = kv_layer.device
    if block_table is None:
        batch = checks.check_csr(indptr, indices, seq_lens, device)
        table, kind, width, entries = indices, "csr", 0, indices.shape[0]
    else:
        batch = checks.check_padded(block_table, seq_lens, device)
        table, kind, width = block_table, "pad", block_table.shape[1]
        entries = batch * width
    _check_contiguous("kv_layer", kv_layer)
    if geo.quantized:
        _check_contiguous("kv_scale", kv_scale)
        if kv_zero is not None:
            _check_contiguous("kv_zero", kv_zero)
    if out_key is None and out_value is None:
        total = int(seq_lens.sum())
    else:
        given = out_key if isinstance(out_key, torch.Tensor) else out_value
        total = given.shape[0] if isinstance(given, torch.Tensor) and given.dim() >= 1 else 0
    heads, dim = geo.num_heads, geo.head_dim
    if checks.check_out(out_key, out_value, total, geo, out_dtype, device):
        _check_aligned("out_key", out_key)
        _check_aligned("out_value", out_value)
    else:
        out_key = torch.empty((total, heads, dim), dtype=out_dtype, device=device)
        out_value = torch.empty((total, heads, dim), dtype=out_dtype, device=device)
    if total == 0 or entries == 0 or heads * dim == 0:
        return [], out_key, out_value
    table = table.contiguous()
    indptr_c = indptr.contiguous() if indptr is not None else None
    lens = seq_lens.contiguous()
    seq_ends = torch.cumsum(lens, 0, dtype=torch.int64)  # inclusive; starts = ends - lens
    table_args = [_ptr(table), _ptr(indptr_c), _ptr(lens), _ptr(seq_ends), _i64(batch), _i64(entries)]
    table_args += [_i64(width), _i64(total), _i64(geo.num_blocks), _i64(geo.block_size), _i64(heads)]
    keep = (table, indptr_c, lens, seq_ends)
    lo = layout.lower()
    if geo.quantized:
        name = sources.gather_name(kind, lo, quant=_QUANT_NAMES[geo.kv_dtype], out_type=_MODEL_NAMES[out_dtype],  # type: ignore[index]
                                   rotated=signs is not None)
        args = [_ptr(kv_layer), _ptr(kv_scale), _ptr(kv_zero), _ptr(out_key), _ptr(out_value)]
        args += table_args + [_i64(dim), _i64(geo.groups)]
        block_keys = [_ptr(key_scale), _ptr(key_zero)]  # null: no block keys
        if signs is not None:
            grid, block = _rot_dims(total * 2 * heads, max(1, dim // 2), dim)
            return [Launch("gather_kv.cu", name, grid, block, tuple(args + [_ptr(signs)] + block_keys),
                           keep + (signs,))], out_key, out_value
        args += block_keys
        per = 16 // out_key.element_size()  # one thread per 16 output bytes where they line up
        if dim % per == 0 and _vector_ok([16], [out_key, out_value]):
            name = sources.gather_name(kind, lo, quant=_QUANT_NAMES[geo.kv_dtype], out_type=_MODEL_NAMES[out_dtype],  # type: ignore[index]
                                       vec=True)
            return [_launch("gather_kv.cu", name, entries, geo.block_size * heads * dim // per, args, keep)], \
                out_key, out_value
        return [_launch("gather_kv.cu", name, entries, geo.block_size * heads * dim, args, keep)], out_key, out_value
    elt = kv_layer.element_size()
    unit = 16 if _vector_ok([dim * elt], [kv_layer, out_key, out_value]) else elt
    head_chunks = dim * elt // unit
    name = sources.gather_name(kind, lo, chunk=_CHUNK_NAMES[unit])
    args = [_ptr(kv_layer), _ptr(out_key), _ptr(out_value)] + table_args + [_i64(head_chunks)]
    cols = geo.block_size * heads * head_chunks
    return [_launch("gather_kv.cu", name, entries, cols, args, keep)], out_key, out_value


# ----------------------------------------------------------------------------------
# copy_blocks / swap_blocks


def _block_copy(src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor) -> Launch | None:
    layers, src_blocks = src.shape[0], src.shape[1]
    block_bytes = math.prod(src.shape[2:]) * src.element_size()
    num_pairs = pairs.shape[0]
    if layers == 0 or block_bytes == 0 or num_pairs == 0:
        return None
    unit = _chunk_for(block_bytes, src.data_ptr(), dst.data_ptr())
    index = "i64" if pairs.dtype == torch.int64 else "i32"
    name = sources.copy_blocks_name(_CHUNK_NAMES[unit], index)
    args = [_ptr(src), _ptr(dst), _ptr(pairs), _i64(num_pairs), _i64(layers)]
    args += [_i64(block_bytes // unit), _i64(src_blocks), _i64(dst.shape[1])]
    return _launch("copy_blocks.cu", name, num_pairs * layers, block_bytes // unit, args, (pairs,))


def _host_pairs(pairs: object) -> bool:
    return isinstance(pairs, torch.Tensor) and pairs.device.type == "cpu"


def _no_pairs(pairs: object) -> torch.Tensor:
    """An empty stand-in for device pairs, so the reference validators run their
    structural checks without reading (syncing on) the real ones."""
    dtype = pairs.dtype if isinstance(pairs, torch.Tensor) else torch.int64
    return torch.empty((0, 2), dtype=dtype)


def plan_copy_blocks(arenas, pairs) -> list[Launch]:
    """Plan :func:`pagedkv.ops.reference.copy_blocks`: one launch per arena."""
    if _host_pairs(pairs):
        arenas, _, _ = checks.validate_copy_blocks(arenas, pairs)  # every check, same messages
    else:
        arenas, _, _ = checks.validate_copy_blocks(arenas, _no_pairs(pairs))
        pairs = checks.check_pairs(pairs, arenas[0].device)
    for i, a in enumerate(arenas):
        _check_contiguous(f"arenas[{i}]", a)
    pairs = pairs.to(arenas[0].device).contiguous()
    launches = [_block_copy(a, a, pairs) for a in arenas]
    return [x for x in launches if x is not None]


def plan_swap_blocks(src_arenas, dst_arenas, pairs, *, launch_device: torch.device | None = None) -> list[Launch]:
    """Plan :func:`pagedkv.ops.reference.swap_blocks`: one launch per arena pair.

    With ``launch_device`` (the CUDA path) every arena must live on that device or
    in pinned host memory, which the kernel reads or writes in place.
    """
    if _host_pairs(pairs):
        srcs, dsts, _, _ = checks.validate_swap_blocks(src_arenas, dst_arenas, pairs)
    else:
        srcs, dsts, _, _ = checks.validate_swap_blocks(src_arenas, dst_arenas, _no_pairs(pairs))
        pairs = checks.check_pairs(pairs, srcs[0].device, dsts[0].device)
    for name, group in (("src_arenas", srcs), ("dst_arenas", dsts)):
        for i, a in enumerate(group):
            if launch_device is not None and a.device != launch_device:
                if a.device.type != "cpu":
                    raise DeviceError(expected(f"{name}[{i}]", f"device {launch_device} or pinned host memory", a.device))
                if not a.is_pinned():
                    raise DeviceError(
                        expected(f"{name}[{i}]", "pinned host memory (tensor.pin_memory())", "pageable host memory")
                    )
            _check_contiguous(f"{name}[{i}]", a)
    pairs = pairs.to(launch_device if launch_device is not None else srcs[0].device).contiguous()
    launches = [_block_copy(s, d, pairs) for s, d in zip(srcs, dsts)]
    return [x for x in launches if x is not None]


# ----------------------------------------------------------------------------------
# convert_layout


def plan_convert_layout(arena, src_layout, dst_layout, *, scale=False):
    """Plan :func:`pagedkv.ops.reference.convert_layout`; returns ``(launches, out)``."""
    checks.check_layout(src_layout, "src_layout")
    checks.check_layout(dst_layout, "dst_layout")
    if not isinstance(arena, torch.Tensor):
        raise DTypeError(expected("arena", "a torch.Tensor", type(arena).__name__))
    ndims = (4, 5) if scale else (5, 6)
    kv_dim = arena.dim() - (3 if scale else 4)
    if arena.dim() not in ndims or arena.shape[kv_dim] != 2:
        what = "scale arena [L, NB, 2, a, b] or layer [NB, 2, a, b]" if scale else (
            "arena [L, NB, 2, a, b, D] or layer [NB, 2, a, b, D]"
        )
        raise ShapeError(expected("arena", what, tuple(arena.shape)))
    _check_contiguous("arena", arena)
    shape = list(arena.shape)
    row = 1 if scale else shape[-1]
    a_len, b_len = (shape[-2], shape[-1]) if scale else (shape[-3], shape[-2])
    planes = math.prod(shape[: kv_dim + 1])
    if src_layout == dst_layout:  # a copy: the same walk with one-long middle dims
        planes, a_len, b_len = planes * a_len * b_len, 1, 1
    else:
        i = len(shape) - (2 if scale else 3)
        shape[i], shape[i + 1] = shape[i + 1], shape[i]
    out = torch.empty(shape, dtype=arena.dtype, device=arena.device)
    row_bytes = row * arena.element_size()
    if out.numel() == 0:
        return [], out
    unit = _chunk_for(row_bytes, arena.data_ptr(), out.data_ptr())
    row_chunks = row_bytes // unit
    args = [_ptr(arena), _ptr(out), _i64(planes), _i64(a_len), _i64(b_len), _i64(row_chunks)]
    name = sources.transpose_name(_CHUNK_NAMES[unit])
    return [_launch("convert_layout.cu", name, planes * b_len, a_len * row_chunks, args)], out
