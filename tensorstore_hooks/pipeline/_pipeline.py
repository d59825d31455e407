"""The pipeline: the units behind one ``OffloadHooks``, built and wired together.

A saved tensor goes, in order, through (see ``docs/life-of-a-saved-tensor.md``):

* :class:`~tensorstore_hooks.pipeline._router.Router` - pack decides keep / host / store;
* :class:`~tensorstore_hooks.pipeline._records.RecordTable` - a record per stored tensor and
  every change to it (NOTE [ Record lifecycle ]), dedup, the handles' finalizers;
* :class:`~tensorstore_hooks.pipeline._writebehind.WriteBehind` - its bytes into the store on
  I/O threads, bounded by ``max_inflight`` (accelerator tensors staged to pinned host
  memory first by :class:`~tensorstore_hooks.pipeline._device.DeviceStager`, or held there
  within ``host_budget`` and spilled oldest first: NOTE [ Host tier wiring ]);
* :class:`~tensorstore_hooks.pipeline._prefetch.Prefetcher` - back from the store ahead of
  backward, newest first, within ``prefetch`` bytes; unpack returns it.

The pipeline owns those units and the close sequence: when the last record is freed
after :meth:`Pipeline.close`, an owned store closes.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterator

from tensorstore_hooks.config import PipelineSettings, Policy, exact_size
from tensorstore_hooks.pipeline._budgets import BudgetControl, PlanMemory, pinned_idle_cap
from tensorstore_hooks.pipeline._device import DeviceStager
from tensorstore_hooks.pipeline._iopool import StorePool, on_io_thread, shutdown_pool
from tensorstore_hooks.pipeline._prefetch import Prefetcher
from tensorstore_hooks.pipeline._records import Record, RecordTable
from tensorstore_hooks.pipeline._router import ModulePaths, Router
from tensorstore_hooks.pipeline._stats import OffloadStats
from tensorstore_hooks.pipeline._timeline import Timeline
from tensorstore_hooks.pipeline._writebehind import WriteBehind
from tensorstore_hooks.runtime import HeapReleaser, PipelineEffects, foreign
from tensorstore_hooks.storage import TensorStore

__all__ = ["Pipeline"]

log = logging.getLogger("tensorstore_hooks")


class Pipeline:
    """The pipeline behind one :class:`~tensorstore_hooks.OffloadHooks` (torch or Paddle).

    ``policy`` decides per tensor (keep / host / store); ``settings`` is the config's
    ``pipeline:`` section as it is (:class:`~tensorstore_hooks.config._settings.PipelineSettings`);
    ``owns_store``: close ``store`` once the pipeline is closed and nothing is live.
    ``plan``: start the device budget's plan from what earlier pipelines learnt and add
    to it (NOTE [ Plan carry-over ]); ``stats``: count into these (a pipeline reopened
    for the same hooks: NOTE [ Idle hooks ]). Hooks pack and unpack through :attr:`router`.
    """

    def __init__(
        self,
        store: TensorStore,
        *,
        policy: Policy,
        settings: PipelineSettings,
        owns_store: bool = False,
        plan: PlanMemory | None = None,
        stats: OffloadStats | None = None,
    ) -> None:
        self.store = store
        self.policy = policy
        self.settings = settings
        self.owns_store = owns_store
        self._pid = os.getpid()  # NOTE [ Fork safety ]
        self.stats = stats = stats if stats is not None else OffloadStats()
        # Counters bump ``stats`` directly: a bound method of ours would be a cycle.
        self.heap = HeapReleaser(  # NOTE [ Heap release ]
            settings.release_heap_every, on_release=functools.partial(_count_heap_release, stats)
        )
        io = StorePool(store, settings.writer_threads + 2)
        self._closed = False
        self._close_lock = threading.Lock()
        self._parked = False  # NOTE [ Idle hooks ]
        # Re-entrant: a handle's finalizer (_release -> _idle) may run on this thread
        # inside a locked region, at any allocation the collector picks.
        self._park_lock = threading.RLock()
        close_idle()  # another pipeline: the idle ones close (NOTE [ Idle hooks ] rule 1)
        self.table = table = RecordTable(self._release, stats)
        # Budgets first: host_budget "auto" is derived now (NOTE [ Auto budgets ]).
        self.budget = budget = BudgetControl.for_pipeline(policy, settings, stats, plan)
        self.stager = stager = DeviceStager(  # NOTE [ Host tier wiring ]
            table.copies,
            idle_cap=pinned_idle_cap(settings),
            host_budget=budget.host_budget,
            stats=stats,
            hold_timeout_s=settings.read_deadline_s,
        )
        self.writer = writer = WriteBehind(table, io, stager=stager, heap=self.heap, stats=stats)
        stager.copy_window = _window_of(writer)  # NOTE [ Copy window ]
        self.prefetcher = Prefetcher(
            table.reads,
            io,
            stager=stager,
            heap=self.heap,
            stats=stats,
            read_deadline_s=settings.read_deadline_s,
        )
        _wire_direct_io(self, store, owns_store)
        # Sets both windows now and after every forward (NOTE [ Windows ]).
        budget.connect(self.writer, self.prefetcher, stager.tier)
        self.router = Router(
            policy=policy,
            stats=stats,
            table=table,
            writer=self.writer,
            prefetcher=self.prefetcher,
            stager=stager,
            budget=budget,
        )
        # Last, once nothing can fail: both are given back by _close_now. NOTE [ Closed
        # while in use ] (storage/zarr/_store.py), NOTE [ Process-wide effects ]
        # (runtime/_effects.py).
        self._unuse = store._use()
        trim_every = settings.release_heap_every if self.heap.enabled else 0
        self._effects = self.router.effects = PipelineEffects(settings.mmap_threshold, trim_every)

    @property
    def scope(self) -> ModulePaths | None:
        """Where ``module`` rules read the running module's path (``None``: no model)."""
        return self.router.scope

    @scope.setter
    def scope(self, scope: ModulePaths | None) -> None:
        self.router.scope = scope

    @property
    def timeline(self) -> Timeline | None:
        """The timeline ``hooks.trace()`` records into (``None``: not recording)."""
        return self.router.timeline

    @timeline.setter
    def timeline(self, timeline: Timeline | None) -> None:
        self.router.timeline = self.writer.timeline = self.prefetcher.timeline = timeline

    @contextlib.contextmanager
    def trace(self, path: str | os.PathLike[str]) -> Iterator[Timeline]:
        """Record this pipeline's work into a :class:`Timeline` saved at ``path`` on exit.

        :attr:`timeline` is set while the block runs; the file is written even if the
        block raises. Raises ``RuntimeError`` if a trace is already recording.
        """
        if self.timeline is not None:
            raise RuntimeError("hooks.trace(): these hooks are already recording a timeline")
        timeline = Timeline(path)
        self.timeline = timeline
        try:
            yield timeline
        finally:
            self.flush()  # writes still running belong in the picture
            self.timeline = None
            timeline.write()

    def forward_begin(self) -> None:
        """A forward under this pipeline's hooks starts (for the timeline, if recording)."""
        timeline = self.timeline
        if timeline is not None:
            timeline.forward_begin()

    def forward_end(self) -> None:
        """The forward under this pipeline's hooks ended."""
        timeline = self.timeline
        if timeline is not None:
            timeline.forward_end()

    def describe(self) -> str:
        """One line: the store and every setting of the pipeline, for the INFO log at open."""
        policy, settings, store = self.policy, self.settings, self.store
        temporary = " (temporary, removed at close)" if store.temporary else ""
        rules = (
            ", ".join(f"rules[{i}] {r.describe()}->{r.action}" for i, r in enumerate(policy.rules))
            or "none"
        )
        return (
            f"offload pipeline: store {store.url}{temporary}; policy min_bytes="
            f"{exact_size(policy.min_bytes)} skip_parameters={policy.skip_parameters} "
            f"default={policy.default} device_budget={_size(policy.device_budget, 'none')} "
            f"rules: {rules}; pipeline max_inflight={_size(settings.max_inflight, 'derived')} "
            f"prefetch={_size(settings.prefetch, 'derived')} "
            f"host_budget={_size(settings.host_budget or None, 'none')} "
            f"memory_headroom={_size(settings.memory_headroom, 'none')} "
            f"writer_threads={settings.writer_threads} read_deadline_s={settings.read_deadline_s:g}"
        )

    # -------------------------------------------------------------- release
    def _release(self, rec: Record) -> None:
        """Finalizer of a handle: the record table frees the record; this cleans up."""
        try:
            freed = self.table.free(rec)
            if freed is None:
                return
            self.stager.give_back(rec, freed.give_back)
            if freed.key is not None:
                self.writer.discard(freed.key)
            elif freed.write_running is not None and not on_io_thread():
                # Rule 2 of NOTE [ Record lifecycle ]: "graph freed => every key gone"
                # holds when `del loss` returns. (An I/O thread must not wait: the
                # write may be queued behind it.)
                freed.write_running.wait(self.settings.read_deadline_s)
            if freed.last:
                self._close_now()
            elif self._parked and self.table.live == 0 and not on_io_thread():
                self._idle()
        except Exception:  # pragma: no cover - a finalizer must never raise
            log.debug("release failed", exc_info=True)

    # ------------------------------------------------------------- lifecycle
    def emit_warning(self) -> None:
        """Issue the pending one-time fallback warning (on the caller's thread)."""
        self.router.emit_warning()

    def flush(self) -> None:
        """Block until every pending write of this pipeline has reached the store."""
        self.router.close_spans()  # open spans are pending writes (NOTE [ Span unions ])
        self.writer.flush()
        self.emit_warning()

    @property
    def live_records(self) -> int:
        """Records whose graph is still alive."""
        return self.table.live

    def close(self) -> None:
        """Stop taking tensors; close the store (if owned) once every record is freed."""
        if foreign(self._pid):  # a forked child: no lock, no store (NOTE [ Fork safety ])
            return  # (its router keeps every tensor it packs)
        self.router.close_spans()
        if self.table.close():
            self._close_now()

    def park(self) -> None:
        """No block of the hooks is open: idle once nothing is live (NOTE [ Idle hooks ]).

        Idle: the I/O threads of an owned store stop at once (they start again on
        use) and its process-wide effects are given back; the pipeline closes (its
        store, its buffers) when another pipeline is made in this process, or when its
        hooks are collected. A pipeline recording a
        timeline does not idle (the trace still owns it)."""
        if self.timeline is not None or foreign(self._pid):
            return
        with self._park_lock:
            self._parked = True
        if self.table.live == 0:
            self._idle()

    def unpark(self) -> bool:
        """A block of the hooks opens: ``False`` if the pipeline was closed while idle
        (the hooks make a new one); else it stays open until the next :meth:`park`."""
        with self._park_lock:
            self._parked = False
            closed = self._closed
        with _IDLE_LOCK:
            _IDLE.discard(self)
        return not closed

    def _idle(self) -> None:
        with self._park_lock:
            if not self._parked or self.table.live or self._closed:
                return
            if self.owns_store:  # shared pools stay: other pipelines use them
                # Without waiting: this may run in a handle's finalizer, where a wait
                # keeps a Ctrl-C deferred (NOTE [ Signals and finalizers ]).
                shutdown_pool(self.store, timeout_s=0.0)
            # Nothing moves: glibc gets its dynamic mmap ceiling back, so a plain step
            # beside idle hooks pays nothing (NOTE [ Process-wide effects ], effect 2).
            self._effects.idle()
        with _IDLE_LOCK:
            _IDLE.add(self)

    def _close_if_idle(self) -> None:
        # Under the park lock: a block opening now waits, then finds the pipeline closed.
        with self._park_lock:
            if self._parked and self.table.live == 0 and not self._closed:
                self.close()


    def _close_now(self) -> None:
        with self._close_lock:
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


_IDLE: weakref.WeakSet[Pipeline] = weakref.WeakSet()
"""Pipelines parked with nothing live (NOTE [ Idle hooks ])."""
_IDLE_LOCK = threading.RLock()  # re-entrant, as the park lock is


def close_idle() -> None:
    """Close every idle pipeline (NOTE [ Idle hooks ] rule 1): a new one is being made."""
    with _IDLE_LOCK:
        idle = list(_IDLE)
        _IDLE.clear()
    for pipeline in idle:
        pipeline._close_if_idle()


def _wire_direct_io(pipeline: Pipeline, store: TensorStore, owns_store: bool) -> None:
    """``stats.direct_io`` says how the store moves chunk files; a store the pipeline
    owns keeps at most ``max(prefetch window, its default)`` idle aligned read buffers
    (NOTE [ Aligned buffers ] rule 4: the window's memory, parked between backward
    passes and reused by the next one)."""
    status = store.direct_io
    if status is not None:
        pipeline.stats.direct_io = status.describe()
    floor = store.buffer_pool_bytes
    if owns_store and floor is not None:
        resize = store.set_buffer_pool_bytes
        pipeline.prefetcher.on_window = lambda window: resize(max(window, floor))


def _size(n: object, unset: str) -> object:
    # A budget may be a share of the memory there is ("auto", "60%"): shown as such.
    return unset if n is None else exact_size(n) if isinstance(n, int) else str(n)


def _count_heap_release(stats: OffloadStats) -> None:
    stats.heap_releases += 1


def _window_of(writer: WriteBehind) -> Callable[[], int]:
    """The write-behind's ``max_inflight``, read through a weak reference: the stager
    must not keep the writer (and with it the pipeline's threads) alive in a cycle."""
    ref = weakref.ref(writer)

    def window() -> int:
        alive = ref()
        return 0 if alive is None else alive.max_inflight

    return window
