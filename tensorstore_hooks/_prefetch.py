"""The prefetcher: stored records read back ahead of backward, newest first.

NOTE [ Prefetch order ]
Backward unpacks roughly in reverse pack order. Records sit in the record table in
pack order; each unpack of a stored record moves a cursor to just below it, and the
prefetcher walks the cursor downwards (newest first), reading records ahead (stored
ones from the store, held ones from the host tier: NOTE [ Host tier wiring ]) while
the bytes read but not yet consumed stay within the ``prefetch`` window. An unpack
that finds its read already done or running is a hit; one that has to start its own
read is a miss. Out-of-order access (branches, several graphs) is correct, only
slower: the cursor simply jumps.

A read has one deadline, ``read_deadline_s``, from its first attempt: reads retry in
the library's one retry loop (NOTE [ One retry layer ] in ``_retry.py``) with
:func:`~tensorstore_hooks._retry.classify_store_read`, and a read ahead that failed
is final for its unpack (it already had the whole deadline) rather than retried again.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import CancelledError, Future
from typing import Any

import torch

from ._iopool import READ
from ._parts import PipelineUnit, SessionParts
from ._records import Record, State
from ._retry import Retrier, RetriesExhausted, RetryPolicy, classify_store_read
from ._trace import READ_RANGE, UNPACK_WAIT_RANGE, Timeline, span
from .errors import StoreUnavailableError

__all__ = ["Prefetcher"]

_READABLE = (State.STORED, State.HELD)
"""What the read-ahead reads: stored records, and held ones (from the host tier)."""

log = logging.getLogger("tensorstore_hooks")


class Prefetcher(PipelineUnit):
    """Cursor and window of read-ahead; :meth:`read` is the one way bytes come back."""

    def __init__(self, parts: SessionParts, *, window_bytes: int, read_deadline_s: float) -> None:
        super().__init__(parts)
        self.window_bytes = window_bytes
        self.read_deadline_s = read_deadline_s
        self.cursor = -1  # pack position the next read-ahead looks at
        self._window = 0  # bytes read ahead and not yet consumed
        self._retrier = Retrier(
            RetryPolicy(
                deadline_s=max(read_deadline_s, 1e-3),
                first_backoff_s=0.01,
                max_backoff_s=1.0,
                min_attempt_s=0.0,
            ),
            label=f"offload reads from {parts.store.url}",
            classify=classify_store_read,
        )
        self.timeline: Timeline | None = None  # set while hooks.trace() records

    # ---------------------------------------------------------------- unpack
    def claim(self, rec: Record) -> Future[Any] | None:
        """Take the read running ahead for ``rec``, or ``None`` (lock held).

        Without one, the cursor jumps to just below ``rec`` (NOTE [ Prefetch order ]).
        """
        fut = rec.fetch
        if fut is not None:
            rec.fetch = None
            self._window -= rec.nbytes
            self._stats.hold(-rec.nbytes)
        else:
            self.cursor = rec.pos - 1
        return fut

    def take(self, rec: Record, fut: Future[Any] | None, t0: float) -> torch.Tensor:
        """The tensor of ``rec`` from ``fut`` (a hit) or a read of its own (a miss)."""
        if fut is not None:
            self._stats.prefetch_hits += 1
            with span(UNPACK_WAIT_RANGE, self.timeline):  # NOTE [ Profiler ranges ]
                try:
                    out = fut.result()
                except CancelledError:
                    out = self.read(rec)
                # Any other error is final: that read had the whole deadline already.
        else:
            self._stats.prefetch_misses += 1
            self.fill()
            with span(UNPACK_WAIT_RANGE, self.timeline):
                out = self.read(rec)
        self._stats.unpack_stall_s += time.perf_counter() - t0
        self.fill()
        return self._stager.finish(out)

    # ------------------------------------------------------------------ read
    def read(self, rec: Record) -> Any:
        """Read one record back: from its host copy if it has one, else from the store,
        retrying transient errors until the deadline.

        Returns the tensor on its device (an accelerator: ``(tensor, event)`` for
        :meth:`DeviceStager.finish`). Runs on I/O threads and the caller's.
        """
        out = self._stager.from_host(rec)  # held in the host tier, or not yet written
        if out is not None:
            return out
        key = rec.key
        if key is None:
            raise StoreUnavailableError(
                f"offload: a saved tensor was freed before it was read ({self._store.url})"
            )
        t0 = time.perf_counter()
        with span(READ_RANGE, self.timeline, {"bytes": rec.nbytes}):  # NOTE [ Profiler ranges ]
            t = self._get(key)
        read_s = time.perf_counter() - t0
        with self._table.lock:  # reader threads run this concurrently
            self._stats.bytes_read += rec.nbytes
            self._stats.read_s += read_s
        log.debug("read: record %d, %d B in %.2f ms", rec.pos, rec.nbytes, read_s * 1e3)
        self._heap.note(rec.nbytes)
        t = t.detach()
        if self._stager.accelerated(rec.device):
            return self._stager.to_device(t, rec.device, rec.offset)
        if rec.device.type != "cpu":
            return t.to(rec.device)
        return t

    def _get(self, key: str) -> torch.Tensor:
        try:
            return self._retrier.call(
                f"reading key {key!r}", lambda _left_s: self._store.get(key, device="cpu")
            )
        except RetriesExhausted as e:
            raise StoreUnavailableError(
                f"offload: reading key {key!r} from {self._store.url} failed "
                f"({e.attempts} attempt(s) over {e.elapsed_s:.1f}s, read_deadline_s="
                f"{self.read_deadline_s:g}): {type(e.cause).__name__}: {e.cause}"
            ) from e.cause

    def restart(self) -> None:
        """A backward begins: read ahead from the newest record down."""
        with self._table.lock:
            self.cursor = self._table.end - 1
        self.fill()

    def fill(self) -> None:
        """Start reads ahead of backward within the window (NOTE [ Prefetch order ])."""
        if self.window_bytes <= 0:
            return
        submit = []
        table = self._table
        with table.lock:
            while self.cursor >= 0:
                rec = table.at(self.cursor)
                if rec is not None and rec.state in _READABLE and rec.fetch is None:
                    if self._window and self._window + rec.nbytes > self.window_bytes:
                        break
                    rec.fetch = Future()  # a placeholder: claimed, submitted below
                    self._window += rec.nbytes
                    self._stats.hold(rec.nbytes)
                    submit.append(rec)
                self.cursor -= 1
        pool = self._io() if submit else None
        for rec in submit:
            assert pool is not None
            fut = pool.submit(READ, self.read, rec)
            with table.lock:
                if rec.fetch is not None:
                    rec.fetch = fut
                else:
                    fut.cancel()

    # --------------------------------------------------------------- release
    def forget(self, rec: Record) -> None:
        """``rec`` was freed: cancel its read ahead (lock held)."""
        if rec.fetch is not None:
            rec.fetch.cancel()
            rec.fetch = None
            self._window -= rec.nbytes
            self._stats.hold(-rec.nbytes)

    def reset(self) -> None:
        """Nothing is live: start over (lock held)."""
        self.cursor = -1
        self._stats.hold(-self._window)
        self._window = 0
