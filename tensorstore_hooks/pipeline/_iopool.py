"""Background I/O threads shared by every pipeline on one store.

A small priority pool: reads (backward is waiting) go before writes. Threads start on
first use and stop on :meth:`IOPool.shutdown`, which runs when the owning store is
closed and at interpreter exit (an ``atexit`` handler registered only while a pool
exists: NOTE [ Process-wide effects ] in ``runtime/_effects.py``). A task's exception is
delivered through its Future, never lost in the thread.

One pool serves every pipeline on a store, sized by the first pipeline that asks
(``writer_threads + 2``); see :func:`pool_for` for what a later pipeline with another
size gets.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import queue
import sys
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

if sys.version_info >= (3, 11):
    from typing import TypeVarTuple, Unpack
else:  # pragma: no cover - Python 3.10
    from typing_extensions import TypeVarTuple, Unpack

if TYPE_CHECKING:
    from tensorstore_hooks.storage import TensorStore


__all__ = [
    "READ",
    "WRITE",
    "IOPool",
    "StorePool",
    "at_exit_registered",
    "on_io_thread",
    "pool_for",
    "shutdown_pool",
]

log = logging.getLogger("tensorstore_hooks")

READ = 0
WRITE = 1
_STOP = 99

_WORKER = threading.local()

T = TypeVar("T")
Ts = TypeVarTuple("Ts")


class _Runnable(Protocol):
    """What the queue holds: a task of any result type."""

    def run(self) -> None: ...


class _Task(Generic[T, Unpack[Ts]]):
    """``fn(*args)`` and the Future its result or exception goes to."""

    __slots__ = ("args", "fn", "future")

    def __init__(self, fn: Callable[[Unpack[Ts]], T], args: tuple[Unpack[Ts]]) -> None:
        self.fn = fn
        self.args = args
        self.future: Future[T] = Future()

    def run(self) -> None:
        """Run ``fn`` unless the Future was cancelled; never raises."""
        future, fn, args = self.future, self.fn, self.args
        # A failure's traceback keeps this frame: on exit it must refer to nothing of
        # the task (its arguments hold tensors and records), or they outlive the task.
        del self
        try:
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(*args)
                except BaseException as e:  # delivered to whoever waits on the future
                    future.set_exception(e)
                else:
                    future.set_result(result)
        finally:
            del future, fn, args


def on_io_thread() -> bool:
    """True on a worker thread of any :class:`IOPool` (it must never wait for its own queue)."""
    return getattr(_WORKER, "pool", None) is not None


class IOPool:
    """A fixed number of daemon threads draining a priority queue of callables."""

    def __init__(self, threads: int, name: str = "tsh-io") -> None:
        self.threads = max(1, threads)
        self._name = name
        self._queue: queue.PriorityQueue[tuple[int, int, _Runnable | None]] = (
            queue.PriorityQueue()
        )
        self._counter = itertools.count()
        self._workers: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False
        self._pid = os.getpid()  # NOTE [ Fork safety ]: a forked child has none of its threads
        self.retired = False  # counted out of the pools that keep the exit handler

    @property
    def closed(self) -> bool:
        """True once :meth:`shutdown` ran, or in a forked child of the process that made
        the pool (its threads do not exist there); a closed pool takes no more tasks."""
        return self._closed or os.getpid() != self._pid  # foreign(), inline: per task

    def submit(
        self, priority: int, fn: Callable[[Unpack[Ts]], T], *args: Unpack[Ts]
    ) -> Future[T]:
        """Run ``fn(*args)`` on a pool thread; lower ``priority`` runs first."""
        task = _Task(fn, args)
        with self._lock:
            if self.closed:
                raise RuntimeError("tensorstore-hooks I/O pool is shut down")
            if len(self._workers) < self.threads:
                self._start_worker()
        self._queue.put((priority, next(self._counter), task))
        return task.future

    def _start_worker(self) -> None:
        t = threading.Thread(
            target=self._run, name=f"{self._name}-{len(self._workers)}", daemon=True
        )
        self._workers.append(t)
        t.start()

    def _run(self) -> None:
        _WORKER.pool = self
        while True:
            priority, _, task = self._queue.get()
            if priority == _STOP or task is None:
                return
            task.run()
            # An idle thread must not keep the last tensor it read or wrote alive (and
            # its read buffer out of the pool) until its next task.
            del task

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Finish queued tasks, then stop the threads (waits up to ``timeout_s``).

        A no-op in a forked child (the threads are its parent's)."""
        with self._lock:
            if self.closed:
                return
            self._closed = True
            workers = list(self._workers)
        for _ in workers:
            self._queue.put((_STOP, next(self._counter), None))
        for t in workers:
            if t is not threading.current_thread():
                t.join(timeout_s)

    @property
    def alive_threads(self) -> int:
        return sum(t.is_alive() for t in self._workers)


_POOLS: weakref.WeakKeyDictionary[TensorStore, IOPool] = weakref.WeakKeyDictionary()
_POOLS_LOCK = threading.RLock()  # re-entered by _count_pool from pool_for


def pool_for(store: TensorStore, threads: int) -> IOPool:
    """The pool shared by all pipelines on ``store``, made with ``threads`` on first use.

    The first caller sizes the pool. A later caller asking for another size gets the
    existing pool unchanged (its pipelines share those threads), and a log warning
    naming both sizes; call :func:`shutdown_pool` first to resize.
    """
    with _POOLS_LOCK:
        pool = _POOLS.get(store)
        if pool is None or pool.closed:
            pool = _POOLS[store] = IOPool(threads)
            _count_pool(+1)  # NOTE [ Process-wide effects ] (effect 5)
            # Idle workers hold no reference to the store: once it is collected, stop
            # them (without joining: a finalizer may run on any thread, even a worker).
            weakref.finalize(store, _collected, pool).atexit = False
        elif pool.threads != max(1, threads):
            log.warning(
                "tensorstore-hooks: the store %s already has an I/O pool of %d threads; "
                "these hooks asked for %d and share the existing %d (writer_threads "
                "applies to the first hooks on a store)",
                store.url,
                pool.threads,
                threads,
                pool.threads,
            )
        return pool


class StorePool:
    """A pipeline's way to its store and the store's pool: ``pool()`` is :func:`pool_for`,
    cached.

    A pool shut down (its store closed by another pipeline) is replaced on next use.
    """

    __slots__ = ("_pool", "_threads", "store")

    def __init__(self, store: TensorStore, threads: int) -> None:
        self.store = store
        """The store the pool's tasks read and write."""
        self._threads = threads
        self._pool: IOPool | None = None

    def __call__(self) -> IOPool:
        pool = self._pool
        if pool is None or pool.closed:
            pool = self._pool = pool_for(self.store, self._threads)
        return pool


def shutdown_pool(store: TensorStore, timeout_s: float = 10.0) -> None:
    """Stop ``store``'s pool (its queued tasks run first); the next :func:`pool_for` makes
    a new one. Waits up to ``timeout_s`` for each thread (0: the threads stop on their
    own, as soon as their queue is done: nothing waits, e.g. in a finalizer)."""
    with _POOLS_LOCK:
        pool = _POOLS.pop(store, None)
    if pool is not None:
        _retire(pool)
        pool.shutdown(timeout_s)


def _collected(pool: IOPool) -> None:
    # The store was collected (its entry leaves _POOLS with it): stop the pool's threads.
    _retire(pool)
    pool.shutdown(0.0)


_pools = 0  # pools made and not yet retired; guarded by _POOLS_LOCK
_exit_registered = False


def _retire(pool: IOPool) -> None:
    with _POOLS_LOCK:
        if pool.retired:
            return
        pool.retired = True
    _count_pool(-1)


def _count_pool(delta: int) -> None:
    """Register :func:`_shutdown_all` at exit while pools exist, unregister after."""
    global _pools, _exit_registered
    with _POOLS_LOCK:
        _pools += delta
        if _pools > 0 and not _exit_registered:
            atexit.register(_shutdown_all)
            _exit_registered = True
        elif _pools <= 0 and _exit_registered:
            atexit.unregister(_shutdown_all)
            _exit_registered = False


def at_exit_registered() -> bool:
    """Whether the exit handler that stops the I/O threads is registered now."""
    return _exit_registered


def _shutdown_all() -> None:  # pragma: no cover - exercised by subprocess tests
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
        _POOLS.clear()
    for pool in pools:
        pool.shutdown(timeout_s=5.0)
