"""The write-behind: saved tensors' bytes into the store on I/O threads, pack not waiting.

NOTE [ In-place checks ]
With saved-tensor hooks active, torch no longer checks that a saved tensor was not
modified in place. So every record remembers ``t._version`` at pack. The writer
checks it before copying and again after (a version bump happens on the host before
the in-place kernel runs, so an overlapping write is always seen by the second
check); kept tensors are checked at unpack. A modified tensor makes unpack raise
torch's usual error rather than return later values.

Once its bytes are stored the record drops the tensor (that frees the memory), but
keeps a *weak* reference to the saved tensor (the object pack received: the user's
tensor itself, also for ops that save their output) and checks its version at every
unpack. Whether the write had finished therefore never decides whether backward
raises: a tensor someone modifies in place is alive, and one that died cannot be
modified. (A ``detach()``-ed alias shares the counter and may outlive the saved
tensor; modifying only that alias after the saved tensor died goes unseen. Paddle
guards hold no weak reference: there the check ends with the write.)

Pack blocks while more than ``max_inflight`` bytes are queued or being written
(backpressure; a single larger tensor still goes alone). A write that fails or is
refused keeps the tensor in memory (fallback: counted, warned once). A record served
from memory before its write ran (the tail shortcut) cancels the write; a write
already under way deletes what it wrote once it sees the record unwanted.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from ._iopool import WRITE
from ._parts import PipelineUnit, SessionParts
from ._records import Record, State
from ._trace import WRITE_RANGE, Timeline, span
from .errors import StoreClosedError

__all__ = ["WriteBehind"]

log = logging.getLogger("tensorstore_hooks")


class _Dirty(Exception):
    """Internal: the saved tensor changed in place before its bytes were copied."""


class WriteBehind(PipelineUnit):
    """Queues records for writing, bounds the bytes in flight, falls back on failures."""

    def __init__(self, parts: SessionParts, *, max_inflight: int) -> None:
        super().__init__(parts)
        self.max_inflight = max_inflight
        self._inflight = 0
        self._warned = False
        self._pending_warning: str | None = None
        self.timeline: Timeline | None = None  # set while hooks.trace() records

    @property
    def inflight(self) -> int:
        """Bytes queued or being written."""
        return self._inflight

    # ----------------------------------------------------------------- queue
    def admit(self, nbytes: int) -> None:
        """Block while ``nbytes`` more would exceed ``max_inflight`` (lock held)."""
        if self._inflight and self._inflight + nbytes > self.max_inflight:
            t0 = time.perf_counter()
            while self._inflight and self._inflight + nbytes > self.max_inflight:
                self._table.cond.wait(0.05)
            self._stats.pack_stall_s += time.perf_counter() - t0

    def count(self, rec: Record) -> None:
        """Count a new record as offloaded (lock held; a ``host`` rule's is counted as host)."""
        if not rec.host_rule:
            self._stats.tensors_offloaded += 1
            self._stats.bytes_offloaded += rec.nbytes

    def enqueue(self, rec: Record) -> None:
        """Count a QUEUED record in flight (lock held); then :meth:`start` it."""
        self._inflight += rec.nbytes
        self._stats.hold(rec.nbytes)

    def start(self, rec: Record, t: torch.Tensor) -> None:
        """Submit ``rec``'s write (call without the lock): stage device tensors first."""
        if self._stager.stages(t):
            self._stager.stage(rec, t)
        self._io().submit(WRITE, self._write, rec)

    # ------------------------------------------------------------ host tier
    def hold(self, rec: Record, t: torch.Tensor) -> None:
        """Put HELD ``rec`` in the host tier (call without the lock; NOTE [ Host tier
        wiring ]); with no room in time, write it from the device instead."""
        held, waited_s = self._stager.hold(rec, t, self.spill)
        with self._table.lock:
            self._stats.pack_stall_s += waited_s
            if held or rec.state != State.HELD:
                return
            rec.move(State.QUEUED)
            self.enqueue(rec)
        log.debug("host tier: no room within %gs, writing record %d directly", waited_s, rec.pos)
        self.start(rec, t)

    def spill(self, rec: Record) -> None:
        """Write HELD ``rec`` to the store from its host copy: the tier needs its room."""
        with self._table.lock:
            if rec.state != State.HELD:  # freed meanwhile: its release gave the room back
                return
            rec.move(State.QUEUED)
            self.enqueue(rec)
            self._stats.tensors_spilled += 1
            self._stats.bytes_spilled += rec.nbytes
        log.debug("host tier: spilling record %d (%d B)", rec.pos, rec.nbytes)
        self._io().submit(WRITE, self._write, rec)

    def cancel(self, rec: Record) -> None:
        """Tail shortcut: ``rec`` is served from memory, its write is not wanted (lock held)."""
        if rec.state != State.MEMORY:
            rec.move(State.MEMORY)
            self._stats.tail_hits += 1

    # ----------------------------------------------------------------- write
    def _put(self, src: torch.Tensor) -> str:
        """The one place a saved tensor's bytes are copied out (into the store)."""
        return self._store.put(src)

    def _write(self, rec: Record) -> None:
        """Writer thread: move one record's bytes into the store."""
        lock = self._table.lock
        with lock:
            if rec.state != State.QUEUED:  # freed, or served from memory, before it ran
                self._finished(rec)
                return
            rec.move(State.WRITING)
            rec.write_started = True
            staged = rec.staged
            event = staged.event if staged is not None else None
            src = staged.host if staged is not None else rec.source
        key: str | None = None
        error: BaseException | None = None
        orig: Any = None
        try:
            if event is not None:
                event.synchronize()
                with lock:
                    self._stager.copied(rec)
            if src is None or rec.state == State.DIRTY:
                raise _Dirty()
            orig = rec.guard  # the saved tensor (``src`` is its pinned copy for CUDA)
            if orig is not None and orig._version != rec.version:
                raise _Dirty()
            t0 = time.perf_counter()  # NOTE [ Profiler ranges ]
            with span(WRITE_RANGE, self.timeline, {"bytes": rec.nbytes}):
                key = self._put(src)
            write_s = time.perf_counter() - t0
            with lock:
                self._stats.write_s += write_s
                self._stats.bytes_written += rec.nbytes
            log.debug("write: record %d, %d B in %.2f ms", rec.pos, rec.nbytes, write_s * 1e3)
            if orig is not None and orig._version != rec.version:
                raise _Dirty()
        except _Dirty:
            with lock:
                if rec.state == State.WRITING:
                    rec.move(State.DIRTY)
                if rec.state == State.DIRTY:
                    rec.drop_source()
        except BaseException as e:
            error = e
        del src, orig  # the record alone decides how long the tensor lives
        with lock:
            if error is not None:
                if rec.state == State.WRITING:
                    self._fallback(rec, error)
            elif key is not None and rec.state == State.WRITING:
                rec.move(State.STORED)
                rec.key = key
                rec.drop_source()
                key = None
                self._stager.release(rec)
        if key is not None:
            # Freed or served from memory while writing: the bytes are not wanted. Delete
            # them before the write counts as finished, so flush() covers the delete too.
            self.discard(key)
        with lock:
            self._finished(rec)
        self._heap.note(rec.nbytes)

    def _finished(self, rec: Record) -> None:
        with self._table.lock:
            if rec.state in (State.FREED, State.DIRTY):
                self._stager.release(rec)  # its host copy is not wanted any more
            self._inflight -= rec.nbytes
            self._stats.hold(-rec.nbytes)
            self._table.cond.notify_all()
        rec.writing_done.set()

    def _fallback(self, rec: Record, error: BaseException) -> None:
        """Keep the tensor in memory after a failed or refused write (lock held)."""
        rec.move(State.MEMORY)
        rec.error = error
        if rec.source is None and rec.staged is not None:
            # Device tensor already released: a pageable copy of the host copy is the
            # tensor now (unpack moves it back to its device), the buffer goes back.
            rec.source = rec.staged.host.clone()
            self._stager.release(rec)
        stats = self._stats
        stats.fallbacks += 1
        if not rec.host_rule:
            stats.tensors_offloaded -= 1
            stats.bytes_offloaded -= rec.nbytes
            stats.tensors_kept += 1
            stats.bytes_kept += rec.nbytes
        if not self._warned:
            self._warned = True
            self._pending_warning = (
                f"tensorstore-hooks: the store {self._store.url} could not take a saved "
                f"tensor ({type(error).__name__}: {error}); keeping such tensors in memory "
                "instead. Training continues; hooks.stats.fallbacks counts them."
            )
        # One warning per session (above); each tensor only at DEBUG.
        log.debug("write to %s failed, tensor kept in memory: %r", self._store.url, error)

    def take_warning(self) -> str | None:
        """The one-time fallback warning, once (the caller issues it on its own thread)."""
        msg, self._pending_warning = self._pending_warning, None
        return msg

    # -------------------------------------------------------------- cleanup
    def discard(self, key: str) -> None:
        """Delete unwanted stored bytes; a failure is logged, never raised."""
        try:
            self._store.delete(key)
        except KeyError:
            pass
        except StoreClosedError:  # closed by its owner: a daemon session's keys went with it
            log.debug("not deleting %r: %s is closed", key, self._store.url)
        except Exception as e:
            log.warning("could not delete %r from %s: %r", key, self._store.url, e)

    def flush(self) -> None:
        """Block until every queued write has finished (and deleted what is unwanted)."""
        with self._table.lock:
            while self._inflight > 0:
                self._table.cond.wait(0.1)
