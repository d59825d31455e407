"""ZarrStore: tensors in log-structured Zarr v3 segment arrays under one fsspec root.

See ``docs/layout.md`` for the on-disk format. In short::

    ROOT/zarr.json                        group {"tensorstore_hooks": {"format": 3}}
    ROOT/NS/zarr.json                     group, one per writer (host-pid-random) or named
    ROOT/NS/seg-CHUNK/zarr.json           1-D uint8 array, chunk shape (CHUNK,), codecs
                                          bytes [+ zstd|blosc-lz4]
    ROOT/NS/seg-CHUNK/c/I                 chunk I: CHUNK bytes [compressed]
    ROOT/NS/index/{journal,snapshot}      key -> (segment, first chunk, chunks, crcs, meta)
    ROOT/NS/lock                          held (flock) by the store object writing NS

The units: :class:`~tensorstore_hooks._allocator.ChunkAllocator` decides where chunks
go (pure), :class:`~tensorstore_hooks._chunkcodec.ChunkCodec` turns a payload into
chunk objects and back (codec, checksums), :class:`~tensorstore_hooks._index.IndexLog`
persists the index, :class:`~tensorstore_hooks._chunkio.ChunkIO` moves objects; this
class orchestrates them under one lock.

NOTE [ Segment layout ]
Creating a Zarr array costs 3-8 ms in zarr 3.1.6, whatever its size, and a training
step saves hundreds of tensors, so arrays are created once per size class and each
tensor occupies a run of whole chunks in the class that wastes least: chunk sizes are
``chunk_bytes`` halved down to 4 KiB, and a tensor goes to the largest class whose
padding is at most 1/8 of its size. A put then writes whole chunks (NOTE [ Chunk
objects ] in ``_chunkcodec.py``: what Zarr reads for them) and a delete frees them;
chunk runs are reused. I/O bypasses zarr's async machinery (tens of microseconds a call)
and writes the keys and encodings that ``zarr.open_array`` reads back.

NOTE [ Aligned I/O entry points ]
For callers that move a tensor's bytes through page-aligned host memory of their own
(the pipeline's CUDA staging: a device-to-host copy lands in a pinned buffer, and a
host-to-device copy leaves from one), two methods skip the store's own buffers:

1. ``put_aligned(meta, buffer)``: the chunks are written with ``O_DIRECT`` straight
   from ``buffer`` (no host copy); ``get_into(key, buffer)``: the chunks are read
   straight into it. ``buffer`` starts on a 4 KiB boundary, is writable and holds at
   least ``round_up(nbytes, 4096)`` bytes; the bytes after ``nbytes`` up to there are
   the store's to overwrite (zero padding on a put, whole blocks on a get). A buffer
   that does not qualify is a ``ConfigError`` and nothing is transferred.
2. Both return when the transfer is over: the buffer is the caller's again.
3. Without direct I/O (tmpfs, ``direct_io="off"``, object stores) they are
   ``put_blob`` and a read + copy: always correct, only not copy-free.
4. What the store itself holds for everyone else is ``buffers`` (``PoolStats``):
   read buffers lent as tensor storage (a tensor's ``nbytes`` rounded up to 4 KiB,
   returned when the tensor dies), staging buffers in use by writes (at most one
   chunk per writing thread), and idle buffers kept for reuse (at most
   ``buffer_pool_bytes``, settable with ``set_buffer_pool_bytes``). A caller that
   budgets memory counts the lent ones where the tensors are counted and the idle
   and staging ones beside them.

NOTE [ Spare chunk files ]
A training loop frees and re-saves the same sizes every step. On a local filesystem,
unlinking a chunk file and creating it again costs the kernel 3-10x more than
rewriting the file in place (ext4 frees and reallocates the blocks and the page-cache
pages; measured 0.6-3 GiB/s against 7-8 GiB/s here), and that kernel time is taken
from the training step's cores. So where the backend says overwriting is cheap
(``ChunkIO.supports_rewrite_in_place``: local directories), a deleted key's chunk files stay
on disk as *spares*: its run goes back to the free list and the next put of the same
size class and length rewrites it. Spares hold at most ``spare_bytes`` (default: the
peak of the live keys' chunk bytes, so a steady loop's footprint is its peak); beyond
that, the least recently freed spares are unlinked to make room (a loop re-saves what
it just freed: keeping old spares of sizes no longer used would turn every later
put into a create), and ``close()`` unlinks them all. Spare chunks are in
no index entry, so no reader (ours or plain zarr through the index) takes their stale
bytes for a key's; a read racing its key's delete raises ``KeyNotFoundError``.

NOTE [ Requests that land late ]
An object store may apply a request after the client gave up on it: measured with
SeaweedFS, a PUT that timed out while its volume server was down was written by the
S3 gateway once the volume server came back, over the chunk object of a key written
since. So a chunk run with a write or delete whose outcome is unknown (an attempt
that failed with a timeout, a dropped connection, an error: ``ChunkIO.take_uncertain``)
is never handed out again by this store object: a failed put abandons its run, a
delete that failed keeps its run out of the free list. The objects are orphans, at
most a few per outage, and go with the namespace. (The checksums bound to each
chunk's key and position would catch such an overwrite as an ``IntegrityError``;
this keeps it from happening.)

NOTE [ Closed while in use ]
An offload session deletes its keys when autograd frees their graph, which may be
after the store was closed (a graph held by a reference cycle, freed by the
collector). So a session marks its use of the store (``_use()``); ``close()`` then
refuses puts and gets at once but keeps the journal and the namespace lock for the
sessions' deletes, and finishes (spares unlinked, an empty namespace removed, the
lock released) when the last session is done, or as soon as no key is left. Nothing
is left behind, and no delete fails. Keys put by hand stay, as after any close.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import shutil
import socket
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._aligned import BLOCK_BYTES, BufferPool, PoolStats, address_of, round_up
from ._allocator import SEGMENT_CHUNKS, ChunkAllocator, Run, SegmentFullError
from ._chunkcodec import ChunkCodec
from ._chunkio import ChunkIO, DirectIOStatus, FsspecIO, LocalIO, MemoryIO
from ._codec import TensorMeta
from ._forks import foreign
from ._housekeeping import make_temp_root, sweep_at_open
from ._index import HEADER_BYTES, Damage, IndexLog, os_error
from ._retry import RetryPolicy
from ._store import BlobStore
from ._units import parse_bytes
from ._urls import split_url
from ._zarr_docs import namespace_doc, namespace_format, root_doc, segment_doc
from ._zarr_options import (
    DEFAULT_CHUNK_BYTES,
    MIN_CHUNK_BYTES,
    check_chunk_bytes,
    parse_codec,
    parse_direct_io,
)
from .errors import (
    ConfigError,
    IntegrityError,
    KeyNotFoundError,
    QuotaExceededError,
    StoreClosedError,
    StoreUnavailableError,
    TensorStoreError,
)

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "MIN_CHUNK_BYTES",
    "ZarrStore",
    "parse_codec",
    "split_url",
]

log = logging.getLogger("tensorstore_hooks")

DEFAULT_BUFFER_POOL_BYTES = 64 << 20
"""Idle aligned buffers a store keeps for reuse by default (``buffer_pool_bytes``)."""

_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
FORMAT_VERSION = 3
"""The layout this version writes and reads (docs/layout.md); a namespace of another
format is refused when opened, naming its version."""


@dataclass(slots=True)
class _Entry:
    chunk: int  # chunk size class (bytes); 0 for an empty payload
    start: int  # first chunk index in that class's segment
    count: int  # number of chunks
    crc: bytes  # crc32c of each chunk, 4 bytes each: NOTE [ Bound chunk checksums ]
    meta: TensorMeta

    @property
    def run(self) -> Run:
        return self.chunk, self.start, self.count

    def to_record(self) -> dict[str, Any]:
        return {
            "seg": self.chunk,
            "start": self.start,
            "count": self.count,
            "crc": self.crc,
            "meta": self.meta.to_dict(),
        }

    @classmethod
    def from_record(cls, rec: dict[str, Any]) -> _Entry:
        try:
            chunk, start, count = rec["seg"], rec["start"], rec["count"]
            crcs, meta = rec["crc"], rec["meta"]
        except (KeyError, TypeError) as e:
            raise IntegrityError(f"index entry is malformed: {rec!r:.200}") from e
        if not all(isinstance(v, int) and v >= 0 for v in (chunk, start, count)):
            raise IntegrityError(f"index entry has bad extents: {rec!r:.200}")
        if not isinstance(crcs, bytes) or len(crcs) != 4 * count:
            raise IntegrityError(f"index entry has bad chunk checksums: {rec!r:.200}")
        return cls(chunk, start, count, crcs, TensorMeta.from_dict(meta))


def make_io(
    url: str | os.PathLike[str] | None,
    storage_options: dict[str, Any] | None = None,
    retry_deadline_s: float = 30.0,
) -> ChunkIO:
    """The :class:`ChunkIO` for a store root URL (no store, nothing written)."""
    kind, location = split_url(url)
    if kind == "local":
        return LocalIO(location)
    if kind == "memory":
        return MemoryIO(location)
    if not (isinstance(retry_deadline_s, int | float) and retry_deadline_s > 0):
        raise ConfigError(
            f"ZarrStore: retry_deadline_s must be a number of seconds > 0, got {retry_deadline_s!r}"
        )
    retry = RetryPolicy(deadline_s=float(retry_deadline_s))
    try:
        fs, path, owned = FsspecIO.open_filesystem(location, storage_options or {}, retry)
    except ImportError as e:
        raise ConfigError(f"ZarrStore: cannot open {location!r}: {e}") from e
    except ValueError as e:
        raise ConfigError(f"ZarrStore: bad URL {location!r}: {e}") from e
    if (
        getattr(fs, "protocol", None) in ("file", ("file", "local"))
        or type(fs).__name__ == "LocalFileSystem"
    ):
        return LocalIO(path)
    return FsspecIO(fs, path, location, retry=retry, owns_fs=owned)


class ZarrStore(BlobStore):
    """Tensors in chunked Zarr v3 arrays under a local path or any fsspec URL.

        ``url``: a bare path, ``file://``, ``memory://`` (private to this object), or any
        fsspec URL (``s3://bucket/prefix``) with ``storage_options`` passed to fsspec.
        ``None`` makes a temporary directory that is removed on ``close()`` and at exit.

        Each instance writes into its own *namespace* under the root (``host-pid-random``,
        prefixed ``r{rank}-`` under ``torch.distributed``, unless ``namespace`` names one),
        so several processes and ranks can share a root. Opening a
        named namespace that exists resumes it: its keys are readable again. On a local
        root a namespace is locked (``flock`` on ``NS/lock``) while a store object has it
        open: a second opener, in this process or another, gets a
        :class:`StoreUnavailableError` naming the holder. Object stores have no lock:
        give each writer its own namespace (the default does).

        ``retry_deadline_s`` (fsspec URLs): how long one object-store operation retries
        transient failures (throttling, 5xx, connection resets) before it raises
        :class:`StoreUnavailableError`; a missing bucket or denied access fails at once,
        when the store is opened.

        ``spare_bytes`` (local directories): how many bytes of deleted keys' chunk files
        to keep for rewriting in place (NOTE [ Aligned I/O entry points ]
    For callers that move a tensor's bytes through page-aligned host memory of their own
    (the pipeline's CUDA staging: a device-to-host copy lands in a pinned buffer, and a
    host-to-device copy leaves from one), two methods skip the store's own buffers:

    1. ``put_aligned(meta, buffer)``: the chunks are written with ``O_DIRECT`` straight
       from ``buffer`` (no host copy); ``get_into(key, buffer)``: the chunks are read
       straight into it. ``buffer`` starts on a 4 KiB boundary, is writable and holds at
       least ``round_up(nbytes, 4096)`` bytes; the bytes after ``nbytes`` up to there are
       the store's to overwrite (zero padding on a put, whole blocks on a get). A buffer
       that does not qualify is a ``ConfigError`` and nothing is transferred.
    2. Both return when the transfer is over: the buffer is the caller's again.
    3. Without direct I/O (tmpfs, ``direct_io="off"``, object stores) they are
       ``put_blob`` and a read + copy: always correct, only not copy-free.
    4. What the store itself holds for everyone else is ``buffers`` (``PoolStats``):
       read buffers lent as tensor storage (a tensor's ``nbytes`` rounded up to 4 KiB,
       returned when the tensor dies), staging buffers in use by writes (at most one
       chunk per writing thread), and idle buffers kept for reuse (at most
       ``buffer_pool_bytes``, settable with ``set_buffer_pool_bytes``). A caller that
       budgets memory counts the lent ones where the tensors are counted and the idle
       and staging ones beside them.

    NOTE [ Spare chunk files ]); ``None`` (default):
        up to the peak of the live keys' chunk bytes; ``0``: unlink at once, so the
        directory holds exactly the live keys.

        ``direct_io`` (local directories): ``"auto"`` (default) writes and reads chunk
        files with ``O_DIRECT`` where the filesystem allows it (not tmpfs), so offloaded
        bytes leave RAM and cost no page-cache copy; ``"on"`` requires it
        (:class:`ConfigError` where it cannot be had); ``"off"`` goes through the page
        cache. :attr:`direct_io` says what was chosen and why (NOTE [ Direct I/O ] in
        ``_chunkio.py``).

        ``buffer_pool_bytes``: how many bytes of idle page-aligned buffers (direct-write
        staging, and read buffers that came back from dead tensors) to keep for reuse;
        ``None`` (default): :data:`DEFAULT_BUFFER_POOL_BYTES`. What the pool holds is
        :attr:`buffers` (NOTE [ Aligned buffers ] in ``_aligned.py``).

        Reads: ``get``/``get_blob`` return tensors whose storage is the buffer the bytes
        were read into (no copy; a tensor with a storage offset or a gapped view is
        rebuilt by the codec). :meth:`put_aligned` writes from a caller's aligned
        buffer with no copy at all.

        Errors: a put that fails for any OS reason raises a TensorStoreError
        (:class:`QuotaExceededError` when the filesystem is full) and is not stored: its
        chunks are deleted and nothing is journaled. A damaged index is replayed as far
        as it goes (:attr:`damage`, NOTE [ Journal records ] in ``_index.py``).

        Thread-safe. ``put_blob``/``get_blob`` of different keys run concurrently; the
        index is guarded by a lock and chunk I/O happens outside it.
    """

    def __init__(
        self,
        url: str | os.PathLike[str] | None = None,
        *,
        storage_options: dict[str, Any] | None = None,
        chunk_bytes: int | str = DEFAULT_CHUNK_BYTES,
        codec: str = "none",
        namespace: str | None = None,
        retry_deadline_s: float = 30.0,
        spare_bytes: int | str | None = None,
        direct_io: str | bool = "auto",
        buffer_pool_bytes: int | str | None = None,
    ) -> None:
        self._closed = True  # until fully constructed: close() must be safe on failure
        chunk, spare, pool_bytes, direct_mode = _check_options(
            chunk_bytes, spare_bytes, buffer_pool_bytes, direct_io
        )
        self._pool = BufferPool(pool_bytes)
        try:
            self._codec = ChunkCodec(codec, self._pool)
        except ConfigError as e:
            raise ConfigError(f"ZarrStore: codec: {e}; got {codec!r}") from None
        self.codec = codec
        self.chunk_bytes = chunk
        if namespace is not None and not (
            isinstance(namespace, str) and _NAMESPACE_RE.match(namespace)
        ):
            raise ConfigError(f"ZarrStore: namespace {namespace!r} must be 1-128 of [A-Za-z0-9._-]")
        self._temporary = url is None
        self._pid = os.getpid()  # NOTE [ Fork safety ]: only this process changes the store
        # NOTE [ Stale namespaces ]: a temporary root sweeps its dead siblings.
        location = make_temp_root() if self._temporary else None
        self._io = make_io(location or url, storage_options, retry_deadline_s)
        self._url = self._io.url
        self.namespace = namespace or _default_namespace()
        self._lock = threading.Lock()
        self._index: dict[str, _Entry] = {}
        self._nbytes = 0
        self._next_key = 0
        self._alloc = ChunkAllocator(
            chunk, keep_spares=self._io.supports_rewrite_in_place, spare_limit=spare
        )
        self._segments_made: set[int] = set()
        self._root_doc_written = False  # the root's zarr.json: made at the first put
        self._users = 0  # offload sessions writing here: NOTE [ Closed while in use ]
        self._close_pending = False
        self._finished = False  # _close_now ran
        self._unlock: Callable[[], None] | None = None
        self.damage: list[Damage] = []
        """What replaying this namespace's index found damaged (empty when all was well)."""
        self._direct = DirectIOStatus(False, direct_mode, "not configured")
        try:
            self._unlock = self._take_namespace()
            _write_layout(self._io, self._url, self.namespace, self.chunk_bytes, self.codec)
            self._configure_direct_io(direct_mode)
            if isinstance(self._io, LocalIO):
                self._io.root_made = True  # a vanished root is an error from now on
            if not self._temporary:
                kind, root = split_url(url)
                if kind == "local":
                    sweep_at_open(root)  # NOTE [ Stale namespaces ]
            self._log = IndexLog(self._io, f"{self.namespace}/index")
            self._resume(self._log)
        except BaseException as e:
            if self._unlock is not None:
                self._unlock()
            if self._temporary:
                with contextlib.suppress(Exception):
                    self._io.remove_tree("")
            self._io.close()
            if isinstance(e, TensorStoreError) or not isinstance(e, Exception):
                raise
            if isinstance(e, OSError):
                raise os_error(e, f"ZarrStore: opening {self._url}") from e
            raise StoreUnavailableError(f"ZarrStore: cannot open {self._url}: {e}") from e
        self._closed = False
        # Collected without close(): close the journal quietly, release the namespace
        # (and remove a temporary directory).
        self._finalizer: weakref.finalize[Any, Any] = weakref.finalize(
            self, _finalize, self._pid, self._log, self._unlock, location
        )

    # ------------------------------------------------------------------ setup
    def _take_namespace(self) -> Callable[[], None] | None:
        try:
            return self._io.lock(f"{self.namespace}/lock")
        except BlockingIOError as e:
            raise StoreUnavailableError(
                f"ZarrStore({self._url}): namespace {self.namespace!r} is open in another "
                f"store object ({e.strerror}); two writers would overwrite each other's "
                "keys. Close the other store first, or use another namespace."
            ) from None

    def _configure_direct_io(self, mode: str) -> None:
        try:
            self._direct = self._io.configure_direct_io(mode, f"{self.namespace}/direct-probe")
        except ConfigError as e:
            raise ConfigError(f"ZarrStore({self._url}): {e}") from None

    def _resume(self, index_log: IndexLog) -> None:
        entries, self._next_key = _replay(index_log, self._alloc, self._url, self.namespace)
        self.damage = list(index_log.damage)
        for key, entry in entries.items():
            self._index[key] = entry
            self._nbytes += entry.meta.nbytes
            if entry.count:
                self._segments_made.add(entry.chunk)

    def _ensure_root_doc(self) -> None:
        """The root's ``zarr.json``, where missing: written at the first put, so a store
        that never stored anything leaves no file at its root."""
        if not self._root_doc_written:
            if not self._io.exists("zarr.json"):
                self._io.write("zarr.json", [root_doc(FORMAT_VERSION)])
            self._root_doc_written = True

    def _segment_path(self, chunk: int) -> str:
        return f"{self.namespace}/seg-{chunk}"

    def _ensure_segment(self, chunk: int) -> None:
        if chunk in self._segments_made:
            return
        doc = segment_doc(chunk, SEGMENT_CHUNKS, self._codec.zarr_compressors())
        self._io.write(f"{self._segment_path(chunk)}/zarr.json", [doc])
        self._segments_made.add(chunk)

    def _run_paths(self, run: Run) -> list[str]:
        chunk, start, count = run
        seg = self._segment_path(chunk)
        return [f"{seg}/c/{start + i}" for i in range(count)]

    # ------------------------------------------------------------------- puts
    def put_blob(self, meta: TensorMeta, payload: Any) -> str:
        n = meta.nbytes
        data = memoryview(payload).cast("B") if n else memoryview(b"")
        if len(data) != n:
            raise IntegrityError(f"ZarrStore.put: payload has {len(data)} bytes, metadata says {n}")
        return self._put(meta, lambda paths, chunk: self._codec.write(self._io, paths, data, chunk))

    def put_aligned(self, meta: TensorMeta, buffer: Any) -> str:
        """Store ``buffer[:meta.nbytes]`` like :meth:`put_blob`, straight from ``buffer``
        (NOTE [ Aligned I/O entry points ]).

        For callers that already hold a tensor's bytes in page-aligned memory (a pinned
        staging buffer a device-to-host copy landed in, or an array from
        :meth:`get_blob`): ``buffer`` is a writable buffer that starts on a
        ``BLOCK_BYTES`` (4 KiB) boundary and has at least ``round_up(nbytes, 4096)``
        bytes; the store may overwrite the bytes after ``nbytes`` up to that length
        (zero padding). With direct I/O the chunks are written from ``buffer`` itself:
        no host copy. Otherwise this is :meth:`put_blob`. The buffer is consumed
        before this returns. Raises :class:`ConfigError` for a misaligned, short or
        read-only buffer (nothing is written).
        """
        n = meta.nbytes
        region = _aligned_region(buffer, n, "put_aligned")
        return self._put(
            meta, lambda paths, chunk: self._codec.write_aligned(self._io, paths, region, n, chunk)
        )

    def _put(self, meta: TensorMeta, write: Callable[[list[str], int], bytes]) -> str:
        n = meta.nbytes
        chunk, count = self._alloc.layout(n)
        self._check_writer("write")
        with self._lock:
            self._check_open()
            key = format(self._next_key, "x")
            self._next_key += 1
            try:
                run = (chunk, self._alloc.alloc(chunk, count) if count else 0, count)
            except SegmentFullError as e:
                raise StoreUnavailableError(f"ZarrStore({self._url}): {e}") from None
        paths = self._run_paths(run)
        try:
            if not self._root_doc_written:
                with self._lock:
                    self._ensure_root_doc()
            if count and chunk not in self._segments_made:  # the first put of a class
                with self._lock:
                    self._ensure_segment(chunk)
            crcs = write(paths, chunk) if count else b""
        except Exception as e:
            self._undo_put(run, paths)
            raise self._put_error(key, e) from e
        entry = _Entry(chunk, run[1], count, crcs, meta)
        with self._lock:
            try:
                self._check_open()
                # Journaled before it is acknowledged: a put whose record could not be
                # written is not stored (NOTE [ Journal records ] in _index.py).
                self._log.record_put(key, entry.to_record())
            except TensorStoreError as e:
                failure: TensorStoreError | None = e
            else:
                failure = None
                self._index[key] = entry
                self._nbytes += n
        if failure is not None:
            self._undo_put(run, paths)
            if isinstance(failure, StoreUnavailableError) and self._closed:
                raise failure
            raise self._put_error(key, failure) from failure
        return key

    def _undo_put(self, run: Run, paths: list[str]) -> None:
        """A put that failed: delete what it wrote (give the space back), free its run
        unless a request on it may still land (NOTE [ Requests that land late ])."""
        with contextlib.suppress(Exception):
            self._io.delete(paths)
        uncertain = self._io.take_uncertain(paths)
        with self._lock:
            if uncertain:
                self._alloc.abandon(run)
            else:
                self._alloc.cancel(run)

    def _put_error(self, key: str, e: BaseException) -> TensorStoreError:
        where = f"ZarrStore({self._url}): writing key {key!r}"
        gone = self._gone() if isinstance(e, FileNotFoundError) else None
        if gone is not None:
            return StoreUnavailableError(f"{where} failed: {gone}; the tensor was not stored")
        err = _write_failure(where, e)
        if isinstance(err, QuotaExceededError):
            self._drop_spares()  # the disk is full: spare chunk files are free space
        return type(err)(f"{err}; the tensor was not stored")

    def _drop_spares(self) -> None:
        with self._lock:
            runs = self._alloc.drain_spares()
        self._unlink(runs)

    def _unlink(self, runs: list[Run]) -> None:
        """Delete the chunk files of freed runs (outside the lock), then free them."""
        if not runs:
            return
        with contextlib.suppress(Exception):
            self._io.delete([p for run in runs for p in self._run_paths(run)])
        # NOTE [ Requests that land late ]: a run with an uncertain request stays out.
        settled = [run for run in runs if not self._io.take_uncertain(self._run_paths(run))]
        with self._lock:
            self._alloc.release(settled)

    # ------------------------------------------------------------------- gets
    def _entry(self, key: str, *, deleting: bool = False) -> _Entry:
        self._check_open(deleting)
        entry = self._index.get(key) if isinstance(key, str) else None
        if entry is None:
            raise KeyNotFoundError(
                f"ZarrStore({self._url}): no key {key!r} in namespace {self.namespace!r} "
                "(never written, already deleted, or written by another store object)"
            )
        return entry

    def meta(self, key: str) -> TensorMeta:
        return self._entry(key).meta

    def get_blob(self, key: str) -> tuple[TensorMeta, Any]:
        """The metadata and the payload in a writable, page-aligned uint8 array: from
        :data:`~tensorstore_hooks._aligned.POOL_MIN_BYTES` up, a pooled buffer that
        goes back to the pool when the array and everything made from it (a tensor's
        storage) are gone (NOTE [ Aligned buffers ])."""
        entry = self._entry(key)
        n = entry.meta.nbytes
        if not entry.count:
            return entry.meta, np.empty(n, dtype=np.uint8)
        out, region = self._pool.lend(n)
        self._read_into(key, entry, region, n, 0, entry.count)
        return entry.meta, out

    def chunk_class(self, key: str) -> int:
        """The chunk size of ``key``'s run (0 for an empty payload): the unit of
        :meth:`read_range`."""
        return self._entry(key).chunk

    def read_range(self, key: str, start: int, length: int) -> np.ndarray:
        """Bytes ``[start, start + length)`` of ``key``'s payload, each whole chunk read
        verified, in an array like :meth:`get_blob`'s (a streamed answer holds one
        piece at a time). ``start`` must be a multiple of :meth:`chunk_class`, and the
        range must end at a chunk boundary or at the payload's end. Errors as
        :meth:`get_blob`."""
        entry = self._entry(key)
        chunk, n = entry.chunk, entry.meta.nbytes
        end = start + length
        if length == 0:
            return np.empty(0, dtype=np.uint8)
        if start < 0 or start % chunk or end > n or (end != n and length % chunk):
            raise ValueError(f"read_range: [{start}, {end}) is not a run of whole chunks")
        out, region = self._pool.lend(length)
        self._read_into(key, entry, region, length, start // chunk, -(-end // chunk))
        return out

    def get_into(self, key: str, buffer: Any) -> TensorMeta:
        """Read ``key``'s payload into the first ``nbytes`` of ``buffer`` and return its
        metadata (NOTE [ Aligned I/O entry points ]).

        ``buffer``: writable, starting on a ``BLOCK_BYTES`` (4 KiB) boundary, at least
        ``round_up(nbytes, 4096)`` bytes (a direct read fills whole blocks: the bytes
        after ``nbytes`` up to there are overwritten). With direct I/O the chunks land
        in it straight from the disk. Raises :class:`ConfigError` for a buffer that is
        misaligned, short or read-only (nothing is read), and what :meth:`get_blob`
        raises.
        """
        entry = self._entry(key)
        n = entry.meta.nbytes
        region = _aligned_region(buffer, n, "get_into")
        if entry.count:
            self._read_into(key, entry, region, n, 0, entry.count)
        return entry.meta

    def _read_into(
        self, key: str, entry: _Entry, region: memoryview, n: int, first: int, last: int
    ) -> None:
        """Chunks ``[first, last)`` of ``key``'s run (``n`` payload bytes) into ``region``."""
        paths = self._run_paths(entry.run)[first:last]
        crcs = entry.crc[4 * first : 4 * last]
        what = f"ZarrStore({self._url}): key {key!r}"
        try:
            self._codec.read(self._io, paths, region, n, entry.chunk, crcs, what)
        except FileNotFoundError as e:
            if key not in self._index:
                raise self._missing(key) from e
            gone = self._gone()
            if gone is not None:
                raise StoreUnavailableError(f"{what} cannot be read: {gone}") from e
            raise IntegrityError(f"{what}: chunk {e.filename or e} is missing") from e
        except TensorStoreError:
            if key not in self._index:
                raise self._missing(key) from None
            raise
        except (IsADirectoryError, NotADirectoryError) as e:
            # Not a passing fault: a chunk path that is not a file will not heal.
            raise IntegrityError(f"{what}: chunk {e.filename or e} is not a file") from e
        except OSError as e:
            raise os_error(e, f"reading {what}") from e
        except Exception as e:
            raise StoreUnavailableError(f"reading {what} failed: {e}") from e
        # A key deleted while being read may have had its chunks rewritten as spares;
        # the bound checksums catch that, and so does this.
        if key not in self._index:
            raise self._missing(key)

    def _gone(self) -> str | None:
        """Why the store's root or namespace is no longer there (``None`` if it is)."""
        try:
            # Before the first put the root has no zarr.json: only the namespace tells.
            if self._root_doc_written and not self._io.exists("zarr.json"):
                return (
                    f"the store's root {self._url} is gone (removed or renamed while the "
                    "store was open)"
                )
            if not self._io.exists(f"{self.namespace}/zarr.json"):
                return (
                    f"namespace {self.namespace!r} of {self._url} is gone (removed or "
                    "renamed while the store was open)"
                )
        except Exception:  # cannot even look: say so rather than guess
            return f"the store's root {self._url} cannot be reached"
        return None

    def _missing(self, key: str) -> KeyNotFoundError:
        return KeyNotFoundError(f"ZarrStore({self._url}): key {key!r} was deleted while being read")

    # ---------------------------------------------------------------- deletes
    def delete(self, key: str) -> None:
        self._check_writer("delete")
        with self._lock:
            entry = self._entry(key, deleting=True)
            unlink = self._forget([key], [entry])
        self._unlink(unlink)
        self._finish_if_drained()

    def delete_many(self, keys: Any) -> None:
        self._check_writer("delete")
        with self._lock:
            self._check_open(deleting=True)
            found = [(k, self._index.get(k)) for k in keys if isinstance(k, str)]
            pairs = [(k, e) for k, e in found if e is not None]
            unlink = self._forget([k for k, _ in pairs], [e for _, e in pairs])
        self._unlink(unlink)
        self._finish_if_drained()

    def _finish_if_drained(self) -> None:
        """A close waiting for sessions' deletes finishes once no key is left."""
        with self._lock:
            drained = self._close_pending and not self._index
            if drained:
                self._close_pending = False
        if drained:
            self._close_now()

    def _forget(self, keys: list[str], entries: list[_Entry]) -> list[Run]:
        """Under the lock: drop keys from the index and journal; returns runs to unlink."""
        for key, entry in zip(keys, entries, strict=True):
            del self._index[key]
            self._nbytes -= entry.meta.nbytes
            self._log.record_delete(key)  # never raises: deferred if the disk is full
        self._maybe_compact()
        return self._alloc.retire(e.run for e in entries)

    def _maybe_compact(self) -> None:
        if not self._log.needs_compaction(len(self._index)):
            return
        try:
            self._compact()
        except TensorStoreError as e:
            # The journal is untouched and still the truth; try again at the next delete.
            log.warning("ZarrStore(%s): compacting the index failed: %s", self._url, e)

    def _compact(self) -> None:
        self._log.snapshot({k: e.to_record() for k, e in self._index.items()})
        last = format(self._next_key - 1, "x")
        if self._next_key and last not in self._index:
            self._log.record_delete(last)  # keeps the key high-water mark in the journal

    def compact_index(self) -> None:
        """Rewrite the index as a snapshot of the live keys now, however short the
        journal (for a caller that counts the journal's bytes against a quota).

        Raises a TensorStoreError if the snapshot cannot be written; the journal is
        then untouched and still the truth.
        """
        with self._lock:
            self._check_open()
            self._compact()

    # ------------------------------------------------------------- inventory
    def keys(self) -> Iterator[str]:
        with self._lock:
            return iter(list(self._index))

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key in self._index

    def __len__(self) -> int:
        return len(self._index)

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def url(self) -> str:
        return self._url

    @property
    def temporary(self) -> bool:
        """True if this store made its own temporary directory (removed at close)."""
        return self._temporary

    @property
    def direct_io(self) -> DirectIOStatus:
        """Whether chunk files are written and read with ``O_DIRECT``, what was asked
        (``direct_io=``) and, when off, why (NOTE [ Direct I/O ] in ``_chunkio.py``)."""
        return self._direct

    @property
    def buffers(self) -> PoolStats:
        """The aligned buffers this store holds: idle in its pool, lent as tensor
        storage, staging writes (NOTE [ Aligned buffers ] in ``_aligned.py``)."""
        return self._pool.stats

    @property
    def buffer_bytes(self) -> int:
        """Bytes of aligned buffers this store holds right now (idle + in use): memory
        beyond the tensors themselves that a caller's budget should count."""
        return self._pool.stats.held_bytes

    def set_buffer_pool_bytes(self, nbytes: int) -> None:
        """How many idle aligned bytes to keep from now on (trims at once if lower):
        for a caller that sizes the pool from its own windows and budgets."""
        self._pool.set_idle_limit(nbytes)

    def flush(self) -> None:
        """Persist the index where the backend cannot append (object stores)."""
        self._check_writer("write")
        with self._lock:
            self._check_open()
            if not self._io.supports_append:
                self._log.snapshot({k: e.to_record() for k, e in self._index.items()})

    def _check_open(self, deleting: bool = False) -> None:
        if self._closed and not (deleting and self._close_pending):
            raise StoreClosedError(
                f"ZarrStore({self._url}) is closed; open a new store with tsh.open_store(...)"
            )

    def _check_writer(self, what: str) -> None:
        if foreign(self._pid):
            raise StoreUnavailableError(
                f"ZarrStore({self._url}): cannot {what} here: this store was opened by "
                f"process {self._pid} and this process ({os.getpid()}) is a fork of it, "
                "which must leave the parent's namespace alone (NOTE [ Fork safety ]); "
                "open a store of this process's own with tsh.open_store(...)"
            )

    def close(self) -> None:
        """Close the store. A temporary store deletes its directory; a namespace that
        holds no keys is removed so shared roots do not fill with empty writers.

        In a forked child of the process that opened it, only this object is closed:
        nothing on disk, and the namespace lock stays with the parent."""
        if foreign(self._pid):
            self._closed = True
            self._finalizer.detach()
            return
        with self._lock:
            if self._closed:
                return
            self._closed = True  # no put or get from now on
            if self._users:
                # NOTE [ Closed while in use ]: the sessions' deletes still come.
                self._close_pending = True
                return
        self._close_now()

    def _use(self) -> Callable[[], None]:
        """Internal (NOTE [ Closed while in use ]): an offload session writes here; call
        the result once it has deleted what it wrote (idempotent)."""
        with self._lock:
            self._check_open()
            self._users += 1
        done: list[bool] = []

        def unuse() -> None:
            with self._lock:
                if done:
                    return
                done.append(True)
                self._users -= 1
                last = self._users == 0 and self._close_pending
                self._close_pending = self._close_pending and not last
            if last:
                self._close_now()

        return unuse

    def _close_now(self) -> None:
        with self._lock:
            if self._finished:
                return
            self._finished = True
            empty = not self._index
            spares = [p for run in self._alloc.drain_spares() for p in self._run_paths(run)]
            with contextlib.suppress(Exception):
                if not empty and not self._io.supports_append:
                    self._log.snapshot({k: e.to_record() for k, e in self._index.items()})
            self._log.close()
        if spares and not self._temporary and not empty:
            with contextlib.suppress(Exception):
                self._io.delete(spares)
        if not self._temporary and empty:
            with contextlib.suppress(Exception):
                self._io.remove_tree(self.namespace)
        self._finalizer()  # releases the namespace lock last, removes a temporary root
        self._io.close()
        self._pool.close()


def _aligned_region(buffer: Any, n: int, what: str) -> memoryview:
    """``buffer`` as a writable byte view that a direct transfer of ``n`` bytes may use
    (NOTE [ Aligned I/O entry points ]), or a ConfigError saying what is wrong."""
    try:
        region = memoryview(buffer).cast("B")
    except TypeError as e:
        raise ConfigError(
            f"ZarrStore.{what}: expected a buffer, got {type(buffer).__name__}"
        ) from e
    need = round_up(n)
    offset = address_of(region) % BLOCK_BYTES if len(region) else 0
    if region.readonly or len(region) < need or (n and offset):
        raise ConfigError(
            f"ZarrStore.{what}: the buffer must be writable, start on a "
            f"{BLOCK_BYTES}-byte boundary and hold at least {need} bytes for a "
            f"{n}-byte payload; got {len(region)} bytes"
            f"{' (read-only)' if region.readonly else ''} at address offset {offset}; "
            "use put_blob / get_blob for other buffers"
        )
    return region


def _check_options(
    chunk_bytes: int | str,
    spare_bytes: int | str | None,
    buffer_pool_bytes: int | str | None,
    direct_io: str | bool,
) -> tuple[int, int | None, int, str]:
    """``ZarrStore``'s chunk size, spare limit, buffer pool size and direct-I/O mode,
    checked (``ConfigError``)."""
    try:
        spare = (
            None if spare_bytes is None else parse_bytes(spare_bytes, what="ZarrStore spare_bytes")
        )
        pool_bytes = (
            DEFAULT_BUFFER_POOL_BYTES
            if buffer_pool_bytes is None
            else parse_bytes(buffer_pool_bytes, what="ZarrStore buffer_pool_bytes")
        )
    except ValueError as e:
        raise ConfigError(str(e)) from e
    try:
        direct_mode = parse_direct_io(direct_io)
    except ConfigError as e:
        raise ConfigError(f"ZarrStore: direct_io: {e}; got {direct_io!r}") from None
    try:
        chunk = check_chunk_bytes(chunk_bytes)
    except ConfigError as e:
        raise ConfigError(f"ZarrStore: chunk_bytes: {e}; got {chunk_bytes!r}") from None
    return chunk, spare, pool_bytes, direct_mode


def _write_layout(io: ChunkIO, url: str, namespace: str, chunk_bytes: int, codec: str) -> None:
    """The namespace's ``zarr.json`` (a group document), where missing; a namespace of
    another layout format is refused (``ConfigError`` naming it). The root's is written
    at the first put (``ZarrStore._ensure_root_doc``)."""
    ns_doc = f"{namespace}/zarr.json"
    if not io.exists(ns_doc):
        io.write(ns_doc, [namespace_doc(FORMAT_VERSION, namespace, chunk_bytes, codec)])
        return
    found = namespace_format(io.read(ns_doc))
    if found != FORMAT_VERSION:
        raise ConfigError(
            f"ZarrStore({url}): namespace {namespace!r} is in layout format "
            f"{found} ({ns_doc}), written by another version of tensorstore-hooks; this "
            f"version reads format {FORMAT_VERSION} only (docs/layout.md, 'Formats'). Its "
            "tensors cannot be read here: open another namespace, or remove the "
            f"directory {namespace!r} under the root if its tensors are not needed"
        )


def _replay(
    index_log: IndexLog, alloc: ChunkAllocator, url: str, namespace: str
) -> tuple[dict[str, _Entry], int]:
    """A namespace's live entries from its index (their runs taken in ``alloc``), and
    the next key to hand out."""
    records = index_log.load()
    # Keys are never reused, not even deleted ones: a stale key must miss, not
    # return another tensor. Deleted keys count, and so does every key the damage
    # could have hidden (NOTE [ Journal records ] in _index.py).
    next_key = 0
    order: dict[str, int] = {}
    for key in [*index_log.retired_keys, *records]:
        with contextlib.suppress(ValueError):
            order[key] = int(key, 16)
            next_key = max(next_key, order[key] + 1)
    if index_log.damage:
        next_key += index_log.damaged_bytes // HEADER_BYTES + 1
    entries = {key: _Entry.from_record(rec) for key, rec in records.items()}
    dropped = alloc.resume(
        {k: e.run for k, e in entries.items()}, {k: order.get(k, -1) for k in entries}
    )
    if dropped:
        # Their delete records were lost (damage, or a crash while the disk was full).
        log.warning(
            "ZarrStore(%s): namespace %r: %d deleted key(s) whose delete record was lost "
            "reappeared on replay and were dropped (their chunks belong to newer keys)",
            url,
            namespace,
            len(dropped),
        )
    for key in dropped:
        del entries[key]
    return entries, next_key


def _write_failure(where: str, e: BaseException) -> TensorStoreError:
    """The store's error for a write that failed with ``e``."""
    if isinstance(e, OSError):
        return os_error(e, where)
    if isinstance(e, TensorStoreError):
        return type(e)(f"{where} failed: {e}")
    return StoreUnavailableError(f"{where} failed: {e}")


def _finalize(
    pid: int, index_log: IndexLog, unlock: Callable[[], None] | None, temp_dir: str | None
) -> None:
    if foreign(pid):  # a forked child's exit: the store is its parent's (NOTE [ Fork safety ])
        return
    index_log.close()
    if unlock is not None:
        unlock()
    if temp_dir is not None:
        shutil.rmtree(temp_dir, ignore_errors=True)


def _default_namespace() -> str:
    """``[r{rank}-]host-pid-random``: unique per process; the rank tells ranks apart at a glance."""
    host = re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname())[:40] or "host"
    rank = _distributed_rank()
    prefix = f"r{rank}-" if rank is not None else ""
    return f"{prefix}{host}-{os.getpid()}-{secrets.token_hex(4)}"


def _distributed_rank() -> int | None:
    """This process's global rank: from ``torch.distributed`` once initialised, else the
    ``RANK`` a launcher (torchrun, ...) exports before ``init_process_group``."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except (ImportError, RuntimeError, ValueError):
        pass
    rank = os.environ.get("RANK", "")
    return int(rank) if rank.isdigit() else None
