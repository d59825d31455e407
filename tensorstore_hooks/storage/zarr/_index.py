"""The key index of a :class:`~tensorstore_hooks.ZarrStore` namespace, persisted.

Where the backend can append (local disk), every put and delete is appended to
``index/journal`` as one framed record *before* the store call returns, so a process
killed with SIGKILL loses no acknowledged entry. The journal is compacted into
``index/snapshot`` when it holds far more records than live keys. Backends that
cannot append (object stores) write the snapshot on ``flush()`` and ``close()``. A
private ``memory://`` store persists nothing. The daemon's session journal
(``server/_journal.py``) uses the same class and format.

NOTE [ Journal records ]
Every record is framed so that one damaged record costs only itself::

    magic  b"\\xc1TSH"                      (4 bytes; 0xc1 is never a msgpack type byte)
    length u32 little-endian               (bytes of body, at most 8 MiB)
    crc    u32 little-endian               crc32c of the 4 length bytes, then of body
    body   msgpack [op, key, entry]        op "put" (entry: a map) or "del" (entry: nil)

Replay reads records in order. A record whose magic, length or checksum is wrong is
*damage*: replay scans forward for the next offset where a whole valid record starts
(magic, length and checksum all agree: a false match needs a crc32c collision) and
goes on from there, so garbage in the middle loses only the records it overwrote.
Each damaged region is reported as a :class:`Damage` (file, ordinal of the first
record lost, byte offset and length, why) in :attr:`IndexLog.damage` and in one
``RuntimeWarning`` naming the file. A *torn tail* (the file ends inside a record
whose header promises more bytes than follow, or inside a header: a crash or a full
disk mid-append) is not damage: that write was never acknowledged; it is ignored
and cut off before the next append.

Writes: the record is written with one ``write`` loop to the OS (what survives
SIGKILL: the store's durability rule is "acknowledged = in the OS", no fsync). If any
OS error interrupts it (ENOSPC, EDQUOT, EIO, ...), the file is truncated back to
where the record began, so the space is given back and no torn record is left for a
later append to follow; the error becomes a :class:`~tensorstore_hooks.TensorStoreError`
and the caller does not acknowledge the operation. A delete record that cannot be
written is kept and written before the next record (the key is already gone from
memory; see :meth:`IndexLog.record_delete`).

The snapshot uses the same framing: one header record ``["snap", "", {"records":
N}]`` then ``N`` put records, replacing ``snapshot`` atomically (a temporary file,
``fsync``, rename, directory ``fsync``: NOTE [ Atomic documents ] in
``storage/io/_base.py``) before the journal is cut; a snapshot with fewer valid
records than its header promised reports the shortfall as damage.

Format 1 files (a bare ``u32`` length + msgpack, no checksum; a snapshot that is one
msgpack map) are refused with an :class:`~tensorstore_hooks.IntegrityError` that
names the file and the fix: they cannot be told apart from damage reliably, and a
record without a checksum cannot be trusted to name the right tensor.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import struct
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import BinaryIO, TypeAlias

import msgpack

from tensorstore_hooks.errors import (
    IntegrityError,
    QuotaExceededError,
    StoreUnavailableError,
    TensorStoreError,
)
from tensorstore_hooks.protocol import Msgpack
from tensorstore_hooks.storage.io import ChunkIO
from tensorstore_hooks.storage.zarr._checksum import crc

__all__ = [
    "MAGIC",
    "Damage",
    "IndexEntry",
    "IndexLog",
    "Record",
    "Scan",
    "frame_record",
    "os_error",
    "scan_journal",
]

log = logging.getLogger("tensorstore_hooks")

MAGIC = b"\xc1TSH"
_HEADER = struct.Struct("<4sII")
HEADER_BYTES = _HEADER.size
MAX_RECORD_BYTES = 8 << 20
_MAX_SNAPSHOT = 1 << 31
_UNPACK_LIMITS = {
    "max_bin_len": MAX_RECORD_BYTES,
    "max_str_len": 1 << 16,
    "max_array_len": 1 << 16,
    "max_map_len": 1 << 16,
    "max_ext_len": 0,
}
_OPS = ("put", "del")
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})

IndexEntry: TypeAlias = dict[str, Msgpack]
"""One key's entry as a record carries it: a msgpack map whose fields its owner defines
(the store's ``Entry.to_record``, the daemon's journal). Replayed, it is untrusted."""
Record: TypeAlias = tuple[str, str, "IndexEntry | None"]
"""``(op, key, entry)``: a put carries an entry, a delete ``None`` (NOTE [ Journal records ])."""


@dataclass(frozen=True, slots=True)
class Damage:
    """One damaged region of a journal or snapshot, found on replay."""

    path: str
    """The file (URL of the store root + path)."""
    record: int
    """1-based ordinal of the first record lost (valid records before it + 1)."""
    offset: int
    """Byte offset where the damage starts."""
    nbytes: int
    """Bytes skipped (the damaged region)."""
    reason: str
    """What was wrong (bad magic, checksum mismatch, ...)."""

    def __str__(self) -> str:
        return (
            f"{self.path}: record {self.record} at byte {self.offset} is damaged "
            f"({self.reason}; {self.nbytes} bytes skipped)"
        )


@dataclass(frozen=True, slots=True)
class Scan:
    """What :func:`scan` found in one file."""

    records: list[Record]
    """Valid records in file order: ``(op, key, entry)``."""
    damage: list[Damage]
    valid_end: int
    """Offset just after the last valid record or damaged region (a torn tail follows)."""


def frame_record(record: Sequence[Msgpack]) -> bytes:
    """One framed record (NOTE [ Journal records ])."""
    body = msgpack.packb(record, use_bin_type=True)
    if len(body) > MAX_RECORD_BYTES:
        raise IntegrityError(f"index record of {len(body)} bytes exceeds {MAX_RECORD_BYTES}")
    # One crc32c call over the length bytes and the body (a put's hot path).
    checked = len(body).to_bytes(4, "little") + body
    return b"".join((MAGIC, checked[:4], crc(checked).to_bytes(4, "little"), checked[4:]))


def _record_at(buf: bytes, pos: int) -> tuple[Record | None, int, str]:
    """``(record, end, "")`` if a valid record starts at ``pos``, else ``(None, pos,
    why)`` with ``why`` ``"torn"`` if the file ends inside it."""
    left = len(buf) - pos
    if left < HEADER_BYTES:
        return None, pos, "torn" if MAGIC.startswith(buf[pos : pos + 4]) else "bad magic"
    magic, n, want = _HEADER.unpack_from(buf, pos)
    if magic != MAGIC:
        return None, pos, "bad magic"
    if n > MAX_RECORD_BYTES:
        return None, pos, f"length {n} exceeds {MAX_RECORD_BYTES}"
    end = pos + HEADER_BYTES + n
    if end > len(buf):
        return None, pos, "torn"
    body = buf[pos + HEADER_BYTES : end]
    if crc(body, crc(buf[pos + 4 : pos + 8])) != want:
        return None, pos, "checksum mismatch"
    try:
        rec = msgpack.unpackb(body, raw=False, strict_map_key=True, **_UNPACK_LIMITS)
    except Exception as e:
        return None, pos, f"undecodable body ({type(e).__name__})"
    if not (
        isinstance(rec, list)
        and len(rec) == 3
        and isinstance(rec[0], str)
        and isinstance(rec[1], str)
        and (rec[2] is None or isinstance(rec[2], dict))
    ):
        return None, pos, "not an [op, key, entry] record"
    return (rec[0], rec[1], rec[2]), end, ""


def _next_valid(buf: bytes, start: int) -> int | None:
    pos = buf.find(MAGIC, start)
    while pos >= 0:
        if _record_at(buf, pos)[0] is not None:
            return pos
        pos = buf.find(MAGIC, pos + 1)
    return None


def scan_journal(buf: bytes, path: str) -> Scan:
    """Parse the framed records of one file, resynchronising past damage."""
    records: list[Record] = []
    damage: list[Damage] = []
    pos = 0
    while pos < len(buf):
        rec, end, why = _record_at(buf, pos)
        if rec is not None:
            records.append(rec)
            pos = end
            continue
        nxt = _next_valid(buf, pos + 1)
        if nxt is None:
            if why != "torn":
                damage.append(Damage(path, len(records) + 1, pos, len(buf) - pos, why))
                pos = len(buf)
            break  # else: a torn tail, never acknowledged
        if why == "torn":
            why = "length runs past a later record"
        damage.append(Damage(path, len(records) + 1, pos, nxt - pos, why))
        pos = nxt
    return Scan(records, damage, pos)


def os_error(e: OSError, what: str) -> TensorStoreError:
    """An OS error as the TensorStoreError a caller acts on: a full filesystem is a
    :class:`QuotaExceededError` (the write is refused; free space and retry), anything
    else a :class:`StoreUnavailableError`."""
    if e.errno in _FULL_ERRNOS:
        return QuotaExceededError(
            f"{what} failed: the filesystem is full ({e.strerror or e}); "
            "free space or point the store at a larger disk"
        )
    return StoreUnavailableError(f"{what} failed: {type(e).__name__}: {e}")


class IndexLog:
    """Persists ``key -> entry`` for one namespace. Not thread-safe: the owner locks.

    ``warn``: issue a ``RuntimeWarning`` naming the file when :meth:`load` finds
    damage (a reader that reports damage itself, such as ``inspect``, passes False).
    """

    def __init__(self, io: ChunkIO, directory: str, *, warn: bool = True) -> None:
        self._io = io
        self._dir = directory
        self._journal_path = f"{directory}/journal"
        self._snapshot_path = f"{directory}/snapshot"
        self._persist = not io.is_private_memory
        self._append = io.supports_append
        self._warn = warn
        self._journal: BinaryIO | None = None
        self._end: int | None = None  # where the next record goes (journal length)
        self._torn_at: int | None = None  # a torn tail starts here: cut before appending
        self._records = 0
        self._deferred: list[bytes] = []  # delete records not yet written (disk was full)
        self.damage: list[Damage] = []
        """Damaged regions found by :meth:`load` (empty when everything replayed)."""
        self.retired_keys: set[str] = set()
        """Keys whose last replayed record is a delete (set by :meth:`load`)."""

    # ------------------------------------------------------------------ replay
    @property
    def damaged_bytes(self) -> int:
        """Bytes the damage covers. At most ``damaged_bytes // HEADER_BYTES + 1`` records
        were lost, which bounds the keys replay cannot have seen."""
        return sum(d.nbytes for d in self.damage)

    def load(self) -> dict[str, IndexEntry]:
        """Replay snapshot then journal; returns the live entries (see :attr:`damage`).

        Raises :class:`~tensorstore_hooks.IntegrityError` for a format 1 file and
        :class:`~tensorstore_hooks.StoreUnavailableError` if the files cannot be read.
        """
        entries: dict[str, IndexEntry] = {}
        self.damage = []
        if not self._persist:
            return entries
        snap = self._read(self._snapshot_path)
        if snap:
            self._load_snapshot(snap, entries)
        raw = self._read(self._journal_path)
        if raw and not raw.startswith(MAGIC) and _is_format1_journal(raw):
            raise self._format1(self._journal_path)
        found = scan_journal(raw, self._where(self._journal_path))
        self.damage.extend(found.damage)
        self._end = len(raw)
        self._torn_at = found.valid_end if found.valid_end < len(raw) else None
        for op, key, entry in found.records:
            self._records += 1
            if op == "put" and entry is not None:
                entries[key] = entry
                self.retired_keys.discard(key)
            elif op == "del":
                entries.pop(key, None)
                self.retired_keys.add(key)
        if self.damage and self._warn:
            warnings.warn(
                "tensorstore-hooks index damaged; the tensors its damaged records describe "
                "are lost, the rest replayed: " + "; ".join(str(d) for d in self.damage),
                RuntimeWarning,
                stacklevel=3,
            )
        return entries

    def _where(self, path: str) -> str:
        return f"{self._io.url}/{path}"

    def _read(self, path: str) -> bytes:
        try:
            return bytes(self._io.read(path))
        except FileNotFoundError:
            return b""
        except IsADirectoryError as e:
            raise IntegrityError(
                f"index file {self._where(path)} is a directory; remove it (the namespace's "
                "index is damaged)"
            ) from e
        except NotADirectoryError as e:
            raise IntegrityError(
                f"index directory {self._where(self._dir)} is not a directory; the "
                "namespace's index is damaged (move the file away)"
            ) from e
        except OSError as e:
            raise os_error(e, f"reading index file {self._where(path)}") from e

    def _load_snapshot(self, raw: bytes, entries: dict[str, IndexEntry]) -> None:
        where = self._where(self._snapshot_path)
        if len(raw) > _MAX_SNAPSHOT:
            raise IntegrityError(f"index snapshot {where} is larger than {_MAX_SNAPSHOT} bytes")
        if not raw.startswith(MAGIC) and _is_format1_snapshot(raw):
            raise self._format1(self._snapshot_path)
        found = scan_journal(raw, where)
        self.damage.extend(found.damage)
        records = found.records
        promised: int | None = None
        if records and records[0][0] == "snap" and isinstance(records[0][2], dict):
            n = records[0][2].get("records")
            promised = n if isinstance(n, int) else None
            records = records[1:]
        puts = [(k, e) for op, k, e in records if op == "put" and e is not None]
        if promised is None and not found.damage:
            self.damage.append(Damage(where, 1, 0, 0, "no snapshot header record"))
        elif promised is not None and len(puts) < promised and not found.damage:
            self.damage.append(
                Damage(
                    where,
                    len(puts) + 2,
                    found.valid_end,
                    len(raw) - found.valid_end,
                    f"{promised - len(puts)} of {promised} records missing (truncated)",
                )
            )
        entries.update(puts)

    def _format1(self, path: str) -> IntegrityError:
        return IntegrityError(
            f"index file {self._where(path)} is in format 1 (records without checksums, "
            "written by an older tensorstore-hooks); this version reads format 2 only. Its "
            "tensors cannot be resumed: remove the namespace directory "
            f"{self._dir.rsplit('/', 1)[0]!r} (or read it with the older version)"
        )

    # ------------------------------------------------------------------ writes
    def record_put(self, key: str, entry: IndexEntry) -> None:
        """Append a put record. Raises a TensorStoreError if it could not be written
        (the file is as before: do not acknowledge the put)."""
        self._write(frame_record(["put", key, entry]))

    def record_delete(self, key: str) -> None:
        """Append a delete record. Never raises for an OS error: a record that cannot
        be written now (disk full) is kept and written before the next record, so a
        later put that reuses the key's chunks is journaled after it. Until then a
        crash would bring the key back on replay; the store's chunk checksums (bound
        to the entry) keep it from ever returning another tensor's bytes."""
        data = frame_record(["del", key, None])
        try:
            self._write(data)
        except TensorStoreError as e:
            if not self._deferred:
                log.warning("journal %s: %s; delete records are kept until it works", self._dir, e)
            self._deferred.append(data)

    def record_deletes(self, keys: Sequence[str]) -> None:
        """Append delete records for ``keys`` in one write, or none of them: raises a
        TensorStoreError if they could not be written (the file is as before). For an
        owner that must not acknowledge a delete a crash could undo (the daemon's
        session journal)."""
        if keys:
            self._write(b"".join(frame_record(["del", k, None]) for k in keys), len(keys))

    def _write(self, data: bytes, records: int = 1) -> None:
        if not (self._persist and self._append):
            return
        f = self._open()
        if self._deferred:
            records += len(self._deferred)
            data = b"".join(self._deferred) + data
        try:
            written = f.write(data)
            if written != len(data):  # a partial write: go on, or meet the error
                _write_all(f, memoryview(data)[written or 0 :])
        except OSError as e:
            self._give_back(f)
            raise os_error(e, f"appending to journal {self._where(self._journal_path)}") from e
        assert self._end is not None
        self._end += len(data)
        self._records += records
        self._deferred.clear()

    def _open(self) -> BinaryIO:
        if self._journal is None:
            where = self._where(self._journal_path)
            try:
                self._journal = self._io.open_append(self._journal_path)
                if self._end is None:  # never loaded: append after what is there
                    self._end = self._journal.seek(0, 2)
                if self._torn_at is not None:
                    # Cut the torn tail off: a record appended after it would turn it
                    # into damage in the middle (NOTE [ Journal records ]).
                    self._journal.truncate(self._torn_at)
                    self._end = self._torn_at
                    self._torn_at = None
            except OSError as e:
                self._close_file()
                raise os_error(e, f"opening journal {where}") from e
        return self._journal

    def _give_back(self, f: BinaryIO) -> None:
        """After a failed append: truncate to the last whole record (frees the space)."""
        try:
            f.truncate(self._end)
        except OSError as e:
            # Leave it to the next append, which starts by cutting the same tail.
            log.debug("journal %s: truncating a failed append failed: %r", self._dir, e)
            self._torn_at = self._end
            self._close_file()

    def _close_file(self) -> None:
        if self._journal is not None:
            with contextlib.suppress(OSError):
                self._journal.close()
        self._journal = None

    def needs_compaction(self, live: int) -> bool:
        """True when the journal is mostly dead records (then call :meth:`snapshot`)."""
        return self._persist and self._append and self._records > 4 * live + 4096

    def snapshot(self, live: dict[str, IndexEntry]) -> None:
        """Write all live entries as the snapshot and reset the journal.

        Raises a TensorStoreError if the snapshot cannot be written; the journal and
        the previous snapshot are then untouched (still the truth).
        """
        if not self._persist:
            return
        parts = [frame_record(["snap", "", {"records": len(live)}])]
        parts.extend(frame_record(["put", k, e]) for k, e in live.items())
        try:
            # Whole and on disk before the journal is cut (NOTE [ Atomic documents ]).
            self._io.write_atomic(self._snapshot_path, parts)
        except OSError as e:
            raise os_error(e, f"writing index snapshot {self._where(self._snapshot_path)}") from e
        self._deferred.clear()  # the snapshot holds only live keys
        if self._append:
            # Records already in the snapshot may be replayed again after a crash between
            # these two steps; replaying them is harmless (same entries, same deletes).
            try:
                self._io.truncate(self._journal_path)
            except OSError as e:
                raise os_error(e, f"truncating journal {self._where(self._journal_path)}") from e
            self._end = 0
            self._torn_at = None
        self._records = 0

    def close(self) -> None:
        """Close the journal file (idempotent). Deferred delete records are tried once more."""
        if self._deferred:
            with contextlib.suppress(TensorStoreError):
                self._write(self._deferred.pop())
        self._close_file()


def _write_all(f: BinaryIO, mv: memoryview) -> None:
    while mv:
        n = f.write(mv)
        if not n:
            raise OSError(errno.EIO, "write returned 0")
        mv = mv[n:]


def _is_format1_journal(raw: bytes) -> bool:
    """True if ``raw`` starts like a format 1 journal (``u32`` length + msgpack record)."""
    if len(raw) < 5:
        return False
    n = int.from_bytes(raw[:4], "little")
    if not 0 < n <= (1 << 20) or len(raw) < 4 + n:
        return False
    try:
        rec = msgpack.unpackb(raw[4 : 4 + n], raw=False)
    except Exception:
        return False
    return isinstance(rec, list) and len(rec) == 3 and rec[0] in _OPS


def _is_format1_snapshot(raw: bytes) -> bool:
    """True if ``raw`` is a format 1 snapshot (one msgpack map)."""
    try:
        return isinstance(msgpack.unpackb(raw, raw=False), dict)
    except Exception:
        return False
