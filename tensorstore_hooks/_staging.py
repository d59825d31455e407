"""Staging: moving tensors between an accelerator and host memory (pinned buffers, streams).

"Staging" means only that here (see the glossary in ``docs/life-of-a-saved-tensor.md``).
:class:`DeviceOps` is the seam the device stager (``_device.py``) drives; :class:`CudaOps`
is its implementation, made of the staging functions below (:func:`copy_to_host`,
:func:`copy_to_device`, :func:`consume`, ...). Those functions touch streams, events,
copies and allocators only through a :class:`Runtime`: :class:`TorchCuda` is torch's
CUDA, and ``tests/fake_cuda.py`` is a recording, poisoning stand-in that runs the same
functions on CPU tensors and checks their order.

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
from contextlib import AbstractContextManager
from typing import Protocol, TypeAlias, cast

import torch

from ._codec import span_of

__all__ = [
    "CopyEvent",
    "CudaOps",
    "DeviceOps",
    "Loaded",
    "PinnedPool",
    "Runtime",
    "Stream",
    "StreamSet",
    "TorchCuda",
    "pinned_block_bytes",
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


Stream: TypeAlias = object
"""An accelerator stream: opaque to the staging code, only its :class:`Runtime` uses it."""

Loaded: TypeAlias = tuple[torch.Tensor, CopyEvent | None]
"""A tensor read back, and the event its copy to the device completes on (``None``:
ready now). :meth:`DeviceOps.finish` orders the consumer after the event."""


class Runtime(Protocol):
    """The stream, event, copy and allocation primitives the staging functions use.

    :class:`TorchCuda` maps each to ``torch.cuda``; a test runtime records them.
    Streams are opaque objects; events are :class:`CopyEvent`.
    """

    def accelerated(self, device: torch.device) -> bool:
        """Whether tensors on ``device`` are this runtime's (staged through host memory)."""
        ...

    def capturing(self, device: torch.device) -> bool:
        """Whether the current stream of ``device`` is capturing a graph."""
        ...

    def current_stream(self, device: torch.device) -> Stream:
        """The calling thread's current stream on ``device``."""
        ...

    def new_stream(self, device: torch.device) -> Stream:
        """A new side stream on ``device`` (a copy stream)."""
        ...

    def use_stream(self, stream: Stream) -> AbstractContextManager[object]:
        """A context in which ``stream`` is the current stream (work goes there)."""
        ...

    def new_event(self) -> CopyEvent:
        """A new event, not recorded yet."""
        ...

    def record(self, event: CopyEvent, stream: Stream) -> None:
        """Record ``event`` on ``stream`` (it completes when the work queued so far does)."""
        ...

    def wait(self, stream: Stream, event: CopyEvent) -> None:
        """Make later work on ``stream`` wait for ``event`` (no host blocking)."""
        ...

    def copy(self, dst: torch.Tensor, src: torch.Tensor, *, non_blocking: bool) -> None:
        """``dst.copy_(src, non_blocking=...)`` on the current stream."""
        ...

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A new 1-D device tensor, allocated for the current stream."""
        ...

    def pinned(self, nbytes: int) -> torch.Tensor:
        """A new page-locked host buffer of ``nbytes`` bytes (uint8)."""
        ...

    def pinned_bytes(self, nbytes: int) -> int:
        """Bytes the host allocator really holds for :meth:`pinned` ``(nbytes)``."""
        ...

    def pageable(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A new 1-D tensor in ordinary (pageable) host memory."""
        ...

    def record_stream(self, t: torch.Tensor, stream: Stream) -> None:
        """Tell the device allocator that ``stream`` uses ``t`` (``Tensor.record_stream``)."""
        ...


def pinned_block_bytes(nbytes: int) -> int:
    """Bytes torch's pinned (caching host) allocator takes for a request of ``nbytes``:
    the next power of two (at least 4 KiB, the smallest buffer this library asks for)."""
    return 1 << (max(nbytes, 4096) - 1).bit_length()


def pinned_buffer(nbytes: int) -> torch.Tensor:
    """A new page-locked host buffer of ``nbytes`` bytes (``cudaHostAlloc``, ~ms).

    The one place this library allocates pinned memory: torch's caching host allocator
    rounds each request up to a power of two (:func:`pinned_block_bytes`) and keeps
    freed blocks cached for reuse by a later request of the same size.
    """
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


class TorchCuda:
    """:class:`Runtime` of torch's CUDA (``torch.cuda`` streams, events, allocators)."""

    @staticmethod
    def accelerated(device: torch.device) -> bool:
        return device.type == "cuda"

    @staticmethod
    def capturing(device: torch.device) -> bool:
        return bool(torch.cuda.is_current_stream_capturing())

    @staticmethod
    def current_stream(device: torch.device) -> Stream:
        return torch.cuda.current_stream(device)

    @staticmethod
    def new_stream(device: torch.device) -> Stream:
        return torch.cuda.Stream(device=device)

    @staticmethod
    def use_stream(stream: Stream) -> AbstractContextManager[object]:
        return torch.cuda.stream(cast(torch.cuda.Stream, stream))

    @staticmethod
    def new_event() -> CopyEvent:
        return torch.cuda.Event()

    @staticmethod
    def record(event: CopyEvent, stream: Stream) -> None:
        cast(torch.cuda.Event, event).record(cast(torch.cuda.Stream, stream))

    @staticmethod
    def wait(stream: Stream, event: CopyEvent) -> None:
        cast(torch.cuda.Stream, stream).wait_event(cast(torch.cuda.Event, event))

    @staticmethod
    def copy(dst: torch.Tensor, src: torch.Tensor, *, non_blocking: bool) -> None:
        dst.copy_(src, non_blocking=non_blocking)

    @staticmethod
    def empty(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=device)

    @staticmethod
    def pinned(nbytes: int) -> torch.Tensor:
        return pinned_buffer(nbytes)

    @staticmethod
    def pinned_bytes(nbytes: int) -> int:
        return pinned_block_bytes(nbytes)

    @staticmethod
    def pageable(numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    @staticmethod
    def record_stream(t: torch.Tensor, stream: Stream) -> None:
        t.record_stream(cast(torch.cuda.Stream, stream))


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
        return pinned_block_bytes(n)  # the allocator's own sizes: nothing is wasted twice

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
    """One device-to-host and one host-to-device stream per device, made lazily."""

    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime
        self._d2h: dict[torch.device, Stream] = {}
        self._h2d: dict[torch.device, Stream] = {}
        self._lock = threading.Lock()

    def _get(self, table: dict[torch.device, Stream], device: torch.device) -> Stream:
        with self._lock:
            stream = table.get(device)
            if stream is None:
                stream = table[device] = self._runtime.new_stream(device)
            return stream

    def d2h(self, device: torch.device) -> Stream:
        return self._get(self._d2h, device)

    def h2d(self, device: torch.device) -> Stream:
        return self._get(self._h2d, device)


def span_bytes(t: torch.Tensor) -> int:
    """Bytes of the storage span view ``t`` covers (what a host copy of it needs, >= 1)."""
    return max(span_of(tuple(t.shape), tuple(t.stride())) * t.element_size(), 1)


def copy_to_host(t: torch.Tensor, buf: torch.Tensor, streams: StreamSet, rt: Runtime) -> Loaded:
    """Start an async copy of device tensor ``t`` into pinned buffer ``buf``.

    ``buf`` holds at least :func:`span_bytes` of ``t``. Returns ``(host_view,
    done_event)``: ``host_view`` has ``t``'s dtype, shape and strides over ``buf`` and
    is valid once ``done_event`` has completed. The caller keeps ``t`` alive until
    then. See NOTE [ Stream ordering ].
    """
    producer = rt.current_stream(t.device)  # captured before switching streams
    ready = rt.new_event()
    rt.record(ready, producer)
    copy_stream = streams.d2h(t.device)
    span = span_of(tuple(t.shape), tuple(t.stride()))
    with rt.use_stream(copy_stream):
        rt.wait(copy_stream, ready)
        # Copy the storage span the view covers, then rebuild the same view on host
        # (storage offset 0 there; the caller restores the original offset on unpack).
        src = t.detach().as_strided((span,), (1,), t.storage_offset())
        dst = buf[: span * t.element_size()].view(t.dtype)
        rt.copy(dst, src, non_blocking=True)
        done = rt.new_event()
        rt.record(done, copy_stream)
    host_view = dst.as_strided(t.shape, t.stride(), 0)
    return host_view, done


def copy_to_device(
    host: torch.Tensor, device: torch.device, offset: int, streams: StreamSet, rt: Runtime
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
    with rt.use_stream(stream):
        base = rt.empty(offset + span, host.dtype, device)
        rt.copy(base[offset:], flat, non_blocking=True)
        done = rt.new_event()
        rt.record(done, stream)
    out = base.as_strided(host.shape, host.stride(), offset)
    return out, done


def consume(t: torch.Tensor, done: CopyEvent, rt: Runtime) -> torch.Tensor:
    """Order the current stream after ``done`` and tell the allocator it uses ``t``."""
    stream = rt.current_stream(t.device)
    rt.wait(stream, done)
    rt.record_stream(t, stream)
    return t


class CudaOps:
    """:class:`DeviceOps` made of the staging functions over a :class:`Runtime`
    (default :class:`TorchCuda`): what the device stager does with an accelerator."""

    def __init__(self, runtime: Runtime | None = None) -> None:
        self.runtime: Runtime = TorchCuda() if runtime is None else runtime
        self.streams = StreamSet(self.runtime)

    def accelerated(self, device: torch.device) -> bool:
        """Whether tensors on ``device`` are staged through host memory."""
        return self.runtime.accelerated(device)

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A new pinned host buffer of ``nbytes`` bytes."""
        return self.runtime.pinned(nbytes)

    def to_host(self, t: torch.Tensor, buf: torch.Tensor) -> Loaded:
        """Start copying ``t`` into ``buf``: ``(host_view, event)``; :func:`copy_to_host`."""
        return copy_to_host(t, buf, self.streams, self.runtime)

    def to_device(self, host: torch.Tensor, device: torch.device, offset: int) -> Loaded:
        """Start copying ``host`` onto ``device``: ``(tensor, event)``; :func:`copy_to_device`."""
        return copy_to_device(host, device, offset, self.streams, self.runtime)

    def finish(self, t: torch.Tensor, done: CopyEvent) -> torch.Tensor:
        """The tensor unpack returns, ordered after ``done`` on the current stream."""
        return consume(t, done, self.runtime)
