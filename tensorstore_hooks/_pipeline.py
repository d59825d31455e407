"""The offload session: what pack and unpack do for every saved tensor.

NOTE [ Record lifecycle ]
pack creates a ``_Record`` (or reuses one, see dedup) and returns a ``_Handle``
pointing at it; autograd keeps the handle in its graph. A record moves

    QUEUED -> WRITING -> STORED            the normal path (write-behind)
    QUEUED/WRITING -> MEMORY               tail shortcut (unpack came first) or a
                                           failed/refused write (fallback)
    QUEUED/WRITING -> DIRTY                modified in place before it was copied
    any -> FREED                           the last handle died (graph freed)

The record holds the source tensor until its bytes are in the store, then drops it,
which is what frees activation memory. Stored bytes are deleted only when the last
handle dies (``weakref.finalize``), never on unpack: unpack may run many times
(``retain_graph=True``, double backward).

NOTE [ Prefetch order ]
Backward unpacks roughly in reverse pack order. Records sit in ``_order`` in pack
order; each unpack of a stored record moves a cursor to just below it, and the
prefetcher walks the cursor downwards (newest first), reading records ahead while
the bytes read but not yet consumed stay within the ``prefetch`` window. An unpack
that finds its read already done or running is a hit; one that has to start its own
read is a miss. Out-of-order access (branches, several graphs) is correct, only
slower: the cursor simply jumps.

NOTE [ In-place checks ]
With saved-tensor hooks active, torch no longer checks that a saved tensor was not
modified in place. So every record remembers ``t._version`` at pack. The writer
checks it before copying and again after (a version bump happens on the host before
the in-place kernel runs, so an overlapping write is always seen by the second
check); kept tensors are checked at unpack. A modified tensor makes unpack raise
torch's usual error rather than return later values.

NOTE [ Detached aliases ]
The pack hook receives the saved tensor with its ``grad_fn``; for ops that save their
own output (ReLU, attention) that ``grad_fn`` is the very node that holds our handle.
Anything we keep that references the tensor itself closes a cycle through C++ that
Python's collector cannot see: the graph would outlive ``del loss`` (forever for a
kept tensor, until its write ends for a stored one). So records and kept handles hold
``t.detach()``: the same storage and the same version counter, no autograd history.
Unpack returns it as is; autograd re-attaches the history it saved itself.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import random
import threading
import time
import warnings
import weakref
from collections import deque
from concurrent.futures import Future
from typing import Any

import torch

from ._codec import is_dense, unsupported_reason
from ._heap import HeapReleaser
from ._iopool import READ, WRITE, IOPool, pool_for, shutdown_pool
from ._stats import OffloadStats, RouteStats
from ._store import TensorStore
from .errors import (
    IntegrityError,
    KeyNotFoundError,
    StoreUnavailableError,
    TensorStoreError,
    UnsupportedTensorError,
)

__all__ = ["OffloadSession", "PipelineOptions", "inplace_error"]

log = logging.getLogger("tensorstore_hooks")


class _State(enum.IntEnum):
    QUEUED = 0
    WRITING = 1
    STORED = 2
    MEMORY = 3
    DIRTY = 4
    FREED = 5


class PipelineOptions:
    """Byte budgets and threads of one session (validated by the config layer)."""

    __slots__ = (
        "max_inflight",
        "prefetch",
        "read_deadline_s",
        "release_heap_every",
        "writer_threads",
    )

    def __init__(
        self,
        *,
        max_inflight: int = 512 << 20,
        prefetch: int = 256 << 20,
        writer_threads: int = 2,
        read_deadline_s: float = 30.0,
        release_heap_every: int = 128 << 20,
    ) -> None:
        self.max_inflight = max_inflight
        self.prefetch = prefetch
        self.writer_threads = writer_threads
        self.read_deadline_s = read_deadline_s
        self.release_heap_every = release_heap_every


class _Record:
    __slots__ = (
        "copy_event",
        "dedup_key",
        "device",
        "error",
        "fetch",
        "guard",
        "host",
        "host_buf",
        "key",
        "nbytes",
        "offset",
        "pos",
        "refs",
        "source",
        "state",
        "version",
        "write_started",
        "writing_done",
    )

    def __init__(self, t: torch.Tensor, nbytes: int, pos: int, guard: Any = None) -> None:
        # The saved tensor until its bytes are stored, detached: NOTE [ Detached aliases ].
        self.source: torch.Tensor | None = t.detach()
        # What in-place checks read ``_version`` from: the tensor itself, or for another
        # framework's tensor (seen here through a zero-copy alias) that tensor's counter.
        self.guard: Any = self.source if guard is None else guard
        self.version = self.guard._version
        self.nbytes = nbytes
        self.device = t.device
        self.offset = int(t.storage_offset())
        self.state = _State.QUEUED
        self.key: str | None = None
        self.refs = 1
        self.pos = pos
        self.fetch: Future[Any] | None = None
        self.host: torch.Tensor | None = None  # CUDA: host view over a pinned buffer
        self.host_buf: torch.Tensor | None = None
        self.copy_event: Any = None
        self.dedup_key: tuple[Any, ...] | None = None
        self.error: BaseException | None = None
        self.write_started = False
        self.writing_done = threading.Event()  # set when the writer is finished with it


class _Handle:
    """What autograd keeps for an offloaded tensor: a pointer to its record."""

    __slots__ = ("__weakref__", "rec")

    def __init__(self, rec: _Record) -> None:
        self.rec = rec


class _Kept:
    """A tensor left in place, with its version at pack (see NOTE [ In-place checks ]).

    Holds ``t.detach()``: see NOTE [ Detached aliases ].
    """

    __slots__ = ("tensor", "version")

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor = t.detach()
        self.version = t._version


class _Host:
    """A tensor moved to pinned host memory by a ``host`` rule (like ``save_on_cpu``)."""

    __slots__ = ("device", "tensor")

    def __init__(self, t: torch.Tensor, device: torch.device) -> None:
        self.tensor = t
        self.device = device


def inplace_error(what: str) -> RuntimeError:
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an "
        f"inplace operation ({what} was saved for backward by an offloaded op and changed "
        "afterwards). tensorstore-hooks keeps torch's rule: do not modify saved tensors in "
        "place, or clone them before modifying."
    )


def _is_dense(t: torch.Tensor) -> bool:
    return is_dense(tuple(t.shape), tuple(t.stride()))


class OffloadSession:
    """Pack/unpack logic of one :class:`~tensorstore_hooks.OffloadHooks`.

    ``policy`` decides per tensor (keep / host / store); ``scope`` (optional) tells
    the module path that is running. Thread-safe: background writers and readers
    update records under one re-entrant lock (finalizers of graph nodes may run
    while it is held).
    """

    def __init__(
        self,
        store: TensorStore,
        *,
        policy: Any,
        options: PipelineOptions,
        scope: Any = None,
        owns_store: bool = False,
    ) -> None:
        self.store = store
        self.policy = policy
        self.options = options
        self.scope = scope
        self.owns_store = owns_store
        self.stats = OffloadStats()
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._inflight = 0
        self._order: list[_Record | None] = []
        self._live = 0
        self._cursor = -1
        self._window = 0
        self._dedup: dict[tuple[Any, ...], tuple[weakref.ref[torch.Tensor], _Record]] = {}
        self._warned = False
        self._pending_warning: str | None = None
        self._cuda_pending: deque[_Record] = deque()
        self._pool: IOPool | None = None
        self._closing = False
        self._closed = False
        self._pinned: Any = None
        self._streams: Any = None
        self._heap = HeapReleaser(options.release_heap_every)  # NOTE [ Heap release ]
        self.budget: Any = None

    # ------------------------------------------------------------ resources
    def _io(self) -> IOPool:
        pool = self._pool
        if pool is None or pool._closed:
            pool = self._pool = pool_for(self.store, self.options.writer_threads + 2)
        return pool

    def _staging(self) -> tuple[Any, Any]:
        if self._pinned is None:
            from ._staging import PinnedPool, StreamSet

            self._pinned = PinnedPool(cap_bytes=self.options.max_inflight + self.options.prefetch)
            self._streams = StreamSet()
        return self._pinned, self._streams

    # ------------------------------------------------------------------ pack
    def pack(self, t: torch.Tensor) -> Any:
        """The pack hook. Returns the tensor's stand-in in the autograd graph."""
        self.emit_warning()
        reason = unsupported_reason(t)
        if reason is not None:
            self.keep_unsupported(reason)
            return _Kept(t)
        nbytes = t.numel() * t.element_size()
        action = self.route(t, nbytes)
        if action == "store":
            return self.pack_store(t, nbytes)
        if action == "host":
            return self._pack_host(t)
        return _Kept(t)

    def keep_unsupported(self, reason: str) -> None:
        """Count a tensor kept because the codec cannot store it (sparse, subclass, ...)."""
        self._count("keep", f"unsupported: {reason}", 0)
        self.stats.tensors_kept += 1

    def route(self, t: torch.Tensor, nbytes: int, *, parameter: bool | None = None) -> str:
        """Decide ``keep`` / ``host`` / ``store`` for a supported tensor and count it.

        ``parameter`` overrides the policy's own parameter test (for tensors of another
        framework). A ``keep`` is counted here; a ``host`` is counted by the caller's
        packing, a ``store`` by :meth:`pack_store`. Once the session is closing, every
        tensor is kept.
        """
        path = self.scope.current() if self.scope is not None else None
        decision = self.policy.decide(t, path, parameter=parameter)
        action = decision.action
        label = decision.label
        if self.budget is not None and self.budget.keep(
            action, nbytes, accelerator=t.device.type != "cpu"
        ):
            action, label = "keep", "device_budget"
        self._count(action, label, nbytes)
        if action == "host":
            self.stats.tensors_host += 1
            self.stats.bytes_host += nbytes
            return action
        if action != "store" or self._closing:
            self.stats.tensors_kept += 1
            self.stats.bytes_kept += nbytes
            return "keep"
        return action

    def _count(self, action: str, label: str, nbytes: int) -> None:
        for table, name in ((self.stats.per_action, action), (self.stats.per_rule, label)):
            route = table.get(name)
            if route is None:
                route = table[name] = RouteStats()
            route.tensors += 1
            route.bytes += nbytes

    @staticmethod
    def _pack_host(t: torch.Tensor) -> Any:
        if t.device.type == "cpu":
            return _Kept(t)  # already in host memory; a copy would only add memory
        if _is_dense(t):
            packed = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, pin_memory=True)
        else:
            packed = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        packed.copy_(t.detach(), non_blocking=True)
        return _Host(packed, t.device)

    def pack_store(self, t: torch.Tensor, nbytes: int, *, guard: Any = None) -> _Handle:
        """Queue ``t`` for write-behind and return its handle (blocks at ``max_inflight``).

        ``guard``: the object whose ``_version`` tells whether the saved tensor was
        modified in place (default ``t``; another framework passes its own tensor's
        counter, since a zero-copy alias has a counter of its own).
        """
        stats = self.stats
        # Dedup needs torch's version counter in the key; a guarded alias has none.
        dkey = self._dedup_key(t) if guard is None else None
        with self._lock:
            hit = self._dedup.get(dkey) if dkey is not None else None
            if hit is not None and dkey is not None:
                ref, rec = hit
                alive = ref()
                if (
                    alive is not None
                    and rec.state != _State.FREED
                    and alive.untyped_storage().data_ptr() == dkey[0]
                ):
                    rec.refs += 1
                    stats.dedup_hits += 1
                    return self._new_handle(rec)
            # Backpressure: bound the bytes waiting to be written (NOTE [ Record lifecycle ]).
            if self._inflight and self._inflight + nbytes > self.options.max_inflight:
                t0 = time.perf_counter()
                while self._inflight and self._inflight + nbytes > self.options.max_inflight:
                    self._cond.wait(0.05)
                stats.pack_stall_s += time.perf_counter() - t0
            rec = _Record(t, nbytes, len(self._order), guard)
            self._order.append(rec)
            self._live += 1
            if dkey is not None:
                rec.dedup_key = dkey
                self._dedup[dkey] = (weakref.ref(t), rec)
            self._inflight += nbytes
            stats.tensors_offloaded += 1
            stats.bytes_offloaded += nbytes
        if t.device.type == "cuda":
            self._start_device_copy(rec, t)
        self._io().submit(WRITE, self._write, rec)
        return self._new_handle(rec)

    @staticmethod
    def _dedup_key(t: torch.Tensor) -> tuple[Any, ...]:
        # data_ptr alone is reused by the allocator; it is only trusted while a weak
        # reference proves the first saver (and so this storage) is still alive.
        return (
            t.untyped_storage().data_ptr(),
            t.storage_offset(),
            tuple(t.shape),
            tuple(t.stride()),
            t._version,
            t.dtype,
            t.device,
        )

    def _new_handle(self, rec: _Record) -> _Handle:
        handle = _Handle(rec)
        fin = weakref.finalize(handle, self._release, rec)
        fin.atexit = False  # at exit the store is going away anyway; never raise there
        return handle

    def _start_device_copy(self, rec: _Record, t: torch.Tensor) -> None:
        from ._staging import copy_to_host

        pool, streams = self._staging()
        rec.host, rec.host_buf, rec.copy_event = copy_to_host(t, pool, streams)
        with self._lock:
            self._cuda_pending.append(rec)
            self._reap_device_copies()

    def _reap_device_copies(self) -> None:
        """Drop device tensors whose copy to host has finished (frees GPU memory early)."""
        pending = self._cuda_pending
        while pending:
            rec = pending[0]
            if rec.copy_event is not None and not rec.copy_event.query():
                break
            pending.popleft()
            self._device_copy_done(rec)

    def _device_copy_done(self, rec: _Record) -> None:
        src = rec.source
        if (
            src is not None
            and src.device.type == "cuda"
            and rec.state in (_State.QUEUED, _State.WRITING)
        ):
            if rec.guard._version != rec.version:
                rec.state = _State.DIRTY
            rec.source = rec.guard = None
        rec.copy_event = None

    # ----------------------------------------------------------------- write
    def _write(self, rec: _Record) -> None:
        """Writer thread: move one record's bytes into the store."""
        with self._lock:
            if rec.state != _State.QUEUED:
                self._write_finished(rec)
                rec.writing_done.set()
                return
            rec.state = _State.WRITING
            rec.write_started = True
            event = rec.copy_event
            src = rec.host if rec.host is not None else rec.source
        key: str | None = None
        error: BaseException | None = None
        orig: torch.Tensor | None = None
        try:
            if event is not None:
                event.synchronize()
                with self._lock:
                    self._device_copy_done(rec)
            if src is None or rec.state == _State.DIRTY:
                raise _Dirty()
            orig = rec.guard  # the saved tensor (``src`` is its pinned copy for CUDA)
            if orig is not None and orig._version != rec.version:
                raise _Dirty()
            key = self.store.put(src)
            if orig is not None and orig._version != rec.version:
                raise _Dirty()
        except _Dirty:
            with self._lock:
                if rec.state in (_State.WRITING, _State.DIRTY):
                    rec.state = _State.DIRTY
                    rec.source = rec.guard = None
        except BaseException as e:
            error = e
        del src, orig  # the record alone decides how long the tensor lives
        with self._lock:
            if error is not None:
                if rec.state == _State.WRITING:
                    self._fallback(rec, error)
            elif key is not None and rec.state == _State.WRITING:
                rec.state = _State.STORED
                rec.key = key
                rec.source = rec.guard = None
                key = None
                self._release_host_buffer(rec)
        if key is not None:
            # Freed or served from memory while writing: the bytes are not wanted. Delete
            # them before the write counts as finished, so flush() covers the delete too.
            self._delete_key(key)
        with self._lock:
            self._write_finished(rec)
        rec.writing_done.set()
        self._heap.note(rec.nbytes)

    def _write_finished(self, rec: _Record) -> None:
        self._inflight -= rec.nbytes
        self._cond.notify_all()

    def _fallback(self, rec: _Record, error: BaseException) -> None:
        """Keep the tensor in memory after a failed or refused write."""
        rec.state = _State.MEMORY
        rec.error = error
        if rec.source is None and rec.host is not None:
            # CUDA source already released: the pinned host copy is the tensor now.
            rec.source = rec.host.clone()
            self._release_host_buffer(rec)
        self.stats.fallbacks += 1
        self.stats.tensors_offloaded -= 1
        self.stats.bytes_offloaded -= rec.nbytes
        self.stats.tensors_kept += 1
        self.stats.bytes_kept += rec.nbytes
        if not self._warned:
            self._warned = True
            self._pending_warning = (
                f"tensorstore-hooks: the store {self.store.url} could not take a saved tensor "
                f"({type(error).__name__}: {error}); keeping such tensors in memory instead. "
                "Training continues; hooks.stats.fallbacks counts them."
            )
        log.warning("write to %s failed, tensor kept in memory: %r", self.store.url, error)

    def _release_host_buffer(self, rec: _Record) -> None:
        if rec.host_buf is not None and self._pinned is not None:
            self._pinned.give(rec.host_buf)
        rec.host_buf = None
        rec.host = None

    def emit_warning(self) -> None:
        """Issue the pending one-time fallback warning (on the caller's thread)."""
        msg = self._pending_warning
        if msg is not None:
            self._pending_warning = None
            warnings.warn(msg, UserWarning, stacklevel=3)

    # ---------------------------------------------------------------- unpack
    def unpack(self, packed: Any) -> torch.Tensor:
        """The unpack hook. May run many times for one handle; never deletes."""
        self.emit_warning()
        if self.budget is not None and self.budget.backward_started():
            with self._lock:
                self._cursor = len(self._order) - 1
            self._fill()
        if isinstance(packed, _Kept):
            if packed.tensor._version != packed.version:
                raise inplace_error(f"a tensor of shape {tuple(packed.tensor.shape)}")
            return packed.tensor
        if isinstance(packed, _Host):
            return packed.tensor.to(packed.device, non_blocking=True)
        rec = packed.rec
        t0 = time.perf_counter()
        while True:
            with self._lock:
                state = rec.state
                src = rec.source
                if state in (_State.QUEUED, _State.WRITING, _State.MEMORY) and src is not None:
                    return self._from_memory(rec, src)
                if state == _State.DIRTY:
                    raise inplace_error("a tensor")
                if state in (_State.MEMORY, _State.FREED):
                    raise StoreUnavailableError(
                        f"offload: a saved tensor is no longer available ({state.name.lower()}); "
                        "was the graph freed or the session closed?"
                    )
                if state != _State.STORED:
                    # A CUDA tensor already copied to host but not yet written: wait.
                    done = rec.writing_done
                else:
                    fut = rec.fetch
                    if fut is not None:
                        rec.fetch = None
                        self._window -= rec.nbytes
                    else:
                        self._cursor = rec.pos - 1  # see NOTE [ Prefetch order ]
                    break
            done.wait()
        if fut is not None:
            self.stats.prefetch_hits += 1
            try:
                out = fut.result()
            except BaseException:
                out = self._read(rec)  # retried with a deadline, then raised
        else:
            self.stats.prefetch_misses += 1
            self._fill()
            out = self._read(rec)
        self.stats.unpack_stall_s += time.perf_counter() - t0
        self._fill()
        return self._finish(rec, out)

    def _from_memory(self, rec: _Record, src: torch.Tensor) -> torch.Tensor:
        """Tail shortcut: serve a tensor whose write has not finished; cancel the write."""
        if rec.state != _State.MEMORY:
            rec.state = _State.MEMORY
            self.stats.tail_hits += 1
        if rec.guard is not None and rec.guard._version != rec.version:
            raise inplace_error(f"a tensor of shape {tuple(src.shape)}")
        return src

    def _finish(self, rec: _Record, out: Any) -> torch.Tensor:
        if isinstance(out, tuple):  # CUDA: (tensor, done event)
            from ._staging import consume

            t, done = out
            return consume(t, done)
        return out

    def _read(self, rec: _Record) -> Any:
        """Read one record back, retrying transient errors until the deadline."""
        key = rec.key
        if key is None:
            raise StoreUnavailableError(
                f"offload: a saved tensor was freed before it was read ({self.store.url})"
            )
        deadline = time.monotonic() + self.options.read_deadline_s
        delay = 0.01
        while True:
            try:
                t = self.store.get(key, device="cpu")
                break
            except (KeyNotFoundError, IntegrityError, UnsupportedTensorError):
                raise
            except Exception as e:
                if isinstance(e, TensorStoreError) and not isinstance(e, StoreUnavailableError):
                    raise  # not transient
                if time.monotonic() + delay > deadline:
                    raise StoreUnavailableError(
                        f"offload: reading key {key!r} from {self.store.url} failed for "
                        f"{self.options.read_deadline_s:g}s: {e}"
                    ) from e
                last: BaseException = e
            log.debug("read of %r failed (%r), retrying", key, last)
            time.sleep(delay * (1 + random.random()))
            delay = min(delay * 2, 1.0)
        with self._lock:  # reader threads run this concurrently
            self.stats.bytes_read += rec.nbytes
        self._heap.note(rec.nbytes)
        t = t.detach()
        if rec.device.type == "cuda":
            from ._staging import copy_to_device

            pool, streams = self._staging()
            dev, done, buf = copy_to_device(t, rec.device, rec.offset, pool, streams)
            done.synchronize()  # the pinned buffer is reusable once the copy is done
            pool.give(buf)
            return (dev, done)
        if rec.device.type != "cpu":
            return t.to(rec.device)
        return t

    def _fill(self) -> None:
        """Start reads ahead of backward within the prefetch window (NOTE [ Prefetch order ])."""
        if self.options.prefetch <= 0:
            return
        submit = []
        with self._lock:
            order = self._order
            while self._cursor >= 0:
                rec = order[self._cursor]
                if rec is not None and rec.state == _State.STORED and rec.fetch is None:
                    if self._window and self._window + rec.nbytes > self.options.prefetch:
                        break
                    fut: Future[Any] = Future()
                    rec.fetch = fut
                    self._window += rec.nbytes
                    submit.append(rec)
                self._cursor -= 1
        pool = self._io() if submit else None
        for rec in submit:
            assert pool is not None
            fut = pool.submit(READ, self._read, rec)
            with self._lock:
                if rec.fetch is not None:
                    rec.fetch = fut
                else:
                    fut.cancel()

    # -------------------------------------------------------------- release
    def _release(self, rec: _Record) -> None:
        """Finalizer of a handle: free the record once its last handle is gone."""
        try:
            with self._lock:
                rec.refs -= 1
                if rec.refs > 0 or rec.state == _State.FREED:
                    return
                prev = rec.state
                rec.state = _State.FREED
                key, rec.key = rec.key, None
                if rec.fetch is not None:
                    rec.fetch.cancel()
                    rec.fetch = None
                    self._window -= rec.nbytes
                if rec.dedup_key is not None:
                    hit = self._dedup.get(rec.dedup_key)
                    if hit is not None and hit[1] is rec:
                        del self._dedup[rec.dedup_key]
                self._order[rec.pos] = None
                self._live -= 1
                if prev in (_State.STORED, _State.MEMORY, _State.DIRTY):
                    self._release_host_buffer(rec)
                source, rec.source = rec.source, None
                rec.guard = None
                idle = self._live == 0
                if idle:
                    self._order.clear()
                    self._cursor = -1
                    self._window = 0
                elif len(self._order) > 1024 and self._live * 4 < len(self._order):
                    self._compact()
            del source  # may free graph pieces; outside the lock
            if key is not None:
                self._delete_key(key)
            elif (
                rec.write_started
                and not rec.writing_done.is_set()
                and not threading.current_thread().name.startswith("tsh-io")
            ):
                # A write in progress (freed mid-write, or served from memory by the tail
                # shortcut) deletes what it wrote once it sees the record unwanted; wait
                # for that so "graph freed => every key gone" holds when `del loss` returns.
                rec.writing_done.wait(self.options.read_deadline_s)
            if idle and self._closing:
                self._close_now()
        except Exception:  # pragma: no cover - a finalizer must never raise
            log.debug("release failed", exc_info=True)

    def _compact(self) -> None:
        live = [r for r in self._order if r is not None]
        cursor_rec = None
        if self._cursor >= 0:
            for i in range(self._cursor, -1, -1):
                if self._order[i] is not None:
                    cursor_rec = self._order[i]
                    break
        for i, r in enumerate(live):
            r.pos = i
        self._order = list(live)
        self._cursor = cursor_rec.pos if cursor_rec is not None else -1

    def _delete_key(self, key: str) -> None:
        try:
            self.store.delete(key)
        except KeyError:
            pass
        except Exception as e:
            log.warning("could not delete %r from %s: %r", key, self.store.url, e)

    # ------------------------------------------------------------- lifecycle
    def flush(self) -> None:
        """Block until every pending write of this session has reached the store."""
        with self._lock:
            while self._inflight > 0:
                self._cond.wait(0.1)
        self.emit_warning()

    @property
    def live_records(self) -> int:
        return self._live

    def close(self, *, wait: bool = True) -> None:
        """Stop taking tensors; close the store (if owned) once every record is freed."""
        with self._lock:
            self._closing = True
            idle = self._live == 0
        if idle:
            self._close_now()

    def _close_now(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._pinned is not None:
            self._pinned.clear()
        if self.owns_store:
            shutdown_pool(self.store)
            with contextlib.suppress(Exception):
                self.store.close()

    @property
    def closed(self) -> bool:
        return self._closed


class _Dirty(Exception):
    """Internal: the saved tensor changed in place before its bytes were copied."""
