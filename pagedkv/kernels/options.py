"""Typed NVRTC compile options with one translator into NVRTC flags.

Every knob that changes the compiled code is a field here, and
:meth:`CompileOptions.nvrtc_flags` is the only place that spells NVRTC flags, so the
disk-cache key (which hashes those flags) cannot miss an option.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from pagedkv.errors import InvalidArgumentError, expected

__all__ = ["CompileOptions", "TARGETS"]

TARGETS = ("ptx", "cubin")
_ARCH = re.compile(r"^sm_(\d{2,3})([af]?)$")
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_STDS = ("c++17", "c++20")

Defines = Mapping[str, str | None] | tuple[tuple[str, str | None], ...]


@dataclass(frozen=True)
class CompileOptions:
    """How to compile one kernel source.

    Attributes:
        arch: the real architecture, ``"sm_80"``, ``"sm_89"``, ``"sm_90"`` (``"sm_90a"``
            for arch-specific features).
        target: ``"ptx"`` (portable; ``--gpu-architecture=compute_XY``) or ``"cubin"``
            (machine code for exactly ``arch``; what a launch loads, as no driver JIT
            is then needed).
        std: C++ dialect, ``"c++17"`` or ``"c++20"``.
        defines: preprocessor macros, ``{name: value or None}``; stored sorted.
        fmad: allow contracting a*b+c into an FMA. Off by default: the quantization
            arithmetic must round once per operation to match the torch reference.
        line_info: emit line tables (for profilers).
        device_debug: ``-G`` device debug info (slow code).
        include_dirs: extra ``-I`` directories (the kernels need none: their headers
            travel in memory with the source).
        max_registers: ``--maxrregcount``, or ``None`` for the compiler's choice.
    """

    arch: str = "sm_80"
    target: str = "ptx"
    std: str = "c++17"
    defines: Defines = field(default=())
    fmad: bool = False
    line_info: bool = False
    device_debug: bool = False
    include_dirs: tuple[str, ...] = ()
    max_registers: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.arch, str) or not _ARCH.match(self.arch):
            raise InvalidArgumentError(expected("arch", "'sm_XY' such as 'sm_80' or 'sm_90a'", repr(self.arch)))
        if self.target not in TARGETS:
            raise InvalidArgumentError(expected("target", "'ptx' or 'cubin'", repr(self.target)))
        if self.std not in _STDS:
            raise InvalidArgumentError(expected("std", "'c++17' or 'c++20'", repr(self.std)))
        items = self.defines.items() if isinstance(self.defines, Mapping) else self.defines
        defines = []
        for item in items:
            name, value = item
            if not isinstance(name, str) or not _IDENT.match(name):
                raise InvalidArgumentError(expected("defines", "C identifiers as names", repr(name)))
            if value is not None and not isinstance(value, str):
                raise InvalidArgumentError(expected(f"defines[{name!r}]", "a str or None", type(value).__name__))
            defines.append((name, value))
        object.__setattr__(self, "defines", tuple(sorted(defines)))
        object.__setattr__(self, "include_dirs", tuple(str(d) for d in self.include_dirs))
        if self.max_registers is not None and (
            isinstance(self.max_registers, bool) or not isinstance(self.max_registers, int) or self.max_registers <= 0
        ):
            raise InvalidArgumentError(expected("max_registers", "a positive int or None", repr(self.max_registers)))

    @property
    def compute_capability(self) -> tuple[int, int]:
        digits = _ARCH.match(self.arch).group(1)  # type: ignore[union-attr]
        return int(digits[:-1]), int(digits[-1])

    def nvrtc_flags(self) -> tuple[str, ...]:
        """The NVRTC command line these options mean (the one translator)."""
        m = _ARCH.match(self.arch)  # always matches: __post_init__ checked it
        virtual = "compute_" + m.group(1) + m.group(2)  # type: ignore[union-attr]
        flags = [
            f"--gpu-architecture={virtual if self.target == 'ptx' else self.arch}",
            f"--std={self.std}",
            f"--fmad={'true' if self.fmad else 'false'}",
        ]
        if self.line_info:
            flags.append("--generate-line-info")
        if self.device_debug:
            flags.append("--device-debug")
        if self.max_registers is not None:
            flags.append(f"--maxrregcount={self.max_registers}")
        flags += [f"-D{n}" if v is None else f"-D{n}={v}" for n, v in self.defines]  # type: ignore[str-unpack]  # pairs, once made
        flags += [f"--include-path={d}" for d in self.include_dirs]
        return tuple(flags)
