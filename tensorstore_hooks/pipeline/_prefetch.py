"""The prefetcher: stored records read back ahead of backward, newest first.

NOTE [ Prefetch order ]
Backward unpacks roughly in reverse pack order. Records sit in the record table in
pack order; each unpack of a stored record moves a cursor to just below it, and the
prefetcher walks the cursor downwards (newest first), reading records ahead (stored
ones from the store, held ones from the host tier: NOTE [ Host tier wiring ]) while
the bytes read but not yet consumed stay within the ``prefetch`` window. The cursor
and the window are the record table's (:class:`~tensorstore_hooks.pipeline._records.ReadAhead`,
and ``claim_for_unpack``); the prefetcher runs the reads. An unpack
that finds its read already done or running is a hit; one that has to start its own
read is a miss. Out-of-order access (branches, several graphs) is correct, only
slower: the cursor simply jumps.

The window counts what a read brings back onto the device (its span, rounded: rule 7
of NOTE [ Stream ordering ]), not the tensor's element bytes. A record whose saved
tensor is still in memory is never read ahead (unpack returns the tensor itself).
Each read ahead runs into the very future the record table gave the record when it
planned the read, so an unpack on another thread that claims it before the read
has even been submitted waits for that read, not for a placeholder.

A read has one deadline, ``read_deadline_s``, from its first attempt: reads retry in
the library's one retry loop (NOTE [ One retry layer ] in ``storage/_retry.py``) with
:func:`~tensorstore_hooks.storage._retry.classify_store_read`, and a read ahead that failed
is final for its unpack (it already had the whole deadline) rather than retried again,
except for one that ran out of device memory: reading ahead runs at backward's peak,
so that unpack reads on demand instead, and reads ahead stop until the next backward.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future

import torch

from tensorstore_hooks.errors import StoreUnavailableError
from tensorstore_hooks.pipeline._device import DeviceStager
from tensorstore_hooks.pipeline._iopool import READ, StorePool
from tensorstore_hooks.pipeline._records import ReadAhead, Record
from tensorstore_hooks.pipeline._staging import Loaded
from tensorstore_hooks.pipeline._stats import OffloadStats, count_transfer
from tensorstore_hooks.pipeline._timeline import (
    READ_RANGE,
    UNPACK_WAIT_RANGE,
    Timeline,
    ranges_off,
    span,
)
from tensorstore_hooks.runtime import HeapReleaser
from tensorstore_hooks.storage import Retrier, RetriesExhausted, RetryPolicy, classify_store_read

__all__ = ["Prefetcher"]

log = logging.getLogger("tensorstore_hooks")


class Prefetcher:
    """Reads records back from ``io.store`` ahead of backward, on its I/O pool ``io()``;
    :meth:`read` is the one way bytes come back. ``heap`` is told of every byte read."""

    def __init__(
        self,
        reads: ReadAhead,
        io: StorePool,
        *,
        stager: DeviceStager,
        heap: HeapReleaser,
        stats: OffloadStats,
        read_deadline_s: float,
    ) -> None:
        self._reads = reads
        self._io, self._store, self._heap = io, io.store, heap  # where bytes come from
        self._stager = stager
        self._stats = stats
        self._stats_lock = threading.Lock()  # reader threads add up their times
        self.on_window: Callable[[int], None] | None = None
        """Told every new window (the pipeline sizes the store's idle read buffers)."""
        self._window_bytes = 0
        self.read_deadline_s = read_deadline_s
        self._retrier = Retrier(
            RetryPolicy(
                deadline_s=max(read_deadline_s, 1e-3),
                first_backoff_s=0.01,
                max_backoff_s=1.0,
                min_attempt_s=0.0,
            ),
            label=f"offload reads from {self._store.url}",
            classify=classify_store_read,
        )
        self.timeline: Timeline | None = None  # set while hooks.trace() records
        self._out_of_memory = False  # a read ahead ran out of device memory: stop

    @property
    def window_bytes(self) -> int:
        """Bytes read ahead and not yet unpacked, at most (``prefetch``, NOTE [ Windows ])."""
        return self._window_bytes

    @window_bytes.setter
    def window_bytes(self, nbytes: int) -> None:
        changed = nbytes != self._window_bytes
        self._window_bytes = nbytes
        if changed and self.on_window is not None:
            self.on_window(nbytes)

    # ---------------------------------------------------------------- unpack
    def take(self, rec: Record, fut: Future[Loaded] | None, t0: float) -> Loaded:
        """The tensor of ``rec`` from ``fut`` (a hit) or a read of its own (a miss),
        ordered on the current stream, and the event its copy completed on (for a
        later unpack on another stream: rule 8 of NOTE [ Record lifecycle ])."""
        out: Loaded | None = None
        if fut is not None:
            if ranges_off(self.timeline):  # nobody would see the wait's range
                out = _result(fut)
            else:
                with span(UNPACK_WAIT_RANGE, self.timeline):  # NOTE [ Profiler ranges ]
                    out = _result(fut)
        if out is not None:
            self._stats.prefetch_hits += 1
        else:
            self._stats.prefetch_misses += 1
            self.fill()
            with span(UNPACK_WAIT_RANGE, self.timeline):
                out = self.read(rec)
        self._stats.unpack_stall_s += time.perf_counter() - t0
        self.fill()
        return self._stager.finish(out), out[1]

    # ------------------------------------------------------------------ read
    def read(self, rec: Record) -> Loaded:
        """Read one record back: from its host copy if it has one, else from the store,
        retrying transient errors until the deadline.

        Returns the tensor on its device, with the event its copy there completes on
        (for :meth:`DeviceStager.finish`). Runs on I/O threads and the caller's.
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
        with self._stats_lock:  # reader threads run this concurrently
            self._stats.bytes_read += rec.nbytes
            count_transfer(self._stats, self._store, key, rec.nbytes)
            self._stats.read_s += read_s
        log.debug("read: record %d, %d B in %.2f ms", rec.pos, rec.nbytes, read_s * 1e3)
        self._heap.note(rec.nbytes)
        t = t.detach()
        if self._stager.accelerated(rec.device):
            return self._stager.to_device(t, rec.device)
        if rec.device.type != "cpu":
            return t.to(rec.device), None
        return t, None

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
        self._out_of_memory = False
        self._reads.restart()
        self.fill()

    def fill(self) -> None:
        """Start reads ahead of backward within the window (NOTE [ Prefetch order ])."""
        window = self._window_bytes  # not the property: every unpack runs this
        if window <= 0 or self._out_of_memory:
            return
        planned = self._reads.plan(window)
        if not planned:
            return
        pool = self._io()
        for i, (rec, fut) in enumerate(planned):
            try:
                pool.submit(READ, self._read_ahead, rec, fut)
            except RuntimeError:  # the pool shut down (the store closed): read on demand
                for _, left in planned[i:]:
                    left.cancel()
                return

    def _read_ahead(self, rec: Record, fut: Future[Loaded]) -> None:
        """I/O thread: run one read ahead into ``fut`` (unless freed meanwhile)."""
        if not fut.set_running_or_notify_cancel():
            return
        out: Loaded | None = None
        error: BaseException | None = None
        try:
            out = self.read(rec)
        except BaseException as e:
            error = e
        if isinstance(error, torch.OutOfMemoryError) and not self._out_of_memory:
            self._out_of_memory = True
            log.info("read ahead: out of device memory; reading on demand this backward")
        if error is not None:
            fut.set_exception(error)
        else:
            assert out is not None
            fut.set_result(out)
        # A logged error's traceback keeps this frame alive: it must not keep the read
        # (whose error holds the unpacking frames, and their handles) with it.
        del fut, out, error, rec


def _result(fut: Future[Loaded]) -> Loaded | None:
    """A read ahead's tensor; ``None``: freed meanwhile, or no device memory ahead (the
    caller reads now). Any other error is final: that read had the whole deadline."""
    try:
        return fut.result()
    except (CancelledError, torch.OutOfMemoryError):
        return None
