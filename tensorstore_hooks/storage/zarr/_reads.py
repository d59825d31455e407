"""KeyReader: a ZarrStore's reads (whole keys, chunk ranges, into a caller's buffer),
and TransferCounts: the bytes it moved with direct I/O and without.

The store (``storage/zarr/_store.py``) owns the namespace, the codec, the I/O and the buffer
pool; this unit reads a key's stored stream through them into pooled aligned buffers
(or a caller's), undoes the stream's rotation (NOTE [ Chunk objects ] in
``storage/zarr/_chunkcodec.py``) and maps a failed read to the store's errors.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from tensorstore_hooks._codec import Buffer, TensorMeta, as_memoryview
from tensorstore_hooks.errors import (
    ConfigError,
    IntegrityError,
    KeyNotFoundError,
    StoreUnavailableError,
    TensorStoreError,
)
from tensorstore_hooks.storage.io import BLOCK_BYTES, BufferPool, ChunkIO, address_of, round_up
from tensorstore_hooks.storage.zarr._chunkcodec import ChunkCodec
from tensorstore_hooks.storage.zarr._index import os_error
from tensorstore_hooks.storage.zarr._namespace import Entry, NamespaceIndex

__all__ = ["KeyReader", "TransferCounter", "TransferCounts", "aligned_region", "store_gone"]


@dataclass(frozen=True, slots=True)
class TransferCounts:
    """Payload bytes a store moved, by path (``ZarrStore.transfers``)."""

    direct_written: int = 0
    """Written with ``O_DIRECT``: no page cache, no copy into it."""
    buffered_written: int = 0
    """Written through the page cache (or to a memory or object store)."""
    direct_read: int = 0
    buffered_read: int = 0


class TransferCounter:
    """Thread-safe running :class:`TransferCounts`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = [0, 0, 0, 0]

    def add(self, nbytes: int, *, direct: bool, read: bool) -> None:
        with self._lock:
            self._counts[2 * read + (not direct)] += nbytes

    @property
    def counts(self) -> TransferCounts:
        with self._lock:
            return TransferCounts(*self._counts)


class KeyReader:
    """Reads keys of one namespace into pooled aligned buffers or a caller's."""

    def __init__(
        self,
        ns: NamespaceIndex,
        codec: ChunkCodec,
        io: ChunkIO,
        pool: BufferPool,
        url: str,
        counter: TransferCounter,
    ) -> None:
        self._ns, self._codec, self._io, self._pool = ns, codec, io, pool
        self._url = url
        self._counter = counter

    def blob(self, key: str) -> tuple[TensorMeta, np.ndarray]:
        """``ZarrStore.get_blob``."""
        entry = self._ns.entry(key)
        n = entry.meta.nbytes
        if not entry.count:
            return entry.meta, np.empty(n, dtype=np.uint8)
        out, region = self._pool.lend(n, entry.rot)
        self._read_into(key, entry, region, n, 0, entry.count)
        if entry.rot:  # the payload's first bytes were stored last (NOTE [ Chunk objects ])
            out[: entry.rot] = region[n - entry.rot : n]
        return entry.meta, out

    def range(self, key: str, start: int, length: int) -> np.ndarray:
        """``ZarrStore.read_range``."""
        entry = self._ns.entry(key)
        chunk, n = entry.chunk, entry.meta.nbytes
        end = start + length
        if length == 0:
            return np.empty(0, dtype=np.uint8)
        if start < 0 or start % chunk or end > n or (end != n and length % chunk):
            raise ValueError(f"read_range: [{start}, {end}) is not a run of whole chunks")
        rot = entry.rot
        if not rot:
            out, region = self._pool.lend(length)
            self._read_into(key, entry, region, length, start // chunk, -(-end // chunk))
            return out
        # A rotated stream (NOTE [ Chunk objects ]): payload byte p is stream byte
        # (p - rot) mod n, so the range is one piece of the stream, plus the stream's
        # last ``rot`` bytes for a range that starts the payload; read, then copied.
        out, _ = self._pool.lend(length)
        head = rot if start == 0 else 0
        out[head:] = self._stream(key, entry, start - rot + head, end - rot)
        if head:
            out[:head] = self._stream(key, entry, n - rot, n)
        return out

    def _stream(self, key: str, entry: Entry, lo: int, hi: int) -> np.ndarray:
        """Bytes ``[lo, hi)`` of ``entry``'s stored stream, from the whole chunks that
        hold them (a pooled buffer that goes back when the returned view dies)."""
        chunk, n = entry.chunk, entry.meta.nbytes
        first, last = lo // chunk, -(-hi // chunk)
        span = min(last * chunk, n) - first * chunk
        whole, region = self._pool.lend(span)
        self._read_into(key, entry, region, span, first, last)
        return whole[lo - first * chunk : hi - first * chunk]

    def into(self, key: str, buffer: Buffer) -> TensorMeta:
        """``ZarrStore.get_into``."""
        entry = self._ns.entry(key)
        n = entry.meta.nbytes
        region = aligned_region(buffer, n, "get_into")
        if entry.rot:
            _, out = self.blob(key)
            region[:n] = out.data
        elif entry.count:
            self._read_into(key, entry, region, n, 0, entry.count)
        return entry.meta

    def _read_into(
        self, key: str, entry: Entry, region: memoryview, n: int, first: int, last: int
    ) -> None:
        """Chunks ``[first, last)`` of ``entry``'s stored stream (``n`` bytes) into
        ``region`` (aligned), verified."""
        paths = self._ns.run_paths(entry.run)[first:last]
        crcs = entry.crc[4 * first : 4 * last]
        what = f"ZarrStore({self._url}): key {key!r}"
        direct = self._codec.moves_direct(self._io, entry.chunk)  # once: read as counted
        try:
            self._codec.read(self._io, paths, region, n, entry.chunk, crcs, what, first, direct)
        except Exception as e:
            gone = None
            if isinstance(e, FileNotFoundError) and key in self._ns:
                gone = store_gone(self._io, self._url, self._ns)
            if key not in self._ns:
                err: Exception = self.missing(key)
            elif gone is not None:
                err = StoreUnavailableError(f"{what} cannot be read: {gone}")
            else:
                err = _read_failure(what, e)
            if err is e:
                raise
            raise err from e
        # A key deleted while being read may have had its chunks rewritten as spares;
        # the bound checksums catch that, and so does this.
        if key not in self._ns:
            raise self.missing(key)
        self._counter.add(n, direct=direct, read=True)

    def missing(self, key: str) -> KeyNotFoundError:
        return KeyNotFoundError(f"ZarrStore({self._url}): key {key!r} was deleted while being read")


def aligned_region(buffer: Buffer, n: int, what: str) -> memoryview:
    """``buffer`` as a writable byte view that a direct transfer of ``n`` bytes may use
    (NOTE [ Aligned I/O entry points ] in ``storage/zarr/_store.py``), or a ConfigError saying
    what is wrong."""
    try:
        region = as_memoryview(buffer).cast("B")
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


def store_gone(io: ChunkIO, url: str, ns: NamespaceIndex) -> str | None:
    """Why the store's root or namespace is no longer there (``None`` if it is)."""
    namespace = ns.namespace
    try:
        # Before the first put the root has no zarr.json: only the namespace tells.
        if ns.root_doc_written and not io.exists("zarr.json"):
            return f"the store's root {url} is gone (removed or renamed while the store was open)"
        if not io.exists(f"{namespace}/zarr.json"):
            return (
                f"namespace {namespace!r} of {url} is gone (removed or renamed while the "
                "store was open)"
            )
    except Exception:  # cannot even look: say so rather than guess
        return f"the store's root {url} cannot be reached"
    return None


def _read_failure(what: str, e: Exception) -> TensorStoreError:
    """The store's error for a read of a key still in the index that failed with ``e``."""
    if isinstance(e, TensorStoreError):
        return e
    if isinstance(e, FileNotFoundError):
        return IntegrityError(f"{what}: chunk {e.filename or e} is missing")
    if isinstance(e, IsADirectoryError | NotADirectoryError):
        # Not a passing fault: a chunk path that is not a file will not heal.
        return IntegrityError(f"{what}: chunk {e.filename or e} is not a file")
    if isinstance(e, OSError):
        return os_error(e, f"reading {what}")
    return StoreUnavailableError(f"reading {what} failed: {e}")
