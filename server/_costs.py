"""What a stored tensor counts against the daemon's quotas, and what the disk root holds.

NOTE [ What a tensor costs ]
Quotas count what a tensor really costs the daemon, not only its payload:

* in RAM: payload + ``RAM_OVERHEAD_BYTES`` (2 KiB: its key, metadata, buffer object
  and bookkeeping; measured at about 1.7 KiB of RSS per tensor). So zero-byte
  tensors count: a RAM quota of 1 MiB holds at most 512 of them.
* on disk, the directory is the measure, exactly (NOTE [ Exact disk quota ]).
* ``--session-quota`` counts payload + ``RAM_OVERHEAD_BYTES`` per tensor, whichever
  tier holds it (``_sessions``).

A quota lower than what a restarted daemon finds on disk is honoured by refusing
(no new tensor goes to that tier until enough is freed); stored data is never
dropped to get under it.

NOTE [ Exact disk quota ]
The disk tier's directory never holds more than ``disk_quota`` bytes (file sizes),
and ``stats`` shows what it holds. Its files are:

1. chunk files: a tensor's run of whole chunks of its size class, each file exactly
   its class's size (layout format 4: the checksums and the rotation live in the index;
   NOTE [ Segment layout ] in ``_zarr_store.py``; :func:`chunk_footprint`), known
   from its size and counted from the moment its write starts until its delete ends;
2. journals: the disk index (``daemon/index``) and the session journal
   (``daemon/sessions``), each a journal + a snapshot. Their size is *measured* (a
   ``stat`` of each) whenever room is checked and no store call is running on the
   thread pool; while one is, it is the last measure plus the bound of each record
   written since. Dead records of deleted tensors count until a compaction drops them;
3. the other files (``zarr.json`` documents, the lock), measured by a walk at start
   and after a new size class's segment is created.

*used* = 1 + 2 + 3. Files that may still appear are *reserved* before they can:
a write in flight reserves its chunk files, its journal records and, for a size
class not seen yet, a segment document; and every stored tensor (and journaled
session) keeps a *standing* reservation for the records still to come: its delete
records, and its records' copy in the snapshot a compaction writes next to the old
journal before dropping it. A record is counted once: by the reservation that covers
it until that ends (then the journals' size counts it). So ``used + reserved <=
disk_quota`` holds at every moment, the directory is at most ``used + reserved``,
and when no store call is running *used* is exactly what it holds.
Dead records count until a compaction drops them; when they are what fills the
quota, a refused write first compacts both journals (``DiskTier.compact``, at most
once a second).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass

from tensorstore_hooks._codec import TensorMeta
from tensorstore_hooks.protocol import Msgpack
from tensorstore_hooks.storage import split_url
from tensorstore_hooks.storage.zarr import ZarrStore, frame_record

__all__ = [
    "DISK_NAMESPACE",
    "DISK_TENSOR_RAM_BYTES",
    "RAM_OVERHEAD_BYTES",
    "DiskCharge",
    "DiskCosts",
    "chunk_footprint",
    "ram_charge",
]

DISK_NAMESPACE = "daemon"
"""ZarrStore namespace of the disk tier under the root (fixed, so a restart resumes it);
the session journal lives in it too (``daemon/sessions``)."""
RAM_OVERHEAD_BYTES = 2048
"""Charged per tensor beyond its payload, in RAM and against a session's quota."""
DISK_TENSOR_RAM_BYTES = 1024
"""RAM charged per disk-tier tensor against ``limits.disk_bookkeeping`` (NOTE [ Disk-tier
bookkeeping ] in ``_disk``; measured about 765 bytes)."""
_MIN_CHUNK_BYTES = 4 << 10
_INDEX_CRC_BYTES = 4
"""Per chunk, in the disk index record: its crc32c (NOTE [ Bound chunk checksums ])."""
_SEGMENT_DOC_BYTES = 2048
"""Bound on a new size class's ``seg-CHUNK/zarr.json`` (about 530 bytes measured)."""
_RECORD_SLACK_BYTES = 16
"""Added to each computed record bound (a small field the disk index may add)."""
_SNAPSHOT_HEADER_BYTES = 64
_BIG = (1 << 64) - 1  # the widest msgpack integer: bounds never undercount
_DISK_KEY = "f" * 16  # the disk index's keys are hex counters
_DAEMON_KEY = "k:" + "x" * 22  # the daemon's keys: secrets.token_urlsafe(16)
_SESSION = "x" * 32  # session ids: secrets.token_urlsafe(24)
_JOURNAL_DIRS = (f"{DISK_NAMESPACE}/index", f"{DISK_NAMESPACE}/sessions")
_JOURNAL_FILES = ("journal", "snapshot", "snapshot.tmp")


def ram_charge(n: int) -> int:
    """What an ``n``-byte tensor counts against the RAM quota (and a session quota)."""
    return n + RAM_OVERHEAD_BYTES


def _classes(chunk_bytes: int) -> list[int]:
    classes = [c for c in (chunk_bytes >> i for i in range(chunk_bytes.bit_length()))]
    return [c for c in classes if c >= _MIN_CHUNK_BYTES] or [chunk_bytes]


def chunk_layout(n: int, chunk_bytes: int) -> tuple[int, int]:
    """``(size class, chunk count)`` of an ``n``-byte payload in a ZarrStore with
    ``chunk_bytes`` chunks: whole chunks of the largest size class whose padding is
    at most 1/8 (NOTE [ Segment layout ] in ``_zarr_store.py``)."""
    return _layout(n, _classes(chunk_bytes))


def _layout(n: int, classes: list[int]) -> tuple[int, int]:
    if n == 0:
        return 0, 0
    for c in classes:
        if c > n and c != classes[-1]:
            continue
        count = -(-n // c)
        if (count * c - n) * 8 <= n or c == classes[-1]:
            return c, count
    raise AssertionError("unreachable: the smallest class always fits")  # pragma: no cover


def chunk_footprint(n: int, chunk_bytes: int) -> int:
    """Bytes of the chunk files an ``n``-byte payload occupies (whole chunks of its
    class; a chunk file is exactly its class's size)."""
    chunk, count = chunk_layout(n, chunk_bytes)
    return count * chunk


@dataclass(frozen=True, slots=True)
class DiskCharge:
    """What one tensor reserves on the disk tier (bounds: NOTE [ Exact disk quota ])."""

    chunk_class: int
    """Its chunks' size class (0 for an empty payload)."""
    files: int
    """Its chunk files' bytes (whole chunks of its class)."""
    records: int
    """Its put records, in the disk index and the session journal."""
    index_del: int
    """Its delete record in the disk index."""
    session_del: int
    """Its delete record in the session journal."""

    @property
    def standing(self) -> int:
        """Kept while it is stored: its delete records + its records' copy in a snapshot."""
        return self.index_del + self.session_del + self.records

    @property
    def write(self) -> int:
        """Reserved while it is written: files + records + standing."""
        return self.files + self.records + self.standing


def _bound(record: Sequence[Msgpack]) -> int:
    return len(frame_record(record)) + _RECORD_SLACK_BYTES


_CRC_BIN_HEADER = 5  # msgpack bin 32 header of the chunk checksums
_SESSION_KEY_PUT = _bound(["put", _DAEMON_KEY, {"s": _SESSION, "d": _DISK_KEY, "n": _BIG}])


@functools.lru_cache(maxsize=256)
def _index_put_base(dtype: str, device: str, framework: str, ndim: int) -> int:
    """Bound on a disk-index put record without its chunk checksums: the tensor's own
    strings, every integer at its widest (computed once per kind of tensor, so a
    charge is arithmetic)."""
    meta: dict[str, Msgpack] = {
        "dtype": dtype,
        "storage_dtype": "x" * 8,
        "shape": [_BIG] * ndim,
        "stride": [_BIG] * ndim,
        "storage_offset": _BIG,
        "compact": False,
        "device": device,
        "requires_grad": False,
        "nbytes": _BIG,
        **({} if framework == "torch" else {"framework": framework}),
    }
    entry: dict[str, Msgpack] = {
        "seg": _BIG, "start": _BIG, "count": _BIG, "crc": b"", "rot": _BIG, "meta": meta
    }
    return _bound(["put", _DISK_KEY, entry]) + _CRC_BIN_HEADER


class DiskCosts:
    """Disk-side costs of one disk tier: per tensor, per session, and the root's files."""

    def __init__(self, disk: ZarrStore | None) -> None:
        self.chunk_bytes: int = disk.chunk_bytes if disk is not None else 8 << 20
        self._size_classes = _classes(self.chunk_bytes)
        kind, location = split_url(disk.url) if disk is not None else ("", "")
        self.local_root = location if kind == "local" else None
        self._index_del = _bound(["del", _DISK_KEY, None])
        self._session_del = _bound(["del", _DAEMON_KEY, None])
        session_put = _bound(["put", "s:" + _SESSION, {"created": 1e300}])
        self.session_standing = session_put + _bound(["del", "s:" + _SESSION, None])
        """A journaled session's own record: its delete + its copy in a snapshot."""
        self.session_record = session_put
        """A session's own put record (written with its first disk-tier tensor)."""
        self.journal_paths: tuple[str, ...] = ()
        if self.local_root is not None:
            self.journal_paths = tuple(
                os.path.join(self.local_root, d, f) for d in _JOURNAL_DIRS for f in _JOURNAL_FILES
            )

    def charge(self, meta: TensorMeta) -> DiskCharge:
        """What the tensor described by ``meta`` reserves on the disk tier."""
        chunk, count = _layout(meta.nbytes, self._size_classes)
        base = _index_put_base(meta.dtype, meta.device, meta.framework, len(meta.shape))
        index_put = base + _INDEX_CRC_BYTES * count
        records = index_put + _SESSION_KEY_PUT
        return DiskCharge(
            chunk_class=chunk,
            files=count * chunk,
            records=records,
            index_del=self._index_del,
            session_del=self._session_del,
        )

    @property
    def snapshot_headers(self) -> int:
        """Standing room for the header record of each journal's next snapshot."""
        return len(_JOURNAL_DIRS) * _SNAPSHOT_HEADER_BYTES

    @staticmethod
    def segment_doc_bound() -> int:
        """Room a new size class's segment document may take."""
        return _SEGMENT_DOC_BYTES

    def journal_bytes(self) -> int:
        """Bytes of both journals and their snapshots now (0 for a non-local root)."""
        total = 0
        for path in self.journal_paths:
            with contextlib.suppress(OSError):
                total += os.stat(path).st_size
        return total

    def other_files(self) -> tuple[int, set[int]]:
        """Bytes of the root's files that are neither chunk files nor journals, and the
        size classes whose segment exists (a walk: call it rarely)."""
        if self.local_root is None:
            return 0, set()
        skip = set(self.journal_paths)
        total = 0
        classes: set[int] = set()
        for dirpath, dirnames, filenames in os.walk(self.local_root):
            base = os.path.basename(dirpath)
            if base.startswith("seg-") and base[4:].isdigit():
                classes.add(int(base[4:]))
            dirnames[:] = [d for d in dirnames if d != "c"]  # chunk files: counted per tensor
            for name in filenames:
                full = os.path.join(dirpath, name)
                if full in skip:
                    continue
                with contextlib.suppress(OSError):
                    total += os.lstat(full).st_size
        return total, classes
