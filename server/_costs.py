"""What a stored tensor counts against the daemon's quotas.

NOTE [ What a tensor costs ]
Quotas count what a tensor really costs the daemon, not only its payload:

* in RAM: payload + ``RAM_OVERHEAD_BYTES`` (2 KiB: its key, metadata, buffer object
  and bookkeeping; measured at about 1.7 KiB of RSS per tensor). So zero-byte
  tensors count: a RAM quota of 1 MiB holds at most 512 of them.
* on disk: the chunk files it occupies (whole chunks of its size class: NOTE [ Segment
  layout ] in ``_zarr_store.py``, NOTE [ Chunk objects ] in ``_chunkcodec.py``) +
  ``DISK_RECORD_BYTES`` (512 bytes: its index and session-journal records).
  Everything else the directory holds (zarr.json documents, journal records of
  deleted tensors not yet compacted, snapshots) is measured from the files
  (:meth:`Tiers.refresh_metadata`) and counted as ``metadata``, so ``used`` is what
  the directory holds.
* ``--session-quota`` counts payload + ``RAM_OVERHEAD_BYTES`` per tensor, whichever
  tier holds it (``_sessions``).

A quota lower than what a restarted daemon finds on disk is honoured by refusing
(no new tensor goes to that tier until enough is freed); stored data is never
dropped to get under it.
"""

from __future__ import annotations

import contextlib
import os
import time

from tensorstore_hooks._store import BlobStore
from tensorstore_hooks._zarr_store import split_url

__all__ = [
    "DISK_RECORD_BYTES",
    "RAM_OVERHEAD_BYTES",
    "DiskCosts",
    "chunk_footprint",
    "ram_charge",
]

RAM_OVERHEAD_BYTES = 2048
"""Charged per tensor beyond its payload, in RAM and against a session's quota."""
DISK_RECORD_BYTES = 512
"""Charged per tensor on disk beyond its chunk files (its journal records)."""
_MIN_CHUNK_BYTES = 4 << 10
_METADATA_REFRESH_S = 0.5


def ram_charge(n: int) -> int:
    """What an ``n``-byte tensor counts against the RAM quota (and a session quota)."""
    return n + RAM_OVERHEAD_BYTES


def chunk_footprint(n: int, chunk_bytes: int) -> int:
    """Bytes of the chunk files an ``n``-byte payload occupies in a ZarrStore with
    ``chunk_bytes`` chunks (NOTE [ Segment layout ] in ``_zarr_store.py``): whole
    chunks of the largest size class whose padding is at most 1/8 (layout format 3: a
    chunk file is exactly its class's size, its checksum lives in the index)."""
    if n == 0:
        return 0
    classes = [c for c in (chunk_bytes >> i for i in range(chunk_bytes.bit_length()))]
    classes = [c for c in classes if c >= _MIN_CHUNK_BYTES] or [chunk_bytes]
    for c in classes:
        if c > n and c != classes[-1]:
            continue
        count = -(-n // c)
        if (count * c - n) * 8 <= n or c == classes[-1]:
            return count * c
    raise AssertionError("unreachable: the smallest class always fits")  # pragma: no cover


class DiskCosts:
    """Disk-side costs of one disk tier: per tensor, and the root's other files."""

    def __init__(self, disk: BlobStore | None) -> None:
        chunk_bytes = getattr(disk, "chunk_bytes", None)
        self._chunk_bytes = chunk_bytes if isinstance(chunk_bytes, int) else None
        kind, location = split_url(disk.url) if disk is not None else ("", "")
        self._local_root = location if kind == "local" else None
        self._measured_at = float("-inf")

    def charge(self, n: int) -> int:
        """What an ``n``-byte tensor counts against the disk quota."""
        if self._chunk_bytes is None:
            return n + DISK_RECORD_BYTES
        return chunk_footprint(n, self._chunk_bytes) + DISK_RECORD_BYTES

    def metadata(self, live_tensors: int, *, force: bool = False) -> int | None:
        """Bytes of the root's files other than chunk files, beyond the
        ``DISK_RECORD_BYTES`` each of ``live_tensors`` is already charged; None when
        not measured (not a local root, or measured less than 0.5 s ago)."""
        now = time.monotonic()
        if self._local_root is None:
            return None
        if not force and now - self._measured_at < _METADATA_REFRESH_S:
            return None
        self._measured_at = now
        total = 0
        for dirpath, dirnames, filenames in os.walk(self._local_root):
            dirnames[:] = [d for d in dirnames if d != "c"]  # chunk files: charged per tensor
            for name in filenames:
                with contextlib.suppress(OSError):
                    total += os.lstat(os.path.join(dirpath, name)).st_size
        return max(0, total - live_tensors * DISK_RECORD_BYTES)
