"""What a capture has in flight: its I/O threads' tasks and its host buffers.

:class:`Inflight` owns the capture's :class:`~tensorstore_hooks.pipeline._iopool.IOPool`, counts
the tasks submitted to it (``flush`` waits for none to be left), and hands out chunk
buffers from two :class:`~tensorstore_hooks.pipeline._staging.PinnedPool`\\ s (pinned ones for
accelerator tensors, page-aligned pageable ones for CPU tensors) within ``max_inflight`` bytes
(rule 2 of NOTE [ Capture writes ] in ``capture/_writer.py``).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import torch

if sys.version_info >= (3, 11):
    from typing import TypeVarTuple, Unpack
else:  # pragma: no cover - Python 3.10
    from typing_extensions import TypeVarTuple, Unpack

from tensorstore_hooks.pipeline import WRITE, IOPool, PinnedPool
from tensorstore_hooks.storage.io import aligned_empty

__all__ = ["Inflight"]

Ts = TypeVarTuple("Ts")


class Inflight:
    """Tasks on ``threads`` I/O threads and host buffers within ``max_inflight`` bytes.

    ``allocate_pinned(n)``: a new pinned buffer (the device seam's). Thread-safe.
    """

    def __init__(
        self, max_inflight: int, threads: int, allocate_pinned: Callable[[int], torch.Tensor]
    ) -> None:
        self.max_inflight = max_inflight
        self.pool = IOPool(threads, name="tsh-capture")
        self._pinned = PinnedPool(max_inflight, allocate=allocate_pinned)
        self._pageable = PinnedPool(max_inflight, allocate=_pageable)
        self._cond = threading.Condition()
        self._held = 0  # bytes of buffers in use
        self._tasks = 0  # tasks submitted and not finished
        self.peak_bytes = 0
        """The most buffer bytes in use at once."""

    # ------------------------------------------------------------------ tasks
    def submit(self, fn: Callable[[Unpack[Ts]], object], *args: Unpack[Ts]) -> None:
        """Run ``fn(*args)`` on an I/O thread (counted until it has finished)."""
        with self._cond:
            self._tasks += 1
        try:
            fut: Future[object] = self.pool.submit(WRITE, fn, *args)
        except BaseException:
            self._done()
            raise
        fut.add_done_callback(self._done)

    def _done(self, _fut: object = None) -> None:
        with self._cond:
            self._tasks -= 1
            self._cond.notify_all()

    def wait_idle(self) -> None:
        """Block until every task submitted so far (and those they submit) has finished."""
        with self._cond:
            while self._tasks:
                self._cond.wait()

    # ------------------------------------------------------------------ buffers
    def take(
        self, nbytes: int, pinned: bool, spill: Callable[[], bool]
    ) -> tuple[torch.Tensor, float]:
        """A buffer of at least ``nbytes`` once there is room; returns it and the seconds
        waited. While tasks run, their end may give room back; when none runs,
        ``spill()`` is asked to start one that will (``False``: it could not), and with
        nothing left to wait for the buffer goes over the bound, alone."""
        size = PinnedPool._class(nbytes)
        t0: float | None = None
        with self._cond:
            while self._held and self._held + size > self.max_inflight:
                if t0 is None:
                    t0 = time.perf_counter()
                if self._tasks:
                    self._cond.wait(0.05)
                    continue
                self._cond.release()
                try:
                    spilled = spill()
                finally:
                    self._cond.acquire()
                if not spilled and not self._tasks:
                    break
            self._held += size
            self.peak_bytes = max(self.peak_bytes, self._held)
        buf = (self._pinned if pinned else self._pageable).take(nbytes)
        return buf, (0.0 if t0 is None else time.perf_counter() - t0)

    def give(self, buf: torch.Tensor, pinned: bool) -> None:
        """Return a buffer from :meth:`take` (kept for reuse within the bound)."""
        (self._pinned if pinned else self._pageable).give(buf)
        with self._cond:
            self._held -= buf.numel()
            self._cond.notify_all()

    def close(self) -> None:
        """Stop the I/O threads (after their queued tasks) and drop idle buffers."""
        self.pool.shutdown()
        self._pinned.clear()
        self._pageable.clear()


def _pageable(nbytes: int) -> torch.Tensor:
    """A host buffer for CPU tensors' rows, page-aligned so that a chunk can be written
    from it with ``O_DIRECT`` (rule 2 of NOTE [ Capture writes ])."""
    return torch.from_numpy(aligned_empty(nbytes))
