"""The RAM and disk tiers: placement, quotas, spilling, reads and frees.

NOTE [ Quota accounting ]
Each tier counts *used* bytes (tensors stored there) and *reserved* bytes (PUTs whose
payload is still arriving, spills still being written). A PUT reserves its bytes
before a single payload byte is read, under one admission lock, so concurrent PUTs
can never overshoot: ``used + reserved <= quota`` holds at every await point.

Placement of an ``n``-byte PUT:

1. RAM, if ``n`` fits in what RAM has free.
2. Otherwise RAM after spilling the *oldest* RAM tensors to disk (backward reads the
   newest first, so the oldest are needed last). The admission lock is held while
   the spill runs, and the new buffer is only allocated once the victims' RAM is
   released, so the RAM quota is never exceeded even transiently (transient send
   buffers of GETs aside). Usually the room is already there: see
   NOTE [ Spill ahead ].
3. Disk directly, if the tensor is larger than the RAM quota, RAM is held by
   in-flight PUTs, or ``memory_quota`` is 0. Its payload is staged in a transient
   buffer bounded by ``staging_bytes`` and acknowledged only once on disk.
4. Otherwise QUOTA_EXCEEDED. Stored tensors are never dropped to make room:
   eviction means spilling, never losing live data.

A disk-tier tensor stays counted until its chunks are actually deleted.

What each tensor counts against a quota: NOTE [ What a tensor costs ] in ``_costs``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import numpy as np

from tensorstore_hooks._store import BlobStore
from tensorstore_hooks._units import format_bytes
from tensorstore_hooks.errors import KeyNotFoundError
from tensorstore_hooks.protocol import ErrorCode

from ._costs import DiskCosts, ram_charge
from ._model import Entry

__all__ = ["Reservation", "TierError", "Tiers"]

log = logging.getLogger("tensorstore_hooks.server")


class TierError(Exception):
    """A request the tiers refuse; ``code`` goes into the error frame."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(eq=False, slots=True)
class Reservation:
    """Bytes promised to one PUT; released by commit or :meth:`Tiers.release`."""

    tier: str
    nbytes: int
    """Bytes charged to ``tier`` (payload + overhead, see NOTE [ What a tensor costs ])."""
    payload: int
    """The tensor's payload bytes (what staging holds for a disk-bound PUT)."""
    session_charge: int = 0
    """Bytes held against the owner's session quota (the session table releases them)."""
    staged: bool = False
    active: bool = True


class _ByteBudget:
    """An asyncio semaphore counted in bytes; one request larger than the limit may run alone."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._waiters: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    def _fits(self, n: int) -> bool:
        return self.used == 0 or self.used + n <= self.limit

    async def acquire(self, n: int) -> None:
        if not self._waiters and self._fits(n):
            self.used += n
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        item = (n, fut)
        self._waiters.append(item)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release(n)  # granted just as we were cancelled: hand it on
            elif item in self._waiters:
                self._waiters.remove(item)
            raise

    def release(self, n: int) -> None:
        self.used -= n
        while self._waiters:
            m, fut = self._waiters[0]
            if fut.done():
                self._waiters.popleft()
                continue
            if not self._fits(m):
                break
            self._waiters.popleft()
            self.used += m
            fut.set_result(None)


class Tiers:
    """RAM tier + optional disk tier (a BlobStore run on ``pool``). Event-loop thread only.

    Places bytes and counts them per tier; knows nothing of sessions beyond the
    :class:`Entry` values it is handed. A finished spill is reported through
    :attr:`on_spilled` (the session table moves the owner's accounting and journals
    the tensor's new home).
    """

    def __init__(
        self,
        *,
        memory_quota: int,
        disk_quota: int,
        disk: BlobStore | None,
        pool: Executor,
        staging_bytes: int | None,
    ) -> None:
        self.memory_quota = memory_quota
        self.disk_quota = disk_quota if disk is not None else 0
        self.disk = disk
        self.on_spilled: Callable[[Entry], None] = _ignore
        """Called (event-loop thread) once a spilled entry's bytes are on disk and its
        RAM is released; ``entry.disk_key`` is set. Not called for freed entries."""
        self._pool = pool
        self._admit = asyncio.Lock()
        # None: the caller counts staged payload bytes as they arrive (the daemon's
        # StagingBudget, see NOTE [ Staging as bytes arrive ] in server/_staging.py).
        self._staging = _ByteBudget(staging_bytes) if staging_bytes is not None else None
        # RAM entries that may be spilled, oldest first. See NOTE [ Quota accounting ].
        self._lru: collections.OrderedDict[str, Entry] = collections.OrderedDict()
        self._spill_tasks: set[asyncio.Task[None]] = set()
        self.ram_spilling = 0
        """Bytes of RAM tensors being written to disk (freed when the writes finish)."""
        self._pending_deletes: list[tuple[str, int]] = []
        self._delete_task: asyncio.Task[None] | None = None
        self._costs = DiskCosts(disk)
        self.disk_metadata = 0
        """Bytes of the directory's other files (NOTE [ What a tensor costs ])."""
        self.ram_used = 0
        self.ram_reserved = 0
        self.disk_used = 0
        self.disk_reserved = 0
        self.ram_entries = 0
        self.disk_entries = 0
        self.spills = 0
        self.spill_bytes = 0
        self.spill_failures = 0
        self.quota_rejected = 0

    # -------------------------------------------------------------- admission
    def _ram_free(self) -> int:
        return self.memory_quota - self.ram_used - self.ram_reserved

    def _disk_free(self) -> int:
        return self.disk_quota - self.disk_used - self.disk_reserved - self.disk_metadata

    def disk_charge(self, n: int) -> int:
        """What an ``n``-byte tensor counts against the disk quota."""
        return self._costs.charge(n)

    def refresh_metadata(self, *, force: bool = False) -> None:
        """Re-measure the disk root's non-chunk files (at most every 0.5 s unless forced)."""
        measured = self._costs.metadata(self.disk_entries, force=force)
        if measured is not None:
            self.disk_metadata = measured

    async def admit(self, n: int) -> Reservation:
        """Reserve room for an ``n``-byte PUT. Raises TierError(QUOTA_EXCEEDED)."""
        self.refresh_metadata()
        async with self._admit:
            res = await self._place(n)
            if res is None and self._deletes_in_flight():
                # Deleted disk tensors count until their chunks are gone: a PUT that
                # follows a DELETE must find the room that DELETE made.
                await self._wait_deletes()
                res = await self._place(n)
            if res is None:
                self.quota_rejected += 1
                raise TierError(ErrorCode.QUOTA_EXCEEDED, self._full_message(n))
        if res.tier == "ram" or self._staging is None:
            return res
        try:
            await self._staging.acquire(res.payload)
        except BaseException:
            self.release(res)
            raise
        res.staged = True
        return res

    async def _place(self, n: int) -> Reservation | None:
        """Reserve room for ``n`` payload bytes in RAM (spilling if need be) or on disk;
        None if neither fits."""
        rc = ram_charge(n)
        if rc <= self.memory_quota and (
            self._ram_free() >= rc or (self.disk is not None and await self._make_room(rc))
        ):
            self.ram_reserved += rc
            return Reservation("ram", rc, n)
        dc = self.disk_charge(n)
        if self.disk is None or self._disk_free() < dc:
            return None
        self.disk_reserved += dc
        return Reservation("disk", dc, n)

    def _deletes_in_flight(self) -> bool:
        return self._delete_task is not None and not self._delete_task.done()

    async def _wait_deletes(self) -> None:
        while self._delete_task is not None and not self._delete_task.done():
            # shield: a PUT cancelled while waiting must not cancel the deletes
            await asyncio.shield(self._delete_task)

    def _full_message(self, n: int) -> str:
        in_use = format_bytes(self.disk_used + self.disk_reserved + self.disk_metadata)
        disk = (
            f"disk {in_use} of {format_bytes(self.disk_quota)}"
            if self.disk is not None
            else "no disk tier (start the daemon with --root)"
        )
        return (
            f"no room for {format_bytes(n)} (+ per-tensor overhead): "
            f"RAM {format_bytes(self.ram_used + self.ram_reserved)} "
            f"of {format_bytes(self.memory_quota)}, {disk} in use; the client keeps the tensor"
        )

    async def _make_room(self, n: int) -> bool:
        """Spill the oldest RAM tensors until ``n`` bytes fit in RAM (admission lock held).

        Spills already in flight (see :meth:`_spill_ahead`) count towards the room
        needed: only the rest is spilled here, then this waits for them all.
        """
        failures = self.spill_failures
        while self._ram_free() < n:
            deficit = n - self._ram_free() - self.ram_spilling
            if deficit > 0:
                victims = self._pick(deficit)
                if sum(ram_charge(e.nbytes) for e in victims) < deficit:
                    return False  # the rest of RAM is held by PUTs in flight, or disk is full
                self._start_spills(victims)
            if self.spill_failures != failures or not self._spill_tasks:
                return self._ram_free() >= n
            await asyncio.wait(set(self._spill_tasks), return_when=asyncio.FIRST_COMPLETED)
        return True

    def _pick(self, nbytes: int) -> list[Entry]:
        """The oldest RAM tensors adding up to ``nbytes`` (fewer if RAM or disk runs out)."""
        victims: list[Entry] = []
        total = 0
        on_disk = 0
        disk_free = self._disk_free()
        for e in self._lru.values():
            dc = self.disk_charge(e.nbytes)
            if total >= nbytes or on_disk + dc > disk_free:
                break
            victims.append(e)
            total += ram_charge(e.nbytes)
            on_disk += dc
        return victims

    def _start_spills(self, victims: list[Entry]) -> None:
        loop = asyncio.get_running_loop()
        for e in victims:
            del self._lru[e.key]
            e.spilling = True
            self.ram_spilling += ram_charge(e.nbytes)
            self.disk_reserved += self.disk_charge(e.nbytes)
            task = loop.create_task(self._spill(e))
            self._spill_tasks.add(task)
            task.add_done_callback(self._spill_tasks.discard)

    def _spill_ahead(self) -> None:
        """Keep some RAM free so that PUTs rarely wait for a spill.

        NOTE [ Spill ahead ]: above 7/8 of the RAM quota, the oldest tensors are
        spilled in the background down to 3/4. Backward reads the newest first, so
        these are the tensors needed last; a PUT then finds room at once instead of
        waiting for disk writes under the admission lock.
        """
        if self.disk is None or self.memory_quota == 0:
            return
        pending = self.ram_used + self.ram_reserved - self.ram_spilling
        if pending * 8 <= self.memory_quota * 7:
            return
        victims = self._pick(pending - self.memory_quota * 3 // 4)
        if victims:
            self._start_spills(victims)

    async def _spill(self, e: Entry) -> None:
        n = e.nbytes
        rc, dc = ram_charge(n), self.disk_charge(n)
        assert self.disk is not None
        loop = asyncio.get_running_loop()
        try:
            dk = await loop.run_in_executor(self._pool, self.disk.put_blob, e.meta, e.buf)
        except Exception:
            log.exception(
                "spilling %s (%s) to disk failed; it stays in RAM", e.key, format_bytes(n)
            )
            self.disk_reserved -= dc
            self.ram_spilling -= rc
            self.spill_failures += 1
            e.spilling = False
            if e.freed:
                self._drop_ram(e)
            else:
                self._lru[e.key] = e
                self._lru.move_to_end(e.key, last=False)
            return
        self.disk_reserved -= dc
        self.disk_used += dc
        self.ram_spilling -= rc
        e.spilling = False
        if e.freed:  # deleted while being written: see free()
            self._drop_ram(e)
            self._delete_disk(dk, dc)
            return
        e.buf = None
        e.disk_key = dk
        self.ram_used -= rc
        self.ram_entries -= 1
        self.disk_entries += 1
        self.spills += 1
        self.spill_bytes += n
        try:
            self.on_spilled(e)
        except Exception:
            # The bytes are on disk and counted; only the journal record may be missing
            # (then a restart collects the tensor as an orphan).
            log.exception("recording the spill of %s failed", e.key)

    # ----------------------------------------------------------------- commit
    def release(self, res: Reservation) -> None:
        """Give back an unused reservation (the PUT failed). Idempotent."""
        if not res.active:
            return
        res.active = False
        if res.tier == "ram":
            self.ram_reserved -= res.nbytes
        else:
            self.disk_reserved -= res.nbytes
        if res.staged:
            res.staged = False
            assert self._staging is not None
            self._staging.release(res.payload)

    def commit_ram(self, res: Reservation, e: Entry) -> None:
        """Keep ``e`` (its received payload in ``e.buf``) in RAM, using ``res``."""
        assert e.buf is not None
        n = res.nbytes
        self.release(res)
        self.ram_used += n
        self.ram_entries += 1
        self._lru[e.key] = e
        self._spill_ahead()

    async def commit_disk(self, res: Reservation, e: Entry, buf: np.ndarray) -> None:
        """Write a disk-placed payload for ``e`` and set ``e.disk_key``.

        Raises TierError(INTERNAL) if the write fails (the reservation is released).
        """
        assert self.disk is not None
        loop = asyncio.get_running_loop()
        try:
            dk = await loop.run_in_executor(self._pool, self.disk.put_blob, e.meta, buf)
        except Exception as exc:
            self.release(res)
            log.exception("writing %s to the disk tier failed", format_bytes(res.payload))
            raise TierError(ErrorCode.INTERNAL, f"the daemon's disk tier failed: {exc}") from exc
        n = res.nbytes
        res.active = False  # the reservation becomes usage
        self.disk_reserved -= n
        self.disk_used += n
        if res.staged:
            res.staged = False
            assert self._staging is not None
            self._staging.release(res.payload)
        e.disk_key = dk
        self.disk_entries += 1

    def restore(self, e: Entry) -> None:
        """Count a disk-tier tensor re-adopted after a restart (``e.disk_key`` set)."""
        assert self.disk is not None and e.disk_key is not None and e.buf is None
        self.disk_used += self.disk_charge(e.nbytes)
        self.disk_entries += 1

    # ------------------------------------------------------------ read / free
    async def read(self, e: Entry) -> Any:
        """The payload of ``e``: its RAM buffer, or a fresh buffer read from disk."""
        if e.buf is not None:
            return e.buf
        assert self.disk is not None and e.disk_key is not None
        loop = asyncio.get_running_loop()
        try:
            _, buf = await loop.run_in_executor(self._pool, self.disk.get_blob, e.disk_key)
        except KeyNotFoundError as exc:
            raise TierError(ErrorCode.NOT_FOUND, f"key {e.key!r} was deleted") from exc
        except Exception as exc:
            log.exception("reading %s from the disk tier failed", e.key)
            raise TierError(ErrorCode.INTERNAL, f"the daemon's disk tier failed: {exc}") from exc
        return buf

    def free(self, e: Entry) -> None:
        """Release ``e``'s bytes (a spill in flight finishes the job). Idempotent."""
        if e.freed:
            return
        e.freed = True
        if e.buf is not None:
            if not e.spilling:
                self._lru.pop(e.key, None)
                self._drop_ram(e)
            return
        self.disk_entries -= 1
        if e.disk_key is not None:
            self._delete_disk(e.disk_key, self.disk_charge(e.nbytes))

    def _drop_ram(self, e: Entry) -> None:
        e.buf = None
        self.ram_used -= ram_charge(e.nbytes)
        self.ram_entries -= 1

    def _delete_disk(self, dk: str, n: int) -> None:
        # Batched: one executor call per burst of frees (a session end frees thousands).
        self._pending_deletes.append((dk, n))
        if self._delete_task is None or self._delete_task.done():
            self._delete_task = asyncio.get_running_loop().create_task(self._flush_deletes())

    async def _flush_deletes(self) -> None:
        assert self.disk is not None
        loop = asyncio.get_running_loop()
        while self._pending_deletes:
            batch, self._pending_deletes = self._pending_deletes, []
            try:
                await loop.run_in_executor(
                    self._pool, self.disk.delete_many, [dk for dk, _ in batch]
                )
            except Exception:
                # Leftovers are unreferenced by the journal, so the next start collects them.
                log.exception("deleting %d disk-tier tensors failed", len(batch))
            self.disk_used -= sum(n for _, n in batch)

    async def drain(self) -> None:
        """Wait for spills and batched disk deletes to finish (shutdown)."""
        while self._spill_tasks:
            await asyncio.gather(*self._spill_tasks, return_exceptions=True)
        await self._wait_deletes()

    def snapshot(self) -> dict[str, Any]:
        return {
            "ram": {
                "used": self.ram_used,
                "reserved": self.ram_reserved,
                "quota": self.memory_quota,
                "tensors": self.ram_entries,
            },
            "disk": {
                "enabled": self.disk is not None,
                "used": self.disk_used + self.disk_metadata,
                "metadata": self.disk_metadata,
                "reserved": self.disk_reserved,
                "quota": self.disk_quota,
                "tensors": self.disk_entries,
            },
            "staging_bytes": self._staging.used if self._staging is not None else 0,
        }


def _ignore(e: Entry) -> None:
    pass
