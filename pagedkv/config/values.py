"""Reading option values: byte counts (``"4GiB"``) and bounded reprs for messages.

Below :mod:`pagedkv.config.options` and the modules it calls (the state options parse
their budget here too), so none of them imports the config class back.
"""
from __future__ import annotations

import numbers
import re
from typing import Any

from pagedkv.errors import ArgumentTypeError, InvalidArgumentError, expected

__all__ = ["INT64_MAX", "parse_bytes", "show"]

_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "kib": 1024, "kb": 1000,
    "m": 1024**2, "mib": 1024**2, "mb": 1000**2,
    "g": 1024**3, "gib": 1024**3, "gb": 1000**3,
    "t": 1024**4, "tib": 1024**4, "tb": 1000**4,
}
_BYTES_RE = re.compile(r"^\s*([0-9]*)(?:\.([0-9]*))?\s*([a-zA-Z]*)\s*$")
INT64_MAX = 2**63 - 1
#: digits of a byte count's integer part read at most (2**63 has 19): longer is refused
#: before conversion, so a 5,000-digit string costs nothing
_MAX_DIGITS = 24


def parse_bytes(value: int | str, name: str = "memory_budget") -> int:
    """Parse a byte count: an int, or a string like ``"4GiB"``, ``"512MB"``, ``"1.5 G"``.

    ``KiB/MiB/GiB/TiB`` and the bare ``K/M/G/T`` are powers of 1024; ``KB/MB/GB/TB``
    are powers of 1000. Fractions round down to whole bytes (exactly: no float). A
    count must be in ``[1, 2**63)``. A float or bool is an ArgumentTypeError.
    """
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, str)):
        raise ArgumentTypeError(expected(name, "a byte count (int or a string like '4GiB')", show(value)))
    if isinstance(value, numbers.Integral):
        n = int(value)
    else:
        m = _BYTES_RE.match(value)
        whole, frac, unit = (m.group(1), m.group(2) or "", m.group(3).lower()) if m else ("", "", "")
        if m is None or unit not in _UNITS or not (whole or frac):
            raise InvalidArgumentError(
                expected(name, "a byte count like '4GiB', '512MB' or '1073741824'", show(value))
            )
        if len(whole.lstrip("0")) > _MAX_DIGITS:
            raise InvalidArgumentError(expected(name, "a byte count below 2**63", show(value)))
        frac = frac[:_MAX_DIGITS]
        n = (int(whole or "0") * 10**len(frac) + int(frac or "0")) * _UNITS[unit] // 10**len(frac)
    if n <= 0:
        raise InvalidArgumentError(expected(name, "a positive byte count", show(value)))
    if n > INT64_MAX:
        raise InvalidArgumentError(expected(name, "a byte count below 2**63", show(value)))
    return n


def show(value: Any) -> str:
    """``repr`` for messages, bounded: huge ints (whose repr may even fail) and long
    strings are summarised, never printed whole."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and abs(int(value)).bit_length() > 64:
        return f"an int of {abs(int(value)).bit_length()} bits"
    if isinstance(value, (str, bytes)) and len(value) > 64:
        return f"{value[:32]!r}... ({len(value)} characters)"
    try:
        text = repr(value)
    except Exception:  # a hostile __repr__ must not replace the error being reported
        text = f"a {type(value).__name__}"
    return text if len(text) <= 200 else text[:200] + "..."
