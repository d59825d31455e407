"""The device stager: accelerator tensors to host memory at pack, and back at unpack.

Pack starts an asynchronous device-to-host copy into a host buffer
(:func:`~tensorstore_hooks._staging.copy_to_host`, NOTE [ Stream ordering ]) and
keeps the device tensor only until that copy's event has completed: then the device
memory is free, long before the store write ends. Unpack copies back on a dedicated
stream, and the consuming stream waits on the copy's event. CPU tensors never come
here. Every device-specific step goes through ``ops``
(:class:`~tensorstore_hooks._staging.DeviceOps`), the seam CPU tests drive. What a
record's host copy is and when it changes hands is the record table's
(:class:`~tensorstore_hooks._records.HostCopy`, NOTE [ Record lifecycle ]); the stager
only allocates, copies and gives buffers back.

NOTE [ Host tier wiring ]
Without ``host_budget`` the host buffers come from a :class:`PinnedPool`: a tensor
stays in one only while its write runs (``max_inflight`` bounds them). With a
``host_budget`` every pinned buffer of the pipeline comes from one
:class:`~tensorstore_hooks._host_tier.HostTier` capped by it (NOTE [ Host tier ]):

1. A tensor the rules send to the store (or to ``host``), small enough for the cap,
   is *held*: its record starts HELD and its bytes are copied into a tier buffer,
   and nothing is written. :meth:`DeviceStager.hold` makes room first: the oldest
   held records spill (``spill(rec)``: HELD -> QUEUED, written from their host copy
   by the write-behind, whose completion gives the buffer back), and pack waits for
   that room (``stats.pack_stall_s``).
2. A tensor larger than the whole cap is never held: it is written from the device
   (the store copies it out on an I/O thread; ``max_inflight`` bounds those).
3. Backward reads a held record from its host buffer (:meth:`from_host`, through the
   prefetcher's read-ahead, newest first), a spilled one from the store through a
   buffer borrowed from the tier (``try_take``, rule 5 of NOTE [ Host tier ]); with no
   room to borrow, the copy to the device goes from pageable memory instead (slower,
   never over the cap).
4. A buffer returns to the tier only when no copy uses it any more: a device copy
   still running into it is waited for, and a read still copying out of it defers
   the return to its end (``HostCopy.readers``, rule 4 of NOTE [ Record lifecycle ]).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

import torch

from ._codec import span_of
from ._host_tier import HostTier, round_up
from ._records import HostCopies, HostCopy, Record
from ._staging import CudaOps, DeviceOps, Loaded, PinnedPool, span_bytes
from ._stats import OffloadStats

__all__ = ["DeviceStager"]


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
        self.ops: DeviceOps = CudaOps() if ops is None else ops
        """The device seam (:class:`~tensorstore_hooks._staging.DeviceOps`)."""
        self.pinned: PinnedPool | None = None
        self.tier: HostTier[torch.Tensor] | None = (
            HostTier(host_budget, self._allocate) if host_budget > 0 else None
        )
        """The host tier (``None`` without a ``host_budget``)."""
        self._copying: deque[Record] = deque()  # copies to host not yet seen complete
        self._copying_lock = threading.Lock()

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
    def accelerated(self, device: torch.device) -> bool:
        """Whether tensors on ``device`` leave it through this stager."""
        return bool(self.ops.accelerated(device))

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` goes to the host tier (rule 1) rather than straight to a write."""
        tier = self.tier
        return (
            tier is not None
            and self.accelerated(t.device)
            and round_up(span_bytes(t)) <= tier.cap_bytes
        )

    def stages(self, t: torch.Tensor) -> bool:
        """Whether a write of ``t`` goes through a pooled buffer (no tier: rule 2 otherwise)."""
        return self.tier is None and self.accelerated(t.device)

    # ----------------------------------------------------------------- pack
    def stage(self, rec: Record, t: torch.Tensor) -> None:
        """Start copying ``t`` of QUEUED ``rec`` into a pooled buffer."""
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
        if victims is None:  # the caller checked holds(); kept safe anyway
            return False, 0.0
        for victim in victims:
            assert isinstance(victim, Record)  # the tier's keys here are records
            spill(victim)
        t0 = time.perf_counter()
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
        copy = HostCopy(host, buf, event)
        if not self._copies.attach(rec, copy):  # gone meanwhile (an interrupted pack)
            self.give_back(rec, copy)
            return
        with self._copying_lock:
            self._copying.append(rec)
        self._reap()

    def _reap(self) -> None:
        """Drop device tensors whose copy to host has finished (frees device memory early)."""
        while True:
            with self._copying_lock:
                if not self._copying:
                    return
                copy = self._copying[0].staged
                if copy is not None and copy.event is not None and not copy.event.query():
                    return
                rec = self._copying.popleft()
            self.give_back(rec, self._copies.done(rec))

    def give_back(self, rec: Record, copy: HostCopy | None) -> None:
        """Return ``rec``'s host copy (taken from it by :class:`HostCopies`) to its pool
        or tier; a device copy still writing into it is waited for first."""
        if copy is None:
            return
        if copy.event is not None:
            copy.event.synchronize()
        if self.tier is not None:
            self.tier.release(rec)
        elif self.pinned is not None:
            self.pinned.give(copy.buf)

    # --------------------------------------------------------------- unpack
    def from_host(self, rec: Record) -> Loaded | None:
        """Copy ``rec`` back to its device from its host copy, or ``None`` if it has none.

        Runs on I/O threads (read-ahead) and the unpacking thread; the buffer stays
        ``rec``'s until the copy has completed.
        """
        copy = self._copies.borrow(rec)
        if copy is None:
            return None
        try:
            event = copy.event
            if event is not None:
                event.synchronize()  # the copy to host of a tensor packed a moment ago
            dev, done = self.ops.to_device(copy.host, rec.device, rec.offset)
            if done is not None:
                done.synchronize()  # the buffer may be given back once this returns
        finally:
            if self._copies.end_read(copy):
                self.give_back(rec, copy)
        return (dev, done)

    def to_device(self, t: torch.Tensor, device: torch.device, offset: int) -> Loaded:
        """Copy host tensor ``t`` (read from the store) onto ``device``.

        Goes through a pinned buffer (the pool's, or one borrowed from the tier, rule 3)
        so the copy is asynchronous.
        """
        n = span_bytes(t)
        tier = self.tier
        if tier is not None:
            key = object()
            buf = tier.try_take(key, n)
            self._note_peak()
            if buf is None:  # no room in the tier: pageable copy, never over the cap
                return self.ops.to_device(t, device, offset)
            try:
                return self._through(t, device, offset, buf)
            finally:
                tier.release(key)
        pool = self._pool()
        buf = pool.take(n)
        try:
            return self._through(t, device, offset, buf)
        finally:
            pool.give(buf)

    def _through(
        self, t: torch.Tensor, device: torch.device, offset: int, buf: torch.Tensor
    ) -> Loaded:
        span = span_of(tuple(t.shape), tuple(t.stride()))
        flat = t.as_strided((span,), (1,), t.storage_offset())
        staged = buf[: span * t.element_size()].view(t.dtype)
        staged.copy_(flat)
        host = staged.as_strided(t.shape, t.stride(), 0)
        dev, done = self.ops.to_device(host, device, offset)
        if done is not None:
            done.synchronize()  # the buffer is reusable once the copy is done
        return (dev, done)

    def finish(self, out: Loaded) -> torch.Tensor:
        """The tensor unpack returns: a device copy is ordered on the current stream."""
        t, done = out
        return t if done is None else self.ops.finish(t, done)

    def clear(self) -> None:
        """Drop the idle host buffers (the pipeline is closed)."""
        if self.pinned is not None:
            self.pinned.clear()
        if self.tier is not None:
            self.tier.clear()
