"""``tsh.CaptureDataset``: captured arrays read back as shuffled batches for training.

NOTE [ Capture reads ]
1. The *units* of an epoch are the chunk objects of every array the name selects, in
   path and chunk order. With ``shuffle`` they are put in a permutation seeded by
   ``(seed, epoch)``, the same in every process, and split round-robin over
   ``world_size * num_workers`` shards (rank-major): shard ``k`` takes units ``k``,
   ``k + shards``, ... Shards share no unit and together hold every unit, so each row
   comes once per epoch, whatever the numbers of ranks and workers.
2. A shard reads its units in that order, a *window* at a time: consecutive units
   adding up to at least ``shuffle_bytes``, read by background threads
   (``read_ahead`` windows ahead of the one being served), each chunk checked against
   its crc32c. A local chunk is mapped, not copied (the page cache is the buffer);
   other roots keep the bytes they fetched. The window's rows are dealt out in a
   permutation seeded by ``(seed, epoch, shard, window)``: each batch takes the next
   ``batch_size`` of it. Rows left over at the end of a window open the next one's
   first batch; the last batch of a shard may be short (``drop_last`` drops it).
3. A batch is one new tensor: its rows are copied once, by the reader threads, ahead
   of the consumer, and lie in the batch in window order. Which rows share a batch is
   the permutation's choice; their order inside the batch is not shuffled again (a
   loss over the batch does not see it, and copying rows in address order is 2-3x
   faster than in random order).
4. ``flatten=True`` folds every axis of a row but the last into rows (tokens as rows),
   and then reads every shape a leaf was captured with (NOTE [ Capture names ] rule 4).
"""

from __future__ import annotations

import math
import mmap
import os
import re
from collections import deque
from collections.abc import Generator, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeAlias

import numpy as np
import numpy.typing as npt
import torch
from torch.utils.data import IterableDataset, get_worker_info

from tensorstore_hooks._units import parse_bytes
from tensorstore_hooks.capture._layout import CAPTURE_DIR, ArrayInfo, chunk_path, list_arrays
from tensorstore_hooks.capture._source import CaptureRoot, CaptureSource, StorageOptions
from tensorstore_hooks.errors import ConfigError, IntegrityError
from tensorstore_hooks.pipeline import READ, IOPool
from tensorstore_hooks.storage.io import ChunkIO, LocalIO
from tensorstore_hooks.storage.zarr import crc

__all__ = ["CaptureDataset"]

_RANK_GROUP = re.compile(r"^rank\d+/")
_GATHER = READ  # batches of the window being served go first,
_FETCH = READ + 1  # then the windows read ahead

_Bytes: TypeAlias = npt.NDArray[np.uint8]
"""Rows of bytes: a chunk's rows, a gathered batch (shape ``(rows, row_bytes)``)."""
_Index: TypeAlias = npt.NDArray[np.int64]
"""Row numbers within a window."""


@dataclass(frozen=True, slots=True)
class _Unit:
    """One chunk object to read: array ``array``'s chunk ``index`` with ``rows`` rows."""

    array: int
    index: int
    rows: int


class CaptureDataset(IterableDataset[torch.Tensor]):
    """Batches of captured rows, shuffled, split over ranks and DataLoader workers.

    ``url``: the store root :func:`~tensorstore_hooks.capture` wrote into (a URL or
    path, with ``storage_options`` for fsspec), or the capture (or ``ZarrStore``)
    itself, which a ``memory://`` root needs. ``name``: an array name as in
    ``cap.arrays`` (``layers.3/output``): the array of every rank group; a name with
    its group (``rank1/layers.3/output``) or shape (``...@17x512_float32``) takes just
    that one. Each item is a tensor of ``batch_size`` rows (use ``DataLoader(ds,
    batch_size=None, num_workers=...)``). ``shuffle``/``seed``: NOTE [ Capture reads ];
    call :meth:`set_epoch` each epoch for a new order. ``flatten``: rows are the last
    axis (tokens as rows). ``shuffle_bytes``: how much is shuffled at once;
    ``read_ahead``: windows read ahead; ``threads``: reader threads per process.
    ``rank``/``world_size`` default to ``torch.distributed``'s (else 0 and 1).

    Raises :class:`ConfigError` when ``name`` selects no array (naming those that
    exist) or arrays whose rows differ. Reading raises
    :class:`~tensorstore_hooks.IntegrityError` for a damaged chunk, naming it.
    """

    def __init__(
        self,
        url: CaptureRoot,
        name: str,
        *,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        flatten: bool = False,
        drop_last: bool = False,
        shuffle_bytes: int | str = "64MiB",
        read_ahead: int = 1,
        threads: int = 2,
        storage_options: StorageOptions | None = None,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        super().__init__()
        for what, value, low in (("batch_size", batch_size, 1), ("read_ahead", read_ahead, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"CaptureDataset: {what} must be an int >= {low}, got {value!r}")
        if not isinstance(threads, int) or not 1 <= threads <= 64:
            raise ConfigError(f"CaptureDataset: threads must be 1..64, got {threads!r}")
        try:
            self.shuffle_bytes = parse_bytes(shuffle_bytes, what="CaptureDataset shuffle_bytes")
        except ValueError as e:
            raise ConfigError(str(e)) from e
        self.batch_size = batch_size
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.flatten = bool(flatten)
        self.drop_last = bool(drop_last)
        self.read_ahead = read_ahead
        self.threads = threads
        self.epoch = 0
        self.rank, self.world_size = _rank_and_world(rank, world_size)
        self.source = CaptureSource.of(url, storage_options)
        io, owned = self.source.open()
        try:
            self.arrays: tuple[ArrayInfo, ...] = tuple(_select(io, name, self.flatten))
        finally:
            if owned:
                io.close()
        self.name = name
        first = self.arrays[0]
        self.row_shape: tuple[int, ...] = first.row_shape[-1:] if self.flatten else first.row_shape
        """The shape of one row as served."""
        self.dtype: torch.dtype = first.torch_dtype
        self._fold = [math.prod(a.row_shape[:-1]) if self.flatten else 1 for a in self.arrays]
        self.num_rows = sum(a.rows * f for a, f in zip(self.arrays, self._fold, strict=True))
        """Rows served per epoch, over all ranks and workers."""

    def set_epoch(self, epoch: int) -> None:
        """Use the order of ``epoch`` (as ``DistributedSampler.set_epoch``)."""
        self.epoch = int(epoch)

    # ------------------------------------------------------------------ units
    def _units(self) -> list[_Unit]:
        units = []
        for i, info in enumerate(self.arrays):
            for c in range(info.chunks):
                units.append(_Unit(i, c, min(info.chunk_rows, info.rows - c * info.chunk_rows)))
        return units

    def shard(self, worker: int = 0, workers: int = 1) -> list[_Unit]:
        """The units of this rank's worker ``worker`` of ``workers`` this epoch (rule 1)."""
        units = self._units()
        if self.shuffle:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(len(units))
            units = [units[i] for i in order]
        shards = self.world_size * workers
        return units[self.rank * workers + worker :: shards]

    # ------------------------------------------------------------------ reading
    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        units = self.shard(worker, workers)
        shard = self.rank * workers + worker
        if not units:
            return
        windows = self._windows(units)
        io, owned = self.source.open()
        pool = IOPool(self.threads, name="tsh-capture-read")
        try:
            pending: deque[list[Future[_Bytes]]] = deque()
            next_window = 0
            carry: torch.Tensor | None = None
            for w in range(len(windows)):
                while next_window < len(windows) and len(pending) <= self.read_ahead:
                    pending.append(
                        [
                            pool.submit(
                                _FETCH, _read_unit, io, self.arrays[u.array], u, self._fold[u.array]
                            )
                            for u in windows[next_window]
                        ]
                    )
                    next_window += 1
                chunks = [fut.result() for fut in pending.popleft()]
                window = _Window(chunks)
                order = self._order(window.rows, shard, w)
                carry = yield from self._serve(pool, window, order, carry)
            if carry is not None and len(carry) and not self.drop_last:
                yield carry
        finally:
            pool.shutdown()
            if owned:
                io.close()

    def _windows(self, units: list[_Unit]) -> list[list[_Unit]]:
        out: list[list[_Unit]] = [[]]
        size = 0
        for u in units:
            if size >= self.shuffle_bytes:
                out.append([])
                size = 0
            out[-1].append(u)
            size += u.rows * self.arrays[u.array].row_bytes
        return out

    def _order(self, n: int, shard: int, window: int) -> _Index:
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, self.epoch, shard, window]).permutation(n)

    def _serve(
        self,
        pool: IOPool,
        window: _Window,
        order: _Index,
        carry: torch.Tensor | None,
    ) -> Generator[torch.Tensor, None, torch.Tensor | None]:
        """Yield the window's batches, gathered on the pool's threads ahead of the
        consumer; return the rows left over (a tensor of its own)."""
        b = self.batch_size
        n = window.rows
        pos = 0

        def take(lo: int, hi: int) -> torch.Tensor:
            got = window.gather(np.sort(order[lo:hi]))  # rule 3: rows in window order
            return torch.from_numpy(got).view(self.dtype).view(hi - lo, *self.row_shape)

        if carry is not None and len(carry):
            need = b - len(carry)
            if n < need:
                return torch.cat([carry, take(0, n)])
            yield torch.cat([carry, take(0, need)])
            pos = need
        ahead: deque[Future[torch.Tensor]] = deque()
        for lo in range(pos, n - b + 1, b):
            ahead.append(pool.submit(_GATHER, take, lo, lo + b))
            if len(ahead) > self.threads:
                yield ahead.popleft().result()
            pos = lo + b
        while ahead:
            yield ahead.popleft().result()
        return take(pos, n) if pos < n else None

    def __repr__(self) -> str:
        return (
            f"CaptureDataset({self.source.url!r}, {self.name!r}, rows={self.num_rows}, "
            f"row_shape={self.row_shape}, dtype={self.dtype}, batch_size={self.batch_size}, "
            f"arrays={len(self.arrays)})"
        )


class _Window:
    """The chunks of one window: rows of bytes, numbered across the chunks in order."""

    def __init__(self, chunks: list[_Bytes]) -> None:
        self.chunks = chunks
        self.starts = np.cumsum([0, *(len(c) for c in chunks)])
        self.rows = int(self.starts[-1])
        self.row_bytes = chunks[0].shape[1]

    def gather(self, rows: _Index) -> _Bytes:
        """A new array of the window's rows ``rows`` (ascending): one copy of each row,
        the rows of each chunk by one ``np.take`` (no GIL held, no buffering)."""
        out = np.empty((len(rows), self.row_bytes), dtype=np.uint8)
        bounds = np.searchsorted(rows, self.starts)
        for j, chunk in enumerate(self.chunks):
            lo, hi = int(bounds[j]), int(bounds[j + 1])
            if lo < hi:
                np.take(chunk, rows[lo:hi] - self.starts[j], axis=0, out=out[lo:hi], mode="clip")
        return out


def _read_unit(io: ChunkIO, info: ArrayInfo, unit: _Unit, fold: int) -> _Bytes:
    """Reader thread: chunk ``unit`` as rows of bytes (``fold`` rows per stored row),
    checked against its crc32c. A local chunk is mapped (the page cache, no copy);
    other roots hand over the bytes they fetched."""
    path = chunk_path(info.path, unit.index, len(info.row_shape) + 1)
    where = f"CaptureDataset: chunk {path} of {io.url}"
    size = info.chunk_bytes + 4
    try:
        data = _map(os.path.join(io.root, path)) if isinstance(io, LocalIO) else io.read(path)
    except FileNotFoundError:
        raise IntegrityError(f"{where} is missing ({info.rows} rows visible)") from None
    view = np.frombuffer(data, dtype=np.uint8)
    if len(view) != size:
        raise IntegrityError(f"{where} has {len(view)} bytes, expected {size}")
    if crc(view[:-4]).to_bytes(4, "little") != view[-4:].tobytes():
        raise IntegrityError(f"{where}: checksum mismatch, the stored bytes are corrupted (crc32c)")
    return view[: unit.rows * info.row_bytes].reshape(unit.rows * fold, info.row_bytes // fold)


def _map(path: str) -> mmap.mmap | bytes:
    """A read-only map of the file at ``path`` (closed when the last view of it dies)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return b""
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        return mmap.mmap(f.fileno(), size, flags=flags, prot=mmap.PROT_READ)


def _select(io: ChunkIO, name: str, flatten: bool) -> list[ArrayInfo]:
    """The arrays ``name`` selects (see :class:`CaptureDataset`), checked alike."""
    if not isinstance(name, str) or not name:
        raise ConfigError(
            f"CaptureDataset: name must be an array name such as 'layers.0/output', got {name!r}"
        )
    found = list(list_arrays(io))
    grouped = bool(_RANK_GROUP.match(name))

    def matches(info: ArrayInfo) -> bool:
        have = info.name if grouped else _RANK_GROUP.sub("", info.name)
        if have == name:
            return True
        return flatten and "@" not in name and have.split("@", 1)[0] == name

    chosen = [a for a in found if matches(a)]
    if not chosen:
        names = sorted({a.name for a in found})
        shown = ", ".join(names[:12]) + (f", ... ({len(names)} in all)" if len(names) > 12 else "")
        raise ConfigError(
            f"CaptureDataset: no captured array {name!r} under {io.url}/{CAPTURE_DIR}. "
            f"Arrays there: {shown or '(none)'}"
        )
    chosen = [a for a in chosen if a.rows]
    if not chosen:
        raise ConfigError(
            f"CaptureDataset: the arrays named {name!r} under {io.url} hold no rows yet"
        )
    rows = {(a.row_shape[-1:] if flatten else a.row_shape, a.dtype) for a in chosen}
    if len(rows) > 1:
        detail = ", ".join(f"{a.name} {a.row_shape} {a.dtype}" for a in chosen)
        fix = (
            "their last axes or dtypes differ"
            if flatten
            else "pass flatten=True to read tokens as rows, or name one of them"
        )
        raise ConfigError(
            f"CaptureDataset: {name!r} selects arrays whose rows differ ({detail}): {fix}"
        )
    if flatten and not chosen[0].row_shape:
        raise ConfigError(f"CaptureDataset: {name!r} holds scalars; flatten=True needs a last axis")
    return chosen


def _rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is None or world_size is None:
        import torch.distributed as dist

        live = dist.is_available() and dist.is_initialized()
        if rank is None:
            rank = int(dist.get_rank()) if live else 0
        if world_size is None:
            world_size = int(dist.get_world_size()) if live else 1
    if not (
        isinstance(world_size, int)
        and world_size >= 1
        and isinstance(rank, int)
        and 0 <= rank < world_size
    ):
        raise ConfigError(
            f"CaptureDataset: rank {rank!r} must be in 0..world_size-1 (world_size {world_size!r})"
        )
    return rank, world_size
