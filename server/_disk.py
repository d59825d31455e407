"""The disk tier: a ZarrStore namespace run on a thread pool, its exact byte count,
and what happens when its filesystem fails.

NOTE [ Disk failures ]
1. A write to the disk tier that fails (its chunk files or its journal record: a
   filesystem full below ``disk_quota``, an I/O error, a read-only or unwritable
   directory) is undone: the files it wrote are deleted, a spilled tensor stays in
   RAM, and a PUT placed on disk is answered QUOTA_EXCEEDED (the client keeps the
   tensor), never INTERNAL. A tensor is never acknowledged, nor reported as on disk,
   before its bytes *and* its journal record are written.
2. After a failed write the disk tier takes no writes (no spills, no PUTs placed
   there) for a back-off of 0.5 s doubling to 30 s; the first write after it probes.
   A freed disk-tier tensor ends a back-off caused by a full filesystem (room may be
   back).
3. One WARNING per episode of failures, naming the error, and one INFO when writes
   work again; everything in between is DEBUG. An episode lasts until writes have
   worked for :data:`_EPISODE_QUIET_S` without a failure: a full filesystem where
   each freed tensor lets one write through, and the next one fails, is one episode,
   not one warning per freed tensor. No traceback for an OS error.
4. A root deleted or replaced while the daemon serves (its device and inode changed)
   turns the disk tier off until a restart: one ERROR; its tensors answer NOT_FOUND
   ("lost with the root"), writes QUOTA_EXCEEDED.
5. A failed read (a chunk missing or corrupt) fails that GET with INTERNAL naming
   the key; every other request goes on.

NOTE [ Disk-tier bookkeeping ]
A disk-tier tensor's payload costs no RAM, but its bookkeeping does: its entry, key
and metadata, its place in the disk index, measured at about 765 bytes. Charged to
nothing, a disk quota of small tensors would cost the daemon tens of GiB of RAM. So
every disk-tier tensor, and every write in flight that would add one, is charged
:data:`~._costs.DISK_TENSOR_RAM_BYTES` against ``limits.disk_bookkeeping``; a write
past it is refused like one past the disk quota (QUOTA_EXCEEDED, saying which), and
``stats`` shows the budget (``buffers.bookkeeping``).

Byte counts: NOTE [ Exact disk quota ] in ``_costs``. Event-loop thread only, except
the store calls, which run on ``pool``.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from tensorstore_hooks._codec import TensorMeta
from tensorstore_hooks._units import format_bytes
from tensorstore_hooks.errors import KeyNotFoundError, QuotaExceededError, TensorStoreError
from tensorstore_hooks.protocol import Msgpack
from tensorstore_hooks.storage.zarr import ZarrStore

from ._costs import DISK_NAMESPACE, DISK_TENSOR_RAM_BYTES, DiskCharge, DiskCosts
from ._model import Entry

__all__ = ["DiskFailure", "DiskReservation", "DiskTier"]

T = TypeVar("T")

log = logging.getLogger("tensorstore_hooks.server")

_EPISODE_QUIET_S = 60.0
"""Writes must work this long before a new failure counts as a new episode (rule 3)."""
_FIRST_BACKOFF_S = 0.5
_MAX_BACKOFF_S = 30.0
_COMPACT_DEAD_BYTES = 64 << 10
"""Journal records of deleted tensors worth a compaction when the disk is full."""
_COMPACT_EVERY_S = 1.0
_DELETE_BATCH = 256
"""Disk-tier tensors deleted per store call (an ended session frees thousands)."""
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


class DiskFailure(Exception):
    """A disk-tier write failed and was undone (NOTE [ Disk failures ])."""


@dataclass(eq=False, slots=True)
class DiskReservation:
    """Room promised to one disk-tier write (a PUT placed on disk, or a spill)."""

    charge: DiskCharge
    extra: int
    """A session record and a segment document that may come with it."""
    records: int
    """Journal records it covers (taken off the measured journal size meanwhile)."""
    probe: bool = False
    """The first write after a failure's back-off (NOTE [ Disk failures ], rule 2)."""
    active: bool = True

    @property
    def nbytes(self) -> int:
        return self.charge.write + self.extra


@dataclass(frozen=True, slots=True)
class _Doomed:
    """A disk-tier tensor on its way out: what it still holds until its delete ends."""

    disk_key: str
    files: int
    index_del: int
    """Its index delete record (written by the delete)."""
    records: int
    """Its put records (in the disk index until the delete; a compaction may copy them)."""


class _Health:
    """Whether the disk tier takes writes now (NOTE [ Disk failures ], rules 2-3)."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.error: str | None = None
        self.full = False
        self.retry_at = 0.0
        self.backoff_s = _FIRST_BACKOFF_S
        self.failures = 0
        self.probing = False
        """A write is testing whether the failure is over: the others wait for it."""
        self.last_failure = float("-inf")
        self.told = False
        """The episode's WARNING was logged and its INFO not yet (rule 3)."""

    def writable(self, now: float) -> bool:
        return self.error is None or (now >= self.retry_at and not self.probing)

    def failed(self, exc: BaseException, what: str) -> None:
        self.failures += 1
        self.probing = False
        message = f"{what}: {exc}"
        self.error = message
        self.full = isinstance(exc, QuotaExceededError) or (
            isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS
        )
        now = time.monotonic()
        self.retry_at = now + self.backoff_s
        new_episode = now - self.last_failure >= _EPISODE_QUIET_S
        self.last_failure = now
        if new_episode:
            self.told = True
            log.warning(
                "the disk tier at %s cannot take writes (%s); tensors stay in RAM or with "
                "their clients, next try in %gs",
                self.where,
                message,
                self.backoff_s,
            )
        else:
            log.debug("disk tier still failing (%s); next try in %gs", message, self.backoff_s)
        self.backoff_s = min(self.backoff_s * 2, _MAX_BACKOFF_S)

    def succeeded(self) -> None:
        if self.error is not None and self.told:
            self.told = False
            log.info("the disk tier at %s takes writes again", self.where)
        self.probing = False
        self.error = None
        self.full = False
        self.backoff_s = _FIRST_BACKOFF_S

    def room_freed(self) -> None:
        if self.full:
            self.retry_at = 0.0


class DiskTier:
    """One ZarrStore namespace as the daemon's disk tier. Event-loop thread only."""

    def __init__(
        self, store: ZarrStore, pool: Executor, quota: int, bookkeeping_limit: int
    ) -> None:
        self.store = store
        self.quota = quota
        self.bookkeeping_limit = bookkeeping_limit
        """RAM for disk-tier tensors' bookkeeping (NOTE [ Disk-tier bookkeeping ])."""
        self.writes = 0
        """Writes in flight (reserved, not yet committed or released)."""
        self.costs = DiskCosts(store)
        self._pool = pool
        self._health = _Health(store.url)
        root = self.costs.local_root
        self._root = root
        # The root and the disk tier's namespace directory in it (NOTE [ Disk failures ],
        # rule 4): deleting either would make writes recreate a fresh, empty copy.
        self._watched = [root, os.path.join(root, DISK_NAMESPACE)] if root is not None else []
        self._ids = [_identity(p) for p in self._watched]
        self.lost: str | None = None
        """Why the tier is off for good (its root went away), or None."""
        self.files = 0
        """Chunk-file bytes of tensors on disk (until their delete ends)."""
        self.standing = 0
        """Standing reservations of stored tensors and journaled sessions."""
        self.reserved = 0
        """Reservations of writes in flight."""
        self.docs = 0
        self._classes: set[int] = set()
        self.entries = 0
        # The journals' size (NOTE [ Exact disk quota ]): measured whenever no store
        # call runs on the pool, plus the bound of each record written since.
        self._io_running = 0
        self._journals_measured = self.costs.journal_bytes()
        self._journals_since = 0
        self._pending: list[_Doomed] = []
        self._delete_task: asyncio.Task[None] | None = None
        self.write_failures = 0
        self.compactions = 0
        self.dead = 0
        """Journal bytes (bound) of tensors deleted since the last compaction."""
        self._compacted_at = float("-inf")
        self.compact_sessions: Callable[[], None] = _nothing
        """Compacts the session journal (the session table installs it)."""
        self.measure_docs()

    # ------------------------------------------------------------- accounting
    def measure_docs(self) -> None:
        """Re-walk the root's other files (start, and after a new segment)."""
        self.docs, self._classes = self.costs.other_files()

    def _journals(self) -> int:
        """The journals' size: measured if no store call is running (then exact), else
        the last measure plus the bound of every record written since (then at least
        what they hold, not counting a compaction's snapshot: a standing reservation
        covers that)."""
        if self._io_running == 0:
            self._journals_measured = self.costs.journal_bytes()
            self._journals_since = 0
        return self._journals_measured + self._journals_since

    async def _run(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on the pool: a store call that may append to the journals."""
        self._io_running += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        finally:
            self._io_running -= 1

    @property
    def used(self) -> int:
        """Bytes the directory holds (NOTE [ Exact disk quota ]), measured now; exact
        when nothing is in flight."""
        return self.files + self._journals() + self.docs

    @property
    def reservations(self) -> int:
        return self.reserved + self.standing + self.costs.snapshot_headers

    def held(self) -> int:
        """``used + reserved``: what counts against the quota now."""
        return self.used + self.reservations

    def charge(self, meta: TensorMeta) -> DiskCharge:
        return self.costs.charge(meta)

    def _extra(self, charge: DiskCharge, new_session: bool) -> int:
        extra = self.costs.session_record + self.costs.session_standing if new_session else 0
        if charge.chunk_class and charge.chunk_class not in self._classes:
            extra += self.costs.segment_doc_bound()
        return extra

    def bookkeeping(self) -> int:
        """RAM charged for disk-tier tensors and writes in flight (NOTE [ Disk-tier
        bookkeeping ])."""
        return (self.entries + self.writes) * DISK_TENSOR_RAM_BYTES

    def bookkeeping_full(self) -> bool:
        return self.bookkeeping() + DISK_TENSOR_RAM_BYTES > self.bookkeeping_limit

    def reserve(self, charge: DiskCharge, *, new_session: bool) -> DiskReservation | None:
        """Room for one write, or None (no room, the bookkeeping budget is full, or the
        tier takes no writes now)."""
        if not self.writable() or self.bookkeeping_full():
            return None
        records = charge.records + (self.costs.session_record if new_session else 0)
        res = DiskReservation(charge, self._extra(charge, new_session), records)
        if self.held() + res.nbytes > self.quota:
            return None
        self.reserved += res.nbytes
        self.writes += 1
        if self._health.error is not None:
            res.probe = self._health.probing = True
        return res

    def release(self, res: DiskReservation) -> None:
        """Give back an unused reservation. Idempotent."""
        if res.active:
            res.active = False
            self.reserved -= res.nbytes
            self.writes -= 1
            if res.probe:  # it never wrote: the next write probes instead
                self._health.probing = False

    def writable(self) -> bool:
        """True if a write may be tried now (not failing, root still there)."""
        return self._root_ok() and self._health.writable(time.monotonic())

    def refusal(self) -> str | None:
        """Why writes are refused now (for a QUOTA_EXCEEDED message), or None."""
        if self.lost is not None:
            return self.lost
        if self.bookkeeping_full():
            return (
                f"the daemon's RAM for disk-tier bookkeeping is full: {self.entries} tensors "
                f"at {DISK_TENSOR_RAM_BYTES} bytes each of limits.disk_bookkeeping "
                f"({format_bytes(self.bookkeeping_limit)})"
            )
        if self._health.error is not None:
            left = max(0.0, self._health.retry_at - time.monotonic())
            return f"the disk tier failed ({self._health.error}); next try in {left:.1f}s"
        return None

    def _root_ok(self) -> bool:
        if self.lost is not None:
            return False
        if [_identity(p) for p in self._watched] == self._ids:
            return True
        self.lost = (
            f"the disk tier's root {self._root} was deleted or replaced while the daemon "
            "served; its tensors are lost and it takes no writes until a restart"
        )
        log.error("%s", self.lost)
        return False

    def check(self) -> None:
        """Housekeeping: notice a vanished root (NOTE [ Disk failures ], rule 4)."""
        self._root_ok()

    # ------------------------------------------------------------------ writes
    async def write(self, res: DiskReservation, meta: TensorMeta, buf: np.ndarray) -> str:
        """Write one payload under ``res``; returns its disk key (not journaled yet:
        :meth:`commit` or :meth:`abandon` follows). Raises DiskFailure (``res`` released)."""
        try:
            dk: str = await self._run(self.store.put_blob, meta, buf)
        except Exception as exc:
            self.release(res)
            self._failed(exc, f"writing {format_bytes(meta.nbytes)}")
            raise DiskFailure(self.refusal() or str(exc)) from exc
        self.files += res.charge.files  # counted until its delete ends
        if res.charge.chunk_class and res.charge.chunk_class not in self._classes:
            self.measure_docs()
        if not self._root_ok():
            self._discard(dk, res)
            raise DiskFailure(self.lost or "the disk tier's root is gone")
        return dk

    def commit(self, res: DiskReservation) -> None:
        """The write under ``res`` is journaled: its records are in the journal files
        now (measured), its standing reservation stays while it is stored."""
        assert res.active
        res.active = False
        self.reserved -= res.nbytes
        self.writes -= 1
        self._journals_since += res.records
        self.standing += res.charge.standing
        self.entries += 1
        self._health.succeeded()

    def abandon(self, res: DiskReservation, dk: str, exc: BaseException) -> None:
        """The write under ``res`` could not be journaled: delete it, count a failure."""
        self._failed(exc, "journaling a disk-tier tensor")
        self._discard(dk, res)

    def discard(self, res: DiskReservation, dk: str) -> None:
        """The write under ``res`` is not wanted any more (its owner went away)."""
        self._discard(dk, res)

    def _discard(self, dk: str, res: DiskReservation) -> None:
        # Never journaled by the session table, but in the disk index until deleted:
        # its index delete is still to come, and a compaction may copy its record.
        charge = res.charge
        self.standing += charge.index_del + charge.records
        self._journals_since += charge.records  # its index record is written
        self.release(res)
        self._queue_delete(_Doomed(dk, charge.files, charge.index_del, charge.records))

    def journal_failed(self, exc: BaseException, what: str) -> None:
        """A journal record could not be written (a delete, a session's end): the
        disk tier backs off as for a failed write (NOTE [ Disk failures ], rule 2)."""
        self._failed(exc, what)

    def _failed(self, exc: BaseException, what: str) -> None:
        self.write_failures += 1
        if isinstance(exc, TensorStoreError | OSError):
            self._health.failed(exc, what)
        else:  # not the filesystem: a bug, worth its traceback
            log.error("%s failed", what, exc_info=exc)
            self._health.failed(exc, what)

    def session_recorded(self) -> None:
        """A session got its journal record (or was restored with one)."""
        self.standing += self.costs.session_standing

    def session_ended(self) -> None:
        """A journaled session ended (its delete record is written): its standing
        reservation is spent."""
        self.standing -= self.costs.session_standing
        self._journals_since += self.costs.session_standing - self.costs.session_record

    def restore(self, meta: TensorMeta) -> None:
        """Count a disk-tier tensor re-adopted after a restart."""
        charge = self.costs.charge(meta)
        self.files += charge.files
        self.standing += charge.standing
        self.entries += 1

    # ------------------------------------------------------------------- reads
    def pieces(self, e: Entry, piece_bytes: int) -> list[tuple[int, int]]:
        """``(start, length)`` of the pieces ``e`` is read in: whole chunks, about
        ``piece_bytes`` each (one piece for an empty tensor)."""
        assert e.disk_key is not None
        n = e.nbytes
        try:
            chunk = self.store.chunk_class(e.disk_key)
        except KeyNotFoundError:
            chunk = 0
        if n == 0 or chunk == 0:
            return [(0, n)]
        unit = chunk * max(1, piece_bytes // chunk)
        return [(start, min(unit, n - start)) for start in range(0, n, unit)]

    async def read(self, e: Entry, start: int, length: int) -> np.ndarray:
        """Bytes ``[start, start + length)`` of ``e``'s payload, read and verified.

        Raises KeyNotFoundError (deleted, or lost with the root) or TensorStoreError.
        """
        if self.lost is not None:
            raise KeyNotFoundError(self.lost)
        assert e.disk_key is not None
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._pool, self.store.read_range, e.disk_key, start, length
        )

    def start_reading(self, e: Entry) -> None:
        e.readers += 1

    def done_reading(self, e: Entry) -> None:
        """One streamed answer of ``e`` ended; a delete waiting for it goes ahead."""
        e.readers -= 1
        if e.readers == 0 and e.freed and e.disk_key is not None:
            self._free_now(e)

    # ------------------------------------------------------------------ frees
    def free(self, e: Entry, *, journaled: bool = True) -> None:
        """Delete ``e``'s disk-tier tensor (after its last streamed answer). Its session
        journal's delete record is written (``journaled``; else its session's end
        record covers it): that part of its standing is spent."""
        session_del = self.costs.charge(e.meta).session_del
        self.entries -= 1
        self.standing -= session_del
        if journaled:
            self._journals_since += session_del
        if e.readers == 0 and e.disk_key is not None:
            self._free_now(e)

    def _free_now(self, e: Entry) -> None:
        assert e.disk_key is not None
        charge = self.costs.charge(e.meta)
        dk, e.disk_key = e.disk_key, None
        self._queue_delete(_Doomed(dk, charge.files, charge.index_del, charge.records))
        self._health.room_freed()

    def _queue_delete(self, doomed: _Doomed) -> None:
        # Batched: one executor call per burst of frees (a session end frees thousands).
        self._pending.append(doomed)
        if self._delete_task is None or self._delete_task.done():
            self._delete_task = asyncio.get_running_loop().create_task(self._flush_deletes())

    async def _flush_deletes(self) -> None:
        while self._pending:
            # A bounded batch per store call: the store's index lock is held for the
            # whole call, and other clients' disk writes need it too.
            batch, self._pending = self._pending[:_DELETE_BATCH], self._pending[_DELETE_BATCH:]
            try:
                await self._run(self.store.delete_many, [d.disk_key for d in batch])
            except Exception as exc:
                # Leftovers are unreferenced by the journal, so the next start collects them.
                log.warning("deleting %d disk-tier tensors failed: %s", len(batch), exc)
            for d in batch:
                self.files -= d.files
                self.standing -= d.index_del + d.records
                self._journals_since += d.index_del
                self.dead += d.index_del + d.records

    def worth_compacting(self) -> bool:
        """True when the journals hold enough records of deleted tensors that a
        compaction frees room (checked when the disk tier refuses a write)."""
        now = time.monotonic()
        return self.dead >= _COMPACT_DEAD_BYTES and now - self._compacted_at >= _COMPACT_EVERY_S

    async def compact(self) -> None:
        """Compact both journals now (the disk is full of dead records). Failures are
        logged; the journals are then as they were."""
        self._compacted_at = time.monotonic()
        self.compactions += 1
        self.compact_sessions()
        try:
            await self._run(self.store.compact_index)
        except TensorStoreError as exc:
            log.warning("compacting the disk tier's index failed: %s", exc)
            return
        self.dead = 0

    def deletes_in_flight(self) -> bool:
        return self._delete_task is not None and not self._delete_task.done()

    async def wait_deletes(self) -> None:
        while self._delete_task is not None and not self._delete_task.done():
            # shield: a PUT cancelled while waiting must not cancel the deletes
            await asyncio.shield(self._delete_task)

    # ---------------------------------------------------------------- report
    def snapshot(self) -> dict[str, Msgpack]:
        journals = self._journals()
        return {
            "enabled": True,
            "used": self.files + journals + self.docs,
            "metadata": journals + self.docs,
            "reserved": self.reservations,
            "quota": self.quota,
            "tensors": self.entries,
            "writable": self.refusal() is None,
            # The library's own disk path (NOTE [ Direct I/O ] in storage/io/_local.py).
            "direct_io": self.store.direct_io.enabled,
            "direct_io_reason": self.store.direct_io.reason,
        }

    def bookkeeping_snapshot(self) -> dict[str, int]:
        return {
            "used": self.bookkeeping(),
            "limit": self.bookkeeping_limit,
            "per_tensor": DISK_TENSOR_RAM_BYTES,
        }

    def counters(self) -> dict[str, int]:
        moved = self.store.transfers
        return {
            "disk_write_failures": self.write_failures,
            "disk_compactions": self.compactions,
            "disk_direct_bytes": moved.direct_written + moved.direct_read,
            "disk_buffered_bytes": moved.buffered_written + moved.buffered_read,
        }


def _nothing() -> None:
    pass


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino
