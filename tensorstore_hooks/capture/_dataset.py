"""``tsh.CaptureDataset``: captured arrays read back as shuffled batches for training.

Who reads which rows: NOTE [ Capture epochs ] in ``capture/_plan.py``. How chunks are
read, checked and gathered: NOTE [ Capture reads ] in ``capture/_chunks.py``. What is
checked before anything is read:

NOTE [ Capture metadata bounds ]
A ``zarr.json`` is data like any other: it may be torn, hostile or just wrong, and a
reader must neither spin, nor allocate what it claims, nor recurse without end.

1. Every document is read within the bounds of NOTE [ Capture layout ] rule 6; one
   that cannot be used is skipped with a warning that names it and how to recover
   (and is an :class:`IntegrityError` when it is all the name selects).
2. The chunks an array claims are counted against the chunk objects that exist
   (one listing of its ``c/`` folder) before any list of them is made, and a chunk's
   payload is at most :data:`MAX_CHUNK_BYTES`; each object's size is checked again
   before a buffer is taken for it (NOTE [ Capture reads ] rule 2). Either is an
   :class:`IntegrityError` naming the array.
3. Arrays whose rows hold no element (a leaf captured once with a zero-length axis)
   are skipped: they hold nothing to serve.
"""

from __future__ import annotations

import math
import mmap
import os
import re
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import numpy as np
import numpy.typing as npt
import torch
from torch.utils.data import IterableDataset, get_worker_info

from tensorstore_hooks._units import parse_bytes
from tensorstore_hooks._warn import warn_user
from tensorstore_hooks.capture._chunks import ChunkReader, MapCache, Scatter, scatter
from tensorstore_hooks.capture._layout import CAPTURE_DIR, ArrayInfo, scan_arrays
from tensorstore_hooks.capture._plan import EVEN_MODES, Piece, Plan
from tensorstore_hooks.capture._source import CaptureRoot, CaptureSource, StorageOptions
from tensorstore_hooks.errors import ConfigError, IntegrityError
from tensorstore_hooks.pipeline import READ, IOPool
from tensorstore_hooks.storage.io import BufferPool, ChunkIO, LocalIO, round_up

__all__ = ["MAX_CHUNK_BYTES", "CaptureDataset"]

_RANK_GROUP = re.compile(r"^rank\d+/")
_FETCH = READ  # a window's pieces, read and scattered into its batches
MAX_CHUNK_BYTES = 4 << 30
"""The largest chunk payload a document may claim (NOTE [ Capture metadata bounds ])."""

_Index = npt.NDArray[np.int64]
"""Row numbers within a window."""
_Bytes = npt.NDArray[np.uint8]
"""Rows of bytes: a chunk's rows, a batch's (shape ``(rows, row_bytes)``)."""


class _Batch:
    """A batch being filled from one or more windows (NOTE [ Capture reads ] rule 4)."""

    def __init__(self, data: _Bytes) -> None:
        self.data = data
        """``(batch_size, row_bytes)`` uint8 over a pooled buffer."""
        self.fill = 0
        self.parts: list[Future[None]] = []
        """The tasks of the windows whose rows it holds (each fills part of it)."""

    def wait(self) -> _Bytes:
        for part in self.parts:
            part.result()
        return self.data[: self.fill]


class _Deal:
    """Where one window's rows go, made on the consumer's thread while the window is
    read: ``batches`` it completes, ``parts[j]`` what piece ``j`` fills (rule 4)."""

    def __init__(self, pieces: int) -> None:
        self.batches: list[_Batch] = []
        self.touched: list[_Batch] = []
        self.parts: list[list[Scatter]] = [[] for _ in range(pieces)]


class CaptureDataset(IterableDataset[torch.Tensor]):
    """Batches of captured rows, shuffled, split over ranks and DataLoader workers.

    ``url``: the store root :func:`~tensorstore_hooks.capture` wrote into (a URL or
    path, with ``storage_options`` for fsspec), or the capture (or ``ZarrStore``)
    itself, which a ``memory://`` root needs. ``name``: an array name as in
    ``cap.arrays`` (``layers.3/output``): the array of every rank group; a name with
    its group (``rank1/layers.3/output``) or shape (``...@17x512_float32``) takes just
    that one. Each item is a tensor of ``batch_size`` rows (use ``DataLoader(ds,
    batch_size=None, num_workers=...)``; ``len(ds)`` is this rank's batches per epoch).
    ``shuffle``/``seed``: NOTE [ Capture epochs ]; call :meth:`set_epoch` each epoch
    for a new order (it reaches DataLoader workers, persistent ones too).
    ``flatten``: rows are the last axis (tokens as rows). ``even_batches``: every rank
    yields the same number of batches (``"pad"``, default: one batch of repeated rows
    on the shorter ranks; ``"drop"``; ``False``: a :class:`ConfigError` if they would
    differ). ``shuffle_bytes``: how much is shuffled at once; ``read_ahead``: windows
    read ahead; ``threads``: reader threads per process; ``map_bytes``: a local root's
    chunk files stay mapped from epoch to epoch when the arrays hold at most this much
    (NOTE [ Capture reads ] rule 3; ``0``: read into pooled buffers). ``rank``/``world_size``
    default to ``torch.distributed``'s (else 0 and 1).

    Raises :class:`ConfigError` when ``name`` selects no array (naming those that
    exist) or arrays whose rows differ, and :class:`IntegrityError` for metadata that
    does not match the files (NOTE [ Capture metadata bounds ]). Reading raises
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
        even_batches: str | bool = "pad",
        shuffle_bytes: int | str = "64MiB",
        read_ahead: int = 1,
        threads: int = 2,
        map_bytes: int | str = "16GiB",
        storage_options: StorageOptions | None = None,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        super().__init__()
        _check_args(batch_size, read_ahead, threads, even_batches)
        try:
            self.shuffle_bytes = parse_bytes(shuffle_bytes, what="CaptureDataset shuffle_bytes")
            self.map_bytes = parse_bytes(map_bytes, what="CaptureDataset map_bytes")
        except ValueError as e:
            raise ConfigError(str(e)) from e
        self.batch_size = batch_size
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.flatten = bool(flatten)
        self.drop_last = bool(drop_last)
        self.even_batches = even_batches
        self.read_ahead = read_ahead
        self.threads = threads
        self.rank, self.world_size = _rank_and_world(rank, world_size)
        self.source = CaptureSource.of(url, storage_options)
        io, owned = self.source.open()
        try:
            self.arrays: tuple[ArrayInfo, ...] = tuple(_select(io, name, self.flatten))
            _check_files(io, self.arrays)
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
        """Rows served per epoch, over all ranks and workers (pad rows not counted)."""
        self.plan = Plan(
            [_chunk_rows(a, f) for a, f in zip(self.arrays, self._fold, strict=True)],
            world_size=self.world_size,
            batch_size=batch_size,
            drop_last=self.drop_last,
            even=even_batches,
            name=name,
        )
        self._epoch = _shared_epoch(name)
        self._pool: tuple[int, BufferPool] | None = None
        self._maps: tuple[int, MapCache] | None = None

    @property
    def epoch(self) -> int:
        """The epoch whose order is served (:meth:`set_epoch`)."""
        return int(self._epoch[0])

    def set_epoch(self, epoch: int) -> None:
        """Use the order of ``epoch`` from the next iteration on, in this process and in
        every DataLoader worker (as ``DistributedSampler.set_epoch``; call it before
        ``iter(loader)``)."""
        self._epoch[0] = int(epoch)

    def __len__(self) -> int:
        """Batches this rank yields per epoch (the same on every rank unless
        ``even_batches=False``)."""
        return self.plan.shares[self.rank].batches

    def __getstate__(self) -> dict[str, object]:
        state = dict(self.__dict__)
        state["_pool"] = state["_maps"] = None  # each process pools and maps its own
        return state

    # ------------------------------------------------------------------ plan
    def shard(self, worker: int = 0, workers: int = 1) -> list[Piece]:
        """The chunk pieces this rank's worker ``worker`` of ``workers`` reads this
        epoch, pad batch not included (NOTE [ Capture epochs ] rule 2)."""
        order, starts = self.plan.stream(self.seed, self.epoch, self.shuffle)
        lo, hi, _ = self.plan.worker_rows(self.rank, worker, workers)
        return self.plan.pieces(order, starts, lo, hi)

    def _buffers(self) -> BufferPool:
        """This process's pool of chunk and batch buffers (NOTE [ Capture reads ] rule 5)."""
        if self._pool is None or self._pool[0] != os.getpid():
            self._pool = (os.getpid(), BufferPool(self.pool_bytes))
        return self._pool[1]

    @property
    def pool_bytes(self) -> int:
        """The most bytes this process's buffer pool holds while an epoch is read and
        its batches are dropped as they are used (NOTE [ Capture reads ] rule 5): the
        batches of ``read_ahead + 1`` windows being filled, ``threads`` chunks being
        read, and ``2 + threads`` batches between the reader and the consumer. It is
        also the idle limit (what stays for the next epoch)."""
        batch = round_up(self.batch_size * self.arrays[0].row_bytes // self._fold[0], mmap.PAGESIZE)
        chunk = round_up(max(a.chunk_bytes for a in self.arrays) + 5, mmap.PAGESIZE)
        window = self.shuffle_bytes + chunk  # a window ends past shuffle_bytes by < a piece
        per_window = (window // batch + 2) * batch  # its batches, the open one included
        held = (self.threads + 2) * batch  # served, not yet dropped
        return (self.read_ahead + 1) * per_window + self.threads * chunk + held

    def _mapped(self, io: ChunkIO) -> MapCache | None:
        """This process's maps of chunk files (NOTE [ Capture reads ] rule 3): for a local
        root whose selected arrays fit within ``map_bytes``, else ``None``."""
        total = sum(a.chunks * (a.chunk_bytes + 4) for a in self.arrays)
        if not isinstance(io, LocalIO) or total > self.map_bytes:
            return None
        if self._maps is None or self._maps[0] != os.getpid():
            self._maps = (os.getpid(), MapCache(self.map_bytes))
        return self._maps[1]

    # ------------------------------------------------------------------ reading
    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        epoch = self.epoch
        order, starts = self.plan.stream(self.seed, epoch, self.shuffle)
        lo, hi, pad = self.plan.worker_rows(self.rank, worker, workers)
        pieces = self.plan.pieces(order, starts, lo, hi)
        extra = self.plan.pad_pieces(order, starts, self.rank) if pad else []
        if not pieces and not extra:
            return
        io, owned = self.source.open()
        pool = IOPool(self.threads, name="tsh-capture-read")
        reader = ChunkReader(io, self._buffers(), self._mapped(io))
        try:
            shard = self.rank * workers + worker
            yield from self._serve(pool, reader, self._windows(pieces), (epoch, shard))
            if extra:
                yield from self._serve(pool, reader, [extra], None)
        finally:
            pool.shutdown()
            if owned:
                io.close()

    def _windows(self, pieces: list[Piece]) -> list[list[Piece]]:
        """NOTE [ Capture epochs ] rule 4: runs of pieces of at least ``shuffle_bytes``."""
        out: list[list[Piece]] = [[]]
        size = 0
        for piece in pieces:
            if size >= self.shuffle_bytes:
                out.append([])
                size = 0
            out[-1].append(piece)
            size += piece.rows * self.arrays[piece.array].row_bytes // self._fold[piece.array]
        return [w for w in out if w]

    def _serve(
        self,
        pool: IOPool,
        reader: ChunkReader,
        windows: list[list[Piece]],
        shuffled: tuple[int, int] | None,
    ) -> Iterator[torch.Tensor]:
        """Yield the batches of ``windows`` (NOTE [ Capture reads ] rule 4): each window is
        started ``read_ahead`` windows ahead of the one served; its order
        (``shuffled``: ``(epoch, shard)``; ``None``: in order) is dealt out here while
        its pieces are read, and each piece's task scatters its rows into the batches."""
        started: deque[list[_Batch]] = deque()  # per started window, the batches it ends
        open_batch: list[_Batch] = []  # the batch being filled, across windows
        nxt = 0
        for _ in range(len(windows)):
            while nxt < len(windows) and len(started) <= self.read_ahead:
                order_of = self._order_of(shuffled, nxt)
                started.append(self._start(pool, reader, windows[nxt], order_of, open_batch))
                nxt += 1
            for batch in started.popleft():
                yield self._shaped(batch.wait())
        for batch in open_batch:
            yield self._shaped(batch.wait())

    def _start(
        self,
        pool: IOPool,
        reader: ChunkReader,
        pieces: list[Piece],
        order_of: Callable[[int], _Index],
        open_batch: list[_Batch],
    ) -> list[_Batch]:
        """Start reading one window and deal its rows out; returns the batches it ends.

        The pieces' tasks are queued first (their reads start at once) and wait for the
        deal, which this thread makes meanwhile; a deal that fails reaches them too."""
        deal: Future[_Deal] = Future()
        tasks = [pool.submit(_FETCH, self._fill, reader, p, j, deal) for j, p in enumerate(pieces)]
        try:
            starts: _Index = np.cumsum([0, *(p.rows for p in pieces)], dtype=np.int64)
            made = self._deal(order_of(int(starts[-1])), starts, open_batch)
        except BaseException as e:
            deal.set_exception(e)
            raise
        for batch in made.touched:
            batch.parts.extend(tasks)
        deal.set_result(made)
        return made.batches

    def _deal(self, order: _Index, starts: _Index, open_batch: list[_Batch]) -> _Deal:
        """Deal a window's rows in ``order`` to batches: the open one first (a batch spans
        windows), then new ones. A batch's rows are in window order (rule 4), so the rows
        each piece gives it are one run of it."""
        made = _Deal(len(starts) - 1)
        rows_in = int(starts[-1])
        pos = 0
        while pos < rows_in:
            if not open_batch:
                open_batch.append(_Batch(self._new_batch()))
            batch = open_batch[0]
            take = min(self.batch_size - batch.fill, rows_in - pos)
            rows = np.sort(order[pos : pos + take])
            bounds = np.searchsorted(rows, starts)
            out = batch.data[batch.fill : batch.fill + take]
            for j in range(len(starts) - 1):
                lo, hi = int(bounds[j]), int(bounds[j + 1])
                if lo < hi:
                    made.parts[j].append((out[lo:hi], rows[lo:hi] - starts[j]))
            made.touched.append(batch)
            batch.fill += take
            pos += take
            if batch.fill == self.batch_size:
                open_batch.clear()
                made.batches.append(batch)
        return made

    def _fill(self, reader: ChunkReader, piece: Piece, j: int, deal: Future[_Deal]) -> None:
        """Reader thread: read piece ``j`` of a window (checked: NOTE [ Capture reads ]
        rule 2), then copy its rows into the batches the deal gives them."""
        chunk = reader.read(self.arrays[piece.array], piece.index, self._fold[piece.array])
        scatter(chunk[piece.lo : piece.hi], deal.result().parts[j])

    def _new_batch(self) -> _Bytes:
        row_bytes = self.arrays[0].row_bytes // self._fold[0]
        data, _ = self._buffers().lend(self.batch_size * row_bytes)
        return data.reshape(self.batch_size, row_bytes)

    def _shaped(self, data: _Bytes) -> torch.Tensor:
        return torch.from_numpy(data).view(self.dtype).view(len(data), *self.row_shape)

    def _order_of(
        self, shuffled: tuple[int, int] | None, window: int
    ) -> Callable[[int], _Index]:
        """How window ``window`` orders its ``n`` rows: NOTE [ Capture epochs ] rule 4."""
        if not self.shuffle or shuffled is None:
            return lambda n: np.arange(n, dtype=np.int64)
        epoch, shard = shuffled
        return lambda n: np.random.default_rng([self.seed, epoch, shard, window]).permutation(n)

    def __repr__(self) -> str:
        return (
            f"CaptureDataset({self.source.url!r}, {self.name!r}, rows={self.num_rows}, "
            f"row_shape={self.row_shape}, dtype={self.dtype}, batch_size={self.batch_size}, "
            f"arrays={len(self.arrays)})"
        )


def _shared_epoch(name: str) -> torch.Tensor:
    """The epoch, in shared memory: ``set_epoch`` then reaches DataLoader workers made
    before it (``persistent_workers=True``; NOTE [ Capture epochs ])."""
    epoch = torch.zeros(1, dtype=torch.int64)
    try:
        return epoch.share_memory_()
    except (RuntimeError, OSError) as e:  # no /dev/shm (some sandboxes)
        warn_user(
            f"CaptureDataset({name!r}): no shared memory here ({e}); set_epoch reaches "
            "DataLoader workers only when they are made after it: use "
            "persistent_workers=False for a new order each epoch"
        )
        return epoch


def _check_args(batch_size: int, read_ahead: int, threads: int, even: object) -> None:
    for what, value, low in (("batch_size", batch_size, 1), ("read_ahead", read_ahead, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ConfigError(f"CaptureDataset: {what} must be an int >= {low}, got {value!r}")
    if not isinstance(threads, int) or not 1 <= threads <= 64:
        raise ConfigError(f"CaptureDataset: threads must be 1..64, got {threads!r}")
    if not any(even is m or (isinstance(m, str) and even == m) for m in EVEN_MODES):
        raise ConfigError(
            f"CaptureDataset: even_batches must be 'pad', 'drop' or False, got {even!r} "
            "(NOTE [ Capture epochs ] rule 3 in capture/_plan.py)"
        )


def _chunk_rows(info: ArrayInfo, fold: int) -> list[int]:
    """Served rows of each chunk of ``info`` (its chunk count was checked against the
    files: NOTE [ Capture metadata bounds ] rule 2)."""
    full, rest = divmod(info.rows, info.chunk_rows)
    return [info.chunk_rows * fold] * full + ([rest * fold] if rest else [])


def _check_files(io: ChunkIO, arrays: tuple[ArrayInfo, ...]) -> None:
    """NOTE [ Capture metadata bounds ] rule 2, before anything is sized by a claim."""
    for info in arrays:
        where = f"CaptureDataset: capture array {info.name} under {io.url}"
        if info.chunk_bytes > MAX_CHUNK_BYTES:
            raise IntegrityError(
                f"{where}: its zarr.json claims chunks of {info.chunk_bytes} bytes "
                f"({info.chunk_rows} rows of {info.row_shape}), more than any capture writes"
            )
        present = sum(1 for n in io.listdir(f"{info.path}/c") if n.isdigit())
        if info.chunks > present:
            raise IntegrityError(
                f"{where}: its zarr.json claims {info.rows} rows in {info.chunks} chunk "
                f"objects, but only {present} exist under {info.path}/c; the document does "
                "not belong to these files (restore it, or rebuild it with "
                "tensorstore_hooks.capture.repair_array)"
            )


def _select(io: ChunkIO, name: str, flatten: bool) -> list[ArrayInfo]:
    """The arrays ``name`` selects (see :class:`CaptureDataset`), checked alike."""
    if not isinstance(name, str) or not name:
        raise ConfigError(
            f"CaptureDataset: name must be an array name such as 'layers.0/output', got {name!r}"
        )
    scan = scan_arrays(io)
    grouped = bool(_RANK_GROUP.match(name))

    def matches(array_name: str) -> bool:
        have = array_name if grouped else _RANK_GROUP.sub("", array_name)
        if have == name:
            return True
        return flatten and "@" not in name and have.split("@", 1)[0] == name

    chosen = [a for a in scan.arrays if matches(a.name)]
    damaged = [d for d in scan.damaged if matches(d.path[len(CAPTURE_DIR) + 1 :])]
    for d in damaged:  # NOTE [ Capture metadata bounds ] rule 1
        warn_user(f"CaptureDataset: skipping {d}")
    if not chosen and damaged:
        raise damaged[0]
    if not chosen:
        names = sorted({a.name for a in scan.arrays})
        shown = ", ".join(names[:12]) + (f", ... ({len(names)} in all)" if len(names) > 12 else "")
        raise ConfigError(
            f"CaptureDataset: no captured array {name!r} under {io.url}/{CAPTURE_DIR}. "
            f"Arrays there: {shown or '(none)'}"
        )
    chosen = [a for a in chosen if a.rows and a.row_bytes]  # rule 3: zero-length rows
    if not chosen:
        raise ConfigError(
            f"CaptureDataset: the arrays named {name!r} under {io.url} hold no rows yet "
            "(or only rows of no elements)"
        )
    _check_alike(name, chosen, flatten)
    return chosen


def _check_alike(name: str, chosen: list[ArrayInfo], flatten: bool) -> None:
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
