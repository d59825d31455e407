"""The record table: one record per offloaded tensor, its state, and who still holds it.

NOTE [ Record lifecycle ]
``Router.store`` creates a :class:`Record` (or reuses one, see dedup below) and
returns a :class:`Handle` pointing at it; autograd keeps the handle in its graph. A
record moves only along :data:`TRANSITIONS`, through :meth:`Record.move`:

    QUEUED -> WRITING -> STORED            the normal path (write-behind)
    HELD -> QUEUED                         held in the host tier, then spilled
                                           (NOTE [ Host tier wiring ] in ``_device.py``)
    HELD -> DIRTY                          held, modified in place before the copy ran
    QUEUED/WRITING -> MEMORY               tail shortcut (unpack came first) or a
                                           failed/refused write (fallback)
    QUEUED/WRITING -> DIRTY                modified in place before it was copied
    any -> FREED                           the last handle died (graph freed)

Any other move is a bug in tensorstore-hooks and raises :class:`IllegalTransition`.
The record holds the source tensor until its bytes are in the store, then drops it,
which is what frees activation memory. Stored bytes are deleted only when the last
handle dies (a weak reference's callback, shielded from signals: NOTE [ Signals and
finalizers ] in ``_signals.py``), never on unpack: unpack may run many times
(``retain_graph=True``, double backward).

Dedup: a tensor saved twice (``exp`` saves its output, and so do the ``sin`` and
``cos`` that read it) is written once. The key is the storage address plus view and
version, but an address is reused by the allocator as soon as a tensor dies, so a hit
is trusted only while a weak reference proves the first saver is still alive.

NOTE [ Detached aliases ]
The pack hook receives the saved tensor with its ``grad_fn``; for ops that save their
own output (ReLU, attention) that ``grad_fn`` is the very node that holds our handle.
Anything we keep that references the tensor itself closes a cycle through C++ that
Python's collector cannot see: the graph would outlive ``del loss`` (forever for a
kept tensor, until its write ends for a stored one). So records and kept handles hold
``t.detach()``: the same storage and the same version counter, no autograd history.
Unpack returns it as is; autograd re-attaches the history it saved itself.

Locking: one re-entrant lock, :attr:`RecordTable.lock`, guards every record and the
units that work on them (write-behind, prefetcher, device stager); finalizers of graph
nodes may run while it is held.
"""

from __future__ import annotations

import enum
import os
import threading
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

import torch

from ._eager import never_compiled
from ._forks import foreign
from ._signals import shielded

__all__ = [
    "TRANSITIONS",
    "Handle",
    "IllegalTransition",
    "Record",
    "RecordTable",
    "State",
]


class State(enum.IntEnum):
    """Where a record's bytes are: see NOTE [ Record lifecycle ]."""

    QUEUED = 0
    WRITING = 1
    STORED = 2
    MEMORY = 3
    DIRTY = 4
    FREED = 5
    HELD = 6


TRANSITIONS: Mapping[State, frozenset[State]] = {
    State.QUEUED: frozenset({State.WRITING, State.MEMORY, State.DIRTY, State.FREED}),
    State.WRITING: frozenset({State.STORED, State.MEMORY, State.DIRTY, State.FREED}),
    State.STORED: frozenset({State.FREED}),
    State.MEMORY: frozenset({State.FREED}),
    State.DIRTY: frozenset({State.FREED}),
    State.FREED: frozenset(),
    State.HELD: frozenset({State.QUEUED, State.DIRTY, State.FREED}),
}
"""The allowed moves of NOTE [ Record lifecycle ]: state -> states it may move to."""


class IllegalTransition(RuntimeError):
    """Internal error: a record was asked to make a move the lifecycle forbids (a bug)."""


class Record:
    """One offloaded tensor. Fields are read and written under :attr:`RecordTable.lock`."""

    __slots__ = (
        "dedup_key",
        "device",
        "error",
        "fetch",
        "guard",
        "guard_ref",
        "host_rule",
        "key",
        "nbytes",
        "offset",
        "pos",
        "refs",
        "source",
        "staged",
        "state",
        "version",
        "write_started",
        "writing_done",
    )

    def __init__(
        self, t: torch.Tensor, nbytes: int, pos: int, guard: Any = None, state: State = State.QUEUED
    ) -> None:
        # The saved tensor until its bytes are stored, detached: NOTE [ Detached aliases ].
        self.source: torch.Tensor | None = t.detach()
        # What in-place checks read ``_version`` from: the tensor itself, or for another
        # framework's tensor (seen here through a zero-copy alias) that tensor's counter.
        self.guard: Any = self.source if guard is None else guard
        self.version: int = self.guard._version
        # Outlives ``guard``: see NOTE [ In-place checks ].
        self.guard_ref = _weak(t if guard is None else guard)
        self.nbytes = nbytes
        self.device = t.device
        self.offset = int(t.storage_offset())
        self.state = state
        self.host_rule = False  # sent here by a ``host`` rule (counted as host, not offloaded)
        self.key: str | None = None
        self.refs = 1
        self.pos = pos
        self.fetch: Future[Any] | None = None  # the prefetcher's read, if one is running
        self.staged: Any = None  # the device stager's host copy (``_device.HostCopy``)
        self.dedup_key: tuple[Any, ...] | None = None
        self.error: BaseException | None = None  # why the write failed (fallback)
        self.write_started = False
        self.writing_done = threading.Event()  # set when the writer is finished with it

    def move(self, to: State) -> None:
        """Change state along :data:`TRANSITIONS`; raises :class:`IllegalTransition`."""
        if to not in TRANSITIONS[self.state]:
            raise IllegalTransition(
                f"tensorstore-hooks internal error: a record of {self.nbytes} bytes cannot "
                f"move {self.state.name} -> {to.name} (see NOTE [ Record lifecycle ]); "
                "please report this"
            )
        self.state = to

    def modified(self) -> bool:
        """True if the saved tensor changed in place since pack (NOTE [ In-place checks ]).

        After the write the tensor is gone from the record but its weak reference
        is not: a tensor still alive is still checked.
        """
        guard = self.guard
        if guard is None and self.guard_ref is not None:
            guard = self.guard_ref()
        return guard is not None and guard._version != self.version

    def drop_source(self) -> None:
        """Let go of the saved tensor (its bytes are elsewhere now, or unwanted)."""
        self.source = self.guard = None


def _weak(obj: Any) -> weakref.ref[Any] | None:
    try:
        return weakref.ref(obj)
    except TypeError:  # another framework's guard without weak references
        return None


class Handle:
    """What autograd keeps for an offloaded tensor: a pointer to its record."""

    __slots__ = ("__weakref__", "rec")

    def __init__(self, rec: Record) -> None:
        self.rec = rec


class _Finalizer(weakref.ref[Handle]):
    """A weak reference to a handle whose callback gives up its record: the finalizer.

    A plain ``weakref.ref`` callback rather than ``weakref.finalize``, whose own
    Python ``__call__`` would run before any shielded code (NOTE [ Signals and
    finalizers ]). Kept alive by :data:`_finalizers` (as ``weakref.finalize`` keeps
    its registry), which holds ``release`` strongly and the table not at all.
    """

    __slots__ = ("pid", "rec", "release")
    pid: int
    rec: Record
    release: Callable[[Record], None]

    def __new__(cls, handle: Handle, rec: Record, release: Callable[[Record], None]) -> _Finalizer:
        self = super().__new__(cls, handle, _handle_died)
        self.rec = rec
        self.release = release
        self.pid = os.getpid()  # NOTE [ Fork safety ]: a forked child's copy frees nothing
        return self

    def __init__(self, handle: Handle, rec: Record, release: Callable[[Record], None]) -> None:
        super().__init__(handle, _handle_died)  # type: ignore[call-arg]


_finalizers: set[_Finalizer] = set()
"""The finalizers of live handles (set operations are atomic under the GIL)."""


@never_compiled  # may run inside compiled code: NOTE [ torch.compile ], rule 3
@shielded  # NOTE [ Signals and finalizers ]: a signal must not cut this in half
def _handle_died(ref: _Finalizer) -> None:
    _finalizers.discard(ref)
    if not foreign(ref.pid):
        ref.release(ref.rec)


def dedup_key(t: torch.Tensor) -> tuple[Any, ...]:
    """Identity of a saved view; trusted only with a live weak reference (see the NOTE)."""
    return (
        t.untyped_storage().data_ptr(),
        t.storage_offset(),
        tuple(t.shape),
        tuple(t.stride()),
        t._version,
        t.dtype,
        t.device,
    )


class RecordTable:
    """Records in pack order, dedup, the live count and the handles' finalizers.

    ``on_last_handle(rec)`` runs (on whatever thread drops the last reference) when a
    handle dies; it calls :meth:`free`. It must be a bound method: the table keeps it
    weakly and each handle's finalizer strongly, so its owner lives while any handle
    does, yet owner -> table -> owner is no reference cycle (plain reference counting
    frees a session and its store, with no wait for the collector). Callers hold
    :attr:`lock` around every method but :meth:`handle`.
    """

    _COMPACT_MIN = 1024

    def __init__(self, on_last_handle: Callable[[Record], None]) -> None:
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self._on_last_handle = weakref.WeakMethod(on_last_handle)
        self._order: list[Record | None] = []
        self._live = 0
        self._dedup: dict[tuple[Any, ...], tuple[weakref.ref[torch.Tensor], Record]] = {}

    @property
    def live(self) -> int:
        """Records not yet freed."""
        return self._live

    @property
    def end(self) -> int:
        """One past the newest pack position."""
        return len(self._order)

    def at(self, pos: int) -> Record | None:
        """The record at pack position ``pos`` (``None`` once freed)."""
        return self._order[pos]

    def reuse(self, t: torch.Tensor, key: tuple[Any, ...] | None) -> Record | None:
        """The live record already holding ``t`` (one more reference taken), or ``None``."""
        hit = self._dedup.get(key) if key is not None else None
        if hit is None or key is None:
            return None
        ref, rec = hit
        alive = ref()
        if (
            alive is None
            or rec.state == State.FREED
            or alive.untyped_storage().data_ptr() != key[0]
        ):
            return None
        rec.refs += 1
        return rec

    def add(
        self,
        t: torch.Tensor,
        nbytes: int,
        guard: Any,
        key: tuple[Any, ...] | None,
        state: State = State.QUEUED,
    ) -> Record:
        """A new record for ``t`` (QUEUED, or HELD for the host tier), last in pack order."""
        rec = Record(t, nbytes, len(self._order), guard, state)
        self._order.append(rec)
        self._live += 1
        if key is not None:
            rec.dedup_key = key
            self._dedup[key] = (weakref.ref(t), rec)
        return rec

    def handle(self, rec: Record) -> Handle:
        """A handle for ``rec`` whose death gives up one reference to it."""
        release = self._on_last_handle()
        if release is None:
            raise IllegalTransition("tensorstore-hooks internal error: the session is gone")
        handle = Handle(rec)
        _finalizers.add(_Finalizer(handle, rec, release))
        return handle

    def free(self, rec: Record) -> State | None:
        """Drop one reference; on the last, move ``rec`` to FREED and return its old state.

        Returns ``None`` while other handles remain (or if already freed).
        """
        rec.refs -= 1
        if rec.refs > 0 or rec.state == State.FREED:
            return None
        prev = rec.state
        rec.move(State.FREED)
        if rec.dedup_key is not None:
            hit = self._dedup.get(rec.dedup_key)
            if hit is not None and hit[1] is rec:
                del self._dedup[rec.dedup_key]
        self._order[rec.pos] = None
        self._live -= 1
        if self._live == 0:
            self._order.clear()
        return prev

    def wants_compaction(self) -> bool:
        """True once freed slots dominate a long order list."""
        return len(self._order) > self._COMPACT_MIN and self._live * 4 < len(self._order)

    def compact(self, cursor: int) -> int:
        """Drop freed slots; returns where ``cursor`` (a pack position) now points."""
        order = self._order
        cursor_rec = None
        for i in range(min(cursor, len(order) - 1), -1, -1):
            if order[i] is not None:
                cursor_rec = order[i]
                break
        live = [r for r in order if r is not None]
        for i, r in enumerate(live):
            r.pos = i
        self._order = list(live)
        return cursor_rec.pos if cursor_rec is not None else -1
