"""Page-aligned host buffers for direct I/O, pooled and counted.

NOTE [ Aligned buffers ]
``O_DIRECT`` moves bytes between the disk and the caller's memory without the page
cache, so that memory must be aligned (the buffer's address, its length and the file
offset: 512 bytes on this machine's virtual disk, 4 KiB on many; :data:`BLOCK_BYTES`
covers both). A torch CPU tensor is 64-byte aligned, never page-aligned: a write goes
from its own memory anyway (its bytes are stored rotated, NOTE [ Chunk objects ] in
``storage/zarr/_chunkcodec.py``), and a read lands in an aligned buffer that *becomes* the
returned tensor's storage (no copy). Rules:

1. A buffer is an anonymous private ``mmap``: page-aligned by the kernel, its own
   pages (``MAP_PRIVATE``: a forked child writing it never touches the parent's), and
   unmapped when the last reference goes. Buffers of at least :data:`HUGE_BYTES` are
   advised ``MADV_HUGEPAGE`` over the whole huge pages they hold from their *origin*
   (offset ``front``, 0 or one block: where a direct read lands) on: the mapping is
   2 MiB larger than the buffer (address space only) so that the origin can sit on
   a 2 MiB boundary, and the bytes before the origin and after the last whole huge
   page stay small pages (a huge page there would charge 2 MiB for a few KiB; a
   buffer of 8 MiB + 4 KiB placed anywhere else would hold three huge pages, not
   four). Measured here (8 MiB): first touch of fresh 4 KiB pages costs 4.9 ms of
   CPU (virtualised page faults), of huge pages 0.37 ms; an ``O_DIRECT`` read into 4
   KiB pages takes 7.3 ms and 0.5 ms of CPU, into huge pages 2.9 ms and 0.1 ms
   (fewer, larger DMA segments, fewer pages to pin).
2. Below :data:`POOL_MIN_BYTES` a buffer is an aligned slice of an ordinary numpy
   allocation (the C heap reuses it for free; an ``mmap`` per small tensor would
   cost a system call and a mapping each) and is never pooled.
3. A pooled buffer is *acquired* (a write's copy buffer: the caller gives it back with
   :meth:`BufferPool.release`) or *lent* (:meth:`BufferPool.lend`: an ndarray over
   it, e.g. a tensor's storage, whose death gives the buffer back). Lending hangs a
   ``weakref.finalize`` on a ctypes array that exports the memory: every ndarray,
   view and tensor made from the lent array keeps that exporter alive, so the
   buffer returns only when nothing can reach its bytes any more.
4. Idle buffers are kept by capacity and origin, at most ``idle_limit_bytes`` of
   them; beyond that the least recently returned are unmapped. A request takes an
   idle buffer of its exact capacity, else the smallest idle one of the same origin
   up to :data:`REUSE_SLACK` times as large, unless buffers of its very size exist
   (a fixed-shape loop asks for the same sizes every step: each gets buffers of its
   own, and after the first step nothing is allocated; under dynamic padding
   every step's sizes differ a little, and exact matches alone would fill the idle
   pool with last steps' sizes that never come back, held for nothing).
   Lent and acquired buffers are not bounded here: whoever holds them
   bounds them (the pipeline's windows). :attr:`BufferPool.stats` says what is
   held, idle and lent, so a caller can count it in its budgets.
5. Idle buffers keep their pages only while reads go on: :meth:`BufferPool.park`
   hands the pages of the idle buffers back to the OS (``MADV_DONTNEED``; the
   mapping and its huge-page advice stay) and a store calls it before each write;
   only buffers idle for :data:`PARK_AFTER_S` or more, and only after a loan. In a
   training loop that is the start of forward: the read buffers backward left idle
   would otherwise sit in RSS through the whole forward, at its peak (the design's
   CPU step: the prefetch window, 131 MiB, 6% of no offloading's activation
   memory), to save their refaults in the next backward, which cost one fault per
   huge page (0.37 ms of CPU per 8 MiB, rule 1).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from tensorstore_hooks._codec import Buffer

__all__ = [
    "BLOCK_BYTES",
    "HUGE_BYTES",
    "PAGE_BYTES",
    "POOL_MIN_BYTES",
    "REUSE_SLACK",
    "AlignedBuffer",
    "BufferPool",
    "PoolStats",
    "address_of",
    "aligned_empty",
    "round_up",
]

PAGE_BYTES = mmap.PAGESIZE
"""The memory page size; every buffer here starts on a page boundary."""
BLOCK_BYTES = 4096
"""The alignment direct I/O uses for addresses, lengths and offsets (rule 1)."""
HUGE_BYTES = 2 << 20
"""Buffers at least this large are advised to use transparent huge pages (rule 1)."""
POOL_MIN_BYTES = 256 << 10
"""Smaller buffers come from the C heap and are not pooled (rule 2)."""

PARK_AFTER_S = 0.5
""":meth:`BufferPool.park` leaves idle buffers that came back more recently than this
(rule 5): a store alternating puts and gets (milliseconds apart) takes them again
before they would be parked; a forward's later writes park the ones its first
write found too recent (a step lasts seconds)."""

REUSE_SLACK = 1.5
"""An idle buffer up to this many times the requested capacity serves a request that
has no exact match (rule 4): the spare tail it lends is memory the buffer already
held, and at most a third of it."""

_PRIVATE = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)


def round_up(n: int, to: int = BLOCK_BYTES) -> int:
    """``n`` rounded up to a multiple of ``to``."""
    return -(-n // to) * to


def address_of(buf: Buffer | mmap.mmap) -> int:
    """The address of a writable or read-only buffer's first byte."""
    arr = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf
    return int(arr.__array_interface__["data"][0])


def aligned_empty(nbytes: int, align: int = PAGE_BYTES) -> np.ndarray:
    """A 1-D uint8 array of ``round_up(nbytes, align)`` bytes (at least ``align``)
    starting on an ``align`` boundary, from the C heap (rule 2)."""
    span = round_up(max(nbytes, 1), align)
    raw = np.empty(span + align, dtype=np.uint8)
    skip = -address_of(raw) % align
    return raw[skip : skip + span]


class AlignedBuffer:
    """One page-aligned region of ``capacity`` bytes (an anonymous private mmap) whose
    offset ``front`` (a multiple of the page size, below ``capacity``) is its origin:
    on a huge page boundary where the buffer is large enough to use huge pages
    (rule 1)."""

    __slots__ = ("__weakref__", "_mm", "_start", "capacity", "front", "view")

    def __init__(self, capacity: int, front: int = 0) -> None:
        if capacity <= 0:
            raise ValueError(f"AlignedBuffer: capacity must be > 0, got {capacity}")
        if front < 0 or front % PAGE_BYTES or front >= capacity:
            raise ValueError(f"AlignedBuffer: bad front {front} for capacity {capacity}")
        self.capacity = capacity
        self.front = front
        advice = _MADV_HUGEPAGE if capacity - front >= HUGE_BYTES else None
        size = capacity + (HUGE_BYTES if advice is not None else 0)
        self._mm = mmap.mmap(-1, size, flags=_PRIVATE) if _PRIVATE else mmap.mmap(-1, size)
        self._start = 0
        if advice is not None:
            origin = -(address_of(self._mm) + front) % HUGE_BYTES
            self._start = origin
            whole = (capacity - front) // HUGE_BYTES * HUGE_BYTES
            with contextlib.suppress(OSError):  # a kernel without THP: plain pages
                self._mm.madvise(advice, origin + front, whole)
        self.view = memoryview(self._mm)[self._start : self._start + capacity]
        """The whole region, writable, format ``B``."""

    def drop_pages(self) -> None:
        """Hand the region's pages back to the OS, keeping the mapping (and its huge
        page advice): the next touch faults in zeroed pages (rule 5)."""
        with contextlib.suppress(OSError, ValueError):  # no MADV_DONTNEED: keep them
            self._mm.madvise(mmap.MADV_DONTNEED, self._start, self.capacity)

    def exporter(self) -> ctypes.Array[ctypes.c_ubyte]:
        """A new ctypes array over the whole region (keeps the mapping alive)."""
        return (ctypes.c_ubyte * self.capacity).from_buffer(self._mm, self._start)


@dataclass(frozen=True, slots=True)
class PoolStats:
    """What a :class:`BufferPool` holds, in bytes of buffer capacity."""

    held_bytes: int
    """Every pooled buffer that exists: idle + in use."""
    idle_bytes: int
    """Buffers waiting in the pool (memory no tensor and no I/O uses right now)."""
    in_use_bytes: int
    """Buffers lent (tensor storage) or acquired (a write's copy buffer) right now."""
    peak_held_bytes: int
    """The most :attr:`held_bytes` has been."""
    idle_limit_bytes: int
    """The most idle bytes the pool keeps."""
    allocations: int
    """Buffers mapped so far (flat after the first step of a steady loop)."""
    reuses: int
    """Requests served by an idle buffer."""
    resident_idle_bytes: int = 0
    """Idle buffers whose pages are still resident (not handed back by
    :meth:`BufferPool.park` since they were last used)."""


class BufferPool:
    """Page-aligned buffers by exact capacity (NOTE [ Aligned buffers ]). Thread-safe."""

    def __init__(self, idle_limit_bytes: int) -> None:
        if idle_limit_bytes < 0:
            raise ValueError(f"BufferPool: idle_limit_bytes must be >= 0, got {idle_limit_bytes}")
        self.idle_limit_bytes = idle_limit_bytes
        self._lock = threading.Lock()
        self._idle: dict[tuple[int, int], list[AlignedBuffer]] = {}  # (capacity, front)
        self._lru: OrderedDict[int, AlignedBuffer] = OrderedDict()  # id -> buffer, oldest first
        self._idle_bytes = 0
        self._in_use_bytes = 0
        self._peak = 0
        self._allocations = 0
        self._reuses = 0
        self._closed = False
        self._mapped: dict[tuple[int, int], int] = {}  # buffers that exist, per size
        self._parked: set[int] = set()  # ids of idle buffers whose pages were handed back
        self._lent = False  # idle buffers may still hold pages park() would take
        self._since: dict[int, float] = {}  # id -> monotonic time it came back

    # ------------------------------------------------------------ acquiring
    def acquire(self, nbytes: int, front: int = 0) -> AlignedBuffer:
        """A buffer of at least ``round_up(nbytes, PAGE_BYTES)`` bytes (an idle one of
        up to :data:`REUSE_SLACK` times that, rule 4) whose origin is at ``front``
        (rule 1); give it back with :meth:`release`. Its contents are whatever it
        last held."""
        capacity = round_up(max(nbytes, 1), PAGE_BYTES)
        with self._lock:
            buf = self._take_idle(capacity, front)
            if buf is not None:
                self._reuses += 1
                self._in_use_bytes += buf.capacity
                return buf
            self._allocations += 1
            self._count_mapped(capacity, front, 1)
            self._in_use_bytes += capacity
            self._peak = max(self._peak, self._in_use_bytes + self._idle_bytes)
        try:
            return AlignedBuffer(capacity, front)
        except BaseException:
            with self._lock:
                self._in_use_bytes -= capacity
                self._count_mapped(capacity, front, -1)
            raise

    def _count_mapped(self, capacity: int, front: int, n: int) -> None:
        """Under the lock: ``n`` more (or fewer) buffers of this size exist."""
        key = (capacity, front)
        left = self._mapped.get(key, 0) + n
        if left:
            self._mapped[key] = left
        else:
            self._mapped.pop(key, None)

    def _take_idle(self, capacity: int, front: int) -> AlignedBuffer | None:
        """Under the lock: the idle buffer a request of ``capacity`` bytes at
        ``front`` takes (rule 4), unlinked from the idle set, or ``None``."""
        key = (capacity, front)
        if not self._idle.get(key):
            if self._mapped.get(key):  # buffers of this very size exist: map one more
                return None
            limit = int(capacity * REUSE_SLACK)
            fits = [
                c for (c, f), b in self._idle.items() if f == front and capacity < c <= limit and b
            ]
            if not fits:
                return None
            key = (min(fits), front)
        bucket = self._idle[key]
        buf = bucket.pop()
        if not bucket:
            del self._idle[key]
        del self._lru[id(buf)]
        del self._since[id(buf)]
        self._parked.discard(id(buf))
        self._idle_bytes -= buf.capacity
        return buf

    def _unlink_oldest(self) -> AlignedBuffer:
        """Under the lock: unlink the least recently returned idle buffer."""
        _, buf = self._lru.popitem(last=False)
        del self._since[id(buf)]
        self._parked.discard(id(buf))
        key = (buf.capacity, buf.front)
        self._idle[key].remove(buf)
        if not self._idle[key]:
            del self._idle[key]
        self._idle_bytes -= buf.capacity
        self._count_mapped(buf.capacity, buf.front, -1)
        return buf

    def release(self, buf: AlignedBuffer) -> None:
        """Give back a buffer from :meth:`acquire`."""
        dropped: list[AlignedBuffer] = []
        with self._lock:
            self._in_use_bytes -= buf.capacity
            if self._closed or buf.capacity > self.idle_limit_bytes:
                dropped.append(buf)
                self._count_mapped(buf.capacity, buf.front, -1)
            else:
                self._idle.setdefault((buf.capacity, buf.front), []).append(buf)
                self._lru[id(buf)] = buf
                self._since[id(buf)] = time.monotonic()
                self._idle_bytes += buf.capacity
                dropped = self._trim()
        del dropped  # unmapped as the last references go, outside the lock

    def _trim(self) -> list[AlignedBuffer]:
        """Under the lock: unlink the least recently returned idle buffers over the limit."""
        out = []
        while self._idle_bytes > self.idle_limit_bytes and self._lru:
            out.append(self._unlink_oldest())
        return out

    # ---------------------------------------------------------------- lending
    def lend(self, nbytes: int, lead: int = 0) -> tuple[np.ndarray, memoryview]:
        """A writable 1-D uint8 array of ``nbytes``, and a writable view of the
        ``round_up(nbytes, BLOCK_BYTES)`` bytes of aligned memory a direct read fills.

        ``lead == 0``: both start on the same page boundary. ``0 < lead <
        BLOCK_BYTES``: the region starts on the buffer's second block and the array
        ``lead`` bytes before it (so the array's address is ``-lead`` modulo 4 KiB:
        the address alignment of a tensor whose bytes were stored rotated by
        ``lead``, NOTE [ Chunk objects ] in ``storage/zarr/_chunkcodec.py``); the region's last
        ``lead`` payload bytes are then the caller's to move to the array's start.

        At least :data:`POOL_MIN_BYTES`, the memory is a pooled buffer that comes back
        to the pool when nothing references the array, anything made from it, or the
        view (rule 3); below, heap memory (rule 2).
        """
        if not 0 <= lead < BLOCK_BYTES:
            raise ValueError(f"BufferPool.lend: lead must be in [0, {BLOCK_BYTES}), got {lead}")
        front = BLOCK_BYTES if lead else 0
        span = round_up(max(nbytes, 1), BLOCK_BYTES)
        if nbytes < POOL_MIN_BYTES:
            whole = aligned_empty(front + span)
        else:
            self._lent = True
            buf = self.acquire(front + span, front)
            holder = buf.exporter()
            weakref.finalize(holder, self.release, buf).atexit = False
            whole = np.frombuffer(memoryview(holder), dtype=np.uint8)
        start = front - lead
        return whole[start : start + nbytes], whole.data[front : front + span]

    # ------------------------------------------------------------------ state
    @property
    def stats(self) -> PoolStats:
        with self._lock:
            return PoolStats(
                held_bytes=self._idle_bytes + self._in_use_bytes,
                idle_bytes=self._idle_bytes,
                in_use_bytes=self._in_use_bytes,
                peak_held_bytes=self._peak,
                idle_limit_bytes=self.idle_limit_bytes,
                allocations=self._allocations,
                reuses=self._reuses,
                resident_idle_bytes=self._idle_bytes
                - sum(self._lru[k].capacity for k in self._parked),
            )

    def park(self) -> int:
        """Hand back the pages of the idle buffers that came back at least
        :data:`PARK_AFTER_S` ago, keeping the buffers (rule 5); returns the bytes
        handed back. Cheap when nothing was lent since every idle buffer was parked
        (one attribute read)."""
        if not self._lent:
            return 0
        now = time.monotonic()
        with self._lock:
            dropped = 0
            young = False
            # Under the lock: a buffer acquired meanwhile must not lose its bytes.
            for key, buf in self._lru.items():  # oldest first
                if key in self._parked:
                    continue
                if now - self._since[key] < PARK_AFTER_S:
                    young = True
                    break
                buf.drop_pages()
                self._parked.add(key)
                dropped += buf.capacity
            self._lent = young
            return dropped

    def set_idle_limit(self, idle_limit_bytes: int) -> None:
        """Change how many idle bytes are kept (trims at once if lower)."""
        if idle_limit_bytes < 0:
            raise ValueError(f"BufferPool: idle_limit_bytes must be >= 0, got {idle_limit_bytes}")
        with self._lock:
            self.idle_limit_bytes = idle_limit_bytes
            dropped = self._trim()
        del dropped

    def close(self) -> None:
        """Unmap every idle buffer; buffers in use are unmapped when they come back."""
        with self._lock:
            self._closed = True
            for buf in self._lru.values():
                self._count_mapped(buf.capacity, buf.front, -1)
            self._lru.clear()
            self._since.clear()
            self._parked.clear()
            self._idle.clear()
            self._idle_bytes = 0
