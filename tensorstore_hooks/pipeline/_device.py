"""The device stager: accelerator tensors to host memory at pack, and back at unpack.

Pack starts an asynchronous device-to-host copy into a host buffer
(:func:`~tensorstore_hooks.pipeline._staging.copy_to_host`, NOTE [ Stream ordering ]) and
keeps the device tensor only until that copy's event has completed: then the device
memory is free, long before the store write ends. Unpack copies back on a dedicated
stream, and the consuming stream waits on the copy's event. A buffer a copy still
uses goes back to its pool or tier when that copy's event is seen complete (polled at
every call here), never by blocking the caller (rule 9 of NOTE [ Stream ordering ]).
CPU tensors never come here.
Every device-specific step goes through ``ops``
(:class:`~tensorstore_hooks.pipeline._staging.DeviceOps`), the seam CPU tests drive. What a
record's host copy is and when it changes hands is the record table's
(:class:`~tensorstore_hooks.pipeline._records.HostCopy`, NOTE [ Record lifecycle ]); the stager
only allocates, copies and gives buffers back.

NOTE [ Host tier wiring ]
Without ``host_budget`` the host buffers come from a :class:`PinnedPool`: a tensor
stays in one only while its write runs (``max_inflight`` bounds them). With a
``host_budget`` every pinned buffer of the pipeline comes from one
:class:`~tensorstore_hooks.pipeline._host_tier.SlabTier` capped by it (NOTE [ Host tier ]):

1. A tensor the rules send to the store (or to ``host``), small enough for the cap,
   is *held*: its record starts HELD and its bytes are copied into a tier buffer,
   and nothing is written. :meth:`DeviceStager.hold` makes room first: the oldest
   held records spill (``spill(rec)``: HELD -> QUEUED, written from their host copy
   by the write-behind, whose completion gives the buffer back), and pack waits for
   that room (``stats.pack_stall_s``).
2. A tensor larger than the whole cap is never held, nor one no buffer can take now
   (rule 4 of NOTE [ Host tier ]) or that found no room within ``hold_timeout_s``: it
   is written from the device, copied out on the copy stream into pageable memory by
   the writing I/O thread (:meth:`to_pageable`, after an event recorded on its
   producer at pack: rule 8 of NOTE [ Stream ordering ]); ``max_inflight`` bounds
   those.
3. Backward reads a held record from its host buffer (:meth:`from_host`, through the
   prefetcher's read-ahead, newest first), a spilled one from the store through a
   buffer borrowed from the tier (``try_take``, rule 5 of NOTE [ Host tier ]); with no
   room to borrow, the copy to the device goes from pageable memory instead (slower,
   never over the cap).
4. A buffer returns to the tier only when no copy uses it any more: a copy to host
   still running into it, or a copy back to the device still reading it, defers the
   return until its event completes (polled, never waited for on the caller's
   thread), and a read still using a record's copy defers it to that read's end
   (``HostCopy.readers``, rule 4 of NOTE [ Record lifecycle ]).
5. The tier counts the pinned memory the allocator really holds (rule 1 of NOTE
   [ Host tier ]): its slabs (NOTE [ Pinned slabs ]: powers of two, which torch's
   pinned allocator holds exactly, :func:`~tensorstore_hooks.pipeline._staging.pinned_block_bytes`),
   each tensor a 4 KiB-aligned range of one; slabs are never dropped while the
   pipeline lives (torch keeps freed pinned blocks cached, so dropping one would free
   nothing).

NOTE [ Copy window ]
Copies to host may lag the kernels that make the tensors (a d2h copy of a large
block can take ~16x its forward), and a saved tensor stays on the device until its
copy is seen complete. So the device bytes whose copy to host still runs are bounded,
per device, on every path that copies at pack (the host tier, the pool, spills):

1. The window is the write-behind's ``max_inflight`` (derived or given): beyond it,
   the oldest copies are waited for by the current stream, on the device
   (``wait_current``: never a host block on the training thread), and their saved
   tensors are dropped at once. Kernels queued later on that stream, the ones that
   would reuse the memory, run only after the copy has read it; memory of another
   stream's pool is ``record_stream``-ed on its producer (rule 2 of NOTE [ Stream
   ordering ]).
2. The newest copy always runs, even alone over the window.
3. A dropped tensor's copy keeps its event: host readers of the bytes (a spill's
   write, a copy back) still wait for it.
4. A tensor still on the device when backward needs it is used in place: the
   read-ahead skips it and unpack returns it, nothing is copied back.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

import torch

from tensorstore_hooks._codec import span_of
from tensorstore_hooks.pipeline._host_tier import SlabTier
from tensorstore_hooks.pipeline._records import HostCopies, HostCopy, Record
from tensorstore_hooks.pipeline._staging import (
    CopyEvent,
    CudaOps,
    DeviceOps,
    Loaded,
    PinnedPool,
    span_bytes,
)
from tensorstore_hooks.pipeline._stats import OffloadStats

__all__ = ["DeviceStager"]


def _cut(slab: torch.Tensor, offset: int, nbytes: int) -> torch.Tensor:
    """A tensor's range of a pinned slab (NOTE [ Pinned slabs ])."""
    return slab[offset : offset + nbytes]


def _keep(_alive: torch.Tensor, release: Callable[[], None] | None = None) -> None:
    """A buffer return whose closure also kept a tensor copied back alive until now."""
    if release is not None:
        release()


class DeviceStager:
    """Host buffers (a pool, or the host tier when ``host_budget > 0``) and device copies.

    ``idle_cap``: idle pooled buffers kept without a host tier. ``stats``: the
    pipeline's counters (``pinned_allocations``, ``peak_host_tier_bytes``).
    ``hold_timeout_s``: the longest pack waits for room in the tier before it writes
    the tensor from the device instead.
    """

    def __init__(
        self,
        copies: HostCopies,
        *,
        idle_cap: int,
        host_budget: int = 0,
        stats: OffloadStats | None = None,
        hold_timeout_s: float = 60.0,
        ops: DeviceOps | None = None,
    ) -> None:
        self._copies = copies
        self._idle_cap = idle_cap
        self._stats = stats
        self.hold_timeout_s = hold_timeout_s
        self._ops: DeviceOps = CudaOps() if ops is None else ops
        self._accelerated: dict[torch.device, bool] = {}  # asked at every pack: cached
        self.pinned: PinnedPool | None = None
        self.tier: SlabTier[torch.Tensor] | None = (
            SlabTier(host_budget, self._allocate, _cut)  # rule 5 of NOTE [ Host tier wiring ]
            if host_budget > 0
            else None
        )
        """The host tier (``None`` without a ``host_budget``)."""
        # Copies to host not yet seen complete, per device (finding L: one device's
        # lagging copy does not hold another's reaping), and their device bytes.
        self._copying: dict[torch.device, deque[Record]] = {}
        self._copying_bytes: dict[torch.device, int] = {}
        self._copying_lock = threading.Lock()
        self.copy_window: Callable[[], int] = lambda: 0
        """Device bytes whose copy to host may still run (NOTE [ Copy window ]); the
        pipeline wires it to the write-behind's ``max_inflight``."""
        # Buffer returns waiting for a copy's event (rule 4), oldest first.
        self._waiting: deque[tuple[CopyEvent, Callable[[], None]]] = deque()
        self._waiting_lock = threading.Lock()
        # Streams pack saw capturing a graph: while one still is, nothing here queries
        # or waits on an event, on any thread (rule 10 of NOTE [ Stream ordering ]).
        self._captures: set[object] = set()
        self._captures_lock = threading.Lock()
        self._single: dict[str, bool] = {}  # device kind -> only one such device

    def _allocate(self, nbytes: int) -> torch.Tensor:
        if self._stats is not None:
            self._stats.pinned_allocations += 1
        return self.ops.allocate(nbytes)

    def _pool(self) -> PinnedPool:
        if self.pinned is None:
            self.pinned = PinnedPool(cap_bytes=self._idle_cap, allocate=self._allocate)
        return self.pinned

    def _note_peak(self) -> None:
        if self._stats is not None and self.tier is not None:
            used = self.tier.used_bytes
            if used > self._stats.peak_host_tier_bytes:
                self._stats.peak_host_tier_bytes = used

    # --------------------------------------------------------------- routing
    @property
    def ops(self) -> DeviceOps:
        """The device seam (:class:`~tensorstore_hooks.pipeline._staging.DeviceOps`)."""
        return self._ops

    @ops.setter
    def ops(self, ops: DeviceOps) -> None:
        self._ops = ops
        self._accelerated = {}

    def accelerated(self, device: torch.device) -> bool:
        """Whether tensors on ``device`` leave it through this stager."""
        try:
            return self._accelerated[device]
        except KeyError:
            known = self._accelerated[device] = bool(self._ops.accelerated(device))
            return known

    def capturing(self, device: torch.device) -> bool:
        """Whether a graph is being captured on ``device`` (rule 10 of NOTE [ Stream
        ordering ]: nothing may query or wait on an event then). A capture on the
        current device while ``device`` is another (finding L) leaves ``device``'s
        tensors free to move, but makes every thread :meth:`quiet` too: CUDA's global
        capture mode forbids event queries whatever the device."""
        if not self.accelerated(device):
            return False
        ops = self.ops
        if ops.capturing(device):
            seen = device
        elif (
            device.index is not None
            and not self._one_device(device.type)
            and ops.capturing(current := torch.device(device.type))
        ):
            seen = current  # the current device (index None) captures: quiet, not kept
        else:
            return False
        with self._captures_lock:
            self._captures.add(ops.capture_stream(seen))
        return seen is device

    def _one_device(self, kind: str) -> bool:
        """Whether the process has a single device of ``kind`` (then the current device
        is the tensor's: no second capture check at pack). Asked once per kind."""
        one = self._single.get(kind)
        if one is None:
            one = self._single[kind] = kind == "cuda" and torch.cuda.device_count() == 1
        return one

    def quiet(self) -> bool:
        """Whether a graph capture pack saw is still running: no thread may query or
        wait on an event now (rule 10 of NOTE [ Stream ordering ], global mode)."""
        if not self._captures:  # the common case: one read, no lock
            return False
        with self._captures_lock:
            self._captures = {s for s in self._captures if self.ops.stream_capturing(s)}
            return bool(self._captures)

    def _wait_capture(self) -> None:
        """On an I/O thread, before a blocking copy: wait for a capture to end."""
        while self.quiet():
            time.sleep(0.001)

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` goes to the host tier (rule 1) rather than straight to a write."""
        if self.tier is None:  # the common case without a host tier: no span computed
            return False
        return self.holds_bytes(span_bytes(t), t.device)

    def holds_bytes(self, nbytes: int, device: torch.device) -> bool:
        """Whether ``nbytes`` leaving ``device`` go to the host tier (rule 1)."""
        tier = self.tier
        return tier is not None and self.accelerated(device) and tier.fits(nbytes)

    def _moved(self, nbytes: int, *, to_host: bool) -> None:
        """Count bytes copied between the device and host memory (``stats``)."""
        stats = self._stats
        if stats is not None:
            if to_host:
                stats.bytes_to_host += nbytes
            else:
                stats.bytes_to_device += nbytes

    def stages(self, t: torch.Tensor) -> bool:
        """Whether a write of ``t`` goes through a pooled buffer (no tier: rule 2 otherwise)."""
        return self.tier is None and self.accelerated(t.device)

    # ----------------------------------------------------------------- pack
    def stage(self, rec: Record, t: torch.Tensor) -> None:
        """Start copying ``t`` of QUEUED ``rec`` into a pooled buffer."""
        self._poll()
        buf = self._pool().take(span_bytes(t))
        self._started(rec, t, buf)

    def hold(
        self, rec: Record, t: torch.Tensor, spill: Callable[[Record], None]
    ) -> tuple[bool, float]:
        """Copy ``t`` of HELD ``rec`` into the tier, spilling the oldest held records first.

        ``spill(victim)`` is called for each record that must leave the tier to make
        room (rule 1). Returns ``(held, waited_s)``: ``held`` is ``False`` when no room
        came within ``hold_timeout_s`` (the caller then writes the tensor from the
        device).
        """
        tier = self.tier
        assert tier is not None
        victims = tier.make_room(rec, span_bytes(t))
        if victims is None:  # no buffer can take it now (rule 4 of NOTE [ Host tier ])
            return False, 0.0
        for victim in victims:
            assert isinstance(victim, Record)  # the tier's keys here are records
            spill(victim)
        t0 = time.perf_counter()
        if self._waiting and not tier.can_take(rec):
            self._settle()  # buffers waiting on copies may be the room pack needs
        try:
            buf = tier.take(rec, self.hold_timeout_s)
        except TimeoutError:
            return False, time.perf_counter() - t0
        waited = time.perf_counter() - t0
        self._note_peak()
        self._started(rec, t, buf)
        return True, waited

    def _started(self, rec: Record, t: torch.Tensor, buf: torch.Tensor) -> None:
        host, event = self.ops.to_host(t, buf)
        self._moved(span_bytes(t), to_host=True)
        copy = HostCopy(host, buf, event)
        if not self._copies.attach(rec, copy):  # gone meanwhile (an interrupted pack)
            self.give_back(rec, copy)
            return
        with self._copying_lock:
            self._copying.setdefault(rec.device, deque()).append(rec)
            self._copying_bytes[rec.device] = (
                self._copying_bytes.get(rec.device, 0) + rec.device_nbytes
            )
        self._reap()
        self._bound(rec.device)
        self._poll()

    def _reap(self) -> None:
        """Drop device tensors whose copy to host has finished (frees device memory early)."""
        if self.quiet():
            return
        for device in list(self._copying):
            while True:
                with self._copying_lock:
                    queue = self._copying[device]
                    if not queue:
                        break
                    copy = queue[0].staged
                    if copy is not None and copy.event is not None and not copy.event.query():
                        break
                    rec = queue.popleft()
                    self._copying_bytes[device] -= rec.device_nbytes
                self.give_back(rec, self._copies.done(rec))

    def _bound(self, device: torch.device) -> None:
        """Keep the device bytes whose copy to host still runs within the window: the
        oldest copies beyond it are waited for by the current stream (on the device)
        and their saved tensors dropped now (NOTE [ Copy window ])."""
        window = self.copy_window()
        victims: list[Record] = []
        with self._copying_lock:
            queue = self._copying[device]
            while len(queue) > 1 and self._copying_bytes[device] > window:
                rec = queue.popleft()  # the newest copy always runs, even alone over it
                self._copying_bytes[device] -= rec.device_nbytes
                victims.append(rec)
        for rec in victims:
            copy = rec.staged
            if copy is not None and copy.event is not None:
                self.ops.wait_current(device, copy.event)
            self.give_back(rec, self._copies.let_go(rec))

    def producer_event(self, t: torch.Tensor) -> CopyEvent:
        """At pack, for ``t`` written without a host copy: an event on its producer,
        for :meth:`to_pageable` on the writing thread (rule 8)."""
        return self.ops.producer_event(t)

    def to_pageable(self, t: torch.Tensor, ready: CopyEvent) -> torch.Tensor:
        """``t``'s bytes in pageable host memory, copied on the copy stream after
        ``ready`` (:meth:`producer_event`); blocks the calling (I/O) thread until done."""
        self._moved(span_bytes(t), to_host=True)
        self._wait_capture()  # a blocking copy would invalidate the user's capture
        return self.ops.to_pageable(t, ready)

    def pin(self, t: torch.Tensor) -> Loaded:
        """A ``host`` rule's pinned copy of ``t`` (no ``host_budget``: not the tier's),
        queued on the producing stream, and the event recorded there after it (rule 8
        of NOTE [ Stream ordering ]): the caller keeps both, for :meth:`unpin`."""
        self._moved(span_bytes(t), to_host=True)
        return self.ops.pin(t)

    def unpin(
        self, host: torch.Tensor, device: torch.device, ready: CopyEvent | None
    ) -> torch.Tensor:
        """A ``host`` rule's tensor back on ``device``, on the current stream once it
        has waited (on the device) for ``ready``, the event :meth:`pin` returned: pack
        and unpack may run on different streams."""
        self._moved(span_bytes(host), to_host=False)
        return self.ops.unpin(host, device, ready)

    # ----------------------------------------------------------- buffer returns
    def give_back(self, rec: Record, copy: HostCopy | None) -> None:
        """Return ``rec``'s host copy (taken from it by :class:`HostCopies`) to its pool
        or tier: now, or once a copy to host still writing into it has completed."""
        if copy is None:
            return
        # The closure holds ``copy`` (and a saved tensor it keeps) until the copy is done.
        self._after(copy.event, lambda: self._return(rec, copy))

    def _return(self, rec: Record, copy: HostCopy) -> None:
        if self.tier is not None:
            self.tier.release(rec)
        elif self.pinned is not None:
            self.pinned.give(copy.buf)

    def _after(self, event: CopyEvent | None, release: Callable[[], None]) -> None:
        """Run ``release`` once ``event`` has completed: now if it has (or is ``None``),
        else at a later :meth:`_poll` (rule 9: nobody blocks on it)."""
        if event is None:
            release()
            return
        with self._waiting_lock:
            self._waiting.append((event, release))
        self._poll()

    def _poll(self) -> None:
        """Run the buffer returns whose copies have completed (never blocks)."""
        if not self._waiting or self.quiet():  # the common case: one read, no lock
            return
        done: list[Callable[[], None]] = []
        with self._waiting_lock:
            left: deque[tuple[CopyEvent, Callable[[], None]]] = deque()
            for event, release in self._waiting:
                if event.query():
                    done.append(release)
                else:
                    left.append((event, release))
            self._waiting = left
        for release in done:
            release()

    def _settle(self) -> None:
        """Wait for every copy a buffer return waits on, then return the buffers (pack
        about to wait for room in the tier; at close)."""
        self._wait_capture()
        while True:
            with self._waiting_lock:
                if not self._waiting:
                    return
                event, release = self._waiting.popleft()
            event.synchronize()
            release()

    # --------------------------------------------------------------- unpack
    def from_host(self, rec: Record) -> Loaded | None:
        """Start copying ``rec`` back to its device from its host copy (``None``: it has
        none). The copy waits on the device for a copy to host still running; the
        buffer stays ``rec``'s until the copy back has completed (rule 4 of NOTE
        [ Host tier wiring ]). Runs on I/O threads and the unpacking thread.
        """
        self._poll()
        copy = self._copies.borrow(rec)
        if copy is None:
            return None
        try:
            out = self.ops.to_device(copy.host, rec.device, copy.event)
            self._moved(span_bytes(copy.host), to_host=False)
        except BaseException:
            self._end_read(rec, copy)
            raise
        # The closure keeps the tensor coming back referenced until its copy completed
        # (finding I: the copy stream is not record_stream-ed on it).
        self._after(out[1], lambda: self._end_read(rec, copy, out[0]))
        return out

    def _end_read(self, rec: Record, copy: HostCopy, _dev: torch.Tensor | None = None) -> None:
        if self._copies.end_read(copy):
            self.give_back(rec, copy)

    def to_device(self, t: torch.Tensor, device: torch.device) -> Loaded:
        """Start copying host tensor ``t`` (read from the store) onto ``device``.

        Goes through a pinned buffer (the pool's, or one borrowed from the tier, rule 3)
        so the copy is asynchronous; the buffer goes back when the copy has completed.
        """
        self._poll()
        n = span_bytes(t)
        self._moved(n, to_host=False)
        tier = self.tier
        if tier is not None:
            key = object()
            buf = tier.try_take(key, n)
            self._note_peak()
            if buf is None:  # no room in the tier: pageable copy, never over the cap
                dev, done = self.ops.to_device(t, device)
                self._after(done, lambda: _keep(dev))  # until its copy completed (finding I)
                return dev, done
            return self._through(t, device, buf, lambda: tier.release(key))
        pool = self._pool()
        buf = pool.take(n)
        return self._through(t, device, buf, lambda: pool.give(buf))

    def _through(
        self,
        t: torch.Tensor,
        device: torch.device,
        buf: torch.Tensor,
        release: Callable[[], None],
    ) -> Loaded:
        try:
            span = span_of(tuple(t.shape), tuple(t.stride()))
            flat = t.as_strided((span,), (1,), t.storage_offset())
            staged = buf[: span * t.element_size()].view(t.dtype)
            staged.copy_(flat)  # host to pinned host: synchronous
            # ``buf`` may be a range of a slab: its own offset (NOTE [ Pinned slabs ]).
            host = staged.as_strided(t.shape, t.stride(), staged.storage_offset())
            dev, done = self.ops.to_device(host, device)
        except BaseException:
            release()
            raise
        self._after(done, lambda: _keep(dev, release))  # ``dev`` too (finding I)
        return dev, done

    def finish(self, out: Loaded) -> torch.Tensor:
        """The tensor unpack returns: a device copy is ordered on the current stream."""
        t, done = out
        return t if done is None else self.ops.finish(t, done)

    def clear(self) -> None:
        """Drop the idle host buffers (the pipeline is closed)."""
        self._settle()
        if self.pinned is not None:
            self.pinned.clear()
        if self.tier is not None:
            self.tier.clear()
