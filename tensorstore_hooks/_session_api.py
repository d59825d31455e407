"""The public surface both ``OffloadHooks`` (PyTorch and Paddle) share.

Each framework wires its own pack and unpack; what a caller reads and calls on
the result (``stats``, ``store``, ``policy``, ``flush()``, ``close()``) is one
:class:`~tensorstore_hooks._pipeline.OffloadSession` underneath, so it lives here
once.
"""

from __future__ import annotations

import os
import weakref
from contextlib import AbstractContextManager
from typing import Any

from ._pipeline import OffloadSession
from ._router import Router
from ._stats import OffloadStats
from ._store import TensorStore

__all__ = ["SessionAPI"]


class SessionAPI:
    """Mixin: the session accessors of an ``OffloadHooks``; call :meth:`_bind` first."""

    _session: OffloadSession

    def _bind(self, session: OffloadSession) -> None:
        self._session = session
        # An owned store is closed when the hooks are collected and nothing is live.
        self._finalizer = weakref.finalize(self, session.close)
        self._finalizer.atexit = False

    @property
    def stats(self) -> OffloadStats:
        """Counters of this session (live; readable during and after backward)."""
        return self._session.stats

    @property
    def store(self) -> TensorStore:
        """The store saved tensors go to."""
        return self._session.store

    @property
    def policy(self) -> Any:
        """The :class:`~tensorstore_hooks.Policy` in force."""
        return self._session.policy

    @property
    def settings(self) -> Any:
        """The pipeline settings in force (the config's ``pipeline:`` section, resolved)."""
        return self._session.settings

    @property
    def router(self) -> Router:
        """The :class:`~tensorstore_hooks.Router` that packs and unpacks for these hooks."""
        return self._session.router

    @property
    def live_records(self) -> int:
        """Saved tensors in the store or in flight whose graph is still alive (0 once freed)."""
        return self._session.live_records

    def trace(self, path: str | os.PathLike[str]) -> AbstractContextManager[Any]:
        """Record a Chrome/Perfetto timeline of this session's work while the block runs.

        ``with hooks.trace("trace.json"): ...train steps...``: forward and backward
        spans, and every pack, unpack, unpack wait, write and read (with its thread),
        saved as Chrome trace JSON at ``path`` on exit (open it in
        https://ui.perfetto.dev). See NOTE [ Profiler ranges ] for torch.profiler.
        """
        from ._trace import record

        return record(self._session, path)

    def flush(self) -> None:
        """Block until every pending write has reached the store.

        Leaving the ``with`` block does not wait: backward wants the newest tensors
        first and may take them straight from memory.
        """
        self._session.flush()

    def close(self) -> None:
        """Stop offloading; an owned store is closed once backward has freed every key.

        A fallback warning still pending (a write refused after the last hook
        call) is issued here, so a refusal is never silent.
        """
        self._session.close()
        self._session.emit_warning()
