"""A private in-process dict of objects (never fsspec's process-global memory filesystem)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from tensorstore_hooks._codec import as_memoryview
from tensorstore_hooks.storage.io._base import Buffer, ChunkIO

__all__ = ["MemoryIO"]

log = logging.getLogger("tensorstore_hooks")

class MemoryIO(ChunkIO):
    """A private in-process dict (never fsspec's process-global memory filesystem)."""

    is_private_memory = True

    def __init__(self, label: str = "memory://") -> None:
        super().__init__(label)
        self._objects: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def write(self, path: str, parts: Sequence[Buffer]) -> None:
        data = b"".join(as_memoryview(p).cast("B") for p in parts)
        self._objects[path] = data

    def read(self, path: str) -> bytes:
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


