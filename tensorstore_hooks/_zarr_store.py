"""ZarrStore: tensors in log-structured Zarr v3 segment arrays under one fsspec root.

See ``docs/layout.md`` for the on-disk format. In short::

    ROOT/zarr.json                        group {"tensorstore_hooks": {"format": 1}}
    ROOT/NS/zarr.json                     group, one per writer (host-pid-random) or named
    ROOT/NS/seg-CHUNK/zarr.json           1-D uint8 array, chunk shape (CHUNK,), codecs
                                          bytes [+ zstd|blosc-lz4] + crc32c
    ROOT/NS/seg-CHUNK/c/I                 chunk I: CHUNK bytes [compressed] + crc32c
    ROOT/NS/index/{journal,snapshot}      key -> (segment, first chunk, chunks, tensor meta)

NOTE [ Segment layout ]
Creating a Zarr array costs 3-8 ms in zarr 3.1.6, whatever its size, and a training
step saves hundreds of tensors, so arrays are created once per size class and each
tensor occupies a run of whole chunks in the class that wastes least: chunk sizes are
``chunk_bytes`` halved down to 4 KiB, and a tensor goes to the largest class whose
padding is at most 1/8 of its size. A put then writes whole chunks (the bytes Zarr
itself would write: payload, zero padding, crc32c) and a delete frees them; chunk
runs are reused. I/O bypasses zarr's async machinery (tens of microseconds a call)
and writes the keys and encodings that ``zarr.open_array`` reads back.

NOTE [ Spare chunk files ]
A training loop frees and re-saves the same sizes every step. On a local filesystem,
unlinking a chunk file and creating it again costs the kernel 3-10x more than
rewriting the file in place (ext4 frees and reallocates the blocks and the page-cache
pages; measured 0.6-3 GiB/s against 7-8 GiB/s here), and that kernel time is taken
from the training step's cores. So where the backend says overwriting is cheap
(``ChunkIO.cheap_overwrite``: local directories), a deleted key's chunk files stay
on disk as *spares*: its run goes back to the free list and the next put of the same
size class and length rewrites it. Spares hold at most ``spare_bytes`` (default: the
peak of the live keys' chunk bytes, so a steady loop's footprint is its peak); beyond
that, the least recently freed spares are unlinked to make room (a loop re-saves what
it just freed: keeping old spares of sizes no longer used would turn every later
put into a create), and ``close()`` unlinks them all. Spare chunks are in
no index entry, so no reader (ours or plain zarr through the index) takes their stale
bytes for a key's; a read racing its key's delete raises ``KeyNotFoundError``.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import socket
import tempfile
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import zarr
from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec, ZstdCodec

from ._checksum import OVERLAP_BYTES, READ_PIECE_BYTES, RunningCrc, crc
from ._chunkio import ChunkIO, FsspecIO, LocalIO, MemoryIO
from ._codec import TensorMeta
from ._index import IndexLog
from ._retry import RetryPolicy
from ._store import BlobStore
from ._units import parse_bytes
from ._urls import split_url
from ._zarr_options import DEFAULT_CHUNK_BYTES, MIN_CHUNK_BYTES, check_chunk_bytes, parse_codec
from .errors import (
    ConfigError,
    IntegrityError,
    KeyNotFoundError,
    StoreUnavailableError,
    TensorStoreError,
)

__all__ = ["DEFAULT_CHUNK_BYTES", "ZarrStore", "parse_codec", "split_url"]

_SEGMENT_CHUNKS = 1 << 32  # chunks per segment array: its shape is CHUNK * 2**32 bytes
_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
FORMAT_VERSION = 1


@dataclass(slots=True)
class _Entry:
    chunk: int  # chunk size class (bytes); 0 for an empty payload
    start: int  # first chunk index in that class's segment
    count: int  # number of chunks
    meta: TensorMeta

    def to_record(self) -> dict[str, Any]:
        return {
            "seg": self.chunk,
            "start": self.start,
            "count": self.count,
            "meta": self.meta.to_dict(),
        }

    @classmethod
    def from_record(cls, rec: dict[str, Any]) -> _Entry:
        try:
            chunk, start, count, meta = rec["seg"], rec["start"], rec["count"], rec["meta"]
        except (KeyError, TypeError) as e:
            raise IntegrityError(f"index entry is malformed: {rec!r:.200}") from e
        if not all(isinstance(v, int) and v >= 0 for v in (chunk, start, count)):
            raise IntegrityError(f"index entry has bad extents: {rec!r:.200}")
        return cls(chunk, start, count, TensorMeta.from_dict(meta))


def _zarr_json(factory: Any) -> bytes:
    """The ``zarr.json`` document zarr itself writes for a node (made in scratch memory)."""
    scratch = zarr.storage.MemoryStore()
    factory(scratch)
    return bytes(scratch._store_dict["zarr.json"].to_bytes())


class ZarrStore(BlobStore):
    """Tensors in chunked Zarr v3 arrays under a local path or any fsspec URL.

    ``url``: a bare path, ``file://``, ``memory://`` (private to this object), or any
    fsspec URL (``s3://bucket/prefix``) with ``storage_options`` passed to fsspec.
    ``None`` makes a temporary directory that is removed on ``close()`` and at exit.

    Each instance writes into its own *namespace* under the root (``host-pid-random``,
    prefixed ``r{rank}-`` under ``torch.distributed``, unless ``namespace`` names one),
    so several processes and ranks can share a root. Opening a
    named namespace that exists resumes it: its keys are readable again.

    ``retry_deadline_s`` (fsspec URLs): how long one object-store operation retries
    transient failures (throttling, 5xx, connection resets) before it raises
    :class:`StoreUnavailableError`; a missing bucket or denied access fails at once,
    when the store is opened.

    ``spare_bytes`` (local directories): how many bytes of deleted keys' chunk files
    to keep for rewriting in place (NOTE [ Spare chunk files ]); ``None`` (default):
    up to the peak of the live keys' chunk bytes; ``0``: unlink at once, so the
    directory holds exactly the live keys.

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
    ) -> None:
        self._closed = True  # until fully constructed: close() must be safe on failure
        try:
            spare = (
                None
                if spare_bytes is None
                else parse_bytes(spare_bytes, what="ZarrStore spare_bytes")
            )
        except ValueError as e:
            raise ConfigError(str(e)) from e
        try:
            chunk = check_chunk_bytes(chunk_bytes)
        except ConfigError as e:
            raise ConfigError(f"ZarrStore: chunk_bytes: {e}; got {chunk_bytes!r}") from None
        try:
            self._codec_name, self._codec_level = parse_codec(codec)
        except ConfigError as e:
            raise ConfigError(f"ZarrStore: codec: {e}; got {codec!r}") from None
        self.codec = codec
        self.chunk_bytes = chunk
        if namespace is not None and not _NAMESPACE_RE.match(namespace):
            raise ConfigError(f"ZarrStore: namespace {namespace!r} must be 1-128 of [A-Za-z0-9._-]")
        self._temporary = url is None
        kind, location = split_url(url)
        if self._temporary:
            location = tempfile.mkdtemp(prefix="tensorstore-hooks-")
        self._io = self._make_io(kind, location, storage_options or {}, retry_deadline_s)
        self._url = self._io.url
        self.namespace = namespace or _default_namespace()
        self._classes = [
            chunk >> i for i in range(chunk.bit_length()) if chunk >> i >= MIN_CHUNK_BYTES
        ]
        self._lock = threading.Lock()
        self._index: dict[str, _Entry] = {}
        self._nbytes = 0
        self._next_key = 0
        self._next_chunk: dict[int, int] = {}
        self._free: dict[tuple[int, int], list[int]] = {}
        # Freed runs whose files are kept for rewriting: NOTE [ Spare chunk files ].
        self._spare: dict[tuple[int, int], list[int]] = {}
        self._spare_nbytes = 0
        self._spare_limit = spare
        self._chunked_nbytes = 0  # live keys' chunk bytes (payload + padding)
        self._peak_chunked = 0
        self._segments_made: set[int] = set()
        self._zeros = b""
        self._compressor = self._make_compressor()
        try:
            self._init_layout()
            self._log = IndexLog(self._io, f"{self.namespace}/index")
            self._resume(self._log.load(), self._log.retired_keys)
        except TensorStoreError:
            self._cleanup_temp()
            self._io.close()
            raise
        except Exception as e:
            self._cleanup_temp()
            self._io.close()
            raise StoreUnavailableError(f"ZarrStore: cannot open {self._url}: {e}") from e
        self._closed = False
        # Collected without close(): close the journal quietly (and remove a temp dir).
        self._finalizer: weakref.finalize[Any, Any] = weakref.finalize(
            self, _finalize, self._log, location if self._temporary else None
        )

    # ------------------------------------------------------------------ setup
    @staticmethod
    def _make_io(
        kind: str, location: str, storage_options: dict[str, Any], retry_deadline_s: float
    ) -> ChunkIO:
        if kind == "local":
            return LocalIO(location)
        if kind == "memory":
            return MemoryIO(location)
        if not (isinstance(retry_deadline_s, int | float) and retry_deadline_s > 0):
            raise ConfigError(
                f"ZarrStore: retry_deadline_s must be a number of seconds > 0, "
                f"got {retry_deadline_s!r}"
            )
        retry = RetryPolicy(deadline_s=float(retry_deadline_s))
        try:
            fs, path, owned = FsspecIO.open_filesystem(location, storage_options, retry)
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

    def _make_compressor(self) -> Any:
        from numcodecs import Blosc, Zstd

        if self._codec_name == "zstd":
            return Zstd(level=self._codec_level)
        if self._codec_name == "lz4":
            return Blosc(cname="lz4", clevel=5, shuffle=Blosc.NOSHUFFLE, blocksize=0)
        return None

    def _init_layout(self) -> None:
        if not self._io.exists("zarr.json"):
            self._io.write(
                "zarr.json",
                [
                    _zarr_json(
                        lambda s: zarr.create_group(
                            store=s,
                            zarr_format=3,
                            attributes={"tensorstore_hooks": {"format": FORMAT_VERSION}},
                        )
                    )
                ],
            )
        ns_doc = f"{self.namespace}/zarr.json"
        if not self._io.exists(ns_doc):
            attrs = {
                "tensorstore_hooks": {
                    "format": FORMAT_VERSION,
                    "namespace": self.namespace,
                    "chunk_bytes": self.chunk_bytes,
                    "codec": self.codec,
                    "index": "index/journal + index/snapshot (msgpack), see docs/layout.md",
                }
            }
            self._io.write(
                ns_doc,
                [_zarr_json(lambda s: zarr.create_group(store=s, zarr_format=3, attributes=attrs))],
            )

    def _resume(self, records: dict[str, dict[str, Any]], retired: set[str]) -> None:
        # Keys are never reused, not even deleted ones: a stale key must miss, not
        # return another tensor. ``retired`` holds the deleted keys the journal names.
        for key in retired:
            with contextlib.suppress(ValueError):
                self._next_key = max(self._next_key, int(key, 16) + 1)
        for key, rec in records.items():
            entry = _Entry.from_record(rec)
            self._index[key] = entry
            self._nbytes += entry.meta.nbytes
            self._chunked_nbytes += entry.chunk * entry.count
            if entry.count:
                self._segments_made.add(entry.chunk)
                end = entry.start + entry.count
                self._next_chunk[entry.chunk] = max(self._next_chunk.get(entry.chunk, 0), end)
            with contextlib.suppress(ValueError):
                self._next_key = max(self._next_key, int(key, 16) + 1)
        # Gaps between resumed extents are simply not reused; they hold no files.

    def _segment_path(self, chunk: int) -> str:
        return f"{self.namespace}/seg-{chunk}"

    def _ensure_segment(self, chunk: int) -> None:
        if chunk in self._segments_made:
            return
        compressors: list[Any] = [Crc32cCodec()]
        if self._codec_name == "zstd":
            compressors.insert(0, ZstdCodec(level=self._codec_level or 3))
        elif self._codec_name == "lz4":
            compressors.insert(
                0, BloscCodec(cname="lz4", clevel=5, shuffle="noshuffle", typesize=1, blocksize=0)
            )
        doc = _zarr_json(
            lambda s: zarr.create_array(
                store=s,
                shape=(chunk * _SEGMENT_CHUNKS,),
                chunks=(chunk,),
                dtype="uint8",
                fill_value=0,
                serializer=BytesCodec(),
                compressors=compressors,
                filters=None,
                zarr_format=3,
                attributes={"tensorstore_hooks": {"segment_chunk_bytes": chunk}},
            )
        )
        self._io.write(f"{self._segment_path(chunk)}/zarr.json", [doc])
        self._segments_made.add(chunk)

    # ------------------------------------------------------------- allocation
    def _layout(self, n: int) -> tuple[int, int]:
        """(chunk size class, chunk count) for ``n`` payload bytes (NOTE [ Segment layout ])."""
        if n == 0:
            return 0, 0
        for c in self._classes:
            if c > n and c != self._classes[-1]:
                continue
            count = -(-n // c)
            if (count * c - n) * 8 <= n or c == self._classes[-1]:
                return c, count
        raise AssertionError("unreachable: the smallest class always fits")  # pragma: no cover

    def _alloc(self, chunk: int, count: int) -> int:
        runs = self._spare.get((chunk, count))
        if runs:
            self._spare_nbytes -= chunk * count
            start = runs.pop()
            if not runs:
                del self._spare[(chunk, count)]
            return start
        runs = self._free.get((chunk, count))
        if runs:
            return runs.pop()
        start = self._next_chunk.get(chunk, 0)
        if start + count > _SEGMENT_CHUNKS:
            raise StoreUnavailableError(f"ZarrStore({self._url}): segment seg-{chunk} is full")
        self._next_chunk[chunk] = start + count
        return start

    def _release(self, chunk: int, start: int, count: int) -> None:
        if count:
            self._free.setdefault((chunk, count), []).append(start)

    def _keep_spares(self, entries: list[_Entry]) -> list[tuple[int, int, int]]:
        """Under the lock: keep freed runs as spares (NOTE [ Spare chunk files ]);
        return the ``(chunk, start, count)`` runs whose files must be deleted and then
        released. The newest freed runs are kept: a run that does not fit evicts the
        least recently freed size first, since a loop re-saves what it just freed."""
        runs = [(e.chunk, e.start, e.count) for e in entries if e.count]
        if not self._io.cheap_overwrite:
            return runs
        limit = self._peak_chunked if self._spare_limit is None else self._spare_limit
        unlink = []
        for chunk, start, count in runs:
            size = chunk * count
            if size > limit:
                unlink.append((chunk, start, count))
                continue
            while self._spare_nbytes + size > limit:
                unlink.append(self._evict_spare())
            # Re-inserted last: the dict's order is least recently freed first.
            starts = self._spare.pop((chunk, count), [])
            starts.append(start)
            self._spare[(chunk, count)] = starts
            self._spare_nbytes += size
        return unlink

    def _evict_spare(self) -> tuple[int, int, int]:
        """Under the lock: take the oldest spare of the least recently freed size."""
        (chunk, count), starts = next(iter(self._spare.items()))
        start = starts.pop(0)
        if not starts:
            del self._spare[(chunk, count)]
        self._spare_nbytes -= chunk * count
        return chunk, start, count

    def _drop_runs(self, runs: list[tuple[int, int, int]]) -> None:
        """Delete the chunk files of freed ``(chunk, start, count)`` runs (outside the
        lock), then free them."""
        if not runs:
            return
        with contextlib.suppress(Exception):
            self._io.delete([p for run in runs for p in self._run_paths(*run)])
        with self._lock:
            for chunk, start, count in runs:
                self._release(chunk, start, count)

    def _chunk_paths(self, entry: _Entry) -> list[str]:
        return self._run_paths(entry.chunk, entry.start, entry.count)

    def _run_paths(self, chunk: int, start: int, count: int) -> list[str]:
        seg = self._segment_path(chunk)
        return [f"{seg}/c/{start + i}" for i in range(count)]

    # -------------------------------------------------------------------- I/O
    def _zero_pad(self, n: int) -> memoryview:
        if len(self._zeros) < n:
            self._zeros = bytes(max(n, self.chunk_bytes))
        return memoryview(self._zeros)[:n]

    def _encode_chunk(self, data: memoryview, chunk: int) -> list[Any]:
        pad = chunk - len(data)
        parts: list[Any] = [data]
        if pad:
            parts.append(self._zero_pad(pad))
        if self._compressor is not None:
            joined = np.frombuffer(b"".join(parts), dtype=np.uint8)
            parts = [memoryview(self._compressor.encode(joined)).cast("B")]
        value = 0
        for p in parts:
            value = crc(p, value)
        parts.append(value.to_bytes(4, "little"))
        return parts

    def _write_chunks_overlapped(self, paths: list[str], data: memoryview, chunk: int) -> None:
        """Local, uncompressed, large chunks: NOTE [ Overlapped checksums ]."""
        for i, path in enumerate(paths):
            piece = data[i * chunk : (i + 1) * chunk]
            parts: list[Any] = [piece]
            if len(piece) < chunk:
                parts.append(self._zero_pad(chunk - len(piece)))
            running = RunningCrc(background=True)
            try:
                for part in parts:
                    running.feed(part)
                self._io.write_with_trailer(path, parts, running.trailer)
            finally:
                # Never leave the helper reading a buffer the caller may reuse.
                running.value()

    def put_blob(self, meta: TensorMeta, payload: Any) -> str:
        n = meta.nbytes
        data = memoryview(payload).cast("B") if n else memoryview(b"")
        if len(data) != n:
            raise IntegrityError(f"ZarrStore.put: payload has {len(data)} bytes, metadata says {n}")
        chunk, count = self._layout(n)
        with self._lock:
            self._check_open()
            key = format(self._next_key, "x")
            self._next_key += 1
            start = self._alloc(chunk, count) if count else 0
            try:
                if count:
                    self._ensure_segment(chunk)
            except Exception:
                self._release(chunk, start, count)
                raise
        entry = _Entry(chunk, start, count, meta)
        paths = self._chunk_paths(entry)
        try:
            if self._compressor is None and self._io.cheap_overwrite and chunk >= OVERLAP_BYTES:
                self._write_chunks_overlapped(paths, data, chunk)
            else:
                self._io.write_many(
                    [
                        (p, self._encode_chunk(data[i * chunk : (i + 1) * chunk], chunk))
                        for i, p in enumerate(paths)
                    ]
                )
        except Exception as e:
            with contextlib.suppress(Exception):
                self._io.delete(paths)
            with self._lock:
                self._release(chunk, start, count)
            raise StoreUnavailableError(
                f"ZarrStore({self._url}): writing key {key!r} failed: {e}; "
                "the tensor was not stored"
            ) from e
        with self._lock:
            self._check_open()
            self._index[key] = entry
            self._nbytes += n
            self._chunked_nbytes += chunk * count
            self._peak_chunked = max(self._peak_chunked, self._chunked_nbytes)
            self._log.record_put(key, entry.to_record())
        return key

    def _entry(self, key: str) -> _Entry:
        self._check_open()
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
        entry = self._entry(key)
        n = entry.meta.nbytes
        out = np.empty(n, dtype=np.uint8)
        if entry.count:
            paths = self._chunk_paths(entry)
            try:
                if self._compressor is None and isinstance(self._io, LocalIO):
                    self._read_local(key, entry, paths, out)
                else:
                    self._read_generic(key, entry, paths, out)
            except FileNotFoundError as e:
                if key not in self._index:
                    raise self._missing(key) from e
                raise IntegrityError(
                    f"ZarrStore({self._url}): chunk {e.filename or e} of key {key!r} is missing"
                ) from e
            except TensorStoreError:
                if key not in self._index:
                    raise self._missing(key) from None
                raise
            except Exception as e:
                raise StoreUnavailableError(
                    f"ZarrStore({self._url}): reading key {key!r} failed: {e}"
                ) from e
            # A key deleted while being read may have had its chunks rewritten as
            # spares: bytes that passed their checksum may be another tensor's.
            if key not in self._index:
                raise self._missing(key)
        return entry.meta, out

    def _missing(self, key: str) -> KeyNotFoundError:
        return KeyNotFoundError(f"ZarrStore({self._url}): key {key!r} was deleted while being read")

    def _read_local(self, key: str, entry: _Entry, paths: list[str], out: np.ndarray) -> None:
        chunk = entry.chunk
        view = memoryview(out.data)
        crc_buf = bytearray(4)
        background = chunk >= OVERLAP_BYTES  # NOTE [ Overlapped checksums ]
        for i, path in enumerate(paths):
            piece = view[i * chunk : (i + 1) * chunk]
            pad = chunk - len(piece)
            step = READ_PIECE_BYTES if background else chunk
            parts = [piece[lo : lo + step] for lo in range(0, len(piece), step)]
            if pad:
                parts.append(memoryview(bytearray(pad)))
            payload_parts = len(parts)
            parts.append(memoryview(crc_buf))
            running = RunningCrc(background)

            def filled(
                j: int,
                parts: list[memoryview] = parts,
                n: int = payload_parts,
                running: RunningCrc = running,
            ) -> None:
                if j < n:
                    running.feed(parts[j])

            try:
                size = self._io.readinto(path, parts, filled)
            finally:
                value = running.value()
            if size != chunk + 4:
                raise IntegrityError(
                    f"ZarrStore({self._url}): chunk {path} of key {key!r} is truncated "
                    f"({size} bytes, expected {chunk + 4})"
                )
            self._verify(key, path, value, crc_buf)

    def _read_generic(self, key: str, entry: _Entry, paths: list[str], out: np.ndarray) -> None:
        chunk = entry.chunk
        blobs = self._io.read_many(paths)
        for i, (path, blob) in enumerate(zip(paths, blobs, strict=True)):
            mv = memoryview(blob).cast("B")
            if len(mv) < 4 or (self._compressor is None and len(mv) != chunk + 4):
                raise IntegrityError(
                    f"ZarrStore({self._url}): chunk {path} of key {key!r} is truncated "
                    f"({len(mv)} bytes)"
                )
            self._verify(key, path, crc(mv[:-4]), mv[-4:])
            body = mv[:-4]
            if self._compressor is not None:
                try:
                    body = memoryview(self._compressor.decode(body)).cast("B")
                except Exception as e:
                    raise IntegrityError(
                        f"ZarrStore({self._url}): chunk {path} of key {key!r} "
                        f"does not decompress: {e}"
                    ) from e
                if len(body) != chunk:
                    raise IntegrityError(
                        f"ZarrStore({self._url}): chunk {path} of key {key!r} decompressed to "
                        f"{len(body)} bytes, expected {chunk}"
                    )
            lo = i * chunk
            hi = min(lo + chunk, len(out))
            out[lo:hi] = np.frombuffer(body, dtype=np.uint8, count=hi - lo)

    def _verify(self, key: str, path: str, crc: int, stored: Any) -> None:
        if crc.to_bytes(4, "little") != bytes(stored):
            raise IntegrityError(
                f"ZarrStore({self._url}): checksum mismatch in chunk {path} of key {key!r}: "
                "the stored bytes are corrupted (crc32c)"
            )

    # ---------------------------------------------------------------- deletes
    def delete(self, key: str) -> None:
        with self._lock:
            entry = self._entry(key)
            del self._index[key]
            self._nbytes -= entry.meta.nbytes
            self._chunked_nbytes -= entry.chunk * entry.count
            self._log.record_delete(key)
            self._maybe_compact()
            unlink = self._keep_spares([entry])
        self._drop_runs(unlink)

    def delete_many(self, keys: Any) -> None:
        entries = []
        with self._lock:
            for key in keys:
                entry = self._index.pop(key, None) if isinstance(key, str) else None
                if entry is not None:
                    self._nbytes -= entry.meta.nbytes
                    self._chunked_nbytes -= entry.chunk * entry.count
                    self._log.record_delete(key)
                    entries.append(entry)
            self._maybe_compact()
            unlink = self._keep_spares(entries)
        self._drop_runs(unlink)

    def _maybe_compact(self) -> None:
        if self._log.needs_compaction(len(self._index)):
            self._log.snapshot({k: e.to_record() for k, e in self._index.items()})
            last = format(self._next_key - 1, "x")
            if self._next_key and last not in self._index:
                self._log.record_delete(last)  # keeps the key high-water mark in the journal

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

    def flush(self) -> None:
        """Persist the index where the backend cannot append (object stores)."""
        with self._lock:
            self._check_open()
            if not self._io.supports_append:
                self._log.snapshot({k: e.to_record() for k, e in self._index.items()})

    def _check_open(self) -> None:
        if self._closed:
            raise StoreUnavailableError(
                f"ZarrStore({self._url}) is closed; open a new store with tsh.open_store(...)"
            )

    def _cleanup_temp(self) -> None:
        if self._temporary:
            with contextlib.suppress(Exception):
                self._io.remove_tree("")

    def close(self) -> None:
        """Close the store. A temporary store deletes its directory; a namespace that
        holds no keys is removed so shared roots do not fill with empty writers."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            empty = not self._index
            spares = [
                p
                for (chunk, count), starts in self._spare.items()
                for start in starts
                for p in self._run_paths(chunk, start, count)
            ]
            self._spare.clear()
            self._spare_nbytes = 0
            with contextlib.suppress(Exception):
                if not empty and not self._io.supports_append:
                    self._log.snapshot({k: e.to_record() for k, e in self._index.items()})
            self._log.close()
        self._finalizer()
        if spares and not self._temporary and not empty:
            with contextlib.suppress(Exception):
                self._io.delete(spares)
        if not self._temporary and empty:
            with contextlib.suppress(Exception):
                self._io.remove_tree(self.namespace)
        self._io.close()


def _finalize(log: IndexLog, temp_dir: str | None) -> None:
    log.close()
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
