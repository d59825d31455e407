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
3. A batch is one pooled buffer (it returns to the pool when the last tensor made from
   it dies), filled by one ``index_select`` per chunk of the window, each row copied
   once, straight from the chunk's buffer (no intermediate shuffled copy), on reader
   threads ahead of the consumer (the copy releases the GIL).
"""

from __future__ import annotations

import os

import numpy as np
import numpy.typing as npt
import torch

from tensorstore_hooks.capture._layout import ArrayInfo, chunk_path
from tensorstore_hooks.errors import IntegrityError
from tensorstore_hooks.storage.io import BufferPool, ChunkIO, LocalIO
from tensorstore_hooks.storage.zarr import crc

__all__ = ["ChunkReader", "gather"]

_Index = npt.NDArray[np.int64]
_Bytes = npt.NDArray[np.uint8]


class ChunkReader:
    """Reads chunk objects of one root into buffers lent by ``pool`` (rules 1 and 2);
    a buffer goes back to the pool when the last tensor over it dies. Thread-safe."""

    def __init__(self, io: ChunkIO, pool: BufferPool) -> None:
        self.io = io
        self.pool = pool

    def read(self, info: ArrayInfo, index: int, fold: int) -> torch.Tensor:
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
        rows = data[: info.chunk_rows * info.row_bytes].reshape(
            info.chunk_rows * fold, info.row_bytes // fold
        )
        return torch.from_numpy(rows)

    def _read_local(self, full: str, size: int, where: str, info: ArrayInfo) -> _Bytes:
        try:
            fd = os.open(full, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise IntegrityError(f"{where} is missing ({info.rows} rows visible)") from None
        try:
            have = os.fstat(fd).st_size
            if have != size:  # rule 2: before any buffer is taken
                raise IntegrityError(f"{where} has {have} bytes, expected {size}")
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


def gather(out: torch.Tensor, chunks: list[torch.Tensor], starts: _Index, rows: _Index) -> None:
    """Copy the window rows ``rows`` (ascending) into ``out`` (rule 3): ``chunks`` are
    the window's pieces as rows of bytes, ``starts`` the window row each begins at (and
    the end)."""
    bounds = np.searchsorted(rows, starts)
    for j, chunk in enumerate(chunks):
        lo, hi = int(bounds[j]), int(bounds[j + 1])
        if lo < hi:
            index = torch.from_numpy(rows[lo:hi] - starts[j])
            torch.index_select(chunk, 0, index, out=out[lo:hi])
