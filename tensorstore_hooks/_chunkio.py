"""Moving whole objects (chunk files, metadata documents) under one root.

Three backends share one small interface: :class:`LocalIO` talks to the OS directly
(one ``open``/``write`` per chunk, ``readinto`` a caller's buffer: no extra copy; with
``O_DIRECT`` where the filesystem allows it, NOTE [ Direct I/O ]), :class:`MemoryIO`
keeps bytes in a private dict, and :class:`FsspecIO` goes through any fsspec
filesystem (S3, GCS, ...), batching many objects into one concurrent call. Paths are
``/``-separated and relative to the root.

NOTE [ Direct I/O ]
Through the page cache, every offloaded byte is copied by the CPU on its way to the
disk and back, and stays charged to the process's memory cgroup until the kernel
writes it back and reclaims it: a container sees no saving at all. With ``O_DIRECT``
the bytes go between the caller's (aligned) memory and the device, and nothing stays
behind. Rules:

1. A store asks for it with ``direct_io``: ``"auto"`` (default) uses it where the
   root's filesystem allows it, ``"on"`` requires it (a :class:`ConfigError` where it
   cannot be had), ``"off"`` never uses it. Only :class:`LocalIO` can; other
   backends report it off.
2. Whether a root allows it is probed once per root directory and process
   (:func:`probe_direct_io`): RAM filesystems (tmpfs, ramfs) are refused outright
   (their files are memory; since Linux 6.6 tmpfs accepts ``O_DIRECT`` and ignores
   it), then one aligned block is written and read back with ``O_DIRECT`` in a probe
   file. A root without it is said once at INFO and in the store's stats.
3. Only chunk objects go direct (:meth:`ChunkIO.write_aligned`,
   :meth:`ChunkIO.read_aligned`): addresses, lengths and the offset 0 are multiples of
   :data:`~tensorstore_hooks._aligned.BLOCK_BYTES`; NOTE [ Aligned buffers ] says
   where such memory comes from. Metadata documents and journals stay buffered.
4. A direct write ends by setting the object's size (``ftruncate``) when it is not
   what the caller asked for: a new object is extended with a hole (no zero-fill of
   whole blocks), a longer one cut back.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import functools
import logging
import os
import secrets
import shutil
import socket
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ._aligned import BLOCK_BYTES, AlignedBuffer
from ._forks import foreign
from ._retry import (
    Failure,
    Retrier,
    RetriesExhausted,
    RetryPolicy,
    RetryStats,
    classify,
    error_chain,
    service_code,
)
from ._urls import link_protocols
from .errors import ConfigError, StoreClosedError, StoreUnavailableError

__all__ = [
    "DIRECT_IO_MODES",
    "ChunkIO",
    "DirectIOStatus",
    "FsspecIO",
    "LocalIO",
    "MemoryIO",
    "direct_io_readonly_check",
    "probe_direct_io",
]

log = logging.getLogger("tensorstore_hooks")

Buffer = Any  # bytes, bytearray, memoryview or a numpy array


class ChunkIO(ABC):
    """Reads and writes whole objects relative to a root. Thread-safe."""

    supports_append: bool = False
    """True if :meth:`open_append` works (cheap durable journals)."""

    supports_rewrite_in_place: bool = False
    """True if rewriting an existing object costs less than deleting it and writing a
    new one (local files), so freed chunk objects are worth keeping for reuse."""

    supports_direct_read: bool = False
    """True if :meth:`readinto` reads straight into the caller's buffers piece by piece
    (no intermediate copy; ``filled`` is called between pieces), so a reader can
    checksum while reading. Otherwise :meth:`readinto` is a whole-object read + copy."""

    is_private_memory: bool = False
    """True if the objects live only in this process and die with this object
    (nothing to persist, nothing another process can see)."""

    def __init__(self, url: str) -> None:
        self.url = url

    @abstractmethod
    def write(self, path: str, parts: Sequence[Buffer]) -> None:
        """Write the concatenation of ``parts`` as object ``path`` (replacing it)."""

    def write_many(self, items: Sequence[tuple[str, Sequence[Buffer]]]) -> None:
        for path, parts in items:
            self.write(path, parts)

    def write_sized(self, path: str, parts: Sequence[Buffer], size: int) -> None:
        """Write object ``path`` of ``size`` bytes that starts with the concatenation of
        ``parts``; the bytes after them are zeros in a new object and unspecified in one
        rewritten in place (here: always zeros)."""
        n = sum(memoryview(p).nbytes for p in parts)
        self.write(path, [*parts, bytes(size - n)] if size > n else parts)

    # ------------------------------------------------------- NOTE [ Direct I/O ]
    direct_io: DirectIOStatus | None = None
    """Set by :meth:`configure_direct_io`; ``None`` until then (buffered)."""

    @property
    def uses_direct_io(self) -> bool:
        """True once :meth:`configure_direct_io` turned ``O_DIRECT`` on."""
        return self.direct_io is not None and self.direct_io.enabled

    def configure_direct_io(self, mode: str, probe_path: str) -> DirectIOStatus:
        """Turn direct I/O on where ``mode`` (``auto``/``on``/``off``) and the backend
        allow it (NOTE [ Direct I/O ] rule 1); ``probe_path`` names a scratch object
        the probe may create and remove. Raises :class:`ConfigError` for ``on`` where
        it cannot be had. Call once, before any chunk I/O."""
        if mode == "on":
            raise ConfigError(
                f"direct_io='on' needs a local directory, but {self.url} is not one "
                "(O_DIRECT is a local-filesystem feature); use direct_io='auto' or 'off'"
            )
        self.direct_io = DirectIOStatus(False, mode, "not a local directory")
        return self.direct_io

    def write_aligned(self, path: str, views: Sequence[memoryview], size: int) -> None:
        """Write the concatenation of ``views`` at offset 0 of ``path`` with ``O_DIRECT``,
        then make the object ``size`` bytes (NOTE [ Direct I/O ] rule 4). Each view must
        start on a ``BLOCK_BYTES`` boundary and be a multiple of it long."""
        raise NotImplementedError(f"{type(self).__name__} has no direct I/O")

    def read_aligned(self, path: str, view: memoryview) -> tuple[int, int]:
        """Fill ``view`` (aligned as for :meth:`write_aligned`) from offset 0 of ``path``
        with ``O_DIRECT``; returns (bytes read, object size). Fewer bytes are read only
        at the end of the object. Raises ``FileNotFoundError`` if absent."""
        raise NotImplementedError(f"{type(self).__name__} has no direct I/O")

    @abstractmethod
    def read(self, path: str) -> Buffer:
        """Return the bytes of ``path``. Raises ``FileNotFoundError`` if absent."""

    def read_many(self, paths: Sequence[str]) -> list[Buffer]:
        return [self.read(p) for p in paths]

    def readinto(
        self,
        path: str,
        views: Sequence[memoryview],
        filled: Callable[[int], None] | None = None,
    ) -> int:
        """Fill ``views`` in order from the start of ``path``; return the object's size.

        Views beyond the end of the object are left partly unfilled; the caller
        compares the returned size with what it expected. ``filled(i)``, if given, is
        called as soon as view ``i`` is complete (local files: before the next is read),
        so the caller can checksum while the rest is read.
        """
        data = memoryview(self.read(path)).cast("B")
        pos = 0
        for i, v in enumerate(views):
            n = min(len(v), len(data) - pos)
            v[:n] = data[pos : pos + n]
            pos += n
            if n < len(v):
                break
            if filled is not None:
                filled(i)
        return len(data)

    @abstractmethod
    def delete(self, paths: Sequence[str]) -> None:
        """Delete objects; missing ones are ignored."""

    def take_uncertain(self, paths: Sequence[str]) -> bool:
        """Whether a write or delete of any of ``paths`` had an attempt fail in a way
        that may still take effect later (the service may apply a request after the
        client gave up on it); the paths are forgotten. Always False where an
        operation's outcome is known when it returns (local files, memory).
        NOTE [ Requests that land late ] in ``_zarr_store.py``."""
        return False

    @abstractmethod
    def exists(self, path: str) -> bool: ...

    @abstractmethod
    def listdir(self, path: str) -> list[str]:
        """Names (not paths) of the entries under ``path``; empty if it does not exist."""

    @abstractmethod
    def remove_tree(self, path: str) -> None:
        """Remove ``path`` and everything under it; absent is fine."""

    def open_append(self, path: str) -> Any:
        """An unbuffered binary file opened for appending (only if ``supports_append``)."""
        raise NotImplementedError(f"{type(self).__name__} cannot append")

    def truncate(self, path: str) -> None:
        """Empty ``path`` in place (only if ``supports_append``)."""
        raise NotImplementedError(f"{type(self).__name__} cannot truncate")

    def replace(self, src: str, dst: str) -> None:
        """Move ``src`` over ``dst``, atomically where the backend can."""
        self.write(dst, [self.read(src)])
        self.delete([src])

    def lock(self, path: str) -> Callable[[], None] | None:
        """Take an exclusive lock named by ``path`` for as long as this process holds it
        (released by the returned function, or when the process dies).

        Returns None where the backend has no locks (object stores, private memory).
        Raises ``BlockingIOError`` whose ``strerror`` names the holder if another
        object (in this or another process) holds it. Never waits.
        """
        return None

    def close(self) -> None:  # noqa: B027 - optional: most backends hold nothing to release
        """Release connections or sessions this object holds (idempotent; default none)."""


class LocalIO(ChunkIO):
    """A directory on a local filesystem, through plain OS calls."""

    supports_append = True
    supports_rewrite_in_place = True
    supports_direct_read = True

    def __init__(self, root: str) -> None:
        super().__init__("file://" + os.path.abspath(root))
        self.root = os.path.abspath(root)
        self.root_made = False
        """Set once the store's layout is written: from then on a missing root is an
        error (removed or renamed), never made again under the writes' feet."""

    def _full(self, path: str) -> str:
        return os.path.join(self.root, path) if path else self.root

    def write(self, path: str, parts: Sequence[Buffer]) -> None:
        self._write(path, parts, None)

    def write_sized(self, path: str, parts: Sequence[Buffer], size: int) -> None:
        self._write(path, parts, size)

    def _open_for_write(self, path: str, extra_flags: int = 0) -> int:
        full = self._full(path)
        flags = os.O_WRONLY | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | extra_flags
        try:
            return os.open(full, flags, 0o644)
        except FileNotFoundError:
            if self.root_made and not os.path.isdir(self.root):
                raise FileNotFoundError(errno.ENOENT, "the store root is gone", self.root) from None
            os.makedirs(os.path.dirname(full), exist_ok=True)
            return os.open(full, flags, 0o644)

    def _write(self, path: str, parts: Sequence[Buffer], size: int | None = None) -> None:
        # Overwrite in place rather than truncate: rewriting the blocks and page-cache
        # pages a file already has is 3-10x cheaper (in kernel time) than freeing them
        # and allocating new ones, and a store's chunk files are rewritten with the same
        # size over and over (NOTE [ Spare chunk files ] in _zarr_store.py).
        fd = self._open_for_write(path)
        try:
            total = 0
            for part in parts:
                total += _write_all(fd, part)
            want = total if size is None else size
            have = os.fstat(fd).st_size
            if have > want or (size is not None and have != want):
                os.ftruncate(fd, want)
        finally:
            os.close(fd)

    # ------------------------------------------------------- NOTE [ Direct I/O ]
    def configure_direct_io(self, mode: str, probe_path: str) -> DirectIOStatus:
        if mode not in DIRECT_IO_MODES:
            raise ConfigError(
                f"direct_io: expected one of {', '.join(DIRECT_IO_MODES)}, got {mode!r}"
            )
        if mode == "off":
            self.direct_io = DirectIOStatus(False, mode, "direct_io is 'off'")
            return self.direct_io
        full = self._full(probe_path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        ok, why = _probe_cached(self.root, full)
        if not ok and mode == "on":
            raise ConfigError(
                f"direct_io='on': {self.url} cannot do direct I/O: {why}. Put the store on a "
                "filesystem that supports O_DIRECT (ext4, xfs, btrfs on a disk), or use "
                "direct_io='auto' (buffered where unsupported) or 'off'"
            )
        self.direct_io = DirectIOStatus(ok, mode, why)
        return self.direct_io

    def write_aligned(self, path: str, views: Sequence[memoryview], size: int) -> None:
        fd = self._open_for_write(path, _O_DIRECT)
        try:
            _pwrite_aligned(fd, views)
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)
        finally:
            os.close(fd)

    def read_aligned(self, path: str, view: memoryview) -> tuple[int, int]:
        full = self._full(path)
        try:
            fd = os.open(full, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | _O_DIRECT)
        except OSError as e:
            if e.errno == errno.EINVAL and os.path.isdir(full):  # what a buffered open says
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), full) from e
            raise
        try:
            size = os.fstat(fd).st_size
            pos = 0
            while pos < len(view):
                n = os.preadv(fd, [view[pos:]], pos)
                if not n:
                    break
                pos += n
            return pos, size
        finally:
            os.close(fd)

    def read(self, path: str) -> Buffer:
        with open(self._full(path), "rb", buffering=0) as f:
            return f.read()

    def readinto(
        self,
        path: str,
        views: Sequence[memoryview],
        filled: Callable[[int], None] | None = None,
    ) -> int:
        with open(self._full(path), "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            for i, v in enumerate(views):
                pos = 0
                while pos < len(v):
                    n = f.readinto(v[pos:])
                    if not n:
                        return size
                    pos += n
                if filled is not None:
                    filled(i)
            return size

    def delete(self, paths: Sequence[str]) -> None:
        for p in paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._full(p))

    def exists(self, path: str) -> bool:
        return os.path.exists(self._full(path))

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(self._full(path)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def remove_tree(self, path: str) -> None:
        shutil.rmtree(self._full(path), ignore_errors=True)

    def open_append(self, path: str) -> Any:
        full = self._full(path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        return open(full, "ab", buffering=0)

    def truncate(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.truncate(self._full(path), 0)

    def replace(self, src: str, dst: str) -> None:
        os.replace(self._full(src), self._full(dst))

    def lock(self, path: str) -> Callable[[], None] | None:
        # flock, not fcntl record locks: flock locks belong to the open file, so two
        # objects in one process exclude each other too, and the kernel drops the lock
        # when the process dies (no stale lock after SIGKILL).
        import fcntl

        full = self._full(path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        fd = os.open(full, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            holder = os.pread(fd, 256, 0).decode("utf-8", "replace").strip() or "unknown"
            os.close(fd)
            raise BlockingIOError(e.errno, f"held by {holder}") from None
        except BaseException:
            os.close(fd)
            raise
        with contextlib.suppress(OSError):
            me = f"pid {os.getpid()} on {socket.gethostname()}".encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, me, 0)

        held = [fd]
        owner = os.getpid()

        def release() -> None:
            if not held:
                return  # idempotent: never close a descriptor number twice
            fd = held.pop()
            # A forked child shares this open file, and with it the lock: only the
            # process that took it unlocks (explicitly: the child may still hold a
            # copy of the descriptor). Closing the child's copy leaves the lock be.
            if not foreign(owner):  # NOTE [ Fork safety ]
                with contextlib.suppress(OSError):
                    fcntl.flock(fd, fcntl.LOCK_UN)
            with contextlib.suppress(OSError):
                os.close(fd)

        return release


def _write_all(fd: int, part: Buffer) -> int:
    mv = memoryview(part).cast("B")
    n = len(mv)
    while mv:
        mv = mv[os.write(fd, mv) :]
    return n


def _pwrite_aligned(fd: int, views: Sequence[memoryview]) -> None:
    """``pwritev`` the views at offset 0, resuming after short writes (which stay
    block-aligned with O_DIRECT; one that does not is an EIO, never silent)."""
    todo = [v for v in views if len(v)]
    pos = 0
    while todo:
        n = os.pwritev(fd, todo, pos)
        if n <= 0 or (n % BLOCK_BYTES and n != sum(len(v) for v in todo)):
            raise OSError(errno.EIO, f"direct write stopped after {pos + max(n, 0)} bytes")
        pos += n
        while todo and n >= len(todo[0]):
            n -= len(todo[0])
            todo.pop(0)
        if n:
            todo[0] = todo[0][n:]


# ----------------------------------------------------------- NOTE [ Direct I/O ]
DIRECT_IO_MODES = ("auto", "on", "off")
"""The values of ``store.direct_io``."""

_O_DIRECT = getattr(os, "O_DIRECT", 0)
_RAM_FILESYSTEMS = {0x01021994: "tmpfs", 0x858458F6: "ramfs"}  # statfs(2) f_type magics
_probed: dict[str, tuple[bool, str]] = {}
_probed_lock = threading.Lock()


@dataclass(frozen=True, slots=True)
class DirectIOStatus:
    """Whether a backend does chunk I/O with ``O_DIRECT`` (NOTE [ Direct I/O ])."""

    enabled: bool
    """True: chunk objects are written and read with ``O_DIRECT``."""
    mode: str
    """What was asked: ``auto``, ``on`` or ``off``."""
    reason: str
    """Why it is off (empty when on)."""

    def describe(self) -> str:
        """``"on"`` or ``"off (why)"``, for logs and ``inspect``."""
        return "on" if self.enabled else f"off ({self.reason})"


def _ram_filesystem(directory: str) -> str | None:
    """The name of the RAM filesystem ``directory`` is on, or None (Linux ``statfs``)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux
        if libc.statfs(os.fsencode(directory), buf) != 0:
            return None
    except (OSError, AttributeError):
        return None
    magic = int.from_bytes(buf.raw[: ctypes.sizeof(ctypes.c_long)], sys.byteorder) & 0xFFFFFFFF
    return _RAM_FILESYSTEMS.get(magic)


def probe_direct_io(directory: str, probe_name: str | None = None) -> tuple[bool, str]:
    """Whether ``O_DIRECT`` chunk I/O works in ``directory`` (which must exist), and if
    not, why (NOTE [ Direct I/O ] rule 2). Creates and removes one probe file
    (``probe_name``, default a unique hidden name); never raises for a refusal."""
    ok, why, _ = _probe(directory, probe_name)
    return ok, why


def direct_io_readonly_check(root: str) -> str:
    """What a store under ``root`` would get from ``direct_io="auto"``, found without
    writing anything (for ``inspect``): ``"available (FS accepts O_DIRECT)"`` or
    ``"off (why)"``. Opens the root's ``zarr.json`` with ``O_DIRECT`` for reading."""
    if not _O_DIRECT:
        return "off (this platform has no O_DIRECT)"
    ram = _ram_filesystem(root)
    if ram is not None:
        return f"off (the root is on {ram}, whose files live in RAM)"
    try:
        fd = os.open(os.path.join(root, "zarr.json"), os.O_RDONLY | _O_DIRECT)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return "off (the filesystem refuses O_DIRECT)"
        return f"unknown ({e.strerror})"
    os.close(fd)
    return "available (the filesystem accepts O_DIRECT; direct_io=auto uses it)"


def _probe(directory: str, probe_name: str | None) -> tuple[bool, str, bool]:
    """:func:`probe_direct_io`, plus whether the answer holds for good (a filesystem
    that refuses O_DIRECT) or may change (no room for the probe file, no permission)."""
    if not _O_DIRECT:
        return False, "this platform has no O_DIRECT", True
    ram = _ram_filesystem(directory)
    if ram is not None:
        return False, f"the root is on {ram}, whose files live in RAM", True
    name = probe_name or f".tsh-direct-probe-{os.getpid()}-{secrets.token_hex(4)}"
    path = os.path.join(directory, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | _O_DIRECT, 0o600)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False, "the filesystem refuses O_DIRECT", True
        return False, f"cannot create a probe file ({e.strerror})", False
    try:
        out, back = AlignedBuffer(BLOCK_BYTES), AlignedBuffer(BLOCK_BYTES)
        out.view[:] = (b"tsh-direct-probe" * (BLOCK_BYTES // 16))[:BLOCK_BYTES]
        try:
            os.pwrite(fd, out.view, 0)
            got = os.preadv(fd, [back.view], 0)
        except OSError as e:
            definitive = e.errno in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP)
            return (
                False,
                f"O_DIRECT I/O of {BLOCK_BYTES}-byte blocks fails ({e.strerror})",
                definitive,
            )
        if got != BLOCK_BYTES or back.view != out.view:
            return False, "O_DIRECT reads did not return what was written", True
        return True, "", True
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)


def _probe_cached(root: str, probe_file: str) -> tuple[bool, str]:
    """:func:`probe_direct_io` (with ``probe_file``) once per root directory in this
    process; a refusal is said once, at INFO."""
    key = os.path.realpath(root)
    with _probed_lock:
        hit = _probed.get(key)
        if hit is not None:
            return hit
        ok, why, definitive = _probe(os.path.dirname(probe_file), os.path.basename(probe_file))
        result = (ok, why)
        if definitive:  # a full disk or a permission problem is asked again next time
            _probed[key] = result
    if not result[0]:
        log.info(
            "direct I/O is off under %s: %s; chunk files go through the page cache", key, result[1]
        )
    return result


class MemoryIO(ChunkIO):
    """A private in-process dict (never fsspec's process-global memory filesystem)."""

    is_private_memory = True

    def __init__(self, label: str = "memory://") -> None:
        super().__init__(label)
        self._objects: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def write(self, path: str, parts: Sequence[Buffer]) -> None:
        data = b"".join(memoryview(p).cast("B") for p in parts)
        self._objects[path] = data

    def read(self, path: str) -> Buffer:
        try:
            return self._objects[path]
        except KeyError:
            raise FileNotFoundError(path) from None

    def delete(self, paths: Sequence[str]) -> None:
        for p in paths:
            self._objects.pop(p, None)

    def exists(self, path: str) -> bool:
        if path in self._objects:
            return True
        prefix = path.rstrip("/") + "/"
        return any(k.startswith(prefix) for k in list(self._objects))

    def listdir(self, path: str) -> list[str]:
        prefix = path.rstrip("/") + "/" if path else ""
        names = {
            k[len(prefix) :].split("/", 1)[0] for k in list(self._objects) if k.startswith(prefix)
        }
        return sorted(names)

    def remove_tree(self, path: str) -> None:
        prefix = path.rstrip("/") + "/" if path else ""
        with self._lock:
            for k in [k for k in self._objects if k.startswith(prefix) or k == path]:
                del self._objects[k]

    def replace(self, src: str, dst: str) -> None:
        self._objects[dst] = self._objects.pop(src)


class FsspecIO(ChunkIO):
    """Any fsspec filesystem (``s3://``, ``gs://``, ``simplecache::...``), with retries.

    Batched calls (``write_many``/``read_many``) use fsspec's ``pipe``/``cat`` with
    many paths, which async filesystems such as s3fs run concurrently; a batch read
    that fails for some paths retries only those.

    Every call runs under a :class:`~tensorstore_hooks._retry.RetryPolicy`: transient
    failures (throttling, 5xx, connection resets, timeouts) are retried with jittered
    backoff until ``policy.deadline_s``; on an async filesystem each attempt is also
    cut off at the deadline. Permanent failures (missing bucket, access denied) and
    an expired deadline raise :class:`~tensorstore_hooks.StoreUnavailableError` naming
    the URL, the object and the fix. A missing object is ``FileNotFoundError``, as the
    :class:`ChunkIO` contract says. Counters: :attr:`retry_stats`.
    See NOTE [ One retry layer ] in ``_retry.py``.
    """

    def __init__(
        self,
        fs: Any,
        root: str,
        url: str,
        *,
        retry: RetryPolicy | None = None,
        owns_fs: bool = False,
    ) -> None:
        from fsspec.asyn import AsyncFileSystem

        super().__init__(url)
        self.fs = fs
        self.root = root.rstrip("/")
        self._retrier = Retrier(retry or RetryPolicy(), label=f"FsspecIO({url})")
        # Blocking calls into an async filesystem go through fsspec.asyn.sync, which
        # can bound one attempt; a filesystem in asynchronous mode cannot be driven here.
        self._async = isinstance(fs, AsyncFileSystem) and not getattr(fs, "asynchronous", False)
        self._owns_fs = owns_fs
        self._closed = False
        self._uncertain: set[str] = set()  # NOTE [ Requests that land late ] in _zarr_store.py
        self._uncertain_lock = threading.Lock()

    # ------------------------------------------------------------ opening
    @classmethod
    def open_filesystem(
        cls, url: str, storage_options: dict[str, Any], retry: RetryPolicy
    ) -> tuple[Any, str, bool]:
        """``fsspec.core.url_to_fs`` with this class's defaults: returns (fs, path, owned).

        For S3 (also inside a chain such as ``simplecache::s3://``), options the user
        did not set are chosen so that this class is the only retry layer: botocore
        makes one attempt, connect/read timeouts fit the deadline, and the filesystem
        is a private instance (``skip_instance_cache``) that :meth:`close` may shut.
        ``owned`` is true when every S3 link of the URL is such a private instance.
        """
        import fsspec

        opts = dict(storage_options)
        links = link_protocols(url)
        owned = any(p in _S3_PROTOCOLS for p in links)
        for proto in links:
            if proto not in _S3_PROTOCOLS:
                continue
            if len(links) == 1:
                target = opts
            else:  # chained URL: fsspec takes each link's options under its protocol
                target = opts[proto] = dict(opts.get(proto) or {})
            config = dict(target.get("config_kwargs") or {})
            config.setdefault("retries", {"total_max_attempts": 1})
            config.setdefault("connect_timeout", min(5.0, retry.deadline_s))
            config.setdefault("read_timeout", min(15.0, max(retry.deadline_s, 1.0)))
            target["config_kwargs"] = config
            target.setdefault("skip_instance_cache", True)
            owned = owned and target["skip_instance_cache"] is True
            if "session" not in target and set(target) <= _s3fs_parameters():
                # Private filesystems, one botocore session: credentials and service
                # models load once per process, not once per store (~0.2 s each).
                target["session"] = _shared_aio_session()
        fs, path = fsspec.core.url_to_fs(url, **opts)
        for inner in _filesystems(fs):
            if _is_s3(inner) and owned:
                # s3fs loops over its own retryable errors 5 times (see NOTE [ One retry layer ]).
                inner.retries = 1
        return fs, path, owned

    # ------------------------------------------------------------ plumbing
    @property
    def retry_stats(self) -> RetryStats:
        """Calls, retries and failures so far (live counters)."""
        return self._retrier.stats

    @property
    def retry_policy(self) -> RetryPolicy:
        return self._retrier.policy

    def _full(self, path: str) -> str:
        return f"{self.root}/{path}" if path else self.root

    def _attempt(self, method: str, time_left_s: float, *args: Any, **kwargs: Any) -> Any:
        """One call of ``fs.<method>``, bounded by ``time_left_s`` where fsspec allows."""
        if self._async:
            coro_fn = getattr(self.fs, "_" + method, None)
            if coro_fn is not None:
                from fsspec.asyn import sync

                return sync(self.fs.loop, coro_fn, *args, timeout=time_left_s, **kwargs)
        return getattr(self.fs, method)(*args, **kwargs)

    def _run(self, what: str, fn: Any) -> Any:
        """``fn(time_left_s)`` under the retry policy; failures become StoreUnavailableError."""
        if self._closed:
            raise StoreClosedError(f"FsspecIO({self.url}) is closed")
        try:
            return self._retrier.call(what, fn)
        except RetriesExhausted as e:
            raise self._unavailable(e) from e.cause

    def _call(self, what: str, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._run(what, lambda t: self._attempt(method, t, *args, **kwargs))

    def _note_uncertain(self, paths: Sequence[str]) -> None:
        with self._uncertain_lock:
            self._uncertain.update(paths)

    def _changing(self, paths: Sequence[str], attempt: Callable[[], Any]) -> Any:
        """One attempt of a request that changes ``paths``: if it fails, the service may
        still apply it later (a timeout while it waits on its storage servers)."""
        try:
            return attempt()
        except FileNotFoundError:
            raise  # a definite answer (nothing there), not an unknown outcome
        except BaseException:
            self._note_uncertain(paths)
            raise

    def take_uncertain(self, paths: Sequence[str]) -> bool:
        with self._uncertain_lock:
            if not self._uncertain:
                return False
            hit = not self._uncertain.isdisjoint(paths)
            self._uncertain.difference_update(paths)
            return hit

    def _unavailable(self, e: RetriesExhausted) -> StoreUnavailableError:
        cause = e.cause
        detail = f"{type(cause).__name__}: {cause}"
        codes = {code for c in error_chain(cause) if (code := service_code(c)) is not None}
        if e.failure is Failure.TRANSIENT:
            if e.down_since is not None and e.attempts == 1:
                how_long = f"the store has been failing for {time.monotonic() - e.down_since:.1f}s"
            else:
                how_long = (
                    f"still failing after {e.attempts} attempts over {e.elapsed_s:.1f}s "
                    f"(retry deadline {self.retry_policy.deadline_s:g}s)"
                )
            return StoreUnavailableError(
                f"FsspecIO({self.url}): {e.what} failed: {how_long}; last error {detail}. "
                "The store is unreachable or throttling: check the endpoint and network, "
                "or allow a longer retry_deadline_s."
            )
        if "NoSuchBucket" in codes or (
            isinstance(cause, FileNotFoundError) and "bucket" in str(cause).lower()
        ):
            fix = "the bucket does not exist: create it or fix the URL"
        elif isinstance(cause, PermissionError) or codes & _DENIED_CODES:
            fix = (
                "access denied: check the credentials in storage_options "
                "(key/secret/token, or the environment) and the bucket policy"
            )
        else:
            fix = "the request was refused; check the URL and storage_options"
        return StoreUnavailableError(f"FsspecIO({self.url}): {e.what} failed: {fix} ({detail})")

    @staticmethod
    def _join(parts: Sequence[Buffer]) -> bytes:
        return b"".join(memoryview(p).cast("B") for p in parts)

    # ------------------------------------------------------------ ChunkIO
    def write(self, path: str, parts: Sequence[Buffer]) -> None:
        data = self._join(parts)
        full = self._full(path)
        self._run(
            f"writing {path!r}",
            lambda t: self._changing([path], lambda: self._attempt("pipe_file", t, full, data)),
        )

    def write_many(self, items: Sequence[tuple[str, Sequence[Buffer]]]) -> None:
        if len(items) <= 1:
            if items:
                self.write(*items[0])
            return
        pending = {self._full(p): self._join(parts) for p, parts in items}
        relative = {self._full(p): p for p, _ in items}

        def attempt(time_left_s: float) -> None:
            # Objects are written concurrently and each one's outcome kept, so a retry
            # re-sends only the failed ones (a batch of 100 under 5% throttling would
            # otherwise almost never succeed as a whole).
            batch = list(pending.items())
            if self._async:
                from fsspec.asyn import sync

                outcomes = self._changing(
                    [relative[p] for p, _ in batch],
                    lambda: sync(self.fs.loop, self._pipe_each, batch, timeout=time_left_s),
                )
            else:
                outcomes = [_outcome(self.fs.pipe_file, p, d) for p, d in batch]
            errors = []
            for (path, _), err in zip(batch, outcomes, strict=True):
                if err is None:
                    del pending[path]
                else:
                    self._note_uncertain([relative[path]])
                    errors.append(err)
            if errors:
                errors.sort(key=lambda err: classify(err) is Failure.TRANSIENT)
                raise errors[0]

        self._run(f"writing {len(items)} objects ({items[0][0]!r}, ...)", attempt)

    async def _pipe_each(self, batch: list[tuple[str, bytes]]) -> list[BaseException | None]:
        limit = asyncio.Semaphore(_BATCH_CONCURRENCY)

        async def one(path: str, data: bytes) -> None:
            async with limit:
                await self.fs._pipe_file(path, data)

        results = await asyncio.gather(*(one(p, d) for p, d in batch), return_exceptions=True)
        out: list[BaseException | None] = []
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, Exception):
                raise r  # cancellation (the attempt's timeout) and the like
            out.append(r if isinstance(r, BaseException) else None)
        return out

    def read(self, path: str) -> Buffer:
        return self._call(f"reading {path!r}", "cat_file", self._full(path))

    def read_many(self, paths: Sequence[str]) -> list[Buffer]:
        if len(paths) <= 1:
            return [self.read(p) for p in paths]
        full = [self._full(p) for p in paths]
        done: dict[str, Any] = {}

        def attempt(time_left_s: float) -> None:
            todo = [f for f in full if f not in done]
            got = self._attempt("cat", time_left_s, todo, on_error="return")
            errors: list[BaseException] = []
            for f in todo:
                v = got.get(f) if isinstance(got, dict) else None
                if v is None:
                    v = FileNotFoundError(f)
                if isinstance(v, BaseException):
                    errors.append(v)
                else:
                    done[f] = v
            if errors:
                # A missing object or a permanent error decides; otherwise the
                # transient failures are retried, and only those paths re-read.
                errors.sort(key=lambda err: classify(err) is Failure.TRANSIENT)
                raise errors[0]

        self._run(f"reading {len(full)} objects ({paths[0]!r}, ...)", attempt)
        return [done[f] for f in full]

    def delete(self, paths: Sequence[str]) -> None:
        if not paths:
            return
        full = [self._full(p) for p in paths]
        try:
            self._run(
                f"deleting {len(full)} objects ({paths[0]!r}, ...)",
                lambda t: self._changing(paths, lambda: self._attempt("rm", t, full)),
            )
        except FileNotFoundError:
            for path in paths:
                with contextlib.suppress(FileNotFoundError):
                    self._delete_one(path)

    def _delete_one(self, path: str) -> None:
        full = self._full(path)
        self._run(
            f"deleting {full!r}",
            lambda t: self._changing([path], lambda: self._attempt("rm_file", t, full)),
        )

    def exists(self, path: str) -> bool:
        return bool(self._call(f"checking {path or '/'!r}", "exists", self._full(path)))

    def listdir(self, path: str) -> list[str]:
        try:
            entries = self._call(f"listing {path or '/'!r}", "ls", self._full(path), detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted({str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries})

    def remove_tree(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._call(f"removing {path or '/'!r}", "rm", self._full(path), recursive=True)

    def close(self) -> None:
        """Close the HTTP sessions of a filesystem this object owns (idempotent).

        Without this, aiohttp connectors are closed only by garbage collection, which
        may come after the event loop is gone (ResourceWarning, 'Unclosed connector').
        """
        if self._closed:
            return
        self._closed = True
        if not self._owns_fs:
            return  # a shared (cached) filesystem may be in use elsewhere
        for fs in _filesystems(self.fs):
            if not _is_s3(fs) or getattr(fs, "_s3", None) is None:
                continue
            from fsspec.asyn import sync

            try:
                sync(fs.loop, _close_s3, fs, timeout=5.0)
            except Exception as e:  # closing must never fail the caller
                log.debug("FsspecIO(%s): closing the S3 session failed: %r", self.url, e)


_S3_PROTOCOLS = frozenset({"s3", "s3a"})
_BATCH_CONCURRENCY = 32  # objects in flight per batch; s3fs's own default is similar
_DENIED_CODES = frozenset(
    {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken"}
)

_AIO_SESSION: tuple[int, Any] | None = None
_AIO_SESSION_LOCK = threading.Lock()


def _shared_aio_session() -> Any:
    """This process's aiobotocore session for the S3 filesystems made here (new after fork)."""
    global _AIO_SESSION
    with _AIO_SESSION_LOCK:
        if _AIO_SESSION is None or _AIO_SESSION[0] != os.getpid():
            from aiobotocore.session import AioSession

            _AIO_SESSION = (os.getpid(), AioSession())
        return _AIO_SESSION[1]


@functools.cache
def _s3fs_parameters() -> frozenset[str]:
    """Options s3fs consumes itself. Any other option goes to the botocore session s3fs
    would create (``profile``, ...), so a shared session must not replace it then."""
    import inspect

    from s3fs import S3FileSystem

    named = {
        name
        for name, p in inspect.signature(S3FileSystem.__init__).parameters.items()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and name != "self"
    }
    return frozenset(
        named | {"use_listings_cache", "listings_expiry_time", "max_paths", "skip_instance_cache"}
    )


def _outcome(fn: Any, *args: Any) -> BaseException | None:
    try:
        fn(*args)
    except Exception as e:
        return e
    return None


def _filesystems(fs: Any) -> list[Any]:
    """``fs`` and the filesystems it wraps (``simplecache::s3://`` has ``.fs``)."""
    out = [fs]
    inner = getattr(fs, "__dict__", {}).get("fs")
    while inner is not None and all(inner is not f for f in out) and len(out) < 4:
        out.append(inner)
        inner = getattr(inner, "__dict__", {}).get("fs")
    return out


def _is_s3(fs: Any) -> bool:
    protocol = getattr(type(fs), "protocol", None)
    names = protocol if isinstance(protocol, tuple | list) else (protocol,)
    return any(n in _S3_PROTOCOLS for n in names)


async def _close_s3(fs: Any) -> None:
    # s3fs keeps the client's async context manager in _s3creator; leaving it closes
    # the aiohttp session. Its own finalizer does the same at garbage collection,
    # and leaving twice is harmless.
    creator = getattr(fs, "_s3creator", None)
    fs._s3 = None
    if creator is not None:
        await creator.__aexit__(None, None, None)
