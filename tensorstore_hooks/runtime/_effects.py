"""Process-wide effects of the library: only while a pipeline lives, each said once.

NOTE [ Process-wide effects ]
A library leaves its host process as it found it. A few things here reach beyond
one pipeline; each happens only while at least one pipeline (the one behind an
``OffloadHooks`` not yet closed) lives, is undone when the last one ends, is logged
once per process at DEBUG when it first happens, and has a switch (docs/config.md,
"Process-wide effects"):

1. SIGINT/SIGTERM handlers are wrapped (NOTE [ Signals and finalizers ]) by a
   ``with hooks:`` on the main thread, and put back (if still ours) when the last
   pipeline ends. Off: ``TSH_SIGNAL_SHIELD=0`` in the environment (a Ctrl-C
   that lands inside a finalizer of ours is then lost, as Python loses it anywhere).
2. glibc's mmap threshold (NOTE [ Mmap threshold ]) is set while a pipeline with
   ``pipeline.mmap_threshold`` moves bytes: from its first stored tensor
   (:meth:`PipelineEffects.moving`) until a forward that stores nothing ends with
   nothing of it left in the store (:meth:`PipelineEffects.idle`), or it ends. A
   pipeline that never stores (an ``auto`` budget with room, an idle ``hooks``) never
   sets it. When the last pipeline that moved bytes stops, glibc gets the ceiling its
   dynamic threshold climbs to (32 MiB; it has no call that turns the dynamic rule on
   again). Off: ``pipeline.mmap_threshold: null``.
3. ``malloc_trim`` (NOTE [ Heap release ]) is called by the I/O threads while a
   pipeline moves bytes; it changes no setting. Off: ``pipeline.release_heap_every: 0``.
4. Global module forward hooks (NOTE [ Wrap hooks ]) are registered while a model is
   ``tsh.wrap``-ped and removed after the last unwrap. Off: use ``tsh.offload()``.
5. An ``atexit`` handler that stops the I/O threads is registered while an I/O pool
   exists (``pipeline/_iopool.py``), and unregistered when the last one shuts down.

Nothing is registered at import (no at-fork handlers either: NOTE [ Fork safety ]).
"""

from __future__ import annotations

import logging
import os
import threading

from tensorstore_hooks.runtime._heap import (
    GLIBC_MMAP_THRESHOLD_MAX,
    release_mmap_threshold,
    set_mmap_threshold,
)
from tensorstore_hooks.runtime._signals import install as install_signal_shield
from tensorstore_hooks.runtime._signals import restore as restore_signals

__all__ = [
    "SIGNAL_SHIELD_ENV",
    "PipelineEffects",
    "live_pipelines",
    "mmap_threshold_set",
    "say_once",
    "shield_signals",
    "signal_shield_enabled",
]

log = logging.getLogger("tensorstore_hooks")

SIGNAL_SHIELD_ENV = "TSH_SIGNAL_SHIELD"
"""``0`` (or ``off``/``false``/``no``): never wrap the SIGINT/SIGTERM handlers."""

_lock = threading.Lock()
_live = 0
_movers = 0  # pipelines moving bytes with an mmap threshold (effect 2)
_mmap_set = False
_said: set[str] = set()


def say_once(topic: str, message: str, *args: object) -> None:
    """Log ``message`` at DEBUG the first time ``topic`` comes up in this process."""
    with _lock:
        if topic in _said:
            return
        _said.add(topic)
    log.debug(message, *args)


def live_pipelines() -> int:
    """Pipelines begun and not yet ended in this process."""
    return _live


def signal_shield_enabled() -> bool:
    """Whether the signal shield may be installed (``TSH_SIGNAL_SHIELD``; default on)."""
    value = os.environ.get(SIGNAL_SHIELD_ENV, "").strip().lower()
    return value not in ("0", "off", "false", "no")


def shield_signals() -> None:
    """Wrap the SIGINT/SIGTERM handlers (effect 1) if a pipeline lives and the switch
    allows; call on entering a hooks block (a no-op off the main thread)."""
    if _live and signal_shield_enabled() and install_signal_shield():
        say_once(
            "signals",
            "tensorstore-hooks: SIGINT/SIGTERM handlers wrapped while pipelines live, so a "
            "Ctrl-C never cuts a finalizer in half (NOTE [ Process-wide effects ]; "
            "%s=0 turns it off)",
            SIGNAL_SHIELD_ENV,
        )


def mmap_threshold_set() -> bool:
    """Whether a pipeline's mmap threshold is in force now (effect 2)."""
    return _mmap_set


class PipelineEffects:
    """One pipeline's share of the process-wide effects; :meth:`end` gives it back.

    ``mmap_threshold``: the pipeline's ``pipeline.mmap_threshold`` (``None``: leave
    glibc alone), in force only between :meth:`moving` and :meth:`idle` (effect 2);
    ``trim_every_bytes``: how often its I/O threads call ``malloc_trim`` (0: never),
    only said here. Called on the thread that packs and unpacks.
    """

    __slots__ = ("_ended", "_moving", "_threshold")

    def __init__(self, mmap_threshold: int | None, trim_every_bytes: int) -> None:
        global _live
        self._ended = False
        self._moving = False
        self._threshold = mmap_threshold
        with _lock:
            _live += 1
        if trim_every_bytes:
            say_once(
                "trim",
                "tensorstore-hooks: malloc_trim(0) after every %d B the I/O threads move "
                "(NOTE [ Process-wide effects ]; pipeline.release_heap_every: 0 turns it off)",
                trim_every_bytes,
            )

    def moving(self) -> None:
        """The pipeline stores a tensor: its mmap threshold is in force (effect 2)."""
        global _movers, _mmap_set
        if self._moving or self._threshold is None:
            return
        with _lock:
            if self._moving or self._ended:
                return
            self._moving = True
            _movers += 1
        if set_mmap_threshold(self._threshold):
            with _lock:
                _mmap_set = True
            say_once(
                "mmap",
                "tensorstore-hooks: glibc mmap threshold set to %d B while pipelines move "
                "bytes (NOTE [ Process-wide effects ]; pipeline.mmap_threshold: null leaves it)",
                self._threshold,
            )

    def idle(self) -> None:
        """The pipeline moves no bytes any more: the last such gives glibc its dynamic
        ceiling back (effect 2). Idempotent; :meth:`moving` claims it again."""
        global _movers, _mmap_set
        with _lock:
            if not self._moving:
                return
            self._moving = False
            _movers -= 1
            reset = _movers == 0 and _mmap_set
            if reset:
                _mmap_set = False
        if reset:
            release_mmap_threshold()
            say_once(
                "mmap back",
                "tensorstore-hooks: no pipeline moves bytes: glibc mmap threshold back at its "
                "dynamic ceiling, %d B",
                GLIBC_MMAP_THRESHOLD_MAX,
            )

    def end(self) -> None:
        """The pipeline ended: undo the effects if it was the last (idempotent)."""
        global _live
        self.idle()
        with _lock:
            if self._ended:
                return
            self._ended = True
            _live -= 1
            last = _live == 0
        if last:
            restore_signals()
