"""One writer per captured array: the locks a capture holds while it runs.

NOTE [ One writer per array ]
Two captures appending to one array would each believe they own the rows from the
end on, and write each other's chunk objects over: rows of both are lost, and both
report every row written. So:

1. A capture holds one lock per (group, module, kind) it may write,
   ``ROOT/.capture-locks/[rank{R}/]MODULE/KIND.lock``, from
   :func:`~tensorstore_hooks.capture` until it ends (``remove()``, the ``with``
   block's exit, or its collection). Every array of that kind (``output``,
   ``output.0``, ``output@17x512_float32``, ``output~tokens``) lies under it. The
   locks live beside ``capture/``, not in it: a capture that captured nothing leaves
   ``capture/`` as it was, and zarr never lists them.
2. On a local root a lock is a ``flock`` on that file: it belongs to the open file, so
   two captures in one process exclude each other as two processes do, and the kernel
   drops it when its process dies (no stale lock after a crash). The file names the
   holder: where ``tsh.capture`` was called, the pid, the host and the time.
3. Object stores and memory roots have no locks: a table in the process holds them, so
   captures in one process still exclude each other. Processes that write one object
   store prefix at once must write distinct groups: under ``torch.distributed`` (or
   with ``RANK`` set) each rank writes ``capture/rank{R}/``, so ranks never contend.
4. A capture that finds a lock held is refused at once, before it hooks anything, with
   a :class:`~tensorstore_hooks.StoreUnavailableError` naming the holder and the ways out.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable

from tensorstore_hooks._warn import internal_prefixes
from tensorstore_hooks.errors import StoreUnavailableError
from tensorstore_hooks.storage.io import ChunkIO, LocalIO

__all__ = ["LOCK_DIR", "ArrayLocks", "lock_path"]

LOCK_DIR = ".capture-locks"
"""The folder under the store root that holds the capture locks (rule 1)."""

_table: dict[tuple[str, str], str] = {}  # rule 3: (root, lock path) -> holder
_table_lock = threading.Lock()


def lock_path(group: str, module: str, kind: str) -> str:
    """The lock of ``kind`` arrays of ``module`` in ``group`` (``capture`` or
    ``capture/rank{R}``): rule 1."""
    rank = group.partition("/")[2]
    return "/".join(p for p in (LOCK_DIR, rank, module, f"{kind}.lock") if p)


def _root_key(io: ChunkIO) -> str:
    return f"memory@{id(io):x}" if io.is_private_memory else io.url


def _call_site() -> str:
    """``file:line`` of the first frame outside this library, torch and frameworks."""
    prefixes = internal_prefixes()
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not (name.startswith(prefixes) or name.startswith("<frozen ")):
            return f"{name}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return "?"


class ArrayLocks:
    """The locks of one capture (rule 1). Not thread-safe: the capture takes them once
    and releases them once."""

    def __init__(self, io: ChunkIO) -> None:
        self._io = io
        self._releases: list[Callable[[], None]] = []
        self.holder = (
            f"tsh.capture called at {_call_site()} (pid {os.getpid()} on "
            f"{socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')})"
        )
        """Who holds them, as a second capture is told."""

    def take(self, paths: Iterable[str]) -> None:
        """Take every lock of ``paths``, or none: raises :class:`StoreUnavailableError`
        naming the first one held elsewhere (rule 4)."""
        try:
            for path in paths:
                self._releases.append(self._take(path))
        except BaseException:
            self.release()
            raise

    def _take(self, path: str) -> Callable[[], None]:
        io = self._io
        if isinstance(io, LocalIO):
            try:
                release = io.lock(path)
            except BlockingIOError as e:
                raise self._refused(path, str(e.strerror).removeprefix("held by ")) from None
            if release is not None:
                with contextlib.suppress(OSError):
                    self._describe(os.path.join(io.root, path))
                return release
        key = (_root_key(io), path)
        with _table_lock:
            held = _table.get(key)
            if held is not None:
                raise self._refused(path, held)
            _table[key] = self.holder

        def release_entry() -> None:
            with _table_lock:
                if _table.get(key) == self.holder:
                    del _table[key]

        return release_entry

    def _describe(self, full: str) -> None:
        """Write the holder into the lock file (what a refused capture reads)."""
        fd = os.open(full, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, self.holder.encode(), 0)
        finally:
            os.close(fd)

    def _refused(self, path: str, holder: str) -> StoreUnavailableError:
        folder, _, name = path.rpartition("/")
        kind = name.removesuffix(".lock")
        where = "capture/" + folder.removeprefix(LOCK_DIR).lstrip("/")
        return StoreUnavailableError(
            f"capture: the {kind} arrays of {where} under {self._io.url} are being written "
            f"by another capture: {holder}. Two writers would write each other's chunks over "
            "and mix their rows. End that capture first (leave its with block, or call "
            "cap.remove()), capture into another root, or give each writer its own group "
            "(under torch.distributed, or with RANK set, each rank writes capture/rank{R}/)"
        )

    def release(self) -> None:
        """Release every lock taken (idempotent)."""
        while self._releases:
            with contextlib.suppress(Exception):
                self._releases.pop()()
