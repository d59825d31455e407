"""Staging: moving tensors between an accelerator and host memory (pinned buffers, streams).

"Staging" means only that here (see the glossary in ``docs/life-of-a-saved-tensor.md``).
:class:`DeviceOps` is the seam the device stager (``pipeline/_device.py``) drives; :class:`CudaOps`
is its implementation, made of the staging functions below (:func:`copy_to_host`,
:func:`copy_to_device`, :func:`consume`, ...). Those functions touch streams, events,
copies and allocators only through a :class:`Runtime`: :class:`TorchCuda` is torch's
CUDA, and ``tests/fake_cuda.py`` is a recording, poisoning stand-in that runs the same
functions on CPU tensors and checks their order.

NOTE [ Stream ordering ]
The rules every copy between host and device keeps; ``docs/life-of-a-saved-tensor.md``
("Streams and events") explains each, and ``tests/fake_cuda.py`` checks them:

1. Producer first: a copy on a copy stream reads a device tensor only after waiting on
   an event recorded on the stream that made it. The producing stream is therefore
   captured *before* entering the copy stream's context (inside it,
   ``current_stream()`` is the copy stream itself and waiting on it orders nothing).
2. A device tensor a copy reads stays referenced until that copy's event has
   completed, so the caching allocator cannot hand its memory to another kernel (a
   copy on the producing stream itself, rule 8: ``record_stream`` on that stream).
   Every tensor taken off the device is also ``record_stream``-ed on its producer at
   pack: memory allocated for another stream returns to that stream's pool when the
   library drops it, and must not be handed out while the producer may still use it.
3. A pinned buffer goes back to its pool or tier, to be written or copied into again,
   only once every copy using it has completed; bytes copied to host are read, on the
   host or by a copy back to the device on any stream, only after the copy's event
   (waited on by that stream: a ``host`` rule's copy, rule 8, included).
4. A tensor copied onto the device is used only after the consuming stream waits on
   the copy's event (a device-side wait, never a host one), and ``record_stream``
   tells the allocator that stream uses it.
5. Device memory for a tensor coming back is allocated on the consuming (current)
   stream, not on the copy stream: the caching allocator keeps a stream's freed blocks
   for that stream. The copy stream waits for an event recorded there after the
   allocation before writing, and ``record_stream``-s the tensor.
6. Copies move the bytes as they are in memory (conj and neg bits off) and the result
   gets the bits back as view flags: an asynchronous copy to host applies a conj bit
   on the host before the bytes land (pytorch#146286).
7. A tensor comes back with a storage of its own span (storage offset 0), not the
   offset and span of the storage it was cut from.
8. Every copy off the device goes through the device stager: on a copy stream (a
   ``host`` rule's copy without a tier: in order on the producing stream itself,
   which records an event after it, and the copy back runs on the consuming stream
   once that stream waited on the event; the source is ``record_stream``-ed on the
   producer). A tensor written without a host copy is copied out on the copy stream,
   after an event recorded on its producer at pack, never read from the device by an
   I/O thread.
9. No thread blocks on a copy while holding the record table's lock, and the unpacking
   thread never blocks on one: buffers go back when their copy's event is seen
   complete (polled), and events are made with ``blocking=True`` so a thread that
   does wait sleeps.
10. No event is queried or synchronized while a graph is being captured: pack keeps
    tensors in place then, and unpack refuses to bring an offloaded one back. CUDA's
    global capture mode forbids it on every thread, so once pack has seen a capture
    the I/O threads and buffer returns query nothing, and copies wait, until the
    capturing stream says it has ended (``cudaStreamIsCapturing``, legal to ask).
"""

from __future__ import annotations

import threading
import weakref
from collections import defaultdict
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import ClassVar, Protocol, TypeAlias, cast

import torch

from tensorstore_hooks._codec import span_of

__all__ = [
    "CopyEvent",
    "CudaOps",
    "alloc_bytes",
    "device_bytes",
    "physical",
    "DeviceOps",
    "Loaded",
    "PinnedPool",
    "Runtime",
    "Stream",
    "StreamSet",
    "TorchCuda",
    "pinned_block_bytes",
    "pinned_buffer",
    "producer_event",
    "returned_bytes",
    "span_bytes",
    "with_bits",
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

    def stream_capturing(self, stream: Stream) -> bool:
        """Whether ``stream`` is capturing a graph (legal to ask from any thread, even
        during a capture: ``cudaStreamIsCapturing``)."""
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
        # ``device``'s own current stream (finding L): is_current_stream_capturing()
        # alone asks about the current device's, whatever device the tensor is on.
        return TorchCuda.stream_capturing(torch.cuda.current_stream(device))

    @staticmethod
    def current_stream(device: torch.device) -> Stream:
        return torch.cuda.current_stream(device)

    @staticmethod
    def stream_capturing(stream: Stream) -> bool:
        # current stream is thread-local: setting it here changes no other thread's
        with torch.cuda.stream(cast(torch.cuda.Stream, stream)):
            return bool(torch.cuda.is_current_stream_capturing())

    @staticmethod
    def new_stream(device: torch.device) -> Stream:
        return torch.cuda.Stream(device=device)

    @staticmethod
    def use_stream(stream: Stream) -> AbstractContextManager[object]:
        return torch.cuda.stream(cast(torch.cuda.Stream, stream))

    @staticmethod
    def new_event() -> CopyEvent:
        return torch.cuda.Event(blocking=True)  # rule 9: a waiting thread sleeps

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


_TORCH_CUDA = TorchCuda()  # one runtime object: the key of the process's shared streams


class DeviceOps(Protocol):
    """Every device-specific step the device stager takes: the seam CPU tests drive.

    :class:`CudaOps` is the real one, made of the staging functions of this module over
    a :class:`Runtime`; ``tests/fake_accelerator.py`` is the same :class:`CudaOps` over a
    fake runtime. Events returned may be ``None`` (the copy has completed already).
    """

    def accelerated(self, device: torch.device) -> bool:
        """Whether tensors on ``device`` are staged through host memory."""
        ...

    def capturing(self, device: torch.device) -> bool:
        """Whether a graph is being captured on ``device``'s current stream (rule 10)."""
        ...

    def capture_stream(self, device: torch.device) -> Stream:
        """The stream capturing a graph on ``device`` (the current one), for
        :meth:`stream_capturing` from other threads."""
        ...

    def stream_capturing(self, stream: Stream) -> bool:
        """Whether ``stream`` is still capturing (asking is legal during a capture)."""
        ...

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A new pinned host buffer of ``nbytes`` bytes (uint8)."""
        ...

    def pinned_bytes(self, nbytes: int) -> int:
        """Pinned bytes :meth:`allocate` ``(nbytes)`` really holds (the allocator's rounding)."""
        ...

    def to_host(self, t: torch.Tensor, buf: torch.Tensor) -> Loaded:
        """Start copying ``t`` into ``buf``: ``(host_view, event)``."""
        ...

    def to_device(
        self, host: torch.Tensor, device: torch.device, after: CopyEvent | None = None
    ) -> Loaded:
        """Start copying ``host`` onto ``device`` once ``after`` (if any) has completed:
        ``(tensor, event)``; ``host`` stays untouched, and the tensor referenced, until
        the event has completed."""
        ...

    def producer_event(self, t: torch.Tensor) -> CopyEvent:
        """An event recorded now on the stream making ``t`` (the current stream)."""
        ...

    def wait_current(self, device: torch.device, event: CopyEvent) -> None:
        """Make later work on ``device``'s current stream wait for ``event`` (on the
        device: the host does not block)."""
        ...

    def to_pageable(self, t: torch.Tensor, ready: CopyEvent) -> torch.Tensor:
        """``t`` copied into new pageable host memory after ``ready`` (blocks until done)."""
        ...

    def pin(self, t: torch.Tensor) -> Loaded:
        """A pinned host copy of ``t``, in order on the current stream (``host`` rules):
        ``(host_copy, event)``, the event recorded on that stream after the copy."""
        ...

    def unpin(
        self, host: torch.Tensor, device: torch.device, ready: CopyEvent | None = None
    ) -> torch.Tensor:
        """``host`` (from :meth:`pin`) back on ``device``, on the current stream once it
        has waited for ``ready`` (the event :meth:`pin` returned)."""
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
    :class:`~tensorstore_hooks.pipeline._host_tier.SlabTier` hands out every pinned buffer.
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
    """One device-to-host and one host-to-device stream per device, made lazily.

    :meth:`shared` gives every pipeline of a process the same set for one runtime:
    torch hands streams out round-robin from a pool of 32 per device, which NCCL's
    communicators use too, so two new streams per pipeline (hooks made every step)
    would soon share a stream with a collective and serialize behind it.
    """

    _sets: ClassVar[weakref.WeakKeyDictionary[Runtime, StreamSet]] = (
        weakref.WeakKeyDictionary()
    )
    _sets_lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def shared(cls, runtime: Runtime) -> StreamSet:
        """The process's one :class:`StreamSet` over ``runtime``."""
        with cls._sets_lock:
            found = cls._sets.get(runtime)
            if found is None:
                found = cls._sets[runtime] = cls(runtime)
            return found

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
    if t.is_contiguous():  # its elements are its span: no Python loop (the common tensor)
        return max(t.numel() * t.element_size(), 1)
    return max(span_of(tuple(t.shape), tuple(t.stride())) * t.element_size(), 1)


def alloc_bytes(nbytes: int, device: torch.device) -> int:
    """Bytes an allocation of ``nbytes`` takes on ``device``: CUDA's caching allocator
    rounds every block up to a multiple of 512 bytes; host memory is taken as asked."""
    if device.type == "cuda":
        return max(-(-nbytes // 512) * 512, 512)
    return nbytes


def device_bytes(t: torch.Tensor) -> int:
    """Memory saved tensor ``t`` holds on its device while it stays there: all of its
    storage (a view keeps the storage it was cut from alive), as the allocator rounds it."""
    return alloc_bytes(t.untyped_storage().nbytes(), t.device)


def returned_bytes(t: torch.Tensor) -> int:
    """Memory ``t`` takes on its device when it comes back: its own span (rule 7), rounded."""
    return alloc_bytes(span_bytes(t), t.device)


def physical(t: torch.Tensor) -> tuple[torch.Tensor, bool, bool]:
    """``t``'s bytes as they are in memory (a view with the conj and neg bits off), and
    the bits: what rule 6 copies, and what :func:`with_bits` puts back."""
    conj, neg = t.is_conj(), t.is_neg()
    if conj:
        t = t.conj()  # of a conj view: the same storage, bit off
    if neg:
        t = torch._neg_view(t)
    return t, conj, neg


def with_bits(t: torch.Tensor, conj: bool, neg: bool) -> torch.Tensor:
    """View ``t`` with the conj and neg bits :func:`physical` took off (no copy)."""
    if neg:
        t = torch._neg_view(t)
    if conj:
        t = t.conj()
    return t


def _flat(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The storage span view ``t`` covers, as a 1-D view, and its length in elements."""
    span = span_of(tuple(t.shape), tuple(t.stride()))
    return t.as_strided((span,), (1,), t.storage_offset()), span


def copy_to_host(t: torch.Tensor, buf: torch.Tensor, streams: StreamSet, rt: Runtime) -> Loaded:
    """Start an async copy of device tensor ``t`` into pinned buffer ``buf``.

    ``buf`` holds at least :func:`span_bytes` of ``t``. Returns ``(host_view,
    done_event)``: ``host_view`` has ``t``'s dtype, shape, strides and conj/neg bits
    over ``buf`` (from ``buf``'s first byte) and is valid once ``done_event`` has completed. The
    caller keeps ``t`` alive until then. See NOTE [ Stream ordering ].
    """
    producer = rt.current_stream(t.device)  # rule 1: before entering the copy stream
    ready = rt.new_event()
    rt.record(ready, producer)
    copy_stream = streams.d2h(t.device)
    src, conj, neg = physical(t.detach())  # rule 6
    flat, span = _flat(src)
    dst = buf[: span * src.element_size()].view(src.dtype)
    with rt.use_stream(copy_stream):
        rt.wait(copy_stream, ready)
        rt.copy(dst, flat, non_blocking=True)
        done = rt.new_event()
        rt.record(done, copy_stream)
    rt.record_stream(flat, producer)  # rule 2: memory of another stream's pool
    # ``buf`` may be a range of a larger slab (NOTE [ Pinned slabs ]): from its offset.
    host = dst.as_strided(t.shape, t.stride(), dst.storage_offset())
    return with_bits(host, conj, neg), done


def copy_to_device(
    host: torch.Tensor,
    device: torch.device,
    streams: StreamSet,
    rt: Runtime,
    after: CopyEvent | None = None,
) -> Loaded:
    """Start a copy of host tensor ``host`` onto ``device`` on the host-to-device stream.

    Returns ``(device_tensor, done_event)`` with ``host``'s shape, strides and conj/neg
    bits, in a storage of its own span (rule 7). The tensor is allocated for the
    current stream, its consumer (rule 5); the copy starts once ``after`` (a copy into
    ``host`` still running) has completed. From pinned memory the copy is
    asynchronous, from pageable memory torch stages it at once. Either way the consumer
    waits for ``done`` before use (see :func:`consume`), and ``host`` must stay
    untouched until ``done`` has completed. The caller keeps the returned tensor
    referenced until then too: a read nobody claims must not free its block mid-copy.
    """
    src, conj, neg = physical(host)
    flat, span = _flat(src)
    consumer = rt.current_stream(device)
    base = rt.empty(span, src.dtype, device)  # rule 5: the consumer's block
    allocated = rt.new_event()
    rt.record(allocated, consumer)
    stream = streams.h2d(device)
    with rt.use_stream(stream):
        rt.wait(stream, allocated)  # the block's earlier tenant is done with it
        if after is not None:
            rt.wait(stream, after)
        rt.copy(base, flat, non_blocking=True)
        done = rt.new_event()
        rt.record(done, stream)
    # No record_stream on the copy stream (finding I): the allocator would hold the
    # block until that stream drained every read queued after it. The caller keeps the
    # tensor alive until ``done`` has completed instead (rule 2's way, for this copy).
    return with_bits(base.as_strided(host.shape, host.stride(), 0), conj, neg), done


def producer_event(t: torch.Tensor, rt: Runtime) -> CopyEvent:
    """An event recorded now on the current stream, the one making ``t``, for
    :func:`copy_to_pageable` on another thread later; ``t`` is ``record_stream``-ed on
    that stream (rule 2: memory from another stream's pool is not handed out again
    while the producer's kernels may still use it)."""
    producer = rt.current_stream(t.device)
    event = rt.new_event()
    rt.record(event, producer)
    rt.record_stream(t, producer)
    return event


def copy_to_pageable(
    t: torch.Tensor, ready: CopyEvent, streams: StreamSet, rt: Runtime
) -> torch.Tensor:
    """``t`` copied on the device-to-host stream, after ``ready`` (an event recorded on
    its producer), into new pageable host memory; returns once the bytes are there.

    For tensors written without a host copy (larger than ``host_budget``, or no room in
    time): rule 8. Shape, strides and bits as :func:`copy_to_host` gives them.
    """
    src, conj, neg = physical(t.detach())
    flat, span = _flat(src)
    dst = rt.pageable(span, src.dtype)
    copy_stream = streams.d2h(t.device)
    with rt.use_stream(copy_stream):
        rt.wait(copy_stream, ready)
        rt.copy(dst, flat, non_blocking=False)  # to pageable memory: synchronous anyway
    return with_bits(dst.as_strided(t.shape, t.stride(), 0), conj, neg)


def copy_to_pinned(t: torch.Tensor, rt: Runtime) -> Loaded:
    """A pinned copy of ``t`` queued on the current stream (a ``host`` rule's copy).

    Returns ``(host_copy, done_event)``: the copy runs in order on the stream that made
    ``t`` (rule 8), and ``done_event`` is recorded there after it. The host copy is
    valid once ``done_event`` has completed: unpack, on whatever stream it runs, waits
    on it before copying back (:func:`copy_from_pinned`, rule 3). ``t`` is
    ``record_stream``-ed on the producer, so memory it was allocated for another stream
    is not reused before the copy read it (rule 2; a no-op on its own stream). The
    pinned buffer belongs to the host copy: torch's host allocator reuses it only
    once the copies recorded on it have completed.
    """
    producer = rt.current_stream(t.device)
    src, conj, neg = physical(t.detach())
    flat, span = _flat(src)
    buf = rt.pinned(max(span * src.element_size(), 1))
    dst = buf[: span * src.element_size()].view(src.dtype)
    rt.copy(dst, flat, non_blocking=True)
    done = rt.new_event()  # blocking (rule 9), as every event here
    rt.record(done, producer)
    rt.record_stream(flat, producer)
    return with_bits(dst.as_strided(t.shape, t.stride(), 0), conj, neg), done


def copy_from_pinned(
    host: torch.Tensor, device: torch.device, rt: Runtime, ready: CopyEvent | None = None
) -> torch.Tensor:
    """``host`` (from :func:`copy_to_pinned`) back on ``device``, on the current stream.

    The current stream (the consumer) first waits on ``ready``, the event recorded
    after the copy to host on the stream that made it (rule 3: a device-side wait, a
    no-op when both are one stream), then allocates and copies there: the result is
    the consumer's own (rules 4 and 5 hold by stream order).
    """
    src, conj, neg = physical(host)
    flat, span = _flat(src)
    consumer = rt.current_stream(device)
    if ready is not None:
        rt.wait(consumer, ready)
    out = rt.empty(span, src.dtype, device)
    rt.copy(out, flat, non_blocking=True)
    return with_bits(out.as_strided(host.shape, host.stride(), 0), conj, neg)


def consume(t: torch.Tensor, done: CopyEvent, rt: Runtime) -> torch.Tensor:
    """Order the current stream after ``done`` and tell the allocator it uses ``t`` (rule 4)."""
    stream = rt.current_stream(t.device)
    rt.wait(stream, done)
    rt.record_stream(t, stream)
    return t


class CudaOps:
    """:class:`DeviceOps` made of the staging functions over a :class:`Runtime`
    (default :class:`TorchCuda`): what the device stager does with an accelerator."""

    def __init__(self, runtime: Runtime | None = None) -> None:
        self.runtime: Runtime = _TORCH_CUDA if runtime is None else runtime
        self.streams = StreamSet.shared(self.runtime)  # finding K: not two per pipeline

    def accelerated(self, device: torch.device) -> bool:
        """Whether tensors on ``device`` are staged through host memory."""
        return self.runtime.accelerated(device)

    def capturing(self, device: torch.device) -> bool:
        """Whether a graph is being captured on ``device``'s current stream."""
        return self.runtime.capturing(device)

    def capture_stream(self, device: torch.device) -> Stream:
        """The stream capturing a graph on ``device`` (the current one)."""
        return self.runtime.current_stream(device)

    def stream_capturing(self, stream: Stream) -> bool:
        """Whether ``stream`` is still capturing a graph."""
        return self.runtime.stream_capturing(stream)

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A new pinned host buffer of ``nbytes`` bytes."""
        return self.runtime.pinned(nbytes)

    def pinned_bytes(self, nbytes: int) -> int:
        """Pinned bytes :meth:`allocate` ``(nbytes)`` really holds."""
        return self.runtime.pinned_bytes(nbytes)

    def to_host(self, t: torch.Tensor, buf: torch.Tensor) -> Loaded:
        """Start copying ``t`` into ``buf``: ``(host_view, event)``; :func:`copy_to_host`."""
        return copy_to_host(t, buf, self.streams, self.runtime)

    def to_device(
        self, host: torch.Tensor, device: torch.device, after: CopyEvent | None = None
    ) -> Loaded:
        """Start copying ``host`` onto ``device``: ``(tensor, event)``; :func:`copy_to_device`."""
        return copy_to_device(host, device, self.streams, self.runtime, after)

    def producer_event(self, t: torch.Tensor) -> CopyEvent:
        """An event recorded now on the current stream (the one making ``t``)."""
        return producer_event(t, self.runtime)

    def wait_current(self, device: torch.device, event: CopyEvent) -> None:
        """The current stream of ``device`` waits for ``event`` (a device-side wait)."""
        self.runtime.wait(self.runtime.current_stream(device), event)

    def to_pageable(self, t: torch.Tensor, ready: CopyEvent) -> torch.Tensor:
        """``t`` in new pageable host memory, copied after ``ready``; :func:`copy_to_pageable`."""
        return copy_to_pageable(t, ready, self.streams, self.runtime)

    def pin(self, t: torch.Tensor) -> Loaded:
        """A pinned copy of ``t`` on the current stream, and the event after it;
        :func:`copy_to_pinned`."""
        return copy_to_pinned(t, self.runtime)

    def unpin(
        self, host: torch.Tensor, device: torch.device, ready: CopyEvent | None = None
    ) -> torch.Tensor:
        """``host`` back on ``device`` on the current stream, after ``ready``;
        :func:`copy_from_pinned`."""
        return copy_from_pinned(host, device, self.runtime, ready)

    def finish(self, t: torch.Tensor, done: CopyEvent) -> torch.Tensor:
        """The tensor unpack returns, ordered after ``done`` on the current stream."""
        return consume(t, done, self.runtime)
