"""The pagedkv error taxonomy.

Messages are API: an invalid-argument message always reads
``"<argument>: expected <what was expected>, got <what was got>"`` so that callers
and tests can match on it. Every error raised by pagedkv derives from
:class:`PagedKVError`, and each also derives from the builtin a caller would expect
(``MemoryError``, ``KeyError``, ``ValueError``, ``TypeError``, ``RuntimeError``).
"""
from __future__ import annotations

from typing import Any

__all__ = [
    "PagedKVError",
    "OutOfBlocksError",
    "HostMemoryError",
    "OutOfMemoryError",
    "SequenceNotFoundError",
    "SequenceExistsError",
    "InvalidArgumentError",
    "ArgumentTypeError",
    "InvalidBlockError",
    "ShapeError",
    "DTypeError",
    "DeviceError",
    "CacheBusyError",
    "KernelCompileError",
    "KernelUnavailableError",
    "PrefillCancelledError",
    "PrefillMemoryError",
    "ModelUnavailableError",
    "InternalError",
    "TierFileError",
    "TierStorageError",
    "TransferError",
    "expected",
]


def expected(argument: str, what: str, got: object) -> str:
    """Format the standard invalid-argument message."""
    return f"{argument}: expected {what}, got {got}"


class PagedKVError(Exception):
    """Base class of every error pagedkv raises."""


class OutOfBlocksError(PagedKVError, MemoryError):
    """Capacity ran out. Carries the blocks needed and the blocks free."""

    def __init__(self, needed: int, free: int, what: str = "allocation"):
        self.needed = int(needed)
        self.free = int(free)
        super().__init__(
            f"out of KV blocks: {what} needs {self.needed} block(s), "
            f"{self.free} free"
        )


class HostMemoryError(PagedKVError, MemoryError):
    """Host memory for pagedkv's own bookkeeping (tables, indexes, buffers) ran out."""


class OutOfMemoryError(PagedKVError, MemoryError):
    """An arena (device KV, window, host or prefix tier, pool bookkeeping) would not fit
    the memory its device has free, or its size overflows 64 bits. Raised by the size
    check before anything is allocated. Carries the option to blame, the bytes needed
    and the bytes available (None when the size overflows before any device is asked)."""

    def __init__(self, option: str, value: object, needed_bytes: int, available_bytes, device: str,
                 what: str = "arenas that fit"):
        self.option = option
        self.needed_bytes = int(needed_bytes)
        self.available_bytes = None if available_bytes is None else int(available_bytes)
        self.device = device
        room = (f"the {self.available_bytes} bytes available on {device}" if self.available_bytes is not None
                else "fewer than 2**63 bytes")
        super().__init__(expected(option, f"{what} {room}", f"{value!r} ({self.needed_bytes} bytes needed)"))


class SequenceNotFoundError(PagedKVError, KeyError):
    """An operation named a sequence the cache does not hold."""

    def __init__(self, seq_id: object, argument: str = "seq_id"):
        self.seq_id = seq_id
        super().__init__(f"{argument}: expected a live sequence id, got {seq_id!r} (unknown)")

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class SequenceExistsError(PagedKVError, ValueError):
    """add/fork named a sequence id that is already live."""

    def __init__(self, seq_id: object, argument: str = "seq_id"):
        self.seq_id = seq_id
        super().__init__(f"{argument}: expected a new sequence id, got {seq_id!r} (already live)")


class InvalidArgumentError(PagedKVError, ValueError):
    """A value is out of range or inconsistent with the cache's state."""


class ArgumentTypeError(PagedKVError, TypeError):
    """An argument has the wrong Python type (a str, float or None where an int is
    expected, a scalar where a sequence is expected); nothing is converted silently."""


class InvalidBlockError(InvalidArgumentError):
    """A block id is out of range, or its state forbids the operation (double free)."""


class ShapeError(InvalidArgumentError):
    """A tensor or array has the wrong shape."""


class DTypeError(PagedKVError, TypeError):
    """A tensor or array has the wrong dtype (pagedkv never casts silently)."""


class DeviceError(PagedKVError, ValueError):
    """A tensor lives on the wrong device."""


class CacheBusyError(PagedKVError, RuntimeError):
    """The operation needs an idle cache (no sequence holds blocks)."""


class KernelCompileError(PagedKVError, RuntimeError):
    """NVRTC rejected a kernel. Carries the compile log and the kernel file name."""

    def __init__(self, filename: str, log: str, options: object = None):
        self.filename = filename
        self.log = log
        self.options = options
        super().__init__(f"NVRTC failed to compile {filename}:\n{log}")


class KernelUnavailableError(PagedKVError, RuntimeError):
    """The CUDA path was requested but cannot run here (no GPU, no cuda-python)."""


class PrefillCancelledError(PagedKVError):
    """A chunked prefill was cancelled; its committed chunks stay cached."""

    progress: Any   # the prefill's PrefillProgress when it stopped (set by the prefill)
    seq_id: Any


class PrefillMemoryError(PagedKVError, MemoryError):
    """Even the smallest allowed chunk's activations exceed the memory headroom.

    Carries ``needed_bytes`` (estimate for ``chunk_tokens`` tokens at ``context``),
    ``available_bytes`` (the headroom) and ``chunk_tokens``.
    """

    def __init__(self, needed_bytes: int, available_bytes: int, chunk_tokens: int, context: int):
        self.needed_bytes = int(needed_bytes)
        self.available_bytes = int(available_bytes)
        self.chunk_tokens = int(chunk_tokens)
        self.context = int(context)
        super().__init__(expected(
            "memory headroom", f"room for a prefill chunk of {chunk_tokens} token(s) at context {context} "
            f"({needed_bytes} bytes of activations)", f"{available_bytes} bytes"))


class ModelUnavailableError(PagedKVError, RuntimeError):
    """The test model could not be found or fetched; the message says how to get it."""


class InternalError(PagedKVError, RuntimeError):
    """An internal invariant broke. This is a bug in pagedkv: please report it."""

    def __init__(self, what: str):
        super().__init__(f"internal invariant broken (this is a bug in pagedkv): {what}")


class TierFileError(PagedKVError, ValueError):
    """A disk prefix tier's files are corrupt, truncated, locked by another process, or
    were written for another model shape or settings. They are refused, never used."""


class TierStorageError(TierFileError, OSError):
    """The disk prefix tier's storage refused an operation: no space (``ENOSPC``), a file
    too large (``EFBIG``), a read-only or unwritable directory (``EROFS``, ``EACCES``,
    ``EPERM``). ``errno`` is set; the directory is left as it was."""


class TransferError(PagedKVError, RuntimeError):
    """A KV transfer between processes failed (the peer refused, died or timed out).

    The receiving cache is left as it was before the call: nothing half-registered,
    no block leaked."""
