"""Staging: moving tensors between an accelerator and host memory (pinned buffers, streams).

"Staging" means only that here (see the glossary in ``docs/life-of-a-saved-tensor.md``).
:class:`DeviceOps` is the seam the device stager (``_device.py``) drives; :class:`CudaOps`
is its CUDA implementation.

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
from typing import Protocol, TypeAlias, cast

import torch

from ._codec import span_of

__all__ = [
    "CopyEvent",
    "CudaOps",
    "DeviceOps",
    "Loaded",
    "PinnedPool",
    "StreamSet",
    "pinned_buffer",
    "span_bytes",
]


class CopyEvent(Protocol):
    """A copy between host and device in progress (``torch.cuda.Event`` is one)."""

    def query(self) -> bool:
        """Whether the copy has completed (never blocks)."""
        ...

    def synchronize(self) -> None:
        """Block until the copy has completed."""
        ...


Loaded: TypeAlias = tuple[torch.Tensor, CopyEvent | None]
"""A tensor read back, and the event its copy to the device completes on (``None``:
ready now). :meth:`DeviceOps.finish` orders the consumer after the event."""


class DeviceOps(Protocol):
    """Every device-specific step the device stager takes: the seam CPU tests replace.

    :class:`CudaOps` is the real one; ``tests/fake_accelerator.py`` treats CPU tensors
    as accelerator tensors through the same five methods. Events returned may be
    ``None`` (the copy has completed already).
    """

    def accelerated(self, device: torch.device) -> bool:
        """Whether tensors on ``device`` are staged through host memory."""
        ...

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A new (pinned) host buffer of ``nbytes`` bytes."""
        ...

    def to_host(self, t: torch.Tensor, buf: torch.Tensor) -> Loaded:
        """Start copying ``t`` into ``buf``: ``(host_view, event)``."""
        ...

    def to_device(self, host: torch.Tensor, device: torch.device, offset: int) -> Loaded:
        """Start copying ``host`` onto ``device`` at storage ``offset``: ``(tensor, event)``."""
        ...

    def finish(self, t: torch.Tensor, done: CopyEvent) -> torch.Tensor:
        """The tensor unpack returns, ordered after ``done`` on the current stream."""
        ...


def pinned_buffer(nbytes: int) -> torch.Tensor:
    """A new page-locked host buffer of ``nbytes`` bytes (``cudaHostAlloc``, ~ms)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


class PinnedPool:
    """Reusable pinned host buffers in power-of-two size classes.

    ``take(n)`` returns a uint8 tensor of at least ``n`` bytes, allocated (by
    ``allocate``, default :func:`pinned_buffer`) only when no free buffer of that class
    exists; ``give`` returns it. Idle buffers are kept up to ``cap_bytes`` in total, so
    a training loop pays for ``cudaHostAlloc`` in its first step only. Thread-safe.
    Used when no ``host_budget`` is set; with one,
    :class:`~tensorstore_hooks._host_tier.HostTier` hands out every pinned buffer.
    """

    def __init__(
        self,
        cap_bytes: int,
        allocate: Callable[[int], torch.Tensor] = pinned_buffer,
    ) -> None:
        self.cap_bytes = cap_bytes
        self._allocate = allocate
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
        return self._allocate(size)

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
        self._d2h: dict[int, torch.cuda.Stream] = {}
        self._h2d: dict[int, torch.cuda.Stream] = {}
        self._lock = threading.Lock()

    def _get(self, table: dict[int, torch.cuda.Stream], device: torch.device) -> torch.cuda.Stream:
        index = device.index if device.index is not None else torch.cuda.current_device()
        with self._lock:
            stream = table.get(index)
            if stream is None:
                stream = table[index] = torch.cuda.Stream(device=index)
            return stream

    def d2h(self, device: torch.device) -> torch.cuda.Stream:
        return self._get(self._d2h, device)

    def h2d(self, device: torch.device) -> torch.cuda.Stream:
        return self._get(self._h2d, device)


def span_bytes(t: torch.Tensor) -> int:
    """Bytes of the storage span view ``t`` covers (what a host copy of it needs, >= 1)."""
    return max(span_of(tuple(t.shape), tuple(t.stride())) * t.element_size(), 1)


def copy_to_host(t: torch.Tensor, buf: torch.Tensor, streams: StreamSet) -> Loaded:
    """Start an async copy of CUDA tensor ``t`` into pinned buffer ``buf``.

    ``buf`` holds at least :func:`span_bytes` of ``t``. Returns ``(host_view,
    done_event)``: ``host_view`` has ``t``'s dtype, shape and strides over ``buf`` and
    is valid once ``done_event`` has completed. The caller keeps ``t`` alive until
    then. See NOTE [ Stream ordering ].
    """
    producer = torch.cuda.current_stream(t.device)  # captured before switching streams
    ready = torch.cuda.Event()
    ready.record(producer)
    copy_stream = streams.d2h(t.device)
    span = span_of(tuple(t.shape), tuple(t.stride()))
    with torch.cuda.stream(copy_stream):
        copy_stream.wait_event(ready)
        # Copy the storage span the view covers, then rebuild the same view on host
        # (storage offset 0 there; the caller restores the original offset on unpack).
        src = t.detach().as_strided((span,), (1,), t.storage_offset())
        dst = buf[: span * t.element_size()].view(t.dtype)
        dst.copy_(src, non_blocking=True)
        done = torch.cuda.Event()
        done.record(copy_stream)
    host_view = dst.as_strided(t.shape, t.stride(), 0)
    return host_view, done


def copy_to_device(
    host: torch.Tensor, device: torch.device, offset: int, streams: StreamSet
) -> Loaded:
    """Start a copy of CPU tensor ``host`` onto ``device`` on the host-to-device stream.

    Returns ``(device_tensor, done_event)`` with ``host``'s shape and strides and
    storage offset ``offset``. From pinned memory the copy is asynchronous; from
    pageable memory torch copies synchronously. Either way the consumer waits for
    ``done`` before use (see :func:`consume`), and ``host`` must stay untouched until
    ``done`` has completed.
    """
    span = span_of(tuple(host.shape), tuple(host.stride()))
    flat = host.as_strided((span,), (1,), host.storage_offset())
    stream = streams.h2d(device)
    with torch.cuda.stream(stream):
        base = torch.empty(offset + span, dtype=host.dtype, device=device)
        base[offset:].copy_(flat, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    out = base.as_strided(host.shape, host.stride(), offset)
    return out, done


class CudaOps:
    """:class:`DeviceOps` for CUDA devices: what the device stager does with one."""

    def __init__(self) -> None:
        self.streams = StreamSet()

    @staticmethod
    def accelerated(device: torch.device) -> bool:
        """Whether tensors on ``device`` are staged through host memory."""
        return device.type == "cuda"

    @staticmethod
    def allocate(nbytes: int) -> torch.Tensor:
        """A new pinned host buffer of ``nbytes`` bytes."""
        return pinned_buffer(nbytes)

    def to_host(self, t: torch.Tensor, buf: torch.Tensor) -> Loaded:
        """Start copying ``t`` into ``buf``: ``(host_view, event)``; :func:`copy_to_host`."""
        return copy_to_host(t, buf, self.streams)

    def to_device(self, host: torch.Tensor, device: torch.device, offset: int) -> Loaded:
        """Start copying ``host`` onto ``device``: ``(tensor, event)``; :func:`copy_to_device`."""
        return copy_to_device(host, device, offset, self.streams)

    @staticmethod
    def finish(t: torch.Tensor, done: CopyEvent) -> torch.Tensor:
        """The tensor unpack returns, ordered after ``done`` on the current stream."""
        return consume(t, cast(torch.cuda.Event, done))  # CudaOps' own events


def consume(t: torch.Tensor, done: torch.cuda.Event) -> torch.Tensor:
    """Order the current stream after ``done`` and tell the allocator it uses ``t``."""
    stream = torch.cuda.current_stream(t.device)
    stream.wait_event(done)
    t.record_stream(stream)
    return t
