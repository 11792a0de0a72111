"""TierDir: the disk prefix tier's directory, and the only way pagedkv opens its files.

The rule (docs/tier-directory.md): pagedkv touches only its own names inside the
directory, and never a file elsewhere. Each file is opened relative to the directory's
descriptor with ``O_NOFOLLOW`` (a symbolic link is refused, never followed) and
``O_NONBLOCK`` (a FIFO cannot hang the open), then checked with ``fstat`` before a byte
is read or written: it must be a regular file owned by this user. Temporaries are
created with ``O_EXCL``; a stale one is removed only when it is such a file. The
directory itself must be owned by this user and not writable by others.

Files are created with their space reserved (``posix_fallocate``): the tier writes
through memory maps, and a write into a hole on a full filesystem would be ``SIGBUS``,
where a reservation fails with ``ENOSPC`` as a typed error. What a failed open created
(files, directories) is removed again, so a refused directory is left as it was.
"""
from __future__ import annotations

import errno
import json
import mmap
import os
import stat
import weakref

from pagedkv.errors import InvalidArgumentError, TierFileError, TierStorageError, expected

__all__ = ["TierDir"]

_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
_MODE = 0o600
_MAX_JSON_BYTES = 64 << 20      # meta.json is small; namespaces.json holds one short key per namespace


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def storage_error(argument: str, what: str, e: OSError) -> TierStorageError:
    code = e.errno if e.errno is None else errno.errorcode.get(e.errno, e.errno)
    err = TierStorageError(expected(argument, what, f"{code} ({e.strerror})"))
    err.errno = e.errno       # (not strerror: OSError would print "[Errno N] ..." instead of the message)
    return err


class TierDir:
    """The tier directory ``path``, created when missing and opened as a descriptor.

    Raises :class:`~pagedkv.errors.InvalidArgumentError` for a path with a NUL byte,
    :class:`~pagedkv.errors.TierStorageError` when the OS refuses (no space, read-only,
    permission, not a directory) and :class:`~pagedkv.errors.TierFileError` for a
    directory or file that breaks the rule above.
    """

    def __init__(self, path):
        path = os.fsdecode(path)
        if "\0" in path:
            raise InvalidArgumentError(expected("prefix_disk_dir", "a directory path without NUL bytes", repr(path)))
        self.path = path
        self.uid = os.geteuid()
        self.fd = -1
        self.created: list[str] = []        # names this open created (removed again on failure)
        self._made: list[str] = []          # directories makedirs created, deepest first
        p = os.path.abspath(path)
        while not os.path.lexists(p) and os.path.dirname(p) != p:
            self._made.append(p)
            p = os.path.dirname(p)
        try:
            os.makedirs(path, exist_ok=True)
            self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
            # a cache dropped without close() still gives the descriptor back when collected
            self._release = weakref.finalize(self, os.close, self.fd)
        except OSError as e:
            self._remove_made()
            raise storage_error("prefix_disk_dir", "a directory pagedkv can create and open", e) from None
        st = os.fstat(self.fd)
        why = None
        if st.st_uid != self.uid:
            why = f"{path!r} owned by uid {st.st_uid}"
        elif st.st_mode & stat.S_IWOTH:
            why = f"{path!r} writable by every user (mode {stat.S_IMODE(st.st_mode):o})"
        if why is not None:
            self.close()
            raise TierFileError(expected("prefix_disk_dir", f"a directory owned by this user (uid {self.uid}) "
                                         "and not writable by others", why))

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    # ---- checks -----------------------------------------------------------------------
    def lstat(self, name: str) -> os.stat_result | None:
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise storage_error(self.file(name), "a file pagedkv can inspect", e) from None

    def _refuse(self, name: str, st: os.stat_result) -> TierFileError | None:
        if not stat.S_ISREG(st.st_mode):
            got = _kind(st.st_mode)
        elif st.st_uid != self.uid:
            got = f"a file owned by uid {st.st_uid}"
        else:
            return None
        return TierFileError(expected(self.file(name), f"a regular file owned by this user (uid {self.uid})", got))

    def check(self, name: str) -> os.stat_result | None:
        """``name``'s status, or None when absent; refuses anything but a regular file of ours."""
        st = self.lstat(name)
        if st is not None:
            bad = self._refuse(name, st)
            if bad is not None:
                raise bad
        return st

    # ---- opening ------------------------------------------------------------------------
    def open(self, name: str, flags: int, *, create: bool = False, exclusive: bool = False) -> int:
        """A descriptor of ``name`` (blocking again), checked to be a regular file of ours."""
        existed = exclusive or self.lstat(name) is not None
        fl = flags | _FLAGS | (os.O_CREAT if create or exclusive else 0) | (os.O_EXCL if exclusive else 0)
        try:
            fd = os.open(name, fl, _MODE, dir_fd=self.fd)
        except OSError as e:
            st = self.lstat(name) if e.errno in (errno.ELOOP, errno.EMLINK, errno.EISDIR, errno.ENXIO) else None
            refused = self._refuse(name, st) if st is not None else None
            if refused is not None:
                raise refused from None
            raise storage_error(self.file(name), "a file pagedkv can open", e) from None
        if not existed or exclusive:
            self.created.append(name)
        bad = self._refuse(name, os.fstat(fd))
        if bad is not None:
            os.close(fd)
            raise bad
        os.set_blocking(fd, True)
        return fd

    def create_file(self, name: str, size: int) -> None:
        """A new file of ``size`` bytes with its space reserved (a stale one of ours is replaced)."""
        if self.check(name) is not None:
            self.unlink(name)
        fd = self.open(name, os.O_RDWR, exclusive=True)
        try:
            self.reserve(fd, name, size)
        finally:
            os.close(fd)

    def reserve(self, fd: int, name: str, size: int) -> None:
        try:
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, size)
            elif os.fstat(fd).st_size < size:     # pragma: no cover - no posix_fallocate (macOS)
                os.ftruncate(fd, size)
        except OSError as e:
            raise storage_error("prefix_disk_blocks", f"room for {size} bytes in {self.file(name)!r}", e) from None

    def map(self, name: str, size: int) -> mmap.mmap:
        """A shared, writable map of ``name``, which must hold exactly ``size`` bytes; its
        space is reserved first (a tier written sparse by an older pagedkv included)."""
        fd = self.open(name, os.O_RDWR)
        try:
            have = os.fstat(fd).st_size
            if have != size:
                raise TierFileError(expected(self.file(name), f"{size} bytes", f"{have} bytes (truncated or foreign)"))
            self.reserve(fd, name, size)
            try:
                return mmap.mmap(fd, size)
            except OSError as e:
                raise storage_error(self.file(name), "a file pagedkv can map", e) from None
        finally:
            os.close(fd)

    # ---- JSON -----------------------------------------------------------------------------
    def read_json(self, name: str):
        fd = self.open(name, os.O_RDONLY)
        try:
            with os.fdopen(fd, "rb", closefd=False) as f:
                data = f.read(_MAX_JSON_BYTES + 1)
        except OSError as e:
            raise storage_error(self.file(name), "a readable pagedkv prefix-tier JSON file", e) from None
        finally:
            os.close(fd)
        if len(data) > _MAX_JSON_BYTES:
            raise TierFileError(expected(self.file(name), "a readable pagedkv prefix-tier JSON file",
                                         f"more than {_MAX_JSON_BYTES} bytes"))
        try:
            return json.loads(data.decode("utf-8"))
        except (ValueError, RecursionError) as e:
            raise TierFileError(expected(self.file(name), "a readable pagedkv prefix-tier JSON file",
                                         f"{type(e).__name__}: {e}")) from None

    def write_json(self, name: str, obj) -> None:
        """Replace ``name`` atomically (a temporary, fsync, rename). On failure the old
        file is intact and the temporary is gone."""
        tmp = name + ".tmp"
        data = json.dumps(obj, sort_keys=True).encode("utf-8")
        if self.check(tmp) is not None:          # a stale temporary of ours: a crashed writer's
            self.unlink(tmp)
        target = self.check(name)
        fd = self.open(tmp, os.O_WRONLY, exclusive=True)
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except OSError as e:
            self.unlink(tmp)
            raise storage_error(self.file(name), "room to write it", e) from None
        finally:
            if tmp in self.created:
                self.created.remove(tmp)
        if target is None:
            self.created.append(name)
        try:
            os.fsync(self.fd)                    # the rename itself survives a power cut
        except OSError:
            pass

    # ---- space and cleanup ----------------------------------------------------------------
    def free_bytes(self) -> int:
        st = os.fstatvfs(self.fd)
        return st.f_bavail * st.f_frsize

    def unlink(self, name: str) -> None:
        try:
            os.unlink(name, dir_fd=self.fd)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise storage_error(self.file(name), "a file pagedkv can remove", e) from None

    def rollback(self) -> None:
        """Remove what this open created (files, then directories): a refused directory
        is left as it was."""
        if self.fd >= 0:
            for name in reversed(self.created):
                try:
                    os.unlink(name, dir_fd=self.fd)
                except OSError:
                    pass
            self.created = []
        self.close()
        self._remove_made()

    def _remove_made(self) -> None:
        for d in self._made:
            try:
                os.rmdir(d)
            except OSError:
                break
        self._made = []

    def close(self) -> None:
        if self.fd >= 0:
            self._release()         # closes it, once
            self.fd = -1
