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
import stat
import tempfile
import weakref
from pathlib import Path

import torch

from pagedkv.errors import InvalidArgumentError, OutOfMemoryError, TierFileError, expected

__all__ = ["SharedArena", "shm_dir", "read_small_file", "read_status"]

MAGIC = b"PAGEDKV-VLLM-ARENA-1\x00"
HEADER = 4096
ALIGN = 4096
PREFIX = "pagedkv-vllm-"
#: the most bytes a worker status file may hold (it is a few dozen)
STATUS_BYTES = 4096
# A pid of at most 10 digits: a longer run of digits is no pid (and no int() to convert).
_NAME = re.compile(r"^pagedkv-vllm-(\d{1,10})-[0-9a-f]{16}$")
_DTYPES = {str(d).replace("torch.", ""): d for d in (torch.bfloat16, torch.float16, torch.float32, torch.int8,
                                                      torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2)}
_ITEMSIZE = {name: torch.empty(0, dtype=d).element_size() for name, d in _DTYPES.items()}
# Bounds a header is checked against before anything is sized from it.
_MAX_ARENAS, _MAX_DIMS, _MAX_DIM, _MAX_LAYERS, _MAX_CAPACITY = 16, 8, 2**31 - 1, 2**20, 2**40
_MAX_PID = 2**31 - 1


_owned: weakref.WeakSet = weakref.WeakSet()      # arenas this process created, still named


@atexit.register
def _unlink_owned() -> None:
    for a in list(_owned):
        a.unlink()


def shm_dir() -> Path:
    d = Path("/dev/shm")
    return d if d.is_dir() and os.access(d, os.W_OK) else Path(tempfile.gettempdir())


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists; a value that is no pid (bool, <= 0, past 2**31) is
    no live process (``os.kill(0, ...)`` would signal this process group)."""
    if type(pid) is not int or not 0 < pid <= _MAX_PID:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:     # another user's process
        return True
    return True


def read_small_file(path: Path | str, limit: int) -> bytes | None:
    """The bytes of the regular file ``path`` if it holds at most ``limit``; else None.

    Opened without following a symlink and without blocking (a FIFO or a device planted
    under the name is refused at ``fstat``, never read), owned by this user: ``/dev/shm``
    is world-writable, so what another user left there is never read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, ValueError):
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size > limit:
            return None
        data = os.pread(fd, limit + 1, 0)
    except OSError:
        return None
    finally:
        os.close(fd)
    return data if len(data) <= limit else None


def read_status(path: Path | str) -> dict | None:
    """A worker status file (``{"pid": int, "refused": str | None}``), or None when it is
    absent, not a small regular file of this user, or not that JSON."""
    data = read_small_file(path, STATUS_BYTES)
    if data is None:
        return None
    try:
        obj = json.loads(data.decode())
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(obj, dict) or type(obj.get("pid")) is not int:
        return None
    refused = obj.get("refused")
    if refused is not None and not isinstance(refused, str):
        return None
    return obj


def sweep_stale(directory: Path | None = None) -> list[str]:
    """Unlink arenas and worker status files whose creating process is gone (a crashed
    engine); returns their names. Only this user's regular files are considered, and
    none is opened in a way that could block."""
    directory = directory or shm_dir()
    gone = []
    me = os.geteuid()
    for p in directory.glob(PREFIX + "*"):
        m = _NAME.match(p.name)
        if m is None:
            continue
        try:
            st = os.lstat(p)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != me or _alive(int(m.group(1))):
                continue
            p.unlink()
            gone.append(p.name)
        except OSError:
            pass
    for p in directory.glob(PREFIX + "worker-*.json"):    # a worker's verdict no scheduler read (a crash)
        status = read_status(p)
        if status is not None and not _alive(status["pid"]):
            try:
                p.unlink()
                gone.append(p.name)
            except OSError:
                pass
    return gone


def _layout(arenas: list[tuple[tuple, torch.dtype]], num_layers: int, capacity: int) -> list[int]:
    return _offsets([(str(dt).replace("torch.", ""), list(shape)) for shape, dt in arenas], num_layers, capacity)


def _offsets(arenas: list, num_layers: int, capacity: int) -> list[int]:
    """Each arena's byte offset in the file, then the file's size (Python ints: no overflow)."""
    offsets, off = [], HEADER
    for dt, shape in arenas:
        offsets.append(off)
        n = num_layers * capacity * _ITEMSIZE[dt]
        for x in shape:
            n *= x
        off += (n + ALIGN - 1) // ALIGN * ALIGN
    offsets.append(off)
    return offsets


def _bad_header(what: str, got: object) -> TierFileError:
    return TierFileError(expected("shared arena header", what, got))


def _is_int(v: object, lo: int, hi: int) -> bool:
    return type(v) is int and lo <= v <= hi


def check_layout(layout: object, size: int) -> dict:
    """``layout`` (a header's JSON) if it describes a file of ``size`` bytes that the
    tensors can view; else a TierFileError naming the first field that does not."""
    if not isinstance(layout, dict):
        raise _bad_header("a JSON object", type(layout).__name__)
    for key, hi in (("num_layers", _MAX_LAYERS), ("capacity", _MAX_CAPACITY)):
        if not _is_int(layout.get(key), 1, hi):
            raise _bad_header(f"{key}: an int in [1, {hi}]", repr(layout.get(key))[:80])
    arenas = layout.get("arenas")
    if not isinstance(arenas, list) or not 1 <= len(arenas) <= _MAX_ARENAS:
        raise _bad_header(f"arenas: a list of 1 to {_MAX_ARENAS} [dtype, shape] pairs", repr(arenas)[:80])
    for a in arenas:
        ok = (isinstance(a, list) and len(a) == 2 and isinstance(a[0], str) and a[0] in _DTYPES
              and isinstance(a[1], list) and 1 <= len(a[1]) <= _MAX_DIMS and all(_is_int(x, 1, _MAX_DIM) for x in a[1]))
        if not ok:
            raise _bad_header(f"arenas: [dtype among {sorted(_DTYPES)}, shape of 1 to {_MAX_DIMS} ints >= 1]",
                              repr(a)[:80])
    want = _offsets(arenas, layout["num_layers"], layout["capacity"])
    if layout.get("offsets") != want or any(type(x) is not int for x in layout["offsets"]):
        raise _bad_header(f"offsets {want[:4]}... for that layout", repr(layout.get("offsets"))[:80])
    if want[-1] != size:
        raise TierFileError(expected("shared arena size", f"{want[-1]} bytes (its header's layout)", f"{size}"))
    return layout


def _parse_header(head: bytes) -> object:
    """The JSON after the magic and its 8-byte length (not yet checked: see check_layout)."""
    if head[:len(MAGIC)] != MAGIC:
        raise _bad_header(repr(MAGIC), repr(head[:len(MAGIC)]))
    n = int.from_bytes(head[len(MAGIC):len(MAGIC) + 8], "little")
    room = HEADER - len(MAGIC) - 8
    if not 2 <= n <= room:
        raise _bad_header(f"a JSON length in [2, {room}]", n)
    try:
        return json.loads(head[len(MAGIC) + 8:len(MAGIC) + 8 + n].decode())
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise _bad_header("JSON", type(e).__name__) from None


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
        """Map an arena another instance created; a bad name, a file that is not this
        user's regular file (a symlink, a FIFO, a directory), or a header that does not
        describe the file exactly is a TierFileError."""
        if not isinstance(name, str) or not _NAME.match(name):
            raise TierFileError(expected("arena name", f"{PREFIX}<pid>-<16 hex>", repr(name)[:80]))
        path = shm_dir() / name
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            raise TierFileError(expected("shared arena", f"{path}: a regular file, readable (same host and "
                                         "/dev/shm), not a symlink", f"{type(e).__name__}: {e}")) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise TierFileError(expected("shared arena", f"{path} a regular file",
                                             f"file mode {stat.filemode(st.st_mode)}"))
            if st.st_uid != os.geteuid():
                raise TierFileError(expected("shared arena", f"{path} owned by this user (uid {os.geteuid()})",
                                             f"uid {st.st_uid}"))
            size = st.st_size
            if size < HEADER:
                raise TierFileError(expected("shared arena", f"at least {HEADER} bytes", f"{size}"))
            head = os.pread(fd, HEADER, 0)
            layout = check_layout(_parse_header(head), size)
            mm = mmap.mmap(fd, size)
        except OSError as e:
            raise TierFileError(expected("shared arena", f"{path} mapped", f"{type(e).__name__}: {e}")) from None
        finally:
            os.close(fd)
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
