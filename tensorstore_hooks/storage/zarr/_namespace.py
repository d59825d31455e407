"""One ZarrStore namespace's keys: key -> entry, where their chunks go, and the journal.

:class:`NamespaceIndex` is the state a :class:`~tensorstore_hooks.ZarrStore` keeps
about its namespace and the one lock that guards it: the live entries (key -> run +
checksums + rotation + metadata), the next key, the
:class:`~tensorstore_hooks.storage.zarr._allocator.ChunkAllocator` (size classes, free runs,
spares), the segment arrays made so far and the persisted index
(:class:`~tensorstore_hooks.storage.zarr._index.IndexLog`: replay on open, a record per put and
delete, compaction). It does no chunk I/O: the store moves the bytes outside the
lock and reports back (``reserve`` -> write -> ``commit`` or ``cancel``).
See docs/layout.md ("The index") for the entry format.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from zarr.abc.codec import BytesBytesCodec

from tensorstore_hooks._codec import TensorMeta
from tensorstore_hooks.errors import (
    IntegrityError,
    KeyNotFoundError,
    StoreClosedError,
    StoreUnavailableError,
    TensorStoreError,
)
from tensorstore_hooks.storage.io import BLOCK_BYTES, ChunkIO
from tensorstore_hooks.storage.zarr._allocator import (
    SEGMENT_CHUNKS,
    ChunkAllocator,
    Run,
    SegmentFullError,
)
from tensorstore_hooks.storage.zarr._docs import damaged_doc_advice, ensure_doc, segment_doc
from tensorstore_hooks.storage.zarr._index import HEADER_BYTES, Damage, IndexEntry, IndexLog

__all__ = ["Entry", "NamespaceIndex"]

log = logging.getLogger("tensorstore_hooks")


@dataclass(frozen=True, slots=True)
class Entry:
    """Where one key's payload is and how to check it (docs/layout.md, "The index")."""

    chunk: int
    """Chunk size class (bytes); 0 for an empty payload."""
    start: int
    """First chunk index in that class's segment."""
    count: int
    """Number of chunks."""
    crc: bytes
    """crc32c of each chunk, 4 bytes each: NOTE [ Bound chunk checksums ]."""
    meta: TensorMeta
    rot: int = 0
    """The stored stream is the payload rotated left by this many bytes (NOTE [ Chunk
    objects ] rule 4 in ``storage/zarr/_chunkcodec.py``)."""

    @property
    def run(self) -> Run:
        return self.chunk, self.start, self.count

    def to_record(self) -> IndexEntry:
        return {
            "seg": self.chunk,
            "start": self.start,
            "count": self.count,
            "crc": self.crc,
            "rot": self.rot,
            "meta": self.meta.to_dict(),
        }

    @classmethod
    def from_record(cls, rec: IndexEntry) -> Entry:
        """Validate an entry read from an index file (``IntegrityError`` if malformed)."""
        try:
            chunk, start, count = rec["seg"], rec["start"], rec["count"]
            crcs, meta, rot = rec["crc"], rec["meta"], rec.get("rot", 0)
        except (KeyError, TypeError, AttributeError) as e:
            raise IntegrityError(f"index entry is malformed: {rec!r:.200}") from e
        if not (
            isinstance(chunk, int)
            and isinstance(start, int)
            and isinstance(count, int)
            and min(chunk, start, count) >= 0
        ):
            raise IntegrityError(f"index entry has bad extents: {rec!r:.200}")
        if not isinstance(crcs, bytes) or len(crcs) != 4 * count:
            raise IntegrityError(f"index entry has bad chunk checksums: {rec!r:.200}")
        entry = cls(chunk, start, count, crcs, TensorMeta.from_dict(meta), 0)
        if not (isinstance(rot, int) and 0 <= rot < BLOCK_BYTES and rot <= entry.meta.nbytes):
            raise IntegrityError(f"index entry has a bad rotation {rot!r}: {rec!r:.200}")
        return cls(chunk, start, count, crcs, entry.meta, rot)


class NamespaceIndex:
    """The keys of one namespace and their chunks' places. Thread-safe (one lock).

    ``url`` and ``namespace`` name it in messages; ``chunk_bytes`` is the largest size
    class; ``keep_spares`` / ``spare_limit`` as in
    :class:`~tensorstore_hooks.storage.zarr._allocator.ChunkAllocator`. Call :meth:`resume` once to
    replay what the namespace holds.
    """

    def __init__(
        self,
        io: ChunkIO,
        url: str,
        namespace: str,
        chunk_bytes: int,
        *,
        spare_limit: int | None,
    ) -> None:
        self._io = io
        self._url = url
        self.namespace = namespace
        self._lock = threading.Lock()
        self._docs_lock = threading.Lock()  # the zarr.json documents (rarely written)
        self._entries: dict[str, Entry] = {}
        self._nbytes = 0
        self._next_key = 0
        self._alloc = ChunkAllocator(
            chunk_bytes, keep_spares=io.supports_rewrite_in_place, spare_limit=spare_limit
        )
        self._segments_made: set[int] = set()
        self.log = IndexLog(io, f"{namespace}/index")
        self.damage: list[Damage] = []
        """What replaying the index found damaged (empty when all was well)."""
        self.closed = False
        """No put or get any more (deletes go on while a close waits for pipelines)."""
        self._users = 0  # offload pipelines writing here: NOTE [ Closed while in use ]
        self._close_pending = False
        self._finished = False  # close() ran
        self.root_doc: bytes | None = None
        """The root's ``zarr.json``, written at the first put (the store sets it)."""
        self.root_doc_written = False  # a store that never stored anything leaves no file

    # ----------------------------------------------------------------- replay
    def resume(self) -> None:
        """Replay the namespace's index: its live entries and their runs are taken."""
        records = self.log.load()
        # Keys are never reused, not even deleted ones: a stale key must miss, not
        # return another tensor. Deleted keys count, and so does every key the damage
        # could have hidden (NOTE [ Journal records ] in storage/zarr/_index.py).
        order: dict[str, int] = {}
        for key in [*self.log.retired_keys, *records]:
            with contextlib.suppress(ValueError):
                order[key] = int(key, 16)
                self._next_key = max(self._next_key, order[key] + 1)
        if self.log.damage:
            self._next_key += self.log.damaged_bytes // HEADER_BYTES + 1
        entries = {key: Entry.from_record(rec) for key, rec in records.items()}
        dropped = self._alloc.resume(
            {k: e.run for k, e in entries.items()}, {k: order.get(k, -1) for k in entries}
        )
        if dropped:
            # Their delete records were lost (damage, or a crash while the disk was full).
            log.warning(
                "ZarrStore(%s): namespace %r: %d deleted key(s) whose delete record was "
                "lost reappeared on replay and were dropped (their chunks belong to newer "
                "keys)",
                self._url,
                self.namespace,
                len(dropped),
            )
        for key in dropped:
            del entries[key]
        self.damage = list(self.log.damage)
        for key, entry in entries.items():
            self._entries[key] = entry
            self._nbytes += entry.meta.nbytes
            if entry.count:
                self._segments_made.add(entry.chunk)

    # ------------------------------------------------------------------- puts
    def reserve(self, n: int) -> tuple[str, Run]:
        """A new key and a run for ``n`` payload bytes (NOTE [ Segment layout ])."""
        chunk, count = self._alloc.layout(n)
        with self._lock:
            self.check_open()
            key = format(self._next_key, "x")
            self._next_key += 1
            try:
                start = self._alloc.alloc(chunk, count) if count else 0
            except SegmentFullError as e:
                raise StoreUnavailableError(f"ZarrStore({self._url}): {e}") from None
        return key, (chunk, start, count)

    def ensure_root_doc(self) -> None:
        """The root's ``zarr.json``, where missing: written at the first put, so a store
        that never stored anything leaves no file at its root. One that cannot be
        parsed is left as it is and reported once (a ``RuntimeWarning``): the store
        goes on, only plain zarr and ``inspect`` need it."""
        if self.root_doc_written or self.root_doc is None:
            return
        with self._docs_lock:  # documents are written outside the index lock
            if not self.root_doc_written:
                self._ensure_doc("zarr.json", self.root_doc, replace=False, what="the root")
                self.root_doc_written = True

    def ensure_segment(self, chunk: int, compressors: list[BytesBytesCodec]) -> None:
        """The segment array document of size class ``chunk``: written where missing or
        different (atomically), once per store object; one that cannot be parsed is
        left as it is and reported once."""
        if chunk in self._segments_made:
            return
        with self._docs_lock:
            if chunk in self._segments_made:
                return
            doc = segment_doc(chunk, SEGMENT_CHUNKS, compressors)
            path = f"{self.segment_path(chunk)}/zarr.json"
            self._ensure_doc(path, doc, replace=True, what=f"the segment array seg-{chunk}")
            self._segments_made.add(chunk)

    def _ensure_doc(self, path: str, doc: bytes, *, replace: bool, what: str) -> None:
        damaged = ensure_doc(self._io, path, doc, replace=replace)
        if damaged is None:
            return
        warnings.warn(
            f"ZarrStore({self._url}): {path} cannot be parsed ({damaged}): plain zarr and "
            f"`tensorstore-hooks inspect` cannot open {what} until it is restored, while "
            f"this store goes on storing and reading tensors; {damaged_doc_advice(self._io, path)}",
            RuntimeWarning,
            stacklevel=2,
        )

    def commit(self, key: str, entry: Entry) -> None:
        """Journal ``entry`` under ``key``, then make it readable. Raises a
        TensorStoreError if the record could not be written (nothing changed)."""
        with self._lock:
            self.check_open()
            # Journaled before it is acknowledged: a put whose record could not be
            # written is not stored (NOTE [ Journal records ] in storage/zarr/_index.py).
            self.log.record_put(key, entry.to_record())
            self._entries[key] = entry
            self._nbytes += entry.meta.nbytes

    def cancel(self, run: Run, *, uncertain: bool = False) -> None:
        """A reserved run whose write failed (its files deleted): free for reuse, or
        never handed out again if a request on it may still land (``uncertain``:
        NOTE [ Requests that land late ] in ``storage/zarr/_store.py``)."""
        with self._lock:
            if uncertain:
                self._alloc.abandon(run)
            else:
                self._alloc.cancel(run)

    # ------------------------------------------------------------------- reads
    def entry(self, key: object, *, deleting: bool = False) -> Entry:
        """``key``'s entry; ``KeyNotFoundError`` if absent, ``StoreClosedError`` if closed."""
        self.check_open(deleting)
        found = self._entries.get(key) if isinstance(key, str) else None
        if found is None:
            raise KeyNotFoundError(
                f"ZarrStore({self._url}): no key {key!r} in namespace {self.namespace!r} "
                "(never written, already deleted, or written by another store object)"
            )
        return found

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    @property
    def nbytes(self) -> int:
        """Payload bytes of the live keys."""
        return self._nbytes

    def segment_path(self, chunk: int) -> str:
        return f"{self.namespace}/seg-{chunk}"

    def run_paths(self, run: Run) -> list[str]:
        chunk, start, count = run
        seg = self.segment_path(chunk)
        return [f"{seg}/c/{start + i}" for i in range(count)]

    # ----------------------------------------------------------------- deletes
    def forget(self, keys: Iterable[object], *, missing_ok: bool) -> list[Run]:
        """Drop ``keys`` from the index and the journal; returns the runs whose files
        the caller must delete (outside any lock) and then :meth:`release`.
        ``missing_ok=False``: a key that is absent raises ``KeyNotFoundError``."""
        with self._lock:
            self.check_open(deleting=True)
            found: list[tuple[str, Entry]] = []
            for key in keys:
                if isinstance(key, str) and (entry := self._entries.get(key)) is not None:
                    found.append((key, entry))
                elif not missing_ok:
                    self.entry(key, deleting=True)  # raises KeyNotFoundError naming it
            for key, entry in found:
                del self._entries[key]
                self._nbytes -= entry.meta.nbytes
                self.log.record_delete(key)  # never raises: deferred if the disk is full
            self._maybe_compact()
            return self._alloc.retire(e.run for _, e in found)

    def release(self, runs: list[Run]) -> None:
        """Runs whose files are gone: free for the next put."""
        with self._lock:
            self._alloc.release(runs)

    def drain_spares(self) -> list[Run]:
        """Every spare run (the disk is full: their files are free space); delete
        their files, then :meth:`release`."""
        with self._lock:
            return self._alloc.drain_spares()

    def _maybe_compact(self) -> None:
        if not self.log.needs_compaction(len(self._entries)):
            return
        try:
            self._compact()
        except TensorStoreError as e:
            # The journal is untouched and still the truth; try again at the next delete.
            log.warning("ZarrStore(%s): compacting the index failed: %s", self._url, e)

    def _compact(self) -> None:
        self.log.snapshot({k: e.to_record() for k, e in self._entries.items()})
        last = format(self._next_key - 1, "x")
        if self._next_key and last not in self._entries:
            self.log.record_delete(last)  # keeps the key high-water mark in the journal

    def compact_index(self) -> None:
        """Rewrite the index as a snapshot of the live keys now (see
        ``ZarrStore.compact_index``)."""
        with self._lock:
            self.check_open()
            self._compact()

    # --------------------------------------------------------------- lifecycle
    def flush(self) -> None:
        """Persist the index where the backend cannot append (object stores)."""
        with self._lock:
            self.check_open()
            if not self._io.supports_append:
                self.log.snapshot({k: e.to_record() for k, e in self._entries.items()})

    def check_open(self, deleting: bool = False) -> None:
        if self.closed and not (deleting and self._close_pending):
            raise StoreClosedError(
                f"ZarrStore({self._url}) is closed; open a new store with tsh.open_store(...)"
            )

    def begin_close(self) -> bool:
        """Refuse puts and gets from now on. True: the caller finishes the close now
        (:meth:`close`); False: already closed, or pipelines still use the store and
        the close finishes when the last one is done or no key is left (NOTE [ Closed
        while in use ] in ``storage/zarr/_store.py``)."""
        with self._lock:
            if self.closed:
                return False
            self.closed = True
            if self._users:
                self._close_pending = True
                return False
            return True

    def use(self, on_last: Callable[[], None]) -> Callable[[], None]:
        """A pipeline writes here; the result (idempotent) says it is done, and calls
        ``on_last`` if it was the last one a pending close waited for."""
        with self._lock:
            self.check_open()
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
                on_last()

        return unuse

    def drained(self) -> bool:
        """Whether a close waiting for pipelines' deletes may finish now: no key is left
        (True once)."""
        with self._lock:
            drained = self._close_pending and not self._entries
            if drained:
                self._close_pending = False
            return drained

    def close(self) -> tuple[bool, list[Run]] | None:
        """Finish closing (idempotent: ``None`` the second time). Persists the index
        where the backend cannot append and closes the journal; returns whether the
        namespace holds no keys and the spare runs whose files the caller deletes."""
        with self._lock:
            if self._finished:
                return None
            self._finished = True
            self.closed = True
            empty = not self._entries
            spares = self._alloc.drain_spares()
            if not empty and not self._io.supports_append:
                self._persist_at_close()
            self.log.close()
        return empty, spares

    def _persist_at_close(self) -> None:
        """The index of an object store, written at close; a failure is said (its keys
        cannot be resumed by a later store), never raised from ``close()``."""
        try:
            self.log.snapshot({k: e.to_record() for k, e in self._entries.items()})
        except Exception as e:
            log.warning(
                "ZarrStore(%s): namespace %r: writing its index at close failed (%s); the "
                "%d key(s) it holds were not persisted, so a store that reopens this "
                "namespace will not find those stored since the last flush()",
                self._url,
                self.namespace,
                e,
                len(self._entries),
            )

    def spare_stats(self) -> tuple[int, int]:
        """(bytes of spare runs, peak live bytes): for tests and ``inspect``."""
        with self._lock:
            return self._alloc.spare_bytes, self._alloc.peak_bytes
