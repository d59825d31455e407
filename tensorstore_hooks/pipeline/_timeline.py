"""Visibility: profiler ranges for our work, and a Chrome/Perfetto timeline of our I/O.

NOTE [ Profiler ranges ]
Every piece of work the hooks do runs inside a ``torch.profiler.record_function``
range (and an NVTX range when CUDA is initialised, for Nsight Systems):

    tsh::pack          the pack hook (policy, queueing; a max_inflight stall inside)
    tsh::unpack        the unpack hook
    tsh::unpack_wait   unpack waiting for bytes from the store (inside tsh::unpack)
    tsh::write         a writer thread putting one tensor into the store
    tsh::read          a reader thread getting one tensor (prefetch or on demand)

torch.profiler records the training thread by default, so pack, unpack and the
waits show in any trace; our I/O threads show with
``experimental_config=torch._C._profiler._ExperimentalConfig(profile_all_threads=True)``.
``hooks.trace(path)`` (``Pipeline.trace``) records all of them, plus forward and
backward spans, into a Chrome trace JSON (open in https://ui.perfetto.dev or
chrome://tracing) with no profiler at all.

Cost when nothing listens: nothing. With no ``hooks.trace()``, no profiler recording
and CUDA not initialised, pack and unpack skip their range (:func:`ranges_off`: one
call instead of about ten); otherwise one ``record_function`` enter/exit per tensor
(about a microsecond).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from typing import TypeAlias

import torch

__all__ = [
    "PACK_RANGE",
    "READ_RANGE",
    "UNPACK_RANGE",
    "UNPACK_WAIT_RANGE",
    "WRITE_RANGE",
    "SpanArgs",
    "Timeline",
    "TraceEvent",
    "span",
]

PACK_RANGE = "tsh::pack"
UNPACK_RANGE = "tsh::unpack"
UNPACK_WAIT_RANGE = "tsh::unpack_wait"
WRITE_RANGE = "tsh::write"
READ_RANGE = "tsh::read"

SpanArgs: TypeAlias = dict[str, int | str]
"""What a span adds to its event (``{"bytes": 4096}``), shown by the trace viewer."""
TraceEvent: TypeAlias = dict[str, str | int | float | SpanArgs | None]
"""One Chrome trace event (``name``, ``ph``, ``ts`` ... as the trace format names them)."""

_record_function = torch.profiler.record_function


def _nvtx_on() -> bool:
    # Only once CUDA is initialised: asking earlier would initialise it.
    return torch.cuda.is_available() and torch.cuda.is_initialized()


_profiler_enabled = torch._C._autograd._profiler_enabled  # this thread's profiler
_autograd_profiler = torch.autograd.profiler  # its module flag: any profiler, all threads


def ranges_off(timeline: Timeline | None) -> bool:
    """Whether a range would be seen by nobody: no ``hooks.trace()``, no profiler
    recording, CUDA (and so NVTX) not initialised. The hooks' fast path then skips
    :func:`span` (about ten Python calls per pack and unpack)."""
    # torch.cuda._initialized: a module flag, read without initialising CUDA
    return (
        timeline is None
        and not _autograd_profiler._is_profiler_enabled
        and not _profiler_enabled()
        and not torch.cuda._initialized
    )


class Timeline:
    """Chrome trace events of one pipeline, collected from any thread.

    ``span()`` adds a complete event; forward and backward spans come from
    :meth:`forward_begin`/:meth:`forward_end` and the unpacks between forwards.
    :meth:`write` saves ``{"traceEvents": [...]}`` JSON (times in microseconds).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._lock = threading.Lock()
        self._events: list[TraceEvent] = []
        self._threads: dict[int, str] = {}
        self._t0_ns = time.perf_counter_ns()
        self._pid = os.getpid()
        self._forward_ns: int | None = None
        self._backward: list[int] | None = None  # [first unpack start, last unpack end]

    def now_ns(self) -> int:
        return time.perf_counter_ns()

    def span(
        self, name: str, start_ns: int, end_ns: int, args: SpanArgs | None = None
    ) -> None:
        """Record ``name`` from ``start_ns`` to ``end_ns`` (``perf_counter_ns``) on this thread."""
        thread = threading.current_thread()
        event: TraceEvent = {
            "name": name,
            "cat": "tensorstore-hooks",
            "ph": "X",
            "ts": (start_ns - self._t0_ns) / 1e3,
            "dur": max(end_ns - start_ns, 0) / 1e3,
            "pid": self._pid,
            "tid": thread.ident,
        }
        if args:
            event["args"] = args
        with self._lock:
            self._events.append(event)
            if thread.ident is not None and thread.ident not in self._threads:
                self._threads[thread.ident] = thread.name
        if name == UNPACK_RANGE:
            self._note_unpack(start_ns, end_ns)

    def _note_unpack(self, start_ns: int, end_ns: int) -> None:
        with self._lock:
            if self._backward is None:
                self._backward = [start_ns, end_ns]
            else:
                self._backward[1] = max(self._backward[1], end_ns)

    def _close_backward(self) -> None:
        with self._lock:
            bwd, self._backward = self._backward, None
        if bwd is not None:
            self._phase("backward", bwd[0], bwd[1])

    def _phase(self, name: str, start_ns: int, end_ns: int) -> None:
        with self._lock:
            self._events.append(
                {
                    "name": name,
                    "cat": "phase",
                    "ph": "X",
                    "ts": (start_ns - self._t0_ns) / 1e3,
                    "dur": max(end_ns - start_ns, 0) / 1e3,
                    "pid": self._pid,
                    "tid": 0,
                }
            )

    def forward_begin(self) -> None:
        """A forward under the hooks starts: the previous backward (if any) ended."""
        self._close_backward()
        self._forward_ns = self.now_ns()

    def forward_end(self) -> None:
        start, self._forward_ns = self._forward_ns, None
        if start is not None:
            self._phase("forward", start, self.now_ns())

    @property
    def events(self) -> list[TraceEvent]:
        """The events so far, metadata included (a copy)."""
        self._close_backward()
        with self._lock:
            meta: list[TraceEvent] = [
                {
                    "name": "thread_name",
                    "ph": "M",
                    "pid": self._pid,
                    "tid": tid,
                    "args": {"name": name},
                }
                for tid, name in sorted(self._threads.items())
            ]
            meta.append(
                {
                    "name": "thread_name",
                    "ph": "M",
                    "pid": self._pid,
                    "tid": 0,
                    "args": {"name": "forward / backward"},
                }
            )
            meta.append(
                {
                    "name": "process_name",
                    "ph": "M",
                    "pid": self._pid,
                    "tid": 0,
                    "args": {"name": "tensorstore-hooks"},
                }
            )
            return meta + list(self._events)

    def write(self) -> None:
        """Save the timeline as Chrome trace JSON at :attr:`path`."""
        doc = {"traceEvents": self.events, "displayTimeUnit": "ms"}
        tmp = f"{self.path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f)
        os.replace(tmp, self.path)


@contextlib.contextmanager
def span(
    name: str, timeline: Timeline | None, args: SpanArgs | None = None
) -> Iterator[None]:
    """A profiler range (NOTE [ Profiler ranges ]) that also lands in ``timeline`` if given."""
    nvtx = _nvtx_on()
    start = time.perf_counter_ns() if timeline is not None else 0
    if nvtx:
        torch.cuda.nvtx.range_push(name)
    try:
        with _record_function(name):
            yield
    finally:
        if nvtx:
            torch.cuda.nvtx.range_pop()
        if timeline is not None:
            timeline.span(name, start, time.perf_counter_ns(), args)
