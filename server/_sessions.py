"""Sessions: who owns which keys, and the lease that frees them when a client vanishes."""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ._journal import KeyRecord

if TYPE_CHECKING:
    from ._journal import StateJournal
    from ._tiers import Entry, Tiers

__all__ = ["Session", "SessionTable"]

log = logging.getLogger("tensorstore_hooks.server")


@dataclass(eq=False, slots=True)
class Session:
    """One client's namespace of keys. Event-loop thread only."""

    id: str
    """Secret: whoever knows it (and the token) can resume the session. Never logged whole."""
    created: float
    """Wall-clock time of creation (survives restarts through the journal)."""
    last_seen: float
    """``time.monotonic()`` of the last request on any of its connections."""
    entries: dict[str, Entry] = field(default_factory=dict)
    ram_bytes: int = 0
    disk_bytes: int = 0
    conns: set[Any] = field(default_factory=set)
    """Live connections attached to this session (kicked when it ends)."""
    persisted: bool = False
    """True once the journal knows this session (it has had a tensor on disk)."""
    ended: bool = False
    requests: int = 0

    @property
    def label(self) -> str:
        """A loggable prefix of the id."""
        return self.id[:8]

    @property
    def nbytes(self) -> int:
        return self.ram_bytes + self.disk_bytes


class SessionTable:
    """All sessions; opens, resumes, ends and expires them."""

    def __init__(self, tiers: Tiers, journal: StateJournal | None, lease_s: float) -> None:
        self.tiers = tiers
        self.journal = journal
        self.lease_s = lease_s
        self.sessions: dict[str, Session] = {}
        self.opened = 0
        self.expired = 0
        self.expired_bytes = 0

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
        return s

    def get(self, sid: str) -> Session | None:
        return self.sessions.get(sid)

    def end(self, s: Session, reason: str) -> int:
        """End ``s`` and free all its tensors; returns the bytes freed. Idempotent."""
        if s.ended:
            return 0
        s.ended = True
        freed = s.nbytes
        for entry in list(s.entries.values()):
            self.tiers.free(entry)
        s.entries.clear()
        self.sessions.pop(s.id, None)
        if s.persisted and self.journal is not None:
            self.journal.session_ended(s.id)
        log.info("session %s ended (%s): %d bytes freed", s.label, reason, freed)
        return freed

    def expire(self, now: float) -> list[Session]:
        """End every session whose lease ran out; returns them (to kick their connections)."""
        out = [s for s in self.sessions.values() if now - s.last_seen > self.lease_s]
        for s in out:
            self.expired += 1
            self.expired_bytes += self.end(s, f"lease of {self.lease_s:g}s expired")
        return out

    def compact_journal(self) -> None:
        """Rewrite the journal as the live sessions and their disk-tier keys."""
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
        self.journal.compact(sessions, keys)
