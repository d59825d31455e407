"""A local directory through plain OS calls, with ``O_DIRECT`` where the filesystem allows it.

Chunk files are written in place (NOTE [ Spare chunk files ] in
``storage/zarr/_store.py``), documents replaced atomically (NOTE [ Atomic documents ]
in ``storage/io/_base.py``).

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
   file. A root without it is said once at INFO and in the store's stats. A probe
   that could not run (no room for its file, no permission) says nothing about the
   filesystem: it is run again before a later write, at most once a second, until it
   answers (a disk full when the store opened must not keep it buffered for life),
   and with ``"on"`` it is that OS error (a full disk: the store's
   ``QuotaExceededError``), not a ``ConfigError`` about O_DIRECT support.
3. Only chunk objects go direct (:meth:`ChunkIO.write_aligned`,
   :meth:`ChunkIO.read_aligned`): addresses, lengths and the offset 0 are multiples of
   :data:`~tensorstore_hooks.storage.io._aligned.BLOCK_BYTES`; NOTE [ Aligned buffers ] says
   where such memory comes from. Metadata documents and journals stay buffered.
4. A direct write ends by setting the object's size (``ftruncate``) when it is not
   what the caller asked for: a new object is extended with a hole (no zero-fill of
   whole blocks), a longer one cut back.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import secrets
import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import BinaryIO, NamedTuple

from tensorstore_hooks._codec import as_memoryview
from tensorstore_hooks.errors import ConfigError
from tensorstore_hooks.runtime import foreign
from tensorstore_hooks.storage.io._aligned import BLOCK_BYTES, AlignedBuffer
from tensorstore_hooks.storage.io._base import DIRECT_IO_MODES, Buffer, ChunkIO, DirectIOStatus

__all__ = [
    "DIRECT_IO_MODES",
    "DirectIOStatus",
    "LocalIO",
    "direct_io_readonly_check",
    "probe_direct_io",
]

log = logging.getLogger("tensorstore_hooks")

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
        self._pending_probe: str | None = None  # a direct-I/O probe to run again
        self._next_probe = 0.0  # time.monotonic() from which it may run
        self._probe_lock = threading.Lock()

    def _full(self, path: str) -> str:
        return os.path.join(self.root, path) if path else self.root

    def write(self, path: str, parts: Sequence[Buffer]) -> None:
        self._write(path, parts, None)

    def write_sized(self, path: str, parts: Sequence[Buffer], size: int) -> None:
        self._write(path, parts, size)

    def _open_for_write(self, path: str, extra_flags: int = 0) -> int:
        return self._open_file(self._full(path), extra_flags)

    def _open_file(self, full: str, extra_flags: int = 0) -> int:
        """Open ``full`` (under the root) for writing, making its directories."""
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
        # size over and over (NOTE [ Spare chunk files ] in storage/zarr/_store.py).
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

    def write_atomic(self, path: str, parts: Sequence[Buffer]) -> None:
        """NOTE [ Atomic documents ] rule 1: a temporary file, ``fsync``, ``rename``
        over ``path``, ``fsync`` of the directory."""
        full = self._full(path)
        directory, name = os.path.split(full)
        tmp = os.path.join(directory, f".{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
        fd = self._open_file(tmp, os.O_EXCL)
        try:
            try:
                for part in parts:
                    _write_all(fd, part)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, full)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        _fsync_directory(directory)

    # ------------------------------------------------------- NOTE [ Direct I/O ]
    def configure_direct_io(self, mode: str, probe_path: str) -> DirectIOStatus:
        """NOTE [ Direct I/O ] rules 1-2. With ``"on"``, a filesystem that refuses
        O_DIRECT is a :class:`ConfigError`; a probe that could not run (no room, no
        permission) raises its ``OSError`` (the store's disk-full error), never a
        ConfigError about O_DIRECT support."""
        if mode not in DIRECT_IO_MODES:
            raise ConfigError(
                f"direct_io: expected one of {', '.join(DIRECT_IO_MODES)}, got {mode!r}"
            )
        if mode == "off":
            self.direct_io = DirectIOStatus(False, mode, "direct_io is 'off'")
            return self.direct_io
        full = self._full(probe_path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        probe = _probe_cached(self.root, full)
        if not probe.ok and probe.transient_errno is not None:
            if mode == "on":
                raise OSError(
                    probe.transient_errno,
                    f"{os.strerror(probe.transient_errno)} (direct_io='on': the O_DIRECT probe "
                    f"file under {self.root} could not be written: {probe.why})",
                )
            self._pending_probe, self._next_probe = full, time.monotonic() + _REPROBE_S
            why = f"{probe.why}; probed again at a later write"
            self.direct_io = DirectIOStatus(False, mode, why)
            log.info("direct I/O is off under %s for now: %s", self.root, why)
            return self.direct_io
        if not probe.ok and mode == "on":
            raise ConfigError(
                f"direct_io='on': {self.url} cannot do direct I/O: {probe.why}. Put the store "
                "on a filesystem that supports O_DIRECT (ext4, xfs, btrfs on a disk), or use "
                "direct_io='auto' (buffered where unsupported) or 'off'"
            )
        self.direct_io = DirectIOStatus(probe.ok, mode, probe.why)
        return self.direct_io

    def recheck_direct_io(self) -> None:
        """A probe that could not run when the store opened (no room, no permission) is
        run again, at most once per second, until it gives an answer that holds: a disk
        full at open does not keep a store buffered for life (NOTE [ Direct I/O ]
        rule 2). Cheap when there is nothing to do (one attribute read)."""
        if self._pending_probe is None or time.monotonic() < self._next_probe:
            return
        with self._probe_lock:
            path = self._pending_probe
            if path is None or time.monotonic() < self._next_probe:
                return
            probe = _probe_cached(self.root, path)
            mode = self.direct_io.mode if self.direct_io is not None else "auto"
            if not probe.ok and probe.transient_errno is not None:
                self._next_probe = time.monotonic() + _REPROBE_S
                return
            self._pending_probe = None
            self.direct_io = DirectIOStatus(probe.ok, mode, probe.why)
        log.info("direct I/O under %s, probed again: %s", self.root, self.direct_io.describe())

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

    def read(self, path: str) -> bytes:
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

    def open_append(self, path: str) -> BinaryIO:
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
    mv = as_memoryview(part).cast("B")
    n = len(mv)
    while mv:
        mv = mv[os.write(fd, mv) :]
    return n


def _fsync_directory(directory: str) -> None:
    """Make a rename in ``directory`` durable (NOTE [ Atomic documents ] rule 1)."""
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(directory, flags)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise  # some filesystems cannot sync a directory: the rename stands anyway
    finally:
        os.close(fd)


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
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_REPROBE_S = 1.0
"""How often a probe that could not run (no room, no permission) may run again."""
_RAM_FILESYSTEMS = {0x01021994: "tmpfs", 0x858458F6: "ramfs"}  # statfs(2) f_type magics
_probed: dict[str, _Probe] = {}
_probed_lock = threading.Lock()


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
    probe = _probe(directory, probe_name)
    return probe.ok, probe.why


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


class _Probe(NamedTuple):
    """What a direct-I/O probe found."""

    ok: bool
    why: str
    """Why not (empty when ``ok``)."""
    transient_errno: int | None
    """The OS error that kept the probe from running (no room for its file, no
    permission), which may go away; ``None`` when the answer holds for good."""


def _probe(directory: str, probe_name: str | None) -> _Probe:
    """:func:`probe_direct_io`, and whether the answer holds for good (a filesystem
    that refuses O_DIRECT) or may change (no room for the probe file, no permission)."""
    if not _O_DIRECT:
        return _Probe(False, "this platform has no O_DIRECT", None)
    ram = _ram_filesystem(directory)
    if ram is not None:
        return _Probe(False, f"the root is on {ram}, whose files live in RAM", None)
    name = probe_name or f".tsh-direct-probe-{os.getpid()}-{secrets.token_hex(4)}"
    path = os.path.join(directory, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | _O_DIRECT, 0o600)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return _Probe(False, "the filesystem refuses O_DIRECT", None)
        return _Probe(False, f"cannot create a probe file ({e.strerror})", e.errno or errno.EIO)
    try:
        out, back = AlignedBuffer(BLOCK_BYTES), AlignedBuffer(BLOCK_BYTES)
        out.view[:] = (b"tsh-direct-probe" * (BLOCK_BYTES // 16))[:BLOCK_BYTES]
        try:
            os.pwrite(fd, out.view, 0)
            got = os.preadv(fd, [back.view], 0)
        except OSError as e:
            why = f"O_DIRECT I/O of {BLOCK_BYTES}-byte blocks fails ({e.strerror})"
            if e.errno in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
                return _Probe(False, why, None)
            return _Probe(False, why, e.errno or errno.EIO)
        if got != BLOCK_BYTES or back.view != out.view:
            return _Probe(False, "O_DIRECT reads did not return what was written", None)
        return _Probe(True, "", None)
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)


def _probe_cached(root: str, probe_file: str) -> _Probe:
    """:func:`probe_direct_io` (with ``probe_file``) once per root directory in this
    process; an answer that may change (``transient_errno``) is asked again next time."""
    key = os.path.realpath(root)
    with _probed_lock:
        hit = _probed.get(key)
        if hit is not None:
            return hit
        probe = _probe(os.path.dirname(probe_file), os.path.basename(probe_file))
        if probe.transient_errno is None:
            _probed[key] = probe
    if not probe.ok and probe.transient_errno is None:  # said once per root and process
        log.info(
            "direct I/O is off under %s: %s; chunk files go through the page cache", key, probe.why
        )
    return probe
