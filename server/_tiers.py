"""The RAM and disk tiers: placement, quotas, spilling and frees.

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
   released, so the RAM quota is never exceeded even transiently. Usually the room
   is already there: see NOTE [ Spill ahead ].
3. Disk directly, if the tensor is larger than the RAM quota, RAM is held by
   in-flight PUTs, or ``memory_quota`` is 0. Its payload is received into a buffer
   bounded by ``limits.put_buffer`` (NOTE [ Payload bytes as they arrive ] in
   ``_payload``) and acknowledged only once on disk and journaled.
4. Otherwise QUOTA_EXCEEDED. Stored tensors are never dropped to make room:
   eviction means spilling, never losing live data.

A spill is a disk write like a PUT's: it reserves its disk room first, and the tensor
counts as on disk only once its bytes and its journal record are written; a spill
that cannot be journaled is undone and the tensor stays in RAM (NOTE [ Disk
failures ] in ``_disk``). What each tensor counts against a quota: NOTE [ What a
tensor costs ] in ``_costs``.

A GET served from RAM sends the tensor's own buffer, which stays alive until the
send ends, however slowly the client reads. So a RAM tensor being sent keeps its RAM
charge until its last answer ends, even when it is deleted or spilled meanwhile
(``ram_answers`` counts those bytes): RAM used is what RAM holds, and the RAM quota
bounds it. Tensors being sent are not picked to spill (spilling them would free
nothing until their answers end).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tensorstore_hooks._codec import TensorMeta
from tensorstore_hooks._units import format_bytes
from tensorstore_hooks.protocol import ErrorCode, Msgpack

from ._costs import ram_charge
from ._disk import DiskFailure, DiskReservation, DiskTier
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
    """Room promised to one PUT; released by a commit or :meth:`Tiers.release`."""

    tier: str
    nbytes: int
    """Bytes charged to ``tier`` (NOTE [ What a tensor costs ])."""
    payload: int
    """The tensor's payload bytes."""
    disk: DiskReservation | None = None
    """The disk tier's reservation of a PUT placed on disk."""
    session_charge: int = 0
    """Bytes held against the owner's session quota (the session table releases them)."""
    active: bool = True


Spilled = Callable[[Entry, str], None]


def _refuse_spills(e: Entry, dk: str) -> None:
    raise RuntimeError("no journal hook installed")


class Tiers:
    """RAM tier + optional disk tier. Event-loop thread only.

    Places bytes and counts RAM; knows nothing of sessions beyond the :class:`Entry`
    values it is handed. A spill's bytes on disk are handed to :attr:`spilled` (the
    session table journals them and moves the owner's accounting); if that raises,
    the spill is undone.
    """

    def __init__(self, *, memory_quota: int, disk: DiskTier | None) -> None:
        self.memory_quota = memory_quota
        self.disk = disk
        self.spilled: Spilled = _refuse_spills
        """Called (event-loop thread) with a spilled entry and its disk key once its
        bytes are on disk; journals it, or raises to undo the spill."""
        self._admit = asyncio.Lock()
        # RAM entries that may be spilled, oldest first. See NOTE [ Quota accounting ].
        self._lru: collections.OrderedDict[str, Entry] = collections.OrderedDict()
        self._spill_tasks: set[asyncio.Task[None]] = set()
        self.ram_spilling = 0
        """Bytes of RAM tensors being written to disk (freed when the writes finish)."""
        self.ram_used = 0
        self.ram_answers = 0
        """RAM (within ``ram_used``) held only by answers of tensors that left RAM."""
        self.ram_reserved = 0
        self.ram_entries = 0
        self.spills = 0
        self.spill_bytes = 0
        self.spill_failures = 0
        self.quota_rejected = 0

    @property
    def disk_quota(self) -> int:
        return self.disk.quota if self.disk is not None else 0

    # -------------------------------------------------------------- admission
    def _ram_free(self) -> int:
        return self.memory_quota - self.ram_used - self.ram_reserved

    async def admit(self, meta: TensorMeta, *, new_session: bool) -> Reservation:
        """Reserve room for a PUT of ``meta``. Raises TierError(QUOTA_EXCEEDED).

        ``new_session``: its session has no journal record yet (a disk write makes one).
        """
        async with self._admit:
            res = await self._place(meta, new_session)
            if res is None and self.disk is not None and self.disk.deletes_in_flight():
                # Deleted disk tensors count until their chunks are gone: a PUT that
                # follows a DELETE must find the room that DELETE made.
                await self.disk.wait_deletes()
                res = await self._place(meta, new_session)
            if res is None and self.disk is not None and self.disk.worth_compacting():
                # The journals' records of deleted tensors count too (NOTE [ Exact disk
                # quota ]): when they are what fills the disk, compacting makes room.
                await self.disk.compact()
                res = await self._place(meta, new_session)
            if res is None:
                self.quota_rejected += 1
                raise TierError(ErrorCode.QUOTA_EXCEEDED, self._full_message(meta.nbytes))
        return res

    async def _place(self, meta: TensorMeta, new_session: bool) -> Reservation | None:
        """Reserve room in RAM (spilling if need be) or on disk; None if neither fits."""
        n = meta.nbytes
        rc = ram_charge(n)
        if rc <= self.memory_quota and (
            self._ram_free() >= rc or (self.disk is not None and await self._make_room(rc))
        ):
            self.ram_reserved += rc
            return Reservation("ram", rc, n)
        if self.disk is None:
            return None
        dres = self.disk.reserve(self.disk.charge(meta), new_session=new_session)
        if dres is None:
            return None
        return Reservation("disk", dres.nbytes, n, disk=dres)

    def _full_message(self, n: int) -> str:
        if self.disk is not None:
            why = self.disk.refusal()
            disk = f"disk {format_bytes(self.disk.held())} of {format_bytes(self.disk.quota)}" + (
                f" ({why})" if why else ""
            )
        else:
            disk = "no disk tier (start the daemon with --root)"
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
            if deficit > 0 and not self._spill_oldest(deficit, all_or_nothing=True):
                return False  # the rest of RAM is held by PUTs in flight, or disk is full
            if self.spill_failures != failures or not self._spill_tasks:
                return self._ram_free() >= n
            await asyncio.wait(set(self._spill_tasks), return_when=asyncio.FIRST_COMPLETED)
        return True

    def _spill_oldest(self, nbytes: int, *, all_or_nothing: bool) -> bool:
        """Start spilling the oldest RAM tensors adding up to ``nbytes`` of RAM, each
        with its disk room reserved; returns whether that much was started (with
        ``all_or_nothing``, nothing is started unless it all fits)."""
        assert self.disk is not None
        picked: list[tuple[Entry, DiskReservation]] = []
        total = 0
        for e in self._lru.values():
            if total >= nbytes:
                break
            if e.answers:
                continue  # being sent: spilling it would free nothing yet
            dres = self.disk.reserve(self.disk.charge(e.meta), new_session=not e.owner.persisted)
            if dres is None:
                break
            picked.append((e, dres))
            total += ram_charge(e.nbytes)
        if all_or_nothing and total < nbytes:
            for _, dres in picked:
                self.disk.release(dres)
            return False
        loop = asyncio.get_running_loop()
        for e, dres in picked:
            del self._lru[e.key]
            e.spilling = True
            self.ram_spilling += ram_charge(e.nbytes)
            task = loop.create_task(self._spill(e, dres))
            self._spill_tasks.add(task)
            task.add_done_callback(self._spill_tasks.discard)
        return total >= nbytes

    def _spill_ahead(self) -> None:
        """Keep some RAM free so that PUTs rarely wait for a spill.

        NOTE [ Spill ahead ]: above 7/8 of the RAM quota, the oldest tensors are
        spilled in the background down to 3/4. Backward reads the newest first, so
        these are the tensors needed last; a PUT then finds room at once instead of
        waiting for disk writes under the admission lock.
        """
        if self.disk is None or self.memory_quota == 0:
            return
        pending = self.ram_used - self.ram_answers + self.ram_reserved - self.ram_spilling
        if pending * 8 <= self.memory_quota * 7:
            return
        self._spill_oldest(pending - self.memory_quota * 3 // 4, all_or_nothing=False)

    async def _spill(self, e: Entry, dres: DiskReservation) -> None:
        assert self.disk is not None and e.buf is not None
        try:
            dk = await self.disk.write(dres, e.meta, e.buf)
        except DiskFailure:
            self._spill_undone(e)
            return
        if e.freed:  # deleted while being written: see free()
            self.disk.discard(dres, dk)
            self._spill_undone(e, failed=False)
            return
        try:
            self.spilled(e, dk)  # journals it; NOTE [ Disk failures ], rule 1
        except Exception as exc:
            self.disk.abandon(dres, dk, exc)
            self._spill_undone(e)
            return
        self.disk.commit(dres)
        e.spilling = False
        e.buf = None
        e.disk_key = dk
        self.ram_spilling -= ram_charge(e.nbytes)
        self._left_ram(e)
        self.ram_entries -= 1
        self.spills += 1
        self.spill_bytes += e.nbytes

    def _spill_undone(self, e: Entry, *, failed: bool = True) -> None:
        self.ram_spilling -= ram_charge(e.nbytes)
        e.spilling = False
        if failed:
            self.spill_failures += 1
        if e.freed:
            self._drop_ram(e)
        else:  # back where it was: the oldest, first to go when the disk is back
            self._lru[e.key] = e
            self._lru.move_to_end(e.key, last=False)

    # ----------------------------------------------------------------- commit
    def release(self, res: Reservation) -> None:
        """Give back an unused reservation (the PUT failed). Idempotent."""
        if not res.active:
            return
        res.active = False
        if res.tier == "ram":
            self.ram_reserved -= res.nbytes
        elif res.disk is not None and self.disk is not None:
            self.disk.release(res.disk)

    def commit_ram(self, res: Reservation, e: Entry) -> None:
        """Keep ``e`` (its received payload in ``e.buf``) in RAM, using ``res``."""
        assert e.buf is not None
        n = res.nbytes
        self.release(res)
        self.ram_used += n
        self.ram_entries += 1
        self._lru[e.key] = e
        self._spill_ahead()

    async def write_disk(self, res: Reservation, e: Entry, buf: np.ndarray) -> str:
        """Write a disk-placed payload for ``e``; returns its disk key, to be journaled
        and then passed to :meth:`commit_disk` (or :meth:`abandon_disk`).

        Raises TierError(QUOTA_EXCEEDED) if the write failed (the reservation is released).
        """
        assert self.disk is not None and res.disk is not None
        try:
            return await self.disk.write(res.disk, e.meta, buf)
        except DiskFailure as exc:
            res.active = False
            self.quota_rejected += 1
            raise TierError(
                ErrorCode.QUOTA_EXCEEDED,
                f"no room for {format_bytes(e.nbytes)} on disk: {exc}; the client keeps the tensor",
            ) from exc

    def commit_disk(self, res: Reservation, e: Entry, dk: str) -> None:
        """``e``'s payload is on disk under ``dk`` and journaled."""
        assert self.disk is not None and res.disk is not None
        res.active = False
        self.disk.commit(res.disk)
        e.disk_key = dk

    def abandon_disk(self, res: Reservation, dk: str, exc: BaseException | None) -> None:
        """A written payload that is not kept: not journaled (``exc``), or its session ended."""
        assert self.disk is not None and res.disk is not None
        res.active = False
        if exc is not None:
            self.disk.abandon(res.disk, dk, exc)
        else:
            self.disk.discard(res.disk, dk)

    def restore(self, e: Entry) -> None:
        """Count a disk-tier tensor re-adopted after a restart (``e.disk_key`` set)."""
        assert self.disk is not None and e.disk_key is not None and e.buf is None
        self.disk.restore(e.meta)

    # ------------------------------------------------------------------- free
    def free(self, e: Entry, *, journaled: bool = True) -> None:
        """Release ``e``'s bytes (a spill in flight finishes the job). Idempotent.
        ``journaled``: a disk-tier tensor's own delete record was written (else its
        session's end record covers it)."""
        if e.freed:
            return
        e.freed = True
        if e.buf is not None:
            if not e.spilling:
                self._lru.pop(e.key, None)
                self._drop_ram(e)
            return
        assert self.disk is not None
        self.disk.free(e, journaled=journaled)

    def _drop_ram(self, e: Entry) -> None:
        e.buf = None
        self._left_ram(e)
        self.ram_entries -= 1

    def _left_ram(self, e: Entry) -> None:
        """``e`` is no longer a RAM tensor: its RAM is free, or once its answers end."""
        rc = ram_charge(e.nbytes)
        if e.answers:
            e.answer_charge = rc
            self.ram_answers += rc
        else:
            self.ram_used -= rc

    def answer_started(self, e: Entry) -> None:
        """A GET answer starts sending ``e``'s RAM buffer."""
        e.answers += 1

    def answer_ended(self, e: Entry) -> None:
        """That answer ended (sent, or the connection dropped): the buffer's RAM is
        free if the tensor left RAM meanwhile and no other answer sends it."""
        e.answers -= 1
        if e.answers == 0 and e.answer_charge:
            self.ram_used -= e.answer_charge
            self.ram_answers -= e.answer_charge
            e.answer_charge = 0

    async def drain(self) -> None:
        """Wait for spills and batched disk deletes to finish (shutdown)."""
        while self._spill_tasks:
            await asyncio.gather(*self._spill_tasks, return_exceptions=True)
        if self.disk is not None:
            await self.disk.wait_deletes()

    # ----------------------------------------------------------------- report
    def snapshot(self) -> dict[str, Msgpack]:
        """This part of ``stats``: the ``tiers`` section and the tiers' counters."""
        disk: dict[str, Msgpack] = (
            self.disk.snapshot()
            if self.disk is not None
            else {"enabled": False, "used": 0, "metadata": 0, "reserved": 0, "quota": 0,
                  "tensors": 0, "writable": False, "direct_io": False,
                  "direct_io_reason": "no disk tier"}
        )  # fmt: skip
        counters = {
            "spills": self.spills,
            "spill_bytes": self.spill_bytes,
            "spill_failures": self.spill_failures,
            "quota_rejected": self.quota_rejected,
            **(
                self.disk.counters()
                if self.disk is not None
                else {
                    "disk_write_failures": 0,
                    "disk_compactions": 0,
                    "disk_direct_bytes": 0,
                    "disk_buffered_bytes": 0,
                }
            ),
        }
        ram = {
            "used": self.ram_used,
            "answers": self.ram_answers,
            "reserved": self.ram_reserved,
            "quota": self.memory_quota,
            "tensors": self.ram_entries,
        }
        return {"tiers": {"ram": ram, "disk": disk}, "counters": counters}
