"""Moving whole objects (chunk files, metadata documents) under one root: the interface.

Three backends share one small interface: :class:`LocalIO` talks to the OS directly
(one ``open``/``write`` per chunk, ``readinto`` a caller's buffer: no extra copy; with
``O_DIRECT`` where the filesystem allows it, NOTE [ Direct I/O ]), :class:`MemoryIO`
keeps bytes in a private dict, and :class:`FsspecIO` goes through any fsspec
filesystem (S3, GCS, ...), batching many objects into one concurrent call. Paths are
``/``-separated and relative to the root.

NOTE [ Atomic documents ]
A metadata document (a ``zarr.json``, an index snapshot, a capture array's
attributes) is rewritten whole, and a reader or a crash must see the old document or
the new one, never a mix or a prefix: a torn ``zarr.json`` makes a root unreadable
to plain zarr and ``inspect``, and one that cannot be parsed is never overwritten
(the store reports it instead). So documents go through :meth:`ChunkIO.write_atomic`:

1. Local files: the bytes go to a new temporary file beside the document
   (``.NAME.tmp-PID-RANDOM``), which is ``fsync``-ed, renamed over the document
   (``rename`` is atomic within a directory), and the directory is ``fsync``-ed so
   the rename itself survives a power loss. A write that fails (ENOSPC, EFBIG,
   EIO, ...) removes the temporary file and leaves the document as it was.
2. Object stores and memory: a PUT (a dict assignment) replaces a whole object at
   once, so :meth:`ChunkIO.write` is already atomic there.
3. A file someone holds a ``flock`` on (a namespace's ``lock``) is never replaced:
   the lock belongs to the file, and a renamed-over file would drop it.

Chunk files are not documents: they are written in place (NOTE [ Spare chunk
files ]) and bound to their index entry by checksums, which catch a torn chunk.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import BinaryIO

from tensorstore_hooks._codec import Buffer, as_memoryview
from tensorstore_hooks.errors import ConfigError
from tensorstore_hooks.storage._store import DirectIOStatus

__all__ = ["DIRECT_IO_MODES", "Buffer", "ChunkIO", "DirectIOStatus"]

log = logging.getLogger("tensorstore_hooks")

DIRECT_IO_MODES = ("auto", "on", "off")
"""The values of ``store.direct_io``."""


class ChunkIO(ABC):
    """Reads and writes whole objects relative to a root. Thread-safe."""

    supports_append: bool = False
    """True if :meth:`open_append` works (cheap durable journals)."""

    supports_rewrite_in_place: bool = False
    """True if rewriting an existing object costs less than deleting it and writing a
    new one (local files), so freed chunk objects are worth keeping for reuse."""

    supports_direct_read: bool = False
    """True if :meth:`readinto` reads straight into the caller's buffers piece by piece
    (no intermediate copy; ``filled`` is called between pieces), so a reader can
    checksum while reading. Otherwise :meth:`readinto` is a whole-object read + copy."""

    is_private_memory: bool = False
    """True if the objects live only in this process and die with this object
    (nothing to persist, nothing another process can see)."""

    def __init__(self, url: str) -> None:
        self.url = url

    @abstractmethod
    def write(self, path: str, parts: Sequence[Buffer]) -> None:
        """Write the concatenation of ``parts`` as object ``path`` (replacing it)."""

    def write_atomic(self, path: str, parts: Sequence[Buffer]) -> None:
        """Replace object ``path`` with the concatenation of ``parts`` so that a reader,
        or a crash, sees the old object whole or the new one whole, never a mix
        (NOTE [ Atomic documents ]); durable when it returns where the backend can
        make it so. On failure the old object is untouched and the error (``OSError``
        for a local file) is raised. Default: :meth:`write`, for backends where
        writing one object is atomic (object stores, memory)."""
        self.write(path, parts)

    def write_many(self, items: Sequence[tuple[str, Sequence[Buffer]]]) -> None:
        for path, parts in items:
            self.write(path, parts)

    def write_sized(self, path: str, parts: Sequence[Buffer], size: int) -> None:
        """Write object ``path`` of ``size`` bytes that starts with the concatenation of
        ``parts``; the bytes after them are zeros in a new object and unspecified in one
        rewritten in place (here: always zeros)."""
        n = sum(as_memoryview(p).nbytes for p in parts)
        self.write(path, [*parts, bytes(size - n)] if size > n else parts)

    # ------------------------------------------------------- NOTE [ Direct I/O ]
    direct_io: DirectIOStatus | None = None
    """Set by :meth:`configure_direct_io`; ``None`` until then (buffered)."""

    @property
    def uses_direct_io(self) -> bool:
        """True once :meth:`configure_direct_io` turned ``O_DIRECT`` on."""
        return self.direct_io is not None and self.direct_io.enabled

    def configure_direct_io(self, mode: str, probe_path: str) -> DirectIOStatus:
        """Turn direct I/O on where ``mode`` (``auto``/``on``/``off``) and the backend
        allow it (NOTE [ Direct I/O ] rule 1); ``probe_path`` names a scratch object
        the probe may create and remove. Raises :class:`ConfigError` for ``on`` where
        it cannot be had. Call once, before any chunk I/O."""
        if mode == "on":
            raise ConfigError(
                f"direct_io='on' needs a local directory, but {self.url} is not one "
                "(O_DIRECT is a local-filesystem feature); use direct_io='auto' or 'off'"
            )
        self.direct_io = DirectIOStatus(False, mode, "not a local directory")
        return self.direct_io

    def recheck_direct_io(self) -> None:  # noqa: B027 - optional: most backends never probe
        """Run again a direct-I/O probe that could not run before (a full disk, no
        permission), rate-limited; called before each write. Default: nothing."""

    def write_aligned(self, path: str, views: Sequence[memoryview], size: int) -> None:
        """Write the concatenation of ``views`` at offset 0 of ``path`` with ``O_DIRECT``,
        then make the object ``size`` bytes (NOTE [ Direct I/O ] rule 4). Each view must
        start on a ``BLOCK_BYTES`` boundary and be a multiple of it long."""
        raise NotImplementedError(f"{type(self).__name__} has no direct I/O")

    def read_aligned(self, path: str, view: memoryview) -> tuple[int, int]:
        """Fill ``view`` (aligned as for :meth:`write_aligned`) from offset 0 of ``path``
        with ``O_DIRECT``; returns (bytes read, object size). Fewer bytes are read only
        at the end of the object. Raises ``FileNotFoundError`` if absent."""
        raise NotImplementedError(f"{type(self).__name__} has no direct I/O")

    @abstractmethod
    def read(self, path: str) -> bytes:
        """Return the bytes of ``path``. Raises ``FileNotFoundError`` if absent."""

    def read_many(self, paths: Sequence[str]) -> list[bytes]:
        return [self.read(p) for p in paths]

    def readinto(
        self,
        path: str,
        views: Sequence[memoryview],
        filled: Callable[[int], None] | None = None,
    ) -> int:
        """Fill ``views`` in order from the start of ``path``; return the object's size.

        Views beyond the end of the object are left partly unfilled; the caller
        compares the returned size with what it expected. ``filled(i)``, if given, is
        called as soon as view ``i`` is complete (local files: before the next is read),
        so the caller can checksum while the rest is read.
        """
        data = memoryview(self.read(path)).cast("B")
        pos = 0
        for i, v in enumerate(views):
            n = min(len(v), len(data) - pos)
            v[:n] = data[pos : pos + n]
            pos += n
            if n < len(v):
                break
            if filled is not None:
                filled(i)
        return len(data)

    @abstractmethod
    def delete(self, paths: Sequence[str]) -> None:
        """Delete objects; missing ones are ignored."""

    def take_uncertain(self, paths: Sequence[str]) -> bool:
        """Whether a write or delete of any of ``paths`` had an attempt fail in a way
        that may still take effect later (the service may apply a request after the
        client gave up on it); the paths are forgotten. Always False where an
        operation's outcome is known when it returns (local files, memory).
        NOTE [ Requests that land late ] in ``storage/zarr/_store.py``."""
        return False

    @abstractmethod
    def exists(self, path: str) -> bool: ...

    @abstractmethod
    def listdir(self, path: str) -> list[str]:
        """Names (not paths) of the entries under ``path``; empty if it does not exist."""

    @abstractmethod
    def remove_tree(self, path: str) -> None:
        """Remove ``path`` and everything under it; absent is fine."""

    def open_append(self, path: str) -> BinaryIO:
        """An unbuffered binary file opened for appending (only if ``supports_append``)."""
        raise NotImplementedError(f"{type(self).__name__} cannot append")

    def truncate(self, path: str) -> None:
        """Empty ``path`` in place (only if ``supports_append``)."""
        raise NotImplementedError(f"{type(self).__name__} cannot truncate")

    def replace(self, src: str, dst: str) -> None:
        """Move ``src`` over ``dst``, atomically where the backend can."""
        self.write(dst, [self.read(src)])
        self.delete([src])

    def lock(self, path: str) -> Callable[[], None] | None:
        """Take an exclusive lock named by ``path`` for as long as this process holds it
        (released by the returned function, or when the process dies).

        Returns None where the backend has no locks (object stores, private memory).
        Raises ``BlockingIOError`` whose ``strerror`` names the holder if another
        object (in this or another process) holds it. Never waits.
        """
        return None

    def close(self) -> None:  # noqa: B027 - optional: most backends hold nothing to release
        """Release connections or sessions this object holds (idempotent; default none)."""


