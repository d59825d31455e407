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

Some ops change a saved tensor without a version bump: ``batch_norm`` saves its
running statistics before it updates them in place, unversioned. Torch's backward
sees the live tensor (training-mode backward does not read those values). A write
running during such an update would store bytes of two moments, which a read then
refuses as a checksum mismatch. So a tensor written from its own host memory and no
larger than ``UNVERSIONED_CHECK_BYTES`` (running statistics are one value per
channel) is compared byte for byte before and after its write: if it changed, the
bytes are discarded and the record keeps the live tensor in memory, as torch would
(counted as kept, no warning: nothing failed). A larger tensor changed that way is
not seen here; a read of torn bytes is an ``IntegrityError``, never wrong values.

The write-behind does the I/O; every state change it needs is an intent of the
record table (``begin_write``, ``end_write``, ...: NOTE [ Record lifecycle ]).
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from tensorstore_hooks.errors import StoreClosedError
from tensorstore_hooks.pipeline._device import DeviceStager
from tensorstore_hooks.pipeline._iopool import WRITE, StorePool
from tensorstore_hooks.pipeline._records import Record, RecordTable, WriteJob
from tensorstore_hooks.pipeline._staging import CopyEvent
from tensorstore_hooks.pipeline._stats import OffloadStats, count_transfer
from tensorstore_hooks.pipeline._timeline import WRITE_RANGE, Timeline, span
from tensorstore_hooks.runtime import HeapReleaser

UNVERSIONED_CHECK_BYTES = 64 << 10
"""Host tensors up to this size are checked for unversioned changes across their
write (NOTE [ In-place checks ])."""

__all__ = ["WriteBehind"]

log = logging.getLogger("tensorstore_hooks")


class WriteBehind:
    """Writes records' bytes into ``io.store`` on its I/O pool ``io()``; falls back on
    failures. ``heap`` is told of every byte written (NOTE [ Heap release ])."""

    def __init__(
        self,
        table: RecordTable,
        io: StorePool,
        *,
        stager: DeviceStager,
        heap: HeapReleaser,
        stats: OffloadStats,
    ) -> None:
        self._table = table
        self._io, self._store, self._heap = io, io.store, heap  # where bytes go, who is told
        self._stager = stager
        self._stats = stats
        self._stats_lock = threading.Lock()  # writer threads add up their times
        self.max_inflight = 0
        """Bytes queued or being written before pack blocks (NOTE [ Windows ])."""
        self._warned = False
        self.pending_warning: str | None = None
        """The one-time fallback warning not yet issued (read without a call by every
        pack and unpack; :meth:`take_warning` takes it)."""
        self.timeline: Timeline | None = None  # set while hooks.trace() records

    # ----------------------------------------------------------------- pack
    def admit(self, nbytes: int) -> None:
        """Block while ``nbytes`` more would exceed ``max_inflight`` (backpressure)."""
        self._stats.pack_stall_s += self._table.wait_for_room(nbytes, self.max_inflight)

    def has_room(self, nbytes: int) -> bool:
        """Whether :meth:`admit` ``(nbytes)`` would not wait now."""
        inflight = self._table.inflight
        return not inflight or inflight + nbytes <= self.max_inflight

    def start(self, rec: Record, t: torch.Tensor) -> None:
        """Submit QUEUED ``rec``'s write: a device tensor is staged to host first, or
        (with a host tier it does not go to) copied out by the writer after an event
        recorded here, on its producer (rule 8 of NOTE [ Stream ordering ])."""
        ready: CopyEvent | None = None
        if self._stager.stages(t):
            self._stager.stage(rec, t)
        elif self._stager.accelerated(t.device):
            ready = self._stager.producer_event(t)
        self._io().submit(WRITE, self._write, rec, ready)

    def hold(self, rec: Record, t: torch.Tensor) -> None:
        """Put HELD ``rec`` in the host tier (NOTE [ Host tier wiring ]); with no room
        in time, write it from the device instead."""
        held, waited_s = self._stager.hold(rec, t, self.spill)
        self._stats.pack_stall_s += waited_s
        if held or not self._table.write_directly(rec):
            return
        log.debug("host tier: no room within %gs, writing record %d directly", waited_s, rec.pos)
        self.start(rec, t)

    def spill(self, rec: Record) -> None:
        """Write HELD ``rec`` to the store from its host copy: the tier needs its room."""
        if not self._table.spill(rec):  # freed meanwhile: its free gave the room back
            return
        log.debug("host tier: spilling record %d (%d B)", rec.pos, rec.nbytes)
        self._io().submit(WRITE, self._write, rec)

    # ----------------------------------------------------------------- write
    def _write(self, rec: Record, ready: CopyEvent | None = None) -> None:
        """Writer thread: move one record's bytes into the store (``ready``: the event
        a tensor written from the device is copied out after)."""
        table = self._table
        job = table.begin_write(rec)
        key: str | None = None
        error: BaseException | None = None
        dirty = live = False
        wrote = job is not None
        if job is not None:
            try:
                key, dirty, live = self._put(rec, job, ready)
            except BaseException as e:
                error = e
            del job  # the record alone decides how long the tensor lives
        end = table.end_write(rec, key=key, error=error, dirty=dirty, keep_live=live)
        self._stager.give_back(rec, end.give_back)
        if end.discard is not None:
            # Freed, served from memory or modified while writing: the bytes are not
            # wanted. Deleted before the write counts as finished, so flush() covers it.
            self.discard(end.discard)
        if end.error is not None:
            self._fell_back(end.error)
        table.write_finished(rec)
        if wrote:
            self._heap.note(rec.nbytes)

    def _put(
        self, rec: Record, job: WriteJob, ready: CopyEvent | None
    ) -> tuple[str | None, bool, bool]:
        """Check the version, copy the bytes into the store, check again (NOTE [ In-place
        checks ]): the one place a saved tensor's bytes are copied out.

        Returns the key written (``None``: nothing was), whether the saved tensor
        changed in place (then the bytes written are worthless), and whether it changed
        without a version bump (then the live tensor is kept in memory).
        """
        table = self._table
        if job.event is not None:
            job.event.synchronize()  # an I/O thread: may wait (events are blocking)
            self._stager.give_back(rec, table.copies.done(rec))
        src = job.source
        if src is None or not table.unchanged(rec):
            return None, True, False
        union = rec.span
        if union is not None and not union.region:
            src = union.gather(src)  # the gaps stay behind (NOTE [ Span unions ], rule 5)
        before = None  # written from the saved tensor's own host memory: check it
        if (
            job.from_device
            and rec.nbytes <= UNVERSIONED_CHECK_BYTES
            and not self._stager.accelerated(src.device)
        ):
            before = _raw_bytes(src)
            before = None if before is None else before.clone()
        if job.from_device and self._stager.accelerated(src.device):
            if ready is None:
                raise RuntimeError(
                    "tensorstore-hooks internal error: a device tensor reached the writer "
                    "without an event on its producer (rule 8 of NOTE [ Stream ordering ])"
                )
            src = self._stager.to_pageable(src, ready)  # rule 8: never read it here
            if not table.unchanged(rec):
                return None, True, False
        t0 = time.perf_counter()  # NOTE [ Profiler ranges ]
        with span(WRITE_RANGE, self.timeline, {"bytes": rec.nbytes}):
            key = self._store.put(src)
        write_s = time.perf_counter() - t0
        with self._stats_lock:
            self._stats.write_s += write_s
            self._stats.bytes_written += rec.nbytes
            count_transfer(self._stats, self._store, key, rec.nbytes)
        log.debug("write: record %d, %d B in %.2f ms", rec.pos, rec.nbytes, write_s * 1e3)
        after = None if before is None else _raw_bytes(src)
        if before is not None and after is not None and not torch.equal(before, after):
            log.debug("write: record %d changed without a version bump: kept", rec.pos)
            return key, False, True
        return key, not table.unchanged(rec), False

    def _fell_back(self, error: BaseException) -> None:
        """A write failed or was refused and its tensor stays in memory: warn once."""
        if not self._warned:
            self._warned = True
            self.pending_warning = (
                f"tensorstore-hooks: the store {self._store.url} could not take a saved "
                f"tensor ({type(error).__name__}: {error}); keeping such tensors in memory "
                "instead. Training continues; hooks.stats.fallbacks counts them."
            )
        # One warning per pipeline (above); each tensor only at DEBUG.
        log.debug("write to %s failed, tensor kept in memory: %r", self._store.url, error)

    def take_warning(self) -> str | None:
        """The one-time fallback warning, once (the caller issues it on its own thread)."""
        msg, self.pending_warning = self.pending_warning, None
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
        self._table.wait_for_writes()


def _raw_bytes(t: torch.Tensor) -> torch.Tensor | None:
    """``t``'s elements as bytes, in order (a copy only where ``t`` is not contiguous),
    so that NaNs compare equal to themselves; ``None`` for a tensor that has no such
    view (sparse, quantized: not checked)."""
    if t.layout != torch.strided or t.is_quantized:
        return None
    flat = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return flat.view(torch.uint8)
