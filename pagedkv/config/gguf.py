"""The model shape from a GGUF file's metadata, without the ``gguf`` package.

``CacheConfig.from_hf_config`` accepts a path to a ``.gguf`` (llama.cpp's format, as
the test model ships). Only the key/value header is read, never the tensors, and every
length in it is checked against the file before use, so a truncated or hostile file
gives an :class:`~pagedkv.errors.InvalidArgumentError`, not a crash or a huge
allocation.

Layout (GGUF v2 and v3): ``b"GGUF"``, ``uint32`` version, ``uint64`` tensor count,
``uint64`` key/value count, then each pair as a string key, a ``uint32`` value type and
the value. Strings are a ``uint64`` length and UTF-8 bytes; arrays are a ``uint32``
element type, a ``uint64`` count and the elements. Little-endian, or big-endian for
files written on big-endian machines (told apart by the version field).
"""
from __future__ import annotations

import io
import mmap
import os
import stat
import struct
from typing import Any

from pagedkv.errors import ArgumentTypeError, InvalidArgumentError, expected

__all__ = ["GGUF_MAGIC", "read_gguf_metadata", "hf_fields_from_gguf", "open_regular"]

GGUF_MAGIC = b"GGUF"

# value type -> struct code of a scalar (8 = string, 9 = array are handled apart)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_MAX_DEPTH = 4   # arrays of arrays: bounded, so a hostile file cannot recurse without end


class _Reader:
    def __init__(self, buf, path: str):
        self.buf, self.pos, self.path, self.end = buf, 0, path, len(buf)
        self.order = "<"

    def fail(self, what: str) -> InvalidArgumentError:
        return InvalidArgumentError(expected("config", "a GGUF file with a readable metadata header",
                                             f"{self.path!r} ({what} at byte {self.pos})"))

    def take(self, code: str) -> Any:
        size = struct.calcsize(code)
        if self.pos + size > self.end:
            raise self.fail("truncated")
        (value,) = struct.unpack_from(self.order + code, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.take("Q")
        if n > self.end - self.pos:
            raise self.fail(f"a string of {n} bytes past the end of the file")
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail("a string that is not UTF-8") from None

    def value(self, vtype: int, depth: int = 0) -> Any:
        code = _SCALARS.get(vtype)
        if code is not None:
            return self.take(code)
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY and depth < _MAX_DEPTH:
            etype, count = self.take("I"), self.take("Q")
            code = _SCALARS.get(etype)
            if code is not None:
                size = struct.calcsize(code)
                if count > (self.end - self.pos) // size:
                    raise self.fail(f"an array of {count} elements past the end of the file")
                if count > 64:              # long arrays (vocabularies) are skipped, not decoded
                    self.pos += count * size
                    return None
                return [self.take(code) for _ in range(count)]
            if count > self.end - self.pos:  # every element takes at least one byte
                raise self.fail(f"an array of {count} elements past the end of the file")
            items = [self.value(etype, depth + 1) for _ in range(count)]
            return items if count <= 64 else None
        raise self.fail(f"unknown value type {vtype}")


def open_regular(path: str, argument: str = "config", what: str = "a readable GGUF file") -> io.BufferedReader:
    """Open ``path`` for reading if it is a regular file. It is opened non-blocking and
    checked on the descriptor (no window between the check and the open), so a FIFO,
    socket or device named as a model file is refused instead of blocking or streaming."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise InvalidArgumentError(expected(argument, what, f"{path!r} ({e.strerror})")) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
                    else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")
            raise InvalidArgumentError(expected(argument, "a regular file (config.json or GGUF)",
                                                f"{path!r} ({kind})"))
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_gguf_metadata(path: str) -> dict[str, Any]:
    """The key/value metadata of a GGUF file (arrays longer than 64 elements: None)."""
    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                raise InvalidArgumentError(expected("config", "a GGUF file with a readable metadata header",
                                                    f"{path!r} ({size} bytes)"))
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _parse(buf, path)
    except OSError as e:
        raise InvalidArgumentError(expected("config", "a readable GGUF file", f"{path!r} ({e.strerror})")) from None


def _parse(buf, path: str) -> dict[str, Any]:
    r = _Reader(buf, path)
    if bytes(buf[:4]) != GGUF_MAGIC:
        raise r.fail("no GGUF magic")
    r.pos = 4
    version = r.take("I")
    if version > 0xFFFF:           # written big-endian: the version reads byte-swapped
        r.order, r.pos = ">", 4
        version = r.take("I")
    if version not in (2, 3):
        raise r.fail(f"GGUF version {version} (2 and 3 are read)")
    r.take("Q")                    # tensor count: the tensors are not read
    count = r.take("Q")
    if count > (r.end - r.pos) // 13:   # a pair takes at least 8 + 1 + 4 bytes
        raise r.fail(f"{count} metadata pairs past the end of the file")
    out: dict[str, Any] = {}
    for _ in range(count):
        key = r.string()
        out[key] = r.value(r.take("I"))
    return out


def hf_fields_from_gguf(meta: dict[str, Any], path: str) -> dict[str, Any]:
    """The Hugging Face config fields ``from_hf_config`` reads, from GGUF metadata."""
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise InvalidArgumentError(expected("config", "a GGUF file naming general.architecture", repr(path)))

    def get(name: str) -> Any:
        value = meta.get(f"{arch}.{name}")
        if isinstance(value, list):   # per-layer values: one shape for the cache needs them equal
            if not value or any(v != value[0] for v in value):
                raise InvalidArgumentError(expected("config", f"one value of {arch}.{name} for every layer",
                                                    f"{_short(value)} in {path!r}"))
            value = value[0]
        # sizes are integer types in GGUF: a float (NaN, inf), bool, string or nested array
        # in their place is refused here, by its GGUF key
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ArgumentTypeError(expected(f"{arch}.{name}", "an integer", f"{_short(value)} in {path!r}"))
        return value

    fields: tuple[tuple[str, str], ...] = (
        ("num_hidden_layers", "block_count"),
        ("num_attention_heads", "attention.head_count"),
        ("num_key_value_heads", "attention.head_count_kv"),
        ("hidden_size", "embedding_length"),
        ("head_dim", "attention.key_length"),
        ("max_position_embeddings", "context_length"),
    )
    return {hf: get(name) for hf, name in fields if get(name) is not None}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:80] + "..."
