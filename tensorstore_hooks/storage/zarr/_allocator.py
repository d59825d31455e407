"""Where a tensor's chunks go: size classes, free runs and spare runs. Pure (no I/O).

A *run* is ``(chunk, start, count)``: ``count`` consecutive chunks of the size class
``chunk`` bytes, starting at chunk index ``start`` of that class's segment array.
:class:`ChunkAllocator` hands runs out and takes them back; the store does the I/O
and tells it what happened. See NOTE [ Segment layout ] and NOTE [ Spare chunk files ]
in ``storage/zarr/_store.py``. Not thread-safe: the store calls it under its lock.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping

from tensorstore_hooks.storage.zarr._options import MIN_CHUNK_BYTES

__all__ = ["MIN_CHUNK_BYTES", "SEGMENT_CHUNKS", "ChunkAllocator", "Run", "SegmentFullError"]

SEGMENT_CHUNKS = 1 << 32
"""Chunks per segment array: its shape is ``chunk * 2**32`` bytes."""

Run = tuple[int, int, int]
"""``(chunk size class in bytes, first chunk index, chunk count)``."""


class SegmentFullError(Exception):
    """A size class has handed out all of its ``SEGMENT_CHUNKS`` chunk indices."""


class ChunkAllocator:
    """Size classes, free lists and spares for one namespace.

    ``keep_spares``: keep freed runs' files for rewriting (the backend rewrites in
    place cheaply); ``spare_limit``: bytes of spares to keep (``None``: the peak of
    the live bytes so far). Byte figures count whole chunks (payload + padding).
    """

    def __init__(self, chunk_bytes: int, *, keep_spares: bool, spare_limit: int | None) -> None:
        self.classes = [
            chunk_bytes >> i
            for i in range(chunk_bytes.bit_length())
            if chunk_bytes >> i >= MIN_CHUNK_BYTES
        ]
        self._keep_spares = keep_spares
        self._spare_limit = spare_limit
        self._next: dict[int, int] = {}
        self._free: dict[tuple[int, int], list[int]] = {}
        # Freed runs whose files are kept, least recently freed size first.
        self._spare: dict[tuple[int, int], list[int]] = {}
        self.spare_bytes = 0
        """Bytes of spare runs (files on disk that belong to no key)."""
        self.live_bytes = 0
        """Bytes of runs handed out and not yet retired."""
        self.peak_bytes = 0
        """The most :attr:`live_bytes` has been."""

    # ----------------------------------------------------------------- layout
    def layout(self, n: int) -> tuple[int, int]:
        """(chunk size class, chunk count) for ``n`` payload bytes: the largest class
        whose padding is at most ``n / 8`` (NOTE [ Segment layout ])."""
        if n == 0:
            return 0, 0
        last = self.classes[-1]
        for c in self.classes:
            if c > n and c != last:
                continue
            count = -(-n // c)
            if (count * c - n) * 8 <= n or c == last:
                return c, count
        raise AssertionError("unreachable: the smallest class always fits")  # pragma: no cover

    # ------------------------------------------------------------- lifecycle
    def alloc(self, chunk: int, count: int) -> int:
        """A run of ``count`` chunks of class ``chunk``: a spare (its files exist and are
        rewritten), else a free run, else new indices. Returns its start."""
        size = chunk * count
        start = self._take(self._spare, chunk, count)
        if start is not None:
            self.spare_bytes -= size
        else:
            start = self._take(self._free, chunk, count)
        if start is None:
            start = self._next.get(chunk, 0)
            if start + count > SEGMENT_CHUNKS:
                raise SegmentFullError(f"segment seg-{chunk} is full")
            self._next[chunk] = start + count
        self.live_bytes += size
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return start

    def cancel(self, run: Run) -> None:
        """A run from :meth:`alloc` that was never used (its write failed and its files
        were deleted): back on the free list."""
        self.live_bytes -= run[0] * run[2]
        self.release([run])

    def abandon(self, run: Run) -> None:
        """A run from :meth:`alloc` that was never used but whose objects may still
        change (a write of unknown outcome): never handed out again."""
        self.live_bytes -= run[0] * run[2]

    def retire(self, runs: Iterable[Run]) -> list[Run]:
        """Runs of deleted keys. Keeps what fits as spares (the newest freed: a loop
        re-saves what it just freed, so the least recently freed sizes make room) and
        returns the runs whose files the caller must delete, then :meth:`release`."""
        unlink: list[Run] = []
        limit = self.peak_bytes if self._spare_limit is None else self._spare_limit
        for chunk, start, count in runs:
            if not count:
                continue
            size = chunk * count
            self.live_bytes -= size
            if not self._keep_spares or size > limit:
                unlink.append((chunk, start, count))
                continue
            while self.spare_bytes + size > limit:
                unlink.append(self._evict_spare())
            starts = self._spare.pop((chunk, count), [])  # re-inserted last: newest
            starts.append(start)
            self._spare[(chunk, count)] = starts
            self.spare_bytes += size
        return unlink

    def release(self, runs: Iterable[Run]) -> None:
        """Runs whose files are gone: free for the next :meth:`alloc`."""
        for chunk, start, count in runs:
            if count:
                self._free.setdefault((chunk, count), []).append(start)

    def drain_spares(self) -> list[Run]:
        """Every spare run (to delete their files, e.g. at close or on a full disk);
        the caller deletes the files and then calls :meth:`release`."""
        runs = [(c, s, n) for (c, n), starts in self._spare.items() for s in starts]
        self._spare.clear()
        self.spare_bytes = 0
        return runs

    def _evict_spare(self) -> Run:
        (chunk, count), starts = next(iter(self._spare.items()))
        start = starts.pop(0)
        if not starts:
            del self._spare[(chunk, count)]
        self.spare_bytes -= chunk * count
        return chunk, start, count

    @staticmethod
    def _take(pool: dict[tuple[int, int], list[int]], chunk: int, count: int) -> int | None:
        starts = pool.get((chunk, count))
        if not starts:
            return None
        start = starts.pop()
        if not starts:
            del pool[(chunk, count)]
        return start

    # ----------------------------------------------------------------- resume
    def resume(self, runs: Mapping[str, Run], order: Mapping[str, int]) -> list[str]:
        """Take over the runs of replayed keys; returns the keys dropped.

        Live keys never share a chunk, so two replayed runs that overlap mean the
        older key was deleted and its delete record lost (damage): its chunks now hold
        the newer key's bytes. The newer key (higher ``order``) keeps them and the
        older is dropped, so it can never be read as another tensor. Gaps between the
        resumed runs are not reused (their files, if any, belong to no key).
        """
        taken: dict[int, list[tuple[int, int]]] = {}  # per class: sorted (start, end)
        dropped: list[str] = []
        for key in sorted(runs, key=lambda k: order[k], reverse=True):
            chunk, start, count = runs[key]
            if not count:
                continue
            mine = taken.setdefault(chunk, [])
            i = bisect.bisect_left(mine, (start, start + count))
            if (i > 0 and mine[i - 1][1] > start) or (i < len(mine) and mine[i][0] < start + count):
                dropped.append(key)
                continue
            mine.insert(i, (start, start + count))
            self.live_bytes += chunk * count
            self._next[chunk] = max(self._next.get(chunk, 0), start + count)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return dropped
