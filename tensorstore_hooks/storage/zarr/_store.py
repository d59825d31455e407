"""ZarrStore: tensors in log-structured Zarr v3 segment arrays under one fsspec root.

See ``docs/layout.md`` for the on-disk format. In short::

    ROOT/zarr.json                        group {"tensorstore_hooks": {"format": 4}}
    ROOT/NS/zarr.json                     group, one per writer (host-pid-random) or named
    ROOT/NS/seg-CHUNK/zarr.json           1-D uint8 array, chunk shape (CHUNK,), codecs
                                          bytes [+ zstd|blosc-lz4]
    ROOT/NS/seg-CHUNK/c/I                 chunk I: CHUNK bytes [compressed]
    ROOT/NS/index/{journal,snapshot}      key -> (segment, first chunk, chunks, crcs,
                                          rotation, meta)
    ROOT/NS/lock                          held (flock) by the store object writing NS

The units: :class:`~tensorstore_hooks.storage.zarr._namespace.NamespaceIndex` holds the keys
and where their chunks go (with
:class:`~tensorstore_hooks.storage.zarr._allocator.ChunkAllocator`, pure,
and :class:`~tensorstore_hooks.storage.zarr._index.IndexLog`, the persisted journal) under its lock,
:class:`~tensorstore_hooks.storage.zarr._chunkcodec.ChunkCodec` turns a payload into chunk objects
and back (codec, checksums, direct writes from the tensor's memory),
:class:`~tensorstore_hooks.storage.io.ChunkIO` moves objects, and
:class:`~tensorstore_hooks.storage.io._aligned.BufferPool` lends the aligned read buffers; this
class opens the namespace and orchestrates them.

NOTE [ Segment layout ]
Creating a Zarr array costs 3-8 ms in zarr 3.1.6, whatever its size, and a training
step saves hundreds of tensors, so arrays are created once per size class and each
tensor occupies a run of whole chunks in the class that wastes least: chunk sizes are
``chunk_bytes`` halved down to 4 KiB, and a tensor goes to the largest class whose
padding is at most 1/8 of its size. A put then writes whole chunks (NOTE [ Chunk
objects ] in ``storage/zarr/_chunkcodec.py``: what Zarr reads for them) and a delete frees them;
chunk runs are reused. I/O bypasses zarr's async machinery (tens of microseconds a call)
and writes the keys and encodings that ``zarr.open_array`` reads back.

NOTE [ Aligned I/O entry points ]
For callers that move a tensor's bytes through page-aligned host memory of their own
(the pipeline's CUDA staging: a device-to-host copy lands in a pinned buffer, and a
host-to-device copy leaves from one), two methods skip the store's own buffers:

1. ``put_aligned(meta, buffer)``: the chunks are written with ``O_DIRECT`` straight
   from ``buffer``, every block of them (no host copy, no bounce buffer, no
   rotation); ``get_into(key, buffer)``: the chunks of a key stored unrotated (by
   ``put_aligned``, or from page-aligned memory) are read straight into it; a
   rotated one (NOTE [ Chunk objects ] in ``storage/zarr/_chunkcodec.py``) goes through a pooled
   read buffer and a copy. ``buffer`` starts on a 4 KiB boundary, is writable and
   holds at least ``round_up(nbytes, 4096)`` bytes; the bytes after ``nbytes`` up to
   there are the store's to overwrite (zero padding on a put, whole blocks on a
   get). A buffer that does not qualify is a ``ConfigError`` and nothing is
   transferred.
2. Both return when the transfer is over: the buffer is the caller's again.
3. Without direct I/O (tmpfs, ``direct_io="off"``, object stores) they are
   ``put_blob`` and a read + copy: always correct, only not copy-free.
4. What the store itself holds for everyone else is ``buffers`` (``PoolStats``):
   read buffers lent as tensor storage (a tensor's ``nbytes`` rounded up to 4 KiB,
   plus one block for a rotated stream; returned when the tensor dies), copy
   buffers in use by writes that cannot go from the tensor's own memory (at most
   one chunk per writing thread), and idle buffers kept for reuse (at most
   ``buffer_pool_bytes``, settable with ``set_buffer_pool_bytes``). A caller that
   budgets memory counts the lent ones where the tensors are counted and the idle
   and copy ones beside them.

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
An offload pipeline deletes its keys when autograd frees their graph, which may be
after the store was closed (a graph held by a reference cycle, freed by the
collector). So a pipeline marks its use of the store (``_use()``); ``close()`` then
refuses puts and gets at once but keeps the journal and the namespace lock for the
pipelines' deletes, and finishes (spares unlinked, an empty namespace removed, the
lock released) when the last pipeline is done, or as soon as no key is left. Nothing
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
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping

import numpy as np

from tensorstore_hooks._codec import Buffer, TensorMeta, as_memoryview
from tensorstore_hooks._units import parse_bytes
from tensorstore_hooks.errors import (
    ConfigError,
    IntegrityError,
    StoreUnavailableError,
    TensorStoreError,
)
from tensorstore_hooks.runtime import foreign
from tensorstore_hooks.storage._retry import RetryPolicy
from tensorstore_hooks.storage._store import BlobStore
from tensorstore_hooks.storage._urls import split_url
from tensorstore_hooks.storage.io import (
    BufferPool,
    ChunkIO,
    DirectIOStatus,
    FsspecIO,
    LocalIO,
    MemoryIO,
    PoolStats,
)
from tensorstore_hooks.storage.zarr._chunkcodec import ChunkCodec
from tensorstore_hooks.storage.zarr._docs import (
    damaged_doc_advice,
    namespace_doc,
    namespace_format,
    read_doc,
    root_doc,
)
from tensorstore_hooks.storage.zarr._housekeeping import make_temp_root, sweep_at_open
from tensorstore_hooks.storage.zarr._index import Damage, IndexLog, os_error
from tensorstore_hooks.storage.zarr._namespace import NamespaceIndex
from tensorstore_hooks.storage.zarr._options import (
    DEFAULT_CHUNK_BYTES,
    MIN_CHUNK_BYTES,
    check_chunk_bytes,
    parse_codec,
    parse_direct_io,
)
from tensorstore_hooks.storage.zarr._reads import (
    KeyReader,
    TransferCounter,
    TransferCounts,
    aligned_region,
)
from tensorstore_hooks.storage.zarr._writes import KeyWriter, check_writer

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
FORMAT_VERSION = 4
"""The layout this version writes and reads (docs/layout.md); a namespace of another
format is refused when opened, naming its version."""


def make_io(
    url: str | os.PathLike[str] | None,
    storage_options: Mapping[str, object] | None = None,
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
    # An outage costs one deadline, not one per object (NOTE [ Outages ]).
    retry = RetryPolicy(deadline_s=float(retry_deadline_s), paced_probes=True)
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
    so several processes and ranks can share a root. Opening a named namespace that
    exists resumes it: its keys are readable again. On a local root a namespace is
    locked (``flock`` on ``NS/lock``) while a store object has it open: a second
    opener, in this process or another, gets a :class:`StoreUnavailableError` naming
    the holder. Object stores have no lock: give each writer its own namespace (the
    default does).

    ``retry_deadline_s`` (fsspec URLs): how long one object-store operation retries
    transient failures (throttling, 5xx, connection resets) before it raises
    :class:`StoreUnavailableError`; a missing bucket or denied access fails at once,
    when the store is opened.

    ``spare_bytes`` (local directories): how many bytes of deleted keys' chunk files
    to keep for rewriting in place (NOTE [ Spare chunk files ]); ``None`` (default):
    up to the peak of the live keys' chunk bytes; ``0``: unlink at once, so the
    directory holds exactly the live keys.

    ``direct_io`` (local directories): ``"auto"`` (default) writes and reads chunk
    files with ``O_DIRECT`` where the filesystem allows it (not tmpfs), so offloaded
    bytes leave RAM and cost no page-cache copy; ``"on"`` requires it
    (:class:`ConfigError` where it cannot be had); ``"off"`` goes through the page
    cache. :attr:`direct_io` says what was chosen and why (NOTE [ Direct I/O ] in
    ``storage/io/_local.py``). With it, a put writes straight from the tensor's own memory
    (NOTE [ Chunk objects ] in ``storage/zarr/_chunkcodec.py``).

    ``buffer_pool_bytes``: how many bytes of idle page-aligned buffers (read buffers
    that came back from dead tensors, copy buffers of writes that cannot go from the
    tensor's memory) to keep for reuse; ``None`` (default):
    :data:`DEFAULT_BUFFER_POOL_BYTES`. What the pool holds is :attr:`buffers` (NOTE
    [ Aligned buffers ] in ``storage/io/_aligned.py``).

    Reads: ``get``/``get_blob`` return tensors whose storage is the buffer the bytes
    were read into (no copy; a tensor with a storage offset or a gapped view is
    rebuilt by the codec). :meth:`put_aligned` writes from a caller's aligned
    buffer with no copy at all (NOTE [ Aligned I/O entry points ]).

    Errors: a put that fails for any OS reason raises a TensorStoreError
    (:class:`QuotaExceededError` when the filesystem is full) and is not stored: its
    chunks are deleted and nothing is journaled. A damaged index is replayed as far
    as it goes (:attr:`damage`, NOTE [ Journal records ] in ``storage/zarr/_index.py``).

    Thread-safe. ``put_blob``/``get_blob`` of different keys run concurrently; the
    index (:class:`~tensorstore_hooks.storage.zarr._namespace.NamespaceIndex`) is guarded by a
    lock and chunk I/O happens outside it.
    """

    def __init__(
        self,
        url: str | os.PathLike[str] | None = None,
        *,
        storage_options: Mapping[str, object] | None = None,
        chunk_bytes: int | str = DEFAULT_CHUNK_BYTES,
        codec: str = "none",
        namespace: str | None = None,
        retry_deadline_s: float = 30.0,
        spare_bytes: int | str | None = None,
        direct_io: str | bool = "auto",
        buffer_pool_bytes: int | str | None = None,
    ) -> None:
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
        # NOTE [ Stale namespaces ]: a temporary root sweeps its dead siblings, and is
        # locked (its marker) until it is removed.
        temp = make_temp_root() if self._temporary else None
        location = temp[0] if temp is not None else None
        self._io = make_io(location or url, storage_options, retry_deadline_s)
        self._url = self._io.url
        self.namespace = namespace or default_namespace()
        self._unlock: Callable[[], None] | None = None
        self._direct = DirectIOStatus(False, direct_mode, "not configured")
        self._ns = NamespaceIndex(self._io, self._url, self.namespace, chunk, spare_limit=spare)
        self._counter = TransferCounter()
        self._reads = KeyReader(
            self._ns, self._codec, self._io, self._pool, self._url, self._counter
        )
        self._writes = KeyWriter(
            self._ns, self._codec, self._io, self._url, self._pid, self._counter
        )
        self._ns.root_doc = root_doc(FORMAT_VERSION)
        self._ns.closed = True  # until fully constructed: close() must be safe on failure
        try:
            self._unlock = _lock_namespace(self._io, self.namespace)
            _write_layout(self._io, self._url, self.namespace, self.chunk_bytes, self.codec)
            self._direct = _configure_direct_io(self._io, direct_mode, self.namespace)
            if isinstance(self._io, LocalIO):
                self._io.root_made = True  # a vanished root is an error from now on
            if not self._temporary:
                kind, root = split_url(url)
                if kind == "local":
                    sweep_at_open(root)  # NOTE [ Stale namespaces ]
            self._ns.resume()
        except BaseException as e:
            if self._unlock is not None:
                self._unlock()
            if temp is not None:
                with contextlib.suppress(Exception):
                    self._io.remove_tree("")
                temp[1]()
            self._io.close()
            if isinstance(e, TensorStoreError) or not isinstance(e, Exception):
                raise
            if isinstance(e, OSError):
                raise os_error(e, f"ZarrStore: opening {self._url}") from e
            raise StoreUnavailableError(f"ZarrStore: cannot open {self._url}: {e}") from e
        self._ns.closed = False
        # Collected without close(): close the journal quietly, release the namespace
        # (and remove a temporary directory).
        self._finalizer = weakref.finalize(
            self, _finalize, self._pid, self._ns.log, self._unlock, temp
        )

    @property
    def damage(self) -> list[Damage]:
        """What replaying this namespace's index found damaged (empty when all was well)."""
        return self._ns.damage

    # ------------------------------------------------------------------- puts
    def put_blob(self, meta: TensorMeta, payload: Buffer) -> str:
        n = meta.nbytes
        data = as_memoryview(payload).cast("B") if n else memoryview(b"")
        if len(data) != n:
            raise IntegrityError(f"ZarrStore.put: payload has {len(data)} bytes, metadata says {n}")
        self._pool.park()  # idle read buffers' pages go (NOTE [ Aligned buffers ] rule 5)
        return self._writes.put(
            meta,
            lambda paths, chunk, direct: self._codec.write(self._io, paths, data, chunk, direct),
        )

    def put_aligned(self, meta: TensorMeta, buffer: Buffer) -> str:
        """Store ``buffer[:meta.nbytes]`` like :meth:`put_blob`, straight from ``buffer``
        (NOTE [ Aligned I/O entry points ]).

        For callers that already hold a tensor's bytes in page-aligned memory (a pinned
        staging buffer a device-to-host copy landed in): ``buffer`` is a writable
        buffer that starts on a ``BLOCK_BYTES`` (4 KiB) boundary and has at least
        ``round_up(nbytes, 4096)`` bytes; the store may overwrite the bytes after
        ``nbytes`` up to that length (zero padding). With direct I/O every block is
        written from ``buffer`` itself: no host copy. Otherwise this is
        :meth:`put_blob`. The buffer is consumed before this returns. Raises
        :class:`ConfigError` for a misaligned, short or read-only buffer (nothing is
        written).
        """
        n = meta.nbytes
        region = aligned_region(buffer, n, "put_aligned")
        self._pool.park()
        return self._writes.put(
            meta,
            lambda paths, chunk, direct: (
                self._codec.write_aligned(self._io, paths, region, n, chunk, direct),
                0,
            ),
        )

    # ------------------------------------------------------------------- gets
    def meta(self, key: str) -> TensorMeta:
        return self._ns.entry(key).meta

    def get_blob(self, key: str) -> tuple[TensorMeta, np.ndarray]:
        """The metadata and the payload in a writable uint8 array whose address is
        that of the tensor it was stored from, modulo 4 KiB (page-aligned for one
        stored from aligned memory): from
        :data:`~tensorstore_hooks.storage.io._aligned.POOL_MIN_BYTES` up, a pooled buffer that
        goes back to the pool when the array and everything made from it (a tensor's
        storage) are gone (NOTE [ Aligned buffers ])."""
        return self._reads.blob(key)

    def chunk_class(self, key: str) -> int:
        """The chunk size of ``key``'s run (0 for an empty payload): the unit of
        :meth:`read_range`."""
        return self._ns.entry(key).chunk

    def read_range(self, key: str, start: int, length: int) -> np.ndarray:
        """Bytes ``[start, start + length)`` of ``key``'s payload, each whole chunk read
        verified, in an array like :meth:`get_blob`'s (a streamed answer holds one
        piece at a time). ``start`` must be a multiple of :meth:`chunk_class`, and the
        range must end at a chunk boundary or at the payload's end. Errors as
        :meth:`get_blob`."""
        return self._reads.range(key, start, length)

    def get_into(self, key: str, buffer: Buffer) -> TensorMeta:
        """Read ``key``'s payload into the first ``nbytes`` of ``buffer`` and return its
        metadata (NOTE [ Aligned I/O entry points ]).

        ``buffer``: writable, starting on a ``BLOCK_BYTES`` (4 KiB) boundary, at least
        ``round_up(nbytes, 4096)`` bytes (a direct read fills whole blocks: the bytes
        after ``nbytes`` up to there are overwritten). With direct I/O the chunks land
        in it straight from the disk (a key written from memory that was not
        page-aligned, stored rotated, is read into a pooled buffer and copied).
        Raises :class:`ConfigError` for a buffer that is misaligned, short or read-only
        (nothing is read), and what :meth:`get_blob` raises.
        """
        return self._reads.into(key, buffer)

    # ---------------------------------------------------------------- deletes
    def delete(self, key: str) -> None:
        check_writer(self._pid, self._url, "delete")
        self._writes.unlink(self._ns.forget([key], missing_ok=False))
        if self._ns.drained():  # NOTE [ Closed while in use ]
            self._close_now()

    def delete_many(self, keys: Iterable[str]) -> None:
        check_writer(self._pid, self._url, "delete")
        self._writes.unlink(self._ns.forget(keys, missing_ok=True))
        if self._ns.drained():
            self._close_now()

    def compact_index(self) -> None:
        """Rewrite the index as a snapshot of the live keys now, however short the
        journal (for a caller that counts the journal's bytes against a quota).

        Raises a TensorStoreError if the snapshot cannot be written; the journal is
        then untouched and still the truth.
        """
        self._ns.compact_index()

    # ------------------------------------------------------------- inventory
    def keys(self) -> Iterator[str]:
        return iter(self._ns.keys())

    def __contains__(self, key: object) -> bool:
        return key in self._ns

    def __len__(self) -> int:
        return len(self._ns)

    @property
    def nbytes(self) -> int:
        return self._ns.nbytes

    @property
    def url(self) -> str:
        return self._url

    @property
    def temporary(self) -> bool:
        """True if this store made its own temporary directory (removed at close)."""
        return self._temporary

    @property
    def direct_io(self) -> DirectIOStatus:
        """Whether chunk files are written and read with ``O_DIRECT`` now, what was asked
        (``direct_io=``) and, when off, why (NOTE [ Direct I/O ] in ``storage/io/_local.py``).
        A probe that a full disk kept from running at open runs again at a later put,
        so this may turn on during the store's life."""
        return self._io.direct_io if self._io.direct_io is not None else self._direct

    def moves_direct(self, key: str) -> bool:
        """Whether ``key``'s chunks are written and read with ``O_DIRECT``."""
        return self._codec.moves_direct(self._io, self._ns.entry(key).chunk)

    @property
    def transfers(self) -> TransferCounts:
        """Payload bytes written and read so far, with ``O_DIRECT`` and without (chunk
        classes below 256 KiB and compressed ones go through the page cache)."""
        return self._counter.counts

    @property
    def buffers(self) -> PoolStats:
        """The aligned buffers this store holds: idle in its pool, lent as tensor
        storage, copy buffers of writes (NOTE [ Aligned buffers ] in ``storage/io/_aligned.py``)."""
        return self._pool.stats

    @property
    def buffer_pool_bytes(self) -> int:
        """Idle aligned buffer bytes this store keeps for reuse now."""
        return self._pool.stats.idle_limit_bytes

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
        check_writer(self._pid, self._url, "write")
        self._ns.flush()

    def close(self) -> None:
        """Close the store. A temporary store deletes its directory; a namespace that
        holds no keys is removed so shared roots do not fill with empty writers.

        In a forked child of the process that opened it, only this object is closed:
        nothing on disk, and the namespace lock stays with the parent."""
        ns = getattr(self, "_ns", None)  # None: the constructor failed before making it
        if ns is not None and foreign(self._pid):
            ns.closed = True
            self._finalizer.detach()
        elif ns is not None and ns.begin_close():
            self._close_now()

    def _use(self) -> Callable[[], None]:
        """Internal (NOTE [ Closed while in use ]): an offload pipeline writes here; call
        the result once it has deleted what it wrote (idempotent)."""
        return self._ns.use(self._close_now)

    def _close_now(self) -> None:
        closed = self._ns.close()
        if closed is None:
            return
        empty, spare_runs = closed
        spares = [p for run in spare_runs for p in self._ns.run_paths(run)]
        if spares and not self._temporary and not empty:
            with contextlib.suppress(Exception):
                self._io.delete(spares)
        if not self._temporary and empty:
            with contextlib.suppress(Exception):
                self._io.remove_tree(self.namespace)
        self._finalizer()  # releases the namespace lock last, removes a temporary root
        self._io.close()
        self._pool.close()


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


def _lock_namespace(io: ChunkIO, namespace: str) -> Callable[[], None] | None:
    """Take the namespace's lock (NOTE: one writer per namespace, docs/layout.md)."""
    try:
        return io.lock(f"{namespace}/lock")
    except BlockingIOError as e:
        raise StoreUnavailableError(
            f"ZarrStore({io.url}): namespace {namespace!r} is open in another "
            f"store object ({e.strerror}); two writers would overwrite each other's "
            "keys. Close the other store first, or use another namespace."
        ) from None


def _configure_direct_io(io: ChunkIO, mode: str, namespace: str) -> DirectIOStatus:
    try:
        return io.configure_direct_io(mode, f"{namespace}/direct-probe")
    except ConfigError as e:
        raise ConfigError(f"ZarrStore({io.url}): {e}") from None


def _write_layout(io: ChunkIO, url: str, namespace: str, chunk_bytes: int, codec: str) -> None:
    """The namespace's ``zarr.json`` (a group document), where missing, written
    atomically (NOTE [ Atomic documents ]). One that cannot be parsed is left as it
    is and refused (``IntegrityError`` naming it and how to recover); a namespace of
    another layout format is refused (``ConfigError`` naming it). The root's document
    is written at the first put (``NamespaceIndex.ensure_root_doc``)."""
    ns_doc = f"{namespace}/zarr.json"
    doc = read_doc(io, ns_doc)
    if doc.missing:
        io.write_atomic(ns_doc, [namespace_doc(FORMAT_VERSION, namespace, chunk_bytes, codec)])
        return
    if doc.parsed is None:
        raise IntegrityError(
            f"ZarrStore({url}): namespace {namespace!r}: its document {ns_doc} cannot be "
            f"parsed ({doc.error}), so its layout format is unknown and the namespace "
            f"cannot be opened; {damaged_doc_advice(io, ns_doc)}"
        )
    found = namespace_format(doc.parsed)
    if found is None:
        raise ConfigError(
            f"ZarrStore({url}): {namespace!r} under the root is a Zarr node that "
            f"tensorstore-hooks did not make ({ns_doc} has no attributes.tensorstore_hooks); "
            "nothing in it was changed. Open another namespace, or another root"
        )
    if found != FORMAT_VERSION:
        raise ConfigError(
            f"ZarrStore({url}): namespace {namespace!r} is in layout format "
            f"{found} ({ns_doc}), written by another version of tensorstore-hooks; this "
            f"version reads format {FORMAT_VERSION} only (docs/layout.md, 'Formats'). Its "
            "tensors cannot be read here: open another namespace, or remove the "
            f"directory {namespace!r} under the root if its tensors are not needed"
        )


def _finalize(
    pid: int,
    index_log: IndexLog,
    unlock: Callable[[], None] | None,
    temp: tuple[str, Callable[[], None]] | None,
) -> None:
    if foreign(pid):  # a forked child's exit: the store is its parent's (NOTE [ Fork safety ])
        return
    index_log.close()
    if unlock is not None:
        unlock()
    if temp is not None:
        shutil.rmtree(temp[0], ignore_errors=True)
        temp[1]()  # the temporary root's lock, once nothing is left under it


def default_namespace() -> str:
    """``[r{rank}-]host-pid-random``: unique per process; the rank tells ranks apart at a glance."""
    host = re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname())[:40] or "host"
    rank = distributed_rank()
    prefix = f"r{rank}-" if rank is not None else ""
    return f"{prefix}{host}-{os.getpid()}-{secrets.token_hex(4)}"


def distributed_rank() -> int | None:
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
