"""Captured chunk objects read into pooled buffers, checked, and gathered into batches.

NOTE [ Capture reads ]
1. A chunk object is read whole, with one large sequential read, into a page-aligned
   buffer lent by the reader's pool (:class:`~tensorstore_hooks.storage.io.BufferPool`,
   NOTE [ Aligned buffers ] rule 3): a buffer comes back when the last tensor over it
   dies, so after the first windows no read pays for fresh pages (page faults cost here
   about as much as the copy). A local file is read with
   ``preadv`` (from the page cache when it holds the file, in one request to the disk
   otherwise); other roots with their ``readinto``.
2. Before a buffer is taken the object's size is checked against its document (a
   ``zarr.json`` claiming more rows or larger rows than the files hold costs a
   ``stat``, not an allocation) and after the read its crc32c, before any row is used:
   either failing is an :class:`IntegrityError` naming the chunk.
3. A local chunk is *mapped* instead, when the arrays a dataset reads fit within its
   ``map_bytes``: a read-only shared map of the file (populated at once, after asking
   the kernel to read the whole file ahead) is kept from epoch to epoch, so a warm
   epoch copies each row once, from the page cache into its batch, with no read copy
   and no map to set up again (both cost here about what the gather does). A map is
   made again when its file changed (device, inode, size, mtime: a chunk rewritten by
   a rename is a new file), and the least recently used maps go beyond ``map_bytes``.
   Mapped pages are page cache: RSS counts them as shared file pages, and the kernel
   reclaims them under pressure as any page cache (the map then reads them again).
4. A window's pieces are read by one task each, all queued at once (their reads overlap
   one another and the copies of the pieces read before them); meanwhile the consumer's
   thread deals the window's order out to batches (a batch's rows in window order, so
   the rows one piece gives a batch are one run of it). Once its piece is read and
   checked, the task copies each of its rows once, straight from the chunk's buffer or
   map into its place in a batch (one ``numpy.take`` per batch it feeds: no shuffled
   intermediate copy), and drops the chunk. A batch is one pooled buffer (it returns to
   the pool when the last tensor made from it dies) and is served once every task of
   the windows it spans is done.
5. So a process holds, from its pool, the batches of the ``read_ahead + 1`` windows
   being filled, one chunk per reader thread, and the batches the consumer still holds;
   :attr:`CaptureDataset.pool_bytes` is that bound for a consumer that drops each batch
   after its step.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections import OrderedDict

import numpy as np
import numpy.typing as npt

from tensorstore_hooks.capture._layout import ArrayInfo, chunk_path
from tensorstore_hooks.errors import IntegrityError
from tensorstore_hooks.storage.io import BufferPool, ChunkIO, LocalIO
from tensorstore_hooks.storage.zarr import crc

__all__ = ["ChunkReader", "MapCache", "Scatter", "scatter"]

_Index = npt.NDArray[np.int64]
_Bytes = npt.NDArray[np.uint8]
Scatter = tuple[_Bytes, _Index]
"""Where a piece's rows go: ``(out, rows)``, ``out[i] = piece[rows[i]]`` (rule 4)."""


class MapCache:
    """Maps of local chunk files kept from epoch to epoch, at most ``limit_bytes`` of
    them (rule 3). Thread-safe."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self._maps: OrderedDict[str, tuple[tuple[int, ...], _Bytes]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, path: str, fd: int, st: os.stat_result) -> _Bytes:
        """The bytes of the file ``path`` (open as ``fd``, whose ``fstat`` is ``st``)."""
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        with self._lock:
            hit = self._maps.get(path)
            if hit is not None and hit[0] == key:
                self._maps.move_to_end(path)
                return hit[1]
        os.posix_fadvise(fd, 0, st.st_size, os.POSIX_FADV_WILLNEED)  # one request ahead
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        data = np.frombuffer(mmap.mmap(fd, st.st_size, flags=flags, prot=mmap.PROT_READ), np.uint8)
        with self._lock:
            old = self._maps.pop(path, None)
            if old is not None:
                self._bytes -= len(old[1])
            self._maps[path] = (key, data)
            self._bytes += len(data)
            while self._bytes > self.limit_bytes and len(self._maps) > 1:
                _, (_, gone) = self._maps.popitem(last=False)
                self._bytes -= len(gone)  # unmapped once no window uses it
        return data


class ChunkReader:
    """Reads chunk objects of one root into buffers lent by ``pool`` (rules 1 and 2),
    or through ``maps`` (rule 3, local roots); a buffer goes back to the pool when the
    last tensor over it dies. Thread-safe."""

    def __init__(self, io: ChunkIO, pool: BufferPool, maps: MapCache | None = None) -> None:
        self.io = io
        self.pool = pool
        self.maps = maps

    def read(self, info: ArrayInfo, index: int, fold: int) -> _Bytes:
        """Chunk ``index`` of ``info`` as ``(served rows, row bytes)`` uint8 rows of
        ``row_bytes // fold`` bytes each."""
        path = chunk_path(info.path, index, len(info.row_shape) + 1)
        where = f"CaptureDataset: chunk {path} of {self.io.url}"
        size = info.chunk_bytes + 4
        if isinstance(self.io, LocalIO):
            data = self._read_local(os.path.join(self.io.root, path), size, where, info)
        else:
            data = self._read_other(path, size, where, info)
        if crc(data[:-4]) != int.from_bytes(data[-4:].tobytes(), "little"):
            raise IntegrityError(
                f"{where}: checksum mismatch, the stored bytes are corrupted (crc32c)"
            )
        return data[: info.chunk_rows * info.row_bytes].reshape(
            info.chunk_rows * fold, info.row_bytes // fold
        )

    def _read_local(self, full: str, size: int, where: str, info: ArrayInfo) -> _Bytes:
        try:
            fd = os.open(full, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise IntegrityError(f"{where} is missing ({info.rows} rows visible)") from None
        try:
            st = os.fstat(fd)
            if st.st_size != size:  # rule 2: before any buffer is taken
                raise IntegrityError(f"{where} has {st.st_size} bytes, expected {size}")
            if self.maps is not None:
                return self.maps.get(full, fd, st)
            data, view = self.pool.lend(size)
            pos = 0
            while pos < size:
                n = os.preadv(fd, [view[pos:size]], pos)
                if n <= 0:
                    raise IntegrityError(f"{where} ended after {pos} of {size} bytes")
                pos += n
            return data
        finally:
            os.close(fd)

    def _read_other(self, path: str, size: int, where: str, info: ArrayInfo) -> _Bytes:
        data, view = self.pool.lend(size + 1)  # one byte more: an object too long shows
        try:
            have = self.io.readinto(path, [view[: size + 1]])
        except FileNotFoundError:
            raise IntegrityError(f"{where} is missing ({info.rows} rows visible)") from None
        if have != size:
            raise IntegrityError(f"{where} has {have} bytes, expected {size}")
        return data[:size]


def scatter(piece: _Bytes, parts: list[Scatter]) -> None:
    """Copy rows of ``piece`` (rows of bytes) into batches (rule 4): ``out[i] =
    piece[rows[i]]`` for each ``(out, rows)``. ``numpy.take`` copies on the calling
    thread alone, without the GIL (torch's ``index_select`` would start its intra-op
    threads, which then compete with the other reader threads for the same cores)."""
    for out, rows in parts:
        np.take(piece, rows, axis=0, out=out, mode="clip")
