"""SharedArena: the host tier's block bytes in a shared-memory file both connector sides map.

vLLM runs the connector's scheduler side (decides) and worker side (copies) as two
instances, in two processes by default. The scheduler side creates the arena; the
worker side opens it by the name that every step's metadata carries, so only slot
numbers and vLLM block ids cross the process boundary.

A file ``pagedkv-vllm-<pid>-<nonce>`` in ``/dev/shm``: a 4 KiB header (magic, then the
JSON layout: arenas, capacity, KV shape, storage format), then one region per arena,
``[num_layers, capacity, *block_shape]``. The nonce is fresh per arena, so a worker
never maps another engine's (or a crashed engine's) segment; the scheduler unlinks the
name as soon as the worker reports it mapped (the mappings outlive the name), and
sweeps names whose creating process is gone, so a crash leaves nothing for long.
"""
from __future__ import annotations

import atexit
import json
import mmap
import os
import re
import secrets
import tempfile
import weakref
from pathlib import Path

import torch

from pagedkv.errors import InvalidArgumentError, OutOfMemoryError, TierFileError, expected

__all__ = ["SharedArena", "shm_dir"]

MAGIC = b"PAGEDKV-VLLM-ARENA-1\x00"
HEADER = 4096
ALIGN = 4096
PREFIX = "pagedkv-vllm-"
_NAME = re.compile(r"^pagedkv-vllm-(\d+)-[0-9a-f]{16}$")
_DTYPES = {str(d).replace("torch.", ""): d for d in (torch.bfloat16, torch.float16, torch.float32, torch.int8,
                                                      torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2)}


_owned: weakref.WeakSet = weakref.WeakSet()      # arenas this process created, still named


@atexit.register
def _unlink_owned() -> None:
    for a in list(_owned):
        a.unlink()


def shm_dir() -> Path:
    d = Path("/dev/shm")
    return d if d.is_dir() and os.access(d, os.W_OK) else Path(tempfile.gettempdir())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale(directory: Path | None = None) -> list[str]:
    """Unlink arenas whose creating process is gone (a crashed engine); returns their names."""
    directory = directory or shm_dir()
    gone = []
    for p in directory.glob(PREFIX + "*"):
        m = _NAME.match(p.name)
        if m and not _alive(int(m.group(1))):
            try:
                p.unlink()
                gone.append(p.name)
            except OSError:
                pass
    for p in directory.glob(PREFIX + "worker-*.json"):    # a worker's verdict no scheduler read (a crash)
        try:
            if not _alive(int(json.loads(p.read_text()).get("pid", 0))):
                p.unlink()
                gone.append(p.name)
        except (OSError, ValueError, TypeError, AttributeError):
            pass
    return gone


def _layout(arenas: list[tuple[tuple, torch.dtype]], num_layers: int, capacity: int) -> list[int]:
    offsets, off = [], HEADER
    for shape, dt in arenas:
        offsets.append(off)
        n = num_layers * capacity * torch.Size(shape).numel() * torch.empty(0, dtype=dt).element_size()
        off += (n + ALIGN - 1) // ALIGN * ALIGN
    offsets.append(off)
    return offsets


class SharedArena:
    """Attributes: ``name`` (what the metadata carries), ``layout`` (the header's JSON),
    ``tensors`` (one ``[num_layers, capacity, *shape]`` view per arena)."""

    def __init__(self, name: str, path: Path, mm: mmap.mmap, layout: dict, owner: bool):
        self.name, self.path, self.layout, self.owner = name, path, layout, owner
        self._mm = mm
        buf = torch.frombuffer(mm, dtype=torch.uint8)
        self.tensors = []
        offs = layout["offsets"]
        for i, (dt, shape) in enumerate(layout["arenas"]):
            dtype = _DTYPES[dt]
            full = (layout["num_layers"], layout["capacity"], *shape)
            n = torch.Size(full).numel() * torch.empty(0, dtype=dtype).element_size()
            self.tensors.append(buf[offs[i]:offs[i] + n].view(dtype).view(full))

    @classmethod
    def create(cls, arenas: list[tuple[tuple, torch.dtype]], num_layers: int, capacity: int,
               fmt: dict) -> SharedArena:
        """A new zeroed arena (pages are allocated on first touch)."""
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise InvalidArgumentError(expected("capacity", "an int >= 1", repr(capacity)))
        directory = shm_dir()
        sweep_stale(directory)
        offsets = _layout(arenas, num_layers, capacity)
        layout = dict(fmt, num_layers=num_layers, capacity=capacity, offsets=offsets,
                      arenas=[[str(dt).replace("torch.", ""), list(shape)] for shape, dt in arenas])
        blob = json.dumps(layout).encode()
        if len(MAGIC) + 8 + len(blob) > HEADER:
            raise InvalidArgumentError(expected("arena layout", f"a header under {HEADER} bytes",
                                                f"{len(blob)} bytes of JSON"))
        st = os.statvfs(directory)
        if offsets[-1] > st.f_bavail * st.f_frsize:     # tmpfs would SIGBUS on the first touch past it
            raise OutOfMemoryError("host_blocks", capacity, offsets[-1], st.f_bavail * st.f_frsize, str(directory))
        name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        path = directory / name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, offsets[-1])
            mm = mmap.mmap(fd, offsets[-1])
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        os.close(fd)
        mm[:len(MAGIC)] = MAGIC
        mm[len(MAGIC):len(MAGIC) + 8] = len(blob).to_bytes(8, "little")
        mm[len(MAGIC) + 8:len(MAGIC) + 8 + len(blob)] = blob
        arena = cls(name, path, mm, layout, owner=True)
        _owned.add(arena)
        return arena

    @classmethod
    def open(cls, name: str) -> SharedArena:
        """Map an arena another instance created; a bad name or header is a TierFileError."""
        if not isinstance(name, str) or not _NAME.match(name):
            raise TierFileError(expected("arena name", f"{PREFIX}<pid>-<16 hex>", repr(name)))
        path = shm_dir() / name
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as e:
            raise TierFileError(expected("shared arena", f"{path} readable (same host and /dev/shm)",
                                         f"{type(e).__name__}: {e}")) from None
        try:
            size = os.fstat(fd).st_size
            if size < HEADER:
                raise TierFileError(expected("shared arena", f"at least {HEADER} bytes", f"{size}"))
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        if mm[:len(MAGIC)] != MAGIC:
            raise TierFileError(expected("shared arena header", repr(MAGIC), repr(mm[:len(MAGIC)])))
        n = int.from_bytes(mm[len(MAGIC):len(MAGIC) + 8], "little")
        try:
            layout = json.loads(mm[len(MAGIC) + 8:len(MAGIC) + 8 + n].decode())
        except (ValueError, UnicodeDecodeError) as e:
            raise TierFileError(expected("shared arena header", "JSON", f"{type(e).__name__}")) from None
        if layout.get("offsets", [0])[-1] != size:
            raise TierFileError(expected("shared arena size", str(layout.get("offsets", [0])[-1]), str(size)))
        return cls(name, path, mm, layout, owner=False)

    def unlink(self) -> None:
        """Drop the name (mappings stay valid); idempotent."""
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass

    def close(self) -> None:
        if self.owner:
            self.unlink()
        self.tensors = []

    def __del__(self):
        if getattr(self, "owner", False):
            self.unlink()
