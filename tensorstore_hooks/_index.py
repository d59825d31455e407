"""The key index of a :class:`~tensorstore_hooks.ZarrStore` namespace, persisted.

Where the backend can append (local disk), every put and delete is appended to
``index/journal`` as one length-prefixed msgpack record *before* the store call
returns, so a process killed with SIGKILL loses no acknowledged entry. The journal is
compacted into ``index/snapshot`` when it holds far more records than live keys.
Backends that cannot append (object stores) write the snapshot on ``flush()`` and
``close()``. A private ``memory://`` store persists nothing.

Record: ``u32 little-endian length`` + msgpack ``[op, key, entry]`` with op ``"put"``
(entry = the index entry map) or ``"del"`` (entry = nil). A truncated last record
(a crash mid-append) is ignored on replay.
"""

from __future__ import annotations

import contextlib
import struct
from typing import Any

import msgpack

from ._chunkio import ChunkIO, MemoryIO
from .errors import IntegrityError

__all__ = ["IndexLog"]

_LEN = struct.Struct("<I")
_MAX_RECORD = 1 << 20
_MAX_SNAPSHOT = 1 << 31
_UNPACK_LIMITS = {
    "max_bin_len": 0,
    "max_str_len": 1 << 16,
    "max_array_len": 1 << 16,
    "max_map_len": 1 << 24,
    "max_ext_len": 0,
}


class IndexLog:
    """Persists ``key -> entry`` for one namespace. Not thread-safe: the store locks."""

    def __init__(self, io: ChunkIO, directory: str) -> None:
        self._io = io
        self._dir = directory
        self._journal_path = f"{directory}/journal"
        self._snapshot_path = f"{directory}/snapshot"
        self._persist = not isinstance(io, MemoryIO)
        self._append = io.supports_append
        self._journal: Any = None
        self._records = 0
        self.retired_keys: set[str] = set()
        """Keys whose last replayed record is a delete (set by :meth:`load`)."""

    def load(self) -> dict[str, dict[str, Any]]:
        """Replay snapshot then journal; returns the live entries."""
        entries: dict[str, dict[str, Any]] = {}
        if not self._persist:
            return entries
        try:
            raw = self._io.read(self._snapshot_path)
        except FileNotFoundError:
            raw = None
        if raw is not None:
            if len(raw) > _MAX_SNAPSHOT:
                raise IntegrityError(
                    f"index snapshot {self._io.url}/{self._snapshot_path} too large"
                )
            try:
                snap = msgpack.unpackb(raw, raw=False, strict_map_key=True, **_UNPACK_LIMITS)
            except Exception as e:
                raise IntegrityError(
                    f"index snapshot {self._io.url}/{self._snapshot_path} is corrupt: {e}"
                ) from e
            if not isinstance(snap, dict):
                raise IntegrityError(f"index snapshot {self._snapshot_path}: expected a map")
            entries.update(snap)
        try:
            raw = self._io.read(self._journal_path)
        except FileNotFoundError:
            raw = b""
        mv = memoryview(raw)
        pos = 0
        while pos + _LEN.size <= len(mv):
            (n,) = _LEN.unpack_from(mv, pos)
            if n > _MAX_RECORD or pos + _LEN.size + n > len(mv):
                break  # truncated tail: the write that was cut off was never acknowledged
            try:
                op, key, entry = msgpack.unpackb(
                    mv[pos + _LEN.size : pos + _LEN.size + n], raw=False, **_UNPACK_LIMITS
                )
            except Exception:
                break
            pos += _LEN.size + n
            self._records += 1
            if op == "put" and isinstance(key, str) and isinstance(entry, dict):
                entries[key] = entry
                self.retired_keys.discard(key)
            elif op == "del" and isinstance(key, str):
                entries.pop(key, None)
                self.retired_keys.add(key)
        return entries

    def record_put(self, key: str, entry: dict[str, Any]) -> None:
        self._write(["put", key, entry])

    def record_delete(self, key: str) -> None:
        self._write(["del", key, None])

    def _write(self, record: list[Any]) -> None:
        if not (self._persist and self._append):
            return
        if self._journal is None:
            self._journal = self._io.open_append(self._journal_path)
        body = msgpack.packb(record, use_bin_type=True)
        self._journal.write(_LEN.pack(len(body)) + body)
        self._records += 1

    def needs_compaction(self, live: int) -> bool:
        """True when the journal is mostly dead records (then call :meth:`snapshot`)."""
        return self._persist and self._append and self._records > 4 * live + 4096

    def snapshot(self, live: dict[str, dict[str, Any]]) -> None:
        """Write all live entries as the snapshot and reset the journal."""
        if not self._persist:
            return
        tmp = self._snapshot_path + ".tmp"
        self._io.write(tmp, [msgpack.packb(live, use_bin_type=True)])
        self._io.replace(tmp, self._snapshot_path)
        if self._append:
            # Records already in the snapshot may be replayed again after a crash between
            # these two steps; keys are never reused, so replaying them is harmless.
            self._io.truncate(self._journal_path)
        self._records = 0

    def close(self) -> None:
        if self._journal is not None:
            with contextlib.suppress(OSError):
                self._journal.close()
            self._journal = None
