"""Device staging: pooled pinned host buffers and CUDA copy streams.

NOTE [ Stream ordering ]
Device-to-host: the producing stream is captured *before* entering the copy stream's
context (inside it, ``current_stream()`` is the copy stream itself and waiting on it
orders nothing), an event recorded on the producer is waited on by the copy stream,
the copy goes into a pooled pinned buffer with ``non_blocking=True``, and a second
event marks completion. The source tensor stays referenced until that event is done,
so the caching allocator cannot hand its memory to another kernel mid-copy.
Host-to-device is the mirror image: the copy runs on a dedicated stream from a pinned
buffer, and the consuming stream waits on its completion event before using the
tensor (``record_stream`` tells the allocator the consumer uses it).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from ._codec import span_of

__all__ = ["PinnedPool", "StreamSet"]


class PinnedPool:
    """Reusable pinned host buffers in power-of-two size classes.

    ``take(n)`` returns a uint8 tensor of at least ``n`` bytes, allocated with
    ``pin_memory=True`` only when no free buffer of that class exists; ``give``
    returns it. Idle buffers are kept up to ``cap_bytes`` in total, so a training
    loop pays for ``cudaHostAlloc`` in its first step only. Thread-safe.
    ``on_allocate`` is told of each new buffer (the session's counter).
    """

    def __init__(self, cap_bytes: int, on_allocate: Callable[[], None] | None = None) -> None:
        self.cap_bytes = cap_bytes
        self._on_allocate = on_allocate
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._idle_bytes = 0
        self._lock = threading.Lock()
        self.allocations = 0

    @staticmethod
    def _class(n: int) -> int:
        return 1 << max(n - 1, 4095).bit_length()

    def take(self, n: int) -> torch.Tensor:
        size = self._class(n)
        with self._lock:
            bucket = self._free[size]
            if bucket:
                self._idle_bytes -= size
                return bucket.pop()
            self.allocations += 1
        if self._on_allocate is not None:
            self._on_allocate()
        return torch.empty(size, dtype=torch.uint8, pin_memory=True)

    def give(self, buf: torch.Tensor) -> None:
        size = buf.numel()
        with self._lock:
            if self._idle_bytes + size <= self.cap_bytes:
                self._free[size].append(buf)
                self._idle_bytes += size

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._idle_bytes = 0


class StreamSet:
    """One device-to-host and one host-to-device stream per CUDA device, made lazily."""

    def __init__(self) -> None:
        self._d2h: dict[int, Any] = {}
        self._h2d: dict[int, Any] = {}
        self._lock = threading.Lock()

    def _get(self, table: dict[int, Any], device: torch.device) -> Any:
        index = device.index if device.index is not None else torch.cuda.current_device()
        with self._lock:
            stream = table.get(index)
            if stream is None:
                stream = table[index] = torch.cuda.Stream(device=index)
            return stream

    def d2h(self, device: torch.device) -> Any:
        return self._get(self._d2h, device)

    def h2d(self, device: torch.device) -> Any:
        return self._get(self._h2d, device)


def copy_to_host(
    t: torch.Tensor, pool: PinnedPool, streams: StreamSet
) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """Start an async copy of CUDA tensor ``t`` into a pooled pinned buffer.

    Returns ``(host_view, pinned_buffer, done_event)``. ``host_view`` has ``t``'s
    dtype, shape and strides over the pinned buffer; it is valid once ``done_event``
    has completed. The caller keeps ``t`` alive until then and gives the buffer back
    to ``pool`` when finished with it. See NOTE [ Stream ordering ].
    """
    producer = torch.cuda.current_stream(t.device)  # captured before switching streams
    ready = torch.cuda.Event()
    ready.record(producer)
    copy_stream = streams.d2h(t.device)
    span = span_of(tuple(t.shape), tuple(t.stride()))
    span_bytes = span * t.element_size()
    buf = pool.take(max(span_bytes, 1))
    with torch.cuda.stream(copy_stream):
        copy_stream.wait_event(ready)
        # Copy the storage span the view covers, then rebuild the same view on host
        # (storage offset 0 there; the caller restores the original offset on unpack).
        src = t.detach().as_strided((span,), (1,), t.storage_offset())
        dst = buf[:span_bytes].view(t.dtype)
        dst.copy_(src, non_blocking=True)
        done = torch.cuda.Event()
        done.record(copy_stream)
    host_view = dst.as_strided(t.shape, t.stride(), 0)
    return host_view, buf, done


def copy_to_device(
    host: torch.Tensor, device: torch.device, offset: int, pool: PinnedPool, streams: StreamSet
) -> tuple[torch.Tensor, Any, torch.Tensor]:
    """Start an async copy of CPU tensor ``host`` onto ``device`` through a pinned buffer.

    Returns ``(device_tensor, done_event, pinned_buffer)`` with ``host``'s shape and
    strides and storage offset ``offset``. The consumer must wait for ``done`` before
    use (see :func:`consume`); the buffer goes back to ``pool`` once ``done`` has
    completed.
    """
    span = span_of(tuple(host.shape), tuple(host.stride()))
    flat = host.as_strided((span,), (1,), host.storage_offset())
    buf = pool.take(max(span * host.element_size(), 1))
    staged = buf[: span * host.element_size()].view(host.dtype)
    staged.copy_(flat)
    stream = streams.h2d(device)
    with torch.cuda.stream(stream):
        base = torch.empty(offset + span, dtype=host.dtype, device=device)
        base[offset:].copy_(staged, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    out = base.as_strided(host.shape, host.stride(), offset)
    return out, done, buf


def consume(t: torch.Tensor, done: Any) -> torch.Tensor:
    """Order the current stream after ``done`` and tell the allocator it uses ``t``."""
    stream = torch.cuda.current_stream(t.device)
    stream.wait_event(done)
    t.record_stream(stream)
    return t
