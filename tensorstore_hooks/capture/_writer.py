"""The capture writer: rows of captured tensors appended to Zarr arrays on I/O threads.

Capture appends; it does not put tensors by key, so it has a writer of its own built
from the library's pieces: the store's :class:`~tensorstore_hooks.storage.io.ChunkIO`
(local files, memory, or fsspec with its retries), the store's crc32c
(:func:`~tensorstore_hooks.storage.zarr._checksum.crc`), an I/O pool and pooled host buffers
(:class:`~tensorstore_hooks.capture._inflight.Inflight`), and the device seam
(:class:`~tensorstore_hooks.pipeline._staging.DeviceOps`: accelerator tensors leave the device
on its copy stream, into pinned buffers). Its chunk objects are its own (``bytes`` +
``crc32c``, what zarr writes), whatever layout the store's segments use.

NOTE [ Capture writes ]
1. A hook copies its tensor's rows, in the stored dtype, into the open chunk buffer of
   the array (its *tail*) before it returns, so the values are those of the hook call
   whatever the model does to the tensor afterwards. An accelerator tensor is first
   copied (and cast) into a private tensor on its device, then copied into the pinned
   buffer on the copy stream; the device tensor is referenced only until that copy's
   event is seen complete, and copies still running hold at most a window of device
   bytes (NOTE [ Capture copy window ] in ``capture/_inflight.py``); a settle task on
   an I/O thread waits for the buffer's copies before its write.
2. A full chunk buffer is written by an I/O thread as one chunk object, then given
   back to the pool. Where the root takes ``O_DIRECT`` (``direct_io``, NOTE [ Direct
   I/O ] in ``storage/io/_local.py``) a chunk the writer owns (a full chunk, or a tail
   taken off its array) goes from its page-aligned buffer straight to the disk: no
   page cache holds it afterwards, so a container's memory charge stays flat however
   much is captured (``stats.chunks_direct``). The few bytes of a payload past its
   last whole block go with the checksum in one small aligned block. Host buffers in
   use never exceed ``max_inflight`` bytes (a single chunk buffer larger than that
   still goes, alone): a hook waits for room (``stats.stall_s``); when only open tails
   hold the room, the least recently used tail is written as a partial chunk and its
   buffer given back (``stats.spills``); its rows are read back from the store when
   that array grows again.
3. Writes of one chunk object run in the order they were submitted (each waits for
   the previous write of the same object). A chunk that already holds visible rows is
   rewritten atomically (a temporary object and a rename on local disks; object
   stores and memory replace whole objects anyway): visible rows are never damaged.
4. ``zarr.json`` is replaced after chunk writes, atomically (NOTE [ Capture documents ]
   in ``capture/_docs.py``); its shape covers the longest prefix of rows whose chunks
   are written, rounded down to a block boundary (NOTE [ Capture layout ] rule 3).
   Only a newer state is ever written, and at most one write of an array's document
   runs at a time: a commit that finds one running leaves it to write the newest
   state once more when it ends. A document costs two ``fsync`` calls, so while other
   writes of the array are running a finished write commits only if the last commit
   is :data:`COMMIT_EVERY_S` old (the last write to finish always commits): visible
   rows lag the written ones by at most that while rows stream in, and not at all
   once they stop.
5. A failed chunk write stops its array: the rows before the failed chunk become (or
   stay) visible, the rest of that array's rows are dropped (``stats.rows_dropped``);
   the failure is counted (``stats.failed_writes``) and warned about once, and
   training goes on. A failed ``zarr.json`` write is counted and retried with the next.
6. :meth:`CaptureWriter.flush` writes every tail as a partial chunk and waits for every
   write: all rows captured so far are then visible.

Locks: ``_Array.append_lock`` orders one array's appends (a hook holds it while it
waits for room); ``_Array.state_lock`` guards what I/O threads update and is never
held while waiting. I/O threads never take an append lock, except to try one
(spilling), so a hook waiting for room can always be woken.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from tensorstore_hooks.capture._docs import write_document
from tensorstore_hooks.capture._inflight import Inflight, capture_stream
from tensorstore_hooks.capture._layout import (
    _MARK,
    CAPTURE_FORMAT,
    JSON,
    ArrayInfo,
    GroupDocs,
    JSONDoc,
    array_doc,
    chunk_path,
    encode_doc,
    read_array,
    row_bytes,
)
from tensorstore_hooks.errors import IntegrityError
from tensorstore_hooks.pipeline import CopyEvent, CudaOps, DeviceOps
from tensorstore_hooks.storage.io import BLOCK_BYTES, ChunkIO, LocalIO, address_of, aligned_empty
from tensorstore_hooks.storage.zarr import crc

__all__ = [
    "COMMIT_EVERY_S",
    "ArraySpec",
    "CaptureStats",
    "CaptureWriter",
    "as_rows",
    "chunk_rows_for",
]

COMMIT_EVERY_S = 0.25
"""While an array's writes stream in, its ``zarr.json`` is replaced at most this often
(NOTE [ Capture writes ] rule 4)."""

log = logging.getLogger("tensorstore_hooks")


@dataclass
class CaptureStats:
    """What a capture did so far (live counters; readable after it ends)."""

    blocks: int = 0
    """Tensors captured (one block of rows each)."""
    rows: int = 0
    """Rows captured."""
    bytes_captured: int = 0
    """Bytes copied off the model, in the stored dtype."""
    bytes_written: int = 0
    """Payload bytes of chunk objects written (a tail written early counts again)."""
    chunks_written: int = 0
    """Chunk objects written."""
    chunks_direct: int = 0
    """Of those, written with ``O_DIRECT`` (no page cache; NOTE [ Capture writes ] rule 2)."""
    failed_writes: int = 0
    """Chunk or ``zarr.json`` writes that failed (NOTE [ Capture writes ] rule 5)."""
    rows_dropped: int = 0
    """Rows not stored because their array stopped after a failed write."""
    skipped: int = 0
    """Tensors not captured: kinds no Zarr array holds (sparse, quantized, meta, ...)."""
    stall_s: float = 0.0
    """Seconds hooks waited for room under ``max_inflight``."""
    spills: int = 0
    """Open tails written early to make room (NOTE [ Capture writes ] rule 2)."""
    peak_inflight_bytes: int = 0
    """The most host-buffer bytes in use at once."""


@dataclass(frozen=True, slots=True)
class ArraySpec:
    """What one captured array holds; decided on its first block."""

    name: str
    """Its key in ``cap.arrays`` (``layers.0/output``)."""
    path: str
    """Its path under the store root (``capture/[rankR/]layers.0/output``)."""
    module: str
    kind: str
    row_shape: tuple[int, ...]
    dtype: torch.dtype
    """The stored dtype."""
    source_dtype: torch.dtype
    """The dtype of the first tensor it captured (before a ``dtype=`` cast)."""
    rank: int | None
    chunk_rows: int
    tokens: str | None = None
    """A masked array's companion (NOTE [ Capture masks ] rule 3); ``None``: not masked."""

    @property
    def row_bytes(self) -> int:
        return row_bytes(self.row_shape, self.dtype)

    @property
    def chunk_bytes(self) -> int:
        return self.chunk_rows * self.row_bytes


def chunk_rows_for(row_bytes: int, chunk_bytes: int) -> int:
    """Rows per chunk object: as many whole rows as fit in ``chunk_bytes`` (at least one)."""
    return max(1, chunk_bytes // max(1, row_bytes))


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a row axis: a 0-d tensor is one row."""
    return t.reshape(1) if t.dim() == 0 else t


class _Chunk:
    """An open chunk buffer of an array: its *tail*."""

    __slots__ = ("buf", "copies", "index", "lock", "pinned", "rows", "used")

    def __init__(self, index: int, buf: torch.Tensor, pinned: bool) -> None:
        self.index = index
        self.buf = buf
        self.pinned = pinned
        self.rows = 0
        self.copies: list[CopyEvent] = []  # copies into it under way (their tensors: Inflight)
        self.lock = threading.Lock()
        self.used = time.monotonic()

    def settle(self) -> None:
        """Wait for the device copies into this buffer, then drop their device tensors."""
        with self.lock:
            while self.copies:
                self.copies[-1].synchronize()
                self.copies.pop()


class _Write:
    """One submitted write of a chunk object: ``done`` is set once its I/O ended."""

    __slots__ = ("done", "ok")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.ok = False


@dataclass(eq=False)
class _Array:
    spec: ArraySpec
    doc: JSONDoc
    append_lock: threading.Lock = field(default_factory=threading.Lock)
    state_lock: threading.Lock = field(default_factory=threading.Lock)
    meta_lock: threading.Lock = field(default_factory=threading.Lock)
    recommit: bool = False
    """A commit came while the document was being written: write it again (rule 4)."""
    # Under append_lock:
    appended: int = 0
    """Rows placed in chunks (in a tail, being written, or written)."""
    tail: _Chunk | None = None
    # Under state_lock:
    full_chunks: int = 0
    """Chunks ``0 .. full_chunks - 1`` are written whole."""
    durable: dict[int, int] = field(default_factory=dict)
    """Rows written of each chunk from ``full_chunks`` on."""
    writes: dict[int, _Write] = field(default_factory=dict)
    """The newest write of each chunk object (rule 3)."""
    runs: list[list[int]] = field(default_factory=list)
    """Blocks, run-length: ``[step, first_row, rows, count]``."""
    failed_at: int | None = None
    """The chunk whose write failed (rule 5): the array takes no more rows."""
    visible: int = 0
    """Rows the newest ``zarr.json`` written shows."""
    exists: bool = False
    """Whether its ``zarr.json`` is in the store."""
    writing: int = 0
    """Chunk writes submitted and not finished (rule 4)."""
    committed_at: float = 0.0
    """``time.monotonic()`` of the newest ``zarr.json`` written (rule 4)."""

    def add_block(self, step: int, first: int, rows: int) -> None:
        last = self.runs[-1] if self.runs else None
        if (
            last is not None
            and last[2] == rows
            and last[0] + last[3] == step
            and last[1] + last[2] * last[3] == first
        ):
            last[3] += 1
        else:
            self.runs.append([step, first, rows, 1])

    def written_prefix(self) -> int:
        """Rows from row 0 on whose chunks are all written."""
        rows = self.spec.chunk_rows
        while self.durable.get(self.full_chunks, 0) >= rows:
            del self.durable[self.full_chunks]
            self.writes.pop(self.full_chunks, None)  # a full chunk is never written again
            self.full_chunks += 1
        return self.full_chunks * rows + self.durable.get(self.full_chunks, 0)

    def block_end_at_most(self, n: int) -> int:
        """The largest block boundary <= ``n``."""
        for _step, first, rows, count in reversed(self.runs):
            if first < n:
                return first + min(count, (n - first) // rows) * rows
        return 0

    def runs_upto(self, n: int) -> list[list[int]]:
        """The runs of the blocks that end at or before row ``n``."""
        out = []
        for step, first, rows, count in self.runs:
            whole = min(count, max(0, n - first) // rows)
            if whole:
                out.append([step, first, rows, whole])
            if whole < count:
                break
        return out


class CaptureWriter:
    """Appends rows to capture arrays under ``io``'s root (NOTE [ Capture writes ]).

    ``max_inflight``: bytes of host buffers in use before hooks wait; ``threads``: I/O
    threads; ``ops``: the device seam (default CUDA's). Thread-safe: hooks on several
    threads may append at once.
    """

    def __init__(
        self,
        io: ChunkIO,
        *,
        max_inflight: int,
        threads: int,
        stats: CaptureStats,
        ops: DeviceOps | None = None,
    ) -> None:
        self.io = io
        self.stats = stats
        self.ops: DeviceOps = CudaOps() if ops is None else ops
        """The device seam (``tests/fake_accelerator.py`` drives it on CPU)."""
        self.inflight = Inflight(max_inflight, threads, lambda n: self.ops.allocate(n))
        """The I/O threads' tasks and the host buffers (rule 2)."""
        self._zeros = b""  # zero padding of partial chunks, grown as needed
        self._arrays: dict[str, _Array] = {}
        self._groups = GroupDocs()
        self._stats_lock = threading.Lock()
        self._warned = False
        self._pending_warning: str | None = None
        self._closed = False

    # ------------------------------------------------------------------ arrays
    def existing(self, path: str) -> ArrayInfo | None:
        """The capture array already at ``path`` in the store (``None``: none)."""
        return read_array(self.io, path)

    def open_array(self, spec: ArraySpec, resume: ArrayInfo | None) -> None:
        """Make ``spec`` writable. ``resume``: the array already stored at its path
        (same row shape, dtype and chunking); new rows are appended to it."""
        arr = _Array(spec, array_doc(spec.row_shape, spec.chunk_rows, spec.dtype))
        if resume is not None:
            arr.exists = True
            arr.appended = arr.visible = resume.rows
            arr.full_chunks = resume.rows // spec.chunk_rows
            if resume.rows % spec.chunk_rows:
                arr.durable[arr.full_chunks] = resume.rows % spec.chunk_rows
            arr.runs = _runs(resume.attributes.get("blocks"))
            arr.doc["attributes"] = dict(resume.attributes)
        # Copy on write: I/O and hook threads iterate the old dict without a lock.
        self._arrays = {**self._arrays, spec.name: arr}

    @property
    def specs(self) -> list[ArraySpec]:
        """The arrays opened so far."""
        return [a.spec for a in self._arrays.values()]

    # ------------------------------------------------------------------ append
    def append(self, name: str, t: torch.Tensor, step: int) -> None:
        """Copy the rows of ``t`` (detached, shape ``(rows, *row_shape)``) into array
        ``name`` as one block of step ``step``. Store trouble never raises here."""
        arr = self._arrays[name]
        spec = arr.spec
        rows = t.shape[0]
        if rows == 0:
            return
        accelerated = bool(self.ops.accelerated(t.device))
        if accelerated and (capturing := capture_stream(self.ops, t.device)) is not None:
            # NOTE [ Capture copy window ] rule 4: no I/O task waits on an event meanwhile
            self.inflight.note_capture(capturing, self.ops.stream_capturing)
            raise _graph_capture_error(name)  # rule 10 of NOTE [ Stream ordering ]
        src = t
        if accelerated:
            # Rule 1: a private copy on the device, in the stored dtype, contiguous.
            with torch.no_grad():
                src = torch.empty(t.shape, dtype=spec.dtype, device=t.device).copy_(t)
        settle: _Chunk | None = None
        with arr.append_lock:
            with arr.state_lock:
                stopped = self._closed or arr.failed_at is not None
                if not stopped:
                    arr.add_block(step, arr.appended, rows)
            if stopped:
                self.count(rows_dropped=rows)
                return
            done = 0
            while done < rows:
                tail = arr.tail if arr.tail is not None else self._open_tail(arr, accelerated)
                if tail is None:  # rule 5: stopped; its rows were counted as dropped
                    return
                n = min(rows - done, spec.chunk_rows - tail.rows)
                self._copy_rows(tail, src[done : done + n], spec, accelerated)
                tail.rows += n
                tail.used = time.monotonic()
                arr.appended += n
                done += n
                if tail.rows == spec.chunk_rows:
                    arr.tail = None
                    self._submit_write(arr, tail, release=True)
                elif accelerated:
                    settle = tail
        if settle is not None:
            self.inflight.submit(settle.settle)
        self.count(blocks=1, rows=rows, bytes_captured=rows * spec.row_bytes)

    def _copy_rows(
        self, tail: _Chunk, rows: torch.Tensor, spec: ArraySpec, accelerated: bool
    ) -> None:
        lo = tail.rows * spec.row_bytes
        dst = tail.buf[lo : lo + rows.shape[0] * spec.row_bytes]
        if accelerated:
            _, event = self.ops.to_host(rows, dst)
            if event is not None:
                self.inflight.copies.add(rows, event, self.ops)  # NOTE [ Capture copy window ]
                with tail.lock:
                    tail.copies.append(event)
            return
        with torch.no_grad():
            dst.view(spec.dtype).view(rows.shape).copy_(rows)

    def _open_tail(self, arr: _Array, pinned: bool) -> _Chunk | None:
        """A buffer for the chunk the next row of ``arr`` goes to (under its append
        lock), holding that chunk's rows already in the store; ``None``: the array stopped."""
        spec = arr.spec
        index, have = divmod(arr.appended, spec.chunk_rows)
        buf, waited_s = self.inflight.take(spec.chunk_bytes, pinned, lambda: self._spill_one(arr))
        with self._stats_lock:
            self.stats.stall_s += waited_s
            peak = max(self.stats.peak_inflight_bytes, self.inflight.peak_bytes)
            self.stats.peak_inflight_bytes = peak
        tail = _Chunk(index, buf, pinned)
        if have:  # written early (rule 2) or by an earlier capture
            try:
                self._read_back(arr, tail, have)
            except Exception as e:
                self._give(tail)
                self._stop(arr, index, e, f"reading back chunk {index} of {spec.path}")
                return None
            tail.rows = have
        with arr.state_lock:
            if arr.failed_at is not None:
                self._give(tail)
                return None
        arr.tail = tail
        return tail

    def _read_back(self, arr: _Array, tail: _Chunk, rows: int) -> None:
        spec = arr.spec
        with arr.state_lock:
            prev = arr.writes.get(tail.index)
        if prev is not None:
            prev.done.wait()  # rule 3: after the newest write of this object
            if not prev.ok:
                raise IntegrityError("its last write failed")
        path = chunk_path(spec.path, tail.index, len(spec.row_shape) + 1)
        blob = memoryview(self.io.read(path)).cast("B")
        if len(blob) != spec.chunk_bytes + 4:
            raise IntegrityError(f"chunk {path} has {len(blob)} bytes")
        if crc(blob[:-4]).to_bytes(4, "little") != bytes(blob[-4:]):
            raise IntegrityError(f"checksum mismatch in chunk {path} (crc32c)")
        n = rows * spec.row_bytes
        tail.buf[:n].numpy()[:] = np.frombuffer(blob[:n], dtype=np.uint8)

    # ------------------------------------------------------------------ room
    def _give(self, tail: _Chunk) -> None:
        self.inflight.give(tail.buf, tail.pinned)

    def _spill_one(self, busy: _Array) -> bool:
        """Write the least recently used open tail (not ``busy``'s) as a partial chunk
        and give its buffer back (rule 2). Returns whether one was."""
        tails = [(a.tail.used, i, a) for i, a in enumerate(self._arrays.values()) if a.tail]
        for _, _, arr in sorted(tails):
            if arr is busy or not arr.append_lock.acquire(blocking=False):
                continue
            try:
                tail, arr.tail = arr.tail, None
                if tail is None:
                    continue
                self._submit_write(arr, tail, release=True)
            finally:
                arr.append_lock.release()
            self.count(spills=1)
            return True
        return False

    # ------------------------------------------------------------------ writes
    def _submit_write(self, arr: _Array, tail: _Chunk, *, release: bool) -> None:
        """Queue a write of ``tail``'s rows so far (under ``arr.append_lock``)."""
        write = _Write()
        with arr.state_lock:
            prev = arr.writes.get(tail.index)
            atomic = prev is not None or arr.durable.get(tail.index, 0) > 0
            arr.writes[tail.index] = write
            arr.writing += 1
        self.inflight.submit(self._write_chunk, arr, tail, tail.rows, release, atomic, prev, write)

    def _write_chunk(
        self,
        arr: _Array,
        tail: _Chunk,
        rows: int,
        release: bool,
        atomic: bool,
        prev: _Write | None,
        write: _Write,
    ) -> None:
        """I/O thread: write ``rows`` rows of ``tail`` as its chunk object, then commit."""
        spec = arr.spec
        error: BaseException | None = None
        try:
            if prev is not None:
                prev.done.wait()  # rule 3
            tail.settle()
            with arr.state_lock:
                skip = arr.failed_at is not None and tail.index > arr.failed_at
            if not skip:
                direct = self._put_chunk(spec, tail, rows, atomic, owned=release)
                write.ok = True
        except BaseException as e:
            error = e
        finally:
            write.done.set()
            if release:
                self._give(tail)
        if error is not None:
            self._stop(arr, tail.index, error, f"writing chunk {tail.index} of {spec.path}")
        elif write.ok:
            with arr.state_lock:
                arr.durable[tail.index] = max(arr.durable.get(tail.index, 0), rows)
            self.count(
                chunks_written=1, chunks_direct=int(direct), bytes_written=rows * spec.row_bytes
            )
        with arr.state_lock:
            arr.writing -= 1
            later = arr.writing and time.monotonic() - arr.committed_at < COMMIT_EVERY_S
        if not later:  # rule 4: a write still running commits when it ends
            self._commit(arr)

    def _put_chunk(
        self, spec: ArraySpec, tail: _Chunk, rows: int, atomic: bool, *, owned: bool
    ) -> bool:
        """Write ``rows`` rows of ``tail`` as its chunk object: exactly what zarr writes
        with codecs ``bytes`` + ``crc32c`` (NOTE [ Capture layout ] rule 2). ``owned``:
        no hook writes into ``tail`` any more (its buffer may be padded in place).
        Returns whether it went with ``O_DIRECT`` (rule 2)."""
        path = chunk_path(spec.path, tail.index, len(spec.row_shape) + 1)
        aligned = address_of(tail.buf.numpy()) % BLOCK_BYTES == 0  # pinned memory may not be
        direct = owned and self.io.uses_direct_io and aligned
        if direct:
            views = _direct_views(tail.buf, rows * spec.row_bytes, spec.chunk_bytes)
        else:
            data = tail.buf.numpy().data[: rows * spec.row_bytes]
            parts: list[memoryview | bytes] = [data, *self._padding(spec.chunk_bytes - len(data))]
            value = 0
            for part in parts:
                value = crc(part, value)
            parts.append(value.to_bytes(4, "little"))

        def put(target: str) -> None:
            if direct:
                self.io.write_aligned(target, views, spec.chunk_bytes + 4)
            else:
                self.io.write(target, parts)

        if not (atomic and isinstance(self.io, LocalIO)):
            put(path)
            return direct
        tmp = f"{path}.tmp-{secrets.token_hex(4)}"
        try:
            put(tmp)
            self.io.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(Exception):
                self.io.delete([tmp])
            raise
        return direct

    def _padding(self, n: int) -> list[memoryview]:
        """``n`` zero bytes (the rows of a partial chunk that hold no data yet)."""
        if n <= 0:
            return []
        zeros = self._zeros
        if len(zeros) < n:
            zeros = self._zeros = bytes(n)  # read-only: threads share it as they find it
        return [memoryview(zeros)[:n]]

    def _stop(self, arr: _Array, index: int, error: BaseException, what: str) -> None:
        """Rule 5: ``arr`` takes no more rows; those from chunk ``index`` on are dropped."""
        with arr.state_lock:
            first = arr.failed_at is None
            if first or index < (arr.failed_at or 0):
                arr.failed_at = index
            # What can still become visible: the chunks before it, and the rows of it
            # that an earlier write made durable (a failed rewrite leaves them intact).
            keep = arr.block_end_at_most(index * arr.spec.chunk_rows + arr.durable.get(index, 0))
            last = arr.runs[-1] if arr.runs else [0, 0, 0, 0]
            end = last[1] + last[2] * last[3]
        if first:
            self.count(rows_dropped=max(0, end - keep))
        self.failed(error, what, stopped=True)

    def _commit(self, arr: _Array) -> None:
        """Write ``zarr.json`` showing the rows now safely written (rule 4)."""
        error = _commit(self.io, arr, self._groups)
        if error is not None:
            self.failed(error, f"writing {arr.spec.path}/zarr.json", stopped=False)

    # ------------------------------------------------------------------ failures
    def failed(self, error: BaseException, what: str, *, stopped: bool) -> None:
        """Count a failed write (``stopped``: its array takes no more rows) and keep the
        one-time warning for :meth:`take_warning`."""
        self.count(failed_writes=1)
        log.debug("capture: %s failed: %r", what, error)
        with self._stats_lock:
            if self._warned:
                return
            self._warned = True
        rest = (
            "that array keeps the rows before it and takes no more"
            if stopped
            else "its rows become visible with the next successful write"
        )
        self._pending_warning = (
            f"tensorstore-hooks: capture into {self.io.url}: {what} failed "
            f"({type(error).__name__}: {error}); {rest}. Training continues; "
            "cap.stats.failed_writes and cap.stats.rows_dropped count what was lost."
        )

    def take_warning(self) -> str | None:
        """The one-time failure warning, once (the caller warns on its own thread)."""
        msg, self._pending_warning = self._pending_warning, None
        return msg

    def count(self, **deltas: float) -> None:
        """Add ``deltas`` to the stats fields they name (from any thread)."""
        with self._stats_lock:
            for name, value in deltas.items():
                setattr(self.stats, name, getattr(self.stats, name) + value)

    # ------------------------------------------------------------------ lifecycle
    def flush(self) -> None:
        """Write every open tail as a partial chunk and wait for every write (rule 6)."""
        for arr in list(self._arrays.values()):
            with arr.append_lock:
                tail = arr.tail
                if tail is not None and tail.rows:
                    with arr.state_lock:
                        written = arr.durable.get(tail.index, 0)
                        stopped = arr.failed_at is not None
                    if written < tail.rows and not stopped:
                        self._submit_write(arr, tail, release=False)
        self.inflight.wait_idle()
        for arr in list(self._arrays.values()):
            self._commit(arr)  # retries a zarr.json whose write failed

    def close(self) -> None:
        """Flush, give every buffer back and stop the I/O threads (idempotent)."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            for arr in self._arrays.values():
                with arr.append_lock:
                    tail, arr.tail = arr.tail, None
                if tail is not None:
                    self._give(tail)
            self.inflight.close()


def _direct_views(buf: torch.Tensor, n: int, chunk_bytes: int) -> list[memoryview]:
    """The block-aligned pieces of a chunk object written with ``O_DIRECT`` from
    ``buf`` (page-aligned, ``n`` payload bytes): the payload's whole blocks from the
    buffer itself, then its last part and the crc32c in one small aligned block
    (rule 2). The rows past ``n`` are zeroed in ``buf`` (a partial chunk's padding)."""
    data = buf.numpy()
    if n < chunk_bytes:
        data[n:chunk_bytes] = 0
    value = crc(data[:chunk_bytes])
    whole = chunk_bytes // BLOCK_BYTES * BLOCK_BYTES
    rest = chunk_bytes - whole
    last = aligned_empty(rest + 4, BLOCK_BYTES)
    last[:rest] = data[whole:chunk_bytes]
    last[rest : rest + 4] = np.frombuffer(value.to_bytes(4, "little"), dtype=np.uint8)
    views = [data.data[:whole], last.data]
    return [v for v in views if len(v)]


def _commit(io: ChunkIO, arr: _Array, groups: GroupDocs) -> Exception | None:
    """Write ``arr``'s ``zarr.json`` if more rows are safely written than it shows
    (rule 4; the groups above it first); returns the error of a failed write. While
    another thread writes it, this one leaves it a note to write once more, and returns."""
    while True:
        if not arr.meta_lock.acquire(blocking=False):
            with arr.state_lock:
                arr.recommit = True
            # The holder reads the note after it lets go of the lock; if it let go
            # before the note was left, the lock is free now and this thread writes.
            if not arr.meta_lock.acquire(blocking=False):
                return None
        try:
            with arr.state_lock:
                arr.recommit = False
            error = _commit_once(io, arr, groups)
        finally:
            arr.meta_lock.release()
        with arr.state_lock:
            if error is not None or not arr.recommit:
                return error


def _commit_once(io: ChunkIO, arr: _Array, groups: GroupDocs) -> Exception | None:
    """One write of ``arr``'s ``zarr.json`` (under its ``meta_lock``)."""
    spec = arr.spec
    with arr.state_lock:
        rows = arr.block_end_at_most(arr.written_prefix())
        if arr.exists and rows <= arr.visible:
            return None
        doc = arr.doc
        doc["shape"] = [rows, *spec.row_shape]
        stored = doc.get("attributes")
        doc["attributes"] = {
            **(stored if isinstance(stored, dict) else {}),
            _MARK: CAPTURE_FORMAT,
            "module": spec.module,
            "kind": spec.kind,
            "dtype": _dtype_name(spec.dtype),
            "source_dtype": _dtype_name(spec.source_dtype),
            "rank": spec.rank,
            **({"masked": spec.tokens} if spec.tokens else {}),
            "blocks": _blocks_doc(arr.runs_upto(rows)),
        }
        raw = encode_doc(doc)
    try:
        if not arr.exists:
            groups.ensure(io, spec.path)
        write_document(io, f"{spec.path}/zarr.json", raw)
    except Exception as e:
        return e
    arr.exists = True
    arr.visible = rows
    arr.committed_at = time.monotonic()
    return None


def _runs(blocks: JSON) -> list[list[int]]:
    """The well-formed ``[step, first_row, rows, count]`` runs of a stored ``blocks``."""
    runs: list[list[int]] = []
    for run in blocks if isinstance(blocks, list) else []:
        if isinstance(run, list) and len(run) == 4:
            ints = [v for v in run if isinstance(v, int)]
            if len(ints) == 4:
                runs.append(ints)
    return runs


def _blocks_doc(runs: list[list[int]]) -> JSON:
    return [[*run] for run in runs]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _graph_capture_error(name: str) -> RuntimeError:
    return RuntimeError(
        f"tsh.capture: array {name!r} was appended to while a CUDA graph is being "
        "captured; its copy off the device and the writer's event waits are not "
        "allowed in a capture (they would invalidate it). Append outside the captured "
        "region, e.g. after the graph's replay, from the tensors it wrote."
    )
