"""Keeping Ctrl-C out of the code that must not be cut in half.

NOTE [ Signals and finalizers ]
Python runs a signal handler on the main thread between two bytecodes of whatever
Python code runs there. When backward frees the graph, that code is often a
finalizer of ours (a saved tensor's handle died: free its record, delete its key).
A ``KeyboardInterrupt`` raised inside a finalizer cannot propagate: Python prints
"Exception ignored in: <finalize object>", the interrupt is lost (backward goes on),
and the half-run finalizer leaks the key. No code inside the finalizer can prevent
it: the interrupt may land on its first bytecode, before any ``try``.

So the handler decides. :func:`shielded` marks the functions that must run to the
end (the handle finalizer, the few lines of pack that register a record). While
tensorstore-hooks is in use, :func:`install` wraps the process's Python-level
SIGINT (and SIGTERM, when Python handles it) handler: called inside a shielded
function (any frame of the interrupted stack is one), it does not raise but hands
the signal to a helper thread, which delivers it again a moment later
(``_thread.interrupt_main``); outside, it calls the wrapped handler at once. The
interrupt therefore arrives, a few milliseconds late, in the user's code (or in
backward, which stops), and every finalizer runs to the end: nothing leaks.

Only the main thread runs signal handlers, so finalizers on other threads need
nothing. A handler installed by the user after ours replaces it (theirs wins);
the next ``with hooks:`` wraps theirs in turn. The wrapping lasts only while
pipelines live and can be turned off (NOTE [ Process-wide effects ] in
``runtime/_effects.py``): :func:`restore` puts the wrapped handlers back.
"""

from __future__ import annotations

import _thread
import queue
import signal
import threading
import time
from collections.abc import Callable
from types import CodeType, FrameType
from typing import TypeVar

__all__ = ["install", "restore", "restore_if_pending", "shielded"]

F = TypeVar("F", bound=Callable[..., object])

_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM") if hasattr(signal, name))
_REDELIVER_AFTER_S = 0.002
"""Pause before a deferred signal is raised again (the finalizer is a few µs long)."""

_codes: set[CodeType] = set()
_pending: queue.SimpleQueue[int] = queue.SimpleQueue()
_lock = threading.Lock()
_courier: threading.Thread | None = None


def shielded(fn: F) -> F:
    """Mark ``fn`` as code a signal must not interrupt (see NOTE [ Signals and finalizers ])."""
    _codes.add(fn.__code__)
    return fn


def _inside_shield(frame: FrameType | None) -> bool:
    while frame is not None:
        if frame.f_code in _codes:
            return True
        frame = frame.f_back
    return False


class _DeferringHandler:
    """Wraps a Python signal handler; defers the signal while shielded code runs."""

    __slots__ = ("wrapped",)

    def __init__(self, wrapped: Callable[[int, FrameType | None], object]) -> None:
        self.wrapped = wrapped

    def __call__(self, signum: int, frame: FrameType | None) -> object:
        if _inside_shield(frame):
            _defer(signum)
            return None
        return self.wrapped(signum, frame)


def _defer(signum: int) -> None:
    global _courier
    _pending.put(signum)
    with _lock:
        if _courier is None or not _courier.is_alive():
            _courier = threading.Thread(target=_deliver, name="tsh-signal", daemon=True)
            _courier.start()


def _deliver() -> None:
    # Raise each deferred signal again once the main thread has (most likely) left
    # the shielded code; if it has not, the handler defers it once more.
    while True:
        signum = _pending.get()
        time.sleep(_REDELIVER_AFTER_S)
        _thread.interrupt_main(signal.Signals(signum))


def install() -> bool:
    """Wrap the Python-level handlers of SIGINT/SIGTERM once; call on the main thread.

    A no-op elsewhere, for signals Python does not handle (``SIG_DFL``, ``SIG_IGN``),
    and for handlers already wrapped. Cheap enough for every ``__enter__``. Returns
    whether a handler was wrapped now.
    """
    global _restore_pending
    if threading.current_thread() is not threading.main_thread():
        return False
    _restore_pending = False
    wrapped = False
    for signum in _SIGNALS:
        current = signal.getsignal(signum)
        if isinstance(current, _DeferringHandler) or not callable(current):
            continue
        try:
            signal.signal(signum, _DeferringHandler(current))
        except (ValueError, OSError):  # pragma: no cover - not the main interpreter
            return wrapped
        wrapped = True
    return wrapped


_restore_pending = False


def restore() -> None:
    """Put back the handlers :func:`install` wrapped, where they are still ours.

    Only the main thread may set handlers: called on another one, this is done at
    the next call on the main thread (meanwhile the wrapper defers nothing, since no
    shielded code of a live pipeline can run, and acts as the handler it wraps).
    """
    global _restore_pending
    if threading.current_thread() is not threading.main_thread():
        _restore_pending = True
        return
    _restore_pending = False
    for signum in _SIGNALS:
        current = signal.getsignal(signum)
        if isinstance(current, _DeferringHandler):
            try:
                signal.signal(signum, current.wrapped)
            except (ValueError, OSError):  # pragma: no cover - not the main interpreter
                return


def restore_if_pending() -> None:
    """Finish a :func:`restore` asked for on another thread (call on the main thread)."""
    if _restore_pending:
        restore()
