"""What survives a crash: sessions and which disk-tier tensor belongs to whom.

The disk tier (a :class:`~tensorstore_hooks.ZarrStore` namespace ``daemon``) already
persists its own keys. This journal adds ownership: ``session id -> created`` and
``daemon key -> (session id, disk key, nbytes)``, appended under
``ROOT/daemon/sessions/`` through the library's :class:`IndexLog` (length-prefixed
msgpack records, replayed on start; a record is written before the request that
caused it is acknowledged, and a torn last record is ignored).

Only local roots can append cheaply; for other roots the journal is disabled and a
restarted daemon starts with no sessions (its orphaned disk keys are collected).

NOTE [ Crash ordering ]
A tensor reaches disk in two steps: ``disk.put_blob`` (journaled by the store), then
``key_on_disk`` here. A crash between them leaves a disk key nobody owns; a crash
between ``key_freed`` and the disk delete leaves one too. Recovery deletes every
disk key the journal does not reference, so both cases end clean.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from tensorstore_hooks._chunkio import LocalIO
from tensorstore_hooks._index import IndexLog
from tensorstore_hooks._zarr_store import split_url

from ._model import KeyRecord

__all__ = ["DISK_NAMESPACE", "StateJournal"]

log = logging.getLogger("tensorstore_hooks.server")

DISK_NAMESPACE = "daemon"
"""ZarrStore namespace of the disk tier (fixed, so a restart resumes it)."""


class StateJournal:
    """Append-only record of sessions and disk-tier ownership. Event-loop thread only."""

    def __init__(self, root_url: str) -> None:
        kind, location = split_url(root_url)
        self.enabled = kind == "local"
        self._log: IndexLog | None = None
        if self.enabled:
            self._log = IndexLog(LocalIO(location), f"{DISK_NAMESPACE}/sessions")
        else:
            log.warning(
                "root %s is not a local path: sessions are not journaled, so after a crash "
                "or restart clients cannot resume and their disk-tier tensors are collected",
                root_url,
            )
        self._live = 0

    def load(self) -> tuple[dict[str, float], dict[str, KeyRecord]]:
        """Replay: ``(session id -> created wall time, key -> KeyRecord)``."""
        sessions: dict[str, float] = {}
        keys: dict[str, KeyRecord] = {}
        if self._log is None:
            return sessions, keys
        for name, entry in self._log.load().items():
            kind, _, ident = name.partition(":")
            if kind == "s":
                created = entry.get("created")
                sessions[ident] = (
                    float(created) if isinstance(created, int | float) else time.time()
                )
            elif kind == "k":
                sid, dk, n = entry.get("s"), entry.get("d"), entry.get("n")
                if isinstance(sid, str) and isinstance(dk, str) and isinstance(n, int) and n >= 0:
                    keys[ident] = KeyRecord(sid, dk, n)
        self._live = len(sessions) + len(keys)
        return sessions, keys

    def session_opened(self, sid: str, created: float) -> None:
        self._put(f"s:{sid}", {"created": created})

    def session_ended(self, sid: str) -> None:
        self._del(f"s:{sid}")

    def key_on_disk(self, key: str, rec: KeyRecord) -> None:
        self._put(f"k:{key}", {"s": rec.session, "d": rec.disk_key, "n": rec.nbytes})

    def key_freed(self, key: str) -> None:
        self._del(f"k:{key}")

    def compact(self, sessions: dict[str, float], keys: dict[str, KeyRecord]) -> None:
        """Rewrite the journal as a snapshot of exactly these live records."""
        if self._log is None:
            return
        live: dict[str, dict[str, Any]] = {f"s:{s}": {"created": c} for s, c in sessions.items()}
        live.update(
            {f"k:{k}": {"s": r.session, "d": r.disk_key, "n": r.nbytes} for k, r in keys.items()}
        )
        self._log.snapshot(live)
        self._live = len(live)

    def needs_compaction(self) -> bool:
        return self._log is not None and self._log.needs_compaction(self._live)

    def close(self) -> None:
        if self._log is not None:
            self._log.close()

    def _put(self, name: str, entry: dict[str, Any]) -> None:
        if self._log is not None:
            self._log.record_put(name, entry)
            self._live += 1

    def _del(self, name: str) -> None:
        if self._log is not None:
            self._log.record_delete(name)
            self._live = max(0, self._live - 1)
