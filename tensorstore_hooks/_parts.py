"""What a session's pipeline units share: its record table, store, counters and threads."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ._device import DeviceStager
from ._heap import HeapReleaser
from ._iopool import IOPool
from ._records import RecordTable
from ._stats import OffloadStats
from ._store import TensorStore

__all__ = ["PipelineUnit", "SessionParts"]


@dataclass(frozen=True, slots=True)
class SessionParts:
    """One session's shared parts, made by ``OffloadSession`` and handed to each unit."""

    table: RecordTable
    """The records, and the lock every unit takes to read or change them."""
    store: TensorStore
    stats: OffloadStats
    stager: DeviceStager
    """CUDA tensors to and from pinned host memory."""
    io: Callable[[], IOPool]
    """The store's I/O pool (made on first use, remade after a shutdown)."""
    heap: HeapReleaser
    """Told of every byte the I/O threads move (NOTE [ Heap release ])."""


class PipelineUnit:
    """Base of the write-behind and the prefetcher: the shared parts as attributes."""

    def __init__(self, parts: SessionParts) -> None:
        self._table = parts.table
        self._store = parts.store
        self._stats = parts.stats
        self._stager = parts.stager
        self._io = parts.io
        self._heap = parts.heap
