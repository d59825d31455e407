"""The device stager: CUDA tensors to pinned host memory at pack, and back at unpack.

Pack starts an asynchronous device-to-host copy into a pooled pinned buffer
(:func:`~tensorstore_hooks._staging.copy_to_host`, NOTE [ Stream ordering ]) and
keeps the device tensor only until that copy's event has completed: then the GPU
memory is free, long before the store write ends. Unpack copies back through a pinned
buffer on a dedicated stream, and the consuming stream waits on the copy's event.
CPU tensors never come here.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from ._records import Record, RecordTable, State
from ._staging import PinnedPool, StreamSet, consume, copy_to_device, copy_to_host

__all__ = ["DeviceStager", "HostCopy"]


class HostCopy:
    """A record's pinned host copy: ``host`` is the view, ``buf`` the pooled buffer."""

    __slots__ = ("buf", "event", "host")

    def __init__(self, host: torch.Tensor, buf: torch.Tensor, event: Any) -> None:
        self.host = host
        self.buf = buf
        self.event: Any = event  # the copy's CUDA event; None once it has completed


class DeviceStager:
    """Pinned buffers (``cap_bytes`` kept idle at most) and copy streams, made on first use."""

    def __init__(
        self, table: RecordTable, cap_bytes: int, on_allocate: Callable[[], None] | None = None
    ) -> None:
        self._table = table
        self._cap_bytes = cap_bytes
        self._on_allocate = on_allocate  # told of each pinned buffer allocated
        self.pinned: PinnedPool | None = None
        self._streams: StreamSet | None = None
        self._pending: deque[Record] = deque()

    def _tools(self) -> tuple[PinnedPool, StreamSet]:
        if self.pinned is None or self._streams is None:
            self.pinned = PinnedPool(cap_bytes=self._cap_bytes, on_allocate=self._on_allocate)
            self._streams = StreamSet()
        return self.pinned, self._streams

    # ----------------------------------------------------------------- pack
    def stage(self, rec: Record, t: torch.Tensor) -> None:
        """Start copying CUDA tensor ``t`` of ``rec`` to host (call without the lock)."""
        pool, streams = self._tools()
        host, buf, event = copy_to_host(t, pool, streams)
        rec.staged = HostCopy(host, buf, event)
        with self._table.lock:
            self._pending.append(rec)
            self._reap()

    def _reap(self) -> None:
        """Drop device tensors whose copy to host has finished (frees GPU memory early)."""
        pending = self._pending
        while pending:
            staged = pending[0].staged
            if staged is not None and staged.event is not None and not staged.event.query():
                break
            self.copied(pending.popleft())

    def copied(self, rec: Record) -> None:
        """``rec``'s copy to host has completed: check its version, drop the device tensor.

        Lock held. A tensor modified in place before the copy ran makes the record DIRTY
        (NOTE [ In-place checks ]).
        """
        src = rec.source
        if (
            src is not None
            and src.device.type == "cuda"
            and rec.state in (State.QUEUED, State.WRITING)
        ):
            if rec.modified():
                rec.move(State.DIRTY)
            rec.drop_source()
        if rec.staged is not None:
            rec.staged.event = None

    def release(self, rec: Record) -> None:
        """Give ``rec``'s pinned buffer back to the pool (lock held)."""
        staged, rec.staged = rec.staged, None
        if staged is not None and self.pinned is not None:
            self.pinned.give(staged.buf)

    # --------------------------------------------------------------- unpack
    def to_device(self, t: torch.Tensor, device: torch.device, offset: int) -> Any:
        """Copy host tensor ``t`` onto CUDA ``device``; returns what :meth:`finish` takes."""
        pool, streams = self._tools()
        dev, done, buf = copy_to_device(t, device, offset, pool, streams)
        done.synchronize()  # the pinned buffer is reusable once the copy is done
        pool.give(buf)
        return (dev, done)

    @staticmethod
    def finish(out: Any) -> torch.Tensor:
        """The tensor unpack returns: a staged CUDA copy is ordered on the current stream."""
        if isinstance(out, tuple):  # CUDA: (tensor, done event)
            t, done = out
            return consume(t, done)
        return out

    def clear(self) -> None:
        """Drop the idle pinned buffers (the session is closed)."""
        if self.pinned is not None:
            self.pinned.clear()
