"""What a capture has in flight: its I/O threads' tasks and its host buffers.

:class:`Inflight` owns the capture's :class:`~tensorstore_hooks.pipeline._iopool.IOPool`, counts
the tasks submitted to it (``flush`` waits for none to be left), and hands out chunk
buffers from two :class:`~tensorstore_hooks.pipeline._staging.PinnedPool`\\ s (pinned ones for
accelerator tensors, page-aligned pageable ones for CPU tensors) within ``max_inflight`` bytes
(rule 2 of NOTE [ Capture writes ] in ``capture/_writer.py``), and bounds the device bytes
its copies to host still read (:class:`CopyWindow`).

NOTE [ Capture copy window ]
A hook's private device copy of its rows (rule 1 of NOTE [ Capture writes ]) must stay
alive until its copy to host has read it; copies may lag the kernels ~16x, and the
settle tasks that used to drop them queue behind chunk writes on the I/O threads. So,
as the pipeline's NOTE [ Copy window ] (``pipeline/_device.py``) does, per device:

1. Every copy to host a hook starts is counted, with its device bytes, until it is
   seen complete: each hook drops the tensors of the copies whose events completed
   (a query, on the hook's thread; hooks never run inside a graph capture, rule 10
   of NOTE [ Stream ordering ]).
2. Beyond the window (``copy_window``, default ``max_inflight``) the oldest copies are
   waited for by the device's current stream (``wait_current``: on the device, never
   a host block on the training thread) and their tensors dropped at once: the
   kernels that would reuse that memory are queued later on that stream, so they run
   after the copy has read it. The newest copy always runs, even alone over it.
3. The chunk buffer's own settle (before its write) waits for the events, not the
   tensors: dropping a tensor never lets a buffer be written before its bytes landed.
4. A hook that finds a CUDA graph being captured, on its tensor's device or on the
   current device (:func:`capture_stream`), refuses (rule 10 of NOTE [ Stream
   ordering ]) and says so here (:meth:`Inflight.note_capture`): until that capture has
   ended, no task starts on the I/O threads, so no settle waits on an event meanwhile
   (CUDA's global capture mode forbids it on every thread: it would invalidate the
   user's graph).
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

import torch

if sys.version_info >= (3, 11):
    from typing import TypeVarTuple, Unpack
else:  # pragma: no cover - Python 3.10
    from typing_extensions import TypeVarTuple, Unpack

from tensorstore_hooks.pipeline import WRITE, CopyEvent, DeviceOps, IOPool, PinnedPool
from tensorstore_hooks.storage.io import aligned_empty

__all__ = ["CopyWindow", "Inflight", "capture_stream"]

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
        self.copies = CopyWindow(max_inflight)
        """Device bytes of copies to host still running (NOTE [ Capture copy window ])."""
        self._captures: dict[object, Callable[[object], bool]] = {}  # stream -> still capturing?
        self.capture_waits = 0
        """Tasks that waited for a graph capture to end before they ran (rule 4)."""

    # ------------------------------------------------------------------ tasks
    def submit(self, fn: Callable[[Unpack[Ts]], object], *args: Unpack[Ts]) -> None:
        """Run ``fn(*args)`` on an I/O thread (counted until it has finished)."""
        with self._cond:
            self._tasks += 1
        try:
            fut: Future[object] = self.pool.submit(WRITE, self._after_capture, fn, args)
        except BaseException:
            self._done()
            raise
        fut.add_done_callback(self._done)

    def note_capture(self, stream: object, still: Callable[[object], bool]) -> None:
        """A hook saw ``stream`` capturing a graph; ``still(stream)`` says whether it
        still is (legal to ask during a capture): tasks wait until it is not (rule 4)."""
        with self._cond:
            self._captures[stream] = still

    def _after_capture(
        self, fn: Callable[[Unpack[Ts]], object], args: tuple[Unpack[Ts]]
    ) -> object:
        """Run ``fn(*args)`` once no capture a hook saw is running (rule 4)."""
        waited = False
        while self._captures:  # the common case: one read
            with self._cond:
                self._captures = {s: f for s, f in self._captures.items() if f(s)}
                if not self._captures:
                    break
                if not waited:
                    waited = True
                    self.capture_waits += 1
            time.sleep(0.001)
        return fn(*args)

    def _done(self, _fut: object = None) -> None:
        with self._cond:
            self._tasks -= 1
            self._cond.notify_all()

    def wait_idle(self) -> None:
        """Block until every task submitted so far (and those they submit) has finished."""
        with self._cond:
            while self._tasks:
                self._cond.wait()
        self.copies.reap()  # the settles ran: their copies completed

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
        self.copies.reap()
        self._pinned.clear()
        self._pageable.clear()


class CopyWindow:
    """Copies to host still reading device memory, per device, within ``window`` bytes
    (NOTE [ Capture copy window ]). Thread-safe."""

    def __init__(self, window: int) -> None:
        self.window = window
        """Device bytes whose copy to host may still run, per device (rule 2)."""
        self._copying: dict[torch.device, deque[tuple[torch.Tensor, CopyEvent]]] = {}
        self._bytes: dict[torch.device, int] = {}
        self._lock = threading.Lock()
        self.peak_bytes = 0
        """The most device bytes counted on one device at once (after the bound)."""
        self.waits = 0
        """Copies the bound had a current stream wait for (rule 2)."""

    def held_bytes(self, device: torch.device) -> int:
        """Device bytes on ``device`` whose copy to host is not yet seen complete."""
        with self._lock:
            return self._bytes.get(device, 0)

    def add(self, t: torch.Tensor, event: CopyEvent, ops: DeviceOps) -> None:
        """``t`` is being copied to host until ``event``: count it, drop the tensors of
        completed copies (rule 1) and bound the rest (rule 2), on the hook's thread."""
        device = t.device
        self.reap()
        waits: list[CopyEvent] = []
        with self._lock:
            queue = self._copying.setdefault(device, deque())
            queue.append((t, event))
            held = self._bytes.get(device, 0) + _nbytes(t)
            while len(queue) > 1 and held > self.window:
                old, old_event = queue.popleft()
                held -= _nbytes(old)
                waits.append(old_event)
            self._bytes[device] = held
            self.peak_bytes = max(self.peak_bytes, held)
            self.waits += len(waits)
        for old_event in waits:  # later kernels on the device run after these copies
            ops.wait_current(device, old_event)

    def reap(self) -> None:
        """Drop the tensors of copies whose events completed, oldest first per device."""
        with self._lock:
            for device, queue in self._copying.items():
                while queue and queue[0][1].query():
                    old, _ = queue.popleft()
                    self._bytes[device] -= _nbytes(old)


def capture_stream(ops: DeviceOps, device: torch.device) -> object | None:
    """The stream capturing a CUDA graph that a hook on ``device`` must respect (rule 4):
    ``device``'s current stream, or the current device's (CUDA's global capture mode
    forbids event queries whatever the device); ``None``: none captures."""
    if ops.capturing(device):
        return ops.capture_stream(device)
    if device.index is not None:
        current = torch.device(device.type)  # no index: the current device
        if ops.capturing(current):
            return ops.capture_stream(current)
    return None


def _nbytes(t: torch.Tensor) -> int:
    """Device bytes a hook's rows hold (a contiguous range of its private copy)."""
    return t.numel() * t.element_size()


def _pageable(nbytes: int) -> torch.Tensor:
    """A host buffer for CPU tensors' rows, page-aligned so that a chunk can be written
    from it with ``O_DIRECT`` (rule 2 of NOTE [ Capture writes ])."""
    return torch.from_numpy(aligned_empty(nbytes))
