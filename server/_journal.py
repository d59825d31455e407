"""What survives a crash: sessions and which disk-tier tensor belongs to whom.

The disk tier (a :class:`~tensorstore_hooks.ZarrStore` namespace ``daemon``) already
persists its own keys. This journal adds ownership: ``session id -> created`` and
``daemon key -> (session id, disk key, nbytes)``, appended under
``ROOT/daemon/sessions/`` through the library's :class:`IndexLog` (framed, checksummed
msgpack records, NOTE [ Journal records ] in ``_index.py``; replayed on start; a record
is written before the request that caused it is acknowledged, and a torn last record
is ignored). What replay does with damage: NOTE [ Journal damage ] in ``_recovery``.

Only local roots can append cheaply; for other roots the journal is disabled and a
restarted daemon starts with no sessions (its orphaned disk keys are collected).

NOTE [ Crash ordering ]
A tensor reaches disk in two steps: ``disk.put_blob`` (journaled by the store), then
``key_on_disk`` here. A crash between them leaves a disk key nobody owns; a crash
between ``keys_freed`` and the disk delete leaves one too. Recovery deletes every
disk key the journal does not reference, so both cases end clean.

NOTE [ Durable deletes ]
A disk-tier tensor's chunks are deleted only after a record that a restart reads
says nobody owns it; otherwise a crash would bring back a key whose bytes are gone.

1. A DELETE writes the delete records of its disk-tier keys in one append
   (:meth:`StateJournal.keys_freed`) before anything is freed, and only then is it
   answered. If the append fails, nothing is freed, the keys stay readable, and the
   DELETE is answered with an error (INTERNAL, saying so): never acknowledged.
2. A session's end writes one record, the session's delete: replay treats every key
   of an ended session as an orphan, so its keys need no records of their own. If
   that record cannot be written, the session's disk-tier tensors stay on disk
   (counted) until it can (housekeeping retries) or a compaction drops the session.
3. A full filesystem must not wedge deletes, which are what frees it: the journal
   keeps a small reserve file (``daemon/sessions/reserve``, 16 KiB, counted in the
   disk quota) and gives it up when a delete record meets a full filesystem, then
   appends again; the reserve is made again once there is room.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from tensorstore_hooks.errors import QuotaExceededError
from tensorstore_hooks.storage import split_url
from tensorstore_hooks.storage.io import LocalIO
from tensorstore_hooks.storage.zarr import MAGIC, Damage, IndexEntry, IndexLog

from ._costs import DISK_NAMESPACE
from ._model import KeyRecord

__all__ = ["RESERVE_BYTES", "Replay", "StateJournal", "damaged_readings"]

log = logging.getLogger("tensorstore_hooks.server")

RESERVE_BYTES = 16 << 10
"""The reserve file's size (NOTE [ Durable deletes ], rule 3): a few filesystem blocks,
room for hundreds of delete records in each journal on a full filesystem (the first
delete's unlinked chunks then give room back)."""
_RESERVE_RETRY_S = 2.0


@dataclass(slots=True)
class Replay:
    """What :meth:`StateJournal.load` found."""

    sessions: dict[str, float] = field(default_factory=dict)
    """Session id -> created (wall time), for sessions whose last record is a put."""
    keys: dict[str, KeyRecord] = field(default_factory=dict)
    """Daemon key -> its owner record, for keys whose last record is a put."""
    ended: set[str] = field(default_factory=set)
    """Session ids whose last record is a delete (the session ended)."""
    damage: list[Damage] = field(default_factory=list)
    """Damaged regions of the journal or snapshot (their records are lost)."""
    readings: list[str] = field(default_factory=list)
    """Best-effort readings of the damaged records (untrusted: for the log only)."""
    quarantined: list[str] = field(default_factory=list)
    """Intact records with unusable content, described (file + record), skipped."""


class StateJournal:
    """Append-only record of sessions and disk-tier ownership. Event-loop thread only."""

    def __init__(self, root_url: str) -> None:
        kind, location = split_url(root_url)
        self.enabled = kind == "local"
        self._log: IndexLog | None = None
        if self.enabled:
            self._io = LocalIO(location)
            self._log = IndexLog(self._io, f"{DISK_NAMESPACE}/sessions", warn=False)
        else:
            log.warning(
                "root %s is not a local path: sessions are not journaled, so after a crash "
                "or restart clients cannot resume and their disk-tier tensors are collected",
                root_url,
            )
        self._live = 0
        self._reserve_path: str | None = None
        self._reserve_tried = float("-inf")
        if self.enabled:
            self._reserve_path = os.path.join(location, DISK_NAMESPACE, "sessions", "reserve")
            self.keep_reserve()

    # --------------------------------------------------------------- reserve
    def keep_reserve(self) -> bool:
        """Make the reserve file if it is missing (rule 3); False if there is no room
        yet. Tried at most every few seconds (housekeeping calls this)."""
        path = self._reserve_path
        if path is None:
            return True
        with contextlib.suppress(OSError):
            if os.path.getsize(path) == RESERVE_BYTES:
                return True
        now = time.monotonic()
        if now - self._reserve_tried < _RESERVE_RETRY_S:
            return False
        self._reserve_tried = now
        tmp = path + ".tmp"
        try:
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(bytes(RESERVE_BYTES))
            os.replace(tmp, path)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            log.debug("the journal's reserve file cannot be made yet: %s", e)
            return False
        return True

    def _give_up_reserve(self) -> bool:
        """Free the reserve for a delete record (rule 3); False if there was none."""
        if self._reserve_path is None:
            return False
        try:
            os.unlink(self._reserve_path)
        except OSError:
            return False
        log.warning(
            "the filesystem of the daemon's root is full: gave up the journal's reserve "
            "file so that deletes can be recorded"
        )
        return True

    def load(self) -> Replay:
        """Replay the journal. Damage and unusable records are reported, never fatal."""
        out = Replay()
        if self._log is None:
            return out
        where = f"{self._io.url}/{DISK_NAMESPACE}/sessions"
        for name, entry in self._log.load().items():
            kind, _, ident = name.partition(":")
            if kind == "s" and ident:
                created = entry.get("created")
                out.sessions[ident] = (
                    float(created) if isinstance(created, int | float) else time.time()
                )
                continue
            if kind == "k" and ident:
                sid, dk, n = entry.get("s"), entry.get("d"), entry.get("n")
                if isinstance(sid, str) and isinstance(dk, str) and isinstance(n, int) and n >= 0:
                    out.keys[ident] = KeyRecord(sid, dk, n)
                    continue
            out.quarantined.append(f"{where}: record {name!r} has unusable content {entry!r:.120}")
        out.ended = {name[2:] for name in self._log.retired_keys if name.startswith("s:")}
        out.damage = list(self._log.damage)
        for d in out.damage:
            out.readings.extend(damaged_readings(self._io, d))
        self._live = len(out.sessions) + len(out.keys)
        return out

    def session_opened(self, sid: str, created: float) -> None:
        self._put(f"s:{sid}", {"created": created})

    def session_ended(self, sid: str) -> None:
        """Record that session ``sid`` ended (NOTE [ Durable deletes ], rule 2). Raises
        a TensorStoreError if the record cannot be written."""
        self._del_all([f"s:{sid}"])

    def key_on_disk(self, key: str, rec: KeyRecord) -> None:
        self._put(f"k:{key}", {"s": rec.session, "d": rec.disk_key, "n": rec.nbytes})

    def keys_freed(self, keys: Sequence[str]) -> None:
        """Record the delete of ``keys``, all in one append or none (NOTE [ Durable
        deletes ], rule 1). Raises a TensorStoreError if it cannot be written."""
        self._del_all([f"k:{k}" for k in keys])

    def compact(self, sessions: dict[str, float], keys: dict[str, KeyRecord]) -> None:
        """Rewrite the journal as a snapshot of exactly these live records."""
        if self._log is None:
            return
        live: dict[str, IndexEntry] = {f"s:{s}": {"created": c} for s, c in sessions.items()}
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

    def _put(self, name: str, entry: IndexEntry) -> None:
        if self._log is not None:
            self._log.record_put(name, entry)
            self._live += 1

    def _del_all(self, names: list[str]) -> None:
        if self._log is None or not names:
            return
        try:
            self._log.record_deletes(names)
        except QuotaExceededError:
            if not self._give_up_reserve():
                raise
            self._log.record_deletes(names)  # rule 3: the reserve's room
        self._live = max(0, self._live - len(names))


_KEY_RE = re.compile(rb"k:([A-Za-z0-9_-]{8,64})")
_SID_RE = re.compile(rb"(?<![A-Za-z0-9_-])(?:s:)?([A-Za-z0-9_-]{32})(?![A-Za-z0-9_-])")


def damaged_readings(io: LocalIO, d: Damage) -> list[str]:
    """What the damaged region ``d`` seems to have said: the key and session names still
    legible in its bytes (a flipped bit rarely hits them all).

    Only for the log (which sessions and keys were probably lost): a record whose
    checksum fails is never trusted to adopt anything.
    """
    rel = d.path.removeprefix(io.url).lstrip("/")
    try:
        region = bytes(io.read(rel))[d.offset : d.offset + d.nbytes]
    except OSError:
        return []
    out: list[str] = []
    starts = [0, *(m.start() for m in re.finditer(re.escape(MAGIC), region) if m.start())]
    for i, start in enumerate(starts[:64]):
        piece = region[start : starts[i + 1] if i + 1 < len(starts) else len(region)]
        keys = _KEY_RE.findall(piece)
        sids = _SID_RE.findall(piece)
        if keys:
            owner = f" of session {sids[0][:8].decode()}" if sids else ""
            out.append(f"key {keys[0].decode()}{owner}")
        elif sids:
            out.append(f"session {sids[0][:8].decode()}")
    return out
