"""Capture documents (``zarr.json``) replaced so that no failure leaves one torn.

NOTE [ Capture documents ]
Captured rows are data people keep for weeks; an array's ``zarr.json`` is the only
thing that makes its chunk files readable, so it must never be lost:

1. A document is replaced, never rewritten in place. On a local root the new bytes go
   to a temporary file beside it (``.zarr.json.tmp-XXXXXXXX``: a dot name, which
   listings skip), which is synced (``fsync``), renamed over the document, and then
   the directory is synced. After any failure (a full disk, ``EFBIG``, a crash) the
   document is the old one or the new one, whole; a failed temporary file is removed.
   Object stores and memory roots replace a whole object per write anyway.
2. A document that exists but cannot be used (it does not parse, is larger than any
   we write, is nested deeper than JSON can be read, or is not a capture array) is
   never written over, and the chunk files beside it are never touched: the array
   is reported, skipped, and named by ``inspect``, with how to recover
   (:func:`recovery_hint`; ``capture/_repair.py`` rebuilds what can be proven).
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import secrets

from tensorstore_hooks.storage.io import ChunkIO, LocalIO

__all__ = ["recovery_hint", "write_document"]


def write_document(io: ChunkIO, path: str, data: bytes) -> None:
    """Replace the document ``path`` under ``io``'s root with ``data``, atomically
    (rule 1). Raises the ``OSError`` of a failed write; the old document is then intact."""
    if not isinstance(io, LocalIO):
        io.write(path, [data])  # one whole object per request: never torn
        return
    folder, name = posixpath.split(path)
    tmp = posixpath.join(folder, f".{name}.tmp-{secrets.token_hex(4)}")
    try:
        io.write(tmp, [data])
        _sync(os.path.join(io.root, tmp))
        io.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(Exception):
            io.delete([tmp])
        raise
    _sync(os.path.dirname(os.path.join(io.root, path)))


def _sync(path: str) -> None:
    """``fsync`` a file or a directory (a read-only descriptor is enough on Linux)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def recovery_hint(url: str, name: str) -> str:
    """How to get the rows of the damaged capture array ``name`` under ``url`` back."""
    return (
        "its chunk files are kept and nothing is written over them. To rebuild the "
        "document from what survives (the shape, chunking and dtype a torn document still "
        "holds, every chunk checked against its crc32c): python -c \"import "
        f"tensorstore_hooks.capture as c; c.repair_array('{url}', '{name}')\" "
        "(or restore that zarr.json from a backup)"
    )
