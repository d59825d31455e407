"""Moving whole objects (chunk files, metadata documents) under one root.

Three backends share one small interface: :class:`LocalIO` talks to the OS directly
(one ``open``/``write`` per chunk, ``readinto`` a caller's buffer: no extra copy),
:class:`MemoryIO` keeps bytes in a private dict, and :class:`FsspecIO` goes through
any fsspec filesystem (S3, GCS, ...), batching many objects into one concurrent call.
Paths are ``/``-separated and relative to the root.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

__all__ = ["ChunkIO", "FsspecIO", "LocalIO", "MemoryIO"]

Buffer = Any  # bytes, bytearray, memoryview or a numpy array


class ChunkIO(ABC):
    """Reads and writes whole objects relative to a root. Thread-safe."""

    supports_append: bool = False
    """True if :meth:`open_append` works (cheap durable journals)."""

    def __init__(self, url: str) -> None:
        self.url = url

    @abstractmethod
    def write(self, path: str, parts: Sequence[Buffer]) -> None:
        """Write the concatenation of ``parts`` as object ``path`` (replacing it)."""

    def write_many(self, items: Sequence[tuple[str, Sequence[Buffer]]]) -> None:
        for path, parts in items:
            self.write(path, parts)

    @abstractmethod
    def read(self, path: str) -> Buffer:
        """Return the bytes of ``path``. Raises ``FileNotFoundError`` if absent."""

    def read_many(self, paths: Sequence[str]) -> list[Buffer]:
        return [self.read(p) for p in paths]

    def readinto(self, path: str, views: Sequence[memoryview]) -> int:
        """Fill ``views`` in order from the start of ``path``; return the object's size.

        Views beyond the end of the object are left partly unfilled; the caller
        compares the returned size with what it expected.
        """
        data = memoryview(self.read(path)).cast("B")
        pos = 0
        for v in views:
            n = min(len(v), len(data) - pos)
            v[:n] = data[pos : pos + n]
            pos += n
        return len(data)

    @abstractmethod
    def delete(self, paths: Sequence[str]) -> None:
        """Delete objects; missing ones are ignored."""

    @abstractmethod
    def exists(self, path: str) -> bool: ...

    @abstractmethod
    def listdir(self, path: str) -> list[str]:
        """Names (not paths) of the entries under ``path``; empty if it does not exist."""

    @abstractmethod
    def remove_tree(self, path: str) -> None:
        """Remove ``path`` and everything under it; absent is fine."""

    def open_append(self, path: str) -> Any:
        """An unbuffered binary file opened for appending (only if ``supports_append``)."""
        raise NotImplementedError(f"{type(self).__name__} cannot append")

    def truncate(self, path: str) -> None:
        """Empty ``path`` in place (only if ``supports_append``)."""
        raise NotImplementedError(f"{type(self).__name__} cannot truncate")

    def replace(self, src: str, dst: str) -> None:
        """Move ``src`` over ``dst``, atomically where the backend can."""
        self.write(dst, [self.read(src)])
        self.delete([src])


class LocalIO(ChunkIO):
    """A directory on a local filesystem, through plain OS calls."""

    supports_append = True

    def __init__(self, root: str) -> None:
        super().__init__("file://" + os.path.abspath(root))
        self.root = os.path.abspath(root)

    def _full(self, path: str) -> str:
        return os.path.join(self.root, path) if path else self.root

    def write(self, path: str, parts: Sequence[Buffer]) -> None:
        full = self._full(path)
        try:
            f = open(full, "wb", buffering=0)  # noqa: SIM115 - closed below
        except FileNotFoundError:
            os.makedirs(os.path.dirname(full), exist_ok=True)
            f = open(full, "wb", buffering=0)  # noqa: SIM115
        with f:
            for part in parts:
                mv = memoryview(part).cast("B")
                while mv:
                    n = f.write(mv)
                    if n is None:  # pragma: no cover - only non-blocking files
                        raise OSError(f"short write to {full}")
                    mv = mv[n:]

    def read(self, path: str) -> Buffer:
        with open(self._full(path), "rb", buffering=0) as f:
            return f.read()

    def readinto(self, path: str, views: Sequence[memoryview]) -> int:
        with open(self._full(path), "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            for v in views:
                pos = 0
                while pos < len(v):
                    n = f.readinto(v[pos:])
                    if not n:
                        return size
                    pos += n
            return size

    def delete(self, paths: Sequence[str]) -> None:
        for p in paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._full(p))

    def exists(self, path: str) -> bool:
        return os.path.exists(self._full(path))

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(self._full(path)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def remove_tree(self, path: str) -> None:
        shutil.rmtree(self._full(path), ignore_errors=True)

    def open_append(self, path: str) -> Any:
        full = self._full(path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        return open(full, "ab", buffering=0)

    def truncate(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.truncate(self._full(path), 0)

    def replace(self, src: str, dst: str) -> None:
        os.replace(self._full(src), self._full(dst))


class MemoryIO(ChunkIO):
    """A private in-process dict (never fsspec's process-global memory filesystem)."""

    def __init__(self, label: str = "memory://") -> None:
        super().__init__(label)
        self._objects: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def write(self, path: str, parts: Sequence[Buffer]) -> None:
        data = b"".join(memoryview(p).cast("B") for p in parts)
        self._objects[path] = data

    def read(self, path: str) -> Buffer:
        try:
            return self._objects[path]
        except KeyError:
            raise FileNotFoundError(path) from None

    def delete(self, paths: Sequence[str]) -> None:
        for p in paths:
            self._objects.pop(p, None)

    def exists(self, path: str) -> bool:
        if path in self._objects:
            return True
        prefix = path.rstrip("/") + "/"
        return any(k.startswith(prefix) for k in list(self._objects))

    def listdir(self, path: str) -> list[str]:
        prefix = path.rstrip("/") + "/" if path else ""
        names = {
            k[len(prefix) :].split("/", 1)[0] for k in list(self._objects) if k.startswith(prefix)
        }
        return sorted(names)

    def remove_tree(self, path: str) -> None:
        prefix = path.rstrip("/") + "/" if path else ""
        with self._lock:
            for k in [k for k in self._objects if k.startswith(prefix) or k == path]:
                del self._objects[k]

    def replace(self, src: str, dst: str) -> None:
        self._objects[dst] = self._objects.pop(src)


class FsspecIO(ChunkIO):
    """Any fsspec filesystem (``s3://``, ``gs://``, ``simplecache::...``).

    Batched calls (``write_many``/``read_many``) use fsspec's ``pipe``/``cat`` with
    many paths, which async filesystems such as s3fs run concurrently.
    """

    def __init__(self, fs: Any, root: str, url: str) -> None:
        super().__init__(url)
        self.fs = fs
        self.root = root.rstrip("/")

    def _full(self, path: str) -> str:
        return f"{self.root}/{path}" if path else self.root

    def write(self, path: str, parts: Sequence[Buffer]) -> None:
        self.fs.pipe_file(self._full(path), b"".join(memoryview(p).cast("B") for p in parts))

    def write_many(self, items: Sequence[tuple[str, Sequence[Buffer]]]) -> None:
        if len(items) == 1:
            self.write(*items[0])
            return
        self.fs.pipe(
            {self._full(p): b"".join(memoryview(x).cast("B") for x in parts) for p, parts in items}
        )

    def read(self, path: str) -> Buffer:
        return self.fs.cat_file(self._full(path))

    def read_many(self, paths: Sequence[str]) -> list[Buffer]:
        if len(paths) == 1:
            return [self.read(paths[0])]
        full = [self._full(p) for p in paths]
        got = self.fs.cat(full, on_error="return")
        out = []
        for f in full:
            v = got.get(f) if isinstance(got, dict) else None
            if v is None:
                v = FileNotFoundError(f)
            if isinstance(v, BaseException):
                raise v
            out.append(v)
        return out

    def delete(self, paths: Sequence[str]) -> None:
        if not paths:
            return
        full = [self._full(p) for p in paths]
        try:
            self.fs.rm(full)
        except FileNotFoundError:
            for f in full:
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm_file(f)

    def exists(self, path: str) -> bool:
        return bool(self.fs.exists(self._full(path)))

    def listdir(self, path: str) -> list[str]:
        try:
            entries = self.fs.ls(self._full(path), detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted({str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries})

    def remove_tree(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self._full(path), recursive=True)
