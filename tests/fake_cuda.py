"""A fake ``torch.cuda`` under the real staging functions: recorded, ordered, poisoned.

:class:`FakeCuda` implements ``tensorstore_hooks.pipeline._staging.Runtime`` over CPU tensors, so
the library's own :func:`copy_to_host`, :func:`copy_to_device` and :func:`consume` run
unchanged on a machine without a GPU, and every stream, event, copy, wait and
``record_stream`` call they make is logged (:attr:`FakeCuda.log`) and checked against
the rules of NOTE [ Stream ordering ] (``docs/life-of-a-saved-tensor.md`` states
them). A broken rule is appended to :attr:`FakeCuda.violations` *and* corrupts data
the way a GPU would, so gradients come out wrong (NaN) rather than by luck right:

* Copies are asynchronous. A copy queued on a side (copy) stream lands only when its
  stream runs: when an event after it is synchronized, queried ``polls`` times, or
  waited on by a compute stream, or a blocking copy runs there. ``polls=0`` runs
  each stream as soon as work is queued on it (still after any fix-up torch does on
  the host, see below). Compute streams are the host's eager CPU ops: work queued
  there with a device destination lands at once; a copy to host memory waits like a
  side stream's.
* Destinations are filled with NaN (all bits set) when the copy is queued: a host
  buffer read, or a device tensor used, before its copy landed reads NaN.
* Rule 1: a copy on a stream that never waited for the producer of the device tensor
  it reads (an event recorded on that stream after :meth:`produced`) leaves NaN.
* Rule 2: the device tensor a copy reads is held only weakly; if nothing else keeps
  it until the copy lands, its memory counts as reused and the copy leaves NaN.
* Rule 3: a host buffer another stream's pending copy uses, reused before that copy
  completed, is reported; a pinned source whose bytes change before its copy lands
  is reported (and the copy takes the changed bytes, as DMA would).
* Rule 4/5: device memory allocated while a copy stream is current, written by a
  stream that did not wait for its allocation, or used by a stream that neither
  waited for its copy nor ``record_stream``-ed it, is reported.
* Rule 6: ``copy(dst, src)`` across conj/neg bits does torch's fix-up
  (``conj_physical_``/``neg_``) on a host destination *before* the bytes land
  (pytorch#146286), on a device destination after them, in stream order.
* Rule 10, graph capture (:meth:`capture`, ``torch.cuda.graph``): while a capture is
  active, ``query``, ``synchronize`` and blocking copies raise, from any thread, as
  CUDA's global capture mode does, and *invalidate the capture*: leaving it then raises
  (``cudaErrorStreamCaptureInvalidated``), so an error a thread swallowed still fails
  the capture. Work the capturing thread queues meanwhile (asynchronous copies,
  :meth:`kernel`) is recorded into the :class:`FakeGraph`, not run: a copy's destination
  keeps its NaN until :meth:`FakeGraph.replay` runs it.
* Several devices (``devices=n``, finding L): each device has its own default stream
  and, per thread, its own current stream (:meth:`use_stream` sets the current stream of
  the stream's device, and makes that device current for its duration, as
  ``torch.cuda.stream`` does); :meth:`set_device` / :meth:`device` pick the current
  device. Streams and events belong to a device: recording an event on another
  device's stream raises, as CUDA does; a copy between two devices raises (the library
  never makes one); a copy of one device's tensor inside another device's stream
  context is reported (it would run on its own device's current stream, unordered with
  the waits made on the stream the code meant). A tensor says where it is through
  :func:`on_device` (an :class:`OnDevice` view whose ``device`` is ``cuda:k``); plain
  CPU tensors are on device 0. :meth:`live_bytes` counts per device too.
* Per-stream pools (finding G): memory :meth:`allocated_for` a stream goes back to that
  stream's pool when freed; every other stream that used it (made it, or read it in a
  copy) must have been ``record_stream``-ed on it, or the freed block may be handed to a
  new tensor while that stream's kernels still use it: reported when the memory is
  found freed (:meth:`run_all`, or any device allocation).
* Simulated time (``timing=``, a :class:`Timing`): each kernel (:meth:`kernel`, and
  every tensor :meth:`produced` at pack) advances the compute clock :attr:`now_s`;
  a copy on a copy stream ends ``nbytes / bandwidth`` after both its stream is free
  and it was issued; a copy from pageable memory runs at half rate and the host
  waits for it. An event completes when the clock passes it: ``query`` answers by
  the clock (not by ``polls``), ``synchronize`` and a compute stream's wait move the
  clock to it. :meth:`live_bytes` / :attr:`peak_bytes` count device memory: tensors
  made on the device (:meth:`produced`) and allocations, while referenced.
* A stream pool (finding K): with ``stream_pool=n``, :meth:`new_stream` hands out the
  ``n`` streams of each device round-robin, as torch's pool of 32 does, so streams
  alias; :meth:`pool_stream` takes one the way NCCL does.

The pinned allocator is modelled as torch's caching host allocator: each request is
rounded up to a power of two, and a freed block stays held (cached) for a later
request of the same size; :attr:`pinned_held_bytes` / :attr:`pinned_peak_bytes` are
what it really holds. Device allocations round to 512 bytes
(:attr:`device_held_bytes`).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from tensorstore_hooks._codec import span_of

__all__ = [
    "FakeCuda",
    "FakeEvent",
    "FakeGraph",
    "FakeStream",
    "OnDevice",
    "Timing",
    "devices_accepted",
    "on_device",
    "torch_function_on",
]

PINNED, PAGEABLE, DEVICE = "pinned", "pageable", "device"
_CPU = torch.device("cpu")


class OnDevice(torch.Tensor):
    """A CPU tensor that says it lives on ``cuda:k`` (several fake devices): ``device``
    answers ``cuda:k``, and what torch makes from it says the same device."""

    _fake_device: ClassVar[torch.device] = _CPU

    @property  # type: ignore[override]
    def device(self) -> torch.device:
        return self.__dict__.get("_fake_device", _CPU)

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., object],
        types: Sequence[type],
        args: Sequence[object] = (),
        kwargs: Mapping[str, object] | None = None,
    ) -> object:
        out = super().__torch_function__(func, types, args, kwargs or {})
        device = next((a.device for a in args if isinstance(a, OnDevice)), None)
        if device is not None and device.type != "cpu":
            for t in out if isinstance(out, tuple | list) else (out,):
                if isinstance(t, OnDevice) and "_fake_device" not in t.__dict__:
                    t.__dict__["_fake_device"] = device
        return out


@contextlib.contextmanager
def devices_accepted() -> Iterator[None]:
    """While active, the library stores :class:`OnDevice` tensors as plain ones (its
    ``unsupported_reason`` refuses tensor subclasses, rightly for real ones): every
    module of ``tensorstore_hooks`` that imported it sees a wrapper."""
    import sys

    from tensorstore_hooks import _codec

    real = _codec.unsupported_reason

    def reason(t: torch.Tensor) -> str | None:
        return real(t.as_subclass(torch.Tensor) if isinstance(t, OnDevice) else t)

    patched = [
        m
        for name, m in list(sys.modules.items())
        if name.startswith("tensorstore_hooks") and getattr(m, "unsupported_reason", None) is real
    ]
    for m in patched:
        m.unsupported_reason = reason  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for m in patched:
            m.unsupported_reason = real  # type: ignore[attr-defined]


def torch_function_on(hook: Callable[[torch.Tensor], object]) -> Callable[[torch.Tensor], object]:
    """``hook`` (a saved-tensor pack hook) run with torch functions on: autograd calls it
    inside the op's ``__torch_function__``, where torch turns subclass dispatch off, so
    the views the library makes there would forget that an :class:`OnDevice` tensor is
    on ``cuda:k`` (set ``hooks.pack_hook = torch_function_on(hooks.pack_hook)``)."""

    def run(t: torch.Tensor) -> object:
        with torch._C._EnableTorchFunction():
            return hook(t)

    return run


def on_device(t: torch.Tensor, index: int) -> torch.Tensor:
    """``t`` (a view of it, in the autograd graph) as a tensor of ``cuda:index``."""
    out = t.as_subclass(OnDevice)
    out.__dict__["_fake_device"] = torch.device("cuda", index)
    return out


@dataclass(frozen=True)
class Timing:
    """Rates of the simulated device (seconds and bytes per second)."""

    compute_s: float = 1e-3
    """One kernel (one saved tensor made, one used in backward)."""
    d2h_bytes_per_s: float = 16e9
    """Pinned device-to-host bandwidth (pageable: half)."""
    h2d_bytes_per_s: float = 16e9
    """Pinned host-to-device bandwidth (pageable: half)."""

    @classmethod
    def lagging(cls, lag: float, nbytes: int, compute_s: float = 1e-3) -> Timing:
        """Copies of ``nbytes`` take ``lag`` times one kernel, each way."""
        rate = nbytes / (lag * compute_s)
        return cls(compute_s, rate, rate)


class FakeStream:
    """A stream: a FIFO of queued work, a stamp per operation, what it waited for."""

    def __init__(self, name: str, side: bool, device: int = 0) -> None:
        self.device = device
        """The device index it belongs to."""
        self.busy_s = 0.0  # simulated time its queued work ends (timed fakes)
        self.name = name
        self.side = side
        """A copy stream the staging code made (not one compute runs on)."""
        self.stamp = 0  # advances with every operation queued or tensor produced here
        self.queue: deque[_Op] = deque()
        self.seen: dict[FakeStream, int] = {}  # stream -> stamp this stream waited for

    def __repr__(self) -> str:
        return self.name


class FakeEvent:
    """An event: recorded on a stream at a stamp; complete once that stream ran to it."""

    def __init__(self, fake: FakeCuda, n: int) -> None:
        self._fake = fake
        self.name = f"event{n}"
        self.stream: FakeStream | None = None
        self.device: int | None = None  # set by its first record, as CUDA's
        self.stamp = 0
        self.seen: dict[FakeStream, int] = {}
        self.polls_left = 0
        self.at_s = 0.0  # simulated time it completes (timed fakes)

    def query(self) -> bool:
        return self._fake._query(self)

    def synchronize(self) -> None:
        self._fake._synchronize(self)

    def __repr__(self) -> str:
        return self.name


class FakeGraph:
    """What a :meth:`FakeCuda.capture` recorded: run by :meth:`replay`."""

    def __init__(self, fake: FakeCuda, stream: FakeStream) -> None:
        self._fake = fake
        self.stream = stream
        """The capturing stream."""
        self.ops: list[_Copy | None] = []
        """Recorded copies, and kernels (``None``), in order."""
        self.invalidated: str | None = None
        """The illegal call that invalidated the capture (``None``: none)."""
        self.replays = 0
        self.joined: set[FakeStream] = set()
        """Streams that waited on the capture's work: captured too (CUDA's fork/join)."""

    def captures(self, stream: FakeStream) -> bool:
        """Whether work queued on ``stream`` now is recorded into this graph."""
        return stream is self.stream or stream in self.joined

    def replay(self) -> None:
        """Run the recorded work (then: every recorded copy has landed)."""
        self._fake._replay(self)


@dataclass(eq=False)
class _Op:
    stream: FakeStream
    stamp: int
    name: str

    def run(self, fake: FakeCuda) -> None:
        raise NotImplementedError


@dataclass(eq=False)
class _Wait(_Op):
    event: FakeEvent

    def run(self, fake: FakeCuda) -> None:
        if self.event.stream is not None and self.event.stream is not self.stream:
            fake._run(self.event.stream, self.event.stamp)


@dataclass(eq=False)
class _Copy(_Op):
    dst: torch.Tensor | None = None  # host destinations: held (torch's host allocator does)
    dst_weak: tuple[StorageWeakRef, _View] | None = None  # device destinations
    dst_memory: _Memory | None = None  # what the fake knows of a device destination
    src: torch.Tensor | None = None  # host sources: held
    src_weak: tuple[StorageWeakRef, _View] | None = None  # device sources
    snapshot: torch.Tensor | None = None  # a host source's bytes when queued
    host_range: tuple[int, int, bool] | None = None  # (lo, hi, written) of host memory
    leave_poison: str | None = None  # a broken rule: the copy lands garbage (NaN)
    device_fixup: tuple[bool, bool] = (False, False)  # (conj, neg) after landing
    # Copies into host memory this one reads that must land first (stream order or a
    # wait): its source's expected bytes are known only once they have.
    writers: set[int] = field(default_factory=set)
    readers: list[_Copy] = field(default_factory=list)

    def run(self, fake: FakeCuda) -> None:
        try:
            self._land(fake)
        finally:
            for reader in self.readers:
                reader.writers.discard(id(self))
                if not reader.writers and reader.src is not None and reader.snapshot is None:
                    reader.snapshot = reader.src.clone()

    def _land(self, fake: FakeCuda) -> None:
        dst = self.dst if self.dst is not None else _materialize(self.dst_weak)
        if dst is None:
            mem = self.dst_memory
            if mem is None or self.stream not in mem.record_streams:
                fake._violate(
                    f"rule 5: {self.name} on {self.stream} lands in device memory freed "
                    "before the copy completed (no record_stream on the copy stream)"
                )
            return
        if self.leave_poison is not None:
            return  # the destination keeps its NaN
        if self.src_weak is not None:  # device memory: it must still be there
            src = _materialize(self.src_weak)
            if src is None:
                fake._violate(
                    f"rule 2: {self.name} on {self.stream} reads a device tensor dropped "
                    "before the copy completed (its memory may already hold another tensor)"
                )
                return
        elif self.src is not None:  # pinned: read when the copy runs
            src = self.src
            if self.snapshot is not None and not _same_bytes(src, self.snapshot):
                fake._violate(
                    f"rule 3: the pinned source of {self.name} on {self.stream} changed "
                    "before the copy completed (a buffer given back and reused too early)"
                )
        else:  # pageable: torch staged its bytes when the copy was queued
            assert self.snapshot is not None
            src = self.snapshot
        dst.copy_(src)
        conj, neg = self.device_fixup
        if conj:
            dst.conj_physical_()  # physical view: conj of the bytes themselves
        if neg:
            dst.neg_()


@dataclass(frozen=True)
class _View:
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


def _weak(t: torch.Tensor) -> tuple[StorageWeakRef, _View]:
    return StorageWeakRef(t.untyped_storage()), _View(
        t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype
    )


def _materialize(ref: tuple[StorageWeakRef, _View] | None) -> torch.Tensor | None:
    if ref is None:
        return None
    weak, v = ref
    if weak.expired():
        return None
    storage = torch.UntypedStorage._new_with_weak_ptr(weak.cdata)
    out = torch.empty(0, dtype=v.dtype)
    return out.set_(storage, v.offset, v.shape, v.stride)


def _physical(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as they are in memory: conj and neg bits off (a view)."""
    if t.is_conj():
        t = t.conj()
    if t.is_neg():
        t = torch._neg_view(t)
    return t


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    span = span_of(tuple(t.shape), tuple(t.stride()))
    flat = t.as_strided((span,), (1,), t.storage_offset())
    return flat.view(torch.uint8) if span else torch.empty(0, dtype=torch.uint8)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(_flat_bytes(a), _flat_bytes(b))


def _poison(t: torch.Tensor) -> None:
    """All bits set: NaN for every float and complex dtype, -1 for integers."""
    if t.numel():
        _flat_bytes(_physical(t)).fill_(255)


def _ptr(t: torch.Tensor) -> int:
    return int(t.untyped_storage().data_ptr())


def _behind(stream: FakeStream, other: FakeStream | None, stamp: int) -> bool:
    """Whether work on ``stream`` may run before ``other`` reached ``stamp``."""
    return other is not None and other is not stream and stream.seen.get(other, 0) < stamp


def _pow2(nbytes: int) -> int:
    return 1 << max(nbytes - 1, 0).bit_length()


@dataclass
class _Memory:
    """What the fake knows of one storage."""

    weak: StorageWeakRef
    kind: str
    stream: FakeStream | None = None  # device memory: the stream it was allocated for
    stamp: int = 0  # ... and when (or, for a produced tensor, when it was produced)
    nbytes: int = 0
    record_streams: set[FakeStream] = field(default_factory=set)
    alloc_stream: FakeStream | None = None  # the pool its block returns to (allocated_for)
    uses: set[FakeStream] = field(default_factory=set)  # streams that made or read it


class FakeCuda:
    """The staging :class:`~tensorstore_hooks.pipeline._staging.Runtime` on CPU tensors (see the
    module docstring). ``polls``: queries an event answers ``False`` before its stream
    runs (0: streams run as soon as work is queued)."""

    def __init__(
        self,
        *,
        polls: int = 0,
        stream_pool: int = 0,
        timing: Timing | None = None,
        devices: int = 1,
    ) -> None:
        self.devices = devices
        """Device indices there are: ``0 .. devices - 1``."""
        self.polls = polls
        self.timing = timing
        """Simulated rates (``None``: untimed, events answer by ``polls``)."""
        self.now_s = 0.0
        """The compute clock: simulated seconds of kernels run (and waits)."""
        self.peak_bytes = 0
        """The most device memory :meth:`live_bytes` counted at once."""
        self._made: list[tuple[StorageWeakRef, int, int]] = []  # produced: (ref, bytes, device)
        self.peak_by_device: Counter[int] = Counter()
        """The most device memory :meth:`live_bytes` counted at once, per device index."""
        self.stream_pool = stream_pool
        """Streams per device :meth:`new_stream` cycles through (0: a new one each time)."""
        self._pools: dict[str, list[FakeStream]] = {}
        self._pool_next: Counter[str] = Counter()
        self.log: list[str] = []
        """Every call, in order: stream, event, copy, wait, record_stream, allocation."""
        self.violations: list[str] = []
        """Rules of NOTE [ Stream ordering ] broken, in order (each also corrupts data)."""
        self.on_block: Callable[[str], None] | None = None
        """Called (with what blocks) on every host-blocking wait: synchronize, blocking copy."""
        self._lock = threading.RLock()
        self._tls = threading.local()
        self._ids = itertools.count(1)
        self._all_streams: list[FakeStream] = []
        self._defaults = [
            self._stream("default" if i == 0 else f"default:{i}", side=False, device=i)
            for i in range(devices)
        ]
        self.default = self._defaults[0]
        """Device 0's default stream."""
        self._graph: FakeGraph | None = None
        self._memory: dict[int, _Memory] = {}
        self._capturing: set[int] = set()
        self._capturing_streams: set[FakeStream] = set()
        self._copies = 0
        # the pinned allocator: live blocks, and freed blocks it keeps cached, by size
        self._blocks: list[tuple[StorageWeakRef, int]] = []
        self._cached: Counter[int] = Counter()
        self.pinned_held_bytes = 0
        self.pinned_peak_bytes = 0
        self.pinned_blocks_made = 0
        self._device: list[tuple[_Memory, int]] = []
        self.device_held_bytes = 0
        """Device memory the allocator cannot hand out: live blocks, and freed blocks
        whose ``record_stream``-ed streams have not yet run past their free."""
        self._deferred: list[tuple[int, dict[FakeStream, int]]] = []  # (bytes, stream -> stamp)
        self._owned: list[_Memory] = []  # memory allocated_for a stream: checked when freed

    # ----------------------------------------------------------- test helpers
    def user_stream(self, name: str, device: int | None = None) -> FakeStream:
        """A compute stream of the user's (``torch.cuda.Stream()`` in a model), on
        ``device`` (default: the current device)."""
        return self._stream(name, side=False, device=self._ordinal(device))

    # ----------------------------------------------------------- devices
    def current_device(self) -> int:
        """The calling thread's current device index (``torch.cuda.current_device``)."""
        return int(getattr(self._tls, "device", 0))

    def set_device(self, index: int) -> None:
        """``torch.cuda.set_device(index)`` on the calling thread."""
        self._tls.device = self._ordinal(index)

    @contextlib.contextmanager
    def device(self, index: int) -> Iterator[None]:
        """``with torch.cuda.device(index)``: current device for the block."""
        before = self.current_device()
        self.set_device(index)
        try:
            yield
        finally:
            self._tls.device = before

    def _ordinal(self, index: int | None) -> int:
        if index is None:
            return self.current_device()
        if not 0 <= index < self.devices:
            raise RuntimeError(f"CUDA error: invalid device ordinal ({index} of {self.devices})")
        return index

    def index(self, device: torch.device) -> int:
        """The fake device index of ``device`` (``cpu``: device 0, as plain tensors are)."""
        if device.type == "cpu":
            return 0
        return self._ordinal(device.index)

    def produced(self, t: torch.Tensor) -> None:
        """``t`` was just made by work on the current stream (a kernel's output)."""
        with self._lock:
            stream = self.current_stream(t.device)
            known = self._known(t)
            if known is not None and known.kind == DEVICE and known.stream is stream:
                return  # another view of memory made earlier: made then, not now
            self.kernel(stream)
            if known is None:
                storage = t.untyped_storage()
                self._made.append((StorageWeakRef(storage), storage.nbytes(), stream.device))
                self.live_bytes()
            stream.stamp += 1
            if known is not None and known.alloc_stream is not None:
                known.stream, known.stamp = stream, stream.stamp  # keep its pool's record
                known.uses.add(stream)
                return
            self._memory[_ptr(t)] = _Memory(
                StorageWeakRef(t.untyped_storage()), DEVICE, stream, stream.stamp
            )

    def kernel(self, stream: FakeStream | None = None) -> None:
        """One kernel ran on ``stream`` (default: the current device's current stream):
        the clock advances (timed fakes); on a stream capturing a graph it is recorded
        into the graph instead (rule 10)."""
        graph = self._graph
        if graph is not None:
            if stream is None:
                stream = self.current_stream(torch.device("cuda", self.current_device()))
            if graph.captures(stream):
                graph.ops.append(None)
                return
        if self.timing is not None:
            self.now_s += self.timing.compute_s

    def live_bytes(self, device: int | None = None) -> int:
        """Device memory now: produced tensors and allocations still referenced (and
        freed blocks the allocator may not hand out yet); updates :attr:`peak_bytes`
        and :attr:`peak_by_device`. ``device``: only that device's (its produced tensors
        and live allocations)."""
        with self._lock:
            self._made = [m for m in self._made if not m[0].expired()]
            out = sum(n for _, n, _ in self._made) + self.device_bytes()
            self.peak_bytes = max(self.peak_bytes, out)
            per: Counter[int] = Counter()
            for _, n, d in self._made:
                per[d] += n
            for mem, n in self._device:
                per[mem.stream.device if mem.stream is not None else 0] += n
            for d, n in per.items():
                self.peak_by_device[d] = max(self.peak_by_device[d], n)
            return out if device is None else per[device]

    def allocated_for(self, t: torch.Tensor, stream: FakeStream) -> None:
        """``t``'s memory came from ``stream``'s pool (allocated while it was current):
        freed, it returns there, and every other stream that used it must have been
        ``record_stream``-ed on it first (finding G)."""
        with self._lock:
            stream.stamp += 1
            mem = _Memory(StorageWeakRef(t.untyped_storage()), DEVICE, stream, stream.stamp)
            mem.alloc_stream = stream
            mem.uses.add(stream)
            self._memory[_ptr(t)] = mem
            self._owned.append(mem)

    def pool_stream(self, device: torch.device | None = None) -> FakeStream:
        """A stream taken from the pool as NCCL takes one (``getStreamFromPool``)."""
        return self._from_pool(device)

    def mark_host(self, t: torch.Tensor) -> None:
        """``t`` is in ordinary host memory (read from a store), unless known otherwise."""
        with self._lock:
            if self._known(t) is None:
                self._memory[_ptr(t)] = _Memory(StorageWeakRef(t.untyped_storage()), PAGEABLE)

    def kind(self, t: torch.Tensor) -> str:
        """``"pinned"``, ``"pageable"`` or ``"device"`` (anything not made as host memory)."""
        with self._lock:
            mem = self._known(t)
            return DEVICE if mem is None else mem.kind

    @contextlib.contextmanager
    def capture(self, device: int | None = None) -> Iterator[FakeGraph]:
        """Graph capture on this thread's current stream of ``device`` (default: the
        current device), in global mode (``torch.cuda.graph``): yields the graph work is
        recorded into; that device is current meanwhile, as ``torch.cuda.graph``'s stream
        context makes it. Leaving it raises if an illegal call invalidated it (rule 10)."""
        me = threading.get_ident()
        index = self._ordinal(device)
        stream = self.current_stream(torch.device("cuda", index))
        before = self.current_device()
        self._tls.device = index
        with self._lock:
            graph = self._graph = FakeGraph(self, stream)
            self._capturing.add(me)
            self._capturing_streams.add(stream)
        self._note("begin capture")
        try:
            yield graph
        finally:
            with self._lock:
                self._capturing.discard(me)
                self._capturing_streams.discard(stream)
                self._graph = None
            self._tls.device = before
            self._note("end capture")
        if graph.invalidated is not None:
            raise RuntimeError(
                "CUDA error: operation not permitted when stream is capturing "
                f"(cudaErrorStreamCaptureInvalidated: {graph.invalidated})"
            )

    def _replay(self, graph: FakeGraph) -> None:
        with self._lock:
            if graph.invalidated is not None:
                raise RuntimeError(f"replay of an invalidated graph ({graph.invalidated})")
            self._note(f"replay {len(graph.ops)} ops")
            graph.replays += 1
            for op in graph.ops:
                if op is None:
                    if self.timing is not None:
                        self.now_s += self.timing.compute_s
                    continue
                if op.src is not None and op.snapshot is not None:
                    op.snapshot = op.src.clone()  # a replay reads the memory as it is now
                op.run(self)

    def run_all(self) -> None:
        """Let every queued copy land (the device catches up)."""
        with self._lock:
            for stream in list(self._all_streams):
                self._run(stream, None)
            self._sweep_owned()

    def check_consumed(self, t: torch.Tensor, done: FakeEvent) -> None:
        """Rule 4: the current stream waited for ``done`` and may use ``t``'s memory."""
        with self._lock:
            consumer = self.current_stream(t.device)
            if done.stream is not None and consumer.seen.get(done.stream, 0) < done.stamp:
                self._violate(
                    f"rule 4: {consumer} uses a tensor copied on {done.stream} without "
                    f"waiting for {done}"
                )
            mem = self._known(t)
            if (
                mem is not None
                and mem.stream is not None
                and mem.stream is not consumer
                and consumer not in mem.record_streams
            ):
                self._violate(
                    f"rule 4: {consumer} uses a tensor allocated for {mem.stream} with no "
                    "record_stream (the allocator may reuse it under the consumer)"
                )

    # ------------------------------------------------------------- Runtime
    @staticmethod
    def accelerated(device: torch.device) -> bool:
        return device.type in ("cpu", "cuda")

    def capturing(self, device: torch.device) -> bool:
        return (
            threading.get_ident() in self._capturing
            and self.current_stream(device) in self._capturing_streams
        )

    def capture_stream(self, device: torch.device) -> FakeStream:
        return self.current_stream(device)

    def current_stream(self, device: torch.device) -> FakeStream:
        index = self.index(device)
        stacks: dict[int, list[FakeStream]] = getattr(self._tls, "stacks", {})
        stack = stacks.get(index)
        return stack[-1] if stack else self._defaults[index]

    def stream_capturing(self, stream: object) -> bool:
        return stream in self._capturing_streams

    def new_stream(self, device: torch.device) -> FakeStream:
        if self.stream_pool:
            stream = self._from_pool(device)
        else:
            stream = self._stream(f"copy{next(self._ids)}", side=True, device=self.index(device))
        self._note(f"new_stream -> {stream}")
        return stream

    def _from_pool(self, device: torch.device | None) -> FakeStream:
        with self._lock:
            key = str(device)
            pool = self._pools.setdefault(key, [])
            n = self._pool_next[key]
            self._pool_next[key] += 1
            size = max(self.stream_pool, 1)
            if len(pool) < size:
                index = self.index(device) if device is not None else 0
                pool.append(self._stream(f"pool{key}#{len(pool)}", side=True, device=index))
            return pool[n % size]

    @contextlib.contextmanager
    def use_stream(self, stream: object) -> Iterator[None]:
        assert isinstance(stream, FakeStream)
        stacks: dict[int, list[FakeStream]] = self._tls.__dict__.setdefault("stacks", {})
        contexts: list[FakeStream] = self._tls.__dict__.setdefault("contexts", [])
        stack = stacks.setdefault(stream.device, [])
        stack.append(stream)
        contexts.append(stream)
        before = self.current_device()
        self._tls.device = stream.device  # torch.cuda.stream makes its device current
        self._note(f"enter {stream}")
        try:
            yield
        finally:
            stack.pop()
            contexts.pop()
            self._tls.device = before
            self._note(f"exit {stream}")

    def new_event(self) -> FakeEvent:
        event = FakeEvent(self, next(self._ids))
        self._note(f"new_event -> {event}")
        return event

    def record(self, event: object, stream: object) -> None:
        assert isinstance(event, FakeEvent) and isinstance(stream, FakeStream)
        with self._lock:
            if event.device is not None and event.device != stream.device:
                raise RuntimeError(
                    f"Event device cuda:{event.device} does not match recording stream's "
                    f"device cuda:{stream.device}"
                )
            event.device = stream.device
            event.stream, event.stamp = stream, stream.stamp
            event.seen = dict(stream.seen)
            event.polls_left = self.polls
            event.at_s = stream.busy_s if stream.side else self.now_s
            self._note(f"record {event} on {stream}@{stream.stamp}")

    def wait(self, stream: object, event: object) -> None:
        assert isinstance(event, FakeEvent) and isinstance(stream, FakeStream)
        with self._lock:
            self._note(f"{stream} waits {event}")
            source = event.stream
            if source is None:
                return  # an event never recorded: CUDA treats it as complete
            for s, stamp in [*event.seen.items(), (source, event.stamp)]:
                if stream.seen.get(s, 0) < stamp:
                    stream.seen[s] = stamp
            graph = self._graph
            if graph is not None and graph.captures(source) and not graph.captures(stream):
                graph.joined.add(stream)  # work queued there now joins the capture
                return
            if source is stream:
                return
            if stream.side:
                stream.busy_s = max(stream.busy_s, event.at_s)
                stream.stamp += 1
                stream.queue.append(_Wait(stream, stream.stamp, f"wait {event}", event))
                self._flush(stream)
            else:
                self.now_s = max(self.now_s, event.at_s)  # the compute stream stalls
                self._run(source, event.stamp)  # compute is eager: it waits now

    def copy(self, dst: torch.Tensor, src: torch.Tensor, *, non_blocking: bool) -> None:
        with self._lock:
            self._copy(dst, src, non_blocking)

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        with self._lock:
            stream = self.current_stream(device)
            if stream.side:
                self._violate(
                    f"rule 5: device memory allocated while copy stream {stream} is current "
                    "(the caching allocator keeps its blocks for that stream)"
                )
            stream.stamp += 1
            t = torch.empty(numel, dtype=dtype)
            if device.type == "cuda":  # several devices: it says where it is
                t = on_device(t, stream.device)
            _poison(t)
            nbytes = -(-max(numel * t.element_size(), 1) // 512) * 512
            self._memory[_ptr(t)] = _Memory(
                StorageWeakRef(t.untyped_storage()), DEVICE, stream, stream.stamp, nbytes
            )
            self._sweep_device()
            self._sweep_owned()
            self._device.append((self._memory[_ptr(t)], nbytes))
            self.device_held_bytes += nbytes
            self.live_bytes()
            self._note(f"empty {numel} x {dtype} on {stream}")
            return t

    def pinned(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            self._sweep_pinned()
            block = _pow2(nbytes)
            if self._cached[block]:
                self._cached[block] -= 1  # a cached block: no new pinned memory
            else:
                self.pinned_held_bytes += block
                self.pinned_blocks_made += 1
                self.pinned_peak_bytes = max(self.pinned_peak_bytes, self.pinned_held_bytes)
            t = torch.empty(nbytes, dtype=torch.uint8)
            _poison(t)
            weak = StorageWeakRef(t.untyped_storage())
            self._blocks.append((weak, block))
            self._memory[_ptr(t)] = _Memory(weak, PINNED, nbytes=block)
            self._note(f"pinned {nbytes} B (block {block})")
            return t

    @staticmethod
    def pinned_bytes(nbytes: int) -> int:
        return _pow2(nbytes)

    def pageable(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        with self._lock:
            t = torch.empty(numel, dtype=dtype)
            _poison(t)
            self._memory[_ptr(t)] = _Memory(StorageWeakRef(t.untyped_storage()), PAGEABLE)
            return t

    def record_stream(self, t: torch.Tensor, stream: object) -> None:
        assert isinstance(stream, FakeStream)
        with self._lock:
            self._note(f"record_stream on {stream}")
            mem = self._known(t)
            if mem is not None:
                mem.record_streams.add(stream)

    # ------------------------------------------------------------ internals
    def _note(self, line: str) -> None:
        self.log.append(line)

    def _violate(self, message: str) -> None:
        self.violations.append(message)
        self._note(f"VIOLATION {message}")

    def _known(self, t: torch.Tensor) -> _Memory | None:
        mem = self._memory.get(_ptr(t))
        if mem is None or mem.weak.expired():
            return None
        return mem

    def _check_capture(self, what: str) -> None:
        if self._capturing:
            self._note(f"{what} during capture")
            graph = self._graph
            if graph is not None and graph.invalidated is None:
                graph.invalidated = what
            raise RuntimeError(
                f"CUDA error: operation not permitted when stream is capturing ({what})"
            )

    def _query(self, event: FakeEvent) -> bool:
        with self._lock:
            self._check_capture(f"query {event}")
            stream = event.stream
            if stream is None or self._complete(event):
                self._note(f"query {event} -> True")
                return True
            if self.timing is not None:
                if event.at_s > self.now_s:
                    self._note(f"query {event} -> False")
                    return False
                self._run(stream, event.stamp)
                self._note(f"query {event} -> True")
                return True
            event.polls_left -= 1
            if event.polls_left > 0:
                self._note(f"query {event} -> False")
                return False
            self._run(stream, event.stamp)
            self._note(f"query {event} -> True")
            return True

    def _synchronize(self, event: FakeEvent) -> None:
        with self._lock:
            self._check_capture(f"synchronize {event}")
            self._note(f"synchronize {event}")
            if self.on_block is not None:
                self.on_block(f"synchronize {event}")
            self.now_s = max(self.now_s, event.at_s)  # the host waits: time passes
            if event.stream is not None:
                self._run(event.stream, event.stamp)

    @staticmethod
    def _complete(event: FakeEvent) -> bool:
        stream = event.stream
        return stream is None or not stream.queue or stream.queue[0].stamp > event.stamp

    def _run(self, stream: FakeStream, upto: int | None) -> None:
        """Run ``stream``'s queued work up to stamp ``upto`` (``None``: all of it)."""
        while stream.queue and (upto is None or stream.queue[0].stamp <= upto):
            op = stream.queue.popleft()
            op.run(self)

    def _flush(self, stream: FakeStream) -> None:
        if self.polls == 0 and self.timing is None:
            self._run(stream, None)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> None:
        src_kind, dst_kind = self.kind(src), self.kind(dst)
        stream = self._copy_stream(dst, src, src_kind, dst_kind)
        self._copies += 1
        name = f"copy#{self._copies}"
        nbytes = src.numel() * src.element_size()
        self._note(f"{name} on {stream}: {src_kind} -> {dst_kind}, {nbytes} B")
        if not non_blocking:
            self._check_capture(f"blocking {name}")
        stream.stamp += 1
        op = _Copy(stream, stream.stamp, name)
        self._order_device_side(op, src, dst, src_kind, dst_kind)
        host = dst if dst_kind != DEVICE else (src if src_kind != DEVICE else None)
        if host is not None:
            lo = int(_physical(host).data_ptr())
            span = max(span_of(tuple(host.shape), tuple(host.stride())), 1)
            op.host_range = (lo, lo + span * host.element_size(), host is dst)
            self._order_host_side(op, stream)
        pdst, psrc = _physical(dst), _physical(src)
        _poison(pdst)
        conj = dst.is_conj() != src.is_conj()
        neg = dst.is_neg() != src.is_neg()
        if dst_kind == DEVICE:
            op.dst_weak = _weak(pdst)
            op.dst_memory = self._known(dst)
            op.device_fixup = (conj, neg)
        else:
            op.dst = pdst
            # torch's fix-up of a copy into host memory runs on the host as soon as the
            # copy is queued, before its bytes land (pytorch#146286).
            if conj:
                pdst.conj_physical_()
            if neg:
                pdst.neg_()
        src_memory = self._known(src)
        if src_kind == DEVICE and src_memory is not None and src_memory.stream is not stream:
            # Read on another stream than the one that made it: freed, its memory is
            # reusable at once. (On its own stream, reuse is ordered after the copy.)
            op.src_weak = _weak(psrc)
        elif src_kind == DEVICE:
            op.src = psrc
        elif src_kind == PINNED:
            op.src = psrc
            op.snapshot = None if op.writers else psrc.clone()
        else:
            op.snapshot = psrc.clone()  # pageable: copied out when queued
        graph = self._graph
        if non_blocking and graph is not None and graph.captures(stream):
            graph.ops.append(op)  # recorded into the graph: runs on replay (rule 10)
            self._note(f"{name} recorded into the graph")
            return
        stream.queue.append(op)
        self._time(stream, nbytes, src_kind, dst_kind)
        if not non_blocking:
            if self.on_block is not None:
                self.on_block(f"blocking {name}")
            self._run(stream, None)
        elif stream.side or dst_kind != DEVICE:
            self._flush(stream)
        else:
            self._run(stream, None)  # eager compute uses the result right away

    def _copy_stream(
        self, dst: torch.Tensor, src: torch.Tensor, src_kind: str, dst_kind: str
    ) -> FakeStream:
        """The stream a copy runs on: its device tensor's device's current stream."""
        pairs = ((dst, dst_kind), (src, src_kind))
        devices = [self._device_of(t) for t, k in pairs if k == DEVICE]
        if len(set(devices)) > 1:
            raise RuntimeError(
                f"the fake refuses a copy between cuda:{devices[1]} and cuda:{devices[0]} "
                "(the library never copies between devices)"
            )
        index = devices[0] if devices else self.current_device()
        contexts: list[FakeStream] = getattr(self._tls, "contexts", [])
        if contexts and contexts[-1].device != index:
            self._violate(
                f"a copy of a cuda:{index} tensor inside {contexts[-1]}'s context (cuda:"
                f"{contexts[-1].device}): it runs on cuda:{index}'s current stream, unordered "
                "with the waits made on the stream meant"
            )
        return self.current_stream(torch.device("cuda", index))

    def _device_of(self, t: torch.Tensor) -> int:
        """The device index of device tensor ``t``: where it says it is, or (a view made
        inside a saved-tensor hook, where torch drops the subclass) where its memory was
        made or allocated."""
        if isinstance(t, OnDevice):
            return self.index(t.device)
        mem = self._known(t)
        if mem is not None and mem.stream is not None:
            return mem.stream.device
        return self.index(t.device)

    def _time(self, stream: FakeStream, nbytes: int, src_kind: str, dst_kind: str) -> None:
        """Timed fakes: when the copy just queued on ``stream`` ends."""
        timing = self.timing
        if timing is None or (src_kind == DEVICE) == (dst_kind == DEVICE):
            return
        rate = timing.d2h_bytes_per_s if src_kind == DEVICE else timing.h2d_bytes_per_s
        if PAGEABLE in (src_kind, dst_kind):
            rate /= 2  # staged through a bounce buffer, and the host waits for it
        start = max(stream.busy_s, self.now_s) if stream.side else self.now_s
        end = start + nbytes / rate
        if stream.side:
            stream.busy_s = end
        else:
            self.now_s = end  # on the compute stream: in its order

    def _order_device_side(
        self, op: _Copy, src: torch.Tensor, dst: torch.Tensor, src_kind: str, dst_kind: str
    ) -> None:
        stream = op.stream
        if src_kind == DEVICE:
            mem = self._known(src)
            if mem is not None and _behind(stream, mem.stream, mem.stamp):
                op.leave_poison = "rule 1"
                self._violate(
                    f"rule 1: {op.name} on {stream} reads a device tensor made on "
                    f"{mem.stream} without waiting for an event recorded there after it "
                    "was made (producer stream captured inside the copy stream's context?)"
                )
        if dst_kind == DEVICE:
            mem = self._known(dst)
            if mem is not None and _behind(stream, mem.stream, mem.stamp):
                self._violate(
                    f"rule 5: {op.name} on {stream} writes device memory allocated for "
                    f"{mem.stream} without waiting for that stream after the allocation"
                )

    def _order_host_side(self, op: _Copy, stream: FakeStream) -> None:
        assert op.host_range is not None
        lo, hi, written = op.host_range
        for other in self._all_streams:
            for pending in other.queue:
                if not isinstance(pending, _Copy) or pending.host_range is None:
                    continue
                plo, phi, pwritten = pending.host_range
                if not (plo < hi and lo < phi and (written or pwritten)):
                    continue
                if not _behind(stream, other, pending.stamp):  # ordered after it
                    if pwritten and not written:
                        op.writers.add(id(pending))
                        pending.readers.append(op)
                else:
                    self._violate(
                        f"rule 3: {op.name} on {stream} uses a host buffer that "
                        f"{pending.name} on {other} still uses (reused before that copy "
                        "completed)"
                    )

    def _stream(self, name: str, side: bool, device: int = 0) -> FakeStream:
        with self._lock:
            stream = FakeStream(name, side, device)
            self._all_streams.append(stream)
            return stream

    def _sweep_pinned(self) -> None:
        live = []
        for weak, block in self._blocks:
            if weak.expired():
                self._cached[block] += 1  # freed: the allocator keeps the block cached
            else:
                live.append((weak, block))
        self._blocks = live

    def _sweep_owned(self) -> None:
        live = []
        for mem in self._owned:
            if not mem.weak.expired():
                live.append(mem)
                continue
            for user in sorted(mem.uses - mem.record_streams, key=str):
                if user is not mem.alloc_stream:
                    self._violate(
                        f"rule 2: memory allocated for {mem.alloc_stream} freed to its pool "
                        f"while {user} used it with no record_stream (its kernels may still "
                        "read it when the block is handed out again)"
                    )
        self._owned = live

    def device_bytes(self) -> int:
        """:attr:`device_held_bytes` now (freed blocks found, recorded streams checked)."""
        with self._lock:
            self._sweep_device()
            return self.device_held_bytes

    def _sweep_device(self) -> None:
        """Freed blocks go back to the allocator; one ``record_stream``-ed on a stream
        still busy waits until that stream ran past the work queued when it was freed
        (the allocator's free-time events), as torch's caching allocator does."""
        live = []
        for mem, nbytes in self._device:
            if not mem.weak.expired():
                live.append((mem, nbytes))
                continue
            busy = {s: s.stamp for s in mem.record_streams if s.queue}
            if busy:
                self._deferred.append((nbytes, busy))
            else:
                self.device_held_bytes -= nbytes
        self._device = live
        pending = []
        for nbytes, busy in self._deferred:
            if all(not s.queue or s.queue[0].stamp > stamp for s, stamp in busy.items()):
                self.device_held_bytes -= nbytes
            else:
                pending.append((nbytes, busy))
        self._deferred = pending
