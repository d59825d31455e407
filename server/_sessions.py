"""Sessions: who owns which keys, what each holds, what the journal says, and the lease
that frees them when a client vanishes.

The :class:`SessionTable` is the only place that changes a session's entries and byte
counts and the only writer of session events to the journal; the tiers it drives
(``_tiers``) only place bytes and report finished spills back through a callback.

Deletes are journaled before anything is freed (NOTE [ Durable deletes ] in
``_journal``). A session that ends is gone at once (its id no longer resumes, its
connections are closed), and its tensors are freed by a background task in batches of
:data:`REAP_BATCH`, the event loop served between them: a session of a hundred
thousand tensors ending never holds up other clients' requests.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Mapping

import numpy as np

from tensorstore_hooks._codec import TensorMeta
from tensorstore_hooks._units import format_bytes
from tensorstore_hooks.errors import TensorStoreError
from tensorstore_hooks.protocol import ErrorCode, Msgpack

from ._costs import RAM_OVERHEAD_BYTES, ram_charge
from ._journal import StateJournal
from ._model import Entry, KeyRecord, Session
from ._tiers import Reservation, TierError, Tiers

__all__ = ["REAP_BATCH", "Session", "SessionTable"]

log = logging.getLogger("tensorstore_hooks.server")

REAP_BATCH = 512
"""Tensors of an ended session freed per turn of the event loop."""


class SessionTable:
    """All sessions; opens, resumes, ends and expires them, and stores and frees their
    tensors through the tiers. Event-loop thread only."""

    def __init__(
        self,
        tiers: Tiers,
        journal: StateJournal | None,
        lease_s: float,
        *,
        session_quota: int | None = None,
    ) -> None:
        self.tiers = tiers
        self.journal = journal
        self.lease_s = lease_s
        self.session_quota = session_quota
        """Most one session may hold (:attr:`Session.charged_bytes`); None: no cap."""
        self.session_rejected = 0
        self.sessions: dict[str, Session] = {}
        self.opened = 0
        self.expired = 0
        self.expired_bytes = 0
        self._compaction_failed = False
        self._reapers: set[asyncio.Task[None]] = set()
        self._unrecorded: dict[str, Session] = {}
        """Ended sessions whose end the journal could not record yet: their disk-tier
        tensors stay until it can (NOTE [ Durable deletes ], rule 2)."""
        self.delete_failures = 0
        """DELETEs refused because the journal could not record them."""
        tiers.spilled = self._spilled
        if tiers.disk is not None:
            tiers.disk.compact_sessions = self.compact_journal

    # ------------------------------------------------------------- lifecycle
    def open(self) -> Session:
        sid = secrets.token_urlsafe(24)
        s = Session(id=sid, created=time.time(), last_seen=time.monotonic())
        self.sessions[sid] = s
        self.opened += 1
        log.info("session %s opened", s.label)
        return s

    def restore(self, sid: str, created: float) -> Session:
        """A journaled session after a restart; its lease starts now."""
        s = Session(id=sid, created=created, last_seen=time.monotonic(), persisted=True)
        self.sessions[sid] = s
        if self.tiers.disk is not None:
            self.tiers.disk.session_recorded()
        return s

    def get(self, sid: str) -> Session | None:
        return self.sessions.get(sid)

    def end(self, s: Session, reason: str) -> int:
        """End ``s`` and free all its tensors (in the background, see the module's
        docstring); returns the bytes it held. Idempotent."""
        if s.ended:
            return 0
        s.ended = True
        held = s.nbytes
        self.sessions.pop(s.id, None)
        recorded = self._record_end(s)
        self._reap(s, disk_too=recorded)
        log.info("session %s ended (%s): %d bytes freed", s.label, reason, held)
        return held

    def _record_end(self, s: Session) -> bool:
        """Journal the end of ``s`` (NOTE [ Durable deletes ], rule 2); False if the
        record cannot be written now (``s`` then waits in :attr:`_unrecorded`)."""
        if not s.persisted or self.journal is None:
            return True
        try:
            self.journal.session_ended(s.id)
        except TensorStoreError as exc:
            if not self._unrecorded:
                log.warning(
                    "the session journal cannot record the end of session %s (%s); its "
                    "disk-tier tensors stay on disk until it can",
                    s.label,
                    exc,
                )
            self._unrecorded[s.id] = s
            return False
        self._unrecorded.pop(s.id, None)
        if self.tiers.disk is not None:
            self.tiers.disk.session_ended()
        return True

    def retry_unrecorded(self) -> None:
        """Housekeeping: record the ends the journal could not take before, then free
        those sessions' disk-tier tensors."""
        for s in list(self._unrecorded.values()):
            if not self._record_end(s):
                return
            self._reap(s, disk_too=True)
        if self.journal is not None:
            self.journal.keep_reserve()

    def _reap(self, s: Session, *, disk_too: bool) -> None:
        entries = [e for e in s.entries.values() if disk_too or e.buf is not None]
        if not entries:
            return
        task = asyncio.get_running_loop().create_task(self._reap_entries(entries))
        self._reapers.add(task)
        task.add_done_callback(self._reapers.discard)

    async def _reap_entries(self, entries: list[Entry]) -> None:
        for i in range(0, len(entries), REAP_BATCH):
            for e in entries[i : i + REAP_BATCH]:
                self._forget(e, journaled=False)  # the session's end record covers them
            await asyncio.sleep(0)

    async def drain(self) -> None:
        """Wait until every ended session's tensors are freed (shutdown)."""
        while self._reapers:
            await asyncio.gather(*self._reapers, return_exceptions=True)

    def expire(self, now: float) -> list[Session]:
        """End every session whose lease ran out; returns them (to kick their connections)."""
        out = [s for s in self.sessions.values() if now - s.last_seen > self.lease_s]
        for s in out:
            self.expired += 1
            self.expired_bytes += self.end(s, f"lease of {self.lease_s:g}s expired")
        return out

    # --------------------------------------------------------------- tensors
    async def admit(self, s: Session, meta: TensorMeta) -> Reservation:
        """Reserve room for a PUT of ``meta`` by ``s``: its session quota, then the tiers.

        Raises TierError(QUOTA_EXCEEDED) naming the quota that is full. Pair with
        :meth:`release` (after the store_* call or the failure).
        """
        n = meta.nbytes
        charge = ram_charge(n)
        quota = self.session_quota
        if quota is not None and s.charged_bytes + charge > quota:
            self.session_rejected += 1
            self.tiers.quota_rejected += 1
            raise TierError(
                ErrorCode.QUOTA_EXCEEDED,
                f"session quota: session {s.label} holds {format_bytes(s.charged_bytes)} of "
                f"its {format_bytes(quota)} (--session-quota), no room for "
                f"{format_bytes(n)} + {format_bytes(RAM_OVERHEAD_BYTES)} overhead; the client "
                "keeps the tensor",
            )
        s.reserved_bytes += charge
        try:
            res = await self.tiers.admit(meta, new_session=not s.persisted)
        except BaseException:
            s.reserved_bytes -= charge
            raise
        res.session_charge = charge
        return res

    def release(self, s: Session, res: Reservation) -> None:
        """The PUT of ``s`` holding ``res`` is over (stored or failed). Idempotent."""
        s.reserved_bytes -= res.session_charge
        res.session_charge = 0
        self.tiers.release(res)

    def store_ram(
        self, s: Session, res: Reservation, key: str, meta: TensorMeta, buf: np.ndarray
    ) -> Entry:
        """Keep a received payload in RAM under ``key`` for ``s`` (``res`` is in RAM)."""
        e = Entry(key, s, meta, buf)
        self.tiers.commit_ram(res, e)
        s.entries[key] = e
        s.ram_bytes += e.nbytes
        return e

    async def store_disk(
        self, s: Session, res: Reservation, key: str, meta: TensorMeta, buf: np.ndarray
    ) -> Entry:
        """Write a disk-placed payload, journal it, and only then return (the ack follows).

        Raises TierError: QUOTA_EXCEEDED if the disk or the journal failed (nothing is
        kept: NOTE [ Disk failures ]), NOT_FOUND if ``s`` ended meanwhile.
        """
        e = Entry(key, s, meta, None)
        dk = await self.tiers.write_disk(res, e, buf)
        if s.ended:
            self.tiers.abandon_disk(res, dk, None)
            raise TierError(ErrorCode.NOT_FOUND, "the session ended while the tensor was written")
        try:
            self._journal_on_disk(e, dk)
        except TensorStoreError as exc:
            self.tiers.abandon_disk(res, dk, exc)
            self.tiers.quota_rejected += 1
            raise TierError(
                ErrorCode.QUOTA_EXCEEDED,
                f"the daemon could not journal the tensor ({exc}); the client keeps it",
            ) from exc
        self.tiers.commit_disk(res, e, dk)
        s.entries[key] = e
        s.disk_bytes += e.nbytes
        return e

    def free_keys(self, entries: list[Entry]) -> None:
        """Forget ``entries`` (a DELETE) and release their bytes. The journal records
        the disk-tier ones first, in one append (NOTE [ Durable deletes ], rule 1);
        if it cannot, nothing is freed and TierError(INTERNAL) says why."""
        on_disk = [e.key for e in entries if e.buf is None and not e.freed]
        if on_disk and self.journal is not None:
            try:
                self.journal.keys_freed(on_disk)
            except TensorStoreError as exc:
                self.delete_failures += 1
                if self.tiers.disk is not None:
                    self.tiers.disk.journal_failed(exc, "recording a delete")
                raise TierError(
                    ErrorCode.INTERNAL,
                    f"the daemon could not record the delete of {len(on_disk)} disk-tier "
                    f"tensors in its journal ({exc}); nothing was deleted and the keys stay "
                    "readable: delete them again later",
                ) from exc
        for e in entries:
            self._forget(e, journaled=True)

    def _forget(self, e: Entry, *, journaled: bool) -> None:
        """Drop ``e`` from its session and release its bytes. Idempotent.

        The journal forgets a disk tensor before its chunks are deleted (NOTE [ Crash
        ordering ] in ``_journal``): ``journaled`` says whether its own delete record
        was written (else its session's end record covers it).
        """
        if e.freed:
            return
        s = e.owner
        s.entries.pop(e.key, None)
        if e.buf is not None:
            s.ram_bytes -= e.nbytes
        else:
            s.disk_bytes -= e.nbytes
        self.tiers.free(e, journaled=journaled)

    def restore_key(self, key: str, s: Session, meta: TensorMeta, rec: KeyRecord) -> Entry:
        """Re-adopt a journaled disk-tier tensor after a restart."""
        e = Entry(key, s, meta, None, disk_key=rec.disk_key)
        self.tiers.restore(e)
        s.entries[key] = e
        s.disk_bytes += e.nbytes
        return e

    def _spilled(self, e: Entry, dk: str) -> None:
        """The tiers wrote ``e`` to disk as ``dk``: journal it, then move its owner's
        bytes. Raises TensorStoreError if it cannot be journaled (the spill is undone)."""
        self._journal_on_disk(e, dk)
        e.owner.ram_bytes -= e.nbytes
        e.owner.disk_bytes += e.nbytes

    def _journal_on_disk(self, e: Entry, dk: str) -> None:
        """Record ``e`` on disk as ``dk`` (and its session, the first time). Raises
        TensorStoreError if a record cannot be written."""
        if self.journal is None:
            return
        owner = e.owner
        if not owner.persisted:
            self.journal.session_opened(owner.id, owner.created)
            owner.persisted = True
            if self.tiers.disk is not None:
                self.tiers.disk.session_recorded()
        self.journal.key_on_disk(e.key, KeyRecord(owner.id, dk, e.nbytes))

    # --------------------------------------------------------------- journal
    def compact_journal(self) -> None:
        """Rewrite the journal as the live sessions and their disk-tier keys.

        A failure is logged (once until a compaction works again) and leaves the
        journal as it was: still the truth, only longer.
        """
        if self.journal is None:
            return
        sessions: dict[str, float] = {}
        keys: dict[str, KeyRecord] = {}
        for s in self.sessions.values():
            if not s.persisted:
                continue
            sessions[s.id] = s.created
            for e in s.entries.values():
                if e.buf is None and e.disk_key is not None and not e.freed:
                    keys[e.key] = KeyRecord(s.id, e.disk_key, e.nbytes)
        try:
            self.journal.compact(sessions, keys)
        except TensorStoreError as exc:
            if not self._compaction_failed:
                log.warning("compacting the session journal failed (%s); it stays as it is", exc)
            self._compaction_failed = True
            return
        self._compaction_failed = False
        # The snapshot names none of the ended sessions: their ends are recorded now.
        for s in list(self._unrecorded.values()):
            del self._unrecorded[s.id]
            if self.tiers.disk is not None:
                self.tiers.disk.session_ended()
            self._reap(s, disk_too=True)

    # ---------------------------------------------------------------- report
    def snapshot(self, connections: Mapping[str, int], now: float) -> dict[str, Msgpack]:
        """This part of ``stats``: the sessions (largest first, at most 200) and the
        session counters. ``connections``: session id -> its live connections."""
        ordered = sorted(self.sessions.values(), key=lambda s: -s.nbytes)
        return {
            "sessions_total": len(ordered),
            "sessions": [
                {
                    "id": s.label,
                    "tensors": len(s.entries),
                    "ram_bytes": s.ram_bytes,
                    "disk_bytes": s.disk_bytes,
                    "connections": connections.get(s.id, 0),
                    "idle_s": now - s.last_seen,
                    "lease_left_s": max(0.0, self.lease_s - (now - s.last_seen)),
                    "requests": s.requests,
                }
                for s in ordered[:200]
            ],
            "counters": {
                "sessions_opened": self.opened,
                "sessions_expired": self.expired,
                "expired_bytes": self.expired_bytes,
                "session_quota_rejected": self.session_rejected,
                "delete_failures": self.delete_failures,
                "unrecorded_session_ends": len(self._unrecorded),
            },
        }
