"""The size check every arena passes before it is allocated.

torch and NumPy, asked for more memory than a machine has, fail with their own
``RuntimeError`` or ``MemoryError`` (or, past 2**63 bytes, a ``TypeError``) and name no
option. Each allocation point (the device store, the window arena, the host swap and
prefix tiers, the core pool's bookkeeping) instead states what it needs here first:
its sizes are multiplied out exactly, refused past 2**63 bytes, summed per device and
compared with the memory that device has free, and an
:class:`~pagedkv.errors.OutOfMemoryError` names the option that asks for the most.

Free memory: the host's ``MemAvailable`` (``/proc/meminfo``; ``sysconf`` elsewhere);
a CUDA device's free bytes (``torch.cuda.mem_get_info``).
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

from pagedkv.errors import DeviceError, OutOfMemoryError, expected

__all__ = ["INT64_MAX", "arena_bytes", "available_bytes", "check_device", "check_fits"]

INT64_MAX = 2**63 - 1

#: (option to blame, its value, bytes needed)
Need = tuple[str, Any, int]


def arena_bytes(option: str, value: Any, shape: Iterable[int], itemsize: int) -> int:
    """Bytes of a ``shape`` arena of ``itemsize``-byte elements; OutOfMemoryError (naming
    ``option``) once the product passes 2**63 - 1."""
    n = int(itemsize)
    for d in shape:
        n *= int(d)
        if n > INT64_MAX:
            raise OutOfMemoryError(option, value, n, None, "any device")
    return n


def _host_available() -> int | None:
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return None


def check_device(device: Any) -> int | None:
    """A CUDA ``device`` torch cannot use is a DeviceError (torch itself would fail with
    an AssertionError on a CPU-only build); returns its index, None for the host."""
    text = str(device)
    if text == "cpu":
        return None
    import torch
    dev = torch.device(text)
    if dev.type != "cuda":
        return None
    if not torch.cuda.is_available():
        raise DeviceError(expected("device", "a CUDA device torch can use", f"{text!r} "
                                   "(torch.cuda.is_available() is False: no GPU, or a CPU-only torch)"))
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if index >= count:
        raise DeviceError(expected("device", f"a CUDA device in [0, {count})", repr(text)))
    return index


def available_bytes(device: Any) -> int | None:
    """Free bytes on ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:N"`` or a torch.device),
    None where it cannot be told. A CUDA device torch cannot use is a DeviceError."""
    if str(device) == "cpu":
        return _host_available()
    index = check_device(device)
    if index is None:
        return None
    import torch
    return int(torch.cuda.mem_get_info(index)[0])


def check_fits(device: Any, needs: Sequence[Need], what: str = "arenas that fit") -> None:
    """Refuse, before anything is allocated, arenas on ``device`` whose bytes together
    pass 2**63 - 1 or the memory the device has free; the error names the option whose
    arena is largest."""
    needs = [n for n in needs if n[2]]
    if not needs:
        return
    total = sum(n[2] for n in needs)
    option, value, _ = max(needs, key=lambda n: n[2])
    if total > INT64_MAX:
        raise OutOfMemoryError(option, value, total, None, str(device), what)
    avail = available_bytes(device)
    if avail is not None and total > avail:
        raise OutOfMemoryError(option, value, total, avail, str(device), what)
