"""The device stager: accelerator tensors to host memory at pack, and back at unpack.

Pack starts an asynchronous device-to-host copy into a host buffer
(:func:`~tensorstore_hooks._staging.copy_to_host`, NOTE [ Stream ordering ]) and
keeps the device tensor only until that copy's event has completed: then the device
memory is free, long before the store write ends. Unpack copies back on a dedicated
stream, and the consuming stream waits on the copy's event. CPU tensors never come
here. Every device-specific step goes through ``ops``
(:class:`~tensorstore_hooks._staging.CudaOps`), the seam CPU tests drive.

NOTE [ Host tier wiring ]
Without ``host_budget`` the host buffers come from a :class:`PinnedPool`: a tensor
stays in one only while its write runs (``max_inflight`` bounds them). With a
``host_budget`` every pinned buffer of the session comes from one
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
   the return to its end (:class:`HostCopy` ``readers``).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from ._codec import span_of
from ._host_tier import HostTier, round_up
from ._records import Record, RecordTable, State
from ._staging import CudaOps, PinnedPool, span_bytes

__all__ = ["DeviceStager", "HostCopy"]


class HostCopy:
    """A record's host copy: ``host`` is the view, ``buf`` the buffer it lives in.

    ``event`` is the copy's device event (``None`` once it has completed); ``readers``
    counts copies back to the device running out of ``buf``, and ``orphaned`` says
    the buffer is to be returned when the last of them ends (rule 4 of NOTE [ Host
    tier wiring ]).
    """

    __slots__ = ("buf", "event", "host", "orphaned", "readers")

    def __init__(self, host: torch.Tensor, buf: torch.Tensor, event: Any) -> None:
        self.host = host
        self.buf = buf
        self.event: Any = event
        self.readers = 0
        self.orphaned = False


class DeviceStager:
    """Host buffers (a pool, or the host tier when ``host_budget > 0``) and device copies.

    ``idle_cap``: idle pooled buffers kept without a host tier. ``stats``: the
    session's counters (``pinned_allocations``, ``peak_host_tier_bytes``).
    ``hold_timeout_s``: the longest pack waits for room in the tier before it writes
    the tensor from the device instead.
    """

    def __init__(
        self,
        table: RecordTable,
        *,
        idle_cap: int,
        host_budget: int = 0,
        stats: Any = None,
        hold_timeout_s: float = 60.0,
        ops: Any = None,
    ) -> None:
        self._table = table
        self._idle_cap = idle_cap
        self._stats = stats
        self.hold_timeout_s = hold_timeout_s
        self.ops: Any = CudaOps() if ops is None else ops
        """The device seam (:class:`~tensorstore_hooks._staging.CudaOps`)."""
        self.pinned: PinnedPool | None = None
        self.tier: HostTier | None = (
            HostTier(host_budget, self._allocate) if host_budget > 0 else None
        )
        """The host tier (``None`` without a ``host_budget``)."""
        self._pending: deque[Record] = deque()

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
        """Start copying ``t`` of QUEUED ``rec`` into a pooled buffer (call without the lock)."""
        buf = self._pool().take(span_bytes(t))
        self._started(rec, t, buf)

    def hold(
        self, rec: Record, t: torch.Tensor, spill: Callable[[Record], None]
    ) -> tuple[bool, float]:
        """Copy ``t`` of HELD ``rec`` into the tier, spilling the oldest held records first.

        Call without the lock. ``spill(victim)`` is called for each record that must
        leave the tier to make room (rule 1). Returns ``(held, waited_s)``: ``held``
        is ``False`` when no room came within ``hold_timeout_s`` (the caller then
        writes the tensor from the device).
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
        with self._table.lock:
            if rec.state != State.HELD:  # gone before it was copied (an interrupted pack)
                tier.release(rec)
                return True, waited
        self._started(rec, t, buf)
        return True, waited

    def _started(self, rec: Record, t: torch.Tensor, buf: torch.Tensor) -> None:
        host, event = self.ops.to_host(t, buf)
        rec.staged = HostCopy(host, buf, event)
        with self._table.lock:
            self._pending.append(rec)
            self._reap()

    def _reap(self) -> None:
        """Drop device tensors whose copy to host has finished (frees device memory early)."""
        pending = self._pending
        while pending:
            staged = pending[0].staged
            if staged is not None and staged.event is not None and not staged.event.query():
                break
            self.copied(pending.popleft())

    def copied(self, rec: Record) -> None:
        """``rec``'s copy to host has completed: check its version, drop the device tensor.

        Lock held. A tensor modified in place before the copy ran makes the record DIRTY
        (NOTE [ In-place checks ]); its host copy is worthless and goes back at once.
        """
        staged = rec.staged
        if staged is None:
            return
        staged.event = None
        if rec.source is not None and rec.state in (State.HELD, State.QUEUED, State.WRITING):
            if rec.modified():
                rec.move(State.DIRTY)
            rec.drop_source()
        if rec.state == State.DIRTY:
            self.release(rec)

    def release(self, rec: Record) -> None:
        """Give ``rec``'s host buffer back (lock held); deferred while a read uses it."""
        staged, rec.staged = rec.staged, None
        if staged is None:
            return
        if staged.readers:
            staged.orphaned = True  # the last reader gives it back (rule 4)
        else:
            self._give(rec, staged)

    def _give(self, rec: Record, staged: HostCopy) -> None:
        if staged.event is not None:  # a device copy may still be writing into it
            staged.event.synchronize()
            staged.event = None
        if self.tier is not None:
            self.tier.release(rec)
        elif self.pinned is not None:
            self.pinned.give(staged.buf)

    # --------------------------------------------------------------- unpack
    def from_host(self, rec: Record) -> Any:
        """Copy ``rec`` back to its device from its host copy, or ``None`` if it has none.

        Returns what :meth:`finish` takes. Runs on I/O threads (read-ahead) and the
        unpacking thread; the buffer stays ``rec``'s until the copy has completed.
        """
        if rec.staged is None:  # the common case (CPU tensors, stored ones): no lock
            return None
        with self._table.lock:
            staged = rec.staged
            if staged is None:
                return None
            staged.readers += 1
        try:
            event = staged.event
            if event is not None:
                event.synchronize()  # the copy to host of a tensor packed a moment ago
            dev, done = self.ops.to_device(staged.host, rec.device, rec.offset)
            if done is not None:
                done.synchronize()  # the buffer may be given back once this returns
        finally:
            with self._table.lock:
                staged.readers -= 1
                if staged.orphaned and staged.readers == 0:
                    staged.orphaned = False
                    self._give(rec, staged)
        return (dev, done)

    def to_device(self, t: torch.Tensor, device: torch.device, offset: int) -> Any:
        """Copy host tensor ``t`` (read from the store) onto ``device``.

        Goes through a pinned buffer (the pool's, or one borrowed from the tier, rule 3)
        so the copy is asynchronous; returns what :meth:`finish` takes.
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
    ) -> Any:
        span = span_of(tuple(t.shape), tuple(t.stride()))
        flat = t.as_strided((span,), (1,), t.storage_offset())
        staged = buf[: span * t.element_size()].view(t.dtype)
        staged.copy_(flat)
        host = staged.as_strided(t.shape, t.stride(), 0)
        dev, done = self.ops.to_device(host, device, offset)
        if done is not None:
            done.synchronize()  # the buffer is reusable once the copy is done
        return (dev, done)

    def finish(self, out: Any) -> torch.Tensor:
        """The tensor unpack returns: a device copy is ordered on the current stream."""
        if isinstance(out, tuple):  # (tensor, done event or None)
            t, done = out
            return t if done is None else self.ops.finish(t, done)
        return out

    def clear(self) -> None:
        """Drop the idle host buffers (the session is closed)."""
        if self.pinned is not None:
            self.pinned.clear()
        if self.tier is not None:
            self.tier.clear()
