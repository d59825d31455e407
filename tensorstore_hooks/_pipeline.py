"""The offload session: the pipeline's units for one ``OffloadHooks``, wired together.

A saved tensor goes, in order, through (see ``docs/life-of-a-saved-tensor.md``):

* :class:`~tensorstore_hooks._router.Router` - pack decides keep / host / store;
* :class:`~tensorstore_hooks._records.RecordTable` - a record per stored tensor,
  its state (NOTE [ Record lifecycle ]), dedup, and the handles' finalizers;
* :class:`~tensorstore_hooks._writebehind.WriteBehind` - its bytes into the store on
  I/O threads, bounded by ``max_inflight`` (CUDA tensors staged to pinned host memory
  first by :class:`~tensorstore_hooks._device.DeviceStager`, or held there within
  ``host_budget`` and spilled oldest first: NOTE [ Host tier wiring ]);
* :class:`~tensorstore_hooks._prefetch.Prefetcher` - back from the store ahead of
  backward, newest first, within ``prefetch`` bytes; unpack returns it.

The session owns those units, the I/O pool reference and the close sequence: when
the last record is freed after :meth:`OffloadSession.close`, the owned store closes.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import TYPE_CHECKING, Any

from ._budgets import BudgetControl, pinned_idle_cap
from ._device import DeviceStager
from ._effects import SessionEffects
from ._forks import foreign
from ._heap import HeapReleaser
from ._iopool import StorePool, on_io_thread, shutdown_pool
from ._parts import SessionParts
from ._prefetch import Prefetcher
from ._records import Record, RecordTable, State
from ._router import Router, inplace_error
from ._stats import OffloadStats
from ._store import TensorStore
from ._trace import Timeline
from ._writebehind import WriteBehind

if TYPE_CHECKING:
    from ._config import PipelineSettings

__all__ = ["OffloadSession", "inplace_error"]

log = logging.getLogger("tensorstore_hooks")


class OffloadSession:
    """The pipeline behind one :class:`~tensorstore_hooks.OffloadHooks` (torch or Paddle).

    ``policy`` decides per tensor (keep / host / store); ``settings`` is the config's
    ``pipeline:`` section as it is (:class:`~tensorstore_hooks._config.PipelineSettings`).
    Hooks pack and unpack through :attr:`router`.
    """

    def __init__(
        self,
        store: TensorStore,
        *,
        policy: Any,
        settings: PipelineSettings,
        scope: Any = None,
        owns_store: bool = False,
    ) -> None:
        self.store = store
        self.settings = settings
        self.owns_store = owns_store
        self._pid = os.getpid()  # NOTE [ Fork safety ]
        self.stats = stats = OffloadStats()
        # Counters bump ``stats`` directly: a bound method of ours would be a cycle.
        self.heap = HeapReleaser(  # NOTE [ Heap release ]
            settings.release_heap_every, on_release=lambda: _bump(stats, "heap_releases")
        )
        self._io = StorePool(store, settings.writer_threads + 2)
        self._closing = False
        self._closed = False
        self._table = RecordTable(self._release)
        self.stager = DeviceStager(  # NOTE [ Host tier wiring ]
            self._table,
            idle_cap=pinned_idle_cap(settings),
            host_budget=settings.host_budget,
            stats=stats,
            hold_timeout_s=settings.read_deadline_s,
        )
        parts = SessionParts(self._table, store, stats, self.stager, self._io, self.heap)
        self._writer = WriteBehind(parts, max_inflight=0)
        self._prefetcher = Prefetcher(
            parts,
            window_bytes=0,
            read_deadline_s=settings.read_deadline_s,
        )
        # Sets both windows now and after every forward (NOTE [ Windows ]).
        budget = BudgetControl.for_session(
            policy, settings, self._writer, self._prefetcher, self.stats
        )
        self.router = Router(
            policy=policy,
            stats=self.stats,
            table=self._table,
            writer=self._writer,
            prefetcher=self._prefetcher,
            stager=self.stager,
            scope=scope,
            budget=budget,
        )
        # Last, once nothing can fail: both are given back by _close_now. NOTE [ Closed
        # while in use ] (_zarr_store.py), NOTE [ Process-wide effects ] (_effects.py).
        self._unuse = store._use()
        trim_every = settings.release_heap_every if self.heap.enabled else 0
        self._effects = SessionEffects(settings.mmap_threshold, trim_every)

    @property
    def policy(self) -> Any:
        return self.router.policy

    @property
    def scope(self) -> Any:
        """Where ``module`` rules read the running module's path (``None``: no model)."""
        return self.router.scope

    @scope.setter
    def scope(self, scope: Any) -> None:
        self.router.scope = scope

    @property
    def timeline(self) -> Timeline | None:
        """The timeline ``hooks.trace()`` records into (``None``: not recording)."""
        return self.router.timeline

    @timeline.setter
    def timeline(self, timeline: Timeline | None) -> None:
        self.router.timeline = self._writer.timeline = self._prefetcher.timeline = timeline

    # -------------------------------------------------------------- release
    def _release(self, rec: Record) -> None:
        """Finalizer of a handle: free the record once its last handle is gone."""
        try:
            with self._table.lock:
                prev = self._table.free(rec)
                if prev is None:
                    return
                key, rec.key = rec.key, None
                self._prefetcher.forget(rec)
                if prev in (State.STORED, State.MEMORY, State.DIRTY, State.HELD):
                    self.stager.release(rec)
                source, rec.source = rec.source, None
                rec.guard = None
                idle = self._table.live == 0
                if idle:
                    self._prefetcher.reset()
                elif self._table.wants_compaction():
                    self._prefetcher.cursor = self._table.compact(self._prefetcher.cursor)
            del source  # may free graph pieces; outside the lock
            if key is not None:
                self._writer.discard(key)
            elif rec.write_started and not rec.writing_done.is_set() and not on_io_thread():
                # A write in progress (freed mid-write, or served from memory by the tail
                # shortcut) deletes what it wrote once it sees the record unwanted; wait
                # for that so "graph freed => every key gone" holds when `del loss` returns.
                # (An I/O thread must not wait: the write may be queued behind it.)
                rec.writing_done.wait(self.settings.read_deadline_s)
            if idle and self._closing:
                self._close_now()
        except Exception:  # pragma: no cover - a finalizer must never raise
            log.debug("release failed", exc_info=True)

    # ------------------------------------------------------------- lifecycle
    def emit_warning(self) -> None:
        """Issue the pending one-time fallback warning (on the caller's thread)."""
        self.router.emit_warning()

    def flush(self) -> None:
        """Block until every pending write of this session has reached the store."""
        self._writer.flush()
        self.emit_warning()

    @property
    def live_records(self) -> int:
        """Records whose graph is still alive."""
        return self._table.live

    def close(self) -> None:
        """Stop taking tensors; close the store (if owned) once every record is freed."""
        if foreign(self._pid):  # a forked child: no lock, no store (NOTE [ Fork safety ])
            self.router.closing = True
            return
        with self._table.lock:
            self._closing = True
            self.router.closing = True
            idle = self._table.live == 0
        if idle:
            self._close_now()

    def _close_now(self) -> None:
        with self._table.lock:
            if self._closed:
                return
            self._closed = True
        self.stager.clear()
        self._unuse()
        self._effects.end()
        if self.owns_store:
            shutdown_pool(self.store)
            with contextlib.suppress(Exception):
                self.store.close()

    @property
    def closed(self) -> bool:
        return self._closed


def _bump(stats: OffloadStats, name: str) -> None:
    setattr(stats, name, getattr(stats, name) + 1)
