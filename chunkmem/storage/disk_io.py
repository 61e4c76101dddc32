"""The disk tier's I/O engine: scratch files under a user-given directory, read and written off the
Python thread in aligned pieces.

A :class:`ScratchSpace` is a private directory ``chunkmem-<pid>-<token>`` that this process creates
under the user's ``nvme_path`` and removes again on :meth:`ScratchSpace.close`, when the object is
garbage collected and at interpreter exit (also after an uncaught exception). Its files
(:class:`DiskFile`) are scratch space, never state: a directory left behind by a killed process is
found by the next :class:`ScratchSpace` in the same ``nvme_path`` (its owner process is gone) and
removed with a warning, without reading what it holds. A private directory that cannot be removed (made
read-only meanwhile) is reported with a ``RuntimeWarning`` naming it and the bytes left in it; a
``nvme_path`` it cannot be created in is an :class:`~chunkmem.InvalidArgumentError` naming ``nvme_path``.

Files are preallocated (``posix_fallocate``) when created, so a full disk is reported then, not in the
middle of a step, and are opened with ``O_DIRECT`` where the filesystem allows it: reads and writes
then bypass the page cache, which would otherwise fill host memory with copies of what the disk tier
exists to keep out of it. ``O_DIRECT`` needs the offset, the length and the buffer's address of every
I/O to be multiples of :data:`ALIGNMENT` (bytes); the engine asks that of every request on every
filesystem, so code that works on one works on all. :class:`AlignedBufferPool` holds such buffers.

A request (:meth:`DiskFile.read_into`, :meth:`DiskFile.write_from`) returns an :class:`IOHandle` at
once; the request is split into pieces of :data:`PIECE_NBYTES` bytes that run on the process's pool of
:data:`IO_WORKERS` threads (:func:`io_workers`) with ``os.preadv`` / ``os.pwritev``, which release the
GIL, so several pieces keep the disk's queues busy while Python computes. Plain system calls in threads
need no dependency; :func:`measure_bandwidth` measures what they reach.

A failed I/O (an errno, or a read that ends before the buffer is full) raises :class:`DiskIOError`
from :meth:`IOHandle.wait`, naming the file, what was moved (e.g. ``"chunk3.exp_avg"``) and the cause.
:func:`inject_faults` makes I/O fail on purpose, for tests.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import errno as errno_codes
import json
import mmap
import os
import re
import secrets
import shutil
import socket
import threading
import time
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from ..errors import ChunkmemError, DiskIOError, InvalidArgumentError, check_number, check_type

ALIGNMENT = 4096
"""Bytes: the offset, the length and the buffer address of every disk I/O are multiples of it."""

PIECE_NBYTES = 8 * 2**20
"""Bytes: a request larger than this is split into pieces of this size that run on several workers."""

IO_WORKERS = 4
"""Threads in the process's pool of I/O workers (:func:`io_workers`)."""

OWNER_FILE = "owner.json"
"""The marker in each private directory that names its owner process (pid, hostname, start time)."""

_PRIVATE_DIR = re.compile(r"^chunkmem-(?P<pid>[0-9]+)-(?P<token>[0-9a-f]+)$")
_WORKER_PREFIX = "chunkmem-io"


def aligned_nbytes(nbytes: int) -> int:
    """``nbytes`` (bytes, >= 0) rounded up to a multiple of :data:`ALIGNMENT`."""
    check_number("nbytes", nbytes, low=0, integer=True)
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


# ---------------------------------------------------------------------------------------------------
# Worker threads


_workers: concurrent.futures.ThreadPoolExecutor | None = None
_workers_lock = threading.Lock()


def io_workers() -> concurrent.futures.ThreadPoolExecutor:
    """The process's pool of :data:`IO_WORKERS` I/O threads, which every request's pieces run on
    (created on first use; a forked child makes its own)."""
    global _workers
    with _workers_lock:
        if _workers is None:
            _workers = concurrent.futures.ThreadPoolExecutor(IO_WORKERS, thread_name_prefix=_WORKER_PREFIX)
        return _workers


def _forget_workers_after_fork() -> None:
    global _workers, _workers_lock
    _workers, _workers_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_workers_after_fork)


def _on_worker_thread() -> bool:
    return threading.current_thread().name.startswith(_WORKER_PREFIX)


# ---------------------------------------------------------------------------------------------------
# Fault injection (tests)


class _Faults:
    """The active :func:`inject_faults` settings; ``failed`` counts the I/Os it made fail."""

    def __init__(self, read_errno: int | None, write_errno: int | None, short_read: bool, after: int,
                 what: str | None, times: int | None) -> None:
        self.read_errno, self.write_errno, self.short_read = read_errno, write_errno, short_read
        self.after, self.what, self.times = after, what, times
        self.matched = 0
        self.failed = 0

    def decide(self, reading: bool, what: str) -> tuple[int | None, bool]:
        """(errno to raise, whether to cut the read short) for a request about to start."""
        targeted = (self.read_errno is not None or self.short_read) if reading else self.write_errno is not None
        if not targeted or (self.what is not None and not what.startswith(self.what)):
            return None, False
        self.matched += 1
        if self.matched <= self.after or (self.times is not None and self.failed >= self.times):
            return None, False
        self.failed += 1
        if reading:
            return (self.read_errno, False) if self.read_errno is not None else (None, True)
        return self.write_errno, False


_faults: _Faults | None = None
_faults_lock = threading.Lock()


@contextlib.contextmanager
def inject_faults(*, read_errno: int | None = None, write_errno: int | None = None, short_read: bool = False,
                  after: int = 0, what: str | None = None, times: int | None = None) -> Iterator[_Faults]:
    """For tests: inside the block, requests fail on purpose.

    A request is matched when it is a read and ``read_errno`` or ``short_read`` is given, or a write and
    ``write_errno`` is given, and (with ``what``) its ``what`` starts with ``what``. The first ``after``
    matched requests run normally; each later one fails (at most ``times`` of them, every one when
    ``None``): a read raises ``OSError(read_errno)``, or with ``short_read`` stops at half of its last
    piece as if the file ended there; a write raises ``OSError(write_errno)``. The failing piece is the
    request's last, so the others have moved their bytes, as in a real partial failure. Yields the
    settings; their ``failed`` attribute counts the requests made to fail.
    """
    global _faults
    if read_errno is not None and short_read:
        raise InvalidArgumentError("short_read", short_read, "False when read_errno is given")
    check_number("after", after, low=0, integer=True)
    if times is not None:
        check_number("times", times, low=1, integer=True)
    faults = _Faults(read_errno, write_errno, short_read, after, what, times)
    with _faults_lock:
        if _faults is not None:
            raise ChunkmemError("inject_faults blocks cannot be nested")
        _faults = faults
    try:
        yield faults
    finally:
        with _faults_lock:
            _faults = None


def _decide_fault(reading: bool, what: str) -> tuple[int | None, bool]:
    with _faults_lock:
        return (None, False) if _faults is None else _faults.decide(reading, what)


# ---------------------------------------------------------------------------------------------------
# Requests


def _move_piece(fd: int, buf: torch.Tensor, start: int, nbytes: int, offset: int, reading: bool,
                fail_errno: int | None, cut_short: bool) -> int:
    """Move ``nbytes`` bytes between ``buf[start:]`` and the file at ``offset`` (bytes); returns the
    bytes moved (fewer only when a read reached the end of the file, or a write moved nothing)."""
    if fail_errno is not None:
        raise OSError(fail_errno, os.strerror(fail_errno))
    limit = nbytes // 2 // ALIGNMENT * ALIGNMENT if cut_short else nbytes
    view = memoryview((ctypes.c_char * nbytes).from_address(buf.data_ptr() + start)).cast("B")
    moved = 0
    while moved < limit:
        part = view[moved:limit]
        count = os.preadv(fd, [part], offset + moved) if reading else os.pwritev(fd, [part], offset + moved)
        if count == 0:
            break
        moved += count
    return moved


class IOHandle:
    """A read or write that has been started. ``nbytes``: the bytes it moves."""

    def __init__(self, file: "DiskFile", operation: str, what: str, offset: int, buf: torch.Tensor,
                 pieces: list[concurrent.futures.Future]) -> None:
        self.nbytes = buf.numel()
        self._file, self._operation, self._what, self._offset = file, operation, what, offset
        self._buf = buf  # kept alive until the I/O is done
        self._pieces = pieces
        self._error: tuple[str, int | None, BaseException | None] | None = None
        self._checked = False

    def done(self) -> bool:
        """Whether every piece has finished (successfully or not); does not raise."""
        return all(piece.done() for piece in self._pieces)

    def wait(self) -> None:
        """Block until the I/O is done; raise :class:`DiskIOError` if it failed (on every call)."""
        if not self._checked:
            concurrent.futures.wait(self._pieces)
            self._error = self._first_error()
            self._checked = True
            self._buf = None
        if self._error is not None:
            cause, code, original = self._error
            raise DiskIOError(self._file.path, self._what, self._operation, cause, code) from original

    def _first_error(self) -> tuple[str, int | None, BaseException | None] | None:
        moved = 0
        failure = None
        for piece in self._pieces:
            error = piece.exception()
            if error is None:
                moved += piece.result()
            elif failure is None:
                if not isinstance(error, OSError):
                    raise error
                failure = error
        if failure is not None:
            code = failure.errno
            text = DiskIOError.from_os_error(self._file.path, self._what, self._operation, failure).cause
            return text, code, failure
        if moved != self.nbytes:
            return f"short {self._operation}: got {moved} of {self.nbytes} bytes (at offset {self._offset})", None, None
        return None


class DiskFile:
    """A preallocated scratch file of a :class:`ScratchSpace`. ``path``: its path; ``nbytes``: its size
    (bytes, a multiple of :data:`ALIGNMENT`)."""

    def __init__(self, space: "ScratchSpace", path: str, fd: int, nbytes: int) -> None:
        self._space = space  # the directory stays while a file or one of its requests is alive
        self._fd = fd
        self.path = path
        self.nbytes = nbytes

    def read_into(self, buf: torch.Tensor, offset: int, what: str) -> IOHandle:
        """Start filling all of ``buf`` (uint8, CPU, contiguous, address and length multiples of
        :data:`ALIGNMENT`) from the file at ``offset`` (bytes, a multiple of :data:`ALIGNMENT`).
        ``what`` names the data in errors. Do not touch ``buf`` until the handle's :meth:`IOHandle.wait`."""
        return self._start(buf, offset, what, reading=True)

    def write_from(self, buf: torch.Tensor, offset: int, what: str) -> IOHandle:
        """Start writing all of ``buf`` (as for :meth:`read_into`) into the file at ``offset`` (bytes).
        Do not change ``buf`` until the handle's :meth:`IOHandle.wait`."""
        return self._start(buf, offset, what, reading=False)

    def flush(self, drop_cache: bool = False) -> None:
        """Wait until the file's writes are on the disk (``fsync``); ``drop_cache``: then ask the kernel to
        drop its cached pages, so the next read comes from the disk (files opened without direct I/O)."""
        os.fsync(self._fd)
        if drop_cache:
            os.posix_fadvise(self._fd, 0, self.nbytes, os.POSIX_FADV_DONTNEED)

    def grow(self, nbytes: int) -> None:
        """Preallocate the file up to ``nbytes`` (bytes, rounded up to :data:`ALIGNMENT`, not smaller
        than :attr:`nbytes`). A full disk raises :class:`DiskIOError` and leaves the file as it was."""
        check_number("nbytes", nbytes, low=self.nbytes, integer=True)
        new = aligned_nbytes(nbytes)
        if new == self.nbytes:
            return
        self._space._check_open()
        try:
            os.posix_fallocate(self._fd, self.nbytes, new - self.nbytes)
        except OSError as error:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self.nbytes)
            raise DiskIOError.from_os_error(self.path, os.path.basename(self.path), "create", error) from error
        self.nbytes = new
        self._space._sizes[os.path.basename(self.path)] = new

    def _start(self, buf: torch.Tensor, offset: int, what: str, reading: bool) -> IOHandle:
        check_type("buf", buf, torch.Tensor, "a torch.Tensor")
        if buf.dtype != torch.uint8 or buf.device.type != "cpu" or not buf.is_contiguous():
            raise InvalidArgumentError("buf", _describe(buf), "a contiguous uint8 CPU tensor")
        if buf.numel() == 0 or buf.numel() % ALIGNMENT or buf.data_ptr() % ALIGNMENT:
            raise InvalidArgumentError("buf", _describe(buf),
                                       f"a non-empty buffer whose address and length are multiples of {ALIGNMENT} "
                                       "bytes (take one from an AlignedBufferPool)")
        check_number("offset", offset, low=0, high=self.nbytes - buf.numel(), integer=True,
                     allowed=f"a multiple of {ALIGNMENT} from 0 to {self.nbytes - buf.numel()} bytes "
                             f"(the file holds {self.nbytes} bytes, the buffer {buf.numel()})")
        if offset % ALIGNMENT:
            raise InvalidArgumentError("offset", offset, f"a multiple of {ALIGNMENT} bytes")
        check_type("what", what, str, "a str naming the data (e.g. 'chunk3.exp_avg')")
        fail_errno, cut_short = _decide_fault(reading, what)
        pieces = []
        total = buf.numel()
        starts = range(0, total, PIECE_NBYTES)
        with self._space._state.lock:
            self._space._check_open()
            for start in starts:
                last = start + PIECE_NBYTES >= total
                piece = io_workers().submit(_move_piece, self._fd, buf, start, min(PIECE_NBYTES, total - start),
                                            offset + start, reading, fail_errno if last else None,
                                            cut_short and last)
                self._space._state.track(piece, self)
                pieces.append(piece)
        return IOHandle(self, "read" if reading else "write", what, offset, buf, pieces)


def _describe(buf: torch.Tensor) -> str:
    return f"tensor(dtype={buf.dtype}, device={buf.device}, numel={buf.numel()}, address={buf.data_ptr():#x})"


# ---------------------------------------------------------------------------------------------------
# The private directory


class _SpaceState:
    """What a :class:`ScratchSpace`'s finalizer needs (it must not hold the space itself)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.owner_pid = os.getpid()  # a forked child leaves its parent's directory alone
        self.fds: list[int] = []
        self.pending: dict[concurrent.futures.Future, DiskFile] = {}
        self.lock = threading.RLock()  # a piece done before its callback is added untracks at once
        self.closed = False

    def track(self, piece: concurrent.futures.Future, file: DiskFile) -> None:
        # the entry holds the file (and so the space) until the piece is done
        self.pending[piece] = file
        piece.add_done_callback(self._untrack)

    def _untrack(self, piece: concurrent.futures.Future) -> None:
        with self.lock:
            self.pending.pop(piece, None)

    def release(self) -> None:
        """Wait for in-flight I/O, close the files and remove the directory; idempotent. Does nothing in
        a forked child (its copies of the locks and pieces may be stuck as they were at the fork)."""
        if os.getpid() != self.owner_pid:
            return
        with self.lock:
            if self.closed:
                return
            self.closed = True
            pending = list(self.pending)
        if not _on_worker_thread():  # a worker cannot wait for pieces queued behind it
            concurrent.futures.wait(pending)
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds.clear()
        _remove_private_directory(self.path)


def _remove_private_directory(path: str) -> None:
    """Remove the private directory ``path`` (gone already: nothing to do). What cannot be removed (a
    read-only directory) is warned about with a ``RuntimeWarning`` naming it and the bytes left in it, so
    the user can delete it: its files are scratch space of the size of what rested on disk."""
    try:
        shutil.rmtree(path)
    except OSError as error:
        shutil.rmtree(path, ignore_errors=True)  # remove what can be removed
        if os.path.lexists(path):
            left = _bytes_under(path)
            size = "an unknown number of bytes" if left is None else f"{left} bytes"
            warnings.warn(f"could not remove the chunkmem scratch directory {path!r} ({size} of disk-tier "
                          f"scratch files left in it): {error}; it holds no state: delete it by hand",
                          RuntimeWarning, stacklevel=2)


def _bytes_under(path: str) -> int | None:
    """Bytes of the files under ``path`` (their sizes), or ``None`` when it cannot be listed."""
    total = 0
    try:
        for directory, _, names in os.walk(path, onerror=_raise):
            for name in names:
                total += os.lstat(os.path.join(directory, name)).st_size
    except OSError:
        return None
    return total


def _raise(error: OSError) -> None:
    raise error


class ScratchSpace:
    """This process's private directory of disk-tier files under ``nvme_path``.

    ``path``: the private directory (``<nvme_path>/chunkmem-<pid>-<token>``); ``direct``: whether its
    files use ``O_DIRECT``. Where the filesystem refuses ``O_DIRECT`` (checked once, with a 4 KiB probe
    file), files use plain buffered I/O instead: the same requests and results, through the page cache
    (which then holds copies of the files' pages in host memory until the kernel reclaims them). No
    ``fsync`` is needed then either: the files are scratch space read back only by this process, which
    sees its own writes through the page cache, and nothing in them survives the process. (tmpfs
    accepts ``O_DIRECT`` since Linux 6.6.) ``direct=False`` forces buffered I/O; ``direct=True``
    requires ``O_DIRECT``.

    The directory is removed by :meth:`close`, when the object is garbage collected, and at interpreter
    exit (also after an uncaught exception), after waiting for in-flight I/O. A killed process cannot
    remove its directory: a later :class:`ScratchSpace` in the same ``nvme_path`` removes every
    ``chunkmem-<pid>-<token>`` directory whose owner process is gone (no process with that pid, or one
    that started at another time) with a warning naming it; one whose owner is alive (or runs on
    another host) is left alone.
    """

    def __init__(self, nvme_path: str | os.PathLike, argument: str = "nvme_path", *,
                 direct: bool | None = None) -> None:
        directory = _checked_directory(nvme_path, argument)
        if direct is not None:
            check_type("direct", direct, bool, "None (use O_DIRECT where the filesystem allows), True or False")
        _remove_leftovers(directory)
        path = os.path.join(directory, f"chunkmem-{os.getpid()}-{secrets.token_hex(8)}")
        try:
            os.mkdir(path, 0o700)
        except OSError as error:
            if error.errno in (errno_codes.EACCES, errno_codes.EPERM, errno_codes.EROFS):
                raise InvalidArgumentError(argument, nvme_path, "a directory this process may write into (creating "
                                           f"{os.path.basename(path)!r} in it failed: {error.strerror})") from error
            raise DiskIOError.from_os_error(path, "the scratch directory", "create", error) from error
        self.path = path
        self._state = _SpaceState(path)
        self._finalizer = weakref.finalize(self, self._state.release)
        self._sizes: dict[str, int] = {}  # name -> bytes preallocated (not the files: they hold the space)
        try:
            _write_owner(path)
            allowed = _direct_io_allowed(path) if direct is not False else False
        except BaseException:
            self.close()
            raise
        if direct and not allowed:
            self.close()
            raise InvalidArgumentError("direct", direct, f"None or False: the filesystem of {directory!r} "
                                                         "refuses O_DIRECT")
        self.direct = allowed

    def file(self, name: str, nbytes: int) -> DiskFile:
        """Create the file ``name`` in the private directory, preallocated to ``nbytes`` (bytes, rounded
        up to :data:`ALIGNMENT`). A full disk (or any failure) raises :class:`DiskIOError` with
        ``operation="create"`` and leaves no file behind."""
        check_type("name", name, str, "a file name (str)")
        if not name or name in (".", "..", OWNER_FILE) or "/" in name or "\0" in name or name.startswith(".probe"):
            raise InvalidArgumentError("name", name, f"a plain file name: not empty, '.', '..', {OWNER_FILE!r}, "
                                                     "'.probe*', no '/'")
        check_number("nbytes", nbytes, low=0, integer=True)
        self._check_open()
        if name in self._sizes:
            raise InvalidArgumentError("name", name, "a name not used yet in this scratch space")
        path = os.path.join(self.path, name)
        size = aligned_nbytes(nbytes)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | (os.O_DIRECT if self.direct else 0)
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as error:
            raise DiskIOError.from_os_error(path, name, "create", error) from error
        try:
            if size:
                os.posix_fallocate(fd, 0, size)
        except OSError as error:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.remove(path)
            raise DiskIOError.from_os_error(path, name, "create", error) from error
        with self._state.lock:
            self._state.fds.append(fd)
        self._sizes[name] = size
        return DiskFile(self, path, fd, size)

    def bytes_on_disk(self) -> int:
        """Bytes preallocated for this space's files (the sum of their :attr:`DiskFile.nbytes`; the
        owner marker's few bytes are not counted)."""
        return sum(self._sizes.values())

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` (or the finalizer) has run."""
        return self._state.closed

    def close(self) -> None:
        """Wait for in-flight I/O, close the files and remove the private directory; idempotent."""
        self._finalizer()

    def __enter__(self) -> "ScratchSpace":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._state.closed:
            raise ChunkmemError(f"the scratch space {self.path!r} is closed")


def _checked_directory(nvme_path: Any, argument: str) -> str:
    check_type(argument, nvme_path, (str, os.PathLike), "a path (str or os.PathLike) of a writable directory")
    directory = os.fspath(nvme_path)
    if not isinstance(directory, str):
        raise InvalidArgumentError(argument, nvme_path, "a path given as str or a str os.PathLike")
    if not os.path.exists(directory):
        raise InvalidArgumentError(argument, nvme_path, "an existing directory (this one does not exist)")
    if not os.path.isdir(directory):
        raise InvalidArgumentError(argument, nvme_path, "a directory (this is a file)")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise InvalidArgumentError(argument, nvme_path, "a directory this process may write into "
                                                        "(this one is read-only to it)")
    return os.path.abspath(directory)


def process_start_time(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks after boot, as text), ``""`` where that cannot be
    read, or ``None`` when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
        return stat[stat.rindex(")") + 2:].split()[19]  # field 22, counting from the pid as 1
    except FileNotFoundError:
        return None
    except (OSError, ValueError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except OSError:
        pass
    return ""


def _write_owner(path: str) -> None:
    owner = {"pid": os.getpid(), "hostname": socket.gethostname(),
             "start_time": process_start_time(os.getpid()), "created": time.time()}
    marker = os.path.join(path, OWNER_FILE)
    try:
        with open(marker, "w") as f:
            json.dump(owner, f)
    except OSError as error:
        raise DiskIOError.from_os_error(marker, "the owner marker", "create", error) from error


def _owner_gone(path: str, pid: int) -> bool:
    """Whether the process that made the private directory ``path`` (named after ``pid``) has ended."""
    try:
        with open(os.path.join(path, OWNER_FILE)) as f:
            owner = json.load(f)
    except (OSError, ValueError):
        owner = {}  # not written yet (its owner may be creating it now) or unreadable: judge by the pid
    if not isinstance(owner, dict):
        owner = {}
    if owner.get("hostname") not in (None, socket.gethostname()):
        return False  # another host's process: cannot tell
    now = process_start_time(pid)
    if now is None:
        return True
    then = owner.get("start_time")
    return bool(then) and bool(now) and then != now


def _remove_leftovers(directory: str) -> None:
    try:
        names = os.listdir(directory)
    except OSError as error:
        warnings.warn(f"could not list {directory!r} to look for leftover chunkmem scratch directories: {error}",
                      stacklevel=3)
        return
    for name in sorted(names):
        match = _PRIVATE_DIR.match(name)
        path = os.path.join(directory, name)
        if match is None or not os.path.isdir(path) or os.path.islink(path):
            continue
        if not _owner_gone(path, int(match["pid"])):
            continue
        try:
            shutil.rmtree(path)
        except OSError as error:
            if os.path.exists(path):  # else another process removed it first
                warnings.warn(f"could not remove the leftover chunkmem scratch directory {path!r} of a process "
                              f"that has ended: {error}", stacklevel=3)
        else:
            warnings.warn(f"removed the leftover chunkmem scratch directory {path!r} of a process that has "
                          "ended (its files were scratch space, not state)", stacklevel=3)


def _direct_io_allowed(path: str) -> bool:
    """Whether files in ``path`` accept ``O_DIRECT`` (open, write and read of an aligned 4 KiB block)."""
    probe = os.path.join(path, ".probe")
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_DIRECT, 0o600)
    except OSError as error:
        if error.errno == errno_codes.EINVAL:
            return False
        raise DiskIOError.from_os_error(probe, "the O_DIRECT probe", "create", error) from error
    block = mmap.mmap(-1, ALIGNMENT)  # page-aligned
    try:
        os.pwritev(fd, [block], 0)
        os.preadv(fd, [block], 0)
        return True
    except OSError as error:
        if error.errno == errno_codes.EINVAL:
            return False
        raise DiskIOError.from_os_error(probe, "the O_DIRECT probe", "create", error) from error
    finally:
        block.close()
        os.close(fd)
        with contextlib.suppress(OSError):
            os.remove(probe)


# ---------------------------------------------------------------------------------------------------
# Buffers


class AlignedBufferPool:
    """``count`` host buffers of ``aligned_nbytes(nbytes)`` bytes each, at addresses that are multiples of
    :data:`ALIGNMENT`, for disk I/O.

    Without CUDA the buffers are one anonymous memory mapping (page-aligned, outside malloc's heap, so
    the pool holds exactly ``count * buffer_nbytes`` bytes). With CUDA they are pinned (page-locked, so
    copies to the GPU can be asynchronous; pinned memory cannot be swapped out, and the pool is the bound
    on it) and come from torch's pinned allocator, with :data:`ALIGNMENT` bytes more where its block is
    not aligned.

    ``count``; ``buffer_nbytes``: bytes per buffer; ``total_nbytes``: bytes the pool allocated (for the
    host ledger); ``free``: buffers free now.
    """

    def __init__(self, count: int, nbytes: int) -> None:
        check_number("buffer_count", count, low=1, integer=True)
        check_number("nbytes", nbytes, low=1, integer=True, allowed="an integer >= 1 (bytes per buffer)")
        self.count = count
        self.buffer_nbytes = aligned_nbytes(nbytes)
        size = count * self.buffer_nbytes
        if torch.cuda.is_available():
            memory = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            if memory.data_ptr() % ALIGNMENT:
                memory = torch.empty(size + ALIGNMENT, dtype=torch.uint8, pin_memory=True)
        else:
            memory = torch.frombuffer(mmap.mmap(-1, size), dtype=torch.uint8)  # holds the mapping
        self._memory = memory
        self.total_nbytes = memory.numel()
        skip = -memory.data_ptr() % ALIGNMENT
        self._buffers = [memory[skip + i * self.buffer_nbytes: skip + (i + 1) * self.buffer_nbytes]
                         for i in range(count)]
        self._index = {b.data_ptr(): i for i, b in enumerate(self._buffers)}
        self._free = list(range(count - 1, -1, -1))

    @property
    def free(self) -> int:
        """Buffers free now."""
        return len(self._free)

    @property
    def pinned(self) -> bool:
        """Whether the buffers are pinned (page-locked) host memory."""
        return self._memory.is_pinned()

    def take(self) -> torch.Tensor:
        """A free buffer (uint8, ``buffer_nbytes`` elements); :class:`ChunkmemError` when all are taken."""
        if not self._free:
            raise ChunkmemError(f"all {self.count} buffers of the aligned buffer pool are in use "
                                "(give one back before taking another)")
        return self._buffers[self._free.pop()]

    def give_back(self, buf: torch.Tensor) -> None:
        """Return a buffer that :meth:`take` gave (once)."""
        check_type("buf", buf, torch.Tensor, "a torch.Tensor taken from this pool")
        index = self._index.get(buf.data_ptr()) if buf.numel() == self.buffer_nbytes else None
        if index is None or buf.dtype != torch.uint8 or buf.untyped_storage().data_ptr() != \
                self._memory.untyped_storage().data_ptr():
            raise InvalidArgumentError("buf", _describe(buf), "a buffer taken from this pool")
        if index in self._free:
            raise InvalidArgumentError("buf", _describe(buf), "a buffer taken from this pool and not given "
                                                              "back yet")
        self._free.append(index)


# ---------------------------------------------------------------------------------------------------
# Bandwidth


def measure_bandwidth(directory: str | os.PathLike, nbytes: int = 2**30, block: int = 64 * 2**20) -> tuple[float, float]:
    """(read, write) bytes per second of ``directory`` with this engine.

    Writes ``nbytes`` (bytes, rounded up to :data:`ALIGNMENT`) into one scratch file, then times a
    second write and a read of it, in requests of ``block`` bytes with enough of them in flight to keep
    every worker busy, using ``O_DIRECT`` where the filesystem allows. The first write is not timed: it
    turns the file's preallocated (unwritten) extents into written ones, which costs the filesystem
    extra work (on this project's ext4 disk it ran at about 0.6x the speed of later writes); the disk
    tier pays it once per file, in its first step, and overwrites afterwards. The write time includes
    an ``fsync``; without ``O_DIRECT`` the file's pages are then dropped from the page cache, so the read
    comes from the disk. The file (and its private directory) is removed afterwards.
    """
    check_number("nbytes", nbytes, low=1, integer=True)
    check_number("block", block, low=1, integer=True)
    total = aligned_nbytes(nbytes)
    block = min(aligned_nbytes(block), total)
    blocks = -(-total // block)
    depth = min(blocks, max(2, -(-IO_WORKERS * PIECE_NBYTES // block)))
    with ScratchSpace(directory, argument="directory") as space:
        disk_file = space.file("bandwidth", total)
        pool = AlignedBufferPool(depth, block)
        buffers = [pool.take().fill_(i + 1) for i in range(depth)]

        def run(reading: bool) -> float:
            begin = time.perf_counter()
            in_flight: list[IOHandle] = []
            for k in range(blocks):
                if len(in_flight) == depth:
                    in_flight.pop(0).wait()
                start = k * block
                buf = buffers[k % depth][:min(block, total - start)]
                in_flight.append(disk_file.read_into(buf, start, "bandwidth") if reading
                                 else disk_file.write_from(buf, start, "bandwidth"))
            for handle in in_flight:
                handle.wait()
            if not reading:
                disk_file.flush(drop_cache=not space.direct)
            return total / (time.perf_counter() - begin)

        run(reading=False)  # allocates the blocks
        write = run(reading=False)
        read = run(reading=True)
    return read, write
