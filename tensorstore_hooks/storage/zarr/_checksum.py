"""crc32c for chunk objects, computed while the bytes are written or read.

NOTE [ Overlapped checksums ]
A chunk's crc32c (the value Zarr's ``Crc32cCodec`` appends) costs about as much as
writing or reading the chunk from the page cache (both ~0.5 ms for 8 MiB here), so
done one after the other it adds ~40% to a local put or get. The ``crc32c`` package
releases the GIL, so a :class:`RunningCrc` feeds the pieces to one helper thread while
the caller's thread is in the ``write``/``readinto`` system call: a put writes the
payload while its checksum runs and appends the checksum last; a get checksums piece
``i`` while piece ``i + 1`` is read. One helper thread, first in first out, keeps the
pieces of each checksum in order. Below :data:`OVERLAP_BYTES` the hand-off costs
more than it saves and the checksum runs inline.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import crc32c

from tensorstore_hooks._codec import Buffer, as_memoryview

__all__ = ["OVERLAP_BYTES", "RunningCrc", "crc"]

OVERLAP_BYTES = 4 << 20
"""Chunks at least this large are checksummed on the helper thread."""

READ_PIECE_BYTES = 1 << 20
"""Granularity of a pipelined read: piece ``i`` is checksummed while ``i + 1`` is read."""

_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()
_executor_pid = os.getpid()


def crc(data: Buffer, value: int = 0) -> int:
    """crc32c of ``data`` continuing from ``value``.

    The ``crc32c`` package uses the CPU's crc32 instruction (about 4x faster than
    google-crc32c here) and releases the GIL.
    """
    return int(crc32c.crc32c(as_memoryview(data), value))


def _helper() -> ThreadPoolExecutor:
    global _executor, _executor_lock, _executor_pid
    if _executor_pid != os.getpid():
        # A forked child has the executor object (and maybe a held lock) but not its
        # thread: start over (NOTE [ Fork safety ]; no at-fork handler is registered).
        _executor, _executor_lock, _executor_pid = None, threading.Lock(), os.getpid()
    with _executor_lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tsh-crc")
        return _executor


class RunningCrc:
    """A crc32c fed piece by piece, on the helper thread when ``background``.

    ``feed`` returns at once (background) and the caller must not modify a fed
    buffer until :meth:`value` returns. ``value`` waits for every fed piece and
    re-raises a failure of the helper.
    """

    __slots__ = ("_background", "_error", "_last", "_value")

    def __init__(self, background: bool) -> None:
        self._background = background
        self._value = 0
        self._last: Future[None] | None = None
        self._error: BaseException | None = None

    def feed(self, data: Buffer) -> None:
        if not self._background:
            self._value = crc(data, self._value)
            return
        self._last = _helper().submit(self._update, data)

    def _update(self, data: Buffer) -> None:
        # Runs on the single helper thread, in submission order.
        if self._error is None:
            try:
                self._value = crc(data, self._value)
            except BaseException as e:  # re-raised by value() on the caller's thread
                self._error = e

    def value(self) -> int:
        if self._last is not None:
            self._last.result()
            self._last = None
        if self._error is not None:
            raise self._error
        return self._value

    def trailer(self) -> bytes:
        """The 4 little-endian bytes Zarr's Crc32cCodec appends."""
        return self.value().to_bytes(4, "little")
